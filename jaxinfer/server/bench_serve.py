"""`jaxinfer bench serve`: an async streaming client that loads a running
server and reports vLLM's serving metrics with vLLM's definitions.

Per request (streamed /v1/completions, token-id prompts so input lengths are
exact, ignore_eos so output lengths are exact):
  TTFT  = first chunk carrying tokens - send time
  ITL   = gaps between successive chunks carrying tokens (one chunk per engine step)
  TPOT  = (E2EL - TTFT) / (output tokens - 1), for requests with > 1 output token
  E2EL  = last byte - send time
Over the run: request, output and total (input + output) throughput over the
wall time from the first send to the last finish; goodput = requests per
second that met every `--goodput` SLO (ttft:MS, tpot:MS, e2el:MS).

Datasets: `random` (lengths uniform within input/output len * (1 +- range
ratio), the same generator as `bench throughput`, so both see the same
lengths for the same seed) and `shared-prefix` (G groups, each a random
prefix of --prefix-len tokens shared by its prompts, then a random suffix).
Arrivals: Poisson at --request-rate (inf: all at once), at most
--max-concurrency in flight. The server's prefix cache remembers earlier
runs' prompts: give each run of a sweep its own --seed.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from jaxinfer.benchmark import synthetic_requests

# Token ids are drawn below this, so that they are valid for any Llama-family vocabulary.
DEFAULT_VOCAB = 32000
WARMUP_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


@dataclass
class RequestResult:
    input_len: int
    output_len: int = 0
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_len < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)


def build_dataset(name: str, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                  prefix_len: int, num_prefix_groups: int, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    """[(prompt token ids, output length)]."""
    if name == "random":
        pairs = synthetic_requests(vocab_size, num_prompts, input_len, output_len, range_ratio, 0, seed)
        return [(prompt, params.max_tokens) for prompt, params in pairs]
    if name == "shared-prefix":
        out = []
        per_group = -(-num_prompts // num_prefix_groups)
        for group in range(num_prefix_groups):
            count = min(per_group, num_prompts - len(out))
            pairs = synthetic_requests(vocab_size, count, input_len, output_len, range_ratio, prefix_len,
                                       seed + group)
            out += [(prompt, params.max_tokens) for prompt, params in pairs]
        return out
    raise ValueError(f"unknown dataset {name!r}; known: random, shared-prefix")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:200', 'tpot:50'] -> {'ttft': 0.2, 'tpot': 0.05} (seconds)."""
    slos = {}
    for item in items or ():
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[key] = float(value) / 1e3
    return slos


async def _one(client: httpx.AsyncClient, url: str, body: dict, result: RequestResult) -> None:
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2el = time.perf_counter() - start
        result.ok = result.ttft is not None
    except (httpx.HTTPError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"


async def run_bench(base_url: str, model: str | None, dataset: list[tuple[list[int], int]], request_rate: float,
                    max_concurrency: int | None, api_key: str | None, seed: int = 0) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(dataset) or 1, max_keepalive_connections=None)
    url = base_url.rstrip("/") + "/v1/completions"
    rng = np.random.default_rng(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None), limits=limits) as client:
        if model is None:
            response = await client.get(base_url.rstrip("/") + "/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]

        def body(prompt, max_tokens):
            return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

        # One untimed request first: the server answers and its first request's costs are not measured.
        # Its prompt is none of the dataset's, so it leaves nothing useful in the prefix cache.
        await _one(client, url, body(WARMUP_PROMPT, 2), RequestResult(len(WARMUP_PROMPT)))
        results = [RequestResult(len(prompt)) for prompt, _ in dataset]

        async def limited(i):
            if gate is None:
                return await _one(client, url, body(*dataset[i]), results[i])
            async with gate:
                return await _one(client, url, body(*dataset[i]), results[i])

        start = time.perf_counter()
        tasks = []
        for i in range(len(dataset)):
            tasks.append(asyncio.create_task(limited(i)))
            if math.isfinite(request_rate) and i + 1 < len(dataset):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


def _stats(values_s: list[float]) -> dict:
    ms = np.asarray(values_s, np.float64) * 1e3
    if ms.size == 0:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    return {"mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    done = [r for r in results if r.ok]
    total_in = sum(r.input_len for r in done)
    total_out = sum(r.output_len for r in done)
    good = [r for r in done if all((getattr(r, key) or 0.0) <= limit for key, limit in slos.items())]
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft": _stats([r.ttft for r in done]),
        "tpot": _stats([r.tpot for r in done if r.tpot is not None]),
        "itl": _stats([gap for r in done for gap in r.itl]),
        "e2el": _stats([r.e2el for r in done]),
    }
    if slos:
        summary["goodput"] = len(good) / duration
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def print_table(title: str, summary: dict) -> None:
    rows = [("Successful requests", summary["completed"]), ("Failed requests", summary["failed"]),
            ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
            ("Total input tokens", summary["total_input_tokens"]),
            ("Total generated tokens", summary["total_output_tokens"]),
            ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}")]
    if "goodput" in summary:
        rows.append(("Request goodput (req/s)", f"{summary['goodput']:.2f}"))
    for key, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"-- {label} --", ""))
        for stat in ("mean", "median", "p99"):
            value = summary[key][f"{stat}_ms"]
            rows.append((f"{stat.capitalize()} {key.upper()} (ms)", "n/a" if value is None else f"{value:.2f}"))
    print(f"{'=' * 20} {title} {'=' * 20}")
    for label, value in rows:
        print(f"{label:<42}{value:>14}")
    if "first_error" in summary:
        print(f"first error: {summary['first_error']}")


def main(args) -> int:
    dataset = build_dataset(args.dataset, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                            args.prefix_len, args.num_prefix_groups, args.vocab_size, args.seed)
    slos = parse_goodput(args.goodput)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    results, duration = asyncio.run(run_bench(base_url, args.model, dataset, args.request_rate,
                                              args.max_concurrency, args.api_key, args.seed))
    summary = summarize(results, duration, slos)
    print_table(f"Serving Benchmark Result ({args.dataset}, rate {args.request_rate}, "
                f"concurrency {args.max_concurrency or 'unlimited'})", summary)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
        with open(args.json, "w") as f:
            json.dump({"config": config, **summary, "requests": [asdict(r) for r in results]}, f, indent=2,
                      default=str)
        print(f"wrote {args.json}")
    return 0 if summary["failed"] == 0 else 1
