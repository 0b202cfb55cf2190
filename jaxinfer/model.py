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
from jaxinfer.loading.params import build_params, resolve_dtype
from jaxinfer.models.attention import full_sequence_attention
from jaxinfer.models.llama import compute_logits, forward
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


def load(model=None, dtype="float32", progress: bool = True) -> Model:
    """Load a model: None (the embedded SmolLM2-135M-Instruct), a HF directory
    (config.json + safetensors), or a .gguf file. dtype: float32 | bfloat16."""
    enable_compilation_cache()
    start = time.perf_counter()
    np_dtype = resolve_dtype(dtype)
    config, source, tokenizer, description = open_checkpoint(model)
    params = build_params(config, source, np_dtype, progress=progress)
    jax.block_until_ready(params)
    return Model(config, params, tokenizer, np_dtype, description, time.perf_counter() - start)
