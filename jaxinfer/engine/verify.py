"""Verification of draft tokens on the device (speculative decoding), beside
the sampler whose draws it reuses.

The target model scores a sequence's last token and its K draft tokens in one
step, giving K + 1 rows of logits per sequence: row j is the distribution of
the token after draft j - 1 (row 0: after the last accepted token). Each
sequence then emits its accepted drafts plus one more token.

Every proposer here drafts deterministically (n-gram lookup, and greedy
draft-model and EAGLE chains), so the proposal distribution q_j is
one-hot(d_j) and the rule of Leviathan et al. / Chen et al. (2023) reads:
accept d_j with probability p_j(d_j); at the first rejection emit a token
from norm(max(0, p_j - one-hot(d_j))); when all K pass, from p_K. `verify`
realizes that rule by coupling: it draws the target's own token x_j from p_j
at every row with the key plain decoding would use for that output index
(engine/sampler.py: fold_in(key(seed), n) for a request's n-th output),
accepts d_j iff x_j == d_j, and emits x_j at the first mismatch. Then
P(accept) = p_j(d_j), and a rejected row's x_j is distributed as p_j
conditioned on x_j != d_j, which is the residual above. The emitted tokens
are moreover exactly the tokens non-speculative sampling with the same seed
emits, whatever was drafted, so a seeded request's output does not depend on
its batch, on cache pressure or on the proposer. Greedy rows are the special
case x_j = argmax p_j.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.engine.sampler import SamplingMetadata, first_argmax, sample


def verify(logits, draft_tokens, num_drafts, meta: SamplingMetadata):
    """Accept or reject drafts and pick each sequence's extra token.

    logits [S, K+1, V] target logits; draft_tokens [S, K] int32; num_drafts [S]
    (<= K; rows past it are ignored). meta: one row per sequence, `steps` =
    output index of the token emitted at row 0.
    Returns (tokens [S, K+1], num_emitted [S]): tokens[:num_emitted] are the
    accepted drafts followed by the extra token; num_emitted = accepted + 1.
    """
    num_seqs, rows, vocab = logits.shape
    row_meta = jax.tree.map(lambda a: jnp.repeat(a, rows, axis=0), meta)
    row_meta.steps = row_meta.steps + jnp.tile(jnp.arange(rows, dtype=row_meta.steps.dtype), num_seqs)
    own = sample(logits.reshape(num_seqs * rows, vocab), row_meta).token_ids.reshape(num_seqs, rows)
    return _accept_leading_matches(own, draft_tokens, num_drafts)


def verify_greedy(logits, draft_tokens, num_drafts):
    """`verify` when every row is greedy, from the argmax alone: the same
    tokens and counts without the sampler's per-row filters (a CPU step pays
    several milliseconds for them over K + 1 rows of a large vocabulary)."""
    return _accept_leading_matches(first_argmax(logits), draft_tokens, num_drafts)


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
