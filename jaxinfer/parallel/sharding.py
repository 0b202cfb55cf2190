"""Partition specs: how each parameter of models/llama.py's layout and the
paged KV pool are split over the mesh's "model" axis (tensor parallelism).

Megatron-style, so that each transformer layer needs exactly two
all-reduces (after wo and after w_down), which GSPMD inserts:

  column-parallel (output features split)   wq wk wv w_gate w_up, bq bk bv
      each device computes its own heads / its slice of the MLP hidden,
      with no communication, from the replicated residual stream
  row-parallel (input features split)       wo w_down
      each device multiplies its heads / hidden slice; the partial sums
      are all-reduced into the replicated residual stream
  vocab-parallel                            embed [vocab, hidden] on vocab,
      lm_head [hidden, vocab] on vocab: the lookup is a masked local
      gather plus one all-reduce, the logits come out split on vocab
      (hidden instead, when the vocabulary does not divide)
  replicated (declared)                     the norms (a few KB each), a
      MoE's router and shared-expert gate (the routing, computed whole on
      every device)

A MoE's experts [L, experts, in, out] (models/moe.py): split whole over
the devices, each device holding num_experts / N of them (expert
parallelism, vLLM's enable_expert_parallel over the same devices as the
attention's TP), when N divides the experts; otherwise each expert is split
like a dense MLP (expert_gate / expert_up on their hidden columns,
expert_down on its hidden rows). Either way the rows routed to another
device's experts contribute zeros there, and the one all-reduce after the
down projection sums every expert's share, as after a dense w_down. The
shared expert is split like a dense MLP.

Quantized weights (quant/tensor.py) split their data like the logical
weight; scales and offsets [.., in / group, out] follow the output split,
and follow an input split only where every shard holds whole groups;
otherwise (per-channel scales of a row-parallel weight: one group) they
are replicated, declared so, and multiply the all-reduced output.
An act-order weight (quant/input_order.py) splits its permuted rows so,
its order replicated: the activations are gathered by the order before
the split (of a row-parallel weight, GSPMD all-gathers them first).

KV heads (the rule): with num_kv_heads >= N the KV heads are split over the
N devices and num_kv_heads must be a multiple of N. With num_kv_heads < N,
N must be a multiple of num_kv_heads and each KV head is replicated on
N / num_kv_heads consecutive devices, the ones whose query heads read it
(vLLM's rule): wk / wv / bk / bv are loaded with every KV head repeated
N / num_kv_heads times, the model then runs with num_kv_heads = N
(sharded_config), one KV head per device. Query head h still reads
original KV head h // (heads / num_kv_heads), so the output is unchanged;
the cost is N / num_kv_heads times the KV cache and K/V projection of an
ideal split, which is what a device needs anyway to attend locally.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.parallel.mesh import CONTEXT_AXIS, MODEL_AXIS
from jaxinfer.quant.input_order import InputOrdered
from jaxinfer.quant.tensor import QuantizedTensor

M = MODEL_AXIS
COLUMN_PARALLEL = ("wq", "wk", "wv", "w_gate", "w_up", "shared_w_gate", "shared_w_up")
ROW_PARALLEL = ("wo", "w_down", "shared_w_down")
HEAD_BIASES = ("bq", "bk", "bv")
REPLICATED = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm", "router", "shared_expert_gate")
EXPERTS_COLUMN = ("expert_gate", "expert_up")
EXPERTS_ROW = ("expert_down",)
KV_KEYS = ("layers/wk", "layers/wv", "layers/bk", "layers/bv")


# ---------------------------------------------------------------------------------------------
# the KV-head rule


def kv_head_replication(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """How many devices hold each KV head (1: the KV heads are split)."""
    n = tensor_parallel_size
    if num_kv_heads % n == 0:
        return 1
    if n % num_kv_heads == 0:
        return n // num_kv_heads
    raise ValueError(f"tensor_parallel_size {n} must divide num_kv_heads ({num_kv_heads}) or be a multiple of it")


def check_divisible(config: ModelConfig, tensor_parallel_size: int) -> None:
    n = tensor_parallel_size
    if config.num_heads % n:
        raise ValueError(f"tensor_parallel_size {n} must divide the number of attention heads ({config.num_heads})")
    if config.has_dense_mlp and config.intermediate_size % n:
        raise ValueError(f"tensor_parallel_size {n} must divide the MLP hidden size ({config.intermediate_size})")
    if config.num_experts and not expert_parallel(config.num_experts, n) and config.moe_intermediate_size % n:
        raise ValueError(f"tensor_parallel_size {n} must divide the number of experts ({config.num_experts}) or "
                         f"each expert's hidden size ({config.moe_intermediate_size})")
    if config.shared_expert_intermediate_size % n:
        raise ValueError(f"tensor_parallel_size {n} must divide the shared expert's hidden size "
                         f"({config.shared_expert_intermediate_size})")
    kv_head_replication(config.num_kv_heads, n)


def expert_parallel(num_experts: int, tensor_parallel_size: int) -> bool:
    """Whether a MoE's experts are split whole over the devices (see the module docstring)."""
    return num_experts % tensor_parallel_size == 0


