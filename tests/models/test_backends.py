"""The platform backends (jaxinfer/backends/), checked on CPU.

The GPU backend's programs are cross-lowered for CUDA (as the Pallas kernel
tests do) and read: its decode step hands every layer's weight to its GEMM
as a whole array (no dynamic slice of a stacked weight, which XLA copies
before a GPU GEMM), and a float32 model's dots ask for full precision. Its
layout and unrolled layer loop also run here, with the Pallas attention in
interpret mode, against HF transformers."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.backends import CpuBackend, GpuBackend, XlaBackend, choose_backend
from jaxinfer.config import ModelConfig
from jaxinfer.engine.inputs import build_inputs
from jaxinfer.engine.programs import forward_step
from jaxinfer.models.kv_cache import allocate_kv_cache
from jaxinfer.models.llama import param_shapes
from jaxinfer.models.residual import Residual
from jaxinfer.quant.layer_weights import PerLayer
from jaxinfer.quant.params import LINEAR_KEYS, quantize_params, quantize_weight
from tests.tiny_models import assert_logits_close, hf_logits, make_hf_model, save_hf_model

# Distinct sizes, so that a stacked weight's shape names it in the module text.
CONFIG = ModelConfig(architecture="llama", vocab_size=160, hidden_size=64, intermediate_size=96, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128)
BLOCK_SIZE, NUM_BLOCKS, NUM_SEQS = 16, 8, 2


def random_params(dtype=jnp.float32) -> dict:
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda shape: jnp.asarray(rng.standard_normal(shape) * 0.1, dtype), param_shapes(CONFIG),
                        is_leaf=lambda x: isinstance(x, tuple))


def lowered_decode_step(backend, params, dtype=jnp.float32) -> str:
    """The engine's decode forward for NUM_SEQS sequences, lowered for CUDA."""
    params = backend.arrange_weights(params)
    cache = allocate_kv_cache(CONFIG, NUM_BLOCKS, BLOCK_SIZE, dtype)
    inputs = build_inputs([], [], [], [], num_tokens=NUM_SEQS, num_seqs=NUM_SEQS, layout="decode",
                          block_size=BLOCK_SIZE, max_blocks_per_seq=4)
    traced = forward_step.trace(params, cache, *inputs[:3], config=CONFIG, backend=backend, layout="decode")
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def stacked_weight_types(dtype: str) -> list[str]:
    """The MLIR types of the seven stacked [layers, in, out] layer weights."""
    shapes = param_shapes(CONFIG)["layers"]
    return sorted({f"tensor<{'x'.join(map(str, shapes[k]))}x{dtype}>" for k in LINEAR_KEYS})


def dynamic_slices_of(text: str, types: list[str]) -> list[str]:
    return [line for line in text.splitlines() if "stablehlo.dynamic_slice" in line
            and any(f"({t}" in line for t in types)]


def weights_read_in_place(text: str, op: str) -> int:
    """How many `op`s (a dot_general, or a call of the Pallas matmul) take a
    weight straight from the program's arguments (%argN), not a copy."""
    return len(re.findall(rf"{op}\(?%[\w#]+, %arg\d+[,)]", text))


def branches_on_data(text: str) -> list[str]:
    """The conditionals (stablehlo.case or .if) of a lowered program that
    choose by a computed value: not those jax.lax.platform_dependent lowers
    to (the GPU backend's Pallas norms), which choose by a constant, the
    platform's index, or by such a choice."""
    fixed = set(re.findall(r"(%\w+) = stablehlo\.constant", text))
    found = []
    for line in text.splitlines():
        match = re.search(r'(%\w+)(?::\d+)? = "stablehlo\.(?:case|if)"\((%\w+)\)', line)
        if match and match.group(2) in fixed:
            fixed.add(match.group(1))
        elif match or "stablehlo.if" in line:
            found.append(line)
    return found


def test_gpu_decode_step_reads_each_layer_weight_in_place():
    """The GPU backend's weights are one array per layer and its loop is
    unrolled: every layer's four GEMMs (q|k|v and gate|up stored joined) take their weight straight from the
    program's arguments, and no stacked weight exists to be sliced. The
    scanned reference backend slices every stacked weight each layer (what
    made XLA copy them on the GPU), which this check sees."""
    types = stacked_weight_types("f32")
    gpu = lowered_decode_step(GpuBackend(), random_params())
    # q|k|v, wo, gate|up and w_down (q/k/v and gate/up stored concatenated: backends/gpu.py), + the head
    assert weights_read_in_place(gpu, "stablehlo.dot_general ") == 4 * CONFIG.num_layers + 1
    assert not dynamic_slices_of(gpu, types) and not any(t in gpu for t in types)
    scanned = lowered_decode_step(XlaBackend(attention="pallas"), random_params())
    assert {t for t in types if any(t in line for line in dynamic_slices_of(scanned, types))} == set(types)


