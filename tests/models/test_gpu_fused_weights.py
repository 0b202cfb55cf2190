"""The GPU backend's fused weights (backends/gpu.py, FusedColumns): each
layer's q|k|v and gate|up stored concatenated along `out` at load, so that
one GEMM (or one Pallas kernel) reads each group in place. Checked on CPU:

  * the model on the GPU backend (Pallas in interpret mode) against HF
    transformers, float32 and int8 / int4 / fp8 (the reference for a quantized
    model: HF holding the same quantized weights, dequantized by
    quant/tensor.py's reference), and through the engine with LoRA
    adapters on the fused projections against PEFT;
  * its decode step cross-lowered for CUDA, read with
    scripts/gpu/compiled_hlo.py: each fused group's weight read by exactly
    one GEMM or kernel per layer, in place, and no weight copied;
  * groups whose weights differ in form stay apart.
"""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxinfer
from jaxinfer.backends import GpuBackend, XlaBackend
from jaxinfer.backends.gpu import FUSED_GROUPS
from jaxinfer.quant.fused_columns import FusedColumns, fused_key
from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.inputs import build_inputs
from jaxinfer.engine.programs import forward_step
from jaxinfer.lora.request import LoRARequest
from jaxinfer.models.kv_cache import allocate_kv_cache
from jaxinfer.models.llama import param_shapes
from jaxinfer.quant.layer_weights import PerLayer
from jaxinfer.quant.params import quantize_params, quantize_weight
from jaxinfer.quant.tensor import QuantizedTensor, dequantize
from jaxinfer.sampling_params import SamplingParams
from pallas_kernels.paged_decode_attention import default_num_splits
from scripts.gpu.compiled_hlo import kernel_counts, weight_copies, weight_readers
from tests.lora_helpers import last_row_logits, make_adapter, peft_model
from tests.tiny_models import assert_logits_close, hf_greedy, hf_logits, make_hf_model, save_hf_model
from tests.xla_flags import cpu_devices_env

HF_NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
            "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
FUSED = [fused_key(("wq", "wk", "wv")), fused_key(("w_gate", "w_up"))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_model = make_hf_model("llama", seed=12)
    return hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp("llama"))


def hf_with_weights(hf_model, layers: dict):
    """A copy of hf_model holding `layers`' linear weights (stacked [L, in,
    out], QuantizedTensors dequantized by the reference)."""
    import copy

    model = copy.deepcopy(hf_model)
    state = model.state_dict()
    for key, name in HF_NAMES.items():
        w = layers[key]
        w = np.asarray(dequantize(w) if isinstance(w, QuantizedTensor) else w, np.float32)
        for i in range(w.shape[0]):
            state[f"model.layers.{i}.{name}.weight"] = torch.from_numpy(np.ascontiguousarray(w[i].T))
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("quantization", [None, "int8", "int4", "fp8"])
def test_fused_model_matches_transformers(tiny, quantization):
    """Loaded on the GPU backend, every layer holds q|k|v and gate|up as one
    weight each (the separate ones gone), whose columns are each weight's:
    the float ones HF's, the quantized ones exactly the codes and scales of
    the same weights quantized apart (the plain XLA backend's load). Its
    logits are HF's, with those weights."""
    hf_model, directory = tiny
    model = jaxinfer.load(str(directory), progress=False, backend=GpuBackend(interpret=True),
                          quantization=quantization)
    layers = model.params["layers"]
    assert set(FUSED) <= set(layers) and not {"wq", "wk", "wv", "w_gate", "w_up"} & set(layers)
    apart = jaxinfer.load(str(directory), progress=False, backend=XlaBackend(), quantization=quantization)
    for names in FUSED_GROUPS[:2]:
        fused = layers[fused_key(names)]
        assert isinstance(fused, PerLayer) and all(isinstance(f, FusedColumns) for f in fused)
        for leaf_fused, *leaves_apart in zip(jax.tree.leaves(PerLayer([f.weight for f in fused]).stacked()),
                                             *(jax.tree.leaves(apart.params["layers"][n]) for n in names)):
            np.testing.assert_array_equal(np.asarray(leaf_fused),
                                          np.concatenate([np.asarray(a) for a in leaves_apart], axis=-1))
    reference = hf_model if quantization is None else hf_with_weights(hf_model, apart.params["layers"])
    tokens = np.random.default_rng(13).integers(0, hf_model.config.vocab_size, 24)  # 24 rows: the Pallas matmul's
    assert_logits_close(model.logits(tokens), hf_logits(reference, tokens))


