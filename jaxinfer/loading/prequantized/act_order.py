"""Act-order groups (GPTQ desc_act, compressed-tensors actorder "group"):
`g_idx` int32 [in] gives each input row's group, and a group's rows are
not consecutive (GPTQ quantized the rows in the order of its Hessian's
diagonal and stored them back in the model's order). Sorting the rows by
group (a stable argsort, `order`) makes every group group_size consecutive
rows, an ordinary grouped weight over permuted rows, multiplied by the
activations gathered by the same order (quant/input_order.py).

The permutation is applied here, once at load."""

from __future__ import annotations

import numpy as np

from jaxinfer.errors import CheckpointError


def group_order(g_idx: np.ndarray, rows: int, group_size: int, name: str) -> np.ndarray:
    """int32 [rows]: the rows sorted by group; CheckpointError naming `name`
    unless group k is then rows k * group_size .. (k + 1) * group_size - 1
    for every k."""
    g_idx = np.asarray(g_idx).astype(np.int64)
    if g_idx.shape != (rows,):
        raise CheckpointError(f"{name}: shape {g_idx.shape} for a weight of {rows} input rows")
    order = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[order], np.arange(g_idx.size) // group_size):
        groups, rows = np.unique(g_idx, return_counts=True)
        raise CheckpointError(f"{name}: act-order groups must be groups 0 .. {-(-g_idx.size // group_size) - 1} "
                              f"of {group_size} rows each; g_idx holds groups {groups[:8].tolist()} "
                              f"of {rows[:8].tolist()} rows{' ...' if groups.size > 8 else ''}")
    return order.astype(np.int32)


def is_trivial(g_idx: np.ndarray, group_size: int) -> bool:
    """Whether the groups are already consecutive rows (no act order)."""
    g_idx = np.asarray(g_idx)
    return np.array_equal(g_idx, np.arange(g_idx.size) // group_size)


def order_label(prefix: str, g_idx_suffix: str, g_idx: np.ndarray, get, names) -> str:
    """The label of this linear's order (InputOrdered.order_of): the first,
    by name, of the linears beside it in its module (q/k/v/o_proj of one
    attention) whose stored g_idx equals its own. Linears on the same input
    quantized by one Hessian store equal ones and so get one label."""
    parent = prefix.rpartition(".")[0]
    tail = "." + g_idx_suffix
    siblings = sorted(n[:-len(tail)] for n in names if n.endswith(tail) and n[:-len(tail)].rpartition(".")[0] == parent)
    for sibling in siblings:
        if sibling == prefix or np.array_equal(np.asarray(get(sibling + tail)), g_idx):
            return sibling.rpartition(".")[2]
    return prefix.rpartition(".")[2]
