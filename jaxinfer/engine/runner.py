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
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.config import ModelConfig
from jaxinfer.engine.request import Sequence
from jaxinfer.engine.sampler import SamplingMetadata, make_penalty_inputs, sample
from jaxinfer.engine.scheduler import ScheduledBatch
from jaxinfer.models.llama import compute_logits, forward
from jaxinfer.models.paged_attention import PagedAttentionMetadata, paged_cache_attention
from jaxinfer.sampling_params import MAX_LOGPROBS
from jaxinfer.utils import bucket_size

log = logging.getLogger(__name__)


def _powers_of_two(low: int, high: int) -> list[int]:
    sizes = [low]
    while sizes[-1] < high:
        sizes.append(sizes[-1] * 2)
    return sizes


def _uses_penalties(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


@functools.partial(jax.jit, static_argnames=("config", "backend", "decode"), donate_argnames=("kv_cache",))
def _forward_step(params, kv_cache, tokens, attn_meta, logits_indices, *, config: ModelConfig, backend: str,
                  decode: bool):
    attention = paged_cache_attention(attn_meta, config.sliding_window, backend, decode)
    hidden, kv_cache = forward(params, config, tokens[None], attn_meta.positions[None], attention, kv_cache)
    # Logits only where a token is sampled: one row per sequence.
    return compute_logits(params, hidden[0][logits_indices]), kv_cache


@functools.partial(jax.jit, static_argnames=("with_penalties",))
def _sample_step(logits, sampling_meta, penalty_inputs, *, with_penalties: bool):
    prompt_mask, output_counts = penalty_inputs if with_penalties else (None, None)
    return sample(logits, sampling_meta, prompt_mask, output_counts, num_logprobs=MAX_LOGPROBS)


class ModelRunner:
    def __init__(self, config: ModelConfig, params, kv_cache, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, attention_backend: str = "xla"):
        self.config = config
        self.attention_backend = attention_backend
        self.params = params
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.token_buckets = _powers_of_two(16, max_num_batched_tokens)
        self.seq_buckets = _powers_of_two(8, max_num_seqs)
        # Padding one decode token to 16 would multiply a memory-bound step's compute by 16.
        self.decode_buckets = _powers_of_two(1, max_num_seqs)
        self.compiled_programs: set = set()
        self.warmed_up = False
        self.num_compilations = 0

    def buckets(self) -> list[tuple[int, int, bool]]:
        """(tokens, seqs, decode) buckets of the forward program."""
        decode = [(n, n, True) for n in self.decode_buckets]
        # >= 1 token per sequence, so seqs <= tokens.
        return decode + [(t, s, False) for t in self.token_buckets for s in self.seq_buckets if s <= t]

    def programs(self) -> list[tuple]:
        """Every program warm-up compiles: forward per bucket, sampler per seqs bucket and penalty flag."""
        seq_sizes = sorted({s for _, s, _ in self.buckets()})
        return [("forward", *bucket) for bucket in self.buckets()] + [
            ("sample", s, pen) for s in seq_sizes for pen in (False, True)
        ]

    def bucket(self, num_tokens: int, num_seqs: int) -> tuple[int, int, bool]:
        if num_tokens == num_seqs:
            n = bucket_size(num_seqs, 1)
            return n, n, True
        return bucket_size(num_tokens, 16), bucket_size(num_seqs, 8), False

    def warmup(self, progress: bool = True) -> None:
        for program in tqdm(self.programs(), desc="compiling", unit="program", disable=not progress, leave=False):
            if program[0] == "forward":
                _, num_tokens, num_seqs, decode = program
                self._forward(*self._dummy_forward_inputs(num_tokens, num_seqs), decode)
            else:
                _, num_seqs, with_penalties = program
                sampling = SamplingMetadata.from_params([None] * num_seqs, [0] * num_seqs, [0] * num_seqs, num_seqs)
                penalties = make_penalty_inputs([], [], self.config.vocab_size, num_seqs) if with_penalties else None
                logits = jnp.zeros((num_seqs, self.config.vocab_size), jnp.float32)
                jax.block_until_ready(self._sample(logits, sampling, penalties, with_penalties))
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

    def _forward(self, tokens, meta, logits_indices, decode: bool):
        self._count(("forward", len(tokens), len(logits_indices), decode))
        logits, self.kv_cache = _forward_step(
            self.params, self.kv_cache, tokens, meta, logits_indices, config=self.config,
            backend=self.attention_backend, decode=decode,
        )
        return logits

    def _sample(self, logits, sampling, penalties, with_penalties: bool):
        self._count(("sample", logits.shape[0], with_penalties))
        return _sample_step(logits, sampling, penalties, with_penalties=with_penalties)

    def run(self, inputs, with_penalties: bool):
        """One step on the device: forward, then sampling; returns the SamplerOutput (device arrays)."""
        tokens, meta, logits_indices, decode, sampling, penalties = inputs
        return self._sample(self._forward(tokens, meta, logits_indices, decode), sampling, penalties, with_penalties)

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
        seqs = batch.sequences
        sampling = SamplingMetadata.from_params(
            [s.params for s in seqs], [s.seed for s in seqs], [len(s.output_token_ids) for s in seqs], num_seqs
        )
        with_penalties = any(_uses_penalties(s) for s in seqs)
        penalties = None
        if with_penalties:
            penalties = make_penalty_inputs(
                [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs], self.config.vocab_size, num_seqs
            )
        return (tokens, meta, logits_indices, decode, sampling, penalties), with_penalties
