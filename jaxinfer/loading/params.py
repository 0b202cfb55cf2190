"""Turn checkpoint tensors (HF names and orientation) into the params pytree.

Every loader exposes a `TensorSource` with HF tensor names: `names()` and
`get(name) -> np.ndarray` in HF orientation ([out, in] for linear weights).
GGUF renames and un-permutes its tensors to fit, so this module is the one
place that knows how checkpoint tensors map onto models/llama.py's layout.
Tensors are read, checked, cast and placed on the device one at a time, so
host memory never holds more than one tensor.

Linear weights may come out as QuantizedTensors (quant/tensor.py), stacked
per layer like arrays: `quantization="gguf"` keeps a GGUF file's Q8_0 / Q4_0 /
Q4_1 blocks (sources offering `get_quantized`), and "int8" | "int4" | "fp8"
quantize each float32 weight as it is read (round to nearest, as
quant/params.py's quantize_params; the head stays float).
"""

from __future__ import annotations

import logging
from typing import Protocol

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.models.llama import param_shapes
from jaxinfer.quant.params import LINEAR_KEYS, quantize_weight
from jaxinfer.quant.tensor import SCHEMES, QuantizedTensor

log = logging.getLogger(__name__)

QUANTIZATIONS = ("gguf", *SCHEMES)

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class TensorSource(Protocol):
    description: str

    def names(self): ...

    def get(self, name: str) -> np.ndarray: ...

    # Optional (GGUF): get_quantized(name) -> QuantizedTensor [in, out] with
    # numpy leaves, or None where the stored type has no direct quantized form.


# Our per-layer parameter -> (HF tensor name inside model.layers.{i}., transpose?)
_LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
_GLOBAL_TENSORS = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def resolve_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return np.dtype(DTYPES[dtype])
    return np.dtype(dtype)


def _check_shape(source: TensorSource, name: str, shape, transpose: bool, expected_shape: tuple) -> None:
    """shape: in params orientation; the message speaks the checkpoint's (HF) orientation."""
    if tuple(shape) != tuple(expected_shape):
        flip = (lambda s: tuple(s)[::-1]) if transpose else tuple
        raise CheckpointError(
            f"tensor {name} in {source.description} has shape {flip(shape)}, but the config implies {flip(expected_shape)}"
        )


def _read(source: TensorSource, name: str, transpose: bool, expected_shape: tuple, dtype) -> jax.Array:
    if name not in source.names():
        raise CheckpointError(f"{source.description} lacks tensor {name}")
    array = source.get(name)
    _check_shape(source, name, array.shape[::-1] if transpose else array.shape, transpose, expected_shape)
    if transpose:
        array = array.T
    return jax.device_put(np.ascontiguousarray(array, dtype=dtype))


def _read_direct(source: TensorSource, name: str, expected_shape: tuple) -> QuantizedTensor | None:
    """The checkpoint's own quantized form of a linear weight, on the device, or None."""
    if name not in source.names():
        raise CheckpointError(f"{source.description} lacks tensor {name}")
    q = source.get_quantized(name)
    if q is None:
        return None
    _check_shape(source, name, q.shape, True, expected_shape)
    return jax.device_put(q)


def _read_quantized(source, name: str, expected_shape: tuple, quantization: str) -> QuantizedTensor | None:
    """A linear weight [in, out] quantized per `quantization` (None from "gguf"
    when the stored type has no direct form). RTN starts from float32, not
    from the requested dtype, so bfloat16 loads do not round twice."""
    if quantization == "gguf":
        return _read_direct(source, name, expected_shape)
    return quantize_weight(_read(source, name, True, expected_shape, np.float32), quantization, name=name)


def _stack(per_layer: list):
    return jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *per_layer)


def _kind(w: QuantizedTensor):
    return w.scheme, w.group_size, w.offsets is None


def build_params(
    config: ModelConfig, source: TensorSource, dtype="float32", progress: bool = True, quantization: str | None = None
) -> dict:
    """quantization: None | "gguf" | "int8" | "int4" | "fp8" (see the module docstring)."""
    dtype = resolve_dtype(dtype)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization == "gguf" and not hasattr(source, "get_quantized"):
        raise ValueError(f'quantization="gguf" needs a GGUF checkpoint; {source.description} is not one')
    shapes = param_shapes(config)
    total = len(shapes["layers"]) * config.num_layers + len(shapes) - 1
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    params = {}
    for key, shape in shapes.items():
        if key == "layers":
            continue
        name, transpose = _GLOBAL_TENSORS[key]
        # Load-time RTN leaves the head float (quantize_params' include_head
        # default); a GGUF head stored quantized stays as stored.
        head = _read_direct(source, name, shape) if key == "lm_head" and quantization == "gguf" else None
        params[key] = head if head is not None else _read(source, name, transpose, shape, dtype)
        bar.update()
    layers = {}
    for key, shape in shapes["layers"].items():
        suffix, transpose = _LAYER_TENSORS[key]
        names = [f"model.layers.{i}.{suffix}" for i in range(config.num_layers)]
        per_layer = None
        if key in LINEAR_KEYS and quantization is not None:
            per_layer = [_read_quantized(source, name, shape[1:], quantization) for name in names]
            kinds = {None if w is None else _kind(w) for w in per_layer}
            if len(kinds) != 1 or None in kinds:
                # Layers stored in different block types cannot share one stacked
                # QuantizedTensor; this weight goes float for all layers.
                if kinds != {None}:
                    log.warning("%s: layers mix GGUF types; loading %s dequantized", source.description, key)
                per_layer = None
        if per_layer is None:
            per_layer = [_read(source, name, transpose, shape[1:], dtype) for name in names]
        bar.update(config.num_layers)
        layers[key] = _stack(per_layer)
        del per_layer  # free the unstacked copies before the next weight
    params["layers"] = layers
    bar.close()
    return params
