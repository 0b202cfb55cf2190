"""Mixtures of experts (models/moe.py) beyond the logits parity of every
family (tests/models/test_hf_parity.py runs the MoE variants of tiny_models):
the checkpoint layouts (fused 3-D expert tensors, sharded files, GGUF files
written by the gguf package, kept quantized), every weight scheme, LoRA on
the attention (and its refusal on experts), and the engine: continuous
batching, chunked prefill, preemption and prefix caching give each
request the tokens it gets alone, structured outputs and the server."""

import copy
import dataclasses
import json

import gguf
import jax
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import jaxinfer
from jaxinfer import LLM, SamplingParams, StructuredOutputsParams
from jaxinfer.errors import RequestError
from jaxinfer.loading.model import _full_logits
from jaxinfer.native import expert_matmul
from jaxinfer.native import matmul as cpu_matmul
from jaxinfer.quant.tensor import QuantizedTensor
from tests.gguf_writer import round_trip_hf_model, write_gguf
from tests.tiny_models import assert_logits_close, hf_logits, make_hf_model, save_hf_model

Q = gguf.GGMLQuantizationType
TOKENS = np.random.default_rng(0).integers(0, 128, 40)


def native_calls(model) -> dict:
    """How many of each native expert kernel the model's forward calls."""
    text = _full_logits.lower(model.params, model.config, np.zeros((1, 64), np.int32), model.backend).as_text()
    return {"float": text.count(expert_matmul.TARGET_NAME), "quantized": text.count(cpu_matmul.EXPERT_TARGET_NAME)}


# -- checkpoint layouts ----------------------------------------------------------------------------
def test_fused_expert_tensors_as_transformers_holds_them(tmp_path):
    """transformers >= 5's own layout (gate_up_proj [experts, 2 * ffn, hidden],
    down_proj [experts, hidden, ffn]), saved from its state dict."""
    hf_model = make_hf_model("qwen2_moe", seed=1)
    hf_model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    model = jaxinfer.load(str(tmp_path), progress=False)
    assert native_calls(model)["float"] == 2  # the scan body's gate/up and down
    assert_logits_close(model.logits(TOKENS), hf_logits(hf_model, TOKENS))


def test_sharded_per_expert_checkpoint(tmp_path):
    hf_model = make_hf_model("mixtral", seed=2)
    save_hf_model(hf_model, tmp_path, max_shard_size="30KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    assert_logits_close(jaxinfer.load(str(tmp_path), progress=False).logits(TOKENS), hf_logits(hf_model, TOKENS))


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_f32_gguf_equals_the_safetensors_load(tmp_path, variant):
    """A GGUF written as llama.cpp's converter writes a MoE (stacked
    ffn_*_exps, expert_count / expert_used_count, Mixtral as "llama" with
    its Q/K rows permuted): the safetensors load's logits and config."""
    hf_model = make_hf_model(variant, seed=3)
    from_gguf = jaxinfer.load(str(write_gguf(hf_model, tmp_path / "m.gguf")), progress=False)
    from_safetensors = jaxinfer.load(str(save_hf_model(hf_model, tmp_path / "hf")), progress=False)
    if variant == "qwen3_moe":  # llama.cpp renormalises Qwen3-MoE's top-k always; so does this config
        assert from_safetensors.config.norm_topk_prob
    eps = from_safetensors.config.rms_norm_eps  # float32 in the file
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=eps) == from_safetensors.config
    assert_logits_close(from_gguf.logits(TOKENS), from_safetensors.logits(TOKENS), rtol=1e-5)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q5_0], ids=lambda q: q.name)
def test_quantized_gguf_experts_stay_in_their_blocks(tmp_path, qtype):
    """The stacked experts load as the file's own codes (one QuantizedTensor
    [layers, experts, in, out]), multiplied by the native kernel: exactly the
    quantize-dequantize image of the model (and for Q8_0 within quantization
    error of the float model; "gguf-a8", int8 activations, close to "gguf")."""
    hf_model = make_hf_model("qwen2_moe", seed=4)
    path = write_gguf(hf_model, tmp_path / "m.gguf", qtype)
    model = jaxinfer.load(str(path), progress=False)
    experts = model.params["layers"]["expert_gate"]
    assert isinstance(experts, QuantizedTensor) and experts.shape == (3, 8, 64, 32)
    assert native_calls(model)["quantized"] == 2
    logits = model.logits(TOKENS)
    assert_logits_close(logits, hf_logits(round_trip_hf_model(copy.deepcopy(hf_model), qtype), TOKENS))
    if qtype == Q.Q8_0:  # (4 and 5 bits move this random net's logits by 10-30% RMS)
        exact = hf_logits(hf_model, TOKENS)
        assert np.sqrt(((logits - exact) ** 2).mean() / (exact ** 2).mean()) < 0.1
        a8_model = jaxinfer.load(str(path), progress=False, quantization="gguf-a8")
        assert native_calls(a8_model)["quantized"] == 2  # the exact kernel on activations rounded first
        a8 = a8_model.logits(TOKENS)
        # int8 activation rounding (~0.4% per block), amplified by this random net as Q8_0's own error
        assert np.sqrt(((a8 - logits) ** 2).mean() / (logits ** 2).mean()) < 0.05


