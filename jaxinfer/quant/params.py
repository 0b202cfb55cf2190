"""Round-to-nearest quantization of a whole params pytree (models/llama.py layout).

The seven per-layer linear weights (and a MoE's experts and shared expert)
are quantized with their layer axis (groups never cross layers or experts);
embeddings, norms, biases and a MoE's routers stay float. With include_head
the output projection is quantized too; for tied embeddings that adds a
quantized `lm_head` (embed.T), while the gather keeps the float table.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxinfer.quant.fused_columns import FusedColumns
from jaxinfer.quant.kquant import SUPER_BLOCK, KQuantTensor
from jaxinfer.quant.layer_weights import PerLayer
from jaxinfer.quant.mixed_stack import MixedStack
from jaxinfer.quant.schemes import activation_block, quantize
from jaxinfer.quant.tensor import SCHEMES, QuantizedTensor

LINEAR_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# A MoE's linear weights (models/moe.py): the experts, stacked [experts, in,
# out] per layer, and the shared expert. Its router and the shared expert's
# sigmoid gate stay float: they are small, and they choose the experts.
ROUTED_KEYS = ("expert_gate", "expert_up", "expert_down")
MOE_LINEAR_KEYS = (*ROUTED_KEYS, "shared_w_gate", "shared_w_up", "shared_w_down")
QUANTIZED_KEYS = LINEAR_KEYS + MOE_LINEAR_KEYS
# Schemes whose load-time quantization (loading/params.py) covers the head too,
# and for tied embeddings replaces the float table (models/llama.py's
# embed_tokens reads the head's columns). w8a8 never multiplies a float weight,
# so a float head would be the largest read of its step; the weight-only
# schemes leave the head float, because XLA:CPU casts a quantized weight to
# float whole before a dot outside the layer scan (a one-row int8 head of the
# default model: ~48 ms against ~3 ms in float32, measured 2026-11-24).
HEAD_SCHEMES = ("w8a8",)
INT4_GROUP = 128


def default_group_size(scheme: str, in_features: int) -> int | None:
    """int4: 128 rows per group, or the largest power of two dividing both 128
    and `in` (64 for SmolLM2's 576-wide hidden); int8 / fp8: per channel."""
    return math.gcd(in_features, INT4_GROUP) if scheme == "int4" else None


def quantize_weight(w, scheme: str, group_size: int | None = None, name: str = "weight") -> QuantizedTensor:
    """One float [..., in, out] weight -> QuantizedTensor (float32 statistics)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {SCHEMES}")
    if isinstance(w, QuantizedTensor):
        raise ValueError(f"{name} is already quantized ({w.scheme}, group {w.group_size})")
    group_size = group_size or default_group_size(scheme, w.shape[-2])
    try:
        return quantize(w, scheme, group_size)
    except ValueError as e:
        raise ValueError(f"cannot quantize {name} {tuple(w.shape)} as {scheme}: {e}") from None


def quantize_params(params: dict, scheme: str, group_size: int | None = None, include_head: bool = False) -> dict:
    """-> a new params dict with the linear weights quantized (the input is not modified;
    layer weights stored one array per layer, a GPU backend's layout, stay so).

    group_size: rows per scale (int8: default per channel; int4: default 128,
    see default_group_size; fp8 is always per channel)."""
    if scheme == "fp8" and group_size is not None:
        raise ValueError("fp8 is per output channel only; leave group_size unset")
    out = dict(params)
    layers = dict(params["layers"])
    for key in (k for k in layers if k in QUANTIZED_KEYS or _is_fused(layers[k])):
        w, name = layers[key], f"layers/{key}"
        layers[key] = (PerLayer(_quantize_layer(x, scheme, group_size, name) for x in w) if isinstance(w, PerLayer)
                       else quantize_weight(w, scheme, group_size, name))
    out["layers"] = layers
    if include_head:
        head = params["lm_head"] if "lm_head" in params else params["embed"].T
        out["lm_head"] = quantize_weight(head, scheme, group_size, name="lm_head")
    return out


def _is_fused(w) -> bool:
    return isinstance(w, PerLayer) and len(w) > 0 and isinstance(w[0], FusedColumns)


def _quantize_layer(w, scheme: str, group_size: int | None, name: str):
    """One layer's weight; a fused group quantized whole: its groups run along
    `in`, so its columns get the scales each weight would get alone."""
    if isinstance(w, FusedColumns):
        return dataclasses.replace(w, weight=quantize_weight(w.weight, scheme, group_size, name))
    return quantize_weight(w, scheme, group_size, name)


def with_int8_activations(params: dict) -> dict:
    """-> params whose quantized linear weights (the layers' and a quantized
    head) multiply activations quantized to int8 blocks (quant/tensor.py,
    activation_block; the block follows each weight's groups). Their scales
    and offsets become float16 where that is exact (a GGUF's Q4_0 / Q4_1 /
    Q8_0 d and m are float16 in the file): the int8-activation kernel reads
    them with the codes, and for int4 groups of 32 float32 ones are half as
    many bytes again as the codes. K-quant weights multiply activations in
    int8 blocks of a whole super-block (256 inputs), as llama.cpp multiplies
    them: their integer sub-scales then apply in integers
    (native/q8_matmul.cc)."""
    def mark(w, narrow=True):
        if isinstance(w, MixedStack):
            return w.replace_parts(mark)
        if isinstance(w, KQuantTensor):  # one activation scale per super-block, as llama.cpp's Q8_K
            return dataclasses.replace(w, activation_block=SUPER_BLOCK)
        if not isinstance(w, QuantizedTensor) or w.scheme not in ("int8", "int4"):
            return w
        parts = [w.scales] + ([] if w.offsets is None else [w.offsets])
        if narrow and all(bool(jnp.array_equal(p.astype(jnp.float16).astype(p.dtype), p)) for p in parts):
            w = dataclasses.replace(w, scales=w.scales.astype(jnp.float16),
                                    offsets=None if w.offsets is None else w.offsets.astype(jnp.float16))
        return dataclasses.replace(w, activation_block=activation_block(w.group_size))

    out = dict(params)
    # A MoE's experts keep float32 scales: their kernel (the exact one, on
    # activations rounded first, backends/cpu.py) reads float32.
    out["layers"] = {key: mark(w, narrow=key not in ROUTED_KEYS) if key in QUANTIZED_KEYS else w
                     for key, w in params["layers"].items()}
    if "lm_head" in out:
        out["lm_head"] = mark(out["lm_head"])
    return out


def params_nbytes(params) -> int:
    """Total bytes of a params pytree; a QuantizedTensor counts its data, scales and offsets."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(params))
