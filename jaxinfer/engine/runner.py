"""Model runner: turns a scheduled batch into padded host arrays, runs the
one jitted step for its bucket on the device, and returns sampled tokens.

Shapes are bucketed: the flattened token count to a power of two from 16 up
to max_num_batched_tokens, the sequence count to a power of two from 8 up to
max_num_seqs. Pure-decode steps (one new token per sequence) get their own
buckets, (n, n) for n a power of two from 1 up to max_num_seqs: no padding
tokens, and the Pallas backend serves them with its split-k decode kernel.
A step is two jitted calls with the logits staying on the device between
them: the model forward, compiled per (tokens, seqs) bucket, and the sampler,
compiled per seqs bucket and per whether any sequence uses repetition/
presence/frequency penalties (those need [seqs, vocab] inputs). Splitting them
keeps the sampler's variants from multiplying the model's compilations.
Everything compiles at warm-up; a compilation after warm-up is counted and
logged as an error. The paged KV pool is donated into each forward call, so
it is updated in place.

Speculative decoding (num_speculative_tokens K > 0) adds two programs per
decode bucket n, keyed by (n, K): the verification forward over n sequences
of exactly 1 + K rows each (the last token, then the drafts; a sequence with
fewer drafts pads its rows, which write to the null block and whose logits
verification ignores), with logits at every row, attending through
spec/attention.py (one context gather per sequence, not per row; the
multi-query decode kernel on Pallas backends); and `_verify_step`
(spec/acceptance.verify on the device). Rows without drafts take their token
from the ordinary sampler program of bucket n on their first row's logits,
so penalties and logprobs (whose requests never get drafts) work unchanged
in a verification step and no penalty variant of verification is compiled.
Only pure-decode steps verify drafts, so the token count is always n(1 + K)
and one program per n suffices. A draft model's runner is `greedy_only`: its
sampler is an argmax.

Tensor parallelism: with a mesh (parallel/), the params and the pool arrive
sharded, the host inputs are placed replicated on the mesh, `mesh` is a
static argument of every program (the Pallas attention runs per shard with
shard_map, parallel/attention.py) and the sampled outputs are constrained to
be replicated, so every device (every host, in a multi-host run) holds the
tokens. Without a mesh the programs are exactly the single-device ones.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxinfer.config import ModelConfig
from jaxinfer.engine.request import Sequence
from jaxinfer.engine.sampler import SamplingMetadata, make_penalty_inputs, sample
from jaxinfer.engine.scheduler import ScheduledBatch
from jaxinfer.models.layers import rms_norm
from jaxinfer.models.llama import compute_logits, forward
from jaxinfer.models.paged_attention import PagedAttentionMetadata, paged_cache_attention
from jaxinfer.parallel.mesh import MODEL_AXIS
from jaxinfer.sampling_params import MAX_LOGPROBS
from jaxinfer.spec.acceptance import verify, verify_greedy
from jaxinfer.spec.attention import verification_attention
from jaxinfer.utils import bucket_size, powers_of_two

log = logging.getLogger(__name__)


def uses_penalties(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _body(params, config: ModelConfig, kv_cache, tokens, attn_meta, attention, with_features: bool):
    """-> (hidden after the final norm [T, hidden], features or None, cache);
    features are the pre-norm hidden states of every row (spec/eagle_head.py)."""
    pre, kv_cache = forward(params, config, tokens[None], attn_meta.positions[None], attention, kv_cache,
                            final_norm=False)
    hidden = rms_norm(pre[0], params["final_norm"], config.rms_norm_eps)
    return hidden, (pre[0] if with_features else None), kv_cache


def _replicated(tree, mesh):
    """Outputs that go to the host: replicated on the mesh (a no-op without one)."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, NamedSharding(mesh, PartitionSpec()))


def _gathered_logits(logits, mesh):
    """Vocab-parallel logits, then all-gathered. The first constraint matters:
    asked only for replicated logits, GSPMD all-gathers the (vocab-split) head
    weight instead and multiplies it whole on every device, which for a real
    vocabulary moves the whole head every step rather than [rows, vocab]."""
    if mesh is None:
        return logits
    if logits.shape[-1] % mesh.size == 0:
        vocab_split = PartitionSpec(*([None] * (logits.ndim - 1)), MODEL_AXIS)
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, vocab_split))
    return _replicated(logits, mesh)


