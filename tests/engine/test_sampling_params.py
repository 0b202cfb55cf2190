"""SamplingParams validation, the numpy reference sampler, and output records.

Expected values come from independent computations: plain Python loops over
token ids, brute force over sorted probabilities, and hand-computed
chi-square statistics against fixed-seed draws.
"""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jaxinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxinfer.sampling_params import InvalidSamplingParameter, SamplingParams
from tests.reference_sampler import apply_penalties, filter_logits, make_rng, sample_next_token

# ---------------------------------------------------------------- validation

INVALID = [
    ("n", 0),
    ("n", -1),
    ("n", True),
    ("n", 1.0),
    ("n", "2"),
    ("max_tokens", 0),
    ("max_tokens", False),
    ("max_tokens", 2.5),
    ("temperature", -1.0),
    ("temperature", -1e-9),
    ("temperature", float("inf")),
    ("temperature", float("nan")),
    ("temperature", "hot"),
    ("temperature", True),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0001),
    ("top_p", float("nan")),
    ("top_p", "0.9"),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", True),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("min_p", "x"),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.01),
    ("presence_penalty", "a"),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("seed", 1.5),
    ("seed", True),
    ("seed", "42"),
    ("seed", -1),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", "12"),
    ("ignore_eos", 1),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", True),
    ("logprobs", 2.0),
]


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_naming_field(field, value):
    with pytest.raises(InvalidSamplingParameter) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(field), str(info.value)
    assert isinstance(info.value, ValueError)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.logprobs is None and p.ignore_eos is False
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.greedy


def test_valid_edge_values_construct():
    p = SamplingParams(
        n=3,
        max_tokens=1,
        temperature=0,
        top_p=1e-6,
        top_k=-1,
        min_p=1.0,
        repetition_penalty=1e-3,
        presence_penalty=-2,
        frequency_penalty=2,
        seed=0,
        stop=("a", "bc"),
        stop_token_ids=(0, 7),
        ignore_eos=True,
        logprobs=20,
    )
    assert p.greedy
    assert p.stop == ["a", "bc"] and p.stop_token_ids == [0, 7]
    assert SamplingParams(logprobs=0).logprobs == 0
    # numpy scalars are accepted and become Python numbers.
    q = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), seed=np.uint32(9))
    assert type(q.n) is int and type(q.temperature) is float and type(q.seed) is int


def test_stop_normalisation():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=["x", "yz"]).stop == ["x", "yz"]
    assert SamplingParams(stop_token_ids=5).stop_token_ids == [5]


def test_with_updates_revalidates():
    p = SamplingParams(temperature=0.5)
    assert p.with_updates(top_k=3).top_k == 3 and p.top_k == 0
    with pytest.raises(InvalidSamplingParameter, match="^top_p"):
        p.with_updates(top_p=2.0)


# ---------------------------------------------------------------- penalties


def penalties_by_loop(logits, output, prompt, rep, presence, frequency):
    out = []
    for token, x in enumerate(logits):
        x = float(x)
        if token in output or token in prompt:
            x = x / rep if x > 0 else x * rep
        count = sum(1 for t in output if t == token)
        x -= frequency * count
        if count > 0:
            x -= presence
        out.append(x)
    return out


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(1, 12),
    rep=st.floats(0.1, 3.0),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
)
def test_penalties_match_loop(data, vocab, rep, presence, frequency):
    value = st.one_of(st.floats(-20, 20), st.sampled_from([0.0, -0.0, 1.0, -1.0]))
    logits = np.array(data.draw(st.lists(value, min_size=vocab, max_size=vocab)))
    ids = st.lists(st.integers(0, vocab - 1), max_size=15)
    output, prompt = data.draw(ids), data.draw(ids)
    before = logits.copy()
    got = apply_penalties(logits, output, prompt, rep, presence, frequency)
    expected = penalties_by_loop(logits, output, prompt, rep, presence, frequency)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(logits, before)  # input untouched


