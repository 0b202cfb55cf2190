"""The LoRA term of an adapted linear for a batch whose rows use different
adapters: y += (x A[slot]) B[slot] per row, from the slot buffers of
lora/slots.py (A [in, S, r], B [S, r, out] for one layer; a row's slot 0
means no adapter, slot s its buffer index s - 1; scales are folded into B).

Three forms; the engine picks gather or one-hot per compiled shape by the
number of rows (static):

  gather   A[slot] and B[slot] per row, then per-row contractions: reads
           one adapter's r columns per row, so at a few rows it moves the
           least memory, but it copies in * r + r * out values per row.
  one-hot  x @ A as one matmul over every slot ([rows, S * r]), the columns
           of other slots zeroed by the row's one-hot mask, then @ B as one
           matmul ([S * r, out]) (BGMV written as two dense GEMMs): it reads
           every slot's buffers once whatever the row count and does S times
           the minimal flops, which dense GEMMs hide well at many rows.

  ragged   rows sorted by slot, then jax.lax.ragged_dot over the groups
           (slot 0's rows against a zero group): the grouped-GEMM form GPUs
           serve well; kept for measuring (scripts/bench_lora.py --forms).

GATHER_MAX_ROWS is where the one-hot form starts to win on the 2-core CPU
(LoRA term alone, 4 distinct adapters, rank 16: gather is faster at 1 and 2
rows, one-hot from 4 rows on; ragged never wins there); measured in
BENCHMARKS.md (LoRA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GATHER_MAX_ROWS = 2


def choose_form(num_rows: int) -> str:
    """The form for a compiled shape of num_rows rows (a static shape, so
    one bucket always runs one form)."""
    return "gather" if num_rows <= GATHER_MAX_ROWS else "one-hot"


def lora_delta(x, a, b, token_slots):
    """x [..., in], a [in, S, r], b [S, r, out], token_slots int32 [...] -> [..., out] in x.dtype."""
    fan_in = a.shape[0]
    lead = x.shape[:-1]
    rows = x.reshape(-1, fan_in)
    slots = token_slots.reshape(-1)
    y = _FORMS[choose_form(rows.shape[0])](rows, a, b, slots)
    return y.astype(x.dtype).reshape(*lead, -1)


def _gather(rows, a, b, slots):
    index = jnp.maximum(slots - 1, 0)
    xa = jnp.einsum("ni,inr->nr", rows, jnp.take(a, index, axis=1))
    xa = xa * (slots > 0)[:, None].astype(xa.dtype)
    return jnp.einsum("nr,nro->no", xa, jnp.take(b, index, axis=0))


def _one_hot(rows, a, b, slots):
    fan_in, num_slots, rank = a.shape
    mask = (slots[:, None] - 1 == jnp.arange(num_slots)[None, :]).astype(rows.dtype)
    xa = (rows @ a.reshape(fan_in, num_slots * rank)).reshape(-1, num_slots, rank) * mask[:, :, None]
    return xa.reshape(-1, num_slots * rank) @ b.reshape(num_slots * rank, -1)


def _ragged(rows, a, b, slots):
    fan_in, num_slots, rank = a.shape
    order = jnp.argsort(slots)
    group_sizes = jnp.bincount(slots, length=num_slots + 1).astype(jnp.int32)
    a_groups = jnp.concatenate([jnp.zeros((1, fan_in, rank), a.dtype), jnp.moveaxis(a, 1, 0)])
    b_groups = jnp.concatenate([jnp.zeros((1, rank, b.shape[-1]), b.dtype), b])
    xa = jax.lax.ragged_dot(rows[order], a_groups, group_sizes)
    y_sorted = jax.lax.ragged_dot(xa, b_groups, group_sizes)
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted)


_FORMS = {"gather": _gather, "one-hot": _one_hot, "ragged": _ragged}