def assert_greedy_as_transformers(engine, hf_model, prompts, max_tokens):
    """The engine's greedy tokens for `prompts`, generated together, are HF's."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for i, prompt in enumerate(prompts):
        assert list(done[str(i)].outputs[0].token_ids) == hf_greedy(hf_model, prompt, max_tokens)


@pytest.mark.slow
def test_engine_with_fused_weights_generates_as_transformers_and_adds_lora_per_projection(tiny, tmp_path):
    """The engine on the fused float model: HF's greedy tokens (prefill
    chunks and decode steps, the Pallas attention in interpret mode); and
    with PEFT adapters on q/k/v and on gate/up (each on some of a fused
    group's projections only), PEFT's logits: each adapter term is added to
    its own projection's columns of the fused output."""
    hf_model, directory = tiny
    model = jaxinfer.load(str(directory), progress=False, backend=GpuBackend())
    engine = LLMEngine(model, EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                                           attention="pallas", warmup="all", enable_lora=True,
                                           max_loras=2, max_lora_rank=8),
                       progress=False)
    rng = np.random.default_rng(14)
    prompts = [rng.integers(0, hf_model.config.vocab_size, n).tolist() for n in (19, 6)]
    assert_greedy_as_transformers(engine, hf_model, prompts, 5)

    adapters = {"qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                "kup": dict(r=8, lora_alpha=8, target_modules=["k_proj", "up_proj"])}
    requests = [LoRARequest(name, i + 1, make_adapter(hf_model, tmp_path / name, seed=i, **options))
                for i, (name, options) in enumerate(adapters.items())]
    for request in requests:
        engine.validate_lora("parity", request)
    logits = last_row_logits(SimpleNamespace(engine=engine), prompts, [r.lora_int_id for r in requests])
    for row, request, prompt in zip(logits, requests, prompts):
        assert_logits_close(row, hf_logits(peft_model(hf_model, request.lora_path), prompt)[-1])


def test_speculative_engine_on_the_gpu_backend_generates_as_transformers(tiny):
    """n-gram drafts verified on the GPU backend (its verify kernel writes the
    rows' K/V into the pool itself, Pallas in interpret mode): HF's greedy
    tokens, with drafts proposed and some accepted (a repeating prompt).
    Two sequences in the smallest decode bucket (four: two padding
    sequences beside them, the splits sized for a lone sequence)."""
    hf_model, directory = tiny
    model = jaxinfer.load(str(directory), progress=False, backend=GpuBackend())
    engine = LLMEngine(model, EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                                           attention="pallas", warmup="all",
                                           speculative=dict(method="ngram", num_speculative_tokens=2, max_n=2,
                                                            disable_by_batch_size=None, adaptive=False)),
                       progress=False)
    rng = np.random.default_rng(15)
    motif = rng.integers(0, hf_model.config.vocab_size, 4).tolist()
    prompts = [motif * 4, rng.integers(0, hf_model.config.vocab_size, 7).tolist()]
    assert_greedy_as_transformers(engine, hf_model, prompts, 8)
    stats = engine.stats()
    assert stats["spec_proposed_tokens"] > 0 and stats["spec_verifications"] > 0, stats
    assert engine.runner.decode_buckets == [4]


# -- the decode step, cross-lowered for CUDA ----------------------------------------------------------
CONFIG = ModelConfig(architecture="llama", vocab_size=160, hidden_size=64, intermediate_size=96, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128)
BLOCK_SIZE, NUM_BLOCKS, NUM_SEQS = 16, 8, 2


def random_params() -> dict:
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda shape: jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32),
                        param_shapes(CONFIG), is_leaf=lambda x: isinstance(x, tuple))


def lowered_decode_hlo(params) -> str:
    """The engine's decode forward on the GPU backend (Pallas attention),
    lowered for CUDA, as HLO text before XLA's passes."""
    backend = GpuBackend()
    params = backend.arrange_weights(params)
    cache = allocate_kv_cache(CONFIG, NUM_BLOCKS, BLOCK_SIZE, jnp.float32)
    inputs = build_inputs([], [], [], [], num_tokens=NUM_SEQS, num_seqs=NUM_SEQS, layout="decode",
                          block_size=BLOCK_SIZE, max_blocks_per_seq=4)
    traced = forward_step.trace(params, cache, *inputs[:3], config=CONFIG, backend=backend, layout="decode")
    return traced.lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")


def mangled(key: str) -> str:
    """A layers key as jax spells its parameters' names in HLO (params['layers']['wq+wk+wv'][0]...)."""
    return "params__layers____" + "".join(c if c.isalnum() or c == "_" else "_" for c in key) + "___"


