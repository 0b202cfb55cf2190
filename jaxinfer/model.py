"""`load()` and `Model`: a checkpoint's config, params and tokenizer, plus a
cache-free full-sequence forward for scoring and parity checks."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.loading.checkpoint import open_checkpoint
from jaxinfer.loading.orbax import OrbaxCheckpoint
from jaxinfer.loading.params import QUANTIZATIONS, build_params, resolve_dtype
from jaxinfer.models.attention import full_sequence_attention
from jaxinfer.models.llama import compute_logits, forward
from jaxinfer.quant.params import quantize_params
from jaxinfer.utils import bucket_size, enable_compilation_cache


class Model:
    def __init__(self, config: ModelConfig, params: dict, tokenizer, dtype, source: str = "", load_seconds=0.0):
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.source = source
        self.load_seconds = load_seconds

    def __repr__(self):
        c = self.config
        return (
            f"Model({self.source!r}, {c.architecture}, layers={c.num_layers}, hidden={c.hidden_size}, "
            f"heads={c.num_heads}/{c.num_kv_heads}, vocab={c.vocab_size}, dtype={self.dtype})"
        )

    def logits(self, token_ids) -> np.ndarray:
        """Full-sequence forward without a cache: float32 logits [T, vocab].

        The sequence is padded at the end to a power-of-two bucket so that
        varied lengths share compilations; causal attention keeps padding from
        affecting the real positions.
        """
        token_ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        length = len(token_ids)
        if length == 0:
            raise ValueError("token_ids is empty")
        if token_ids.min() < 0 or token_ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got {token_ids.min()}..{token_ids.max()}")
        padded = np.zeros(bucket_size(length), np.int32)
        padded[:length] = token_ids
        return np.asarray(_full_logits(self.params, self.config, padded[None]))[0, :length]


@functools.partial(jax.jit, static_argnums=1)
def _full_logits(params, config: ModelConfig, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    attention = full_sequence_attention(positions, config.sliding_window)
    hidden, _ = forward(params, config, tokens, positions, attention)
    return compute_logits(params, hidden)


def load(model=None, dtype="float32", progress: bool = True, quantization: str | None = None) -> Model:
    """Load a model: None (the embedded SmolLM2-135M-Instruct), a HF directory
    (config.json + safetensors), a .gguf file, or a jaxinfer checkpoint directory
    (`jaxinfer convert`). dtype: float32 | bfloat16 (of the unquantized weights).

    quantization: None (float weights; GGUF blocks dequantized), "gguf" (keep
    a GGUF file's Q8_0 / Q4_0 / Q4_1 linear weights quantized as int8 / int4
    with 32-row groups, other types dequantized), or "int8" | "int4" | "fp8"
    (round-to-nearest of the float32 linear weights at load time: int8 / fp8
    per output channel, int4 in groups of 128 rows or fewer, see
    quant/params.py; the embedding, head and norms stay float)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
    enable_compilation_cache()
    start = time.perf_counter()
    np_dtype = resolve_dtype(dtype)
    config, source, tokenizer, description = open_checkpoint(model)
    if isinstance(source, OrbaxCheckpoint):  # a jaxinfer checkpoint: restored by orbax onto the device
        if quantization == "gguf":
            raise ValueError(f'quantization="gguf" needs a GGUF checkpoint; {description} is not one')
        params = source.restore(np_dtype, progress=progress)
        if quantization is not None:
            params = quantize_params(params, quantization)
    else:
        params = build_params(config, source, np_dtype, progress=progress, quantization=quantization)
    jax.block_until_ready(params)
    return Model(config, params, tokenizer, np_dtype, description, time.perf_counter() - start)
