"""Time to first token with and without prefix caching, for prompts that share
a long prefix (a system prompt, a document being asked several questions).

Two engines on the same model in one process, one with the prefix cache and
one without, serve the same requests one at a time, alternating, so both see
the same machine noise. Each request is the shared prefix plus a distinct
suffix; the cached engine computes the prefix once (its "cold" request) and
then only the suffix. Prints a table and writes JSON.

Run: python scripts/bench_prefix_cache.py [--model M] [--prefix-len 1024] [--suffix-len 32]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess

import jax
import numpy as np


def ttft_ms(llm, prompt_ids) -> tuple[float, int]:
    from jaxinfer import SamplingParams

    out = llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    return 1e3 * out.metrics.time_to_first_token, out.num_cached_tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="per-step token budget (a prompt longer than it is prefilled in chunks)")
    parser.add_argument("--json", default="bench_prefix_cache.json")
    args = parser.parse_args()

    from jaxinfer import LLM

    options = dict(dtype=args.dtype, progress=False, max_model_len=args.prefix_len + args.suffix_len + 16,
                   max_num_batched_tokens=args.max_num_batched_tokens)
    engines = {
        "prefix cache on": LLM(args.model, enable_prefix_caching=True, **options),
        "prefix cache off": LLM(args.model, enable_prefix_caching=False, **options),
    }
    for llm in engines.values():
        llm.wait_compiled()  # every bucket compiled before any timing
    vocab = next(iter(engines.values())).model.config.vocab_size
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, vocab, args.prefix_len).tolist()
    # Request 0 is the cached engine's cold request: it fills the cache.
    prompts = [prefix + rng.integers(0, vocab, args.suffix_len).tolist() for _ in range(args.num_requests + 1)]
    times = {name: [] for name in engines}
    cached_tokens = {name: [] for name in engines}
    for prompt in prompts:
        for name, llm in engines.items():
            ms, cached = ttft_ms(llm, prompt)
            times[name].append(ms)
            cached_tokens[name].append(cached)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = jax.devices()[0]
    rows = []
    for name in engines:
        warm = times[name][1:]
        rows.append({
            "engine": name,
            "cold_ttft_ms": times[name][0],
            "warm_ttft_ms_median": statistics.median(warm),
            "warm_ttft_ms_min": min(warm),
            "warm_cached_tokens": statistics.median(cached_tokens[name][1:]),
        })
    on, off = rows
    speedup = off["warm_ttft_ms_median"] / on["warm_ttft_ms_median"]
    print(f"prefix {args.prefix_len} + suffix {args.suffix_len} tokens, {args.num_requests} warm requests each, "
          f"{device.platform} ({device.device_kind}), commit {commit}")
    print(f"{'engine':<18} {'cold TTFT ms':>13} {'warm TTFT ms (median)':>22} {'cached tokens':>14}")
    for r in rows:
        print(f"{r['engine']:<18} {r['cold_ttft_ms']:>13.1f} {r['warm_ttft_ms_median']:>22.1f} "
              f"{r['warm_cached_tokens']:>14.0f}")
    print(f"warm TTFT speedup from the prefix cache: {speedup:.2f}x")
    result = {
        "config": vars(args), "commit": commit, "device": f"{device.platform} {device.device_kind}",
        "host": platform.processor() or platform.machine(), "jax": jax.__version__,
        "rows": rows, "warm_ttft_speedup": speedup, "raw_ttft_ms": times,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
