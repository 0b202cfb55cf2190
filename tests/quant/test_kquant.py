"""K-quant weights (Q2_K .. Q6_K) held at the file's size (quant/kquant.py),
their CPU kernels (native/kquant_matmul.cc, q8_matmul.cc's K-quant handler),
mixed-type stacks (quant/mixed_stack.py) and the other GGUF types.

References, all independent of the code under test: gguf.quants.dequantize
of the raw blocks (bit for bit in float32), float64 numpy products of those
values (and of activations rounded to int8 blocks here, for gguf-a8), the
float load of the same file (its weights dequantized by gguf), HF
transformers' own GGUF loader, and perplexity of that float load. Files are
written with the gguf package (random K-quant blocks: it has no K-quant
quantizer)."""

import dataclasses
import subprocess
import sys
import threading
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.backends import CpuBackend, XlaBackend
from jaxinfer.errors import CheckpointError
from jaxinfer.loading.gguf import (K_QUANT_KINDS, SUPPORTED_TENSOR_TYPES, GGUFTensors, blocks_to_kquant, open_gguf,
                                   unpermute_rows)
from jaxinfer.loading.model import Model
from jaxinfer.native import kquant_matmul, kquant_repack, matmul, paged_attention
from jaxinfer.perplexity import perplexity
from jaxinfer.quant.kquant import KQuantTensor, dequantize
from jaxinfer.quant.layer_weights import LayerOf
from jaxinfer.quant.mixed_stack import MixedStack
from jaxinfer.quant.params import LINEAR_KEYS
from tests.cpu_features import INT8_DOTS, VEC16, needs_vec16, needs_int8_dots
from tests.gguf_writer import K_SUPER_SCALES, gguf_name, random_k_blocks, write_gguf, write_kquant_mix
from tests.tiny_models import assert_logits_close, hf_logits, make_hf_model

Q = gguf.GGMLQuantizationType
K_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
CPU = CpuBackend()


def test_kernels_build_here():
    # Not a skip: CI has g++, and without the kernels K-quant files decode
    # through a float copy of every weight (and without the repacking, a load
    # converts them in numpy, seconds slower). The exact matmul is AVX-512 or
    # AVX2 code, the int8-activation one AVX512-VNNI or AVX2: elsewhere they report so.
    assert kquant_matmul.available() == VEC16 and kquant_matmul.q8_available() == INT8_DOTS
    assert kquant_matmul.load_kinds(kquant_matmul.KINDS) == VEC16
    assert kquant_repack.available()


# A process that registers the exact kernel's handler and loads no kind, then calls it on a Q5_K weight.
UNLOADED_KIND_CHILD = """
import numpy as np, gguf
from jaxinfer.loading.gguf import blocks_to_kquant
from jaxinfer.native import kquant_matmul
from tests.gguf_writer import random_k_blocks
raw = random_k_blocks(np.random.default_rng(0), gguf.GGMLQuantizationType.Q5_K, 64, 256)
w = blocks_to_kquant(raw, gguf.GGMLQuantizationType.Q5_K, 64, 256).tiled(64)
assert kquant_matmul.available()
try:
    kquant_matmul._call(kquant_matmul.TARGET_NAME, np.ones((1, 256), np.float32), [w], 0)[0].block_until_ready()
except Exception as error:
    print(error)
"""


