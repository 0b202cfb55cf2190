"""The n-gram proposer against a brute-force search written independently."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.engine.spec.ngram import propose_ngram


def brute_force(tokens, k, max_n, min_n):
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), k=st.integers(0, 5), max_n=st.integers(1, 5),
       min_n=st.integers(1, 3))
def test_matches_brute_force(tokens, k, max_n, min_n):
    min_n = min(min_n, max_n)
    expected = brute_force(tokens, k, max_n, min_n) if k > 0 else []
    assert propose_ngram(tokens, k, max_n, min_n) == expected


def test_repetitive_text_is_continued():
    phrase = [5, 6, 7, 8, 9]
    tokens = phrase * 3 + phrase[:2]
    assert propose_ngram(tokens, 4, max_n=3) == [7, 8, 9, 5]
    assert propose_ngram(list(np.arange(10)), 3) == []  # nothing repeats: no proposal
