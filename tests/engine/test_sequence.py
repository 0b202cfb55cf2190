"""A step reads a sequence's tokens without copying its context: the slices
it takes (Sequence.token_ids_between, SequenceTokens) against plain list
slicing of token_ids() + draft_token_ids, and the block manager's int32 table
against its list."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.sequence import PLACEHOLDER, Sequence
from jaxinfer.outputs import CompletionOutput, RequestMetrics
from jaxinfer.sampling_params import SamplingParams


def _sequence(prompt, output, pending, drafts) -> Sequence:
    return Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=list(prompt), params=SamplingParams(),
                    seed=0, arrival_order=0, metrics=RequestMetrics(arrival_time=0.0),
                    output=CompletionOutput(index=0, text="", token_ids=list(output)),
                    num_pending=pending, draft_token_ids=list(drafts))


@pytest.mark.parametrize("pending,drafts", [(0, []), (1, []), (0, [70, 71, 72]), (1, [80])])
def test_token_ids_between_is_a_slice_of_the_whole(pending, drafts):
    seq = _sequence(range(10, 15), [50, 51, 52], pending, drafts)
    whole = list(range(10, 15)) + [50, 51, 52] + [PLACEHOLDER] * pending + drafts
    assert seq.token_ids() + seq.draft_token_ids == whole
    for start, end in itertools.product(range(len(whole) + 2), repeat=2):
        assert seq.token_ids_between(start, end) == whole[start:end], (start, end)


def test_sequence_tokens_reads_token_ids_in_place():
    seq = _sequence(range(100, 137), [7, 8], 1, [9, 9])  # drafts are not among token_ids()
    whole, view = seq.token_ids(), seq.tokens
    assert len(view) == len(whole) == seq.num_tokens
    for start, end in itertools.product(range(-3, len(whole) + 3), repeat=2):
        assert view[start:end] == whole[start:end], (start, end)
    assert view[::2] == whole[::2]
    assert [view[i] for i in range(-len(whole), len(whole))] == [whole[i] for i in range(-len(whole), len(whole))]
    with pytest.raises(IndexError):
        view[len(whole)]
    seq.output.token_ids.append(5)  # a view, not a copy: it sees the sequence grow
    assert len(view) == len(whole) + 1 and list(view) == seq.token_ids()


def test_block_table_array_is_the_table_through_growth_and_trims():
    bm = BlockManager(64, 4)
    bm.allocate_prefix("a", list(range(12)))
    for tokens in (1, 9, 30, 17, 40, 3, 0, 22):
        if tokens > len(bm.block_table("a")) * 4:
            assert bm.allocate("a", tokens)
        else:
            bm.trim("a", tokens)
        array = bm.block_table_array("a")
        assert array.dtype == np.int32 and array.tolist() == bm.block_table("a")
    assert bm.block_table_array("nobody").shape == (0,)
    before = bm.block_table_array("a")
    bm.trim("a", 0)  # a copy: the step's inputs keep what they were given
    assert before.tolist() != bm.block_table("a") and len(before) == 6