def test_penalties_concrete_example():
    logits = np.array([2.0, -2.0, 1.0, 0.5, 3.0])
    got = apply_penalties(
        logits,
        output_token_ids=[2, 2, 3],
        prompt_token_ids=[0, 1],
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    # token 0: prompt, 2/2; token 1: prompt, -2*2; token 2: 1/2 - 2*0.25 - 0.5;
    # token 3: 0.5/2 - 0.25 - 0.5; token 4 unseen.
    np.testing.assert_allclose(got, [1.0, -4.0, -0.5, -0.5, 3.0])


def test_penalties_reject_out_of_range_ids():
    with pytest.raises(ValueError):
        apply_penalties(np.zeros(4), [4], [], 1.2, 0.0, 0.0)


# ---------------------------------------------------------------- filters


def kept(logits):
    return set(np.flatnonzero(np.isfinite(logits)).tolist())


def probs_of(logits, indices):
    """Softmax restricted to `indices`, as a dict, computed with math."""
    m = max(logits[i] for i in indices)
    e = {i: math.exp(logits[i] - m) for i in indices}
    total = sum(e.values())
    return {i: v / total for i, v in e.items()}


def brute_force_keep(logits, top_k, top_p, min_p):
    """Keep-set by walking sorted probabilities. Returns it plus a flag that is
    True when a float comparison sat within rounding distance of a boundary."""
    borderline = False
    keep = [i for i in range(len(logits)) if math.isfinite(logits[i])]

    if 0 < top_k < len(logits):
        values = sorted(logits, reverse=True)
        keep = [i for i in keep if logits[i] >= values[top_k - 1]]

    if top_p < 1.0:
        p = probs_of(logits, keep)
        order = sorted(keep, key=lambda i: -p[i])
        total, nucleus = 0.0, []
        for i in order:
            nucleus.append(i)
            total += p[i]
            borderline |= abs(total - top_p) < 1e-9
            if total >= top_p:
                break
        smallest = min(p[i] for i in nucleus)
        keep = [i for i in keep if p[i] >= smallest]

    if min_p > 0.0:
        p = probs_of(logits, keep)
        threshold = min_p * max(p.values())
        borderline |= any(abs(p[i] - threshold) < 1e-12 for i in keep)
        keep = [i for i in keep if p[i] >= threshold]

    return set(keep), borderline


logit_vectors = st.integers(2, 12).flatmap(
    lambda v: st.lists(
        # small integers make ties common; -inf models already-masked tokens
        st.one_of(st.floats(-8, 8), st.integers(-3, 3).map(float), st.just(-np.inf)),
        min_size=v,
        max_size=v,
    ).filter(lambda xs: any(math.isfinite(x) for x in xs))
)


@settings(max_examples=100, deadline=None)
@given(
    logits=logit_vectors,
    top_k=st.integers(-1, 13),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
)
def test_filter_matches_brute_force(logits, top_k, top_p, min_p):
    logits = np.array(logits)
    expected, borderline = brute_force_keep(logits.tolist(), top_k, top_p, min_p)
    assume(not borderline)
    got = filter_logits(logits, top_k, top_p, min_p)
    assert kept(got) == expected
    assert int(np.argmax(logits)) in kept(got)  # the most likely token always survives
    survivors = sorted(expected)
    np.testing.assert_array_equal(got[survivors], logits[survivors])


@settings(max_examples=100, deadline=None)
@given(logits=logit_vectors, top_k=st.integers(-1, 13))
def test_top_k_alone_matches_brute_force(logits, top_k):
    logits = np.array(logits)
    finite = [x for x in logits if math.isfinite(x)]
    got = kept(filter_logits(logits, top_k, 1.0, 0.0))
    if top_k <= 0 or top_k >= len(logits):
        assert got == kept(logits)
    else:
        kth = sorted(logits, reverse=True)[top_k - 1]
        assert got == {i for i, x in enumerate(logits) if math.isfinite(x) and x >= kth}
        # More than k only through ties at the k-th value (or fewer finite tokens).
        assert len(got) >= min(top_k, len(finite))
        assert len(got) == top_k or list(logits).count(kth) > 1 or len(got) == len(finite)


def test_top_k_keeps_ties_at_kth_value():
    assert kept(filter_logits([3.0, 1.0, 2.0, 2.0, 0.0], 2, 1.0, 0.0)) == {0, 2, 3}


def test_top_p_boundaries():
    logits = np.log([0.5, 0.3, 0.2])
    assert kept(filter_logits(logits, 0, 0.49, 0.0)) == {0}
    assert kept(filter_logits(logits, 0, 0.51, 0.0)) == {0, 1}
    assert kept(filter_logits(logits, 0, 0.81, 0.0)) == {0, 1, 2}
    assert kept(filter_logits(logits, 0, 1e-9, 0.0)) == {0}


def test_top_p_exact_boundary_is_inclusive():
    # Dyadic probabilities, exact in float64: [1/2, 1/4, 1/8, 1/8].
    logits = np.log([4.0, 2.0, 1.0, 1.0])
    e = np.exp(logits - logits.max())
    assert (e / e.sum()).tolist() == [0.5, 0.25, 0.125, 0.125]
    # Cumulative probability reaching top_p exactly ends the nucleus ...
    assert kept(filter_logits(logits, 0, 0.5, 0.0)) == {0}
    assert kept(filter_logits(logits, 0, 0.75, 0.0)) == {0, 1}
    # ... and a token tied with the nucleus' last member comes along.
    assert kept(filter_logits(logits, 0, 0.8, 0.0)) == {0, 1, 2, 3}


def test_top_p_runs_on_top_k_renormalised_probs():
    # After top-k=2 the probabilities are [4/7, 3/7]: top_p=0.5 keeps one token,
    # where on the full distribution (0.4 < 0.5) it would have kept two.
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    assert kept(filter_logits(logits, 0, 0.5, 0.0)) == {0, 1}
    assert kept(filter_logits(logits, 2, 0.5, 0.0)) == {0}


def test_min_p_runs_after_top_p():
    # top_p=0.6 keeps {0, 1}; min_p=0.5 then keeps both (0.3/0.5 >= 0.5).
    # The other order (min-p first, vLLM V1) would keep only token 0.
    logits = np.log([0.5, 0.3, 0.2])
    assert kept(filter_logits(logits, 0, 0.6, 0.5)) == {0, 1}
    assert kept(filter_logits(logits, 0, 1.0, 0.5)) == {0, 1}
    assert kept(filter_logits(logits, 0, 1.0, 0.61)) == {0}
    assert kept(filter_logits(logits, 0, 1.0, 1.0)) == {0}


def test_filter_rejects_unsampleable_logits():
    with pytest.raises(ValueError):
        filter_logits([-np.inf, -np.inf], 0, 0.5, 0.0)


# ---------------------------------------------------------------- sampling


def test_top_k_1_is_argmax():
    rng = make_rng(0)
    params = SamplingParams(temperature=1.5, top_k=1)
    for _ in range(50):
        logits = rng.normal(size=30)
        token, _ = sample_next_token(logits, params, rng)
        assert token == int(np.argmax(logits))


def test_greedy_is_argmax_of_penalised_logits_and_ignores_filters():
    logits = np.array([1.0, 3.0, 2.9, -1.0])
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9, frequency_penalty=0.5)
    assert sample_next_token(logits, params, make_rng(0))[0] == 1
    # One earlier occurrence of token 1 costs it 0.5, so token 2 wins.
    assert sample_next_token(logits, params, make_rng(0), output_token_ids=[1])[0] == 2


