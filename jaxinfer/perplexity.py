"""Token-level perplexity of a text with a sliding window (Hugging Face's perplexity guide).

Windows of `context_len` tokens start every `stride` tokens; each window is a fresh sequence and
scores only the tokens the previous window did not (the first window from its second token on),
so every token past the first is scored exactly once, with up to context_len - stride tokens of
context. The window runs through the paged KV cache in chunks, as the engine's chunked prefill
does, so that the KV-cache storage (`kv_cache_dtype` "auto" | "int8" | "fp8") is what is measured
along with the weights.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.config import ModelConfig
from jaxinfer.models.llama import forward
from jaxinfer.models.paged_attention import PagedAttentionMetadata

DEFAULT_CONTEXT_LEN = 1024
DEFAULT_CHUNK_SIZE = 256
DEFAULT_BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per scored token
    num_tokens_scored: int
    num_tokens: int
    num_windows: int
    context_len: int
    stride: int
    kv_cache_dtype: str


def window_spans(num_tokens: int, context_len: int, stride: int) -> list[tuple[int, int, int]]:
    """[(begin, end, first_scored)]: window tokens[begin:end] scores the tokens at positions
    first_scored..end-1 (absolute), each predicted from the window's tokens before it."""
    spans, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context_len, num_tokens)
        first = max(prev_end, begin + 1)  # a window's first token has no context to be scored from
        if first < end:
            spans.append((begin, end, first))
        prev_end = end
        if end == num_tokens:
            break
    return spans


def _allocate_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype, kv_cache_dtype: str, backend):
    from jaxinfer.models.kv_cache import allocate_kv_cache

    return allocate_kv_cache(config, num_blocks, block_size, dtype, kv_cache_dtype, fp8_dtype=backend.kv_fp8_dtype,
                             zeros=backend.zeros)


@functools.partial(jax.jit, static_argnames=("config", "backend"), donate_argnames=("kv_cache",))
def _score_chunk(params, kv_cache, tokens, targets, meta, *, config: ModelConfig, backend):
    """Log-probability of targets[i] after tokens up to tokens[i] (the cache holding the rest)."""
    attention = backend.paged_attention(meta, config.sliding_window, False, None)
    hidden, kv_cache = forward(params, config, tokens[None], meta.positions[None], attention, kv_cache,
                               backend=backend)
    logprobs = jax.nn.log_softmax(backend.logits(params, hidden[0]), axis=-1)
    return jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0], kv_cache


def perplexity(model, token_ids, context_len: int | None = None, stride: int | None = None,
               kv_cache_dtype: str = "auto", chunk_size: int = DEFAULT_CHUNK_SIZE,
               block_size: int = DEFAULT_BLOCK_SIZE, attention: str | None = None,
               progress: bool = False) -> PerplexityResult:
    """Perplexity of `token_ids` under `model` (a loaded `Model`).

    context_len: tokens per window (default min(max_position_embeddings, 1024)); stride: default
    context_len // 2. chunk_size: tokens per forward call through the paged cache.
    """
    config = model.config
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    if len(ids) < 2:
        raise ValueError(f"need at least 2 tokens to score, got {len(ids)}")
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(f"token ids must lie in [0, {config.vocab_size}), got {ids.min()}..{ids.max()}")
    context_len = context_len or min(config.max_position_embeddings, DEFAULT_CONTEXT_LEN)
    if not 2 <= context_len <= config.max_position_embeddings:
        raise ValueError(f"context_len must lie in [2, {config.max_position_embeddings}] "
                         f"(the model's max_position_embeddings), got {context_len}")
    stride = stride or max(1, context_len // 2)
    if not 1 <= stride <= context_len:
        raise ValueError(f"stride must lie in [1, context_len={context_len}], got {stride}")
    if chunk_size < 1 or block_size < 1:
        raise ValueError("chunk_size and block_size must be positive")
    backend = model.backend.with_attention(attention)
    chunk_size = min(chunk_size, context_len)

    num_blocks = -(-context_len // block_size)
    table = np.arange(1, num_blocks + 1, dtype=np.int32)  # block 0 is the null block padding writes to
    # One sequence at a time, so one pool serves every window: a window's stale slots lie past its
    # context length until it overwrites them, and attention never reads past that length.
    cache = _allocate_cache(config, num_blocks + 1, block_size, model.dtype, kv_cache_dtype, backend)

    spans = window_spans(len(ids), context_len, stride)
    nll, scored = 0.0, 0
    for begin, end, first in tqdm(spans, desc="perplexity", unit="window", disable=not progress):
        window = ids[begin:end]
        n = len(window)
        for c0 in range(0, n - 1, chunk_size):  # the last token predicts nothing
            c1 = min(c0 + chunk_size, n)
            m = c1 - c0
            positions = np.zeros(chunk_size, np.int32)
            positions[:m] = np.arange(c0, c1)
            tokens = np.zeros(chunk_size, np.int32)
            tokens[:m] = window[c0:c1]
            targets = np.zeros(chunk_size, np.int32)
            num_targets = min(m, n - 1 - c0)
            targets[:num_targets] = window[c0 + 1 : c0 + 1 + num_targets]
            slots = np.zeros(chunk_size, np.int32)  # padding rows write into the null block
            slots[:m] = table[positions[:m] // block_size] * block_size + positions[:m] % block_size
            meta = PagedAttentionMetadata(slots, positions, np.zeros(chunk_size, np.int32), table[None],
                                          np.array([c1], np.int32), np.array([0, m], np.int32))
            logprobs, cache = _score_chunk(model.params, cache, tokens, targets, meta, config=config,
                                           backend=backend)
            # Row i predicts the window's token c0 + i + 1; keep those this window scores.
            target_pos = begin + c0 + 1 + np.arange(num_targets)
            keep = target_pos >= first
            if keep.any():
                nll -= float(np.asarray(logprobs[:num_targets], np.float64)[keep].sum())
                scored += int(keep.sum())
    mean = nll / scored
    return PerplexityResult(math.exp(mean), mean, scored, len(ids), len(spans), context_len, stride, kv_cache_dtype)


def perplexity_of_text(model, text: str, **kwargs) -> PerplexityResult:
    """Tokenize `text` with the model's tokenizer (BOS as the model adds it) and score it."""
    if model.tokenizer is None:
        raise ValueError(f"{model.source} has no tokenizer; pass token ids to perplexity() instead")
    return perplexity(model, model.tokenizer.encode(text), **kwargs)