# -- weight schemes ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    """Top-8 of 16 experts, dense and sparse layers mixed."""
    hf_model = make_hf_model("qwen3_moe", seed=5)
    return hf_model, str(save_hf_model(hf_model, tmp_path_factory.mktemp("qwen3_moe")))


def rtn_image(hf_model, scheme: str):
    """The HF model with every linear weight (attention, dense MLP, experts,
    shared expert; not the routers, embeddings or head) replaced by its
    round-to-nearest image, computed here in numpy in HF's orientation
    [..., out, in]: int8 absmax / 127 per output channel, int4 min..max in
    15 steps per group of min(128, in) inputs, fp8 e4m3 with absmax / 448."""
    import ml_dtypes

    def image(w):
        if scheme == "int8":
            s = np.abs(w).max(-1, keepdims=True) / 127
            s = np.where(s > 0, s, 1)
            return np.clip(np.round(w / s), -127, 127) * s
        if scheme == "fp8":
            s = np.abs(w).max(-1, keepdims=True) / 448
            s = np.where(s > 0, s, 1)
            return (w / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
        group = np.gcd(w.shape[-1], 128)
        g = w.reshape(*w.shape[:-1], -1, group)
        lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
        s = np.where(hi > lo, (hi - lo) / 15, 1)
        return (np.clip(np.round((g - lo) / s), 0, 15) * s + lo).reshape(w.shape)

    hf_model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj")):
                param.copy_(torch.from_numpy(image(param.float().numpy()).astype(np.float32)))
    return hf_model


@pytest.mark.parametrize("scheme,native", [("int8", True), ("int4", True), ("fp8", False), ("w8a8", False)])
def test_every_scheme_quantizes_the_experts(qwen3_moe_dir, scheme, native):
    """Load-time RTN of the experts (each expert's own scales) as of the dense
    weights; int8 / int4 through the native expert kernel, fp8 and w8a8
    through the reference's ragged_dot. The weight-only schemes give the
    logits of HF's model with its weights rounded independently here; w8a8
    (activations rounded per row too) stays close to int8's."""
    hf_model, directory = qwen3_moe_dir
    model = jaxinfer.load(directory, progress=False, quantization=scheme)
    layers = model.params["layers"]
    assert all(isinstance(layers[k], QuantizedTensor) and layers[k].scheme == scheme
               for k in ("expert_gate", "expert_up", "expert_down", "w_gate"))
    assert not isinstance(layers["router"], QuantizedTensor)
    assert (native_calls(model)["quantized"] > 0) == native
    logits = model.logits(TOKENS)
    if scheme == "w8a8":
        int8 = hf_logits(rtn_image(hf_model, "int8"), TOKENS)
        assert np.sqrt(((logits - int8) ** 2).mean() / (int8 ** 2).mean()) < 0.05
    else:
        assert_logits_close(logits, hf_logits(rtn_image(hf_model, scheme), TOKENS))


def test_convert_round_trip(qwen3_moe_dir, tmp_path):
    """`jaxinfer convert` writes a MoE's int8 experts (and its dense-layer list)
    to an orbax checkpoint that loads back to the same logits."""
    from jaxinfer.convert import convert

    _, directory = qwen3_moe_dir
    convert(directory, tmp_path / "int8", quantize="int8", progress=False, log=lambda *a: None)
    restored = jaxinfer.load(str(tmp_path / "int8"), progress=False)
    assert restored.config.dense_layers == (0, 2)
    assert isinstance(restored.params["layers"]["expert_down"], QuantizedTensor)
    np.testing.assert_allclose(restored.logits(TOKENS),
                               jaxinfer.load(directory, progress=False, quantization="int8").logits(TOKENS),
                               rtol=1e-5, atol=1e-5)


# -- LoRA ----------------------------------------------------------------------------------------
def test_lora_on_the_attention_and_refused_on_experts(qwen3_moe_dir, tmp_path):
    """An attention adapter gives PEFT's logits through the engine's LoRA
    path; one on the experts' or MLP's projections fails that request with
    a message naming why."""
    from peft import LoraConfig, get_peft_model

    hf_model, directory = qwen3_moe_dir
    torch.manual_seed(0)
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "attention")
    bad = tmp_path / "experts"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    save_file({f"base_model.model.model.layers.1.mlp.experts.0.gate_proj.lora_{p}.weight": torch.zeros(4, 64)
               for p in "AB"}, str(bad / "adapter_model.safetensors"))

    llm = LLM(directory, progress=False, enable_lora=True, max_loras=1, max_lora_rank=4, max_model_len=64,
              max_num_seqs=2, max_num_batched_tokens=32)
    good = jaxinfer.LoRARequest("attention", 1, str(tmp_path / "attention"))
    prompt = TOKENS[:12].tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5, ignore_eos=True),
                       lora_request=good, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        expected = torch.log_softmax(peft_model(torch.tensor([prompt])).logits[0, -1].float(), -1).numpy()
    for token, entry in out.logprobs[0].items():
        assert abs(entry.logprob - expected[token]) < 1e-4
    with pytest.raises(RequestError, match="mixture of experts is not supported; adapt its attention"):
        llm.generate([prompt], SamplingParams(max_tokens=1), lora_request=jaxinfer.LoRARequest("x", 2, str(bad)),
                     use_tqdm=False)