@needs_vec16
def test_a_kind_whose_kernels_are_not_loaded_is_named():
    """Each kind's kernels are a library the handler is handed; a call on a
    kind it was not handed (kquant_matmuls always loads them first) fails
    naming the kind, rather than computing anything."""
    out = subprocess.run([sys.executable, "-c", UNLOADED_KIND_CHILD], capture_output=True, text=True,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "the kernel of Q5_K is not loaded" in out.stdout


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("heads", [None, 4])
def test_blocks_dequantize_to_ggufs_values_bit_for_bit(qtype, heads):
    """Random blocks (with and without llama.cpp's Q/K row order undone): the
    held form dequantizes to gguf's own float32 values, plain and tiled, and
    holds the file's bytes (Q2_K, Q6_K) or at most 4% more (one byte per 6-bit
    sub-scale). The native repacking straight into tiles (a CPU load's) gives
    the tiled form byte for byte."""
    raw = random_k_blocks(np.random.default_rng(5), qtype, 128, 512)
    expected = gguf.quants.dequantize(raw, qtype)  # [out, in]
    if heads:
        expected = unpermute_rows(expected, heads)
    w = jax.device_put(blocks_to_kquant(raw, qtype, 128, 512, heads))
    assert w.shape == (512, 128)
    np.testing.assert_array_equal(np.asarray(dequantize(w)), expected.T)
    tiled = w.tiled(64)
    np.testing.assert_array_equal(np.asarray(dequantize(tiled)), expected.T)
    for a, b in zip(jax.tree.leaves(tiled.untiled()), jax.tree.leaves(w)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert raw.nbytes <= w.nbytes <= 1.04 * raw.nbytes
    rows = None if heads is None else unpermute_rows(np.arange(128), heads)
    repacked = kquant_repack.repack(raw, K_QUANT_KINDS[qtype], 128, 512, rows)
    assert jax.tree.structure(repacked) == jax.tree.structure(tiled)
    for a, b in zip(jax.tree.leaves(repacked), jax.tree.leaves(tiled)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, np.asarray(b))
    np.testing.assert_array_equal(np.asarray(dequantize(jax.device_put(repacked))), expected.T)
    with pytest.raises(ValueError, match="bytes"):
        kquant_repack.repack(raw[:-1], K_QUANT_KINDS[qtype], 128, 512)


def stacked_weight(qtype, layers: int, in_features: int, out_features: int, seed: int = 0):
    """(tiled KQuantTensor [layers, in, out], float64 values [layers, in, out]) from random blocks."""
    raws = [random_k_blocks(np.random.default_rng(seed + i), qtype, out_features, in_features) for i in range(layers)]
    w = jax.tree.map(lambda *a: jnp.stack(a), *[blocks_to_kquant(r, qtype, out_features, in_features) for r in raws])
    values = np.stack([gguf.quants.dequantize(r, qtype).T.astype(np.float64) for r in raws])
    return w.tiled(64), values


def assert_matches(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def int8_blocks64(x: np.ndarray, block: int) -> np.ndarray:
    """x rounded to int8 in blocks of `block` inputs (absmax / 127, half to even), float64."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, block)
    scale = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    scale = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.round(blocks / scale), -127, 127)
    return (q.astype(np.float64) * scale.astype(np.float64)).reshape(x.shape)


@needs_vec16
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_kernel_matches_float64(qtype):
    """The exact kernel at 1, 2, 5 (AVX-512's few-row path: tasks of 4, 2
    and 1 tiles; AVX2's takes one row, more go to its many-row path), 23 and
    40 rows (many-row path) against float64 products of gguf's values; layer
    1 of 2; and each row bit for bit its result alone."""
    w, values = stacked_weight(qtype, 2, 512, 256)
    rng = np.random.default_rng(int(qtype))
    exact = jax.jit(kquant_matmul.kquant_matmul)
    for rows in (1, 2, 5, 23, 40):
        x = rng.standard_normal((rows, 512)).astype(np.float32)
        y = np.asarray(exact(x, w, 1))
        assert_matches(y, x.astype(np.float64) @ values[1])
        np.testing.assert_array_equal(y[-1], np.asarray(exact(x[-1:], w, 1))[0])


@needs_int8_dots
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_int8_activation_kernel_matches_float64(qtype):
    """The gguf-a8 kernel at 1, 3 and 17 rows (activations rounded to int8
    per 256 inputs here) against float64 products of gguf's values; layer 1
    of 2; and the first row bit for bit its result alone."""
    w, values = stacked_weight(qtype, 2, 512, 256)
    rng = np.random.default_rng(int(qtype) + 100)
    a8 = dataclasses.replace(w, activation_block=256)
    q8 = jax.jit(kquant_matmul.q8_kquant_matmul)
    for rows in (1, 3, 17):
        x = rng.standard_normal((rows, 512)).astype(np.float32)
        y = np.asarray(q8(x, a8, 1))
        assert_matches(y, int8_blocks64(x, 256) @ values[1])
        np.testing.assert_array_equal(y[0], np.asarray(q8(x[:1], a8, 1))[0])


@needs_int8_dots
@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q4_K], ids=lambda q: q.name)
def test_int8_activation_kernel_exact_at_the_largest_codes(qtype):
    """Every code bit set (Q6_K codes 63, Q4_K 15) against activations that round
    to +127: the largest integer sums the kernel's dots take (AVX2 adds four
    products in int16 before widening, 4 * 63 * 127 = 32,004 for Q6_K, just
    under 2^15), at one row and at three, against float64."""
    blocks = np.full((64, 1, gguf.GGML_QUANT_SIZES[qtype][1]), 0xFF, np.uint8)
    for offset, scale in K_SUPER_SCALES[qtype]:
        blocks[..., offset:offset + 2] = np.asarray([scale], "<f2").view(np.uint8)
    raw = blocks.reshape(64, -1)
    w = jax.tree.map(lambda a: a[None], blocks_to_kquant(raw, qtype, 64, 256)).tiled(64)
    values = gguf.quants.dequantize(raw, qtype).T.astype(np.float64)
    q8 = jax.jit(kquant_matmul.q8_kquant_matmul)
    for rows in (1, 3):
        x = np.ones((rows, 256), np.float32)
        assert_matches(np.asarray(q8(x, dataclasses.replace(w, activation_block=256), 0)),
                       int8_blocks64(x, 256) @ values)


@pytest.mark.parametrize("int8_activations", [pytest.param(False, marks=needs_vec16),
                                              pytest.param(True, marks=needs_int8_dots)], ids=["exact", "gguf-a8"])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_a_row_does_not_depend_on_the_rows_beside_it(qtype, int8_activations):
    """Every row count up to 8 (each its own split of rows and columns) and
    past it (13, 32, 75: one task or several, the many-row path) gives each
    row bit for bit its one-row result, in either kernel."""
    w, _ = stacked_weight(qtype, 1, 256, 192, seed=9)
    x = np.random.default_rng(7).standard_normal((75, 256)).astype(np.float32)
    if int8_activations:
        kernel, weight = kquant_matmul.q8_kquant_matmul, dataclasses.replace(w, activation_block=256)
    else:
        kernel, weight = kquant_matmul.kquant_matmul, w
    run = jax.jit(kernel)
    alone = np.stack([np.asarray(run(x[r:r + 1], weight, 0))[0] for r in range(75)])
    for rows in [*range(2, 9), 13, 32, 75]:
        np.testing.assert_array_equal(np.asarray(run(x[:rows], weight, 0)), alone[:rows])


@pytest.mark.parametrize("int8_activations", [pytest.param(False, marks=needs_vec16),
                                              pytest.param(True, marks=needs_int8_dots)], ids=["exact", "gguf-a8"])
def test_several_kinds_in_one_call(int8_activations):
    """A layer's q, k and v in one call of either kernel, each of its own
    kind and v a MixedStack (layer 0 Q5_K, layer 1 Q2_K: the call reads the
    part that holds the layer): each bit for bit its own call and its
    float64 product, and the CPU backend's linears makes one call."""
    block = 256 if int8_activations else 0
    together_fn = kquant_matmul.q8_kquant_matmuls if int8_activations else kquant_matmul.kquant_matmuls
    target = kquant_matmul.Q8_TARGET_NAME if int8_activations else kquant_matmul.TARGET_NAME
    pairs = [stacked_weight(q, 2, 256, out, seed=s) for s, (q, out) in enumerate([(Q.Q4_K, 256), (Q.Q3_K, 64)])]
    v0, v0_values = stacked_weight(Q.Q5_K, 1, 256, 64, seed=5)
    v1, v1_values = stacked_weight(Q.Q2_K, 1, 256, 64, seed=6)
    ws = [dataclasses.replace(w, activation_block=block) for w, _ in pairs]
    ws.append(MixedStack(tuple(dataclasses.replace(p, activation_block=block) for p in (v0, v1)), (0, 1), (0, 0)))
    values = [v for _, v in pairs] + [np.concatenate([v0_values, v1_values])]
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    rounded = int8_blocks64(x, 256) if int8_activations else x.astype(np.float64)
    together = jax.jit(together_fn)(x, ws, 1)
    for y, w, v in zip(together, ws, values):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(together_fn)(x, [w], 1)[0]))
        assert_matches(np.asarray(y), rounded @ v[1])
    fn = jax.jit(lambda x, ws, i: CPU.linears(x, [LayerOf(w, i) for w in ws]))
    assert fn.lower(x, ws, jnp.int32(1)).as_text().count(f"custom_call @{target}(") == 1


# A Q4_K_M-like mix, with Q3_K_M's and Q2_K's types too: every linear weight a
# K-quant, some of them mixing two types over the layers.
MIX = {"blk.1.attn_v.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q6_K, "blk.0.ffn_up.weight": Q.Q5_K,
       "blk.0.attn_q.weight": Q.Q3_K, "blk.1.attn_q.weight": Q.Q2_K, "output.weight": Q.Q6_K}


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    return write_kquant_mix(make_hf_model("llama_kquant", seed=13), tmp_path_factory.mktemp("kquant") / "m.gguf",
                            MIX, seed=6)


@pytest.fixture(scope="module")
def float_load(mixed_file):
    return jaxinfer.load(str(mixed_file), progress=False, quantization=None)


@pytest.fixture(scope="module")
def kquant_load(mixed_file):
    return jaxinfer.load(str(mixed_file), progress=False)  # "auto": the file's blocks on CPU


TOKENS = np.arange(1, 40)


@needs_vec16
def test_the_k_quant_kernels_build_before_the_weights_are_read(mixed_file, monkeypatch):
    """The K-quant kernels, a machine's longest builds, are asked for as soon
    as the file is open, not once its weights are arranged (the builds run
    beside the load), and only for the kinds it holds (gguf's reader lists
    them): each kind is its own library. matmul.cc (grouped int8 / int4
    codes) is not built at all: the file holds K-quants and floats only."""
    types = {t.tensor_type.name for t in gguf.GGUFReader(mixed_file).tensors}
    held = {name.lower() for name in types if name.endswith("_K")}
    asked, every_kind, attention, grouped = [], threading.Event(), threading.Event(), threading.Event()

    def load_kinds(kinds):  # built already (the first test)
        asked.extend(kinds)
        if set(asked) >= held:
            every_kind.set()
        return True

    monkeypatch.setattr(kquant_matmul, "load_kinds", load_kinds)
    monkeypatch.setattr(paged_attention, "available", lambda: attention.set() or True)
    monkeypatch.setattr(matmul, "available", lambda: grouped.set() or True)
    before = []
    jaxinfer.load(str(mixed_file), progress=False,
                  before_weights=lambda *_: before.append(every_kind.wait(timeout=10)))
    assert before == [True]
    assert len(held) > 1 and set(asked) == held
    # The builds start together; the attention kernel's (always asked for) has started, matmul.cc's not.
    assert types <= {"F32", "F16", *(name.upper() for name in held)}
    assert attention.wait(timeout=10) and not grouped.wait(timeout=0.2)


@needs_vec16
def test_file_loads_at_its_own_size_with_the_float_loads_logits(mixed_file, kquant_load, float_load):
    """quantization="auto" on CPU: every linear weight and the untied head
    in their K-quant blocks, a weight mixing types one stack per type, each
    layer dequantizing to the float load's weight; the bytes held within 4%
    of the file's tensors; logits those of the float load (and of HF
    transformers' GGUF loader) to float32 rounding."""
    transformers = pytest.importorskip("transformers")
    layers = kquant_load.params["layers"]
    assert isinstance(layers["wq"], MixedStack) and isinstance(layers["wk"], KQuantTensor)
    assert sorted(p.kind for p in layers["wq"].parts) == ["q2_k", "q3_k"]
    assert isinstance(kquant_load.params["lm_head"], KQuantTensor)
    for key in LINEAR_KEYS:
        w = layers[key]
        for i in range(2):
            held = w.layer(i) if isinstance(w, MixedStack) else jax.tree.map(lambda a: a[i], w)
            np.testing.assert_array_equal(np.asarray(dequantize(held)),
                                          np.asarray(float_load.params["layers"][key][i]), key)
    _, source, _ = open_gguf(mixed_file)
    held = sum(a.nbytes for k in LINEAR_KEYS for a in jax.tree.leaves(layers[k]))
    held += sum(a.nbytes for a in jax.tree.leaves(kquant_load.params["lm_head"]))
    stored = sum(t.data.nbytes for t in source._tensors.values() if t.tensor_type in K_TYPES)
    assert stored <= held <= 1.04 * stored
    assert_logits_close(kquant_load.logits(TOKENS), float_load.logits(TOKENS), rtol=1e-5)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(mixed_file.parent), gguf_file=mixed_file.name, dtype="float32").eval()
    assert_logits_close(kquant_load.logits(TOKENS), hf_logits(hf_model, TOKENS), rtol=1e-4)


