"""Model runner: picks the bucket of a scheduled batch, builds its inputs
(engine/inputs.py), runs the step's programs (engine/programs.py) and brings
one StepOutput back to the host, whatever kind of step it was. Which programs
exist per bucket, and their compilation at warm-up, are its base class's
(engine/compiled_programs.py).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.engine.compiled_programs import CompiledPrograms
from jaxinfer.engine.executable_cache import ExecutableCache
from jaxinfer.engine.inputs import StepInputs, build_inputs
from jaxinfer.engine.programs import forward_step, sample_step, verify_step
from jaxinfer.engine.sampler import CONDITIONAL, SamplerWork, SamplingMetadata, make_penalty_inputs, needed_work
from jaxinfer.engine.scheduler import ScheduledBatch
from jaxinfer.engine.sequence import PLACEHOLDER, Sequence
from jaxinfer.engine.token_rules import constrained_this_step, fill_step_masks
from jaxinfer.structured.matcher import bitmask_width


class StepOutput(NamedTuple):
    """One step's results on the host; row i is batch sequence i (padding rows follow)."""

    # i32 [S, R]: sequence i emits token_ids[i, :num_emitted[i]], in order.
    token_ids: np.ndarray
    # i32 [S]: 0 for a prompt chunk that did not reach the prompt's end, 1 for a
    # plain step, 1 + accepted drafts for a sequence that verified drafts.
    num_emitted: np.ndarray
    # The sampler's logprob fields for each sequence's first emitted token (only
    # requests with logprobs read them, and those never draft); None when every
    # sequence verified drafts, or when no request asked for logprobs or
    # penalties (the plain sampler computes none).
    logprobs: np.ndarray | None
    logprob_token_ids: np.ndarray | None
    sampled_rank: np.ndarray | None
    # Device [T, hidden], for a runner built with_features (else None): the
    # pre-norm hidden state of every row, which an EAGLE proposer drafts from;
    # sequence i's rows are row_start[i]:row_start[i + 1].
    features: jax.Array | None
    row_start: np.ndarray


class Launched(NamedTuple):
    """A step on the device whose sampled tokens the host has not fetched yet
    (ModelRunner.launch; complete() fetches them)."""

    sampled: object  # the sampler's output on the device (None: every sequence verified drafts)
    token_ids: np.ndarray | None  # host tokens of a verification step, already fetched
    num_emitted: np.ndarray
    features: jax.Array | None
    row_start: np.ndarray


