"""Speculative decoding in the engine: greedy output is token-for-token the
non-speculative output with each proposer (under preemption, prefix hits and
stop ids), a draft equal to the target has every draft accepted, a batch
mixing speculating and non-speculating requests completes correctly, and
nothing compiles after warm-up. (Acceptance itself, including the sampled
rule's distribution, is tested in test_spec_acceptance.py.)"""

import numpy as np
import pytest
import torch

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig
from tests.block_manager_checks import check_invariants
from tests.tiny_models import make_hf_model, save_hf_model

# 23 usable blocks of 4 tokens for up to 8 sequences: preemption is frequent.
# Every LLM here shares these shapes, so programs compile once per process.
ENGINE = dict(max_model_len=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=24)
K = 3
# Drafting at every batch size and step (disable_by_batch_size=None, adaptive=False): these tests are
# about the machinery in batches, preemption included, not about when drafting pays.
ALWAYS = dict(num_speculative_tokens=K, disable_by_batch_size=None, adaptive=False)
PROPOSERS = {
    "ngram": dict(method="ngram", max_n=3, **ALWAYS),
    "draft_is_target": dict(method="draft_model", **ALWAYS),
    "other_draft": dict(method="draft_model", **ALWAYS),  # model set in the fixture
    # Random heads for the tiny target, set in spec_llm: with a draft vocabulary (as shipped) and without.
    "eagle": dict(method="eagle", **ALWAYS),
    "eagle_full_vocab": dict(method="eagle", **ALWAYS),
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_hf_model(make_hf_model("llama", seed=21), tmp_path_factory.mktemp("spec_target")))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """The target with noise on its weights: it agrees with the target often, not always."""
    model = make_hf_model("llama", seed=21)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.03 * torch.randn(param.shape, generator=generator))
    return str(save_hf_model(model, tmp_path_factory.mktemp("spec_draft")))


@pytest.fixture(scope="module")
def eagle_head(tiny_dir, tmp_path_factory):
    """Untrained (random) EAGLE heads for the tiny target: their drafts are
    rarely right, which exercises rejection; exactness must hold regardless.
    -> {"eagle": a head with a draft vocabulary of 96 of the 128 target ids
    in shuffled order (so a draft id is never its target id), "eagle_full_vocab": one
    scoring the target's whole vocabulary}."""
    import jax

    from jaxinfer import load
    from jaxinfer.engine.spec.eagle_head import init_head, save_head

    model = load(tiny_dir, progress=False)
    directory = tmp_path_factory.mktemp("eagle")
    head = init_head(model.config, jax.random.key(0))
    save_head(directory / "full.safetensors", head, model.config, 6, {})
    rng = np.random.default_rng(0)
    d2t = rng.permutation(model.config.vocab_size)[:96].astype(np.int32)
    lm_head = rng.normal(size=(model.config.hidden_size, 96)).astype(np.float32)
    save_head(directory / "vocab.safetensors", head | {"lm_head": lm_head, "d2t": d2t}, model.config, 6, {})
    return {"eagle": str(directory / "vocab.safetensors"), "eagle_full_vocab": str(directory / "full.safetensors")}


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(tiny_dir, progress=False, **ENGINE)


