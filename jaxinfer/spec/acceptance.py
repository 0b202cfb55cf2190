"""Verification of draft tokens on the device (speculative decoding).

The target model scores a sequence's last token and its K draft tokens in one
step, giving K + 1 rows of logits per sequence: row j is the distribution of
the token after draft j - 1 (row 0: after the last accepted token). Each
sequence then emits its accepted drafts plus one more token:

  greedy rows  draft j is accepted while it equals the target's argmax at
               row j; the emitted extra token is the argmax at the first
               mismatch (or at row K when all drafts pass). This is exactly
               the non-speculative greedy output.
  sampled rows the rule of Leviathan et al. / Chen et al. (2023): with p_j the
               target's (temperature-scaled, filtered) distribution and q_j
               the proposer's, draft d_j is accepted with probability
               min(1, p_j(d_j) / q_j(d_j)); at the first rejection the extra
               token is drawn from norm(max(0, p_j - q_j)); when all K pass,
               from p_K. The emitted tokens are then distributed exactly as
               the target's own samples.

A deterministic proposer (n-gram, and the draft model and EAGLE head, whose
drafts are greedy) has q_j = one-hot(d_j): acceptance probability p_j(d_j)
and, on rejection, the residual p_j without d_j, renormalized. `verify`
realizes that same rule by coupling: it draws the target's own token x_j
from p_j at every row with the key plain decoding would use for that output
index, accepts d_j iff x_j == d_j, and emits x_j at the first mismatch. Then
P(accept) = p_j(d_j), and a rejected row's x_j is distributed as p_j
conditioned on x_j != d_j, which is norm(max(0, p_j - one-hot(d_j))). The
emitted tokens are moreover exactly the tokens non-speculative sampling
with the same seed emits, whatever was drafted, so a seeded request's output
does not depend on its batch, on cache pressure or on the proposer.

Randomness follows the sampler's rule (jaxinfer/engine/sampler.py): the
token emitted as a request's n-th output uses key fold_in(key(seed), n), so a
sequence with no drafts draws exactly what plain decoding would; with
proposer distributions (draft_probs), acceptance tests use a separate stream
derived from the same (seed, n).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.engine.sampler import SamplingMetadata, sample, sampling_logits

_ACCEPT_STREAM = 0x5EC0DE  # fold_in constant separating acceptance uniforms from token draws


def _uniform(seed, step, stream=None):
    key = jax.random.fold_in(jax.random.key(seed), step)
    if stream is not None:
        key = jax.random.fold_in(key, stream)
    return jax.random.uniform(key)


def _inverse_cdf(weight, u):
    """First token whose prefix sum of `weight` reaches u * total (positive weight only)."""
    prefix = jnp.cumsum(weight, axis=-1)
    chosen = (prefix >= (u * prefix[..., -1])[..., None]) & (weight > 0)
    return jnp.argmax(chosen, axis=-1).astype(jnp.int32)


def target_probs(logits, meta: SamplingMetadata):
    """[S, K+1, V] logits -> the distributions sampled rows draw from, [S, K+1, V] float32."""
    num_seqs, rows, vocab = logits.shape
    flat_meta = jax.tree.map(lambda a: jnp.repeat(a, rows, axis=0), meta)
    x = sampling_logits(logits.reshape(num_seqs * rows, vocab).astype(jnp.float32), flat_meta)
    return jax.nn.softmax(x, axis=-1).reshape(num_seqs, rows, vocab)


def verify(logits, draft_tokens, num_drafts, meta: SamplingMetadata, draft_probs=None):
    """Accept or reject drafts and pick each sequence's extra token.

    logits [S, K+1, V] target logits; draft_tokens [S, K] int32; num_drafts [S]
    (<= K; rows past it are ignored); draft_probs [S, K, V] the proposer's
    distributions, or None for a deterministic proposer. meta: one row per
    sequence, `steps` = output index of the token emitted at row 0.
    Returns (tokens [S, K+1], num_emitted [S]): tokens[:num_emitted] are the
    accepted drafts followed by the extra token; num_emitted = accepted + 1.
    """
    num_seqs, rows, vocab = logits.shape
    k = rows - 1
    if draft_probs is None:
        return _verify_one_hot(logits, draft_tokens, num_drafts, meta)
    greedy = meta.temperature <= 0.0
    drafted = jnp.arange(k)[None, :] < num_drafts[:, None]  # [S, K]

    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [S, K+1]
    probs = target_probs(logits, meta)
    p_draft = jnp.take_along_axis(probs[:, :k], draft_tokens[..., None], axis=-1)[..., 0]  # [S, K]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
    else:
        q_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    offsets = jnp.arange(k)[None, :]
    u_accept = jax.vmap(jax.vmap(lambda s, n: _uniform(s, n, _ACCEPT_STREAM)))(
        jnp.broadcast_to(meta.seeds[:, None], (num_seqs, k)), meta.steps[:, None] + offsets
    )
    # u < p / q without dividing (q may be 0 for a token the target likes: always accept).
    sampled_accept = u_accept * q_draft < p_draft
    accept = jnp.where(greedy[:, None], draft_tokens == argmax[:, :k], sampled_accept) & drafted
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # leading run

    # The extra token at row num_accepted: residual after a rejection, else p itself.
    row = num_accepted
    p_row = jnp.take_along_axis(probs, row[:, None, None], axis=1)[:, 0]  # [S, V]
    rejected = row < num_drafts
    if draft_probs is None:
        q_row = jax.nn.one_hot(jnp.take_along_axis(draft_tokens, jnp.minimum(row, k - 1)[:, None], axis=1)[:, 0],
                               vocab, dtype=jnp.float32) if k > 0 else jnp.zeros_like(p_row)
    else:
        q_row = jnp.take_along_axis(draft_probs, jnp.minimum(row, k - 1)[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_row - q_row, 0.0)
    # A residual of all zeros (p == q) cannot happen after a rejection with
    # positive probability; fall back to p to stay finite.
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_row)
    weight = jnp.where(rejected[:, None], residual, p_row)
    u_draw = jax.vmap(_uniform)(meta.seeds, meta.steps + row)
    extra = jnp.where(greedy, jnp.take_along_axis(argmax, row[:, None], axis=1)[:, 0], _inverse_cdf(weight, u_draw))

    tokens = jnp.concatenate([draft_tokens, jnp.zeros((num_seqs, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(rows)[None, :] == row[:, None], extra[:, None], tokens)
    return tokens, num_accepted + 1


def _verify_one_hot(logits, draft_tokens, num_drafts, meta: SamplingMetadata):
    """`verify` for deterministic drafts, by coupling (module docstring): row j's
    token is what the plain sampler draws for output index steps + j."""
    num_seqs, rows, vocab = logits.shape
    row_meta = jax.tree.map(lambda a: jnp.repeat(a, rows, axis=0), meta)
    row_meta.steps = row_meta.steps + jnp.tile(jnp.arange(rows, dtype=row_meta.steps.dtype), num_seqs)
    own = sample(logits.reshape(num_seqs * rows, vocab), row_meta).token_ids.reshape(num_seqs, rows)
    return _accept_leading_matches(own, draft_tokens, num_drafts)


def _accept_leading_matches(own, draft_tokens, num_drafts):
    """Drafts accepted while they equal the target's own tokens `own` [S, K+1];
    the extra token is `own` at the first mismatch (or at row K)."""
    num_seqs, rows = own.shape
    k = rows - 1
    drafted = jnp.arange(k)[None, :] < num_drafts[:, None]
    accept = (draft_tokens == own[:, :k]) & drafted
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    extra = jnp.take_along_axis(own, num_accepted[:, None], axis=1)
    tokens = jnp.concatenate([draft_tokens, jnp.zeros((num_seqs, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(rows)[None, :] == num_accepted[:, None], extra, tokens)
    return tokens, num_accepted + 1


def verify_greedy(logits, draft_tokens, num_drafts):
    """`verify` when every row is greedy, from the argmax alone: the same
    tokens and counts, without the [S, K+1, V] target distributions (their
    softmax and prefix sums cost a CPU step several milliseconds)."""
    return _accept_leading_matches(jnp.argmax(logits, axis=-1).astype(jnp.int32), draft_tokens, num_drafts)
