"""The on-device sampler (jaxinfer.engine.sampler) against the float64 numpy
reference in tests/reference_sampler.py and independent float64 computations.

Every device call goes through jax.jit, as in the engine's step. Inputs are
float32 and the reference gets the same float32 values widened to float64;
rows where a filter decision sits within float32 rounding of its boundary
are skipped (and the skips are counted, so they cannot hide everything).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.sampler import (
    BRANCH_FREE,
    CONDITIONAL,
    SamplingMetadata,
    apply_penalties,
    first_argmax,
    make_penalty_inputs,
    needed_work,
    sample,
    sampling_logits,
)
from jaxinfer.sampling_params import SamplingParams
from tests import reference_sampler as ref

SAMPLE = jax.jit(sample, static_argnames=("num_logprobs", "work"))
FILTERED = jax.jit(sampling_logits, static_argnames="work")
PENALISE = jax.jit(apply_penalties)

# Upper 1e-4 quantiles of chi-square (as in tests/engine/test_sampling_params.py).
CHI2_P1E4 = {3: 21.11, 5: 25.74}


def meta_for(params, seeds=None, steps=None, batch_size=None):
    n = len(params)
    seeds = list(range(100, 100 + n)) if seeds is None else seeds
    steps = [0] * n if steps is None else steps
    return SamplingMetadata.from_params(params, seeds, steps, batch_size or n)


def kept(row) -> set[int]:
    return set(np.flatnonzero(np.isfinite(np.asarray(row))).tolist())


def borderline(x: np.ndarray, top_k: int, top_p: float, min_p: float, tol: float = 1e-5) -> bool:
    """True when one of the reference's float comparisons (cumulative mass vs
    top_p, probability vs min_p * max) is within float32 reach of equality."""
    x = x.copy()
    if 0 < top_k < len(x):
        x[x < np.sort(x)[::-1][top_k - 1]] = -np.inf
    if top_p < 1.0:
        cumulative = np.cumsum(np.sort(ref.softmax(x))[::-1])
        if np.any(np.abs(cumulative - top_p) < tol):
            return True
        x = ref.filter_logits(x, 0, top_p, 0.0)
    if min_p > 0.0:
        p = ref.softmax(x)
        return bool(np.any(np.abs(p[p > 0] / p.max() - min_p) < tol))
    return False


def random_logits(rng, rows, vocab):
    # Small integers make ties common; -inf stands for already-masked tokens.
    kind = rng.random((rows, vocab))
    x = np.where(kind < 0.4, rng.integers(-3, 4, (rows, vocab)), rng.uniform(-8, 8, (rows, vocab)))
    x = np.where(kind > 0.9, -np.inf, x)
    x[:, rng.integers(0, vocab)] = 1.0  # at least one finite logit
    return x.astype(np.float32)


def random_params(rng, vocab, mode):
    top_k = int(rng.integers(-1, vocab + 2)) if mode in ("all", "top_k") and rng.random() < 0.6 else 0
    top_p = float(rng.uniform(0.05, 1.0)) if mode == "all" and rng.random() < 0.6 else 1.0
    min_p = float(rng.uniform(0.0, 0.6)) if mode in ("all", "min_p") and rng.random() < 0.5 else 0.0
    return SamplingParams(temperature=float(rng.uniform(0.3, 2.0)), top_k=top_k, top_p=top_p, min_p=min_p)


# ---------------------------------------------------------------- host helpers


def test_from_params_pads_and_normalises():
    meta = SamplingMetadata.from_params(
        [SamplingParams(temperature=0.5, top_k=-1, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                        presence_penalty=0.5, frequency_penalty=-0.25), None],
        [2**32 + 7, 3], [5, 9], 4,
    )
    assert meta.temperature.tolist() == [0.5, 0, 0, 0]
    assert meta.top_k.tolist() == [0, 0, 0, 0]  # -1 and 0 both mean disabled
    np.testing.assert_allclose(meta.top_p, [0.9, 1, 1, 1], rtol=1e-7)
    np.testing.assert_allclose(meta.min_p, [0.1, 0, 0, 0], rtol=1e-7)
    np.testing.assert_allclose(meta.repetition_penalty, [1.3, 1, 1, 1], rtol=1e-7)
    assert meta.presence_penalty.tolist() == [0.5, 0, 0, 0]
    assert meta.frequency_penalty.tolist() == [-0.25, 0, 0, 0]
    assert meta.seeds.tolist() == [7, 0, 0, 0] and meta.steps.tolist() == [5, 0, 0, 0]
    with pytest.raises(ValueError):
        SamplingMetadata.from_params([None] * 3, [0] * 3, [0] * 3, 2)


def test_make_penalty_inputs_counts_by_loop():
    prompts, outputs = [[1, 1, 4], [], None], [[2, 4, 4, 4], [0]]
    mask, counts = make_penalty_inputs(prompts, outputs, 6, 4)
    assert mask.shape == counts.shape == (4, 6) and mask.dtype == np.bool_
    for row in range(4):
        prompt = (prompts[row] or []) if row < len(prompts) else []
        output = outputs[row] if row < len(outputs) else []
        for token in range(6):
            assert mask[row, token] == (token in prompt)
            assert counts[row, token] == output.count(token)


# ---------------------------------------------------------------- filters


@pytest.mark.parametrize("how", ["conditional", "needed", "all"])
@pytest.mark.parametrize("vocab", [7, 13, 50])
def test_filters_match_reference_keep_sets(vocab, how):
    """Every way of paying for work only some rows need (skipped under a
    lax.cond; or, as the GPU backend does, just the pieces the batch needs, or
    every piece, computed unconditionally) keeps the reference's sets."""
    rng = np.random.default_rng(vocab)
    rows, checked, total = 64, 0, 0
    # "min_p" batches have no row using top-k/top-p (the search is skipped),
    # "top_k" batches skip only the top-p search, "all" mixes everything.
    for batch, mode in enumerate(["all", "all", "min_p", "top_k"]):
        logits = random_logits(rng, rows, vocab)
        params = [random_params(rng, vocab, mode) for _ in range(rows)]
        meta = meta_for(params, steps=[batch] * rows)
        work = {"conditional": CONDITIONAL, "needed": needed_work(params, vocab), "all": BRANCH_FREE}[how]
        got = np.asarray(FILTERED(logits, meta, work=work))
        tokens = np.asarray(SAMPLE(logits, meta, work=work).token_ids)
        for i, p in enumerate(params):
            scaled = (logits[i] / np.float32(p.temperature)).astype(np.float64)
            total += 1
            if borderline(scaled, p.top_k, p.top_p, p.min_p):
                continue
            checked += 1
            expected = ref.filter_logits(scaled, p.top_k, p.top_p, p.min_p)
            assert kept(got[i]) == kept(expected), (i, p, logits[i])
            survivors = sorted(kept(expected))
            # XLA's float32 division may differ from numpy's by an ulp.
            np.testing.assert_allclose(got[i, survivors], scaled[survivors], rtol=3e-7)
            assert tokens[i] in kept(expected)
    assert checked >= 0.9 * total


