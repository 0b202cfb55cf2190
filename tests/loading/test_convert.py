"""jaxinfer (orbax) checkpoints, `jaxinfer convert` and perplexity.

References: the source model's params quantized independently with quantize_params (every restored
leaf compared bit for bit), the source tokenizer (same ids), uncached full-sequence forwards with a
float64 numpy log-softmax (for greedy generation and for perplexity)."""

import importlib.util
import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers

import jaxinfer
from jaxinfer.loading.gguf_file import GGUFFile
from jaxinfer import LLM, SamplingParams
from jaxinfer.convert import convert, convert_model
from jaxinfer.errors import CheckpointError
from jaxinfer.loading import orbax as orbax_ckpt
from jaxinfer.loading.orbax import CONFIG_FILE, save_checkpoint
from jaxinfer.perplexity import perplexity, perplexity_of_text, window_spans
from jaxinfer.quant.params import quantize_params
from jaxinfer.quant.tensor import QuantizedTensor
from tests.tiny_models import BASE

EVAL_TEXT = Path(__file__).parents[1] / "data" / "eval_text.txt"
SP_MODEL = Path(importlib.util.find_spec("mistral_common").submodule_search_locations[0]) / "data" / "tokenizer.model.v1"
SCHEMES = ("int8", "int4", "fp8")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a lighthouse, please."}]
STRINGS = ["Hello, world!", "  two  spaces\tand a tab\n", "Café 日本語 😀", "</s> inside <s> text", ""]


