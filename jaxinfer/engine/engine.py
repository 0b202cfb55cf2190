"""LLMEngine: add_request / step / abort over scheduler, block manager and runner.

One step is: Scheduler.schedule() (host) -> ModelRunner.prepare()+run() (one jitted
device call) -> _process() (host: append sampled tokens, detokenize, check
stops, free finished sequences). With `speculative=` set, a pure-decode step
first asks the proposer (spec/) for drafts, and the target verifies them in
one call (prepare_spec + run_spec) -> _process_spec() (see _propose). Bad requests are rejected at add_request
with an error naming the problem; the engine keeps serving the others.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import jax
import numpy as np

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.request import Sequence
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.model import Model
from jaxinfer.models import kv_cache
from jaxinfer.models.paged_attention import ATTENTION_BACKENDS
from jaxinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.spec.config import SpeculativeConfig
from jaxinfer.spec.proposer import build_proposer, max_drafts

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
    # "auto" (the model's dtype), "int8" or "fp8" (see models/kv_cache.py).
    kv_cache_dtype: str = "auto"
    # None, or {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}
    # (see spec/config.py); parsed into a SpeculativeConfig.
    speculative: dict | SpeculativeConfig | None = None

    def __post_init__(self):
        platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
        seqs, tokens = _PLATFORM_DEFAULTS[platform]
        self.max_num_seqs = self.max_num_seqs or seqs
        self.max_num_batched_tokens = self.max_num_batched_tokens or tokens
        self.attention_backend = self.attention_backend or ("pallas" if platform == "gpu" else "xla")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        kv_cache.check_kv_cache_dtype(self.kv_cache_dtype)
        self.speculative = SpeculativeConfig.parse(self.speculative)
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


def kv_block_bytes(model: Model, block_size: int, kv_cache_dtype: str = "auto") -> int:
    return kv_cache.kv_block_bytes(model.config, block_size, model.dtype, kv_cache_dtype)


def choose_num_blocks(model: Model, config: EngineConfig, extra_block_bytes: int = 0) -> int:
    """extra_block_bytes: memory per block of another pool with as many blocks
    (a draft model's), which shares the budget."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_block_bytes(model, config.block_size, config.kv_cache_dtype) + extra_block_bytes
    if model.mesh is not None:  # the pool is split on KV heads: each device holds 1 / N of every block
        per_block = -(-per_block // model.mesh.size)
    devices = [jax.devices()[0]] if model.mesh is None else [
        d for d in model.mesh.devices.flat if d.process_index == jax.process_index()]
    stats = [d.memory_stats() if d.platform == "gpu" else None for d in devices]
    if all(s and "bytes_limit" in s for s in stats):
        # The fullest device of the mesh decides: every device holds a slice of every block.
        free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
        budget = int(free * config.kv_cache_memory_fraction)
    else:
        # CPU: no device memory to measure; enough for every sequence at full length, capped.
        full = config.max_num_seqs * -(-config.max_model_len // config.block_size) * per_block
        budget = min(full, CPU_KV_CACHE_BYTES)
    num_blocks = max(2, budget // per_block + 1)
    if jax.process_count() > 1:
        # Lockstep hosts must build the same pool (same shapes, same programs): the smallest wins.
        from jax.experimental import multihost_utils

        num_blocks = int(np.min(multihost_utils.process_allgather(np.int64(num_blocks))))
    return num_blocks


class LLMEngine:
    def __init__(self, model: Model, config: EngineConfig, progress: bool = True):
        self.model = model
        self.config = config
        self.tokenizer = model.tokenizer
        spec = config.speculative
        draft = None
        if spec is not None and spec.method == "draft_model":
            from jaxinfer.spec.draft_model import load_draft_model

            draft = load_draft_model(spec, model, progress)  # before sizing the pools: it takes memory
        extra = kv_block_bytes(draft, config.block_size, config.kv_cache_dtype) if draft is not None else 0
        num_blocks = choose_num_blocks(model, config, extra)
        c = model.config
        cache = kv_cache.allocate_kv_cache(c, num_blocks, config.block_size, model.dtype, config.kv_cache_dtype,
                                           mesh=model.mesh)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.scheduling_policy
        )
        self.runner = ModelRunner(
            c, model.params, cache, config.block_size, config.max_model_len,
            config.max_num_seqs, config.max_num_batched_tokens, config.attention_backend,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            with_features=spec is not None and spec.method == "eagle", mesh=model.mesh,
        )
        self.runner.warmup(progress)
        # The draft model's pool has as many blocks as the target's.
        self.proposer = build_proposer(spec, draft or model, config, num_blocks, progress) if spec is not None else None
        if self.proposer is not None:
            self.scheduler.on_release = self.proposer.release
        self.spec_proposed_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_verifications = 0  # (sequence, step) pairs that verified at least one draft
        self.requests: dict[str, _RequestState] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        from jaxinfer.parallel.distributed import engine_seed

        self._seed_rng = np.random.default_rng(engine_seed())  # the same on every host of a lockstep run
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
        proposer_device = self.proposer.device_time if self.proposer is not None else 0.0
        drafts = self._propose(batch)
        tables = [self.block_manager.block_table(s.seq_id) for s in batch.sequences]
        if drafts is None:
            inputs, with_penalties = self.runner.prepare(batch, tables)
        else:
            inputs, with_penalties = self.runner.prepare_spec(batch, tables, drafts)
        device_start = time.perf_counter()
        run = self.runner.run if drafts is None else self.runner.run_spec
        out = jax.tree.map(np.asarray, run(inputs, with_penalties))
        device_end = time.perf_counter()
        if self.runner.with_features:  # an EAGLE proposer drafts from the target's features
            self.proposer.observe(batch, np.asarray(self.runner.last_features), drafts)
        touched = self._process(batch, out) if drafts is None else self._process_spec(batch, drafts, out)
        if self.proposer is not None:
            for seq in batch.sequences:
                if not seq.is_finished:  # finished ones were released
                    self.proposer.sync(seq)
            proposer_device = self.proposer.device_time - proposer_device
        end = time.perf_counter()
        device = device_end - device_start + proposer_device
        self.device_time += device
        self.host_time += end - start - device
        return touched

    def _propose(self, batch) -> list[list[int]] | None:
        """Drafts per sequence for a verification step, or None for a plain step.

        Only a pure-decode step speculates (every sequence owes just its last
        token): a step with a prompt chunk runs without drafts, as do requests
        with penalties or logprobs (spec/proposer.py: max_drafts), and a
        sequence the proposer has nothing for decodes one token in the same
        verification batch. Draft slots are allocated here; a sequence that
        cannot get them verifies no drafts (drafts never preempt anyone).
        A verification step holds n * (1 + K) rows for a decode bucket of n
        sequences, which may exceed max_num_batched_tokens: the budget
        bounds the scheduled tokens, and drafts ride on top of it.
        """
        if self.proposer is None or any(
            n != 1 or s.num_computed_tokens != s.num_tokens - 1 for s, n in zip(batch.sequences, batch.num_new_tokens)
        ):
            return None
        k = self.config.speculative.num_speculative_tokens
        caps = [max_drafts(s, k, self.config.max_model_len) for s in batch.sequences]
        if not any(caps):
            return None
        drafts = self.proposer.propose(batch.sequences, caps)
        for seq, draft in zip(batch.sequences, drafts):
            if draft and not self.block_manager.allocate(seq.seq_id, seq.num_tokens + len(draft)):
                draft.clear()
        return drafts if any(drafts) else None

    def _process(self, batch, out) -> list[RequestOutput]:
        now = time.perf_counter()
        touched: dict[str, _RequestState] = {}
        for i, (seq, num_new) in enumerate(zip(batch.sequences, batch.num_new_tokens)):
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids(), seq.num_computed_tokens)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prompt chunk that did not reach the end: nothing sampled
            self._append_token(seq, int(out.token_ids[i]), out, i, now)
            touched[seq.request_id] = self.requests[seq.request_id]
            if seq.output.finish_reason is not None:
                self.scheduler.finish(seq)
        return self._outputs(touched, now)

    def _process_spec(self, batch, drafts, out) -> list[RequestOutput]:
        """A verification step's outputs: each sequence emits its accepted
        drafts and the target's token, one at a time through the usual checks,
        stopping at the first stop (EOS, stop id or string, max_tokens).

        The cache then holds valid K/V for the last token and the accepted
        drafts: num_computed_tokens advances by 1 + accepted and only those
        tokens' full blocks are registered in the prefix cache. The rejected
        drafts' slots are simply rewritten by later steps (nothing reads a
        slot past a sequence's computed tokens before it is rewritten); the
        blocks past the sequence's length are trimmed."""
        now = time.perf_counter()
        touched: dict[str, _RequestState] = {}
        for i, (seq, draft) in enumerate(zip(batch.sequences, drafts)):
            num_emitted = int(out.num_emitted[i])
            if draft:
                self.spec_proposed_tokens += len(draft)
                self.spec_accepted_tokens += num_emitted - 1
                self.spec_verifications += 1
            first = seq.num_computed_tokens
            for j in range(num_emitted):
                self._append_token(seq, int(out.token_ids[i, j]), out, i, now)
                seq.num_computed_tokens = first + j + 1
                if seq.output.finish_reason is not None:
                    break
            self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids(), seq.num_computed_tokens)
            self.block_manager.trim(seq.seq_id, seq.num_tokens)
            touched[seq.request_id] = self.requests[seq.request_id]
            if seq.output.finish_reason is not None:
                self.scheduler.finish(seq)
        return self._outputs(touched, now)

    def _outputs(self, touched: dict, now: float) -> list[RequestOutput]:
        results = []
        for state in touched.values():
            output = state.output()
            if output.finished:
                state.metrics.finished_time = now
                del self.requests[state.request_id]
            results.append(output)
        return results

    def _append_token(self, seq: Sequence, token: int, out, row: int, now: float) -> None:
        """Append one token and check the stops; out[row] holds its logprobs
        (only read for requests with logprobs, which never have drafts)."""
        params, completion = seq.params, seq.output
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
        proposer = self.proposer
        return {
            "num_compilations": self.runner.num_compilations + (proposer.num_compilations if proposer else 0),
            "kv_blocks_total": bm.num_usable_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "num_preemptions": self.scheduler.num_preemptions,
            "host_time_s": self.host_time,
            "device_time_s": self.device_time,
            # Speculative decoding (0 without): drafts verified, drafts accepted,
            # and (sequence, step) verifications with at least one draft.
            "spec_proposed_tokens": self.spec_proposed_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_verifications": self.spec_verifications,
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