def draw(seed, count, params, logits):
    rng = make_rng(seed)
    return [sample_next_token(logits, params, rng)[0] for _ in range(count)]


def test_same_seed_same_sequence_different_seed_differs():
    logits = np.zeros(8)
    params = SamplingParams(temperature=1.0)
    a = draw(123, 200, params, logits)
    assert a == draw(123, 200, params, logits)
    assert a != draw(124, 200, params, logits)
    assert len(set(a)) == 8  # really random, not stuck on one token


def chi_square(counts, probs):
    expected = counts.sum() * np.asarray(probs)
    assert expected.min() >= 5  # the chi-square approximation needs non-tiny cells
    return float(((counts - expected) ** 2 / expected).sum())


# Upper 1e-4 quantiles of the chi-square distribution (computed offline from
# the regularised incomplete gamma function): a correct sampler fails one of
# these tests with probability ~1e-4, and with a fixed seed never flakes.
CHI2_P1E4 = {3: 21.11, 5: 25.74}


def test_temperature_matches_softmax_statistically():
    logits = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 0.2])
    params = SamplingParams(temperature=0.7)
    counts = np.bincount(draw(2024, 20_000, params, logits), minlength=6)
    e = np.exp(logits / 0.7)
    assert chi_square(counts, e / e.sum()) < CHI2_P1E4[5]
    # The same test has power: the untempered distribution is clearly rejected.
    e1 = np.exp(logits)
    assert chi_square(counts, e1 / e1.sum()) > 10 * CHI2_P1E4[5]


def test_top_p_samples_renormalised_nucleus():
    probs = np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
    # Cumulative 0.35, 0.60, 0.75, 0.87: the nucleus for 0.8 is tokens 0..3.
    params = SamplingParams(temperature=1.0, top_p=0.8)
    counts = np.bincount(draw(7, 20_000, params, np.log(probs)), minlength=6)
    assert counts[4] == 0 and counts[5] == 0
    nucleus = probs[:4] / probs[:4].sum()
    assert chi_square(counts[:4], nucleus) < CHI2_P1E4[3]


