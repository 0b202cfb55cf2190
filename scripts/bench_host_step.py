"""The host's share of a decode step at long contexts: what the engine does in
Python between launching steps (scheduling, step inputs, block tables,
output processing), per step, as the batch's contexts grow.

A tiny random model (the tests' llama_ring: 40,960 positions) keeps the device
work small, so the host work is what changes with the context. For each
(batch, context): prompts of `context` tokens are prefilled, then `--steps`
decode steps are timed one by one; the engine's own split (`host_time`, the
step's wall time less the time spent waiting for the device) is reported as
the median step (and the mean).
Prefix caching stays on (the default), as a user runs it.

With --draft-model the engine drafts with a draft model (the same tiny
model, 3 tokens a step, always on), whose proposer's host work is counted too.

Run: python scripts/bench_host_step.py [--batches 1 16 64] [--contexts 1024 8192 32768] [--max-model-len L]
     [--draft-model] [--json out.json]
Compare trees: run it from each tree (PYTHONPATH=<tree>) in one session.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ from a plain checkout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: the longest context timed; the model's own 40,960 is the widest block table")
    parser.add_argument("--draft-model", action="store_true", help="speculative decoding with a draft model")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from jaxinfer import LLM, SamplingParams
    from tests.tiny_models import make_hf_model, save_hf_model

    model = save_hf_model(make_hf_model("llama_ring", seed=3), tempfile.mkdtemp())
    longest = max(args.contexts) + args.steps + 16
    max_batch = max(args.batches)
    # The pool holds the longest contexts timed, whatever the table's width (--max-model-len).
    blocks = max_batch * (-(-longest // 16)) + 2
    speculative = dict(method="draft_model", model=model, num_speculative_tokens=3, disable_by_batch_size=None,
                       adaptive=False) if args.draft_model else None
    llm = LLM(model, progress=False, max_model_len=args.max_model_len or longest, num_kv_blocks=blocks,
              max_num_seqs=max_batch, max_num_batched_tokens=8192, speculative=speculative)
    llm.wait_compiled()
    engine = llm.engine
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}; tiny llama_ring, "
          f"max_model_len {engine.config.max_model_len}, {args.steps} decode steps timed"
          + (", drafting 3 tokens with a draft model" if args.draft_model else ""))
    print("| batch | context | host ms / step, median | mean | wall ms / step, median |")
    print("|---:|---:|---:|---:|---:|")
    rows = []
    rng = np.random.default_rng(0)
    for batch in args.batches:
        for context in args.contexts:
            params = SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True)
            for i in range(batch):
                prompt = rng.integers(0, 128, context).tolist()
                engine.add_request(f"{batch}-{context}-{i}", prompt, params)
            # Prefill (and the first token) untimed: step until every sequence has its first output token.
            while any(s.num_computed_tokens < len(s.prompt_token_ids) or not s.output.token_ids
                      for s in engine.scheduler.running) or engine.scheduler.waiting:
                engine.step()
            host_ms, wall_ms = [], []
            while engine.has_unfinished():
                host, start = engine.host_time, time.perf_counter()
                engine.step()
                host_ms.append((engine.host_time - host) * 1e3)
                wall_ms.append((time.perf_counter() - start) * 1e3)
            # Medians: a garbage collection or the VM's neighbours land on single steps.
            row = dict(batch=batch, context=context, steps=len(host_ms), host_ms=float(np.median(host_ms)),
                       host_ms_mean=float(np.mean(host_ms)), wall_ms=float(np.median(wall_ms)))
            print(f"| {batch} | {context} | {row['host_ms']:.3f} | {row['host_ms_mean']:.3f} | {row['wall_ms']:.3f} |",
                  flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(benchmark="host_step", commit=commit, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