def sharded_config(config: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The config the sharded model runs with: num_kv_heads raised to N when
    the KV heads are replicated (see the rule above); unchanged otherwise."""
    check_divisible(config, tensor_parallel_size)
    r = kv_head_replication(config.num_kv_heads, tensor_parallel_size)
    return config if r == 1 else dataclasses.replace(config, num_kv_heads=config.num_kv_heads * r)


def expand_kv_heads(x, num_kv_heads: int, replication: int):
    """[..., kv_heads * head_dim] -> [..., kv_heads * replication * head_dim],
    each head's columns repeated `replication` times in place (numpy or jnp)."""
    if replication == 1:
        return x
    xp = jnp if isinstance(x, jax.Array) else __import__("numpy")
    head_dim = x.shape[-1] // num_kv_heads
    heads = x.reshape(*x.shape[:-1], num_kv_heads, 1, head_dim)
    heads = xp.broadcast_to(heads, (*x.shape[:-1], num_kv_heads, replication, head_dim))
    return heads.reshape(*x.shape[:-1], num_kv_heads * replication * head_dim)


def expand_kv_weight(w, num_kv_heads: int, replication: int):
    """expand_kv_heads for a plain array or every part of a QuantizedTensor
    (whose data, scales and offsets all end in the output axis); an
    InputOrdered's order is of its inputs, left as it is."""
    if isinstance(w, InputOrdered):
        return w.with_weight(expand_kv_weight(w.weight, num_kv_heads, replication))
    if isinstance(w, QuantizedTensor):
        parts = [None if p is None else expand_kv_heads(p, num_kv_heads, replication)
                 for p in (w.data, w.scales, w.offsets)]
        return dataclasses.replace(w, data=parts[0], scales=parts[1], offsets=parts[2])
    return expand_kv_heads(w, num_kv_heads, replication)


# ---------------------------------------------------------------------------------------------
# specs of the params


def logical_spec(path: str, shape: tuple, tensor_parallel_size: int) -> P:
    """The spec of a (logical, i.e. dequantized) parameter, path as in
    loading/orbax.py ("embed", "layers/wq", ...), shape with the layer axis."""
    n = tensor_parallel_size
    key = path.split("/")[-1]
    if path == "embed":
        vocab, hidden = shape
        return P(M, None) if vocab % n == 0 else P(None, M) if hidden % n == 0 else P()
    if path == "lm_head":
        hidden, vocab = shape
        return P(None, M) if vocab % n == 0 else P(M, None) if hidden % n == 0 else P()
    if key in COLUMN_PARALLEL:
        spec = P(None, None, M)
    elif key in ROW_PARALLEL:
        spec = P(None, M, None)
    elif key in HEAD_BIASES:
        spec = P(None, M)
    elif key in EXPERTS_COLUMN + EXPERTS_ROW:
        if expert_parallel(shape[1], n):
            spec = P(None, M, None, None)
        else:
            spec = P(None, None, None, M) if key in EXPERTS_COLUMN else P(None, None, M, None)
    elif key in REPLICATED:
        return P()
    else:
        raise KeyError(f"no partition rule for parameter {path}")
    _check_split(path, shape, spec, n)
    return spec


def _check_split(path: str, shape, spec: P, n: int) -> None:
    for size, axis in zip(shape, spec):
        if axis == M and size % n:
            raise ValueError(f"{path} {tuple(shape)}: dimension {size} does not split over {n} devices")


def part_spec(logical: P, part: str, part_shape: tuple, tensor_parallel_size: int) -> P:
    """The spec of a QuantizedTensor part given its weight's logical spec (see
    the module docstring); part_shape is the part's own shape."""
    entries = list(logical) + [None] * (len(part_shape) - len(logical))
    if part != "data" and entries[-2] == M and part_shape[-2] % tensor_parallel_size:
        entries[-2] = None  # groups straddle shards (per-channel scales): replicate
    spec = P(*entries)
    _check_split(part, part_shape, spec, tensor_parallel_size)
    return spec


def _flat(params: dict, prefix: str = ""):
    for key, value in params.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


def param_specs(params: dict, tensor_parallel_size: int) -> dict:
    """The declared PartitionSpec of every leaf of `params` (arrays or
    ShapeDtypeStructs; a QuantizedTensor gets a QuantizedTensor of specs)."""
    n = tensor_parallel_size
    specs: dict = {}
    for path, leaf in _flat(params):
        if isinstance(leaf, InputOrdered):
            spec = InputOrdered(_quantized_specs(path, leaf.weight, n), P(), leaf.order_of)
        elif isinstance(leaf, QuantizedTensor):
            spec = _quantized_specs(path, leaf, n)
        else:
            spec = logical_spec(path, leaf.shape, n)
        node = specs
        *parents, name = path.split("/")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = spec
    return specs


def _quantized_specs(path: str, w: QuantizedTensor, tensor_parallel_size: int) -> QuantizedTensor:
    logical = logical_spec(path, w.shape, tensor_parallel_size)
    parts = [None if p is None else part_spec(logical, name, p.shape, tensor_parallel_size)
             for name, p in (("data", w.data), ("scales", w.scales), ("offsets", w.offsets))]
    return dataclasses.replace(w, data=parts[0], scales=parts[1], offsets=parts[2])


def stored_spec(path: str, shape: tuple, logical_shape: tuple, tensor_parallel_size: int) -> P:
    """Spec of one stored array of a checkpoint ("layers/wq" or "layers/wq/scales")."""
    parts = ("data", "scales", "offsets")
    head, _, last = path.rpartition("/")
    if last in parts and head:
        return part_spec(logical_spec(head, logical_shape, tensor_parallel_size), last, shape, tensor_parallel_size)
    return logical_spec(path, shape, tensor_parallel_size)


def named(specs, mesh):
    """A pytree of PartitionSpecs -> the same tree of NamedShardings on `mesh`."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def is_replicated(spec: P) -> bool:
    return all(axis is None for axis in spec)


# ---------------------------------------------------------------------------------------------
# the KV pool


def kv_cache_specs(quantized: bool, context_parallel: bool = False) -> tuple:
    """(k_pool, v_pool[, k_scales, v_scales]) split on the KV-head axis:
    pools [layers, blocks, block_size, KV, D], scales [layers, blocks, block_size, KV];
    with context_parallel, the block axis is split over "context" too, so each
    device holds a contiguous range of blocks (engine/block_ownership.py)."""
    blocks = CONTEXT_AXIS if context_parallel else None
    pool, scales = P(None, blocks, None, M, None), P(None, blocks, None, M)
    return (pool, pool, scales, scales) if quantized else (pool, pool)
