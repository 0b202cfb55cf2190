"""Maximum context vs context_parallel_size at a fixed per-device KV budget.

For each C, an engine whose KV pool holds --blocks-per-device blocks on each
of its C devices (num_kv_blocks = C x that) reports its maximum context
(`stats()["max_context_len"]`: every device's blocks, less the null block),
then serves one prompt that fills it (maximum context - max_tokens tokens)
with greedy decoding. Each run's tokens and top logprobs are compared with a
single-device engine whose pool is big enough for every prompt (the
reference: paged attention, no ring). Times are wall-clock on this machine;
on CPU with virtual devices they say nothing about GPU speed.

Needs C devices: on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8.
Run: python scripts/bench_context_parallel.py [--model DIR] [--sizes 1 2 4 8] [--blocks-per-device 256]
Without --model it builds the tiny random llama_ring checkpoint of the tests.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ from a plain checkout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--blocks-per-device", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()

    from jaxinfer import LLM, SamplingParams

    model = args.model
    if model is None:
        from tests.tiny_models import make_hf_model, save_hf_model

        model = save_hf_model(make_hf_model("llama_ring", seed=3), tempfile.mkdtemp())
    engine = dict(block_size=args.block_size, max_num_seqs=1, max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=3)
    longest = max(args.sizes) * args.blocks_per_device * args.block_size
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, JAX {jax.__version__}, "
          f"{jax.devices()[0].platform} x {jax.device_count()}; {args.blocks_per_device} blocks of "
          f"{args.block_size} tokens per device")
    start = time.perf_counter()
    reference = LLM(model, progress=False, max_model_len=longest, num_kv_blocks=longest // args.block_size + 2,
                    **engine)
    print(f"reference engine (1 device, {longest // args.block_size + 2} blocks) ready in "
          f"{time.perf_counter() - start:.1f}s")
    rng = np.random.default_rng(0)
    vocab = reference.model.config.vocab_size
    print("| C | blocks per device | maximum context (tokens) | x one device | prompt | start-up (s) | generate (s) "
          "| reference generate (s) | tokens equal | max abs logprob diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    base = None
    for c in args.sizes:
        start = time.perf_counter()
        options = dict(context_parallel_size=c) if c > 1 else {}
        llm = LLM(model, progress=False, max_model_len=longest, num_kv_blocks=c * args.blocks_per_device,
                  **options, **engine)
        startup = time.perf_counter() - start
        max_context = llm.stats()["max_context_len"]
        base = base or max_context
        prompt = rng.integers(0, vocab, max_context - args.max_tokens).tolist()
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        generate = time.perf_counter() - start
        start = time.perf_counter()
        want = reference.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        ref_time = time.perf_counter() - start
        diff = max(abs(lp.logprob - want.logprobs[i][t].logprob)
                   for i, entry in enumerate(out.logprobs) for t, lp in entry.items() if t in want.logprobs[i])
        print(f"| {c} | {args.blocks_per_device} | {max_context} | {max_context / base:.2f} | {len(prompt)} | "
              f"{startup:.1f} | {generate:.1f} | {ref_time:.1f} | {out.token_ids == want.token_ids} | {diff:.1e} |",
              flush=True)
        del llm


if __name__ == "__main__":
    main()
