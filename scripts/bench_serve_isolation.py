"""Time to first token of a normal request while an abusive one is in flight,
against a running `jaxinfer serve` (any version).

    python scripts/bench_serve_isolation.py --url http://127.0.0.1:8000 [--repeats 3] [--json PATH]

For each abuse (none; 10**5 stop strings with n=16; 6 MB of text to
/tokenize; 64 requests with distinct JSON schemas at once) it starts the
abuse on threads, waits `--delay` seconds, then times a streamed completion
(8 greedy tokens) to its first text chunk, and reports the median over the
repeats with what the abusive requests got back (status codes). Loopback
only; every request loop is bounded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx

NORMAL = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True,
          "ignore_eos": True}


def ttft(url: str) -> float:
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=NORMAL, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or []
                if choices and choices[0].get("text"):
                    return time.perf_counter() - start
    raise RuntimeError("no text came back")


def many_stops(url):
    body = {"prompt": "Once upon a time", "max_tokens": 64, "n": 16, "ignore_eos": True,
            "stop": [f"never-{i}" for i in range(100_000)]}
    return [httpx.post(url + "/v1/completions", json=body, timeout=600).status_code]


def huge_tokenize(url):
    return [httpx.post(url + "/tokenize", json={"prompt": "hello world " * 500_000}, timeout=600).status_code]


def schema_flood(url):
    codes = []

    def one(i):
        schema = {"type": "object", "properties": {f"field_{i}_{j}": {"type": "integer"} for j in range(8)},
                  "required": [f"field_{i}_0"]}
        body = {"prompt": "JSON:", "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
            "name": f"s{i}", "schema": schema}}}
        codes.append(httpx.post(url + "/v1/completions", json=body, timeout=600).status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


ABUSES = {"none": None, "stop strings (1e5, n=16)": many_stops, "/tokenize of 6 MB": huge_tokenize,
          "64 distinct schemas": schema_flood}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ttft(args.url)  # warm
    results = {}
    for name, abuse in ABUSES.items():
        times, codes = [], []
        for _ in range(args.repeats):
            thread = None
            if abuse is not None:
                thread = threading.Thread(target=lambda: codes.extend(abuse(args.url)))
                thread.start()
                time.sleep(args.delay)
            times.append(ttft(args.url))
            if thread is not None:
                thread.join()
        statuses = {str(c): codes.count(c) for c in sorted(set(codes))}
        results[name] = {"ttft_median_s": statistics.median(times), "ttft_s": times, "abuse_statuses": statuses}
        print(f"{name:28s} TTFT median {statistics.median(times) * 1e3:9.1f} ms  {statuses}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
