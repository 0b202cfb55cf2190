"""The engine: continuous batching, chunked prefill, preemption, prefix
caching and bucketed compilation, checked against one-request-at-a-time
uncached forwards of the same model."""

import gc
import threading

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.errors import RequestError
from tests.tiny_models import make_hf_model, save_hf_model

SMALL_ENGINE = dict(max_model_len=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_hf_model(make_hf_model("llama", seed=21), tmp_path_factory.mktemp("engine")))


@pytest.fixture(scope="module")
def workload():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, int(n)).tolist() for n in rng.integers(1, 60, 32)]
    max_tokens = [int(m) for m in rng.integers(1, 20, 32)]
    return prompts, max_tokens


@pytest.fixture(scope="module")
def reference(tiny_dir, workload):
    """Greedy tokens from uncached full-sequence forwards, one request at a time."""
    llm = LLM(tiny_dir, progress=False, **SMALL_ENGINE)
    expected = []
    for prompt, n in zip(*workload):
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(int(llm.model.logits(tokens)[-1].argmax()))
        expected.append(tokens[len(prompt):])
    return expected


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize(
    "options",
    [
        dict(SMALL_ENGINE),  # chunked prefill: 32-token budget, prompts up to 59
        dict(SMALL_ENGINE, num_kv_blocks=24),  # 23 usable blocks of 4 tokens: forces preemption
        dict(SMALL_ENGINE, scheduling_policy="static"),
        dict(SMALL_ENGINE, enable_prefix_caching=False),
    ],
    ids=["chunked", "preemption", "static", "no-prefix-cache"],
)
def test_batched_equals_sequential(tiny_dir, workload, reference, options):
    llm = LLM(tiny_dir, progress=False, **options)
    prompts, max_tokens = workload
    outputs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    for out, expected in zip(outputs, reference):
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].finish_reason == "length"
    stats = llm.stats()
    if options.get("num_kv_blocks"):
        assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_used"] == 0  # everything freed at the end
    # Every step ran in a bucket of the grid (compiled on demand), no shape outside it.
    assert stats["num_compilations_off_grid"] == 0
    assert 0 < stats["num_compilations"] <= len(llm.engine.runner.programs())


def hold_background_compile(monkeypatch) -> threading.Event:
    """Hold the background warm-up before it compiles anything, until the returned event is set."""
    gate = threading.Event()
    compile_buckets = ModelRunner._compile

    def held_until_gate(self, buckets, calls, progress=False, stop=None):
        if stop is not None:  # the background thread's call
            gate.wait()
        return compile_buckets(self, buckets, calls, progress, stop)

    monkeypatch.setattr(ModelRunner, "_compile", held_until_gate)
    return gate


def test_a_dropped_engine_compiles_nothing_more(tiny_dir, monkeypatch):
    """The background warm-up of an engine no one holds stops: the programs
    it had left are not compiled (they would take the cores from whatever
    runs next)."""
    gate = hold_background_compile(monkeypatch)
    llm = LLM(tiny_dir, progress=False, warmup="background", **SMALL_ENGINE)
    runner = llm.engine.runner
    compiled = runner.num_compilations
    assert runner.compiling and runner.num_pending > 0
    del llm
    gc.collect()
    gate.set()
    runner.wait_compiled()  # the thread has ended
    assert not runner.compiling and runner.num_compilations == compiled and runner.num_pending > 0