# ---------------------------------------------------------------- logprobs


def reference_log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    return x - x.max() - np.log(np.sum(np.exp(x - x.max())))


def test_logprobs_are_raw_penalised_log_softmax():
    rng = make_rng(5)
    vocab = 40
    params = SamplingParams(
        temperature=0.6,
        top_k=10,
        top_p=0.9,
        logprobs=5,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.2,
    )
    for _ in range(30):
        logits = rng.normal(scale=3.0, size=vocab).astype(np.float32)
        output, prompt = rng.integers(0, vocab, 6).tolist(), rng.integers(0, vocab, 6).tolist()
        token, lp = sample_next_token(logits, params, rng, output, prompt)
        ref = reference_log_softmax(penalties_by_loop(logits, output, prompt, 1.3, 0.4, 0.2))
        top5 = set(np.argsort(-ref)[:5].tolist())
        assert set(lp) == top5 | {token}
        assert next(iter(lp)) == token  # sampled token first
        for t, entry in lp.items():
            assert isinstance(entry, Logprob) and entry.decoded_token is None
            assert entry.logprob == pytest.approx(ref[t], rel=1e-9, abs=1e-9)
            assert entry.rank == 1 + sum(1 for v in ref if v > ref[t])


def test_logprobs_include_sampled_token_outside_top():
    rng = make_rng(11)
    logits = np.array([2.0, 1.0, 0.5, 0.0])
    params = SamplingParams(temperature=2.0, logprobs=1)
    seen_outside = False
    for _ in range(200):
        token, lp = sample_next_token(logits, params, rng)
        assert 0 in lp and lp[0].rank == 1
        if token != 0:
            seen_outside = True
            assert len(lp) == 2 and lp[token].rank == token + 1
        else:
            assert len(lp) == 1
    assert seen_outside


def test_logprobs_zero_and_none():
    logits = np.array([0.1, 2.0, -1.0])
    token, lp = sample_next_token(logits, SamplingParams(temperature=0, logprobs=0), make_rng(0))
    assert token == 1 and list(lp) == [1] and lp[1].rank == 1
    assert lp[1].logprob == pytest.approx(reference_log_softmax(logits)[1])
    assert sample_next_token(logits, SamplingParams(temperature=0), make_rng(0))[1] is None


def test_logprob_ties_share_rank():
    params = SamplingParams(temperature=0, logprobs=3)
    token, lp = sample_next_token(np.array([1.0, 1.0, 0.0]), params, make_rng(0))
    assert token == 0
    assert [lp[t].rank for t in (0, 1, 2)] == [1, 1, 3]
    # Ties for the last top-n slot go to the lower token id.
    params = SamplingParams(temperature=0, logprobs=2)
    token, lp = sample_next_token(np.array([1.0, 1.0, 1.0, 0.0, 2.0]), params, make_rng(0))
    assert token == 4 and list(lp) == [4, 0] and lp[0].rank == 2


# ---------------------------------------------------------------- outputs


def test_request_metrics_ttft_and_tpot():
    m = RequestMetrics(arrival_time=10.0, first_token_time=10.5, finished_time=12.5, num_output_tokens=5)
    assert m.time_to_first_token == pytest.approx(0.5)
    assert m.time_per_output_token == pytest.approx(2.0 / 4)  # 4 inter-token gaps after the first
    assert RequestMetrics(10.0, 10.5, 10.5, num_output_tokens=1).time_per_output_token is None
    assert RequestMetrics(10.0).time_to_first_token is None
    assert RequestMetrics(10.0, 11.0, None, num_output_tokens=3).time_per_output_token is None


def test_completion_and_request_output():
    running = CompletionOutput(index=0, text="he", token_ids=[5, 6], finish_reason=None)
    done = CompletionOutput(
        index=1,
        text="hi.",
        token_ids=[5, 7, 2],
        finish_reason="stop",
        stop_reason=2,
        logprobs=[{5: Logprob(-0.1, 1, "h")}],
        cumulative_logprob=-0.1,
    )
    assert not running.finished() and done.finished()
    out = RequestOutput("r0", "say hi", [1, 9], [running, done], finished=False)
    assert out.num_cached_tokens == 0 and out.metrics is None and out.error is None
    assert [o.index for o in out.outputs] == [0, 1]