def test_gpu_quantized_weights_reach_the_pallas_kernel_per_layer():
    """int8 weights at decode: every layer's four joined projections through the
    Pallas matmul (a Triton call), each reading its codes and scales straight
    from the program's arguments."""
    params = quantize_params(random_params(), "int8")
    text = lowered_decode_step(GpuBackend(), params)
    assert weights_read_in_place(text, r"call @quantized_matmul\w*") == 4 * CONFIG.num_layers
    assert not dynamic_slices_of(text, stacked_weight_types("i8"))


def dot_precisions(text: str) -> list[str]:
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots
    return ["HIGHEST" if "precision = [HIGHEST, HIGHEST]" in line else "DEFAULT" for line in dots]


def test_float32_means_float32_on_gpu():
    """A float32 model's every dot asks for full precision on a GPU (JAX's
    default there is TF32); allow_tf32 is the opt-in; bfloat16 is left as it
    is; and the setting is the program's own, not the process's."""
    cpu = choose_backend().with_dtype(jnp.float32)
    assert isinstance(cpu, CpuBackend) and cpu.matmul_precision is None  # XLA:CPU computes float32 anyway
    float32 = lowered_decode_step(GpuBackend().with_dtype(jnp.float32), random_params())
    assert set(dot_precisions(float32)) == {"HIGHEST"}
    tf32 = lowered_decode_step(GpuBackend(allow_tf32=True).with_dtype(jnp.float32), random_params())
    assert set(dot_precisions(tf32)) == {"DEFAULT"}
    bf16 = lowered_decode_step(GpuBackend().with_dtype(jnp.bfloat16), random_params(jnp.bfloat16), jnp.bfloat16)
    assert set(dot_precisions(bf16)) == {"DEFAULT"}
    assert jax.config.jax_default_matmul_precision is None


def test_dtype_auto_is_the_checkpoints_off_cpu(tmp_path):
    """dtype="auto" (vLLM's default): the dtype transformers stored the weights
    in on a GPU, float32 on CPU (exact for a bfloat16 checkpoint, and fast)."""
    import torch

    directory = save_hf_model(make_hf_model("llama", seed=8).to(torch.bfloat16), tmp_path)
    assert jaxinfer.load(str(directory), progress=False).dtype == np.float32
    on_gpu = jaxinfer.load(str(directory), progress=False, backend=GpuBackend(attention="reference"))
    assert on_gpu.dtype == jnp.bfloat16 and on_gpu.backend.matmul_precision is None
    assert on_gpu.params["layers"]["wq+wk+wv"][0].weight.dtype == jnp.bfloat16


def test_per_layer_layout_round_trips():
    params = random_params()
    stacked = params["layers"]["w_down"]
    laid_out = GpuBackend().arrange_weights({**params, "layers": dict(params["layers"])})
    per_layer = laid_out["layers"]["w_down"]
    assert isinstance(per_layer, PerLayer) and len(per_layer) == CONFIG.num_layers
    np.testing.assert_array_equal(np.asarray(per_layer.stacked()), np.asarray(stacked))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_model = make_hf_model("qwen2", seed=4)  # tied head and q/k/v biases
    return hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp("qwen2"))


def test_gpu_backend_model_matches_transformers(tiny):
    """The GPU layout and unrolled loop give HF's logits (cache-free forward)."""
    hf_model, directory = tiny
    model = jaxinfer.load(str(directory), progress=False, backend=GpuBackend(interpret=True))
    assert all(isinstance(w, PerLayer) for w in model.params["layers"].values())
    tokens = np.random.default_rng(5).integers(0, hf_model.config.vocab_size, 40)
    assert_logits_close(model.logits(tokens), hf_logits(hf_model, tokens))


