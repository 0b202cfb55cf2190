"""Turn checkpoint tensors (HF names and orientation) into the params pytree.

Every loader exposes a `TensorSource` with HF tensor names: `names()` and
`get(name) -> np.ndarray` in HF orientation ([out, in] for linear weights).
GGUF renames and un-permutes its tensors to fit, so this module is the one
place that knows how checkpoint tensors map onto models/llama.py's layout.
Tensors are read, checked, cast and placed on the device one at a time, so
host memory never holds more than one tensor.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.models.llama import param_shapes

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class TensorSource(Protocol):
    description: str

    def names(self): ...

    def get(self, name: str) -> np.ndarray: ...


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


def _read(source: TensorSource, name: str, transpose: bool, expected_shape: tuple, dtype) -> jax.Array:
    if name not in source.names():
        raise CheckpointError(f"{source.description} lacks tensor {name}")
    array = source.get(name)
    shape = array.shape[::-1] if transpose else array.shape
    if tuple(shape) != tuple(expected_shape):
        hf_expected = tuple(expected_shape)[::-1] if transpose else tuple(expected_shape)
        raise CheckpointError(
            f"tensor {name} in {source.description} has shape {tuple(array.shape)}, "
            f"but the config implies {hf_expected}"
        )
    if transpose:
        array = array.T
    return jax.device_put(np.ascontiguousarray(array, dtype=dtype))


def build_params(config: ModelConfig, source: TensorSource, dtype="float32", progress: bool = True) -> dict:
    dtype = resolve_dtype(dtype)
    shapes = param_shapes(config)
    total = len(shapes["layers"]) * config.num_layers + len(shapes) - 1
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    params = {}
    for key, shape in shapes.items():
        if key == "layers":
            continue
        name, transpose = _GLOBAL_TENSORS[key]
        params[key] = _read(source, name, transpose, shape, dtype)
        bar.update()
    layers = {}
    for key, shape in shapes["layers"].items():
        suffix, transpose = _LAYER_TENSORS[key]
        per_layer = []
        for i in range(config.num_layers):
            per_layer.append(_read(source, f"model.layers.{i}.{suffix}", transpose, shape[1:], dtype))
            bar.update()
        layers[key] = jnp.stack(per_layer)
        del per_layer  # free the unstacked copies before the next weight
    params["layers"] = layers
    bar.close()
    return params
