"""The GPU check's reading of compiled programs (scripts/gpu/compiled_hlo.py),
run on CPU-compiled programs: its parse of the HLO text against XLA's own
HloModule, the weight copies it reports against programs that do and do not
concatenate weights, the bytes it counts against numpy's. And the GPU
backend's XLA options, which XLA:CPU checks by name too."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

import jaxinfer
from jaxinfer.backends import GpuBackend
from jaxinfer.engine.inputs import build_inputs
from jaxinfer.engine.programs import forward_step
from jaxinfer.models.kv_cache import allocate_kv_cache
from scripts.gpu.compiled_hlo import NOT_KERNELS, bytes_written, kernel_counts, kernels_per_layer, parse, weight_copies
from tests.tiny_models import make_hf_model, save_hf_model

NUM_SEQS, BLOCK_SIZE = 2, 16


@pytest.fixture(scope="module")
def decode_step(tmp_path_factory):
    """The tiny Llama's decode step on the GPU backend (unrolled layers, one
    array per weight), compiled for the CPU: (compiled, model)."""
    directory = save_hf_model(make_hf_model("llama", seed=2), tmp_path_factory.mktemp("llama"))
    model = jaxinfer.load(str(directory), progress=False, backend=GpuBackend(attention="reference"))
    cache = allocate_kv_cache(model.config, 8, BLOCK_SIZE, jnp.float32)
    inputs = build_inputs([], [], [], [], num_tokens=NUM_SEQS, num_seqs=NUM_SEQS, layout="decode",
                          block_size=BLOCK_SIZE, max_blocks_per_seq=4)
    compiled = forward_step.trace(model.params, cache, *inputs[:3], config=model.config, backend=model.backend,
                                  layout="decode").lower().compile()
    return compiled, model


def _xla_opcode(instruction) -> str:
    """XLA's opcode enum (kGetTupleElement) in the text's spelling (get-tuple-element)."""
    name = instruction.opcode.name[1:]
    return "".join(f"-{c.lower()}" if c.isupper() else c for c in name).lstrip("-")


def test_parse_matches_xlas_module(decode_step):
    """Every computation and instruction the text parse finds, with its
    opcode, is the one XLA's HloModule holds; the kernels counted are the
    kernel-level computations' instructions less those that launch nothing."""
    compiled, model = decode_step
    text = compiled.as_text()
    module = parse(text)
    xla = compiled.runtime_executable().hlo_modules()[0]
    spelled = {"exp": "exponential", "sin": "sine", "cos": "cosine"}  # where the enum's name is shorter than the text
    reference = {c.name: {i.name: spelled.get(_xla_opcode(i), _xla_opcode(i)) for i in c.instructions()}
                 for c in xla.computations()}
    assert {c: {i.name: i.opcode for i in instructions} for c, instructions in module.computations.items()} == reference
    levels = module.kernel_level()
    assert levels[0] == module.entry and module.entry in reference
    expected = sum(1 for c in levels for op in reference[c].values() if op not in NOT_KERNELS)
    counts = kernel_counts(text)
    assert sum(n for op, n in counts.items() if " " not in op) == expected
    assert counts["fusion"] == sum(op == "fusion" for op in reference[module.entry].values()) + sum(
        op == "fusion" for c in levels[1:] for op in reference[c].values())
    assert kernels_per_layer(text, model.config.num_layers) == expected / model.config.num_layers
    assert weight_copies(text) == []  # XLA:CPU has no dot merger; the unrolled step reads each weight in place


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def test_weight_copies_names_concatenated_weights():
    """x @ concat(a, b) copies both weights into one on every call (what XLA's
    GPU dot merger would build); concat(x @ a, x @ b) copies no weight."""
    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.standard_normal((64, 48)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal((64, 80)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    merged = _compiled(lambda params, x: x @ jnp.concatenate([params["a"], params["b"]], axis=1), params, x)
    found = weight_copies(merged.as_text())
    assert len(found) == 1 and "params['a']" in found[0] and "params['b']" in found[0], found
    apart = _compiled(lambda params, x: jnp.concatenate([x @ params["a"], x @ params["b"]], axis=1), params, x)
    assert weight_copies(apart.as_text()) == []
    # Only arguments under the weights' prefix count as weights.
    assert weight_copies(merged.as_text(), weights_prefix="weights") == []


def test_bytes_written_by_named_kernels():
    """The bytes the kernels under a name scope write: their outputs' nbytes."""
    def fn(x, y):
        with jax.named_scope("writer"):
            doubled, summed = x * 2 + 1, (y * 3).sum(axis=0)
        return doubled, summed, y - 1

    x, y = jnp.ones((64, 32), jnp.float32), jnp.ones((16, 8), jnp.bfloat16)
    total, kernels = bytes_written(_compiled(fn, x, y).as_text(), "writer")
    doubled, summed, _ = jax.eval_shape(fn, x, y)
    assert total == np.dtype(doubled.dtype).itemsize * doubled.size + np.dtype(summed.dtype).itemsize * summed.size
    assert len(kernels) == 2, kernels


def test_gpu_backend_options_are_names_xla_knows():
    """GpuBackend compiles with XLA's dot merger and rematerialization off,
    under option names XLA knows: a tiny program compiles with them, and
    with a misspelled one it does not (so names are checked, here on CPU as
    on the GPU)."""
    options = GpuBackend().compiler_options()
    assert options == {"xla_gpu_dot_merger_threshold_mb": 0, "xla_disable_hlo_passes": "rematerialization"}
    lowered = jax.jit(lambda a, b: a @ b).lower(jnp.ones((4, 8)), jnp.ones((8, 2)))
    np.testing.assert_allclose(np.asarray(lowered.compile(options)(jnp.ones((4, 8)), jnp.ones((8, 2)))), 8.0)
    with pytest.raises(Exception, match="xla_gpu_dot_merger_threshold_mbs"):
        lowered.compile({"xla_gpu_dot_merger_threshold_mbs": 0})


def test_autotuning_results_outlive_the_source_fingerprint(tmp_path, monkeypatch):
    """With caching on, GpuBackend hands XLA an autotune cache directory that
    exists, lies under the cache root but outside the source fingerprint's
    directory (which an edit replaces), is the same for another fingerprint,
    and is a name XLA takes (a program compiles with it)."""
    from jaxinfer import utils

    monkeypatch.delenv("JAXINFER_DISABLE_COMPILATION_CACHE", raising=False)
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path))
    directory = Path(GpuBackend().compiler_options()["xla_gpu_per_fusion_autotune_cache_dir"])
    assert directory.is_dir() and tmp_path in directory.parents
    assert utils.compilation_cache_dir() not in (directory, *directory.parents)
    monkeypatch.setattr(utils, "source_fingerprint", lambda: "0123456789abcdef")
    assert Path(GpuBackend().compiler_options()["xla_gpu_per_fusion_autotune_cache_dir"]) == directory
    lowered = jax.jit(lambda a, b: a @ b).lower(jnp.ones((4, 8)), jnp.ones((8, 2)))
    np.testing.assert_allclose(np.asarray(lowered.compile(GpuBackend().compiler_options())(
        jnp.ones((4, 8)), jnp.ones((8, 2)))), 8.0)
    monkeypatch.setenv("JAXINFER_DISABLE_COMPILATION_CACHE", "1")
    assert "xla_gpu_per_fusion_autotune_cache_dir" not in GpuBackend().compiler_options()