def test_filters_match_reference_realistic_vocab():
    vocab = 49152
    rng = np.random.default_rng(1)
    logits = rng.normal(0.0, 1.5, (4, vocab))
    # A heavy head of a few hundred tokens puts every top-p boundary among
    # tokens far larger than float32 rounding of the cumulative mass.
    for row in logits:
        row[rng.choice(vocab, 300, replace=False)] += rng.uniform(5, 12, 300)
    logits = logits.astype(np.float32)
    params = [
        SamplingParams(temperature=0.8, top_k=50),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, min_p=0.05),
        SamplingParams(temperature=1.2, top_k=1000, top_p=0.95, min_p=0.01),
    ]
    got = np.asarray(FILTERED(logits, meta_for(params)))
    for i, p in enumerate(params):
        scaled = (logits[i] / np.float32(p.temperature)).astype(np.float64)
        assert not borderline(scaled, p.top_k, p.top_p, p.min_p)
        expected = kept(ref.filter_logits(scaled, p.top_k, p.top_p, p.min_p))
        assert kept(got[i]) == expected
        assert 1 < len(expected) < vocab  # the filter really cut something


# ---------------------------------------------------------------- penalties


def test_penalties_match_reference_row_by_row():
    rng = np.random.default_rng(2)
    rows, vocab = 16, 40
    logits = rng.uniform(-5, 5, (rows, vocab)).astype(np.float32)
    logits[:, :4] = [0.0, -0.0, 1.0, -1.0]
    prompts = [rng.integers(0, vocab, rng.integers(0, 20)).tolist() for _ in range(rows)]
    outputs = [rng.integers(0, vocab, rng.integers(0, 20)).tolist() for _ in range(rows)]
    params = [
        SamplingParams(
            repetition_penalty=float(rng.uniform(0.5, 2.0)) if i % 4 else 1.0,
            presence_penalty=float(rng.uniform(-2, 2)) if i % 3 else 0.0,
            frequency_penalty=float(rng.uniform(-2, 2)) if i % 5 else 0.0,
        )
        for i in range(rows)
    ]
    meta = meta_for(params)
    mask, counts = make_penalty_inputs(prompts, outputs, vocab, rows)
    got = np.asarray(PENALISE(logits, mask, counts, meta))
    for i, p in enumerate(params):
        expected = ref.apply_penalties(logits[i], outputs[i], prompts[i], float(meta.repetition_penalty[i]),
                                       float(meta.presence_penalty[i]), float(meta.frequency_penalty[i]))
        np.testing.assert_allclose(got[i], expected, rtol=1e-6, atol=1e-6, err_msg=f"row {i}")