def test_xla_backend_runs_the_same_weights(kquant_load, float_load):
    """The plain reference (XlaBackend: dequantize, then a float matmul;
    mixed stacks under its scan) on the CPU load's own params."""
    reference = Model(kquant_load.config, kquant_load.params, None, np.float32, "", 0.0, None, "gguf",
                      kquant_load.config, XlaBackend().with_dtype(np.float32))
    assert_logits_close(reference.logits(TOKENS), float_load.logits(TOKENS), rtol=1e-5)


@needs_vec16
def test_gguf_a8_multiplies_int8_blocks(mixed_file, kquant_load):
    """quantization="gguf-a8": every K-quant weight (mixed stacks' parts too)
    marked for int8 activations in blocks of a super-block (llama.cpp's
    Q8_K) and multiplied by a kernel (the int8-activation one where it
    builds, else the exact one on the rounded activations), with logits those of the XLA
    reference of the same params to 1%: the two round the same activations
    to int8 but sum floats in other orders, and a hidden value that lands
    on the other side of a rounding boundary moves by a whole int8 step
    (each single product is held to 1e-5 in test_kernels_match_float64)."""
    a8 = jaxinfer.load(str(mixed_file), progress=False, quantization="gguf-a8")
    for key in LINEAR_KEYS:
        w = a8.params["layers"][key]
        for part in (w.parts if isinstance(w, MixedStack) else [w]):
            assert part.activation_block == 256, key
    reference = Model(a8.config, a8.params, None, np.float32, "", 0.0, None, "gguf-a8", a8.config,
                      XlaBackend().with_dtype(np.float32))
    assert_logits_close(a8.logits(TOKENS), reference.logits(TOKENS), rtol=1e-2)