@pytest.fixture(scope="module")
def workload(plain):
    """Random prompts, repetitive ones (n-gram hits), a shared 12-token prefix
    (prefix-cache hits), and stop ids chosen from plain outputs so that some
    requests stop mid-way: (prompts, params, plain outputs)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, int(n)).tolist() for n in rng.integers(1, 40, 10)]
    prompts += [[5, 6, 7, 8] * 5, [9, 9, 3] * 7, list(range(30, 42)) * 2]
    prefix = rng.integers(0, 128, 12).tolist()
    prompts += [prefix + [1], prefix + [2, 3], prefix + [4, 5, 6]]
    max_tokens = [int(m) for m in rng.integers(1, 24, len(prompts))]
    params = [greedy(m) for m in max_tokens]
    first = plain.generate(prompts, params, use_tqdm=False)
    for i in (0, 4, 11):  # stop at a token the plain run emits after a few steps
        tokens = first[i].outputs[0].token_ids
        if len(tokens) > 3:
            params[i] = greedy(max_tokens[i], stop_token_ids=[tokens[3]])
    reference = plain.generate(prompts, params, use_tqdm=False)
    assert any(o.outputs[0].finish_reason == "stop" for o in reference)
    return prompts, params, reference


_llms = {}


def spec_llm(name, tiny_dir, draft_dir, eagle_head=None):
    if name not in _llms:
        spec = dict(PROPOSERS[name])
        if name == "other_draft":
            spec["model"] = draft_dir
        if name.startswith("eagle"):
            spec["model"] = eagle_head[name]
        _llms[name] = LLM(tiny_dir, progress=False, speculative=spec, **ENGINE)
    return _llms[name]


def check_compilations(llm) -> None:
    """The target's steps ran in buckets of its grid (compiled on demand), and
    the proposer compiled its programs at warm-up, none after."""
    proposer = llm.engine.proposer
    assert llm.stats()["num_compilations_off_grid"] == 0
    assert proposer.num_compilations == len(proposer.programs())


def record_proposals(llm) -> list:
    """(sequence tokens, drafts) for every sequence the proposer offered drafts."""
    proposer, proposals = llm.engine.proposer, []
    propose = proposer.propose

    def recording(seqs, caps):
        drafts = propose(seqs, caps)
        proposals.extend((seq.token_ids(), list(d)) for seq, d in zip(seqs, drafts) if d)
        return drafts

    proposer.propose = recording
    return proposals


def record_eagle_drafts(llm) -> list:
    """(sequences' tokens, the drafting call's inputs, its drafts) per EAGLE proposal."""
    proposer, calls = llm.engine.proposer, []
    propose, draft = proposer.propose, proposer._draft

    def recording_propose(seqs, caps):
        calls.append({"tokens": [seq.token_ids() for seq in seqs]})
        return propose(seqs, caps)

    def recording_draft(tokens, features, first_position, lengths):
        out = draft(tokens, features, first_position, lengths)
        calls[-1].update(window=tokens.copy(), features=features.copy(), first=first_position.copy(),
                         lengths=lengths.copy(), drafts=out.copy())
        return out

    proposer.propose, proposer._draft = recording_propose, recording_draft
    return calls


def check_eagle_drafts(llm, calls) -> None:
    """The features an EAGLE proposal used are the target's own (a cache-free
    forward over the sequence), and its drafts are the head's greedy chain
    recomputed over the whole window for every draft (no K/V buffer)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.models.attention import full_sequence_attention
    from jaxinfer.models.llama import forward
    from jaxinfer.engine.spec.eagle_head import draft_logits, head_features, window_attention
    from jaxinfer.utils import bucket_size

    proposer = llm.engine.proposer
    model, config = llm.model, llm.model.config

    @jax.jit
    def target_features(params, ids):
        positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
        return forward(params, config, ids, positions, full_sequence_attention(positions), backend=model.backend,
                       final_norm=False)[0]

    @jax.jit
    def head_draft(head, params, tokens, features, positions):
        """The head over the whole window: (its features at the last entry, their draft logits)."""
        out, _ = head_features(head, params, config, tokens, features, positions,
                               window_attention(jnp.ones(tokens.shape, bool)), backend=model.backend)
        return out[0, -1], draft_logits(head, params, config, out[0, -1], backend=model.backend)

    checked = 0
    for call in [c for c in calls if "drafts" in c][::3]:
        for row, (length, first) in enumerate(zip(call["lengths"], call["first"])):
            tokens = call["window"][row, :length]
            if length == 1 and not tokens.any():
                continue  # a padding row of the batch bucket
            seq_tokens = next(t for t in call["tokens"] if t[first: first + length] == tokens.tolist()
                              and len(t) == first + length)
            # Padded at the end to a bucket (as Model.logits pads), so that few lengths compile:
            # under causal attention the padding changes no earlier position's features.
            ids = np.zeros((1, bucket_size(len(seq_tokens))), np.int32)
            ids[0, :len(seq_tokens)] = seq_tokens
            feats = target_features(model.params, ids)
            np.testing.assert_allclose(call["features"][row, :length], np.asarray(feats[0, first - 1: first - 1 + length]),
                                       rtol=1e-4, atol=1e-4)
            entries_tokens, entries_feats = list(tokens), list(call["features"][row, :length])
            for j in range(K):
                t = jnp.asarray(entries_tokens, jnp.int32)[None]
                f = jnp.asarray(np.stack(entries_feats))[None]
                pos = first + jnp.arange(len(entries_tokens), dtype=jnp.int32)[None]
                last, logits = head_draft(proposer.head, model.params, t, f, pos)
                if "d2t" in proposer.head:  # the draft vocabulary's argmax, as the target id it stands for
                    assert logits.shape == (96,)
                    token = int(np.asarray(proposer.head["d2t"])[int(jnp.argmax(logits))])
                else:
                    assert logits.shape == (config.vocab_size,)
                    token = int(jnp.argmax(logits))
                assert token == call["drafts"][row, j]
                entries_tokens.append(token)
                entries_feats.append(np.asarray(last))
            checked += 1
            if checked == 6:  # each window length compiles its own head program; six proposals cover the plumbing
                return
    assert checked >= 3


