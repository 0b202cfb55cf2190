"""The executable cache (engine/executable_cache.py) across real process
starts: a second start loads every program instead of compiling it and
generates HF's greedy tokens with them; programs that JAX's own persistent
cache served are never stored (their copies would not run), in a second
engine of the process either."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.cpu_features import needs_vec16
from tests.gguf_writer import write_kquant_mix
from tests.tiny_models import hf_greedy, make_hf_model, save_hf_model
from tests.xla_flags import product_level, with_device_count

# One start of the engine on a tiny checkpoint, its caches under argv[2]:
# prints what warm-up loaded and the greedy tokens of two prompts (batch 2,
# so a prefill bucket and the decode buckets 1 and 2 all run).
CHILD = """
import json, sys
from jaxinfer import LLM, SamplingParams

def start():
    return LLM(sys.argv[1], max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, warmup="all",
               progress=False)

llm = start()
prompts = json.loads(sys.argv[2])
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
runner = llm.engine.runner
result = {"loaded": runner.num_loaded, "programs": len(runner.programs()),
          "tokens": [o.outputs[0].token_ids for o in outs]}
# Then one request that samples (seeded): its sampler is not among those that serve first.
sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)
result["sampled"] = llm.generate(prompts[:1], sampled, use_tqdm=False)[0].outputs[0].token_ids
print("RESULT " + json.dumps(result))
"""
# The same with background compilation (the default): what warm-up had loaded
# when LLM() returned, and what after the background thread finished.
# "ran": the programs its steps ran (the serving ones of the buckets they ran in).
CHILD_BACKGROUND = CHILD.replace('warmup="all"', 'warmup="background"').replace(
    "llm = start()", "llm = start()\nloaded_at_start = llm.engine.runner.num_loaded_before_serving").replace(
    "result = {", "llm.wait_compiled()\nresult = {").replace(
    '{"loaded"', '{"loaded_at_start": loaded_at_start, "compiling": llm.stats()["num_programs_compiling"], '
    '"ran": len({p for b in runner._ready for p in runner.serving_programs(b)}), "loaded"')
# On demand: what its steps compiled, and loaded, by the end (the sampled request's sampler included).
CHILD_ON_DEMAND = CHILD.replace('warmup="all"', 'warmup="on_demand"').replace(
    'print("RESULT "', 'result.update(compiled=runner.num_compilations, loaded=runner.num_loaded)\nprint("RESULT "')
# The same, with an engine started (and its programs stored) first in the same process.
CHILD_SECOND_START = CHILD.replace("llm = start()", "del start().engine\nllm = start()")


def start(model_dir: Path, cache_dir: Path, prompts: list, child: str = CHILD, devices: int = 1,
          xla_level: str = "suite") -> dict:
    """One child process; xla_level "product": compiled at XLA's default
    optimization level instead of the suite's (tests/xla_flags.py)."""
    env = {k: v for k, v in os.environ.items() if k != "JAXINFER_DISABLE_COMPILATION_CACHE"}
    if xla_level == "product":
        env = product_level(env)
    env["JAXINFER_CACHE_DIR"] = str(cache_dir)
    if devices > 1:
        env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), devices)
    out = subprocess.run([sys.executable, "-c", child, str(model_dir), json.dumps(prompts)], env=env,
                         capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


def entries(cache_dir: Path) -> list[Path]:
    return list(cache_dir.glob("*/executables/*.pkl"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_model = make_hf_model("llama", seed=5)
    return hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp("tiny"))


@pytest.mark.slow
def test_second_start_loads_every_program_and_matches_transformers(tiny, tmp_path):
    hf_model, model_dir = tiny
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, 7).tolist(), rng.integers(0, 128, 3).tolist()]
    expected = [hf_greedy(hf_model, p, 10) for p in prompts]
    cache = tmp_path / "cache"

    # The product's own optimization level: the one test that runs it (the
    # rest of the suite compiles at LLVM's lowest; tests/xla_flags.py).
    first = start(model_dir, cache, prompts, xla_level="product")
    assert first["loaded"] == 0
    assert first["tokens"] == expected
    assert len(entries(cache)) == first["programs"]

    second = start(model_dir, cache, prompts, xla_level="product")
    assert second["loaded"] == second["programs"] == first["programs"]
    assert second["tokens"] == expected

    # JAX's persistent cache (beside it, filled by the first start) now
    # serves every compilation: nothing may be stored from it.
    for entry in entries(cache):
        entry.unlink()
    third = start(model_dir, cache, prompts, xla_level="product")
    assert third["loaded"] == 0
    assert third["tokens"] == expected
    assert entries(cache) == []

    # Nor from a second engine in the process, which compiles the same
    # programs again: JAX hands back its in-memory copy of what its
    # persistent cache served, with no cache-hit event (stored, such a copy
    # failed at the next start: "Function wrapped_iota not found").
    fourth = start(model_dir, cache, prompts, child=CHILD_SECOND_START, xla_level="product")
    assert fourth["tokens"] == expected
    assert entries(cache) == []