def test_greedy_rows_are_argmax_of_penalised_logits_on_both_paths():
    rng = np.random.default_rng(3)
    rows, vocab = 8, 40
    # Integers and dyadic penalties are exact in float32: ties stay ties.
    logits = rng.integers(-4, 5, (rows, vocab)).astype(np.float32)
    prompts = [rng.integers(0, vocab, 6).tolist() for _ in range(rows)]
    outputs = [rng.integers(0, vocab, 8).tolist() for _ in range(rows)]
    pen = dict(repetition_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5)
    greedy = [SamplingParams(temperature=0.0, top_k=2, top_p=0.1, min_p=0.9, **pen) for _ in range(rows)]
    mask, counts = make_penalty_inputs(prompts, outputs, vocab, rows)
    expected = [int(np.argmax(ref.apply_penalties(logits[i], outputs[i], prompts[i], 2.0, 0.25, 0.5)))
                for i in range(rows)]
    assert any(  # the fixture really has ties at the maximum
        np.count_nonzero(ref.apply_penalties(logits[i], outputs[i], prompts[i], 2.0, 0.25, 0.5)
                         == ref.apply_penalties(logits[i], outputs[i], prompts[i], 2.0, 0.25, 0.5).max()) > 1
        for i in range(rows)
    )
    all_greedy = np.asarray(SAMPLE(logits, meta_for(greedy), mask, counts).token_ids)
    assert all_greedy.tolist() == expected
    mixed = [SamplingParams(temperature=1.0, top_p=0.5, **pen) if i % 2 else p for i, p in enumerate(greedy)]
    tokens = np.asarray(SAMPLE(logits, meta_for(mixed), mask, counts).token_ids)
    assert tokens[::2].tolist() == expected[::2]


# ---------------------------------------------------------------- seeding


def varied_batch(rng, rows, vocab):
    logits = rng.normal(0, 1, (rows, vocab)).astype(np.float32)
    params = [
        SamplingParams(temperature=float(rng.uniform(0.8, 1.5)), top_k=[0, 20][i % 2], top_p=[1.0, 0.95][i % 3 == 0],
                       min_p=[0.0, 0.01][i % 4 == 1])
        for i in range(rows)
    ]
    return logits, params, rng.integers(0, 2**31, rows).tolist(), rng.integers(0, 500, rows).tolist()


def test_draws_depend_only_on_seed_and_step():
    rng = np.random.default_rng(4)
    logits, params, seeds, steps = varied_batch(rng, 8, 32)
    tokens = np.asarray(SAMPLE(logits, meta_for(params, seeds, steps)).token_ids)

    perm = rng.permutation(8)
    permuted = SAMPLE(logits[perm], meta_for([params[i] for i in perm], [seeds[i] for i in perm],
                                             [steps[i] for i in perm]))
    np.testing.assert_array_equal(np.asarray(permuted.token_ids), tokens[perm])

    # New neighbours (contents, params, seeds) and a larger bucket with padding rows.
    other_logits, other_params, other_seeds, other_steps = varied_batch(rng, 8, 32)
    big_logits = np.concatenate([other_logits, logits[::-1]])
    big = SAMPLE(
        np.concatenate([big_logits, np.zeros((4, 32), np.float32)]),
        meta_for(other_params + params[::-1] + [None] * 4, other_seeds + seeds[::-1] + [0] * 4,
                 other_steps + steps[::-1] + [0] * 4),
    )
    np.testing.assert_array_equal(np.asarray(big.token_ids)[8:16], tokens[::-1])


