"""The pure jitted programs of a step; engine/compiled_programs.py buckets and
compiles them, engine/runner.py runs them.

    forward  tokens -> logits at the rows that sample, the updated KV pool
             (donated, so written in place) and, with_features, the pre-norm
             hidden state of every row (an EAGLE proposer drafts from it;
             a variant, because returning it made a batch-8 CPU decode step
             of the default model ~20% slower). Static per
             (tokens, seqs) bucket and per layout:
               "decode"  one new token per sequence (the Pallas backend
                         serves it with the split-k decode kernel)
               "mixed"   prompt chunks and decode tokens flattened together
               "verify"  exactly 1 + K rows per sequence (its last token and
                         its drafts), logits at every row, attention with one
                         context gather per sequence (models/paged_attention.py)
    sample   one token per sequence from its logits (engine/sampler.py),
             and the same tokens padded to a fixed size, for the next
             step's forward to take as inputs on the device (async
             scheduling, engine/engine.py);
             after structured outputs' token bitmask (under a lax.cond:
             steps without a constrained row skip it, and no variant is
             added); the
             "full" variant also applies logit_bias and repetition/presence/
             frequency penalties (which need [seqs, vocab] inputs) and returns the top
             logprobs, for batches where a request asks for either: the top-20
             logprobs over a 49,152 vocabulary doubled the sampler's time at
             batch 32 on CPU (3.3 -> 6.7 ms), and most batches ask for neither
    verify   acceptance of drafts (engine/verify.py), and the first rows'
             logits for the sequences that had no drafts, which the sample
             program then serves: penalties and logprobs, whose requests never
             draft, need no verification variant of their own

The forward and the sampler are separate programs, the logits staying on the
device between them, so the sampler's variants do not multiply the model's
compilations.

Tensor parallelism: with a mesh (parallel/), the params and the pool arrive
sharded, `mesh` is a static argument of every program (the Pallas attention
runs per shard with shard_map, parallel/attention.py) and the outputs that go
to the host are constrained to be replicated, so every device (every host, in
a multi-host run) holds the tokens. Without a mesh the programs are exactly
the single-device ones.

Context parallelism: on a ("context", "model") mesh every layout's attention
is ring attention over the block-split pool (models/ring_attention.py), and a
prompt step's token rows are split over "context".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.config import ModelConfig
from jaxinfer.engine.sampler import SamplerWork, sample
from jaxinfer.engine.verify import verify, verify_greedy
from jaxinfer.models.llama import forward
from jaxinfer.models.ring_attention import ring_cache_attention
from jaxinfer.parallel.mesh import CONTEXT_AXIS, MODEL_AXIS, context_parallel_size, tensor_parallel_size
from jaxinfer.sampling_params import MAX_LOGPROBS

LAYOUTS = ("decode", "mixed", "verify")


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
    if logits.shape[-1] % tensor_parallel_size(mesh) == 0:
        vocab_split = PartitionSpec(*([None] * (logits.ndim - 1)), MODEL_AXIS)
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, vocab_split))
    return _replicated(logits, mesh)


def _attention(attn_meta, config: ModelConfig, backend, layout: str, num_tokens: int, mesh):
    if context_parallel_size(mesh) > 1:  # the pool's blocks are split over devices: ring attention
        return ring_cache_attention(attn_meta, config.sliding_window, layout == "decode", mesh)
    if layout == "verify":
        rows = num_tokens // attn_meta.context_lens.shape[0]
        return backend.verification_attention(attn_meta, rows, config.sliding_window, mesh)
    return backend.paged_attention(attn_meta, config.sliding_window, layout == "decode", mesh)


@functools.partial(jax.jit, static_argnames=("config", "backend", "layout", "with_features", "mesh"),
                   donate_argnames=("kv_cache",))
def forward_step(params, kv_cache, tokens, attn_meta, logits_indices, lora_slots=None, feed=None, feed_index=None, *,
                 config: ModelConfig, backend, layout: str, with_features: bool = False, mesh=None):
    """-> (logits [len(logits_indices), V], pre-norm hidden [T, hidden] or None, kv_cache).
    backend: the model's platform backend (backends/), with the engine's
    attention option applied (with_attention).
    lora_slots: None, or each row's adapter slot int32 [T] with the adapter
    buffers in params["layers"]["lora"] (lora/slots.py); None traces the
    program without any LoRA input or work.
    feed int32 [F], feed_index int32 [T] (async scheduling): row t's token is
    feed[feed_index[t]] where feed_index[t] >= 0, the previous step's sampled
    token still on the device (sample_step's feed), else tokens[t]."""
    if feed is not None:
        tokens = jnp.where(feed_index >= 0, feed[jnp.maximum(feed_index, 0)], tokens)
    attention = _attention(attn_meta, config, backend, layout, tokens.shape[0], mesh)
    positions = attn_meta.positions
    if context_parallel_size(mesh) > 1 and layout == "mixed":
        # Context parallelism: a prompt step's rows (and so the whole residual
        # stream, the MLPs' work) are split over "context"; decode rows are few
        # and stay replicated (models/ring_attention.py).
        rows = NamedSharding(mesh, PartitionSpec(CONTEXT_AXIS))
        tokens, positions = jax.lax.with_sharding_constraint((tokens, positions), rows)
    pre, kv_cache = forward(params, config, tokens[None], positions[None], attention, kv_cache, backend=backend,
                            final_norm=False, lora_slots=None if lora_slots is None else lora_slots[None])
    hidden = backend.rms_norm(pre[0], params["final_norm"], config.rms_norm_eps)
    # Logits only where a token is sampled. On a mesh they come out split on
    # vocab; the sampler needs whole rows, so gather them here, once, in a
    # sharding the sampler's programs are compiled for.
    features = pre[0] if with_features else None
    logits = backend.logits(params, hidden[logits_indices])
    return _gathered_logits(logits, mesh), features, kv_cache


@functools.partial(jax.jit, static_argnames=("full", "work", "feed_size", "mesh"))
def sample_step(logits, sampling_meta, penalty_inputs, bitmask, constrained, *, full: bool, work: SamplerWork,
                feed_size: int, mesh=None):
    """-> (SamplerOutput, feed int32 [feed_size]: the sampled tokens padded
    with zeros, which the next step's forward can read on the device).
    bitmask int32 [S, ceil(V / 32)], constrained bool [S]: structured
    outputs' allowed tokens. work: which work only some rows need the
    program holds, and whether under a lax.cond (engine/sampler.py); with
    CONDITIONAL a step with no constrained row (all False, a resident zero
    mask) skips the mask."""
    prompt_mask, output_counts, logit_bias = penalty_inputs if full else (None, None, None)
    num_logprobs = MAX_LOGPROBS if full else 0
    out = sample(logits, sampling_meta, prompt_mask, output_counts, num_logprobs=num_logprobs, bitmask=bitmask,
                 constrained=constrained, logit_bias=logit_bias, work=work)
    feed = jnp.zeros((feed_size,), jnp.int32).at[: out.token_ids.shape[0]].set(out.token_ids)
    return _replicated((out, feed), mesh)


@functools.partial(jax.jit, static_argnames=("conditional", "mesh"))
def verify_step(logits, draft_tokens, num_drafts, sampling_meta, *, conditional: bool, mesh=None):
    """logits [S * (1 + K), V] of a verify forward -> (tokens [S, 1 + K],
    num_emitted [S], the first rows' logits [S, V]). A batch of greedy rows
    takes the greedy rule (under a lax.cond where `conditional`; else both
    rules run and the batch's is selected)."""
    num_seqs, k = draft_tokens.shape
    logits = logits.reshape(num_seqs, 1 + k, -1)
    all_greedy = jnp.all(sampling_meta.temperature <= 0.0)
    greedy = lambda: verify_greedy(logits, draft_tokens, num_drafts)  # noqa: E731
    sampled = lambda: verify(logits, draft_tokens, num_drafts, sampling_meta)  # noqa: E731
    if conditional:
        tokens, num_emitted = jax.lax.cond(all_greedy, greedy, sampled)
    else:
        tokens, num_emitted = jax.tree.map(lambda a, b: jnp.where(all_greedy, a, b), greedy(), sampled())
    return _replicated((tokens, num_emitted), mesh) + (logits[:, 0],)
