"""Programs compiled while the weights load (engine/early_compile.py): on a
backend whose params' layout follows from the config (here the GPU
layout, Pallas in interpret mode, on CPU), LLM compiles the first buckets'
serving programs before load() reads a weight, the engine adopts them and
generates HF's greedy tokens; where the loaded params come out other than
predicted, nothing is adopted and the engine compiles its own, with the
same tokens. Across process starts with the executable cache on, the
adopted programs are the ones stored: a cold start loads none of them
back, a warm start adopts the stored ones and loads only the rest."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer.engine.early_compile as early_compile
import jaxinfer.llm
from jaxinfer import LLM, SamplingParams
from jaxinfer.backends import CpuBackend, GpuBackend
from tests.tiny_models import hf_greedy, make_hf_model, save_hf_model

OPTIONS = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_model = make_hf_model("llama", seed=21)
    return hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp("llama"))


def generate(llm, hf_model):
    prompts = [np.random.default_rng(n).integers(0, hf_model.config.vocab_size, n).tolist() for n in (5, 11)]
    outputs = llm.generate(prompts,
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return prompts, [list(o.outputs[0].token_ids) for o in outputs]


def test_programs_compiled_while_loading_are_adopted(tiny, monkeypatch):
    hf_model, directory = tiny
    started = []
    real_start = early_compile.EarlyCompile.start

    def start(shape, config, quantization):
        # Before any weight is read: load() has not returned a model yet.
        started.append(real_start(shape, config, quantization))
        return started[-1]

    monkeypatch.setattr(jaxinfer.llm, "choose_backend", lambda *_: GpuBackend(interpret=True))
    monkeypatch.setattr(early_compile.EarlyCompile, "start", staticmethod(start))
    llm = LLM(str(directory), **OPTIONS)
    (early,) = started
    runner = llm.engine.runner
    first = [p for b in runner.first_buckets() for p in runner.serving_programs(b)]
    assert early is not None and runner.num_adopted == len(first) > 0
    assert llm.engine.block_manager.num_blocks == early.num_blocks
    prompts, tokens = generate(llm, hf_model)
    assert tokens == [hf_greedy(hf_model, p, 4) for p in prompts]


def test_other_params_than_predicted_are_compiled_again(tiny, monkeypatch):
    hf_model, directory = tiny
    backend = GpuBackend(interpret=True)
    predicted = backend.abstract_params

    def wrong(config, dtype, sharding):  # float16 where the checkpoint loads in float32
        return predicted(config, jnp.float16, sharding)

    monkeypatch.setattr(jaxinfer.llm, "choose_backend", lambda *_: backend)
    monkeypatch.setattr(GpuBackend, "abstract_params", lambda self, *args: wrong(*args))
    llm = LLM(str(directory), **OPTIONS)
    assert llm.engine.runner.num_adopted == 0
    prompts, tokens = generate(llm, hf_model)
    assert tokens == [hf_greedy(hf_model, p, 4) for p in prompts]


def test_a_layout_arranged_on_the_host_compiles_after_the_load():
    """The CPU's native layout (tiles arranged in numpy) is not predicted."""
    assert CpuBackend(native=True).abstract_params(None, None, None) is None


# One start of LLM on the GPU layout (interpret mode) with its caches under
# JAXINFER_CACHE_DIR: the runner's counts and the greedy tokens of argv[2].
CHILD = """
import json, sys
import jaxinfer.llm
from jaxinfer import LLM, SamplingParams
from jaxinfer.backends import GpuBackend

jaxinfer.llm.choose_backend = lambda *_: GpuBackend(interpret=True)
llm = LLM(sys.argv[1], max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, progress=False,
          warmup="all")
runner = llm.engine.runner
first = len([p for b in runner.first_buckets() for p in runner.serving_programs(b)])
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                    use_tqdm=False)
print("RESULT " + json.dumps({"adopted": runner.num_adopted, "loaded": runner.num_loaded, "first": first,
                              "programs": len(runner.programs()), "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


@pytest.mark.slow
def test_cold_start_loads_no_adopted_program_back_and_warm_start_adopts_the_stored(tiny, tmp_path):
    hf_model, directory = tiny
    prompts = [np.random.default_rng(n).integers(0, hf_model.config.vocab_size, n).tolist() for n in (5, 11)]
    env = {k: v for k, v in os.environ.items() if k != "JAXINFER_DISABLE_COMPILATION_CACHE"}
    env["JAXINFER_CACHE_DIR"] = str(tmp_path)
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", CHILD, str(directory), json.dumps(prompts)], env=env,
                             capture_output=True, text=True, cwd=Path(__file__).parents[2])
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:]))
    cold, warm = runs
    assert cold["first"] > 0 and cold["adopted"] == cold["first"] and cold["loaded"] == 0
    assert warm["adopted"] == warm["first"] and warm["loaded"] == warm["programs"] - warm["first"]
    expected = [hf_greedy(hf_model, p, 4) for p in prompts]
    assert cold["tokens"] == warm["tokens"] == expected