def test_key_is_fold_in_of_seed_and_step():
    # Recompute the draw independently: one uniform from fold_in(key(seed), step),
    # then the float64 inverse CDF of the softmax.
    rng = np.random.default_rng(5)
    rows, vocab = 16, 12
    logits = rng.normal(0, 1, (rows, vocab)).astype(np.float32)
    seeds, steps = rng.integers(0, 2**31, rows).tolist(), rng.integers(0, 1000, rows).tolist()
    tokens = np.asarray(SAMPLE(logits, meta_for([SamplingParams()] * rows, seeds, steps)).token_ids)
    compared = 0
    for i in range(rows):
        u = float(jax.random.uniform(jax.random.fold_in(jax.random.key(seeds[i]), steps[i])))
        cdf = np.cumsum(ref.softmax(logits[i].astype(np.float64)))
        if np.min(np.abs(cdf - u)) < 1e-5:
            continue
        compared += 1
        assert tokens[i] == int(np.searchsorted(cdf, u)), i
    assert compared >= rows - 2


def test_steps_and_seeds_change_the_draw():
    rows = 100
    logits = np.zeros((rows, 32), np.float32)  # uniform: every draw is pure randomness
    by_step = np.asarray(SAMPLE(logits, meta_for([SamplingParams()] * rows, [7] * rows, list(range(rows)))).token_ids)
    by_seed = np.asarray(SAMPLE(logits, meta_for([SamplingParams()] * rows, list(range(rows)), [3] * rows)).token_ids)
    repeat = np.asarray(SAMPLE(logits, meta_for([SamplingParams()] * rows, [7] * rows, [3] * rows)).token_ids)
    assert len(set(by_step.tolist())) >= 20 and len(set(by_seed.tolist())) >= 20
    assert len(set(repeat.tolist())) == 1


# ---------------------------------------------------------------- distribution


def draw_counts(logits, params, vocab, rows=2000, calls=10):
    batch = np.tile(np.asarray(logits, np.float32), (rows, 1))
    counts = np.zeros(vocab, np.int64)
    for call in range(calls):
        meta = meta_for([params] * rows, [2024] * rows, list(range(call * rows, (call + 1) * rows)))
        counts += np.bincount(np.asarray(SAMPLE(batch, meta).token_ids), minlength=vocab)
    return counts


def chi_square(counts, probs):
    expected = counts.sum() * np.asarray(probs)
    assert expected.min() >= 5
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_distribution_matches_softmax():
    logits = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 0.2])
    counts = draw_counts(logits, SamplingParams(temperature=0.7), 6)
    assert counts.sum() == 20_000
    assert chi_square(counts, ref.softmax(logits / 0.7)) < CHI2_P1E4[5]
    # The test has power: the untempered distribution is clearly rejected.
    assert chi_square(counts, ref.softmax(logits)) > 10 * CHI2_P1E4[5]


def test_top_p_distribution_is_renormalised_nucleus():
    probs = np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
    counts = draw_counts(np.log(probs), SamplingParams(temperature=1.0, top_p=0.8), 6)
    assert counts[4] == 0 and counts[5] == 0
    assert chi_square(counts[:4], probs[:4] / probs[:4].sum()) < CHI2_P1E4[3]


# ---------------------------------------------------------------- logprobs and padding


def test_logprobs_match_float64_log_softmax():
    rng = np.random.default_rng(6)
    rows, vocab, k = 4, 50, 5
    logits = rng.normal(0, 2, (rows, vocab)).astype(np.float32)
    logits[0] = rng.integers(-2, 3, vocab)  # ties in the top-k and at the sampled token
    prompts, outputs = [[], [1, 2], [], []], [[], [3, 3, 9], [], []]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5),
        SamplingParams(temperature=2.0, top_k=10),  # logprobs ignore temperature and filters
        None,
    ]
    meta = meta_for(params, steps=[0, 1, 2, 0])
    mask, counts = make_penalty_inputs(prompts, outputs, vocab, rows)
    out = SAMPLE(logits, meta, mask, counts, num_logprobs=k)
    values, ids = np.asarray(out.logprobs), np.asarray(out.logprob_token_ids)
    tokens, ranks = np.asarray(out.token_ids), np.asarray(out.sampled_rank)
    assert values.shape == ids.shape == (rows, 1 + k) and values.dtype == np.float32 and ids.dtype == np.int32
    for i in range(rows):
        p = params[i] or SamplingParams(temperature=0.0)
        lp = ref.log_softmax(ref.apply_penalties(logits[i], outputs[i], prompts[i], p.repetition_penalty,
                                                 p.presence_penalty, p.frequency_penalty))
        expected = ref.token_logprobs(lp, int(tokens[i]), k)
        top = np.argsort(-lp, kind="stable")[:k]  # lowest id first among ties
        assert ids[i, 0] == tokens[i] and ids[i, 1:].tolist() == top.tolist()
        np.testing.assert_allclose(values[i], lp[ids[i]], atol=2e-5)
        assert ranks[i] == expected[int(tokens[i])].rank
    assert ranks[0] == 1 and ranks[3] == 1  # greedy rows take a top-ranked token


