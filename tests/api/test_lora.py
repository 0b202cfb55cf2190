"""LoRA adapters against HF transformers + PEFT: tiny random models and
random adapters (init_lora_weights=False, so B is not zero) written with
peft's own save_pretrained; jaxinfer's logits and greedy tokens must match
PeftModel's, in batches that mix adapters, across evictions, without
compiling after warm-up; bad adapters fail their request only."""

import copy
import json

import numpy as np
import peft  # the test extra (pyproject.toml): a missing peft fails here rather than skipping
import pytest
import torch

from jaxinfer import LLM, LoRARequest, SamplingParams
from jaxinfer.errors import RequestError
from tests.lora_helpers import last_row_logits, make_adapter, peft_model
from tests.parallel_checks import count_compilations
from tests.tiny_models import assert_logits_close, hf_greedy, hf_logits, make_hf_model, save_hf_model

ENGINE = dict(max_model_len=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> LoraConfig options: several ranks and target sets, rslora, per-module rank and alpha.
ADAPTERS = {
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all8_rslora": dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS, use_rslora=True),
    "mlp16_patterns": dict(r=16, lora_alpha=32, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
                           rank_pattern={"down_proj": 2}, alpha_pattern={"gate_proj": 3}),
    "qk_kv2": dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj"]),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(HF base model, its directory, {adapter name: LoRARequest}, engine)."""
    root = tmp_path_factory.mktemp("lora_llama")
    base = make_hf_model("llama", seed=31)
    base_dir = save_hf_model(base, root / "base")
    requests = {name: LoRARequest(name, i + 1, make_adapter(base, root / name, seed=i, **options))
                for i, (name, options) in enumerate(ADAPTERS.items())}
    llm = LLM(str(base_dir), progress=False, enable_lora=True, max_loras=3, max_lora_rank=16, **ENGINE)
    llm.wait_compiled()  # every bucket its own program: the compile counts below see only what adapters cause
    return base, str(base_dir), requests, llm


def prompts_for(count, seed=0, vocab=128):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(5, 14, count)]


def test_logits_match_peft_in_one_mixed_batch(llama):
    """Base model and three adapters (ranks 2-16, q/k/v, all seven, MLP-only
    with rank/alpha patterns, rslora) as rows of one forward."""
    base, _, requests, llm = llama
    names = [None, "qv4", "all8_rslora", "mlp16_patterns"]
    prompts = prompts_for(len(names), seed=1)
    ids = []
    for name in names:
        if name is not None:
            llm.engine.validate_lora("parity", requests[name])
        ids.append(requests[name].lora_int_id if name else 0)
    logits = last_row_logits(llm, prompts, ids)
    for row, name, prompt in zip(logits, names, prompts):
        reference = hf_logits(base if name is None else peft_model(base, requests[name].lora_path), prompt)[-1]
        assert_logits_close(row, reference)
        if name is not None:  # the adapter matters: far from the base model's logits
            base_logits = hf_logits(base, prompt)[-1]
            assert np.abs(base_logits - reference).max() > 100 * 1e-4 * np.abs(reference).max()


def test_qwen2_adapter_matches_peft(tmp_path):
    """Qwen2 (q/k/v biases, tied embeddings), every target, two decode forms:
    the mixed forward's logits and greedy tokens through decode steps."""
    base = make_hf_model("qwen2", seed=32)
    base_dir = save_hf_model(base, tmp_path / "base")
    adapter = LoRARequest("q", 7, make_adapter(base, tmp_path / "q", seed=5, r=8, lora_alpha=8,
                                               target_modules=ALL_TARGETS))
    llm = LLM(str(base_dir), progress=False, enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE)
    prompt = prompts_for(1, seed=2)[0]
    reference = peft_model(base, adapter.lora_path)
    llm.engine.validate_lora("parity", adapter)
    assert_logits_close(last_row_logits(llm, [prompt], [7])[0], hf_logits(reference, prompt)[-1])
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate([prompt], greedy, use_tqdm=False, lora_request=adapter)
    assert out[0].outputs[0].token_ids == hf_greedy(reference, prompt, 6)


@pytest.fixture(scope="module")
def mixed_run(llama):
    """Eight prompts cycling through the base model and three adapters,
    generated together, and the PeftModel greedy tokens of each."""
    base, _, requests, llm = llama
    names = [None, "qv4", "all8_rslora", "mlp16_patterns"] * 2
    prompts = prompts_for(len(names), seed=3)
    loras = [requests[n] if n else None for n in names]
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=loras)
    models = {n: base if n is None else peft_model(base, requests[n].lora_path) for n in set(names)}
    expected = [hf_greedy(models[n], p, 5) for n, p in zip(names, prompts)]
    return prompts, loras, [o.outputs[0].token_ids for o in outputs], expected


