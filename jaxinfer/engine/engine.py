"""LLMEngine: add_request / step / abort over scheduler, block manager and runner.

One step is: Scheduler.schedule() (host) -> ModelRunner.prepare()+run() (one jitted
device call) -> _process() (host: append sampled tokens, detokenize, check
stops, free finished sequences). Bad requests are rejected at add_request
with an error naming the problem; the engine keeps serving the others.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.request import Sequence
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.model import Model
from jaxinfer.models.paged_attention import ATTENTION_BACKENDS
from jaxinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxinfer.sampling_params import SamplingParams

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 512 * 2**20  # default pool size without a GPU to measure


# (max_num_seqs, max_num_batched_tokens). Every (tokens, seqs) bucket pair is
# compiled at start-up, so CPU keeps the grid small (20 programs); a GPU
# needs wide batches to fill it.
_PLATFORM_DEFAULTS = {"cpu": (16, 256), "gpu": (128, 2048)}


class RequestError(ValueError):
    """A request was rejected; the message names the request and the problem."""


@dataclass
class EngineConfig:
    max_model_len: int
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.9
    # None: chosen by platform (see _PLATFORM_DEFAULTS).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "continuous"
    # None: "pallas" on GPU, "xla" elsewhere (see models/paged_attention.py).
    attention_backend: str | None = None

    def __post_init__(self):
        platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
        seqs, tokens = _PLATFORM_DEFAULTS[platform]
        self.max_num_seqs = self.max_num_seqs or seqs
        self.max_num_batched_tokens = self.max_num_batched_tokens or tokens
        self.attention_backend = self.attention_backend or ("pallas" if platform == "gpu" else "xla")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks must be an int >= 2 (block 0 is reserved), got {self.num_kv_blocks!r}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Sequence]
    metrics: RequestMetrics

    def output(self) -> RequestOutput:
        cached = max(0, min(s.num_cached_tokens for s in self.sequences))
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.output for s in self.sequences],
            finished=all(s.is_finished for s in self.sequences),
            num_cached_tokens=cached,
            metrics=self.metrics,
        )


def kv_block_bytes(model: Model, block_size: int) -> int:
    c = model.config
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * np.dtype(model.dtype).itemsize


def choose_num_blocks(model: Model, config: EngineConfig) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_block_bytes(model, config.block_size)
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform == "gpu" else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        budget = int(free * config.kv_cache_memory_fraction)
    else:
        # CPU: no device memory to measure; enough for every sequence at full length, capped.
        full = config.max_num_seqs * -(-config.max_model_len // config.block_size) * per_block
        budget = min(full, CPU_KV_CACHE_BYTES)
    return max(2, budget // per_block + 1)


class LLMEngine:
    def __init__(self, model: Model, config: EngineConfig, progress: bool = True):
        self.model = model
        self.config = config
        self.tokenizer = model.tokenizer
        num_blocks = choose_num_blocks(model, config)
        c = model.config
        shape = (c.num_layers, num_blocks, config.block_size, c.num_kv_heads, c.head_dim)
        kv_cache = (jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype))
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.scheduling_policy
        )
        self.runner = ModelRunner(
            c, model.params, kv_cache, config.block_size, config.max_model_len,
            config.max_num_seqs, config.max_num_batched_tokens, config.attention_backend,
        )
        self.runner.warmup(progress)
        self.requests: dict[str, _RequestState] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._seed_rng = np.random.default_rng()
        self.host_time = 0.0
        self.device_time = 0.0

    # -- requests ------------------------------------------------------------
    def validate(self, name: str, prompt_token_ids, params: SamplingParams) -> None:
        """Raise RequestError (message starting with `name`) if this request can
        never be served: bad params type, empty or too long prompt, token ids
        outside the vocabulary, or more KV blocks at full length than exist."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"{name}: sampling_params must be a SamplingParams")
        if not prompt_token_ids:
            raise RequestError(f"{name}: prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{name}: token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise RequestError(
                f"{name}: prompt has {len(prompt_token_ids)} tokens, which leaves no room to generate "
                f"within max_model_len={self.config.max_model_len}"
            )
        longest = min(len(prompt_token_ids) + params.max_tokens, self.config.max_model_len)
        blocks = -(-longest // self.config.block_size)
        if blocks > self.block_manager.num_usable_blocks:
            raise RequestError(
                f"{name}: needs {blocks} KV blocks at full length ({longest} tokens) but the cache "
                f"has {self.block_manager.num_usable_blocks}; lower max_tokens or raise num_kv_blocks"
            )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt=None) -> None:
        prompt_token_ids = list(prompt_token_ids)
        if request_id in self.requests:
            raise RequestError(f"request {request_id}: id already in use")
        self.validate(f"request {request_id}", prompt_token_ids, params)
        metrics = RequestMetrics(arrival_time=time.perf_counter())
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31))
        eos = frozenset() if params.ignore_eos or self.tokenizer is None else frozenset(self.tokenizer.eos_token_ids)
        sequences = []
        for index in range(params.n):
            seq = Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                index=index,
                prompt_token_ids=prompt_token_ids,
                params=params,
                # Distinct, reproducible stream per completion of a seeded request.
                seed=(base_seed * 1_000_003 + index) % 2**31,
                arrival_order=next(self._arrivals),
                metrics=metrics,
                output=CompletionOutput(index=index, text="", token_ids=[],
                                        logprobs=[] if params.logprobs is not None else None),
                detokenizer=self.tokenizer.detokenizer(prompt_token_ids) if self.tokenizer else None,
                eos_token_ids=eos,
                leader=sequences[0] if sequences else None,
            )
            if params.logprobs is not None:
                seq.output.cumulative_logprob = 0.0
            sequences.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = _RequestState(request_id, prompt, prompt_token_ids, sequences, metrics)

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq in state.sequences:
            if not seq.is_finished:
                seq.output.finish_reason = "abort"
                self.scheduler.finish(seq)
        state.metrics.finished_time = time.perf_counter()
        return state.output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the requests that made progress
        (finished ones for the last time, then forgotten)."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.sequences:
            return []
        now = time.perf_counter()
        for seq in batch.sequences:
            seq.metrics.first_scheduled_time = seq.metrics.first_scheduled_time or now
        tables = [self.block_manager.block_table(s.seq_id) for s in batch.sequences]
        inputs, with_penalties = self.runner.prepare(batch, tables)
        device_start = time.perf_counter()
        out = jax.tree.map(np.asarray, self.runner.run(inputs, with_penalties))
        device_end = time.perf_counter()
        touched = self._process(batch, out)
        end = time.perf_counter()
        self.device_time += device_end - device_start
        self.host_time += (device_start - start) + (end - device_end)
        return touched

    def _process(self, batch, out) -> list[RequestOutput]:
        now = time.perf_counter()
        touched: dict[str, _RequestState] = {}
        for i, (seq, num_new) in enumerate(zip(batch.sequences, batch.num_new_tokens)):
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids(), seq.num_computed_tokens)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prompt chunk that did not reach the end: nothing sampled
            self._append_token(seq, i, out, now)
            touched[seq.request_id] = self.requests[seq.request_id]
            if seq.output.finish_reason is not None:
                self.scheduler.finish(seq)
        results = []
        for state in touched.values():
            output = state.output()
            if output.finished:
                state.metrics.finished_time = now
                del self.requests[state.request_id]
            results.append(output)
        return results

    def _append_token(self, seq: Sequence, row: int, out, now: float) -> None:
        params, completion = seq.params, seq.output
        token = int(out.token_ids[row])
        completion.token_ids.append(token)
        seq.metrics.first_token_time = seq.metrics.first_token_time or now
        seq.metrics.last_token_time = now
        seq.metrics.num_output_tokens += 1
        if params.logprobs is not None:
            entry = {token: Logprob(float(out.logprobs[row, 0]), int(out.sampled_rank[row]))}
            for rank in range(params.logprobs):
                token_id = int(out.logprob_token_ids[row, 1 + rank])
                entry.setdefault(token_id, Logprob(float(out.logprobs[row, 1 + rank]), rank + 1))
            for token_id, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([token_id]) if self.tokenizer else None
            completion.logprobs.append(entry)
            completion.cumulative_logprob += entry[token].logprob
        if token in (params.stop_token_ids or ()) or token in seq.eos_token_ids:
            completion.finish_reason = "stop"
            completion.stop_reason = token if token in (params.stop_token_ids or ()) else None
        if seq.detokenizer is not None:
            completion.text += seq.detokenizer.add([token])
            if completion.finish_reason is None:
                _cut_at_stop_string(completion, params.stop)
        if completion.finish_reason is None and (
            len(completion.token_ids) >= params.max_tokens or seq.num_tokens >= self.config.max_model_len
        ):
            completion.finish_reason = "length"
        if completion.finish_reason is not None and seq.detokenizer is not None and not isinstance(
            completion.stop_reason, str
        ):
            completion.text += seq.detokenizer.flush()  # bytes held back for a character that never completed
            _cut_at_stop_string(completion, params.stop)

    # -- introspection -------------------------------------------------------
    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_compilations": self.runner.num_compilations,
            "kv_blocks_total": bm.num_usable_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "num_preemptions": self.scheduler.num_preemptions,
            "host_time_s": self.host_time,
            "device_time_s": self.device_time,
        }


def _cut_at_stop_string(completion: CompletionOutput, stop) -> bool:
    """End the completion at the first stop string in its text; the stop
    string itself is not returned (vLLM's default)."""
    hits = [(completion.text.find(s), s) for s in stop or () if s in completion.text]
    if not hits:
        return False
    position, string = min(hits)
    completion.text = completion.text[:position]
    completion.finish_reason, completion.stop_reason = "stop", string
    return True
