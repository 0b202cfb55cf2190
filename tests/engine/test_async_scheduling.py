"""Async scheduling (engine/engine.py): step N + 1 scheduled and launched
before step N's outputs are processed, its rows reading step N's tokens on
the device. On a tiny model, against the engine stepping one step at a time
(which test_engine.py checks against HF transformers): the same tokens,
greedy and seeded, through chunked prefill, preemption (a pool too small for
every sequence), sequences ending mid-flight (stop tokens, max_tokens),
penalised requests (which step one at a time) and aborts."""

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from tests.tiny_models import make_hf_model, save_hf_model

# A small pool (block 0 is the null block): 4 sequences of up to ~60 tokens need more, so some are preempted.
OPTIONS = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_kv_blocks=14,
               warmup="all", progress=False)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    directory = save_hf_model(make_hf_model("llama", seed=7), tmp_path_factory.mktemp("tiny"))
    return {mode: LLM(str(directory), async_scheduling=mode, **OPTIONS) for mode in (False, True)}


def workload():
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 128, n).tolist() for n in (40, 7, 25, 3, 18, 33)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=30, n=2, ignore_eos=True),
        # Ends at the first sampled token among 15 stop ids, mid-flight.
        SamplingParams(temperature=1.0, seed=5, max_tokens=40, stop_token_ids=list(range(0, 128, 9)), ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        # Penalties need the previous step's tokens on the host: these steps run one at a time.
        SamplingParams(temperature=0.7, seed=2, max_tokens=20, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=28, logprobs=2, ignore_eos=True),
    ]
    return prompts, params


def outputs(llm, prompts, params):
    return [[(list(c.token_ids), c.finish_reason, c.logprobs and [sorted(d) for d in c.logprobs]) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_same_tokens_as_one_step_at_a_time(engines):
    prompts, params = workload()
    expected = outputs(engines[False], prompts, params)
    before = engines[True].stats()
    assert outputs(engines[True], prompts, params) == expected
    stats = engines[True].stats()
    assert stats["num_preemptions"] > before["num_preemptions"]
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0
    # Some sequence really ended before its max_tokens, while a step for it was in flight.
    assert any(finish == "stop" for request in expected for _, finish, _ in request)


def test_abort_mid_flight(engines):
    """A request aborted while a step holding it is on the device: the others
    get their tokens unchanged, the aborted one a prefix of its tokens, and
    every block comes back."""
    prompts, params = workload()
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 3
    prompts = prompts[:3]
    results = {}
    for mode, llm in engines.items():
        engine = llm.engine
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"abort-{mode}-{i}", prompt, p)
        finished, steps = {}, 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id[len(f"abort-{mode}-"):]] = list(out.outputs[0].token_ids)
            steps += 1
            if steps == 6:
                aborted = engine.abort(f"abort-{mode}-1")
                finished["1"] = list(aborted.outputs[0].token_ids)
        assert llm.stats()["kv_blocks_used"] == 0
        results[mode] = finished
    assert results[True]["0"] == results[False]["0"] and results[True]["2"] == results[False]["2"]
    complete = outputs(engines[False], prompts[1:2], params[1:2])[0][0][0]
    assert results[True]["1"] == complete[: len(results[True]["1"])] and len(results[True]["1"]) < 24
