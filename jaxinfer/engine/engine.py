"""LLMEngine: add_request / step / abort over the scheduler, runner and output processor.

One step, speculative or not, is one path:

    Scheduler.schedule()     host: who runs, with how many tokens (drafts included)
    ModelRunner.launch()     device: forward, then sampling or draft verification
    ModelRunner.complete()   the step's tokens on the host
    OutputProcessor.process  host: append emitted tokens, check stops, free finished
    proposer.after_step()    host/device: drafts for the next step (engine/spec/)

Async scheduling (`async_scheduling`, on by default on a GPU; vLLM's async
scheduling, SGLang's overlap scheduler): the host's work for step N + 1
runs while step N runs on the device. After launching step N the engine
applies its progress at once (OutputProcessor.expect: each emitting
sequence gets a pending token), schedules and launches step N + 1, whose
rows take those pending tokens from step N's sampled tokens on the device,
and only then fetches and processes step N's outputs. A sequence that step
N finished (EOS, a stop string) was scheduled into step N + 1 in vain: its
row there is dropped. Steps whose next step needs their tokens on the host
first run as before, one at a time: structured outputs (the next mask),
token rules (engine/token_rules.py: the next bans), penalties (the next
counts) and speculative decoding (the next drafts).

Bad requests are rejected at add_request with a RequestError naming the
problem; the engine keeps serving the others. A request's LoRA adapter is
read and checked there too (on first sight; lora/adapter.py), so a bad
adapter is that request's error.

A step that raises (a bug, a device error) fails the requests it held,
with RequestOutput.error naming the exception (internal_error set), and the
engine goes on with the others; only a step that lost the KV pool (donated
to a forward that never returned it) is fatal.

Structured outputs: a request with `structured_outputs` waits here, outside
the scheduler, while its grammar compiles on the compiler's worker thread
(structured/grammar.py); each step admits the requests whose grammar is
ready (every sequence gets its own matcher) and fails, alone, those whose
compile failed or passed `structured_outputs_compile_timeout`: they finish
with `RequestOutput.error` naming the problem. In a multi-host lockstep run
add_request waits for the compile instead, so every host admits the request
in the same step.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
import weakref

import jax
import numpy as np

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.config import EngineConfig, check_context_parallel, choose_num_blocks, kv_block_bytes
from jaxinfer.engine.early_compile import EarlyCompile
from jaxinfer.engine.output_processor import OutputProcessor
from jaxinfer.engine.request import RequestState
from jaxinfer.engine.runner import Launched, ModelRunner
from jaxinfer.engine.scheduler import ScheduledBatch, Scheduler
from jaxinfer.engine.sequence import Sequence, SequenceStatus
from jaxinfer.engine.spec.proposer import build_proposer
from jaxinfer.engine.token_rules import TokenRules
from jaxinfer.engine.tracing_turns import TRACING_TURNS
from jaxinfer.errors import RequestError
from jaxinfer.loading.model import Model
from jaxinfer.models import kv_cache
from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxinfer.parallel.mesh import context_parallel_size
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured.grammar import GrammarCompiler, GrammarError, grammar_text
from jaxinfer.structured.matcher import StructuredState


log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: Model, config: EngineConfig, progress: bool = True, early: EarlyCompile | None = None):
        """early: the programs LLM started compiling while the model's weights
        loaded (engine/early_compile.py), adopted where they came out right."""
        self.model = model
        self.config = config = config.for_backend(model.backend)
        self.tokenizer = model.tokenizer
        spec = config.speculative
        draft = None
        if spec is not None and spec.method == "draft_model":
            from jaxinfer.engine.spec.draft_model import load_draft_model

            draft = load_draft_model(spec, model, progress)  # before sizing the pools: it takes memory
        extra = kv_block_bytes(draft, config.block_size, config.kv_cache_dtype) if draft is not None else 0
        check_context_parallel(config, model.mesh)
        # An early compile's programs hold its pool's shape (sized before the weights loaded).
        early = early.finished(model) if early is not None else None
        num_blocks = early.num_blocks if early is not None else choose_num_blocks(model, config, extra)
        cache = kv_cache.allocate_kv_cache(model.config, num_blocks, config.block_size, model.dtype,
                                           config.kv_cache_dtype, mesh=model.mesh,
                                           fp8_dtype=model.backend.kv_fp8_dtype, zeros=model.backend.zeros)
        model.backend.start_engine()
        cp = context_parallel_size(model.mesh)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, cp)
        # The longest context one sequence can hold: the whole pool, every context device's share.
        self.max_context_len = min(config.max_model_len, self.block_manager.num_usable_blocks * config.block_size)
        log.info("KV pool: %d blocks of %d tokens, %d per device over %d context device(s); maximum context %d "
                 "tokens", num_blocks, config.block_size, num_blocks // cp, cp, self.max_context_len)
        self.lora = None
        if config.enable_lora:
            from jaxinfer.lora.slots import LoRASlots

            self.lora = LoRASlots(model.config, model.checkpoint_config, config.max_loras, config.max_lora_rank,
                                  model.dtype, mesh=model.mesh)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.scheduling_policy,
            lora_slots=self.lora, max_model_len=config.max_model_len,
        )
        # Async scheduling: the launched step whose outputs are not processed yet.
        self._in_flight: tuple[ScheduledBatch, Launched] | None = None
        # The draft model's pool has as many blocks as the target's.
        self.proposer = build_proposer(spec, draft or model, config, num_blocks, progress)
        self.scheduler.on_release = self.proposer.release
        self.runner = ModelRunner.for_engine(model, config, cache, lora=self.lora,
                                             with_features=self.proposer.needs_features)
        if early is not None:
            self.runner.adopt(early.compiled())
        # Lockstep hosts must run every step in the same bucket: a background
        # thread's progress differs between them, a step's own bucket does not.
        warmup = "all" if config.warmup == "background" and jax.process_count() > 1 else config.warmup
        self.runner.warmup(progress, warmup)
        # The background thread holds the runner, not the engine: once the
        # engine is dropped, the programs left to compile serve no one (and
        # would take the cores from whatever runs next).
        weakref.finalize(self, self.runner.stop_compiling)
        self.output_processor = OutputProcessor(self.scheduler, self.block_manager, self.tokenizer,
                                                config.max_model_len)
        self.requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        from jaxinfer.parallel.distributed import engine_seed

        self._seed_rng = np.random.default_rng(engine_seed())  # the same on every host of a lockstep run
        self.host_time = 0.0
        self.device_time = 0.0
        # Structured outputs: the compiler (cheap to make: its worker and the
        # llguidance tokenizer start on the first compile; made here, not lazily,
        # because server handler threads submit to it too) and the requests
        # waiting for their grammar: (state, future, deadline).
        self._grammars = GrammarCompiler(self.tokenizer, model.config.vocab_size) if self.tokenizer else None
        self._pending: list[tuple[RequestState, concurrent.futures.Future, float]] = []

    # -- requests ------------------------------------------------------------
    def validate(self, name: str, prompt_token_ids, params: SamplingParams) -> None:
        """Raise RequestError (message starting with `name`) if this request can
        never be served: bad params type, a prompt validate_prompt refuses, or
        more KV blocks at full length than exist."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"{name}: sampling_params must be a SamplingParams")
        self.validate_prompt(name, prompt_token_ids)
        vocab = self.model.config.vocab_size
        longest = min(len(prompt_token_ids) + params.max_tokens, self.config.max_model_len)
        blocks = -(-longest // self.config.block_size)
        if blocks > self.block_manager.num_usable_blocks:
            raise RequestError(
                f"{name}: needs {blocks} KV blocks at full length ({longest} tokens) but the cache "
                f"has {self.block_manager.num_usable_blocks} (maximum context {self.max_context_len} tokens); lower "
                f"max_tokens, raise num_kv_blocks, or spread the cache over more devices (context_parallel_size)"
            )
        outside = [t for t in (*(params.allowed_token_ids or ()), *(params.logit_bias or ())) if t >= vocab]
        if outside:
            raise RequestError(f"{name}: allowed_token_ids / logit_bias name token ids outside the vocabulary "
                               f"[0, {vocab}): {outside[:5]}")
        if params.bad_words and self.tokenizer is None:
            raise RequestError(f"{name}: bad_words need a tokenizer, and this model has none")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise RequestError(f"{name}: structured_outputs need a tokenizer, and this model has none")
            try:
                grammar_text(params.structured_outputs)  # cheap; whether it compiles is the worker's to say
            except GrammarError as e:
                raise RequestError(f"{name}: {e}") from None

    def validate_prompt(self, name: str, prompt_token_ids) -> None:
        """Raise RequestError if a prompt is empty, has ids outside the
        vocabulary, or leaves no room to generate within max_model_len (a
        server checks this before it sizes max_tokens from the prompt)."""
        if not prompt_token_ids:
            raise RequestError(f"{name}: prompt is empty")
        self.check_token_ids(name, prompt_token_ids)
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise RequestError(
                f"{name}: prompt has {len(prompt_token_ids)} tokens, which leaves no room to generate "
                f"within max_model_len={self.config.max_model_len}"
            )

    def check_token_ids(self, name: str, token_ids) -> None:
        """Raise RequestError unless every id is an integer in [0, vocab_size)."""
        vocab = self.model.config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{name}: token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    def validate_priority(self, name: str, priority: int) -> None:
        """vLLM's rule: only scheduling_policy="priority" takes a priority other than 0."""
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise RequestError(f"{name}: priority {priority} needs scheduling_policy='priority' "
                               f"(this engine runs {self.config.scheduling_policy!r})")

    def validate_lora(self, name: str, lora_request) -> None:
        """Raise RequestError unless this engine serves adapters and can serve
        this one (read and checked now, its host copy kept for add_request)."""
        if lora_request is None:
            return
        if self.lora is None:
            raise RequestError(f"{name}: a lora_request needs an engine built with enable_lora=True")
        try:
            self.lora.register(lora_request)
        except RequestError as e:
            raise type(e)(f"{name}: {e}") from None

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            raise RequestError("structured_outputs need a tokenizer, and this model has none")
        return self._grammars

    def check_structured_outputs(self, name: str, params: SamplingParams) -> None:
        """Compile a request's grammar now (cached for its add_request) and
        raise RequestError if it does not compile in time: what a caller that
        waits anyway (LLM.generate) uses to fail before submitting anything."""
        if params.structured_outputs is None:
            return
        try:
            future = self.grammar_compiler.submit(params.structured_outputs)
            future.result(timeout=self.config.structured_outputs_compile_timeout)
        except concurrent.futures.TimeoutError:
            raise RequestError(f"{name}: {self.grammar_timeout_message(params)}") from None
        except GrammarError as e:
            raise RequestError(f"{name}: {e}") from None

    def grammar_timeout_message(self, params: SamplingParams) -> str:
        """Why a request whose grammar outran its compile time fails (here and at the server)."""
        return (f"structured_outputs.{params.structured_outputs.kind}: the grammar did not compile within "
                f"structured_outputs_compile_timeout={self.config.structured_outputs_compile_timeout} s")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt=None,
                    lora_request=None, priority: int = 0) -> None:
        """lora_request: a LoRARequest (lora/request.py) naming the adapter
        this request runs with, or None for the base model. priority: with
        scheduling_policy="priority", lower values are scheduled first (and
        preempted last); any other policy takes only 0 (vLLM's rule)."""
        self.validate_priority(f"request {request_id}", priority)
        prompt_token_ids = list(prompt_token_ids)
        if request_id in self.requests:
            raise RequestError(f"request {request_id}: id already in use")
        self.validate(f"request {request_id}", prompt_token_ids, params)
        self.validate_lora(f"request {request_id}", lora_request)
        future = None
        if params.structured_outputs is not None:
            # Before any seed or counter moves: a refusal here (the compile
            # queue is full) leaves the engine as it was, so lockstep hosts,
            # which never see the refused request, keep drawing the same seeds.
            try:
                future = self.grammar_compiler.submit(params.structured_outputs)
            except GrammarError as e:
                raise RequestError(f"request {request_id}: {e}") from None
        metrics = RequestMetrics(arrival_time=time.perf_counter())
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31))
        eos = frozenset() if params.ignore_eos or self.tokenizer is None else frozenset(self.tokenizer.eos_token_ids)
        rules = (TokenRules(params, self.tokenizer, self.model.config.vocab_size, eos)
                 if params.allowed_token_ids is not None or params.bad_words or params.min_tokens else None)
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
                detokenizer=(self.tokenizer.detokenizer(prompt_token_ids, params.skip_special_tokens)
                             if self.tokenizer else None),
                eos_token_ids=eos,
                leader=sequences[0] if sequences else None,
                lora_int_id=0 if lora_request is None else lora_request.lora_int_id,
                token_rules=rules,
                priority=priority,
            )
            if params.logprobs is not None:
                seq.output.cumulative_logprob = 0.0
            sequences.append(seq)
        state = RequestState(request_id, prompt, prompt_token_ids, sequences, metrics)
        self.requests[request_id] = state
        if future is None:
            for seq in sequences:
                self.scheduler.add(seq)
        else:
            if jax.process_count() > 1:
                # Lockstep hosts must admit it in the same step: wait here, so that
                # the next step finds the compile done (or failed) on every host.
                concurrent.futures.wait([future])
            self._pending.append((state, future, time.perf_counter() + self.config.structured_outputs_compile_timeout))

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar is ready; fail those whose compile
        failed or timed out (returned, finished, with their error)."""
        failed, still = [], []
        now = time.perf_counter()
        for state, future, deadline in self._pending:
            params = state.sequences[0].params
            if future.done():
                error = future.exception()
                if error is None:
                    compiled = future.result()
                    for seq in state.sequences:
                        seq.structured = StructuredState(compiled.new_matcher())
                        self.scheduler.add(seq)
                    continue
                message = str(error) if isinstance(error, GrammarError) else (
                    f"structured_outputs.{params.structured_outputs.kind}: {type(error).__name__}: {error}")
            elif now > deadline:
                message = self.grammar_timeout_message(params)
            else:
                still.append((state, future, deadline))
                continue
            state.error = f"request {state.request_id}: {message}"
            for seq in state.sequences:
                seq.output.finish_reason = "abort"
                seq.status = SequenceStatus.FINISHED
            state.metrics.finished_time = now
            del self.requests[state.request_id]
            failed.append(state.output())
        self._pending = still
        return failed

    def _fail_step(self, batch, message: str) -> list[RequestOutput]:
        """End every request with a sequence in a failed step: their state
        (computed tokens, blocks, matchers) is no longer known to be right.
        Their outputs carry the error, marked internal (a server answers 500)."""
        outputs = []
        for request_id in dict.fromkeys(s.request_id for s in batch.sequences):
            state = self.requests.get(request_id)
            if state is None:
                continue
            state.error, state.internal_error = f"request {request_id}: {message}", True
            output = self.abort(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self._pending = [p for p in self._pending if p[0] is not state]
        for seq in state.sequences:
            if not seq.is_finished:
                seq.output.finish_reason = "abort"
                seq.num_pending = 0  # an in-flight step's token for it is dropped (OutputProcessor.process)
                self.scheduler.finish(seq)
        state.metrics.finished_time = time.perf_counter()
        return state.output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self._in_flight is not None

    # -- one step ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the requests that made progress
        (finished ones for the last time, then forgotten). In a tracing turn
        while programs are still lowered in the background (tracing_turns.py)."""
        with TRACING_TURNS.step():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        compilations = self.runner.num_compilations
        device_before = self.runner.device_time + self.proposer.device_time
        failed = self._admit_compiled() if self._pending else []
        batch = self.scheduler.schedule()
        if not batch.sequences and self._in_flight is None:
            if self._pending and not failed:  # nothing to run but grammars compiling: wait, not spin
                concurrent.futures.wait([f for _, f, _ in self._pending], timeout=0.01,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            return failed
        outputs, launched = [], None
        if batch.sequences:
            now = time.perf_counter()
            for seq in batch.sequences:
                seq.metrics.first_scheduled_time = seq.metrics.first_scheduled_time or now
            tables = [self.block_manager.block_table_array(s.seq_id) for s in batch.sequences]
            launched, outputs = self._guarded(batch, lambda: (batch, self.runner.launch(batch, tables)))
        if self._in_flight is not None:  # the previous step, behind which this one is queued
            in_flight, self._in_flight = self._in_flight, None
            processed, failures = self._guarded(in_flight[0], lambda: self._complete(*in_flight, start, compilations))
            outputs += (processed or []) + failures
        if launched is not None:
            if self._overlaps(batch):
                self.output_processor.expect(batch, launched[1].num_emitted)
                self._in_flight = launched
            else:
                processed, failures = self._guarded(batch, lambda: self._complete(*launched, start, compilations))
                outputs += (processed or []) + failures
        device = self.runner.device_time + self.proposer.device_time - device_before
        self.device_time += device
        self.host_time += time.perf_counter() - start - device
        return failed + outputs

    def _overlaps(self, batch: ScheduledBatch) -> bool:
        """Whether the next step may be scheduled before this one's outputs
        are processed (async scheduling; the module docstring says when not)."""
        return self.config.async_scheduling and not batch.verifies_drafts and not any(
            s.structured is not None or s.token_rules is not None or s.params.uses_penalties
            for s in batch.sequences)

    def _guarded(self, batch: ScheduledBatch, step_part) -> tuple:
        """(step_part(), []) for a launch or a completion of `batch`; when it
        raises, (None, the outputs of the batch's requests, failed): whatever
        broke, it broke this step's requests only, unless the forward consumed
        the donated KV pool and gave none back (then no step can run again)."""
        try:
            return step_part(), []
        except Exception as e:  # noqa: BLE001
            if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.runner.kv_cache)):
                raise
            log.exception("engine step failed; failing the %d request(s) it held", len(batch.sequences))
            return None, self._fail_step(batch, f"engine step failed: {type(e).__name__}: {e}")

    def _complete(self, batch: ScheduledBatch, launched: Launched, start: float,
                  compilations: int) -> list[RequestOutput]:
        """Process a launched batch's outputs; `start` and `compilations`: the
        wall clock and the runner's compilation count when the engine step
        that completes it began (the same step that launched it whenever
        drafting runs: speculation never schedules asynchronously)."""
        out = self.runner.complete(launched)
        outputs = self.output_processor.process(batch, out, self.requests)
        # A step beside background compilation, or one that compiled its own
        # programs (warmup="on_demand"), times the compilation too.
        compiled = self.runner.compiling or self.runner.num_compilations != compilations
        self.proposer.after_step(batch, out, None if compiled else start)
        return outputs

    def outstanding_tokens(self) -> tuple[int, int]:
        """(prompt tokens not yet computed, tokens still to generate) over
        unfinished requests: what a data-parallel front end balances on."""
        prompt = generate = 0
        for seq in (*self.scheduler.running, *self.scheduler.waiting):
            prompt += max(0, len(seq.prompt_token_ids) - seq.num_computed_tokens)
            generate += seq.params.max_tokens - len(seq.output_token_ids)
        return prompt, generate

    # -- introspection -------------------------------------------------------
    def wait_compiled(self) -> None:
        """Block until every program is compiled (a background warm-up's rest
        included): benchmarks call it so that no compilation shares their clock."""
        self.runner.wait_compiled()

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting) requests: a request runs while any of its
        sequences holds a slot in the batch (vLLM's num_requests_running)."""
        running = {s.request_id for s in self.scheduler.running}
        waiting = {s.request_id for s in self.scheduler.waiting} - running
        return len(running), len(waiting) + len(self._pending)

    def stats(self) -> dict:
        bm, processed = self.block_manager, self.output_processor
        running, waiting = self.num_requests()
        return {
            "num_requests_running": running,
            "num_requests_waiting": waiting,
            "num_compilations": self.runner.num_compilations + self.proposer.num_compilations,
            # Programs a background warm-up has yet to compile (0 once done).
            "num_programs_compiling": self.runner.num_pending,
            # Compilations of a shape outside the bucket grid (each also logged as an error): 0.
            "num_compilations_off_grid": self.runner.num_off_grid,
            "kv_blocks_total": bm.num_usable_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "max_context_len": self.max_context_len,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "num_preemptions": self.scheduler.num_preemptions,
            "host_time_s": self.host_time,
            "device_time_s": self.device_time,
            # Speculative decoding (0 without): drafts verified, drafts accepted,
            # and (sequence, step) verifications with at least one draft.
            "spec_proposed_tokens": processed.num_draft_tokens,
            "spec_accepted_tokens": processed.num_accepted_tokens,
            "spec_verifications": processed.num_verifications,
            # Structured outputs: host seconds filling token bitmasks, and rows filled.
            "structured_mask_time_s": self.runner.mask_time,
            "structured_masks": self.runner.num_masks,
            # LoRA (0 without): adapters written into device slots, and the seconds it took.
            "lora_loads": 0 if self.lora is None else self.lora.num_loads,
            "lora_load_time_s": 0.0 if self.lora is None else self.lora.load_time,
        }