def test_perplexity_unchanged_against_the_float_load(kquant_load, float_load):
    """Perplexity of a text the tests own (its ASCII bytes as token ids of
    the 128-token vocabulary), through the engine's scoring path."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "data" / "eval_text.txt").read_text()
    ids = [b for b in text.encode("ascii", "ignore")[:600]]
    ours = perplexity(kquant_load, ids, context_len=256, stride=128).perplexity
    expected = perplexity(float_load, ids, context_len=256, stride=128).perplexity
    assert abs(ours / expected - 1) < 1e-5


# Every block type gguf.quants can dequantize, besides those above. Random
# bytes are valid blocks for all of them (a NaN super-scale is a NaN weight
# either way; assert_array_equal counts NaNs equal).
OTHER_TYPES = sorted(SUPPORTED_TENSOR_TYPES - {Q.F32, Q.F16, *K_TYPES})


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
def test_every_other_type_loads_dequantized(tmp_path):
    """Each linear slot of a tiny file in another block type (i-quants,
    ternary, FP4, the classic ones): the loaded weight is gguf's
    dequantization of the file's bytes, and the model runs."""
    hf_model = make_hf_model("llama_kquant", seed=3)
    slots = [n for n in hf_model.state_dict() if n.endswith("proj.weight")]
    rng = np.random.default_rng(2)
    for start in range(0, len(OTHER_TYPES), len(slots)):
        chosen = dict(zip(slots, OTHER_TYPES[start:start + len(slots)]))
        override = {}
        for name, qtype in chosen.items():
            rows, columns = hf_model.state_dict()[name].shape
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            override[gguf_name(name)] = (rng.integers(0, 256, (rows, columns // block * size), dtype=np.uint8), qtype)
        path = write_gguf(hf_model, tmp_path / f"types{start}.gguf", tensor_type_override=override)
        _, source, _ = open_gguf(path)
        for name, qtype in chosen.items():
            raw = override[gguf_name(name)][0]
            expected = gguf.quants.dequantize(raw, qtype)
            if "q_proj" in name or "k_proj" in name:
                expected = unpermute_rows(expected, 4 if "q_proj" in name else 2)
            np.testing.assert_array_equal(source.get(name), expected, qtype.name)
        assert jaxinfer.load(str(path), progress=False).logits(TOKENS[:4]).shape == (4, 128)


@pytest.mark.parametrize("qtype", [t for t in Q if t not in SUPPORTED_TENSOR_TYPES and t in gguf.GGML_QUANT_SIZES
                                   and gguf.GGML_QUANT_SIZES[t][0] > 1], ids=lambda q: q.name)
def test_a_type_without_a_dequantizer_is_named(tmp_path, qtype):
    """A block type gguf cannot dequantize (llama.cpp's internal Q8_1 / Q8_K,
    formats newer than the package) fails at load with an error naming it."""
    hf_model = make_hf_model("llama_kquant", seed=3)
    rows, columns = hf_model.state_dict()["model.layers.0.mlp.up_proj.weight"].shape
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((rows, columns // block * size), np.uint8)
    path = write_gguf(hf_model, tmp_path / "m.gguf", tensor_type_override={"blk.0.ffn_up.weight": (raw, qtype)})
    with pytest.raises(CheckpointError, match=rf"blk\.0\.ffn_up\.weight.*{qtype.name}"):
        jaxinfer.load(str(path), progress=False)


@pytest.mark.parametrize("tile", [0, 64])
@pytest.mark.parametrize("qtype", K_QUANT_KINDS, ids=lambda q: q.name)
def test_columns_are_gguf_values(qtype, tile):
    """KQuantTensor.columns (a tied model's embeddings from its head's
    blocks): each column is gguf's dequantized row, plain or tiled (every
    kind: each lays its high bits out in its own way)."""
    raw = random_k_blocks(np.random.default_rng(4), qtype, 128, 512)  # a [vocab 128, hidden 512] table
    table = gguf.quants.dequantize(raw, qtype)
    w = blocks_to_kquant(raw, qtype, 128, 512)
    stored = w.tiled(64) if tile else w
    indices = np.array([[0, 127, 64], [63, 5, 5]])
    np.testing.assert_array_equal(np.asarray(stored.columns(indices)), table[indices])


@needs_vec16
def test_a_tied_k_quant_table_is_the_only_embedding_copy(tmp_path):
    """A tied model whose token_embd is Q6_K (a Q4_K_M file's): on CPU the
    head's blocks are kept, the float table is dropped (the lookup reads
    the blocks' columns), and the logits are the float load's."""
    path = write_kquant_mix(make_hf_model("llama_kquant_tied", seed=21), tmp_path / "tied.gguf",
                            {"token_embd.weight": Q.Q6_K}, seed=8)
    read_as_float = []
    get = GGUFTensors.get
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GGUFTensors, "get", lambda self, name: read_as_float.append(name) or get(self, name))
        kquant = jaxinfer.load(str(path), progress=False)
    assert isinstance(kquant.params["few_row_head"], KQuantTensor) and "embed" not in kquant.params
    assert "model.embed_tokens.weight" not in read_as_float  # not even dequantized on the way
    float_load = jaxinfer.load(str(path), progress=False, quantization=None)
    assert_logits_close(kquant.logits(TOKENS), float_load.logits(TOKENS), rtol=1e-5)


@needs_vec16
def test_a_mixed_stack_is_read_in_one_call():
    """A MixedStack of Q6_K and Q4_K layers (a Q4_K_M file's attn_v) beside a
    plain weight in one kernel call: each layer bit for bit its part's own
    call and against float64 products of gguf's values; and the CPU
    backend's linears takes both in one call, no switch."""
    q6, values6 = stacked_weight(Q.Q6_K, 2, 256, 64, seed=3)
    q4, values4 = stacked_weight(Q.Q4_K, 2, 256, 64, seed=5)
    plain, plain_values = stacked_weight(Q.Q4_K, 4, 256, 128, seed=8)
    mixed = MixedStack((q6, q4), part_of_layer=(0, 1, 1, 0), index_in_part=(0, 0, 1, 1))
    mixed_values = [values6[0], values4[0], values4[1], values6[1]]
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 256)), jnp.float32)
    x64 = np.asarray(x, np.float64)
    together = jax.jit(kquant_matmul.kquant_matmuls)
    alone = jax.jit(kquant_matmul.kquant_matmul)
    for layer in range(4):
        y_plain, y_mixed = together(x, [plain, mixed], layer)
        part = mixed.parts[mixed.part_of_layer[layer]]
        np.testing.assert_array_equal(np.asarray(y_mixed), np.asarray(alone(x, part, mixed.index_in_part[layer])))
        assert_matches(np.asarray(y_mixed), x64 @ mixed_values[layer])
        assert_matches(np.asarray(y_plain), x64 @ plain_values[layer])
    fn = jax.jit(lambda x, ws, i: CPU.linears(x, [LayerOf(w, i) for w in ws]))
    text = fn.lower(x, [plain, mixed], jnp.int32(2)).as_text()
    assert text.count(f"custom_call @{kquant_matmul.TARGET_NAME}(") == 1 and "stablehlo.case" not in text
