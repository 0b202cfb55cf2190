"""Host arrays of one step, padded to its bucket: the one place that turns
sequences' tokens and block tables into token rows, positions and KV slots.

Sequence i computes num_new[i] tokens starting at position num_computed[i].
In the "decode" and "mixed" layouts its rows are packed one after another;
in the "verify" layout every sequence owns exactly `rows_per_seq` = 1 + K
rows (its last token, then its drafts) and one with fewer drafts pads the
rest. Padding rows write their K/V to the null block (slot 0). A padded
verify row still counts in the sequence's context length, so that row j of a
sequence sits at position context_len - rows_per_seq + j, as the verify
attention expects (bottom-right causal), and no real row ever attends to it
(it comes after them). Padding sequences own no rows and have context 0.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxinfer.models.paged_attention import PagedAttentionMetadata


class StepInputs(NamedTuple):
    tokens: np.ndarray  # i32 [T]
    attn_meta: PagedAttentionMetadata
    logits_indices: np.ndarray  # i32: the rows that get logits ([S]; every row [T] when verifying)
    layout: str  # "decode" | "mixed" | "verify" (engine/programs.py)
    # i32 [T]: each row's LoRA adapter slot (0: none; padding rows 0), or
    # None when the engine serves no adapters (the programs then take none).
    lora_slots: np.ndarray | None = None


def build_inputs(step_token_ids: list[list[int]], num_computed: list[int], num_new: list[int],
                 block_tables: list, *, num_tokens: int, num_seqs: int, layout: str,
                 block_size: int, max_blocks_per_seq: int, seq_lora_slots: list[int] | None = None) -> StepInputs:
    """step_token_ids[i]: the num_new[i] tokens sequence i computes (drafts
    included), not its whole context: the host builds them every step.
    block_tables[i]: its block ids (an int32 array or a list).
    seq_lora_slots: sequence i's adapter slot (lora/slots.py), or None without LoRA."""
    rows_per_seq = num_tokens // num_seqs if layout == "verify" else None
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.zeros(num_tokens, np.int32)  # padding writes into the null block
    token_seq = np.zeros(num_tokens, np.int32)
    tables = np.zeros((num_seqs, max_blocks_per_seq), np.int32)
    context_lens = np.zeros(num_seqs, np.int32)
    last_rows = np.zeros(num_seqs, np.int32)
    query_start = np.zeros(num_seqs + 1, np.int32)
    lora_slots = None if seq_lora_slots is None else np.zeros(num_tokens, np.int32)
    start = 0
    for i, (ids, first, new, table) in enumerate(zip(step_token_ids, num_computed, num_new, block_tables)):
        rows = rows_per_seq or new
        table = np.asarray(table, np.int32)
        pos = np.arange(first, first + rows, dtype=np.int32)
        real = pos[:new]
        tokens[start: start + new] = ids
        positions[start: start + rows] = pos
        slots[start: start + new] = table[real // block_size] * block_size + real % block_size
        token_seq[start: start + rows] = i
        tables[i, : len(table)] = table
        context_lens[i] = first + rows
        last_rows[i] = start + new - 1
        if lora_slots is not None:
            lora_slots[start: start + rows] = seq_lora_slots[i]
        start += rows
        query_start[i + 1] = start
    query_start[len(step_token_ids) + 1:] = start  # padding sequences own no rows
    meta = PagedAttentionMetadata(slots, positions, token_seq, tables, context_lens, query_start)
    logits_indices = np.arange(num_tokens, dtype=np.int32) if rows_per_seq else last_rows
    return StepInputs(tokens, meta, logits_indices, layout, lora_slots)