def check_blocks_after_each_step(llm) -> None:
    """After every step no running sequence holds blocks past its tokens and
    the drafts it will verify next (the rejected drafts' blocks were trimmed),
    in the target's and the draft's cache."""
    engine = llm.engine
    step = engine.step
    managers = [engine.block_manager] + [getattr(engine.proposer, "block_manager", None)]

    def checked_step():
        outputs = step()
        for bm in filter(None, managers):
            check_invariants(bm)
            for seq in engine.scheduler.running:
                pending = seq.num_tokens + len(seq.draft_token_ids)
                assert len(bm.block_table(seq.seq_id)) <= -(-pending // bm.block_size)
        return outputs

    engine.step = checked_step


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROPOSERS))
def test_greedy_equals_plain_decoding(name, tiny_dir, draft_dir, eagle_head, workload):
    llm = spec_llm(name, tiny_dir, draft_dir, eagle_head)
    check_compilations(llm)
    prompts, params, reference = workload
    proposals = record_proposals(llm)
    eagle_calls = record_eagle_drafts(llm) if name.startswith("eagle") else None
    check_blocks_after_each_step(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out, ref in zip(outputs, reference):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
    stats = llm.stats()
    check_compilations(llm)
    assert stats["spec_proposed_tokens"] > 0 and stats["spec_verifications"] > 0
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["kv_blocks_used"] == 0
    check_invariants(llm.engine.block_manager)
    if name == "ngram":
        assert stats["spec_accepted_tokens"] > 0
    elif name.startswith("eagle"):
        check_eagle_drafts(llm, eagle_calls)
    else:
        draft_blocks = llm.engine.proposer.block_manager
        assert draft_blocks.num_used_blocks == 0  # freed on finish and on preemption
        check_invariants(draft_blocks)
    if name == "draft_is_target":
        assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"]
    if name == "other_draft":
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
        # After rejections and rollbacks the draft cache still holds exactly the
        # sequence's tokens: its drafts are the draft model's own greedy
        # continuation, computed here without any cache.
        draft_model = llm.engine.proposer.model
        for tokens, drafts in proposals[::4]:
            continuation = list(tokens)
            for _ in drafts:
                continuation.append(int(draft_model.logits(continuation)[-1].argmax()))
            assert continuation[len(tokens):] == drafts
    # Accepted drafts make the verification steps fewer than the tokens they emit.
    emitted_per_verification = 1 + stats["spec_accepted_tokens"] / stats["spec_verifications"]
    assert 1 <= emitted_per_verification <= 1 + K


@pytest.mark.parametrize("name", ["ngram", "other_draft", "eagle"])
def test_mixed_batch(name, plain, tiny_dir, draft_dir, eagle_head):
    """Greedy, seeded sampled (rejection sampling), penalised and logprobs
    requests in one batch; only the first two kinds speculate."""
    llm = spec_llm(name, tiny_dir, draft_dir, eagle_head)
    before = llm.stats()
    loop = [5, 6, 7, 8] * 4
    sampled = SamplingParams(temperature=0.8, top_k=40, max_tokens=20, seed=7, ignore_eos=True)
    requests = [
        (loop, greedy(20)),
        (loop, sampled),
        (loop + [1], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=15, seed=8, n=2, ignore_eos=True)),
        (loop, SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True)),
        (loop, SamplingParams(temperature=0.7, max_tokens=10, frequency_penalty=0.5, seed=3, ignore_eos=True)),
        (loop, SamplingParams(temperature=0.0, max_tokens=9, logprobs=2, ignore_eos=True)),
        (list(range(40, 60)), greedy(17, stop_token_ids=[0])),
    ]
    prompts, params = zip(*requests)
    outputs = llm.generate(list(prompts), list(params), use_tqdm=False)
    for out, p in zip(outputs, params):
        assert len(out.outputs) == p.n
        for completion in out.outputs:
            tokens = completion.token_ids
            if completion.finish_reason == "length":
                assert len(tokens) == p.max_tokens
            else:
                assert completion.finish_reason == "stop" and len(tokens) <= p.max_tokens
                assert tokens[-1] in p.stop_token_ids and not set(tokens[:-1]) & set(p.stop_token_ids)
    stats = llm.stats()
    assert stats["spec_proposed_tokens"] > before["spec_proposed_tokens"]
    check_compilations(llm)
    assert stats["kv_blocks_used"] == 0
    # Every request's tokens equal plain decoding's: greedy and seeded sampled
    # ones too, because verification draws the target's own token with the
    # plain sampler's key (engine/verify.py) whatever was drafted.
    everything = plain.generate(list(prompts), list(params), use_tqdm=False)
    for out, ref in zip(outputs, everything):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    reference = everything[3:6]
    logprobs, ref_logprobs = outputs[5].outputs[0].logprobs, reference[2].outputs[0].logprobs
    assert [sorted(e) for e in logprobs] == [sorted(e) for e in ref_logprobs]
    for entry, ref_entry in zip(logprobs, ref_logprobs):
        for token, lp in entry.items():
            assert lp.logprob == pytest.approx(ref_entry[token].logprob, abs=1e-4)
    # A seeded speculating request draws the same tokens alone as in the batch.
    alone = llm.generate([loop], sampled, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_drafting_off_above_batch_size(plain, tiny_dir):
    """disable_by_batch_size=2: no step offers drafts while more than two
    sequences decode; once the batch has shrunk to two, drafting resumes;
    every output is still plain decoding's."""
    llm = LLM(tiny_dir, progress=False, speculative=dict(method="ngram", num_speculative_tokens=K, max_n=3,
                                                         disable_by_batch_size=2, adaptive=False), **ENGINE)
    sizes = []
    propose = llm.engine.proposer.propose

    def recording(seqs, caps):
        sizes.append(len(seqs))
        return propose(seqs, caps)

    llm.engine.proposer.propose = recording
    prompts = [[5, 6, 7, 8] * 4 + [i] for i in range(6)]
    params = [greedy(4 + 4 * i) for i in range(6)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    reference = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    assert sizes and max(sizes) <= 2
    assert llm.stats()["spec_accepted_tokens"] > 0


# Its rule times drafting against plain decoding on the wall clock: it runs
# alone after the parallel suite (scripts/test.sh), where another worker's
# load would skew the times it compares (it failed so once in ~3 runs).
@pytest.mark.serial
def test_adaptive_drafting_is_exact_and_turns_off(plain, tiny_dir, eagle_head):
    """adaptive=True with a random EAGLE head, whose drafts almost never
    hit: after the steps that time drafting and plain decoding, the rule
    stops drafting (a verification then costs more than the one token it
    yields) but for its periodic tries, and the output is plain decoding's."""
    from jaxinfer.engine.spec.policy import MIN_SAMPLES, PROBE_STEPS

    spec = dict(PROPOSERS["eagle"], model=eagle_head["eagle"], adaptive=True)
    llm = LLM(tiny_dir, progress=False, speculative=spec, warmup="background", **ENGINE)
    prompt = [3, 1, 4, 1, 5]
    # Steps beside the background compilation (seconds of it; these take
    # milliseconds) time the compilation too: the rule is not told them.
    llm.generate([prompt], greedy(8), use_tqdm=False)
    assert llm.engine.runner.compiling
    assert all(mean.count == 0 for mean in llm.engine.proposer.policy.step_seconds.values())
    llm.wait_compiled()
    before = llm.stats()["spec_verifications"]
    params = greedy(80)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    # Without the rule every one of the ~80 steps would verify drafts.
    verifications = llm.stats()["spec_verifications"] - before
    assert 0 < verifications <= 2 * MIN_SAMPLES + 2 + 2 * PROBE_STEPS


def test_adaptive_rule_is_not_told_steps_that_compiled(tiny_dir, eagle_head):
    """On demand, a step that compiles its bucket's programs takes seconds
    where it would take milliseconds: the adaptive rule gets no time for it
    (as for a step beside a background compilation), and does for the others."""
    spec = dict(PROPOSERS["eagle"], model=eagle_head["eagle"], adaptive=True)
    llm = LLM(tiny_dir, progress=False, speculative=spec, warmup="on_demand", **ENGINE)
    engine, steps, at_step_start = llm.engine, [], []
    step, after_step = engine.step, engine.proposer.after_step

    def counting_step():  # the runner's compilations when each step begins
        at_step_start.append(engine.runner.num_compilations)
        return step()

    def recording(batch, out, started):
        steps.append((engine.runner.num_compilations != at_step_start[-1], started))
        after_step(batch, out, started)

    engine.step, engine.proposer.after_step = counting_step, recording
    llm.generate([list(range(1, 21)), [3, 1, 4]], greedy(6), use_tqdm=False)  # a 32-token prompt bucket: compiled
    assert any(compiled for compiled, _ in steps) and any(not compiled for compiled, _ in steps)
    assert all((started is None) == compiled for compiled, started in steps)


def test_throughput_benchmark_reports_acceptance(tiny_dir, draft_dir):
    from jaxinfer.benchmark import run_throughput, synthetic_requests

    llm = spec_llm("ngram", tiny_dir, draft_dir)
    requests = synthetic_requests(128, 6, 12, 16, range_ratio=0.5, seed=1)
    result = run_throughput(llm, [([3, 4, 5] * 4 + prompt, params) for prompt, params in requests])
    spec = result["speculative"]
    assert spec["method"] == "ngram" and spec["proposed_tokens"] > 0
    assert 0 <= spec["acceptance_rate"] <= 1 and 1 <= spec["mean_accepted_length"] <= 1 + K
    assert result["compilations_during_run"] == 0


@pytest.mark.parametrize(
    "speculative, match",
    [
        ("ngram", "must be a dict"),
        (dict(method="eagle", num_speculative_tokens=2, max_n=3), "unknown key"),
        (dict(method="medusa", num_speculative_tokens=2), "method"),
        (dict(method="ngram"), "num_speculative_tokens'] is required"),
        (dict(method="ngram", num_speculative_tokens=0), "positive int"),
        (dict(method="ngram", num_speculative_tokens=2, model="x"), "unknown key"),
        (dict(method="ngram", num_speculative_tokens=2, max_n=2, min_n=3), "min_n"),
        (dict(method="draft_model", num_speculative_tokens=2, max_n=3), "unknown key"),
        (dict(method="eagle", num_speculative_tokens=2, disable_by_batch_size=0), "positive int"),
        (dict(method="ngram", num_speculative_tokens=2, disable_by_batch_size=1.5), "positive int"),
    ],
)
def test_bad_speculative_config(speculative, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(max_model_len=64, speculative=speculative)


def test_a_quantized_copy_of_an_already_quantized_target_is_refused(tiny_dir):
    """draft_model with no model and a quantization rounds the target's float
    weights; a target loaded quantized gets an error naming both ways out."""
    from jaxinfer import load
    from jaxinfer.engine.spec.config import SpeculativeConfig
    from jaxinfer.engine.spec.draft_model import load_draft_model

    spec = SpeculativeConfig.parse(dict(method="draft_model", num_speculative_tokens=2, quantization="int4"))
    with pytest.raises(ValueError, match="holds its weights as 'int8'.*quantization=None.*speculative"):
        load_draft_model(spec, load(tiny_dir, progress=False, quantization="int8"))
    draft = load_draft_model(spec, load(tiny_dir, progress=False))
    assert draft.params["layers"]["wq"].scheme == "int4"


def test_disable_by_batch_size_default_and_none():
    from jaxinfer.engine.spec.config import DISABLE_BY_BATCH_SIZE, SpeculativeConfig

    for method in ("ngram", "draft_model", "eagle"):
        parsed = SpeculativeConfig.parse(dict(method=method, num_speculative_tokens=2))
        assert parsed.disable_by_batch_size == DISABLE_BY_BATCH_SIZE[method]
        always = SpeculativeConfig.parse(dict(method=method, num_speculative_tokens=2, disable_by_batch_size=None))
        assert always.disable_by_batch_size is None