def test_no_logprobs_fields_when_not_requested():
    out = SAMPLE(np.zeros((2, 5), np.float32), meta_for([SamplingParams(), None]))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_rank is None
    assert out.token_ids.dtype == jnp.int32 and out.token_ids.shape == (2,)


def test_padding_rows_are_finite():
    rows, vocab = 8, 64
    rng = np.random.default_rng(7)
    logits = np.zeros((rows, vocab), np.float32)
    logits[:2] = rng.normal(0, 3, (2, vocab))
    params = [SamplingParams(temperature=0.9, top_k=5, top_p=0.7, min_p=0.2, frequency_penalty=1.0),
              SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    mask, counts = make_penalty_inputs([[1, 2]], [[3], [4, 4]], vocab, rows)
    for batch in (params + [None] * 6, [None] * rows):  # mixed path, then all-greedy path
        out = SAMPLE(logits, meta_for(batch, batch_size=rows), mask, counts, num_logprobs=3)
        for field in out:
            assert np.all(np.isfinite(np.asarray(field)))
        assert np.asarray(out.token_ids)[2:].tolist() == [0] * 6
        assert np.all(np.asarray(FILTERED(logits, meta_for(batch, batch_size=rows)))[2:] == 0)


def test_tiny_temperature_stays_finite_and_picks_a_maximum():
    logits = np.array([[10.0, 300.0, 300.0, -20.0, 5.0], [0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)  # x / T overflows
    meta = meta_for([SamplingParams(temperature=1e-37, min_p=0.5)] * 2)
    assert np.asarray(SAMPLE(logits, meta).token_ids)[0] in (1, 2)
    filtered = np.asarray(FILTERED(logits, meta))
    assert kept(filtered[0]) == {1, 2} and kept(filtered[1]) == set(range(5))
    assert not np.any(np.isnan(filtered))


def test_first_argmax_is_numpys_argmax_with_ties_nan_and_bools():
    rng = np.random.default_rng(3)
    ties = rng.integers(0, 3, (6, 40)).astype(np.float32)  # many tied maxima: the lowest index wins
    special = np.array([[np.nan, 1, np.nan, 2], [-np.inf] * 4, [2, np.inf, np.inf, 1], [0, 0, 0, 0]], np.float32)
    for x in (rng.standard_normal((4, 49152)).astype(np.float32), ties, special, rng.random((5, 30)) > 0.8,
              np.zeros((2, 9), bool)):
        np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x))), np.argmax(x, axis=-1))


def test_branch_free_sampler_draws_what_the_conditional_one_draws():
    """The GPU backend's sampler (no lax.cond: the pieces the batch needs, or
    every piece, computed unconditionally and selected per row) draws exactly
    the tokens and logprobs of the conditional one, which the tests above
    check against the reference: all-greedy, mixed and sampled batches (with
    and without top-k / top-p rows), with a structured-output mask on some
    rows or none."""
    rng = np.random.default_rng(11)
    rows, vocab = 8, 96
    logits, params, seeds, steps = varied_batch(rng, rows, vocab)
    greedy = [SamplingParams(temperature=0.0) for _ in range(rows)]
    mixed = [p if i % 3 else g for i, (p, g) in enumerate(zip(params, greedy))]
    bitmask = rng.integers(-2**31, 2**31, (rows, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    unfiltered = [SamplingParams(temperature=0.9, min_p=0.05) if i % 2 else g for i, g in enumerate(greedy)]
    for batch in (greedy, mixed, params, unfiltered):
        for constrained in (np.zeros(rows, bool), np.arange(rows) % 2 == 0):
            meta = meta_for(batch, seeds, steps)
            outs = [SAMPLE(logits, meta, num_logprobs=3, bitmask=bitmask, constrained=constrained, work=work)
                    for work in (CONDITIONAL, needed_work(batch, vocab), BRANCH_FREE)]
            for same in zip(*outs):
                for other in same[1:]:
                    np.testing.assert_array_equal(np.asarray(other), np.asarray(same[0]))
    # The greedy batch's program holds neither the draw nor the searches; the unfiltered one no searches.
    assert needed_work(greedy, vocab) == needed_work([None] * rows, vocab) and not needed_work(greedy, vocab).draw
    assert needed_work(unfiltered, vocab).draw and not needed_work(unfiltered, vocab).filters