def test_gpu_backend_leaves_a_projections_sum_to_the_norm():
    """A decode step's wo or w_down on the GPU backend: float32 partial sums
    over 8 slices of a 4,096-wide input (linear_parts), added to the stream
    in the norm's kernel (add_rms_norm, interpret mode): the stream and its
    norm are float64's x + inputs @ w and HF's RMSNorm of it. One row, or a
    quantized weight, is left to XLA (None)."""
    backend = GpuBackend(interpret=True).with_dtype(jnp.float32)
    rng = np.random.default_rng(5)
    inputs = rng.standard_normal((1, 4, 4096)).astype(np.float32)
    w = (rng.standard_normal((4096, 96)) / 64).astype(np.float32)
    x = rng.standard_normal((1, 4, 96)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(96)).astype(np.float32)
    with backend.precision():
        parts = backend.linear_parts(jnp.asarray(inputs), jnp.asarray(w))
        assert parts.shape == (8, 1, 4, 96) and parts.dtype == jnp.float32
        stream, normed = backend.add_rms_norm(Residual(jnp.asarray(x), parts), jnp.asarray(norm), 1e-6)
        assert backend.linear_parts(jnp.asarray(inputs[:, :1]), jnp.asarray(w)) is None
        assert backend.linear_parts(jnp.asarray(inputs), quantize_weight(jnp.asarray(w), "int8")) is None
    expected = x.astype(np.float64) + inputs.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(stream), expected, rtol=1e-5, atol=1e-5)
    rms = np.sqrt((expected * expected).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(normed), norm * expected / rms, rtol=1e-5, atol=1e-5)


# -- mixtures of experts ------------------------------------------------------------------------------
MOE_CONFIG = ModelConfig(architecture="qwen2_moe", vocab_size=160, hidden_size=64, intermediate_size=96, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128, num_experts=6,
                         num_experts_per_tok=2, moe_intermediate_size=80, shared_expert_intermediate_size=48,
                         dense_layers=(1,))


def test_gpu_decode_step_multiplies_only_the_selected_experts():
    """A MoE's decode step on the GPU backend, cross-lowered for CUDA: each
    sparse layer's expert matmuls are the Pallas grouped kernel (two calls:
    gate and up, then down), reading that layer's expert stack straight from
    the program's arguments; no ragged_dot (XLA's would read every expert),
    and the dense layer runs its own MLP, chosen while tracing the unrolled
    loop, with no conditional."""
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda shape: jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32),
                          param_shapes(MOE_CONFIG), is_leaf=lambda x: isinstance(x, tuple))
    params = GpuBackend().arrange_weights(params)
    cache = allocate_kv_cache(MOE_CONFIG, NUM_BLOCKS, BLOCK_SIZE, jnp.float32)
    inputs = build_inputs([], [], [], [], num_tokens=NUM_SEQS, num_seqs=NUM_SEQS, layout="decode",
                          block_size=BLOCK_SIZE, max_blocks_per_seq=4)
    traced = forward_step.trace(params, cache, *inputs[:3], config=MOE_CONFIG, backend=GpuBackend(), layout="decode")
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    sparse_layers = len(MOE_CONFIG.sparse_layers)
    assert weights_read_in_place(text, r"call @expert_matmul\w*") == 3 * sparse_layers
    assert "ragged" not in text and not branches_on_data(text)


def test_gpu_backend_moe_matches_transformers(tmp_path):
    """The GPU layout and unrolled loop with the grouped kernel (interpret
    mode) give HF's logits for a MoE mixing dense and sparse layers."""
    hf_model = make_hf_model("qwen3_moe", seed=4)
    directory = save_hf_model(hf_model, tmp_path)
    model = jaxinfer.load(str(directory), progress=False, backend=GpuBackend(interpret=True))
    tokens = np.random.default_rng(5).integers(0, hf_model.config.vocab_size, 7)  # 14 rows: the kernel's sizes
    assert_logits_close(model.logits(tokens), hf_logits(hf_model, tokens))


def test_kv_budget_is_the_backends():
    """The KV pool's size is the backend's rule: on CPU every sequence at full
    length up to 512 MiB, but at least one full-context request while half of
    the host's available memory holds it (a 32k-context 0.5B model's 805 MB of
    K/V), else that half; where devices report no memory, the reference's
    512 MiB cap."""
    from jaxinfer.backends.host_memory import available_host_bytes

    mib = 2**20
    cpu, reference = CpuBackend(), XlaBackend()
    one, every = 600 * mib, 16 * 600 * mib
    assert available_host_bytes() // 2 >= one  # the rule's condition holds on this machine
    assert cpu.kv_cache_budget(jax.devices(), 0.9, one, every)[0] == one
    assert cpu.kv_cache_budget(jax.devices(), 0.9, 100 * mib, 16 * 100 * mib)[0] == 512 * mib
    assert cpu.kv_cache_budget(jax.devices(), 0.9, 10 * mib, 2 * 10 * mib)[0] == 20 * mib  # all it needs
    # One request past the room: the room, the longest context that fits (fit_default_context).
    # (MemAvailable moves while other processes run: bounds, not one value.)
    assert one <= cpu.kv_cache_budget(jax.devices(), 0.9, 2**50, 2**51)[0] < 2**50
    assert reference.kv_cache_budget(jax.devices(), 0.9, one, every)[0] == 512 * mib
