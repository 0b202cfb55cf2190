"""`jaxinfer bench throughput|latency`: synthetic offline workloads.

Throughput follows vLLM's benchmark definitions: TTFT = first token time -
arrival; TPOT = (finish - first token) / (output tokens - 1); requests/s and
tokens/s over the wall time from the first submission to the last finish.
"""

from __future__ import annotations

import json
import time

import numpy as np

from jaxinfer.sampling_params import SamplingParams


def _lengths(rng, mean: int, range_ratio: float, count: int) -> list[int]:
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return [int(n) for n in rng.integers(low, high + 1, count)]


def synthetic_requests(vocab_size, num_prompts, input_len, output_len, range_ratio=0.0, prefix_len=0,
                       seed=0, output_lens=None):
    """(prompt token ids, SamplingParams) pairs: random tokens, optional shared prefix."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab_size, prefix_len).tolist()
    inputs = _lengths(rng, input_len, range_ratio, num_prompts)
    outputs = output_lens or _lengths(rng, output_len, range_ratio, num_prompts)
    return [
        (prefix + rng.integers(0, vocab_size, n).tolist(), SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
        for n, m in zip(inputs, outputs)
    ]


def _summary(values_s: list[float]) -> dict:
    ms = np.asarray([v for v in values_s if v is not None]) * 1e3
    if ms.size == 0:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    return {"mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99))}


def _replicas(engine) -> list:
    """The LLMEngines behind llm.engine (data-parallel replicas, or the engine itself)."""
    return getattr(engine, "replicas", [engine])


class KVMemoryTracker:
    """KV-cache occupancy sampled after every step, against what a contiguous
    cache would hold for the same running batch.

    Paged: blocks in use (a block shared by several sequences counts once)
    times block_size, and the token slots those blocks leave empty.
    Contiguous: each running request reserves max_model_len slots (what a
    server that does not know output lengths must reserve), or at best
    prompt + max_tokens (an oracle that knows each request's output budget).
    """

    def __init__(self, engine):
        self.engine = engine
        self.samples: list[tuple[int, int, int, int]] = []  # (tokens, paged slots, max-len slots, oracle slots)

    def sample(self) -> None:
        engines = _replicas(self.engine)
        running = [s for e in engines for s in e.scheduler.running]
        if not running:
            return
        tokens = sum(s.num_computed_tokens for s in running)
        paged = sum(e.block_manager.num_used_blocks for e in engines) * self.engine.config.block_size
        max_len = len(running) * self.engine.config.max_model_len
        oracle = sum(len(s.prompt_token_ids) + s.params.max_tokens for s in running)
        self.samples.append((tokens, paged, max_len, oracle))

    def summary(self) -> dict:
        if not self.samples:
            return {}
        tokens, paged, max_len, oracle = np.asarray(self.samples, np.float64).sum(0)
        return {
            "steps_sampled": len(self.samples),
            "peak_blocks_used": max(p for _, p, _, _ in self.samples) // self.engine.config.block_size,
            # Averaged over steps (sums of slot-steps), so long phases weigh more.
            "paged_slots_per_token": paged / tokens,
            "paged_empty_slot_share": 1 - tokens / paged,
            "contiguous_max_len_slots_per_token": max_len / tokens,
            "contiguous_oracle_slots_per_token": oracle / tokens,
        }


def run_throughput(llm, requests) -> dict:
    llm.wait_compiled()  # no background compilation on the clock
    engine = llm.engine
    stats_before = engine.stats()
    memory = KVMemoryTracker(engine)
    start = time.perf_counter()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"bench-{start}-{i}", prompt, params)
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
        memory.sample()
    wall = time.perf_counter() - start
    stats = engine.stats()
    num_out = sum(len(o.outputs[0].token_ids) for o in finished)
    num_in = sum(len(o.prompt_token_ids) for o in finished)
    host = stats["host_time_s"] - stats_before["host_time_s"]
    device = stats["device_time_s"] - stats_before["device_time_s"]
    return {
        "num_requests": len(finished),
        "wall_s": wall,
        "requests_per_s": len(finished) / wall,
        "output_tokens_per_s": num_out / wall,
        "total_tokens_per_s": (num_in + num_out) / wall,
        "ttft": _summary([o.metrics.time_to_first_token for o in finished]),
        "tpot": _summary([o.metrics.time_per_output_token for o in finished]),
        "prefix_cache_hit_rate": (stats["prefix_cache_hits"] - stats_before["prefix_cache_hits"])
        / max(1, stats["prefix_cache_queries"] - stats_before["prefix_cache_queries"]),
        "num_preemptions": stats["num_preemptions"] - stats_before["num_preemptions"],
        "host_share_of_step_time": host / max(1e-9, host + device),
        "compilations_during_run": stats["num_compilations"] - stats_before["num_compilations"],
        "kv_memory": memory.summary(),
        **({"speculative": speculation_summary(engine, stats_before, stats)} if engine.config.speculative else {}),
    }


def speculation_summary(engine, before: dict, after: dict) -> dict:
    """Acceptance rate = accepted / proposed drafts; mean accepted length =
    tokens a sequence emits per verification step (its accepted drafts + the
    target's own token), averaged over the (sequence, step) verifications."""
    spec = engine.config.speculative
    proposed, accepted, verifications = (
        after[key] - before[key] for key in ("spec_proposed_tokens", "spec_accepted_tokens", "spec_verifications")
    )
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "proposed_tokens": proposed,
        "accepted_tokens": accepted,
        "verifications": verifications,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_length": 1 + accepted / verifications if verifications else 1.0,
    }


def run_latency(llm, batch_size: int, input_len: int, output_len: int, seed=0) -> dict:
    """One batch: time of the step(s) that prefill it, the time until every
    request has its first token, then the mean decode step."""
    llm.wait_compiled()  # no background compilation on the clock
    engine = llm.engine
    requests = synthetic_requests(llm.model.config.vocab_size, batch_size, input_len, output_len, seed=seed)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"latency-{time.perf_counter()}-{i}", prompt, params)
    prefill_steps, decode_steps, finished = [], [], []
    while engine.has_unfinished():
        prefilling = any(
            s.num_computed_tokens < len(s.prompt_token_ids)
            for e in _replicas(engine) for s in (*e.scheduler.waiting, *e.scheduler.running)
        )
        t = time.perf_counter()
        finished += [o for o in engine.step() if o.finished]
        (prefill_steps if prefilling else decode_steps).append(time.perf_counter() - t)
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        # The host's time in the prompt steps: the prefill itself where steps
        # are synchronous (CPU); with async scheduling (GPU) a step returns
        # once the next is queued, and the prefill's device time lands in the
        # first decode step. time_to_first_token_s holds either way.
        "prefill_s": float(sum(prefill_steps)),
        "prefill_steps": len(prefill_steps),
        "time_to_first_token_s": max((o.metrics.time_to_first_token or 0.0 for o in finished), default=None),
        "decode_step_ms_mean": float(np.mean(decode_steps) * 1e3) if decode_steps else None,
        # With async scheduling the first decode step also waits for the last
        # prompt step still on the device: the median leaves that one out.
        "decode_step_ms_median": float(np.median(decode_steps) * 1e3) if decode_steps else None,
        "decode_tokens_per_s": batch_size / float(np.mean(decode_steps)) if decode_steps else None,
    }


def print_and_save(title: str, result: dict, json_path: str | None) -> None:
    print(title)
    for key, value in result.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items())
        elif isinstance(value, float):
            value = f"{value:.3f}"
        print(f"  {key:<28} {value}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {json_path}")