@pytest.mark.parametrize("scheme", [None, "int8", "int4", "fp8", "w8a8"])
def test_decode_step_reads_each_fused_group_once(scheme):
    """Per layer, each fused group's weight (float: the array; quantized:
    codes and scales) is read by one kernel only, a dot for a float weight
    and the Pallas matmul (a Triton custom call) for a quantized one, in
    place (w8a8: its codes by one int8 dot); the step holds no separate
    q/k/v, gate or up weight and copies or concatenates no weight. So a
    layer runs 4 GEMMs (q|k|v, wo, gate|up, w_down), not 7; no scatter
    writes the KV pool (the attention kernel does); and a float model's
    residual adds are in its norms' kernels."""
    params = random_params() if scheme is None else quantize_params(random_params(), scheme, 32 if scheme == "int4"
                                                                     else None)
    text = lowered_decode_hlo(params)
    readers = weight_readers(text)
    assert weight_copies(text) == []
    for key in ("wq", "wk", "wv", "w_gate", "w_up"):
        assert not [w for w in readers if w.startswith(mangled(key))], key
    # w8a8 multiplies in XLA (an int8 dot, its scales on the output); the other schemes in the Pallas kernel.
    pallas = scheme in ("int8", "int4", "fp8")
    for key in FUSED:
        for layer in range(CONFIG.num_layers):
            leaves = [w for w in readers if w.startswith(f"{mangled(key)}{layer}_")]
            # The array; or codes and scales (and int4's offsets).
            assert len(leaves) == (3 if scheme == "int4" else 1 if scheme is None else 2), leaves
            (codes,) = [w for w in leaves if scheme is None or w.endswith("_data.1")]
            assert len(readers[codes]) == 1 and readers[codes][0].endswith("custom-call" if pallas else "dot")
            if pallas:  # codes, scales and offsets all read by that one kernel
                assert {kernel for w in leaves for kernel in readers[w]} == set(readers[codes]), (key, layer)
    counts = kernel_counts(text)
    per_layer = 4 * CONFIG.num_layers
    # One Pallas decode kernel per layer, and the kernel merging its splits where it has several.
    attention = CONFIG.num_layers * (2 if default_num_splits(NUM_SEQS, CONFIG.num_kv_heads) > 1 else 1)
    # A float wo or w_down leaves its sum to the next norm's kernel (models/residual.py): each norm but the
    # first layer's attention norm is one (the final norm's add stays XLA's: the step returns the stream).
    norms = 2 * CONFIG.num_layers - 1 if scheme is None else 0
    assert counts["custom-call __gpu$xla.gpu.triton"] == attention + (per_layer if pallas else 0) + norms
    # The decode kernel writes the step's K/V into the (float) pool itself: no scatter does.
    assert counts["scatter"] == 0 and counts["dynamic-update-slice"] == 0
    if not pallas:
        assert counts["dot"] == per_layer + 1  # + the head


def test_groups_of_different_forms_stay_apart():
    """A group whose weights differ in form (here v int4 beside int8 q and k)
    is stored apart, weight by weight, and multiplies as before; gate|up,
    alike, is fused. The model gives the plain XLA backend's logits on the
    same weights."""
    params = quantize_params(random_params(), "int8")
    params["layers"]["wv"] = quantize_weight(random_params()["layers"]["wv"], "int4", 32)
    arranged = GpuBackend(interpret=True).arrange_weights({**params, "layers": dict(params["layers"])})
    layers = arranged["layers"]
    assert {"wq", "wk", "wv", fused_key(("w_gate", "w_up"))} <= set(layers)
    assert fused_key(("wq", "wk", "wv")) not in layers

    from jaxinfer.models.attention import attention_reference
    from jaxinfer.models.llama import forward

    def logits(backend, params):
        tokens = jnp.asarray(np.random.default_rng(1).integers(0, CONFIG.vocab_size, (1, 9)), jnp.int32)
        positions = jnp.arange(9, dtype=jnp.int32)[None]

        def attend(q, k, v, kv_cache, layer_index):
            return attention_reference(q, k, v, positions, positions), kv_cache

        hidden, _ = forward(params, CONFIG, tokens, positions, attend, backend=backend)
        return backend.logits(params, hidden)

    np.testing.assert_allclose(np.asarray(logits(GpuBackend(interpret=True), arranged)),
                               np.asarray(logits(XlaBackend(), params)), rtol=1e-5, atol=1e-5)


def test_weights_split_over_a_mesh_stay_apart():
    """Over a tensor-parallel mesh (2 CPU devices, in a subprocess: the flag
    must be set before JAX starts) each of q, k, v, gate and up is split
    along out on its own (parallel/sharding.py), which one concatenated
    weight split the same way would not keep: they stay apart."""
    code = """
import jax, numpy as np
from jax.sharding import Mesh
from jaxinfer.backends import GpuBackend
from jaxinfer.parallel.placement import shard_params
from tests.models.test_gpu_fused_weights import random_params
mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
params = shard_params(random_params(), mesh)
assert len(params["layers"]["wq"].sharding.device_set) == 2
print(sorted(GpuBackend().arrange_weights(params)["layers"]))
"""
    env = cpu_devices_env(2)
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split("\n")[-2] == str(sorted(param_shapes(CONFIG)["layers"]))


def test_quantizing_fused_weights_quantizes_each_group_whole(tiny):
    """quantize_params on the GPU layout (a quantized draft made from the
    target's weights, engine/spec/draft_model.py): each fused group comes out
    quantized, bit for bit what fusing the quantized weights gives (a load
    quantized as it reads, then arranged)."""
    _, directory = tiny
    fused = jaxinfer.load(str(directory), progress=False, backend=GpuBackend())
    reference = jaxinfer.load(str(directory), progress=False, backend=GpuBackend(), quantization="int8")
    quantized = quantize_params(fused.params, "int8")
    for names in FUSED_GROUPS:
        key = fused_key(names)
        if key not in reference.params["layers"]:
            continue
        for got, want in zip(quantized["layers"][key], reference.params["layers"][key]):
            assert isinstance(got.weight, QuantizedTensor)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