def test_mixed_batch_equals_peft_and_each_request_alone(llama, mixed_run):
    _, _, _, llm = llama
    prompts, loras, batched, expected = mixed_run
    assert batched == expected
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for prompt, lora, tokens in zip(prompts[:4], loras[:4], batched[:4]):
        alone = llm.generate([prompt], greedy, use_tqdm=False, lora_request=lora)
        assert alone[0].outputs[0].token_ids == tokens


def test_evict_and_reload_without_compiling(llama, mixed_run):
    """A fourth adapter with three slots evicts the least recently used one;
    reloading it gives the same tokens, and nothing compiles meanwhile."""
    base, _, requests, llm = llama
    prompts, loras, batched, _ = mixed_run
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    fourth = requests["qk_kv2"]
    prompt = prompts_for(1, seed=4)[0]
    loads = llm.stats()["lora_loads"]
    with count_compilations(llm) as compiled:
        out = llm.generate([prompt], greedy, use_tqdm=False, lora_request=fourth)
        assert fourth.lora_int_id in llm.engine.lora.resident()
        assert len(llm.engine.lora.resident()) == 3  # someone was evicted
        again = llm.generate(prompts[:4], greedy, use_tqdm=False, lora_request=loras[:4])
    assert compiled == []
    assert llm.stats()["lora_loads"] > loads + 1  # the fourth, then the evicted one back
    assert out[0].outputs[0].token_ids == hf_greedy(peft_model(base, fourth.lora_path), prompt, 5)
    assert [o.outputs[0].token_ids for o in again] == batched[:4]


def test_prefix_cache_is_keyed_by_adapter(llama):
    """The same 13-token prompt (3 full blocks) under the base model and then
    an adapter: the adapter's run must not reuse the base model's K/V."""
    base, _, requests, llm = llama
    prompt = prompts_for(1, seed=6)[0][:5] + list(range(40, 48))
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([prompt], greedy, use_tqdm=False)
    hits = llm.stats()["prefix_cache_hits"]
    lora = requests["all8_rslora"]
    out = llm.generate([prompt], greedy, use_tqdm=False, lora_request=lora)
    assert llm.stats()["prefix_cache_hits"] == hits
    assert out[0].outputs[0].token_ids == hf_greedy(peft_model(base, lora.lora_path), prompt, 4)
    llm.generate([prompt], greedy, use_tqdm=False, lora_request=lora)
    assert llm.stats()["prefix_cache_hits"] > hits  # the same adapter does share


def test_quantized_base_applies_adapter(llama):
    """int8 base weights: the adapter's term adds to the quantized linear's
    output, so the logits land near PeftModel's and far from the base's."""
    base, base_dir, requests, _ = llama
    llm = LLM(base_dir, progress=False, quantization="int8", enable_lora=True, max_loras=1, max_lora_rank=16,
              **ENGINE)
    lora = requests["all8_rslora"]
    llm.engine.validate_lora("q", lora)
    prompt = prompts_for(1, seed=7)[0]
    row = last_row_logits(llm, [prompt], [lora.lora_int_id])[0]
    reference = hf_logits(peft_model(base, lora.lora_path), prompt)[-1]
    scale = np.abs(reference).max()
    assert np.abs(row - reference).max() < 0.05 * scale
    assert np.abs(row - hf_logits(base, prompt)[-1]).max() > 0.2 * scale


# -- bad adapters ---------------------------------------------------------------------------------