def test_bytes_written_leaves_out_outputs_aliased_to_operands():
    """A custom call updating an operand in place (XLA's output_to_operand_aliasing,
    as the decode kernel writing the KV pool compiles on a GPU) writes its
    other outputs' bytes, not the aliased buffer's."""
    hlo = """HloModule m, entry_computation_layout={(f32[4]{0}, bf16[2,8]{1,0})->(f32[4]{0}, bf16[2,8]{1,0})}

ENTRY %main (p0: f32[4], p1: bf16[2,8]) -> (f32[4], bf16[2,8]) {
  %p0 = f32[4]{0} parameter(0)
  %p1 = bf16[2,8]{1,0} parameter(1)
  ROOT %k = (f32[4]{0}, bf16[2,8]{1,0}) custom-call(%p0, %p1), custom_call_target="kernel", output_to_operand_aliasing={{1}: (1, {})}, metadata={op_name="jit(f)/writer/pallas_call"}
}
"""
    total, kernels = bytes_written(hlo, "writer")
    assert total == 4 * 4 and len(kernels) == 1


def test_layout_from_shapes_is_the_loaded_layout(decode_step):
    """The GPU backend's params computed from the config's shapes alone
    (abstract_params: what early_compile.py and scripts/gpu/deviceless.py
    compile for before or without any weight): the same tree
    (one array per layer, q|k|v and gate|up fused) with the same shapes
    and dtypes as a checkpoint loaded for that backend."""
    _, model = decode_step
    loaded = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), model.params)
    computed = model.backend.abstract_params(model.config, jnp.float32, SingleDeviceSharding(jax.devices()[0]))
    assert jax.tree.structure(computed) == jax.tree.structure(loaded)
    assert jax.tree.leaves(computed) == jax.tree.leaves(loaded)


def test_gpu_checks_device_step_runs_the_engines_own_programs(tmp_path):
    """scripts/gpu/e2e.py's device-only step (a decode step's forward and
    sample programs queued back to back) calls the runner as the engine's
    step does: at batches 1 and 3 (padded to the engine's bucket) it runs
    programs the engine compiled at start-up and compiles none of its own."""
    from scripts.gpu.e2e import device_step_ms

    directory = save_hf_model(make_hf_model("llama", seed=2), tmp_path)
    llm = jaxinfer.LLM(str(directory), progress=False, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                       num_kv_blocks=16, warmup="all")
    engine = llm.engine
    compiled = engine.runner.num_compilations
    for batch in (1, 3):
        assert device_step_ms(engine, batch, context=20, iters=2) > 0
    assert engine.runner.num_compilations == compiled


def test_gpu_plugin_compiles_every_kernel_the_tests_call():
    """tests/gpu_plugin.py (the GPU check's Pallas part) forces interpret=False
    on each kernel entry point, jitted ones included: a jitted kernel left
    unwrapped would run the GPU check's kernel tests in interpret mode. Run in
    a process of its own (the plugin rewrites the modules it loads)."""
    import subprocess
    import sys

    kernels = {"paged_decode_attention": ["paged_decode_attention", "merge_splits"],
               "paged_prefill_attention": ["paged_prefill_attention"], "rms_norm": ["rms_norm"],
               "quantized_matmul": ["quantized_matmul"], "expert_matmul": ["expert_matmul"]}
    check = "; ".join(["import importlib, tests.gpu_plugin"] + [
        f"assert importlib.import_module('pallas_kernels.{module}').{name}.forces_compiled, '{name}'"
        for module, names in kernels.items() for name in names])
    root = Path(__file__).parents[2]
    result = subprocess.run([sys.executable, "-c", check], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
