"""build_params (loading/params.py) reading tensors on several threads, and
straight into one array per layer for a backend that keeps them so (the
GPU's, backends/gpu.py):

  * the params read on worker threads are those read one at a time, bit for
    bit, for float, load-time int8, MoE, GGUF blocks (mixed K-quants kept as
    stored too) and pre-quantized (GPTQ) checkpoints;
  * GpuBackend's params, given per layer by the loader, are the stacked
    load split and arranged, bit for bit, and no layer weight is stacked on
    the way (the loader's _stack, which the stacked load calls for every
    weight, is never called);
  * on a 2-device mesh the per-layer load is the stacked one split, each
    layer on the shards the stacked weight's slice had.
"""

import subprocess
import sys
import threading
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest

from jaxinfer.backends import CpuBackend, GpuBackend, XlaBackend
from jaxinfer.loading.checkpoint import open_checkpoint
import jaxinfer.loading.params as params_module
from jaxinfer.loading.params import build_params
from jaxinfer.quant.layer_weights import PerLayer
from tests.gguf_writer import write_gguf, write_kquant_mix
from tests.prequantized_writers import gptq_checkpoint
from tests.tiny_models import make_hf_model, save_hf_model
from tests.xla_flags import cpu_devices_env

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> a checkpoint path; made once for the module."""
    root = tmp_path_factory.mktemp("parallel_load")
    llama = make_hf_model("llama", seed=3)
    paths = {
        "llama": save_hf_model(llama, root / "llama"),
        "qwen2_moe": save_hf_model(make_hf_model("qwen2_moe", seed=4), root / "qwen2_moe"),
        "gguf_q8_0": write_gguf(llama, root / "q8_0.gguf", Q.Q8_0),
        "gguf_q4_0": write_gguf(llama, root / "q4_0.gguf", Q.Q4_0),
        # Layers whose ffn_down / attn_v mix Q6_K into Q4_K, as a Q4_K_M file's do.
        "gguf_kquant_mix": write_kquant_mix(make_hf_model("llama_kquant", seed=5), root / "mix.gguf",
                                            {"blk.1.ffn_down.weight": Q.Q6_K, "blk.0.attn_v.weight": Q.Q6_K}, seed=6),
        # One layer's ffn_down in a type without a direct form: the weight reread float.
        "gguf_q2_k_mix": write_kquant_mix(make_hf_model("llama_kquant", seed=5), root / "q2_k_mix.gguf",
                                          {"blk.1.ffn_down.weight": Q.Q2_K}, seed=6),
    }
    paths["gptq"], _ = gptq_checkpoint(make_hf_model("llama", seed=7), root / "gptq", bits=4, group_size=32,
                                       sym=False, fmt="gptq", reference=False)
    return paths


class ThreadsReading:
    """A TensorSource as `source`, noting which threads read its tensors."""

    def __init__(self, source):
        self.source, self.threads = source, set()

    def __getattr__(self, attribute):
        value = getattr(self.source, attribute)
        if attribute not in ("get", "get_quantized", "get_stored"):
            return value

        def read(*args, **kwargs):
            self.threads.add(threading.get_ident())
            return value(*args, **kwargs)

        return read


def load_params(path, quantization, backend, read_threads, threads_used: set | None = None):
    config, source, _, _ = open_checkpoint(path)
    source = ThreadsReading(source)
    params = build_params(config, source, "float32", progress=False, quantization=quantization, backend=backend,
                          read_threads=read_threads)
    if threads_used is not None:
        threads_used.update(source.threads)
    return params


def assert_bitwise_equal(actual, expected):
    """The same pytree (structure, static fields), every leaf the same dtype, shape and bytes."""
    actual_leaves, actual_tree = jax.tree_util.tree_flatten(actual)
    expected_leaves, expected_tree = jax.tree_util.tree_flatten(expected)
    assert actual_tree == expected_tree
    for a, e in zip(actual_leaves, expected_leaves):
        a, e = np.asarray(a), np.asarray(e)
        assert (a.dtype, a.shape) == (e.dtype, e.shape)
        assert a.tobytes() == e.tobytes()


CASES = [
    ("llama", None, XlaBackend),
    ("llama", "int8", XlaBackend),
    ("qwen2_moe", "int4", XlaBackend),
    ("gguf_q8_0", "gguf", XlaBackend),
    ("gguf_q4_0", "gguf-a8", XlaBackend),
    ("gguf_kquant_mix", "gguf", CpuBackend),  # K-quants as stored, the mixed weights as MixedStacks
    ("gguf_kquant_mix", "gguf", XlaBackend),  # the mixed weights widened to int8 groups
    ("gguf_q2_k_mix", "gguf", XlaBackend),
    ("gptq", "stored", XlaBackend),
]


@pytest.mark.parametrize("name, quantization, backend", CASES)
def test_threaded_read_equals_sequential(checkpoints, name, quantization, backend):
    sequential_threads, worker_threads = set(), set()
    sequential = load_params(checkpoints[name], quantization, backend(), 1, sequential_threads)
    threaded = load_params(checkpoints[name], quantization, backend(), 4, worker_threads)
    assert sequential_threads == {threading.get_ident()}
    assert worker_threads and threading.get_ident() not in worker_threads and len(worker_threads) <= 4
    assert_bitwise_equal(threaded, sequential)


class StackCalls:
    """The loader's stacking of a weight's layers (params._stack), counting its calls (it stacks as before)."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.stack(*args, **kwargs)


