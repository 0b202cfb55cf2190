"""N-gram (prompt lookup) proposer: match the sequence's last n tokens earlier
in the sequence and propose the tokens that followed that match.

The longest n in [min_n, max_n] with a match wins; among matches of that n,
the most recent one (what the text just repeated is the best guess of what it
repeats next). Host-side and model-free: the cost is a scan over the token
list, done with numpy on the sequence's tokens each step. `NgramProposer` is
the engine's interface to it (see engine/spec/proposer.py).
"""

from __future__ import annotations

import numpy as np

from jaxinfer.engine.spec.proposer import Proposer


def propose_ngram(token_ids, num_tokens: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to num_tokens draft tokens (possibly none) for the sequence token_ids."""
    tokens = np.asarray(token_ids, np.int64)
    length = len(tokens)
    if num_tokens < 1 or length < 2:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows of n tokens starting at 0..length-n-1 (the suffix itself excluded).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            start = matches[-1] + n  # the token after the most recent earlier match
            return tokens[start : start + num_tokens].tolist()
    return []


class NgramProposer(Proposer):
    """Prompt lookup for the engine: stateless, no device work, no programs."""

    def __init__(self, engine_config, spec):
        super().__init__(spec.num_speculative_tokens, engine_config.max_model_len, spec.disable_by_batch_size,
                         spec.adaptive)
        self.max_n, self.min_n = spec.max_n, spec.min_n

    def propose(self, seqs, caps: list[int]) -> list[list[int]]:
        return [propose_ngram(seq.token_ids(), cap, self.max_n, self.min_n) for seq, cap in zip(seqs, caps)]
