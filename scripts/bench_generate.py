"""Single-request generation benchmark on the default model (or --model).

Measures, in one process: time to load the model (read + dequantize + place on
device), time to compile the engine's step program for every bucket, time to
first token with warm programs, and decode tokens/s for one request. Prints a table and writes
JSON. Run: python scripts/bench_generate.py [--model M] [--dtype float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import jax


def bench(model, dtype: str, prompt: str, max_tokens: int, repeats: int) -> dict:
    from jaxinfer import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, dtype=dtype, progress=False)
    llm.wait_compiled()
    load_s = llm.model.load_seconds
    compile_s = time.perf_counter() - start - load_s  # every bucket compiled after loading
    prompt_ids = llm.tokenizer.encode(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ttfts, decode_rates = [], []
    for _ in range(repeats):
        out = llm.generate([prompt_ids], params, use_tqdm=False)[0]
        m = out.metrics
        ttfts.append(m.time_to_first_token)
        decode_rates.append(1.0 / m.time_per_output_token)
    return {
        "dtype": dtype,
        "prompt_tokens": len(prompt_ids),
        "output_tokens": max_tokens,
        "load_s": load_s,
        "compile_s": compile_s,
        "ttft_ms_median": 1e3 * statistics.median(ttfts),
        "decode_tok_s_median": statistics.median(decode_rates),
        "repeats": repeats,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="bench_generate.json")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = [bench(args.model, d, args.prompt, args.max_tokens, args.repeats) for d in args.dtype]
    device = jax.devices()[0]
    header = f"{'dtype':<9} {'load s':>7} {'compile s':>9} {'TTFT ms':>8} {'decode tok/s':>12}"
    print(f"model={args.model or 'default (SmolLM2-135M-Instruct Q4_1 GGUF)'} device={device.device_kind} commit={commit}")
    print(header)
    for r in rows:
        print(f"{r['dtype']:<9} {r['load_s']:>7.2f} {r['compile_s']:>9.2f} {r['ttft_ms_median']:>8.1f} {r['decode_tok_s_median']:>12.1f}")
    result = {
        "benchmark": "generate_single_request",
        "model": args.model or "default",
        "device": device.device_kind,
        "platform": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "jax": jax.__version__,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
