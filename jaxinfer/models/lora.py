"""The LoRA term of an adapted linear for a batch whose rows use different
adapters: y += (x A[slot]) B[slot] per row, from the slot buffers of
lora/slots.py (A [in, S, r], B [S, r, out] for one layer; a row's slot 0
means no adapter, slot s its buffer index s - 1; scales are folded into B).

Two forms, picked per compiled shape by the number of rows (static):

  gather   A[slot] and B[slot] per row, then per-row contractions: reads
           one adapter's r columns per row, so at a few rows it moves the
           least memory, but it copies in * r + r * out values per row.
  one-hot  x @ A as one matmul over every slot ([rows, S * r]), the columns
           of other slots zeroed by the row's one-hot mask, then @ B as one
           matmul ([S * r, out]) (BGMV written as two dense GEMMs): it reads
           every slot's buffers once whatever the row count and does S times
           the minimal flops, which dense GEMMs hide well at many rows.

GATHER_MAX_ROWS is where the one-hot form wins on the 2-core CPU; measured
in BENCHMARKS.md (LoRA).
"""

from __future__ import annotations

import jax.numpy as jnp

GATHER_MAX_ROWS = 4


def lora_delta(x, a, b, token_slots):
    """x [..., in], a [in, S, r], b [S, r, out], token_slots int32 [...] -> [..., out] in x.dtype."""
    fan_in, num_slots, rank = a.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, fan_in)
    slots = token_slots.reshape(-1)
    if rows.shape[0] <= GATHER_MAX_ROWS:
        index = jnp.maximum(slots - 1, 0)
        xa = jnp.einsum("ni,inr->nr", rows, jnp.take(a, index, axis=1))
        xa = xa * (slots > 0)[:, None].astype(xa.dtype)
        y = jnp.einsum("nr,nro->no", xa, jnp.take(b, index, axis=0))
    else:
        mask = (slots[:, None] - 1 == jnp.arange(num_slots)[None, :]).astype(rows.dtype)
        xa = (rows @ a.reshape(fan_in, num_slots * rank)).reshape(-1, num_slots, rank) * mask[:, :, None]
        y = xa.reshape(-1, num_slots * rank) @ b.reshape(num_slots * rank, -1)
    return y.astype(x.dtype).reshape(*lead, -1)