def _bad(kind, base, directory):
    """A PEFT directory with one unsupported feature, and the words its error must contain."""
    if kind == "dora":
        make_adapter(base, directory, 0, r=4, lora_alpha=4, target_modules=["q_proj"], use_dora=True)
        return "DoRA"
    if kind == "modules_to_save":
        make_adapter(base, directory, 0, r=4, lora_alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
        return "modules_to_save"
    if kind == "bias":
        make_adapter(base, directory, 0, r=4, lora_alpha=4, target_modules=["q_proj"], bias="lora_only")
        return "bias"
    if kind == "pickle":
        torch.manual_seed(0)
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=["q_proj"]))
        model.save_pretrained(str(directory), safe_serialization=False)
        assert (directory / "adapter_model.bin").exists()
        return "pickle"
    if kind == "rank":
        make_adapter(base, directory, 0, r=32, lora_alpha=32, target_modules=["v_proj"])
        return "max_lora_rank"
    if kind == "shapes":  # an adapter of a wider model
        other = make_hf_model("llama_tp", seed=1)
        make_adapter(other, directory, 0, r=4, lora_alpha=4, target_modules=["q_proj"])
        return "another model"
    if kind == "embeddings":
        make_adapter(base, directory, 0, r=4, lora_alpha=4, target_modules=["q_proj", "embed_tokens"])
        return "not supported"
    if kind == "missing":
        return "not a directory"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["dora", "modules_to_save", "bias", "pickle", "rank", "shapes", "embeddings",
                                  "missing"])
def test_bad_adapter_fails_its_request_only(llama, mixed_run, tmp_path, kind):
    base, _, requests, llm = llama
    words = _bad(kind, base, tmp_path / "bad")
    bad = LoRARequest("bad", 100, str(tmp_path / "bad"))
    prompts, loras, batched, _ = mixed_run
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with pytest.raises(RequestError, match=words):
        llm.generate(prompts[:2], greedy, use_tqdm=False, lora_request=[loras[0], bad])
    with pytest.raises(RequestError, match=words):
        llm.engine.add_request(f"bad-{kind}", prompts[0], greedy, lora_request=bad)
    # the engine keeps serving: the good requests still give their tokens
    out = llm.generate(prompts[:2], greedy, use_tqdm=False, lora_request=loras[:2])
    assert [o.outputs[0].token_ids for o in out] == batched[:2]


def test_adapter_config_checked_before_weights(tmp_path, llama):
    """The config's own claims (here a rank the tensors do not have) are checked."""
    base, _, _, llm = llama
    directory = make_adapter(base, tmp_path / "a", 0, r=4, lora_alpha=4, target_modules=["q_proj"])
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    config["r"] = 8
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(RequestError, match="rank 4 but its config says 8"):
        llm.engine.validate_lora("x", LoRARequest("a", 101, directory))


def test_lora_request_needs_enable_lora(tmp_path):
    base = make_hf_model("llama", seed=31)
    base_dir = save_hf_model(base, tmp_path / "base")
    lora = LoRARequest("a", 1, make_adapter(base, tmp_path / "a", 0, r=2, lora_alpha=2, target_modules=["q_proj"]))
    llm = LLM(str(base_dir), progress=False, **dict(ENGINE, max_num_seqs=1, max_num_batched_tokens=16))
    assert "lora" not in llm.engine.runner.params["layers"]
    with pytest.raises(RequestError, match="enable_lora"):
        llm.generate([[1, 2, 3]], lora_request=lora, use_tqdm=False)
    with pytest.raises(ValueError, match="speculative"):
        LLM(str(base_dir), progress=False, enable_lora=True,
            speculative={"method": "ngram", "num_speculative_tokens": 2}, **ENGINE)


@pytest.mark.parametrize("form", ["gather", "one-hot", "ragged"])
def test_lora_delta_forms_match_float64(form):
    """Each form of models/lora.py (the engine picks gather or one-hot by row
    count; ragged is measured by scripts/bench_lora.py) against a float64
    per-row loop, with rows of slot 0 (no adapter) among the others."""
    from jaxinfer.models import lora

    rng = np.random.default_rng(0)
    fan_in, slots, rank, fan_out = 12, 3, 4, 10
    a = rng.normal(size=(fan_in, slots, rank)).astype(np.float32)
    b = rng.normal(size=(slots, rank, fan_out)).astype(np.float32)
    for rows in (1, 3, 8):
        x = rng.normal(size=(rows, fan_in)).astype(np.float32)
        row_slots = np.array([(3 * k + 1) % (slots + 1) for k in range(rows)], np.int32)  # 1, 0, 3, 2, ...
        expected = np.zeros((rows, fan_out))
        for k, s in enumerate(row_slots):
            if s:
                expected[k] = x[k].astype(np.float64) @ a[:, s - 1].astype(np.float64) @ b[s - 1].astype(np.float64)
        got = np.asarray(lora._FORMS[form](x, a, b, row_slots))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
