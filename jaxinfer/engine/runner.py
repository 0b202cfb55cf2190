"""Model runner: picks the bucket of a scheduled batch, builds its inputs
(engine/inputs.py), runs the step's programs (engine/programs.py) and brings
one StepOutput back to the host, whatever kind of step it was.

Buckets: a pure-decode step (one new token per sequence) runs in (n, n) for
n a power of two from 1 up to max_num_seqs: no padding tokens, and the
Pallas backend serves it with its split-k decode kernel. Other steps pad the
flattened token count to a power of two from 16 up to max_num_batched_tokens
and the sequence count to a power of two from 8 up to max_num_seqs. With K
speculative tokens, a step that verifies drafts runs in (n (1 + K), n) for the
decode buckets n. Everything compiles at warm-up; a compilation after
warm-up is counted and logged as an error.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.config import ModelConfig
from jaxinfer.engine.inputs import StepInputs, build_inputs
from jaxinfer.engine.programs import forward_step, sample_step, verify_step
from jaxinfer.engine.sampler import SamplingMetadata, make_penalty_inputs
from jaxinfer.engine.scheduler import ScheduledBatch
from jaxinfer.engine.sequence import Sequence
from jaxinfer.structured.matcher import bitmask_width, fill_masks
from jaxinfer.utils import bucket_size, powers_of_two

log = logging.getLogger(__name__)


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


class ModelRunner:
    def __init__(self, config: ModelConfig, params, kv_cache, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, attention_backend: str = "xla",
                 num_speculative_tokens: int = 0, sampling: bool = True, with_features: bool = False,
                 mesh=None, lora=None):
        """sampling=False: forward programs only (a draft model's runner, whose
        proposer takes its own argmax of the logits). with_features: steps
        return StepOutput.features (what a proposer's `needs_features` asks).
        lora: the engine's LoRASlots (lora/slots.py), or None: every forward
        then takes each row's adapter slot and the slots' current buffers."""
        self.config = config
        # The ("model",) mesh params and kv_cache are sharded over, or None (one device).
        self.mesh = mesh
        self.attention_backend = attention_backend
        self.params = params
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens
        self.sampling = sampling
        self.with_features = with_features
        self.lora = lora
        # A padded verify row sits at a position up to K beyond the sequence;
        # its table entry must exist (it reads the null block).
        self.max_blocks_per_seq = -(-(max_model_len + num_speculative_tokens) // block_size)
        self.token_buckets = powers_of_two(16, max_num_batched_tokens)
        self.seq_buckets = powers_of_two(8, max_num_seqs)
        # Padding one decode token to 16 would multiply a memory-bound step's compute by 16.
        self.decode_buckets = powers_of_two(1, max_num_seqs)
        self.compiled_programs: set = set()
        self.warmed_up = False
        self.num_compilations = 0
        self.device_time = 0.0  # seconds from dispatching a step to its outputs on the host
        # Structured outputs: host seconds filling token bitmasks, and the rows filled.
        self.mask_time = 0.0
        self.num_masks = 0
        # Per seqs bucket, an all-zeros bitmask and all-False flags kept on the
        # device: what a step with no constrained row passes (nothing to send).
        self._no_masks: dict[int, tuple] = {}

    # -- buckets and warm-up -------------------------------------------------
    def buckets(self) -> list[tuple[int, int, str]]:
        """(tokens, seqs, layout) buckets of the forward program."""
        buckets = [(n, n, "decode") for n in self.decode_buckets]
        # >= 1 token per sequence, so seqs <= tokens.
        buckets += [(t, s, "mixed") for t in self.token_buckets for s in self.seq_buckets if s <= t]
        k = self.num_speculative_tokens
        return buckets + [(n * (1 + k), n, "verify") for n in self.decode_buckets if k]

    def programs(self) -> list[tuple]:
        """Every program warm-up compiles: the forward per bucket, the sampler
        per seqs bucket, plain or full (programs.py), and acceptance per decode bucket."""
        programs = [("forward", *bucket) for bucket in self.buckets()]
        if not self.sampling:
            return programs
        seq_sizes = sorted({s for _, s, _ in self.buckets()})
        programs += [("sample", s, full) for s in seq_sizes for full in (False, True)]
        k = self.num_speculative_tokens
        return programs + [("verify", n, k) for n in self.decode_buckets if k]

    def bucket(self, num_tokens: int, num_seqs: int, verify: bool = False) -> tuple[int, int, str]:
        if verify:
            n = bucket_size(num_seqs, 1)
            return n * (1 + self.num_speculative_tokens), n, "verify"
        if num_tokens == num_seqs:
            n = bucket_size(num_seqs, 1)
            return n, n, "decode"
        return bucket_size(num_tokens, 16), bucket_size(num_seqs, 8), "mixed"

    def warmup(self, progress: bool = True) -> None:
        vocab = self.config.vocab_size
        for program in tqdm(self.programs(), desc="compiling", unit="program", disable=not progress, leave=False):
            kind, num_seqs = program[0], program[2] if program[0] == "forward" else program[1]
            sampling = SamplingMetadata.from_params([None] * num_seqs, [0] * num_seqs, [0] * num_seqs, num_seqs)
            if kind == "forward":
                _, num_tokens, _, layout = program
                inputs = build_inputs([], [], [], [], num_tokens=num_tokens, num_seqs=num_seqs, layout=layout,
                                      block_size=self.block_size, max_blocks_per_seq=self.max_blocks_per_seq,
                                      seq_lora_slots=None if self.lora is None else [])
                jax.block_until_ready(self.forward(inputs))
            elif kind == "sample":
                full = program[2]
                penalties = make_penalty_inputs([], [], vocab, num_seqs) if full else None
                logits = self._put(np.zeros((num_seqs, vocab), np.float32))
                jax.block_until_ready(self._sample(logits, sampling, penalties, full, self._no_mask(num_seqs)))
            else:
                k = program[2]
                logits = self._put(np.zeros((num_seqs * (1 + k), vocab), np.float32))
                drafts, num_drafts = np.zeros((num_seqs, k), np.int32), np.zeros(num_seqs, np.int32)
                jax.block_until_ready(self._verify(logits, drafts, num_drafts, sampling))
        self.warmed_up = True

    def _count(self, program: tuple) -> None:
        if program not in self.compiled_programs:
            self.compiled_programs.add(program)
            self.num_compilations += 1
            if self.warmed_up:
                log.error("compilation after warm-up of %s: a shape escaped bucketing", program)

    def _put(self, tree):
        """Host inputs: as they are on one device (jit transfers them), replicated on a mesh."""
        if self.mesh is None:
            return tree
        from jaxinfer.parallel.placement import replicate

        return replicate(tree, self.mesh)

    # -- programs ------------------------------------------------------------
    def inputs(self, token_ids: list[list[int]], num_computed: list[int], num_new: list[int],
               block_tables: list[list[int]], verify: bool = False, seq_lora_slots: list[int] | None = None
               ) -> StepInputs:
        """The bucketed inputs of a step (engine/inputs.py says what the lists hold)."""
        num_tokens, num_seqs, layout = self.bucket(sum(num_new), len(num_new), verify)
        return build_inputs(token_ids, num_computed, num_new, block_tables, num_tokens=num_tokens,
                            num_seqs=num_seqs, layout=layout, block_size=self.block_size,
                            max_blocks_per_seq=self.max_blocks_per_seq, seq_lora_slots=seq_lora_slots)

    def forward(self, inputs: StepInputs):
        """-> (logits at inputs.logits_indices, pre-norm hidden of every row), on the device."""
        num_seqs = len(inputs.attn_meta.context_lens)
        self._count(("forward", len(inputs.tokens), num_seqs, inputs.layout))
        tokens, meta, logits_indices, lora_slots = self._put((*inputs[:3], inputs.lora_slots))
        params = self.params
        if self.lora is not None:  # the slots' buffers as they are now (loads replace them)
            params = {**params, "layers": {**params["layers"], "lora": self.lora.buffers}}
        logits, features, self.kv_cache = forward_step(
            params, self.kv_cache, tokens, meta, logits_indices, lora_slots, config=self.config,
            backend=self.attention_backend, layout=inputs.layout, with_features=self.with_features, mesh=self.mesh,
        )
        return logits, features

    def _no_mask(self, num_seqs: int) -> tuple:
        if num_seqs not in self._no_masks:
            masks = (np.zeros((num_seqs, bitmask_width(self.config.vocab_size)), np.int32), np.zeros(num_seqs, bool))
            # Kept on the device(s): on a mesh _put already places them (replicated,
            # possibly across hosts, which a plain device_put cannot take).
            self._no_masks[num_seqs] = jax.device_put(masks) if self.mesh is None else self._put(masks)
        return self._no_masks[num_seqs]

    def _token_masks(self, batch: ScheduledBatch, num_seqs: int) -> tuple:
        """(bitmask, constrained) for the sample program: filled for the
        structured sequences that emit a token this step, else the resident zeros."""
        states = [(i, s.structured) for i, s in enumerate(batch.sequences) if s.structured is not None and
                  batch.num_computed_tokens[i] + batch.num_new_tokens[i] - batch.num_drafts[i] == s.num_tokens]
        if not states:
            return self._no_mask(num_seqs)
        start = time.perf_counter()
        bitmask = np.zeros((num_seqs, bitmask_width(self.config.vocab_size)), np.int32)
        constrained = np.zeros(num_seqs, bool)
        fill_masks(states, bitmask)
        constrained[[i for i, _ in states]] = True
        self.mask_time += time.perf_counter() - start
        self.num_masks += len(states)
        return self._put((bitmask, constrained))

    def _sample(self, logits, sampling, penalties, full: bool, masks: tuple):
        self._count(("sample", logits.shape[0], full))
        sampling, penalties = self._put((sampling, penalties))
        return sample_step(logits, sampling, penalties, *masks, full=full, mesh=self.mesh)

    def _verify(self, logits, drafts, num_drafts, sampling):
        self._count(("verify", drafts.shape[0], drafts.shape[1]))
        drafts, num_drafts, sampling = self._put((drafts, num_drafts, sampling))
        return verify_step(logits, drafts, num_drafts, sampling, mesh=self.mesh)

    # -- one engine step -----------------------------------------------------
    def run(self, batch: ScheduledBatch, block_tables: list[list[int]]) -> StepOutput:
        """One step on the device: forward, then the sampler, or acceptance of
        the drafts and the sampler for the sequences that had none."""
        seqs = batch.sequences
        verify = batch.verifies_drafts
        inputs = self.inputs([s.token_ids() + s.draft_token_ids for s in seqs], batch.num_computed_tokens,
                             batch.num_new_tokens, block_tables, verify,
                             None if self.lora is None else [s.lora_slot for s in seqs])
        num_seqs = len(inputs.attn_meta.context_lens)
        sampling = SamplingMetadata.from_params(
            [s.params for s in seqs], [s.seed for s in seqs], [len(s.output_token_ids) for s in seqs], num_seqs
        )
        # The full sampler (programs.py) when any request has penalties or asks for logprobs.
        full = any(s.params.uses_penalties or s.params.logprobs is not None for s in seqs)
        penalties = self._penalty_inputs(seqs, num_seqs) if full else None

        start = time.perf_counter()
        logits, features = self.forward(inputs)
        # Dispatch is asynchronous: the host fills the masks while the device runs the forward.
        masks = self._token_masks(batch, num_seqs)
        if verify:
            k = self.num_speculative_tokens
            drafts, num_drafts = np.zeros((num_seqs, k), np.int32), np.zeros(num_seqs, np.int32)
            for i, seq in enumerate(seqs):
                num_drafts[i] = batch.num_drafts[i]
                drafts[i, : num_drafts[i]] = seq.draft_token_ids
            token_ids, num_emitted, first_logits = self._verify(logits, drafts, num_drafts, sampling)
            token_ids, num_emitted = np.array(token_ids), np.array(num_emitted)
            plain = None
            if not num_drafts[: len(seqs)].all():
                plain = jax.device_get(self._sample(first_logits, sampling, penalties, full, masks))
                drafted = num_drafts > 0
                token_ids[:, 0] = np.where(drafted, token_ids[:, 0], plain.token_ids)
                num_emitted = np.where(drafted, num_emitted, 1)
        else:
            plain = jax.device_get(self._sample(logits, sampling, penalties, full, masks))
            token_ids = plain.token_ids[:, None]
            # A sequence emits once its step reaches its last token (a prompt chunk that does not, emits nothing).
            num_emitted = np.zeros(num_seqs, np.int32)
            num_emitted[: len(seqs)] = [first + new == s.num_tokens for s, first, new in
                                        zip(seqs, batch.num_computed_tokens, batch.num_new_tokens)]
        self.device_time += time.perf_counter() - start
        logprob_fields = (None, None, None) if plain is None else tuple(plain[1:])
        return StepOutput(token_ids, num_emitted, *logprob_fields, features, inputs.attn_meta.query_start)

    def _penalty_inputs(self, seqs: list[Sequence], num_seqs: int):
        return make_penalty_inputs([s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
                                   self.config.vocab_size, num_seqs)