def test_single_device_engine_restarts_on_a_host_with_several_devices(tiny, tmp_path):
    """A host with several devices (8 GPUs; here 8 forced CPU devices) running
    a single-device engine: its second start in the process loads the
    programs the first stored, and they run on the engine's one device
    (they were once loaded for all 8 and failed, wanting 8 shards)."""
    hf_model, model_dir = tiny
    prompts = [np.random.default_rng(1).integers(0, 128, 5).tolist()]
    expected = [hf_greedy(hf_model, p, 10) for p in prompts]
    second = start(model_dir, tmp_path / "cache", prompts, child=CHILD_SECOND_START, devices=8)
    assert second["loaded"] == second["programs"] > 0
    assert second["tokens"] == expected


def test_a_warm_start_loads_programs_as_steps_need_them(tiny, tmp_path):
    """With background compilation and every program stored, warm-up loads
    none before LLM() returns; each step's own bucket is loaded when it
    first runs and the others stay on disk (none is compiled or lowered
    again, and none is resident that no step ran); the tokens are HF's, and
    a sampling request's, whose sampler loads when it comes, the cold start's."""
    hf_model, model_dir = tiny
    prompts = [np.random.default_rng(2).integers(0, 128, 6).tolist()]
    expected = [hf_greedy(hf_model, p, 10) for p in prompts]
    cache = tmp_path / "cache"
    first = start(model_dir, cache, prompts)
    second = start(model_dir, cache, prompts, child=CHILD_BACKGROUND)
    assert second["loaded_at_start"] == 0
    assert second["loaded"] == second["ran"] < second["programs"] == first["programs"]
    assert second["compiling"] == 0
    assert second["tokens"] == expected
    assert second["sampled"] == first["sampled"]  # its sampler loaded when the request needed it


def test_on_demand_stores_what_its_steps_compiled_and_the_next_start_loads_it(tiny, tmp_path):
    """warmup="on_demand" compiles only the buckets its steps run, and stores
    each (the same executables a full warm-up stores): a second start running
    the same requests loads every program it needs and compiles none; the
    tokens are HF's, and the sampling request's the first start's."""
    hf_model, model_dir = tiny
    prompts = [np.random.default_rng(3).integers(0, 128, 20).tolist()]  # a 32-token bucket: not a first one
    expected = [hf_greedy(hf_model, p, 10) for p in prompts]
    cache = tmp_path / "cache"
    first = start(model_dir, cache, prompts, child=CHILD_ON_DEMAND)
    assert first["loaded"] == 0 and first["tokens"] == expected
    assert len(entries(cache)) == first["compiled"] < first["programs"]
    second = start(model_dir, cache, prompts, child=CHILD_ON_DEMAND)
    assert second["loaded"] == second["compiled"] == first["compiled"]
    assert second["tokens"] == expected and second["sampled"] == first["sampled"]


@needs_vec16
def test_a_k_quant_files_second_start_runs_the_stored_programs_on_its_kinds_kernels(tmp_path):
    """A GGUF of Q4_K weights with Q6_K in the head and in a layer that mixes
    both: the programs its second start loads call each kind's K-quant
    kernels, libraries of their own that no trace loads there (nothing is
    traced); they load with the weights, and the second start gives the
    first's tokens, greedy and sampled."""
    q = gguf.GGMLQuantizationType
    mix = {"blk.1.attn_v.weight": q.Q6_K, "blk.1.ffn_down.weight": q.Q6_K, "output.weight": q.Q6_K}
    path = write_kquant_mix(make_hf_model("llama_kquant", seed=13), tmp_path / "m.gguf", mix, seed=6)
    prompts = [np.random.default_rng(4).integers(0, 128, 6).tolist()]
    cache = tmp_path / "cache"
    first = start(path, cache, prompts, child=CHILD_ON_DEMAND)
    second = start(path, cache, prompts, child=CHILD_ON_DEMAND)
    assert first["loaded"] == 0 and second["loaded"] == first["compiled"] > 0
    assert second["tokens"] == first["tokens"] and second["sampled"] == first["sampled"]