def test_serves_a_short_request_while_the_rest_compile(tiny_dir, workload, reference, monkeypatch):
    """background_compile: the engine serves as soon as each layout's
    smallest bucket has its forward and greedy sampler compiled. A short
    greedy request runs in those buckets with the reference's tokens (no
    step compiles, none is padded into a larger bucket); one asking for
    logprobs waits for its full sampler, one that samples for the
    conditional sampler (then its tokens are those of the same request on
    the compiled engine), and a step that no compiled bucket holds for the
    largest buckets, which the background thread compiles next; then the rest."""
    gate = hold_background_compile(monkeypatch)  # so that the steps below cannot use its buckets
    llm = LLM(tiny_dir, progress=False, warmup="background", **SMALL_ENGINE)
    runner = llm.engine.runner
    prompts, max_tokens = workload
    short = next(i for i, prompt in enumerate(prompts) if len(prompt) <= 16)
    waited = {}
    waiter = threading.Thread(target=lambda: waited.setdefault("bucket", runner.bucket(8, 8)))
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=max_tokens[short], ignore_eos=True, logprobs=2)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=max_tokens[short], ignore_eos=True)

    def ask():  # one request at a time: generate() is not for two threads at once
        for name, params in (("sampled", sampled), ("logprobs", with_logprobs)):
            waited[name] = llm.generate([prompts[short]], params, use_tqdm=False)[0].outputs[0]

    asking = threading.Thread(target=ask)
    try:
        compiled = llm.stats()["num_compilations"]
        first = [(1, 1, "decode"), (16, 8, "mixed")]
        assert compiled == len({p for b in first for p in runner.serving_programs(b)}) < len(runner.programs())
        assert runner.bucket(1, 1) == first[0] and runner.bucket(5, 1) == first[1]
        output = llm.generate([prompts[short]], greedy(max_tokens[short]), use_tqdm=False)[0]
        assert output.outputs[0].token_ids == reference[short]
        assert llm.stats()["num_compilations"] == compiled  # served without compiling
        threads = [waiter, asking]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(0.5)
        # Eight decode rows: no compiled bucket holds them yet; sampling: the
        # conditional sampler is not compiled (then logprobs: the full one).
        assert all(thread.is_alive() for thread in threads) and not waited
    finally:
        gate.set()
    for thread in threads:
        thread.join(120)
    assert waited["bucket"] == (8, 8, "decode")
    assert waited["logprobs"].token_ids == reference[short] and len(waited["logprobs"].logprobs) == max_tokens[short]
    llm.wait_compiled()
    assert llm.stats()["num_compilations"] == len(runner.programs()) and llm.stats()["num_programs_compiling"] == 0
    again = llm.generate([prompts[short]], sampled, use_tqdm=False)[0].outputs[0]
    assert waited["sampled"].token_ids == again.token_ids and again.token_ids != reference[short]
    outputs = llm.generate(prompts[:4], [greedy(n) for n in max_tokens[:4]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference[:4]


def test_on_demand_compiles_only_the_buckets_steps_run(tiny_dir, workload, reference):
    """warmup="on_demand": the engine serves once each layout's smallest
    bucket is compiled and compiles nothing in the background; each step
    runs in the bucket a fully compiled engine (warmup="all") runs it in,
    compiled when the step first needs it. The programs compiled are the
    first buckets' and those of the buckets the steps ran, nothing off the
    grid; tokens are the reference's and logprobs a fully compiled
    engine's, bit for bit (the same programs)."""
    prompts, max_tokens = workload
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for n in max_tokens[:10]]
    runs = {}
    for warmup in ("all", "on_demand"):
        llm = LLM(tiny_dir, progress=False, warmup=warmup, **SMALL_ENGINE)
        runner, ran = llm.engine.runner, []
        if warmup == "on_demand":
            first = runner.first_buckets()
            assert runner.num_compilations == len({p for b in first for p in runner.serving_programs(b)})
            assert not runner.compiling and llm.stats()["num_programs_compiling"] == 0
        choose = runner.bucket
        runner.bucket = lambda *args, **kw: ran.append(choose(*args, **kw)) or ran[-1]
        outputs = llm.generate(prompts[:10], params, use_tqdm=False)
        runs[warmup] = ran, outputs
        assert [o.outputs[0].token_ids for o in outputs] == reference[:10]
    assert runs["on_demand"][0] == runs["all"][0]
    for got, want in zip(runs["on_demand"][1], runs["all"][1]):
        assert [lp[t].logprob for lp, t in zip(got.outputs[0].logprobs, got.outputs[0].token_ids)] == \
            [lp[t].logprob for lp, t in zip(want.outputs[0].logprobs, want.outputs[0].token_ids)]
    forwards = {p for p in runner._executables if p[0] == "forward"}
    assert forwards == {("forward", *b) for b in first + runs["on_demand"][0]}
    assert llm.stats()["num_compilations_off_grid"] == 0 and runner.num_compilations < len(runner.programs())


def test_warmup_option_and_its_older_form(monkeypatch):
    from jaxinfer.engine.config import EngineConfig

    assert EngineConfig(max_model_len=64, background_compile=False).warmup == "all"
    assert EngineConfig(max_model_len=64, background_compile=True).warmup == "background"
    monkeypatch.setenv("JAXINFER_WARMUP", "all")
    assert EngineConfig(max_model_len=64).warmup == "all"
    monkeypatch.delenv("JAXINFER_WARMUP")
    assert EngineConfig(max_model_len=64).warmup == "background"
    with pytest.raises(ValueError, match="warmup must be one of .*'lazy'"):
        EngineConfig(max_model_len=64, warmup="lazy")


def test_seeded_sampling_independent_of_batch(tiny_dir):
    llm = LLM(tiny_dir, progress=False, **SMALL_ENGINE)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=12, seed=42, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    rng = np.random.default_rng(1)
    others = [rng.integers(0, 128, int(n)).tolist() for n in rng.integers(1, 40, 6)]
    mixed = llm.generate(
        others[:3] + [[1, 2, 3]] + others[3:],
        [SamplingParams(temperature=0.8, max_tokens=9, ignore_eos=True)] * 3 + [params]
        + [SamplingParams(temperature=1.2, max_tokens=5, ignore_eos=True)] * 3,
        use_tqdm=False,
    )
    assert mixed[3].outputs[0].token_ids == alone
    other_seed = llm.generate([[1, 2, 3]], SamplingParams(**{**params.__dict__, "seed": 43}), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_prefix_cache_hits_and_same_tokens(tiny_dir):
    prefix = list(range(10, 50))  # 40 tokens = 10 full blocks of 4
    prompts = [prefix + [1, 2], prefix + [3], prefix + [4, 5, 6]]
    cached = LLM(tiny_dir, progress=False, **SMALL_ENGINE)
    first = cached.generate([prompts[0]], greedy(6), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    rest = cached.generate(prompts[1:], greedy(6), use_tqdm=False)
    assert all(r.num_cached_tokens == 40 for r in rest)
    stats = cached.stats()
    assert stats["prefix_cache_hits"] == 80 and stats["prefix_cache_queries"] == sum(map(len, prompts))
    uncached = LLM(tiny_dir, progress=False, **dict(SMALL_ENGINE, enable_prefix_caching=False))
    plain = uncached.generate(prompts, greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in [first] + rest] == [o.outputs[0].token_ids for o in plain]
    assert all(o.num_cached_tokens == 0 for o in plain)


def test_waiting_request_counts_one_prefix_query(tiny_dir):
    """A request that waits for blocks is looked up but not admitted each step:
    it must hold no blocks meanwhile and count as one query, when admitted."""
    llm = LLM(tiny_dir, progress=False, **dict(SMALL_ENGINE, num_kv_blocks=16))  # 15 blocks = 60 tokens
    # 32 + 20 tokens = 13 blocks each, so one at a time; the first prompt fills the
    # first step's 32-token budget, so the second is not admitted with a small chunk.
    prompts = [list(range(1, 33)), list(range(33, 65))]
    outputs = llm.generate(prompts, greedy(20), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outputs)
    stats = llm.stats()
    assert stats["num_preemptions"] == 0
    assert stats["prefix_cache_queries"] == 64 and stats["prefix_cache_hits"] == 0


def test_bad_requests_fail_alone(tiny_dir):
    llm = LLM(tiny_dir, progress=False, **dict(SMALL_ENGINE, num_kv_blocks=16))
    engine = llm.engine
    engine.add_request("good", [1, 2, 3], greedy(5))
    cases = {
        "empty": ([], greedy(3), "prompt is empty"),
        "long": ([1] * 128, greedy(3), "max_model_len=128"),
        "vocab": ([1, 999], greedy(3), "outside the vocabulary"),
        "huge": ([1] * 40, greedy(80), "needs 30 KV blocks"),
    }
    for request_id, (prompt, params, match) in cases.items():
        with pytest.raises(RequestError, match=match):
            engine.add_request(request_id, prompt, params)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["good"]
    assert len(outputs[-1].outputs[0].token_ids) == 5


def test_abort_frees_blocks(tiny_dir):
    llm = LLM(tiny_dir, progress=False, **SMALL_ENGINE)
    engine = llm.engine
    engine.add_request("a", list(range(30)), greedy(50))
    engine.add_request("b", list(range(5)), greedy(3))
    engine.step()
    aborted = engine.abort("a")
    assert aborted.outputs[0].finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert llm.stats()["kv_blocks_used"] == 0


def test_parallel_sampling_n(tiny_dir):
    llm = LLM(tiny_dir, progress=False, **SMALL_ENGINE)
    out = llm.generate([list(range(20))], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # The 3 siblings reuse completion 0's 4 full prompt blocks (16 of 20 tokens).
    assert llm.stats()["prefix_cache_hits"] == 3 * 16


def test_stream_deltas_equal_generate_text(default_llm):
    params = SamplingParams(temperature=0, max_tokens=24)
    deltas = list(default_llm.stream("The capital of France is", params))
    text = default_llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].text
    assert len(deltas) > 1 and "".join(deltas) == text


def test_stats_count_running_and_waiting_requests(tiny_dir):
    """A request with n=2 counts once; requests past max_num_seqs wait."""
    llm = LLM(tiny_dir, progress=False, **dict(SMALL_ENGINE, max_num_seqs=2))
    engine = llm.engine
    engine.add_request("pair", list(range(5)), SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.add_request("later", list(range(5)), greedy(4))
    assert (llm.stats()["num_requests_running"], llm.stats()["num_requests_waiting"]) == (0, 2)
    engine.step()
    assert (llm.stats()["num_requests_running"], llm.stats()["num_requests_waiting"]) == (1, 1)
    while engine.has_unfinished():
        engine.step()
    assert (llm.stats()["num_requests_running"], llm.stats()["num_requests_waiting"]) == (0, 0)


def test_skip_special_tokens_false_keeps_them_in_text(default_llm):
    """The chat template's <|im_start|> (a special token) shows in the text only when asked."""
    tokenizer = default_llm.tokenizer
    prompt = tokenizer.encode("<|im_start|>user\\nHi<|im_end|>\\n", add_special_tokens=False)
    engine = default_llm.engine
    detokenizers = {}
    for skip in (True, False):
        # The detokenizer the engine built for this request is what turns its tokens into text.
        params = SamplingParams(temperature=0.0, max_tokens=1, skip_special_tokens=skip)
        engine.add_request(f"special-{skip}", prompt, params)
        detokenizers[skip] = engine.requests[f"special-{skip}"].sequences[0].detokenizer
        engine.abort(f"special-{skip}")
    im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert detokenizers[True].add(im_end) == "" and detokenizers[False].add(im_end) == "<|im_end|>"


def test_freed_host_memory_is_reused_without_page_faults():
    """keep_freed_host_memory (the CPU backend calls it at every engine start): a 64 MB block,
    allocated, written and freed again and again, page-faults once, not on
    every round, as the kernel's own fault counter shows. (XLA:CPU allocates
    each call's temporaries this way; glibc's default maps a fresh block
    over 32 MB per allocation.) In a subprocess: the malloc options are
    process-wide."""
    import json
    import os
    import subprocess
    import sys

    child = """
import ctypes, json, resource
from jaxinfer.backends.host_memory import keep_freed_host_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def faults_per_round(rounds=3, size=64 << 20):
    faults = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults

print(json.dumps([faults_per_round(), keep_freed_host_memory(), faults_per_round()]))
"""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True, env=env).stdout
    default, kept, after = json.loads(out)
    pages = (64 << 20) // 4096
    assert all(f > pages // 2 for f in default)  # glibc's default: a fresh mapping every round
    assert kept is True
    assert all(f < pages // 16 for f in after[1:])  # the first round grows the heap once


def test_priority_policy_runs_lower_values_first(tiny_dir):
    """scheduling_policy="priority" (vLLM's): with room for one sequence,
    requests run in order of priority, then arrival; other policies take only 0."""
    llm = LLM(tiny_dir, progress=False, **dict(SMALL_ENGINE, max_num_seqs=1, scheduling_policy="priority"))
    engine = llm.engine
    for i, priority in enumerate([5, 0, -3, 0]):
        engine.add_request(f"r{i}", [1, 2, 3], greedy(2), priority=priority)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["r2", "r1", "r3", "r0"]