def make_tiny_with_tokenizer(directory: Path) -> Path:
    """A tiny random Llama whose vocabulary is a real sentencepiece model's (Mistral v0.1, 32000)."""
    config = transformers.LlamaConfig(**{**BASE, "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2})
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger than the default init, so that quantization error is visible
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.2 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    shutil.copyfile(SP_MODEL, directory / "tokenizer.model")
    template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}{{ eos_token }}"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))
    return directory


def same_params(a, b):
    """Structure (QuantizedTensor scheme / group size included), shapes, dtypes and bits of every leaf,
    in the plain layout (a load on a CPU with AVX-512 stores the kernels' tiles: quant/tensor.py)."""
    a, b = (jax.tree.map(lambda w: w.untiled() if isinstance(w, QuantizedTensor) else w, t,
                         is_leaf=lambda w: isinstance(w, QuantizedTensor)) for t in (a, b))
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
    flat_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
    assert tree_a == tree_b
    for (path, x), (_, y) in zip(flat_a, flat_b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (jax.tree_util.keystr(path), x.dtype, y.dtype)
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), jax.tree_util.keystr(path)


def same_tokenizer(a, b):
    assert (a.vocab_size, a.bos_token_id, a.eos_token_ids, a.add_bos_token, a.chat_template) == (
        b.vocab_size, b.bos_token_id, b.eos_token_ids, b.add_bos_token, b.chat_template)
    chat = [a.apply_chat_template(CHAT)] if a.chat_template else []
    for text in STRINGS + chat:
        assert a.encode(text) == b.encode(text), text
    if chat:
        assert b.apply_chat_template(CHAT) == chat[0]


def log_softmax64(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def reference_perplexity(model, ids, context_len, stride):
    """HF's sliding-window recipe with one uncached float forward per window (Model.logits)."""
    nll, count = 0.0, 0
    for begin, end, first in window_spans(len(ids), context_len, stride):
        logprobs = log_softmax64(model.logits(ids[begin:end]))
        for j in range(first, end):
            nll -= logprobs[j - begin - 1, ids[j]]
            count += 1
    return float(np.exp(nll / count)), count


# ------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny_src"))


@pytest.fixture(scope="module")
def tiny(tiny_src):
    return jaxinfer.load(str(tiny_src), progress=False)


@pytest.fixture(scope="module")
def tiny_ckpts(tiny_src, tmp_path_factory):
    """scheme -> checkpoint directory, each made by `convert` from the HF directory."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for scheme in ("none", *SCHEMES):
        out[scheme] = root / scheme
        convert(str(tiny_src), out[scheme], quantize=scheme, progress=False, log=lambda *a: None)
    return out


# ------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("scheme", ["none", *SCHEMES])
def test_round_trip_is_bit_exact(tiny, tiny_ckpts, scheme):
    expected = tiny.params if scheme == "none" else quantize_params(tiny.params, scheme)
    restored = jaxinfer.load(str(tiny_ckpts[scheme]), progress=False)
    same_params(restored.params, expected)
    assert restored.config == tiny.config
    leaf = restored.params["layers"]["wq"]
    assert isinstance(leaf, QuantizedTensor) == (scheme != "none")
    same_tokenizer(tiny.tokenizer, restored.tokenizer)


def test_tokenizer_save_round_trips(tmp_path):
    """Tokenizer.save -> load_tokenizer for the kinds a checkpoint can carry that the model tests
    above do not: a sentencepiece vocabulary rebuilt from a GGUF (extra end-of-turn id), and
    special-token ids sentencepiece cannot name itself (no BOS; a BOS that is not a control piece)."""
    from jaxinfer.tokenizer import load_tokenizer, tokenizer_from_gguf
    from tests.loading.test_tokenizer import write_sp_gguf

    from_gguf = tokenizer_from_gguf(GGUFFile(str(write_sp_gguf(tmp_path / "sp.gguf", SP_MODEL, eot_token_id=5))))
    no_bos, plain_bos = load_tokenizer(SP_MODEL), load_tokenizer(SP_MODEL)
    no_bos.bos_token_id, plain_bos.bos_token_id = None, 500
    for i, tokenizer in enumerate((from_gguf, no_bos, plain_bos)):
        directory = tmp_path / str(i)
        directory.mkdir()
        assert tokenizer.save(directory) == ["tokenizer.model", "tokenizer_config.json", "generation_config.json"]
        same_tokenizer(tokenizer, load_tokenizer(directory))


def test_bfloat16_head_and_groups_round_trip(tiny, tmp_path):
    """bfloat16 weights, a quantized head on the tied-free model, int4 groups of 32, rope scaling in the config."""
    model = jaxinfer.load(str(tiny.source), dtype="bfloat16", progress=False)
    model.config = type(model.config)(**{**model.config.__dict__,
                                         "rope_scaling": (("factor", 2.0), ("rope_type", "linear"))})
    model.params = quantize_params(model.params, "int4", 32, include_head=True)
    save_checkpoint(model, tmp_path / "ck", progress=False)
    restored = jaxinfer.load(str(tmp_path / "ck"), dtype="bfloat16", progress=False)
    same_params(restored.params, model.params)
    assert restored.config == model.config
    assert restored.params["lm_head"].group_size == 32 and restored.params["embed"].dtype == np.dtype("bfloat16")
    as_float32 = jaxinfer.load(str(tmp_path / "ck"), progress=False)  # plain weights cast on restore
    same_params(as_float32.params, jax.tree.map(lambda x: x.astype(np.float32) if x.dtype == np.dtype("bfloat16")
                                                else x, model.params))


@pytest.mark.slow
def test_llm_generates_from_checkpoint(tiny, tiny_ckpts):
    """LLM(OUT_DIR): greedy text and chat generation over the KV cache, checked against uncached
    forwards of the independently quantized params."""
    llm = LLM(str(tiny_ckpts["int8"]), max_model_len=64, block_size=4, max_num_seqs=2,
              max_num_batched_tokens=32, progress=False)
    reference = jaxinfer.loading.model.Model(tiny.config, quantize_params(tiny.params, "int8"), tiny.tokenizer, tiny.dtype)
    for prompt, out in ((tiny.tokenizer.encode("Lighthouses guide ships"), llm.generate(
            "Lighthouses guide ships", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)),
            (tiny.tokenizer.encode(tiny.tokenizer.apply_chat_template(CHAT), add_special_tokens=False),
             llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))):
        assert out[0].prompt_token_ids == prompt
        tokens = list(prompt)
        for _ in range(6):
            tokens.append(int(np.argmax(reference.logits(tokens)[-1])))
        assert out[0].outputs[0].token_ids == tokens[len(prompt):]


@pytest.mark.slow
def test_default_model_int8_checkpoint(tmp_path):
    """The embedded SmolLM2 (GGUF, byte-level BPE tokenizer rebuilt from the GGUF) converted to int8:
    the restored params are bit-exact, the tokenizer gives the same ids, and the perplexity of the
    evaluation text is close to the float model's."""
    source = jaxinfer.load(progress=False, quantization=None)  # conversion quantizes float weights
    sizes = convert_model(source, tmp_path / "int8", "int8", progress=False, log=lambda *a: None)
    assert sizes["params_bytes_after"] < 0.45 * sizes["params_bytes_before"]
    restored = jaxinfer.load(str(tmp_path / "int8"), progress=False)
    same_params(restored.params, quantize_params(source.params, "int8"))
    same_tokenizer(source.tokenizer, restored.tokenizer)
    text = EVAL_TEXT.read_text()[:1000]
    float_ppl = perplexity_of_text(source, text, context_len=128, stride=128, chunk_size=128).perplexity
    int8_ppl = perplexity_of_text(restored, text, context_len=128, stride=128, chunk_size=128).perplexity
    assert 2 < float_ppl < 100, float_ppl  # English under a trained model (a random one: ~vocab size, 49152)
    assert abs(int8_ppl / float_ppl - 1) < 0.05, (float_ppl, int8_ppl)


def test_awq_convert_round_trip(tiny, tiny_src, tmp_path, monkeypatch):
    """int4-awq: the calibration text reaches AWQ as token batches of the model's tokenizer, and what
    AWQ returned is what the checkpoint restores (AWQ runs once: it is the slow part)."""
    from jaxinfer import calibration as awq

    calls, real = [], awq.awq_quantize_params

    def spy(params, config, batches, group_size):
        calls.append((batches, group_size, real(params, config, batches, group_size)))
        return calls[-1][2]

    monkeypatch.setattr(awq, "awq_quantize_params", spy)
    calibration = tmp_path / "calibration.txt"  # a slice of agent B's calibration text keeps AWQ quick
    text = (Path(__file__).parents[1] / "data" / "calibration_text.txt").read_text()[:1200]
    calibration.write_text(text)
    convert(str(tiny_src), tmp_path / "awq", quantize="int4-awq", calibration=calibration, group_size=32,
            progress=False, log=lambda *a: None)
    (batches, group_size, expected), = calls
    assert group_size == 32
    assert np.concatenate([b.reshape(-1) for b in batches]).tolist() == tiny.tokenizer.encode(text)[:sum(
        b.size for b in batches)]
    restored = jaxinfer.load(str(tmp_path / "awq"), progress=False)
    same_params(restored.params, expected)
    assert restored.params["layers"]["w_down"].scheme == "int4"


# ------------------------------------------------------------------------------------------------
# damaged checkpoints and interrupted writes


@pytest.fixture
def damaged(tiny_ckpts, tmp_path):
    target = tmp_path / "ck"
    shutil.copytree(tiny_ckpts["int4"], target)
    return target


def largest_params_file(directory):
    return max((p for p in (directory / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def edit_metadata(directory, edit):
    metadata = json.loads((directory / CONFIG_FILE).read_text())
    edit(metadata)
    (directory / CONFIG_FILE).write_text(json.dumps(metadata))


@pytest.mark.parametrize("damage,match", [
    (lambda d: os.truncate(largest_params_file(d), largest_params_file(d).stat().st_size // 2), "bytes, expected .*truncated"),
    (lambda d: largest_params_file(d).unlink(), "is missing; the checkpoint is incomplete"),
    (lambda d: (d / "tokenizer.model").unlink(), "tokenizer.model is missing"),
    (lambda d: (d / CONFIG_FILE).unlink(), f"{CONFIG_FILE} is missing; the checkpoint is incomplete"),
    (lambda d: (d / CONFIG_FILE).write_text((d / CONFIG_FILE).read_text()[:200]), "is not valid JSON"),
    (lambda d: edit_metadata(d, lambda m: m.pop("params")), "lacks 'params'"),
    (lambda d: edit_metadata(d, lambda m: m["config"].pop("num_heads")), r"lacks the fields \['num_heads'\]"),
    (lambda d: edit_metadata(d, lambda m: m["config"].update(intermediate_size=96)),
     r"layers/w_gate has shape \(2, 64, 128\), but the config implies \(2, 64, 96\)"),
    (lambda d: edit_metadata(d, lambda m: m["params"]["layers/wo"].update(group_size=16)), "layers/wo .* lists parts"),
    (lambda d: edit_metadata(d, lambda m: m["params"].pop("layers/w_up")), "the params structure lacks layers/w_up"),
    (lambda d: edit_metadata(d, lambda m: m.update(format_version=99)), "format_version 99 is not supported"),
    (lambda d: edit_metadata(d, lambda m: m["params"].update({"layers/attn_norm": m["params"]["layers/wq"]})),
     "layers/attn_norm is stored quantized"),
])
def test_damaged_checkpoint_is_named(damaged, damage, match):
    damage(damaged)
    with pytest.raises(CheckpointError, match=match) as info:
        jaxinfer.load(str(damaged), progress=False)
    assert str(damaged) in str(info.value)


def test_same_size_corruption_fails_the_checksum(damaged):
    """Bytes changed in place: sizes still match, and tensorstore would read the changed values."""
    victim = largest_params_file(damaged)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{victim.name} does not match its checksum"):
        jaxinfer.load(str(damaged), progress=False)


@pytest.mark.parametrize("other,match", [
    ("int8", "layers/wq/offsets is not on disk"),
    ("int4-g32", r"layers/wq/scales is float32\[2, 2, 64\] on disk, expected float32\[2, 1, 64\]"),
])
def test_consistent_manifest_over_wrong_arrays_is_refused(damaged, tiny, tiny_ckpts, tmp_path, other, match):
    """The int4 (group 64) checkpoint's params/ replaced by another checkpoint's, with a manifest that
    matches the new files: sizes and checksums pass, and the arrays on disk are still refused."""
    if other == "int4-g32":
        save_checkpoint(jaxinfer.loading.model.Model(tiny.config, quantize_params(tiny.params, "int4", 32), None, tiny.dtype),
                        tmp_path / other, progress=False)
    source = tiny_ckpts.get(other, tmp_path / other)
    shutil.rmtree(damaged / "params")
    shutil.copytree(source / "params", damaged / "params")
    files = json.loads((source / CONFIG_FILE).read_text())["files"]
    edit_metadata(damaged, lambda m: m.update(files={
        **{k: v for k, v in m["files"].items() if not k.startswith("params/")},
        **{k: v for k, v in files.items() if k.startswith("params/")}}))
    with pytest.raises(CheckpointError, match=match):
        jaxinfer.load(str(damaged), progress=False)


def test_restore_takes_a_sharding_per_array(tiny_ckpts):
    from jaxinfer.loading.orbax import open_orbax_checkpoint

    _, checkpoint, _, _ = open_orbax_checkpoint(tiny_ckpts["int4"])
    device = jax.devices()[-1]
    seen = []

    def sharding(path, shape, dtype):
        seen.append((path, shape, str(dtype)))
        return jax.sharding.SingleDeviceSharding(device)

    params = checkpoint.restore(sharding=sharding)
    assert ("layers/wq/offsets", (2, 1, 64), "float32") in seen and ("embed", (32000, 64), "float32") in seen
    assert len(seen) == len(jax.tree_util.tree_leaves(params))
    assert all(leaf.devices() == {device} for leaf in jax.tree_util.tree_leaves(params))


def test_interrupted_write_leaves_nothing(tiny, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise KeyboardInterrupt  # as a user's Ctrl-C between the params and the metadata

    monkeypatch.setattr(orbax_ckpt, "_file_manifest", fail)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tiny, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []  # neither OUT_DIR nor the hidden partial sibling
    monkeypatch.undo()

    save_checkpoint(tiny, tmp_path / "out", progress=False)
    with pytest.raises(FileExistsError, match="already exists"):
        save_checkpoint(tiny, tmp_path / "out", progress=False)
    tiny_int8 = jaxinfer.loading.model.Model(tiny.config, quantize_params(tiny.params, "int8"), tiny.tokenizer, tiny.dtype)
    save_checkpoint(tiny_int8, tmp_path / "out", progress=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    same_params(jaxinfer.load(str(tmp_path / "out"), progress=False).params, tiny_int8.params)


# ------------------------------------------------------------------------------------------------
# perplexity


@pytest.mark.parametrize("context_len,stride,chunk_size", [(64, None, 24), (40, 40, 64), (48, 7, 16)])
def test_perplexity_matches_uncached_forward(tiny, context_len, stride, chunk_size):
    ids = tiny.tokenizer.encode(EVAL_TEXT.read_text()[:900])
    result = perplexity(tiny, ids, context_len, stride, chunk_size=chunk_size, block_size=4)
    expected, count = reference_perplexity(tiny, ids, context_len, stride or context_len // 2)
    assert result.num_tokens_scored == count
    # Overlapping windows score every token but the first; disjoint ones skip each window's first.
    assert count == len(ids) - (1 if stride is None or stride < context_len else result.num_windows)
    assert result.perplexity == pytest.approx(expected, rel=1e-4)


def test_perplexity_with_quantized_kv_cache(tiny):
    ids = tiny.tokenizer.encode(EVAL_TEXT.read_text()[:600])
    exact = perplexity(tiny, ids, 64, chunk_size=32, block_size=4)
    for kv_cache_dtype in ("int8", "fp8"):
        approx = perplexity(tiny, ids, 64, chunk_size=32, block_size=4, kv_cache_dtype=kv_cache_dtype)
        assert approx.perplexity != exact.perplexity and approx.kv_cache_dtype == kv_cache_dtype
        assert approx.perplexity == pytest.approx(exact.perplexity, rel=0.05)


# ------------------------------------------------------------------------------------------------
# command line


def test_cli_convert_and_ppl(tiny_src, tiny, tmp_path, capsys):
    from jaxinfer.cli import main

    out = tmp_path / "int4"
    assert main(["convert", str(tiny_src), str(out), "--quantize", "int4", "--group-size", "32",
                 "--dtype", "bfloat16"]) == 0
    printed = capsys.readouterr().out
    assert "(bfloat16) ->" in printed and "(int4)" in printed and f"checkpoint {out}" in printed
    restored = jaxinfer.load(str(out), dtype="bfloat16", progress=False)
    bf16 = jaxinfer.load(str(tiny_src), dtype="bfloat16", progress=False)
    same_params(restored.params, quantize_params(bf16.params, "int4", 32))

    assert main(["ppl", "--model", str(out), str(EVAL_TEXT), "--context-len", "32", "--dtype", "bfloat16"]) == 0
    printed = capsys.readouterr().out
    assert "perplexity" in printed and "context 32, stride 16" in printed

    assert main(["convert", str(tiny_src), str(tmp_path / "awq"), "--quantize", "int4-awq"]) == 1
    assert "int4-awq needs calibration text" in capsys.readouterr().err
    assert main(["convert", str(tiny_src), str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert not (tmp_path / "awq").exists()