@pytest.mark.parametrize("name, quantization", [("llama", None), ("llama", "int8"), ("qwen2_moe", None),
                                                ("gguf_q4_0", "gguf")])
def test_gpu_backend_loads_per_layer_without_stacking(checkpoints, monkeypatch, name, quantization):
    """The GPU backend's load: every layer weight given one array per layer,
    arranged into the params the stacked load arranges, bit for bit; no
    stacking on the way, where the stacked load stacks every weight."""
    stacked = load_params(checkpoints[name], quantization, XlaBackend(), read_threads=4)
    expected = GpuBackend().arrange_weights(stacked)

    spy = StackCalls(params_module._stack)
    monkeypatch.setattr(params_module, "_stack", spy)
    per_layer = load_params(checkpoints[name], quantization, GpuBackend(), read_threads=4)
    assert spy.calls == 0
    assert all(isinstance(w, PerLayer) for w in per_layer["layers"].values())
    load_params(checkpoints[name], quantization, XlaBackend(), read_threads=4)
    assert spy.calls >= len(per_layer["layers"])  # the spy sees the stacked load's stacking
    monkeypatch.undo()

    assert_bitwise_equal(GpuBackend().arrange_weights(per_layer), expected)


MESH_CHECK = """
import jax, numpy as np
from jax.sharding import Mesh
from jaxinfer.backends import GpuBackend, XlaBackend
from jaxinfer.loading.checkpoint import open_checkpoint
import jaxinfer.loading.params as params_module
from jaxinfer.loading.params import build_params
from jaxinfer.quant.layer_weights import PerLayer

config, source, _, _ = open_checkpoint({path!r})
mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
for quantization in (None, "int8"):
    stacked = build_params(config, source, "float32", False, quantization, mesh, XlaBackend())
    per_layer = build_params(config, source, "float32", False, quantization, mesh, GpuBackend())
    assert sorted(per_layer["layers"]) == sorted(stacked["layers"])
    for key, w in per_layer["layers"].items():
        assert isinstance(w, PerLayer), key
        split = PerLayer.unstack(stacked["layers"][key])
        for mine, theirs in zip(jax.tree.leaves(w), jax.tree.leaves(split), strict=True):
            assert np.asarray(mine).tobytes() == np.asarray(theirs).tobytes(), key
            assert mine.sharding.is_equivalent_to(theirs.sharding, mine.ndim), (key, mine.sharding, theirs.sharding)
        assert any(len(a.sharding.device_set) == 2 for a in jax.tree.leaves(w)) or key.endswith("norm"), key
print("ok")
"""


def test_per_layer_load_on_a_mesh(tmp_path):
    """On a 2-device mesh (a subprocess with 2 host devices) the per-layer
    load holds the stacked load's layers, each sharded as its slice."""
    path = save_hf_model(make_hf_model("llama_tp", seed=8), tmp_path / "llama_tp")
    env = cpu_devices_env(2)
    proc = subprocess.run([sys.executable, "-c", MESH_CHECK.format(path=str(path))],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split("\n")[-2] == "ok"
