"""A one-request-at-a-time generation loop over a contiguous KV cache.

This is the foundation's generator: correct and compiled, but it runs requests
sequentially. The engine (paged cache, continuous batching, on-device
sampling) replaces it behind the same `LLM` API.

Per request: one jitted prefill over the prompt padded to a power-of-two
bucket, then one jitted decode step per token; the cache [layers, 1, slots,
kv_heads, head_dim] is donated into each call so it is updated in place.
Sampling runs on the host with the numpy sampler (jaxinfer/sampling.py).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model import Model
from jaxinfer.models.attention import contiguous_cache_attention
from jaxinfer.models.llama import compute_logits, forward
from jaxinfer.outputs import CompletionOutput, RequestMetrics
from jaxinfer.sampling import make_rng, sample_next_token
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.utils import bucket_size

MIN_CACHE_SLOTS = 256


def _run(params, config: ModelConfig, tokens, positions, kv_cache, sample_index):
    attention = contiguous_cache_attention(positions, config.sliding_window)
    hidden, kv_cache = forward(params, config, tokens, positions, attention, kv_cache)
    # Only the sampled position's logits leave the device.
    return compute_logits(params, hidden[:, sample_index]), kv_cache


_step = jax.jit(_run, static_argnums=1, donate_argnums=4)


class SimpleGenerator:
    def __init__(self, model: Model, max_model_len: int):
        self.model = model
        self.config = model.config
        self.max_model_len = max_model_len

    def _cache_slots(self, prompt_len: int, max_tokens: int) -> int:
        needed = min(prompt_len + max_tokens, self.max_model_len)
        # Never smaller than the prefill bucket: the padded prompt is written whole.
        return max(bucket_size(needed, MIN_CACHE_SLOTS), bucket_size(prompt_len))

    def _new_cache(self, slots: int):
        c = self.config
        shape = (c.num_layers, 1, slots, c.num_kv_heads, c.head_dim)
        return (jnp.zeros(shape, self.model.dtype), jnp.zeros(shape, self.model.dtype))

    def _prefill(self, prompt_ids, cache):
        length = len(prompt_ids)
        tokens = np.zeros((1, bucket_size(length)), np.int32)
        tokens[0, :length] = prompt_ids
        positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
        return _step(self.model.params, self.config, tokens, positions, cache, length - 1)

    def _decode(self, token_id, position, cache):
        tokens = np.array([[token_id]], np.int32)
        positions = np.array([[position]], np.int32)
        return _step(self.model.params, self.config, tokens, positions, cache, 0)

    def warmup(self, prompt_len: int, max_tokens: int) -> list:
        """Compile (by running once) the prefill and decode programs a request
        of this size needs; returns callables so a caller can show progress."""
        slots = self._cache_slots(prompt_len, max_tokens)
        ids = np.zeros(prompt_len, np.int32)
        return [
            lambda: jax.block_until_ready(self._prefill(ids, self._new_cache(slots))),
            lambda: jax.block_until_ready(self._decode(0, prompt_len, self._new_cache(slots))),
        ]

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, index: int, metrics: RequestMetrics
    ) -> CompletionOutput:
        tokenizer = self.model.tokenizer
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        seed = params.seed
        rng = make_rng(None if seed is None else [seed, index])  # distinct stream per sample
        stop_ids = set(params.stop_token_ids or ())
        eos_ids = set() if params.ignore_eos or tokenizer is None else set(tokenizer.eos_token_ids)
        detokenizer = tokenizer.detokenizer(prompt_ids) if tokenizer is not None else None
        out = CompletionOutput(index=index, text="", token_ids=[], logprobs=[] if params.logprobs is not None else None)
        out.cumulative_logprob = 0.0 if params.logprobs is not None else None

        cache = self._new_cache(self._cache_slots(len(prompt_ids), max_tokens))
        logits, cache = self._prefill(prompt_ids, cache)
        while True:
            token, logprobs = sample_next_token(
                np.asarray(logits[0]), params, rng, output_token_ids=out.token_ids, prompt_token_ids=prompt_ids
            )
            now = time.perf_counter()
            metrics.first_token_time = metrics.first_token_time or now
            out.token_ids.append(token)
            if logprobs is not None:
                for token_id, lp in logprobs.items():
                    lp.decoded_token = tokenizer.decode([token_id]) if tokenizer else None
                out.logprobs.append(logprobs)
                out.cumulative_logprob += logprobs[token].logprob
            if token in stop_ids or token in eos_ids:
                out.finish_reason = "stop"
                out.stop_reason = token if token in stop_ids else None
            if detokenizer is not None:
                out.text += detokenizer.add([token])
                if out.finish_reason is None and self._cut_at_stop_string(out, params.stop):
                    break
            if out.finish_reason is None and len(out.token_ids) >= max_tokens:
                out.finish_reason = "length"
            if out.finish_reason is not None:
                break
            logits, cache = self._decode(token, len(prompt_ids) + len(out.token_ids) - 1, cache)
        if detokenizer is not None and not isinstance(out.stop_reason, str):
            out.text += detokenizer.flush()  # bytes held back for a character that never completed
            self._cut_at_stop_string(out, params.stop)
        metrics.num_output_tokens += len(out.token_ids)
        return out

    @staticmethod
    def _cut_at_stop_string(out: CompletionOutput, stop: list[str]) -> bool:
        """End the completion at the first stop string in its text; the stop
        string itself is not returned (vLLM's default)."""
        hits = [(out.text.find(s), s) for s in stop or () if s in out.text]
        if not hits:
            return False
        position, string = min(hits)
        out.text = out.text[:position]
        out.finish_reason, out.stop_reason = "stop", string
        return True