@functools.partial(jax.jit, static_argnames=("config", "backend", "decode", "with_features", "mesh"),
                   donate_argnames=("kv_cache",))
def _forward_step(params, kv_cache, tokens, attn_meta, logits_indices, *, config: ModelConfig, backend: str,
                  decode: bool, with_features: bool = False, mesh=None):
    attention = paged_cache_attention(attn_meta, config.sliding_window, backend, decode, mesh)
    hidden, features, kv_cache = _body(params, config, kv_cache, tokens, attn_meta, attention, with_features)
    # Logits only where a token is sampled: one row per sequence. On a mesh they
    # come out split on vocab; the sampler needs whole rows, so gather them here,
    # once, in a sharding the sampler's programs are compiled for.
    return _gathered_logits(compute_logits(params, hidden[logits_indices]), mesh), features, kv_cache


@functools.partial(jax.jit, static_argnames=("with_penalties", "mesh"))
def _sample_step(logits, sampling_meta, penalty_inputs, *, with_penalties: bool, mesh=None):
    prompt_mask, output_counts = penalty_inputs if with_penalties else (None, None)
    return _replicated(sample(logits, sampling_meta, prompt_mask, output_counts, num_logprobs=MAX_LOGPROBS), mesh)


class SpecOutput(NamedTuple):
    """A verification step's result on the host."""

    token_ids: np.ndarray  # i32 [S, 1 + K]: the first num_emitted are emitted
    num_emitted: np.ndarray  # i32 [S]: accepted drafts + 1
    # The ordinary sampler's fields for the first row (None when every row had drafts).
    logprobs: np.ndarray | None
    logprob_token_ids: np.ndarray | None
    sampled_rank: np.ndarray | None


@functools.partial(jax.jit, static_argnames=("config", "backend", "with_features", "mesh"),
                   donate_argnames=("kv_cache",))
def _spec_forward_step(params, kv_cache, tokens, attn_meta, *, config: ModelConfig, backend: str,
                       with_features: bool = False, mesh=None):
    """-> logits at every row [S, 1 + K, V], the first rows' [S, V], features, and the cache."""
    num_seqs = attn_meta.context_lens.shape[0]
    rows = tokens.shape[0] // num_seqs
    attention = verification_attention(attn_meta, rows, config.sliding_window, backend, mesh)
    hidden, features, kv_cache = _body(params, config, kv_cache, tokens, attn_meta, attention, with_features)
    logits = _gathered_logits(compute_logits(params, hidden).reshape(num_seqs, rows, -1), mesh)
    return logits, logits[:, 0], features, kv_cache


@functools.partial(jax.jit, static_argnames=("mesh",))
def _verify_step(logits, draft_tokens, num_drafts, sampling_meta, *, mesh=None):
    return _replicated(jax.lax.cond(
        jnp.all(sampling_meta.temperature <= 0.0),
        lambda: verify_greedy(logits, draft_tokens, num_drafts),
        lambda: verify(logits, draft_tokens, num_drafts, sampling_meta),
    ), mesh)


@functools.partial(jax.jit, static_argnames=("mesh",))
def _argmax_step(logits, *, mesh=None):
    # The lowest id wins ties, as in the sampler's greedy rows.
    return _replicated(jnp.argmax(logits, axis=-1).astype(jnp.int32), mesh)


