"""GGUF loading: files written with gguf.GGUFWriter from tiny HF models, and
the real default-model GGUF against transformers' own GGUF loader."""

import copy

import gguf
import numpy as np
import pytest

import jaxinfer
from jaxinfer.errors import CheckpointError, UnsupportedModelError
from tests.gguf_writer import random_k_blocks, round_trip_hf_model, write_gguf
from tests.tiny_models import assert_logits_close, hf_logits, make_hf_model

Q = gguf.GGMLQuantizationType
TOKENS = np.random.default_rng(0).integers(0, 128, 48)


@pytest.mark.parametrize("variant,arch", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_f32_gguf_matches_hf(tmp_path, variant, arch):
    hf_model = make_hf_model(variant, seed=5)
    path = write_gguf(hf_model, tmp_path / "m.gguf", Q.F32, arch=arch)
    model = jaxinfer.load(str(path), progress=False)
    assert model.config.architecture == arch
    assert_logits_close(model.logits(TOKENS), hf_logits(hf_model, TOKENS))


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_gguf_matches_dequantized_hf(tmp_path, qtype):
    hf_model = make_hf_model("llama", seed=6)
    path = write_gguf(hf_model, tmp_path / "m.gguf", qtype)
    model = jaxinfer.load(str(path), progress=False)
    # Exact: the loader must reproduce the quantize->dequantize image of each weight.
    reference = round_trip_hf_model(copy.deepcopy(hf_model), qtype)
    assert_logits_close(model.logits(TOKENS), hf_logits(reference, TOKENS))
    if qtype == Q.Q8_0:
        # And Q8_0 stays within quantization error of the float model: ~0.6%
        # relative error per weight, amplified to ~3% RMS by this random net.
        ours, exact = model.logits(TOKENS), hf_logits(hf_model, TOKENS)
        assert np.sqrt(((ours - exact) ** 2).mean() / (exact**2).mean()) < 0.05
        assert (ours.argmax(-1) == exact.argmax(-1)).mean() > 0.9


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loader():
    """The real Q4_1 SmolLM2 file: transformers' independent GGUF loader
    (which undoes the Q/K permutation its own way) gives the same logits."""
    transformers = pytest.importorskip("transformers")
    from jaxinfer.loading.checkpoint import default_model_path

    path = default_model_path()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype="float32"
    ).eval()
    model = jaxinfer.load(progress=False)
    tokens = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282]
    assert_logits_close(model.logits(tokens), hf_logits(hf_model, tokens))


def reader_fields_and_tensors(path):
    """gguf.GGUFReader's view of a file, the reference for loading/gguf_file.py."""
    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, reader.tensors


@pytest.mark.parametrize("which", ["default model", "written"])
def test_header_reader_equals_gguf_reader(tmp_path, which):
    from jaxinfer.loading.checkpoint import default_model_path
    from jaxinfer.loading.gguf_file import GGUFFile

    if which == "default model":
        path = default_model_path()
    else:  # every plain and block tensor type we load, and metadata of every value type
        path = tmp_path / "m.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        for key, value in {"test.bool": True, "test.f64": 0.125, "test.bools": [True, False],
                           "test.strings": ["a", "b\u00e9"], "test.floats": [0.5, -2.0]}.items():
            writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
        writer.add_int8("test.i8", -3)
        writer.add_uint64("test.u64", 2**40)
        weight = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(32, 64)
        writer.add_tensor("f32", weight)
        writer.add_tensor("f16", weight.astype(np.float16))
        writer.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
        for q in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1):
            writer.add_tensor(q.name, gguf.quants.quantize(weight, q), raw_dtype=q)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    expected_fields, expected_tensors = reader_fields_and_tensors(path)
    ours = GGUFFile(path)
    assert ours.fields == expected_fields
    assert [t.name for t in ours.tensors] == [t.name for t in expected_tensors]
    for got, want in zip(ours.tensors, expected_tensors):
        assert got.tensor_type == want.tensor_type and got.shape == tuple(int(d) for d in want.shape), got.name
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape, got.name
        np.testing.assert_array_equal(got.data, want.data)


def test_unsupported_tensor_type_is_named(tmp_path):
    hf_model = make_hf_model("llama", seed=7)
    bad = {"blk.0.attn_norm.weight": (np.zeros(64, np.int32), Q.I32)}
    path = write_gguf(hf_model, tmp_path / "m.gguf", tensor_type_override=bad)
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_norm\.weight.*I32"):
        jaxinfer.load(str(path), progress=False)


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    hf_model = make_hf_model("llama", seed=8)
    bad = {"blk.1.ffn_up.weight": (np.zeros((100, 64), np.float32), Q.F32)}
    path = write_gguf(hf_model, tmp_path / "m.gguf", tensor_type_override=bad)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(100, 64\).*\(128, 64\)"):
        jaxinfer.load(str(path), progress=False)


def test_wrong_shape_of_k_quant_layers_names_tensor_and_shapes(tmp_path):
    """The same check where every layer is a K-quant the CPU load repacks
    straight into one stack."""
    hf_model = make_hf_model("llama_kquant", seed=8)
    rng = np.random.default_rng(0)
    bad = {f"blk.{i}.ffn_up.weight": (random_k_blocks(rng, Q.Q4_K, 320, 256), Q.Q4_K)
           for i in range(hf_model.config.num_hidden_layers)}
    path = write_gguf(hf_model, tmp_path / "m.gguf", tensor_type_override=bad)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(320, 256\).*\(256, 256\)"):
        jaxinfer.load(str(path), progress=False)


def test_unknown_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="mamba"):
        jaxinfer.load(str(tmp_path / "m.gguf"), progress=False)


def test_missing_and_garbage_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        jaxinfer.load(str(tmp_path / "nope.gguf"), progress=False)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="junk.gguf"):
        jaxinfer.load(str(tmp_path / "junk.gguf"), progress=False)


def mapping_rss(address: int) -> int:
    """Bytes of this process's mapping that holds `address` resident in it
    (/proc/self/smaps' Rss of that mapping: the process's own view, where
    mincore would report the page cache's)."""
    mapping = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                mapping = start <= address < end
            elif mapping and fields[0] == "Rss:":
                return int(fields[1]) * 1024
    raise LookupError(f"no mapping holds {address:#x}")


def test_a_released_tensor_leaves_the_process_and_reads_the_same(tmp_path):
    """GGUFFile.release: the pages under a converted tensor stop counting in
    the process (an 8B file's read pages otherwise stay beside their
    converted copy for the whole load), and the tensor still reads the
    file's numbers afterwards."""
    from jaxinfer.loading.gguf_file import GGUFFile

    values = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB
    writer = gguf.GGUFWriter(str(tmp_path / "big.gguf"), "llama")
    writer.add_tensor("big.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = GGUFFile(tmp_path / "big.gguf")
    data = reader.tensors[0].data
    np.testing.assert_array_equal(data, values)  # every page read
    address = data.ctypes.data
    assert mapping_rss(address) >= values.nbytes - 4096
    reader.release(data)
    assert mapping_rss(address) <= 2 * 4096  # at most the partial pages at either end
    np.testing.assert_array_equal(data, values)
