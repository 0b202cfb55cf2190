"""Draft verification on the device: greedy acceptance reproduces argmax
decoding exactly, and speculative sampling emits tokens distributed exactly as
the target's own samples (chi-square against the target softmax)."""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxinfer.engine.sampler import SamplingMetadata
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine.verify import verify, verify_greedy

VOCAB = 6
NUM_SAMPLES = 20000


def meta_for(params: SamplingParams, num_seqs: int, first_seed: int = 0) -> SamplingMetadata:
    return SamplingMetadata.from_params([params] * num_seqs, list(range(first_seed, first_seed + num_seqs)),
                                        [3] * num_seqs, num_seqs)


def softmax64(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_greedy_accepts_the_argmax_prefix_and_emits_the_target_token():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 4, VOCAB)).astype(np.float32)
    argmax = logits.argmax(-1)
    drafts = argmax[:, :3].copy()
    drafts[1, 0] = (drafts[1, 0] + 1) % VOCAB  # rejected at once
    drafts[2, 2] = (drafts[2, 2] + 1) % VOCAB  # two accepted
    num_drafts = np.array([3, 3, 3, 1, 0], np.int32)  # row 3: one draft; row 4: none
    tokens, num_emitted = verify(jnp.asarray(logits), jnp.asarray(drafts, jnp.int32), jnp.asarray(num_drafts),
                                 meta_for(SamplingParams(temperature=0.0), 5))
    tokens, num_emitted = np.asarray(tokens), np.asarray(num_emitted)
    assert num_emitted.tolist() == [4, 1, 3, 2, 1]
    for s in range(5):
        # Whatever was accepted, the emitted tokens are the target's argmax chain.
        assert tokens[s, : num_emitted[s]].tolist() == argmax[s, : num_emitted[s]].tolist()


def test_greedy_fast_path_equals_verify():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((6, 4, VOCAB)).astype(np.float32)
    drafts = np.where(rng.random((6, 3)) < 0.7, logits.argmax(-1)[:, :3], rng.integers(0, VOCAB, (6, 3)))
    num_drafts = np.array([3, 3, 2, 1, 0, 3], np.int32)
    args = jnp.asarray(logits), jnp.asarray(drafts, jnp.int32), jnp.asarray(num_drafts)
    tokens, num_emitted = map(np.asarray, verify(*args, meta_for(SamplingParams(temperature=0.0), 6)))
    fast_tokens, fast_emitted = map(np.asarray, verify_greedy(*args))
    assert fast_emitted.tolist() == num_emitted.tolist()
    for s in range(6):
        assert fast_tokens[s, : num_emitted[s]].tolist() == tokens[s, : num_emitted[s]].tolist()


@pytest.mark.parametrize("num_drafts", [1, 2])
def test_speculative_sampling_matches_target_distribution(num_drafts):
    rng = np.random.default_rng(1)
    target_logits = rng.standard_normal((num_drafts + 1, VOCAB)).astype(np.float32) * 1.5
    params = SamplingParams(temperature=0.8, seed=None)
    p = softmax64(target_logits / 0.8)
    # Every proposer drafts deterministically: a fixed, plausible guess that is not the target's favourite.
    drafts = np.tile(np.argsort(p[:num_drafts], axis=-1)[:, -2], (NUM_SAMPLES, 1))
    logits = jnp.asarray(np.broadcast_to(target_logits, (NUM_SAMPLES, num_drafts + 1, VOCAB)))
    tokens, num_emitted = verify(logits, jnp.asarray(drafts, jnp.int32), jnp.full(NUM_SAMPLES, num_drafts, jnp.int32),
                                 meta_for(params, NUM_SAMPLES))
    tokens, num_emitted = np.asarray(tokens), np.asarray(num_emitted)

    def chi2_pvalue(observed_tokens, expected_p):
        counts = np.bincount(observed_tokens, minlength=VOCAB)
        return stats.chisquare(counts, expected_p * counts.sum()).pvalue

    # First emitted token ~ p_0 whether it was an accepted draft or a residual draw.
    assert chi2_pvalue(tokens[:, 0], p[0]) > 1e-3
    # Given the first draft was accepted, the second emitted token ~ p_1
    # (the target's row 1 does not depend on the token here).
    second = tokens[num_emitted >= 2, 1]
    assert len(second) > 1000
    assert chi2_pvalue(second, p[1]) > 1e-3


def test_broken_rule_is_detected():
    """The test's power: accepting every draft (a wrong rule) gives the proposer's
    distribution, which the chi-square test rejects."""
    rng = np.random.default_rng(2)
    p = softmax64(rng.standard_normal(VOCAB) * 1.5)
    q = softmax64(rng.standard_normal(VOCAB))
    wrong = rng.choice(VOCAB, NUM_SAMPLES, p=q)
    counts = np.bincount(wrong, minlength=VOCAB)
    assert stats.chisquare(counts, p * NUM_SAMPLES).pvalue < 1e-6


def test_no_drafts_draws_what_plain_sampling_draws():
    from jaxinfer.engine.sampler import sample

    rng = np.random.default_rng(3)
    logits = rng.standard_normal((64, VOCAB)).astype(np.float32)
    meta = meta_for(SamplingParams(temperature=1.0, top_k=4), 64, first_seed=100)
    plain = np.asarray(sample(jnp.asarray(logits), meta).token_ids)
    tokens, num_emitted = verify(jnp.asarray(logits[:, None]), jnp.zeros((64, 0), jnp.int32),
                                 jnp.zeros(64, jnp.int32), meta)
    assert (np.asarray(num_emitted) == 1).all()
    assert (np.asarray(tokens)[:, 0] == plain).all()