class ModelRunner:
    def __init__(self, config: ModelConfig, params, kv_cache, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, attention_backend: str = "xla",
                 num_speculative_tokens: int = 0, greedy_only: bool = False, with_features: bool = False,
                 mesh=None):
        self.config = config
        # The ("model",) mesh params and kv_cache are sharded over, or None (one device).
        self.mesh = mesh
        # with_features: every forward also returns the pre-norm hidden state of
        # each row, kept in `last_features` (device, [rows, hidden]) for an
        # EAGLE proposer; off otherwise, so no other engine pays for it.
        self.with_features = with_features
        self.last_features = None
        self.attention_backend = attention_backend
        self.params = params
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens
        self.greedy_only = greedy_only
        # A verification row past the last draft sits at a position up to K
        # beyond the sequence; its table entry must exist (it reads the null block).
        self.max_blocks_per_seq = -(-(max_model_len + num_speculative_tokens) // block_size)
        self.token_buckets = powers_of_two(16, max_num_batched_tokens)
        self.seq_buckets = powers_of_two(8, max_num_seqs)
        # Padding one decode token to 16 would multiply a memory-bound step's compute by 16.
        self.decode_buckets = powers_of_two(1, max_num_seqs)
        self.compiled_programs: set = set()
        self.warmed_up = False
        self.num_compilations = 0

    def buckets(self) -> list[tuple[int, int, bool]]:
        """(tokens, seqs, decode) buckets of the forward program."""
        decode = [(n, n, True) for n in self.decode_buckets]
        # >= 1 token per sequence, so seqs <= tokens.
        return decode + [(t, s, False) for t in self.token_buckets for s in self.seq_buckets if s <= t]

    def programs(self) -> list[tuple]:
        """Every program warm-up compiles: forward per bucket, sampler per seqs
        bucket and penalty flag (an argmax per seqs bucket when greedy_only),
        and with K drafts, verification forward and acceptance per decode bucket."""
        seq_sizes = sorted({s for _, s, _ in self.buckets()})
        forward = [("forward", *bucket) for bucket in self.buckets()]
        if self.greedy_only:
            return forward + [("argmax", s) for s in seq_sizes]
        programs = forward + [("sample", s, pen) for s in seq_sizes for pen in (False, True)]
        k = self.num_speculative_tokens
        if k:
            programs += [("spec_forward", n, k) for n in self.decode_buckets]
            programs += [("verify", n, k) for n in self.decode_buckets]
        return programs

    def bucket(self, num_tokens: int, num_seqs: int) -> tuple[int, int, bool]:
        if num_tokens == num_seqs:
            n = bucket_size(num_seqs, 1)
            return n, n, True
        return bucket_size(num_tokens, 16), bucket_size(num_seqs, 8), False

    def warmup(self, progress: bool = True) -> None:
        vocab = self.config.vocab_size
        for program in tqdm(self.programs(), desc="compiling", unit="program", disable=not progress, leave=False):
            kind = program[0]
            if kind == "forward":
                _, num_tokens, num_seqs, decode = program
                tokens, meta, _ = self._dummy_forward_inputs(num_tokens, num_seqs)
                jax.block_until_ready(self._forward(tokens, meta, np.zeros(num_seqs, np.int32), decode))
            elif kind == "spec_forward":
                _, num_seqs, k = program
                tokens, meta, _ = self._dummy_forward_inputs(num_seqs * (1 + k), num_seqs)
                jax.block_until_ready(self._spec_forward(tokens, meta))
            elif kind == "argmax":
                _, num_seqs = program
                jax.block_until_ready(self._argmax(self._put(np.zeros((num_seqs, vocab), np.float32))))
            else:
                num_seqs = program[1]
                sampling = SamplingMetadata.from_params([None] * num_seqs, [0] * num_seqs, [0] * num_seqs, num_seqs)
                if kind == "sample":
                    with_penalties = program[2]
                    penalties = make_penalty_inputs([], [], vocab, num_seqs) if with_penalties else None
                    logits = self._put(np.zeros((num_seqs, vocab), np.float32))
                    jax.block_until_ready(self._sample(logits, sampling, penalties, with_penalties))
                else:
                    k = program[2]
                    logits = self._put(np.zeros((num_seqs, 1 + k, vocab), np.float32))
                    drafts, num_drafts = np.zeros((num_seqs, k), np.int32), np.zeros(num_seqs, np.int32)
                    jax.block_until_ready(self._verify(logits, drafts, num_drafts, sampling))
        self.warmed_up = True

    def _dummy_forward_inputs(self, num_tokens: int, num_seqs: int):
        meta = PagedAttentionMetadata(
            slot_mapping=np.zeros(num_tokens, np.int32),
            positions=np.zeros(num_tokens, np.int32),
            token_seq=np.zeros(num_tokens, np.int32),
            block_tables=np.zeros((num_seqs, self.max_blocks_per_seq), np.int32),
            context_lens=np.zeros(num_seqs, np.int32),
            query_start=np.zeros(num_seqs + 1, np.int32),
        )
        return np.zeros(num_tokens, np.int32), meta, np.zeros(num_seqs, np.int32)

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

    def _forward(self, tokens, meta, logits_indices, decode: bool):
        self._count(("forward", len(tokens), len(logits_indices), decode))
        tokens, meta, logits_indices = self._put((tokens, meta, logits_indices))
        logits, self.last_features, self.kv_cache = _forward_step(
            self.params, self.kv_cache, tokens, meta, logits_indices, config=self.config,
            backend=self.attention_backend, decode=decode, with_features=self.with_features, mesh=self.mesh,
        )
        return logits

    def _sample(self, logits, sampling, penalties, with_penalties: bool):
        self._count(("sample", logits.shape[0], with_penalties))
        sampling, penalties = self._put((sampling, penalties))
        return _sample_step(logits, sampling, penalties, with_penalties=with_penalties, mesh=self.mesh)

    def _spec_forward(self, tokens, meta):
        num_seqs = len(meta.context_lens)
        self._count(("spec_forward", num_seqs, len(tokens) // num_seqs - 1))
        tokens, meta = self._put((tokens, meta))
        logits, first_logits, self.last_features, self.kv_cache = _spec_forward_step(
            self.params, self.kv_cache, tokens, meta, config=self.config, backend=self.attention_backend,
            with_features=self.with_features, mesh=self.mesh,
        )
        return logits, first_logits

    def _verify(self, logits, drafts, num_drafts, sampling):
        self._count(("verify", drafts.shape[0], drafts.shape[1]))
        drafts, num_drafts, sampling = self._put((drafts, num_drafts, sampling))
        return _verify_step(logits, drafts, num_drafts, sampling, mesh=self.mesh)

    def _argmax(self, logits):
        self._count(("argmax", logits.shape[0]))
        return _argmax_step(logits, mesh=self.mesh)

    def run(self, inputs, with_penalties: bool):
        """One step on the device: forward, then sampling; returns the SamplerOutput (device arrays)."""
        tokens, meta, logits_indices, decode, sampling, penalties = inputs
        return self._sample(self._forward(tokens, meta, logits_indices, decode), sampling, penalties, with_penalties)

    def run_greedy(self, inputs):
        """One step of a greedy_only runner: forward, then argmax; int32 [seqs bucket] (device)."""
        tokens, meta, logits_indices, decode, _, _ = inputs
        return self._argmax(self._forward(tokens, meta, logits_indices, decode))

    def run_spec(self, inputs, with_penalties: bool) -> SpecOutput:
        """One verification step: forward with logits at every row, acceptance,
        and the ordinary sampler for rows without drafts when there are any
        (padding rows count: they are real sequences only below num_real)."""
        tokens, meta, drafts, num_drafts, sampling, penalties, num_real = inputs
        logits, first_logits = self._spec_forward(tokens, meta)
        verified = self._verify(logits, drafts, num_drafts, sampling)
        plain = None
        if not num_drafts[:num_real].all():
            plain = self._sample(first_logits, sampling, penalties, with_penalties)
        token_ids, num_emitted = np.array(verified[0]), np.array(verified[1])
        if plain is None:
            return SpecOutput(token_ids, num_emitted, None, None, None)
        drafted = num_drafts > 0
        token_ids[:, 0] = np.where(drafted, token_ids[:, 0], np.asarray(plain.token_ids))
        num_emitted = np.where(drafted, num_emitted, 1)
        return SpecOutput(token_ids, num_emitted, *(np.asarray(x) for x in plain[1:]))

    def prepare(self, batch: ScheduledBatch, block_tables: list[list[int]]):
        """Host arrays for one step, padded to the batch's bucket."""
        num_tokens, num_seqs, decode = self.bucket(sum(batch.num_new_tokens), len(batch))
        tokens = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        slots = np.zeros(num_tokens, np.int32)  # padding writes into the null block
        token_seq = np.zeros(num_tokens, np.int32)
        tables = np.zeros((num_seqs, self.max_blocks_per_seq), np.int32)
        context_lens = np.zeros(num_seqs, np.int32)
        logits_indices = np.zeros(num_seqs, np.int32)
        query_start = np.zeros(num_seqs + 1, np.int32)
        start = 0
        for i, (seq, num_new, table) in enumerate(zip(batch.sequences, batch.num_new_tokens, block_tables)):
            first = seq.num_computed_tokens
            pos = np.arange(first, first + num_new, dtype=np.int32)
            table = np.asarray(table, np.int32)
            tokens[start : start + num_new] = seq.token_ids()[first : first + num_new]
            positions[start : start + num_new] = pos
            slots[start : start + num_new] = table[pos // self.block_size] * self.block_size + pos % self.block_size
            token_seq[start : start + num_new] = i
            tables[i, : len(table)] = table
            context_lens[i] = first + num_new
            logits_indices[i] = start + num_new - 1
            start += num_new
            query_start[i + 1] = start
        query_start[len(batch) + 1 :] = start  # padding sequences own no rows
        meta = PagedAttentionMetadata(slots, positions, token_seq, tables, context_lens, query_start)
        if self.greedy_only:
            return (tokens, meta, logits_indices, decode, None, None), False
        sampling, penalties, with_penalties = self._sampling_inputs(batch.sequences, num_seqs)
        return (tokens, meta, logits_indices, decode, sampling, penalties), with_penalties

    def _sampling_inputs(self, seqs: list[Sequence], num_seqs: int):
        sampling = SamplingMetadata.from_params(
            [s.params for s in seqs], [s.seed for s in seqs], [len(s.output_token_ids) for s in seqs], num_seqs
        )
        with_penalties = any(uses_penalties(s) for s in seqs)
        penalties = None
        if with_penalties:
            penalties = make_penalty_inputs(
                [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs], self.config.vocab_size, num_seqs
            )
        return sampling, penalties, with_penalties

    def prepare_spec(self, batch: ScheduledBatch, block_tables: list[list[int]], drafts: list[list[int]]):
        """Host arrays for a verification step of a pure-decode batch: each
        sequence's last token and its drafts (at most K), padded to 1 + K rows
        and to a decode bucket of sequences. The caller has allocated blocks
        for every draft. Padding rows write to the null block; the sequence's
        context length counts them, so that query row j sits at position
        num_computed + j as bottom-right causal attention expects, and a real
        row never attends to them (they come after it)."""
        k = self.num_speculative_tokens
        rows = 1 + k
        num_seqs = bucket_size(len(batch), 1)
        tokens = np.zeros(num_seqs * rows, np.int32)
        positions = np.zeros(num_seqs * rows, np.int32)
        slots = np.zeros(num_seqs * rows, np.int32)
        token_seq = np.zeros(num_seqs * rows, np.int32)
        tables = np.zeros((num_seqs, self.max_blocks_per_seq), np.int32)
        context_lens = np.zeros(num_seqs, np.int32)
        query_start = np.zeros(num_seqs + 1, np.int32)
        draft_tokens = np.zeros((num_seqs, k), np.int32)
        num_drafts = np.zeros(num_seqs, np.int32)
        for i, (seq, table, draft) in enumerate(zip(batch.sequences, block_tables, drafts)):
            first = seq.num_computed_tokens
            if first != seq.num_tokens - 1 or len(draft) > k:
                raise ValueError(f"sequence {seq.seq_id}: not a decode step with at most {k} drafts")
            start, real = i * rows, 1 + len(draft)
            pos = np.arange(first, first + rows, dtype=np.int32)
            table = np.asarray(table, np.int32)
            tokens[start] = seq.output_token_ids[-1] if seq.output_token_ids else seq.prompt_token_ids[-1]
            tokens[start + 1 : start + real] = draft
            positions[start : start + rows] = pos
            slots[start : start + real] = table[pos[:real] // self.block_size] * self.block_size + pos[:real] % self.block_size
            token_seq[start : start + rows] = i
            tables[i, : len(table)] = table
            context_lens[i] = first + rows
            query_start[i + 1] = start + rows
            draft_tokens[i, : len(draft)] = draft
            num_drafts[i] = len(draft)
        query_start[len(batch) + 1 :] = len(batch) * rows  # padding sequences own no rows
        meta = PagedAttentionMetadata(slots, positions, token_seq, tables, context_lens, query_start)
        sampling, penalties, with_penalties = self._sampling_inputs(batch.sequences, num_seqs)
        return (tokens, meta, draft_tokens, num_drafts, sampling, penalties, len(batch)), with_penalties