# -- the engine --------------------------------------------------------------------------------------
ENGINE = dict(max_model_len=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=40)


@pytest.fixture(scope="module")
def moe_llm(tmp_path_factory):
    """One engine for the module: Qwen2-MoE (shared expert, a dense layer)
    with a small byte-level BPE vocabulary of its own, a KV pool small enough
    to preempt."""
    from tokenizers import ByteLevelBPETokenizer

    from tests.tiny_models import VARIANTS

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(['{"yes": true, "no": false}', "Once upon a time there was a model."] * 20,
                                  vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    config_class, model_class, overrides = VARIANTS["qwen2_moe"]
    VARIANTS["qwen2_moe_bpe"] = (config_class, model_class, dict(overrides, vocab_size=tokenizer.get_vocab_size()))
    try:
        hf_model = make_hf_model("qwen2_moe_bpe", seed=6)
    finally:
        del VARIANTS["qwen2_moe_bpe"]
    directory = save_hf_model(hf_model, tmp_path_factory.mktemp("qwen2_moe_bpe"))
    tokenizer._tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    llm = LLM(str(directory), progress=False, **ENGINE)
    llm.wait_compiled()
    return hf_model, llm


@pytest.mark.slow
def test_batched_steps_give_each_request_its_own_tokens(moe_llm):
    """Continuous batching with chunked prefill, preemption and prefix-cache
    hits: every request's greedy tokens are those of uncached full forwards
    of it alone (routing included: a token's experts depend on it only),
    and the first ones are HF's."""
    hf_model, llm = moe_llm
    rng = np.random.default_rng(7)
    vocab = hf_model.config.vocab_size
    shared = rng.integers(0, vocab, 24).tolist()
    prompts = [shared + rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(1, 30, 10)]
    max_tokens = [int(m) for m in rng.integers(4, 12, 10)]
    reference = []
    for prompt, n in zip(prompts, max_tokens):
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(int(llm.model.logits(tokens)[-1].argmax()))
        reference.append(tokens[len(prompt):])
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                     for n in max_tokens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    with torch.no_grad():
        first = hf_model(torch.tensor([prompts[0]])).logits[0, -1].argmax().item()
    assert reference[0][0] == first


def test_structured_outputs_and_the_server(moe_llm):
    """A JSON schema constrains a MoE's decoding as any model's; the OpenAI
    server serves it, greedy completions equal to generate()'s."""
    import openai

    from jaxinfer.server.app import build_app
    from tests.serving import served

    _, llm = moe_llm
    schema = {"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=schema))
    text = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].text
    assert isinstance(json.loads(text)["yes"], bool)
    expected = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    with served(build_app(llm, model_name="moe")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = client.completions.create(model="moe", prompt="Once upon a time", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected


def test_eagle_is_refused_with_a_reason(qwen3_moe_dir):
    _, directory = qwen3_moe_dir
    with pytest.raises(ValueError, match="does not support mixtures of experts"):
        LLM(directory, progress=False, max_model_len=64, max_num_seqs=2,
            speculative={"method": "eagle", "num_speculative_tokens": 2})


def test_expert_kernels_in_the_engine_step(moe_llm):
    """The engine's decode and mixed steps multiply the experts with the native
    kernel (no ragged_dot: no pass over every expert)."""
    from jaxinfer.engine.inputs import build_inputs
    from jaxinfer.engine.programs import forward_step

    _, llm = moe_llm
    r = llm.engine.runner
    for n_tok, n_seq, layout in ((2, 2, "decode"), (16, 8, "mixed")):
        inputs = build_inputs([], [], [], [], num_tokens=n_tok, num_seqs=n_seq, layout=layout,
                              block_size=r.block_size, max_blocks_per_seq=r.max_blocks_per_seq)
        tokens, meta, indices = r._put(inputs[:3])
        text = forward_step.lower(r.params, r.kv_cache, tokens, meta, indices, config=r.config, backend=r.backend,
                                  layout=inputs.layout, mesh=r.mesh).as_text()
        assert text.count(expert_matmul.TARGET_NAME) == 2 and "ragged" not in text