class ModelRunner(CompiledPrograms):
    def __init__(self, config: ModelConfig, params, kv_cache, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, backend,
                 num_speculative_tokens: int = 0, sampling: bool = True, with_features: bool = False,
                 mesh=None, lora=None, executable_cache: ExecutableCache | None = None):
        """backend: the model's platform backend (backends/) with the engine's
        attention option set in it; every forward runs through it.
        sampling=False: forward programs only (a draft model's runner, whose
        proposer takes its own argmax of the logits). with_features: steps
        return StepOutput.features (what a proposer's `needs_features` asks).
        lora: the engine's LoRASlots (lora/slots.py), or None: every forward
        then takes each row's adapter slot and the slots' current buffers.
        executable_cache: where warm-up finds and stores compiled programs
        (engine/executable_cache.py), or None."""
        # The bucket grid and its executables; sets backend, num_speculative_tokens and sampling.
        super().__init__(backend, max_num_seqs, max_num_batched_tokens, num_speculative_tokens, sampling,
                         executable_cache)
        self.config = config
        # The ("model",) mesh params and kv_cache are sharded over, or None (one device).
        self.mesh = mesh
        self.params = params
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.with_features = with_features
        self.lora = lora
        # A padded verify row sits at a position up to K beyond the sequence;
        # its table entry must exist (it reads the null block).
        self.max_blocks_per_seq = -(-(max_model_len + num_speculative_tokens) // block_size)
        self.device_time = 0.0  # seconds from dispatching a step to its outputs on the host
        # Structured outputs: host seconds filling token bitmasks, and the rows filled.
        self.mask_time = 0.0
        self.num_masks = 0
        # Per seqs bucket, an all-zeros bitmask and all-False flags kept on the
        # device: what a step with no constrained row passes (nothing to send).
        self._no_masks: dict[int, tuple] = {}
        # Async scheduling: the last launched step's sampled tokens, padded to
        # feed_size (every sequence bucket fits), on the device, and each of
        # its sequences' row in it; per token bucket, an all -1 feed index.
        self.feed_size = max(self.decode_buckets + [s for t in self.token_buckets for s in self._mixed_seq_buckets(t)])
        self._feed = self._put(np.zeros(self.feed_size, np.int32)) if mesh is not None else \
            jax.device_put(np.zeros(self.feed_size, np.int32))
        self._feed_rows: dict = {}
        self._no_feed_indices: dict[int, jax.Array] = {}

    @classmethod
    def for_engine(cls, model, config, kv_cache, lora=None, with_features: bool = False) -> ModelRunner:
        """The runner an engine with EngineConfig `config` steps `model` with
        (engine.py; early_compile.py builds the same one on the weights' shapes)."""
        return cls(model.config, model.params, kv_cache, config.block_size, config.max_model_len, config.max_num_seqs,
                   config.max_num_batched_tokens, model.backend.with_attention(config.attention),
                   config.num_speculative_tokens, with_features=with_features, mesh=model.mesh, lora=lora,
                   executable_cache=ExecutableCache.default(model.mesh))

    # -- programs ------------------------------------------------------------
    def _warmup_call(self, program: tuple):
        """(jitted program, placeholder arguments of the program's shapes, static arguments):
        what warm-up (engine/compiled_programs.py) lowers each program with."""
        kind, num_seqs = program[0], program[2] if program[0] == "forward" else program[1]
        sampling = SamplingMetadata.from_params([None] * num_seqs, [0] * num_seqs, [0] * num_seqs, num_seqs)
        vocab = self.config.vocab_size
        if kind == "forward":
            _, num_tokens, _, layout = program
            inputs = build_inputs([], [], [], [], num_tokens=num_tokens, num_seqs=num_seqs, layout=layout,
                                  block_size=self.block_size, max_blocks_per_seq=self.max_blocks_per_seq,
                                  seq_lora_slots=None if self.lora is None else [])
            return self._forward_call(inputs)
        if kind == "sample":
            full, work = program[2:]
            penalties = make_penalty_inputs([], [], vocab, num_seqs, logit_biases=[]) if full else None
            logits = self._put(np.zeros((num_seqs, vocab), np.float32))
            return self._sample_call(logits, sampling, penalties, full, work, self._no_mask(num_seqs))
        k = program[2]
        logits = self._put(np.zeros((num_seqs * (1 + k), vocab), np.float32))
        drafts, num_drafts = np.zeros((num_seqs, k), np.int32), np.zeros(num_seqs, np.int32)
        return self._verify_call(logits, drafts, num_drafts, sampling)

    def _run(self, program: tuple, fn, args: tuple, statics: dict):
        """Run `program`'s executable (compiled at warm-up, see _executable)."""
        return self._executable(program, fn, args, statics)(*args)

    def _put(self, tree):
        """Host inputs: as they are on one device (jit transfers them), replicated on a mesh."""
        if self.mesh is None:
            return tree
        from jaxinfer.parallel.placement import replicate

        return replicate(tree, self.mesh)

    def inputs(self, step_token_ids: list[list[int]], num_computed: list[int], num_new: list[int],
               block_tables: list, verify: bool = False, seq_lora_slots: list[int] | None = None
               ) -> StepInputs:
        """The bucketed inputs of a step (engine/inputs.py says what the lists hold)."""
        num_tokens, num_seqs, layout = self.bucket(sum(num_new), len(num_new), verify)
        return build_inputs(step_token_ids, num_computed, num_new, block_tables, num_tokens=num_tokens,
                            num_seqs=num_seqs, layout=layout, block_size=self.block_size,
                            max_blocks_per_seq=self.max_blocks_per_seq, seq_lora_slots=seq_lora_slots)

    def forward(self, inputs: StepInputs, feed_index=None):
        """-> (logits at inputs.logits_indices, pre-norm hidden of every row), on the device.
        feed_index: rows whose token is in the last step's feed (launch)."""
        program = ("forward", len(inputs.tokens), len(inputs.attn_meta.context_lens), inputs.layout)
        logits, features, self.kv_cache = self._run(program, *self._forward_call(inputs, feed_index))
        return logits, features

    def _forward_call(self, inputs: StepInputs, feed_index=None):
        if feed_index is None:
            feed_index = self._no_feed_index(len(inputs.tokens))
        tokens, meta, logits_indices, lora_slots, feed_index = self._put(
            (*inputs[:3], inputs.lora_slots, feed_index))
        params = self.params
        if self.lora is not None:  # the slots' buffers as they are now (loads replace them, same shapes)
            params = {**params, "layers": {**params["layers"], "lora": self.lora.buffers}}
        statics = dict(config=self.config, backend=self.backend, layout=inputs.layout,
                       with_features=self.with_features, mesh=self.mesh)
        return forward_step, (params, self.kv_cache, tokens, meta, logits_indices, lora_slots, self._feed,
                              feed_index), statics

    def _no_feed_index(self, num_tokens: int):
        """All -1 (every row's token from the host), kept on the device per token bucket."""
        if num_tokens not in self._no_feed_indices:
            index = np.full(num_tokens, -1, np.int32)
            self._no_feed_indices[num_tokens] = jax.device_put(index) if self.mesh is None else self._put(index)
        return self._no_feed_indices[num_tokens]

    def _no_mask(self, num_seqs: int) -> tuple:
        if num_seqs not in self._no_masks:
            masks = (np.zeros((num_seqs, bitmask_width(self.config.vocab_size)), np.int32), np.zeros(num_seqs, bool))
            # Kept on the device(s): on a mesh _put already places them (replicated,
            # possibly across hosts, which a plain device_put cannot take).
            self._no_masks[num_seqs] = jax.device_put(masks) if self.mesh is None else self._put(masks)
        return self._no_masks[num_seqs]

    def _token_masks(self, batch: ScheduledBatch, num_seqs: int) -> tuple:
        """(bitmask, constrained) for the sample program: filled for the
        constrained sequences (a grammar or token rules, engine/token_rules.py)
        that emit a token this step, else the resident zeros."""
        states = [(i, s) for i, s in enumerate(batch.sequences) if constrained_this_step(s) and
                  batch.num_computed_tokens[i] + batch.num_new_tokens[i] - batch.num_drafts[i] == s.num_tokens]
        if not states:
            return self._no_mask(num_seqs)
        start = time.perf_counter()
        bitmask = np.zeros((num_seqs, bitmask_width(self.config.vocab_size)), np.int32)
        constrained = np.zeros(num_seqs, bool)
        fill_step_masks(states, bitmask)
        constrained[[i for i, _ in states]] = True
        self.mask_time += time.perf_counter() - start
        self.num_masks += len(states)
        return self._put((bitmask, constrained))

    def _sample(self, logits, sampling, penalties, full: bool, work: SamplerWork, masks: tuple):
        return self._run(("sample", logits.shape[0], full, work),
                         *self._sample_call(logits, sampling, penalties, full, work, masks))

    def _sample_call(self, logits, sampling, penalties, full: bool, work: SamplerWork, masks: tuple):
        sampling, penalties = self._put((sampling, penalties))
        statics = dict(full=full, work=work, feed_size=self.feed_size, mesh=self.mesh)
        return sample_step, (logits, sampling, penalties, *masks), statics

    def _sampler_work(self, seqs: list[Sequence], full: bool) -> SamplerWork:
        """The sample program a batch runs: the one with just the pieces it
        needs (a backend without conditional skips), or else the greedy one
        for a plain greedy batch (it serves first, compiled_programs.py's
        serving_programs) and the conditional one for any other."""
        work = needed_work([s.params for s in seqs], self.config.vocab_size)
        if not self.backend.conditional_skips:
            return work
        return self.greedy_work if not work.draw and not full else CONDITIONAL

    def _verify(self, logits, drafts, num_drafts, sampling):
        return self._run(("verify", drafts.shape[0], drafts.shape[1]),
                         *self._verify_call(logits, drafts, num_drafts, sampling))

    def _verify_call(self, logits, drafts, num_drafts, sampling):
        drafts, num_drafts, sampling = self._put((drafts, num_drafts, sampling))
        return verify_step, (logits, drafts, num_drafts, sampling), dict(conditional=self.backend.conditional_skips,
                                                                          mesh=self.mesh)

    # -- one engine step -----------------------------------------------------
    def run(self, batch: ScheduledBatch, block_tables: list) -> StepOutput:
        """One step on the device: forward, then the sampler, or acceptance of
        the drafts and the sampler for the sequences that had none."""
        return self.complete(self.launch(batch, block_tables))

    def launch(self, batch: ScheduledBatch, block_tables: list) -> Launched:
        """Dispatch a step's programs without waiting for them (a verification
        step waits). A sequence's pending token (async scheduling,
        engine/sequence.py) is its sampled token of the last launched step,
        which the forward takes from that step's feed on the device."""
        seqs = batch.sequences
        verify = batch.verifies_drafts
        step_tokens = [s.token_ids_between(first, first + new)
                       for s, first, new in zip(seqs, batch.num_computed_tokens, batch.num_new_tokens)]
        inputs = self.inputs(step_tokens, batch.num_computed_tokens, batch.num_new_tokens, block_tables, verify,
                             None if self.lora is None else [s.lora_slot for s in seqs])
        num_seqs = len(inputs.attn_meta.context_lens)
        sampling = SamplingMetadata.from_params(
            [s.params for s in seqs], [s.seed for s in seqs], [s.num_output_tokens for s in seqs], num_seqs
        )
        # The full sampler (programs.py) when any request has penalties or asks for logprobs.
        full = any(s.params.uses_penalties or s.params.logprobs is not None for s in seqs)
        penalties = self._penalty_inputs(seqs, num_seqs) if full else None
        # A sequence emits once its step reaches its last token (a prompt chunk that does not, emits nothing).
        num_emitted = np.zeros(num_seqs, np.int32)
        num_emitted[: len(seqs)] = [first + new - drafts == s.num_tokens for s, first, new, drafts in
                                    zip(seqs, batch.num_computed_tokens, batch.num_new_tokens, batch.num_drafts)]

        start = time.perf_counter()
        logits, features = self.forward(inputs, self._feed_index(inputs, seqs))
        # Dispatch is asynchronous: the host fills the masks while the device runs the forward.
        masks = self._token_masks(batch, num_seqs)
        if not verify:
            sampled, self._feed = self._sample(logits, sampling, penalties, full, self._sampler_work(seqs, full), masks)
            self._feed_rows = {s.seq_id: i for i, s in enumerate(seqs)}
            self.device_time += time.perf_counter() - start
            return Launched(sampled, None, num_emitted, features, inputs.attn_meta.query_start)
        k = self.num_speculative_tokens
        drafts, num_drafts = np.zeros((num_seqs, k), np.int32), np.zeros(num_seqs, np.int32)
        for i, seq in enumerate(seqs):
            num_drafts[i] = batch.num_drafts[i]
            drafts[i, : num_drafts[i]] = seq.draft_token_ids
        token_ids, num_emitted, first_logits = self._verify(logits, drafts, num_drafts, sampling)
        token_ids, num_emitted = np.array(token_ids), np.array(num_emitted)
        sampled = None
        if not num_drafts[: len(seqs)].all():
            work = self._sampler_work(seqs, full)
            sampled = jax.device_get(self._sample(first_logits, sampling, penalties, full, work, masks)[0])
            drafted = num_drafts > 0
            token_ids[:, 0] = np.where(drafted, token_ids[:, 0], sampled.token_ids)
            num_emitted = np.where(drafted, num_emitted, 1)
        self.device_time += time.perf_counter() - start
        return Launched(sampled, token_ids, num_emitted, features, inputs.attn_meta.query_start)

    def complete(self, launched: Launched) -> StepOutput:
        """Wait for a launched step and bring its outputs to the host."""
        start = time.perf_counter()
        sampled = jax.device_get(launched.sampled)
        self.device_time += time.perf_counter() - start
        token_ids = sampled.token_ids[:, None] if launched.token_ids is None else launched.token_ids
        logprob_fields = (None, None, None) if sampled is None else tuple(sampled[1:])
        return StepOutput(token_ids, launched.num_emitted, *logprob_fields, launched.features, launched.row_start)

    def _feed_index(self, inputs: StepInputs, seqs: list[Sequence]):
        """Per row, where in the last launched step's feed its token is (a
        pending token: the rows holding PLACEHOLDER), else -1; None when no
        row has one."""
        rows = np.flatnonzero(inputs.tokens == PLACEHOLDER)
        if not len(rows):
            return None
        feed_index = np.full(len(inputs.tokens), -1, np.int32)
        feed_index[rows] = [self._feed_rows[seqs[inputs.attn_meta.token_seq[row]].seq_id] for row in rows]
        return feed_index

    def _penalty_inputs(self, seqs: list[Sequence], num_seqs: int):
        return make_penalty_inputs([s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
                                   self.config.vocab_size, num_seqs, [s.params.logit_bias for s in seqs])
