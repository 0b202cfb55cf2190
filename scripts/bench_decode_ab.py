"""Decode step time of source trees side by side: before/after a change, in one run.

Each measurement is its own process importing jaxinfer from a `--config
LABEL=TREE` source tree (e.g. a `git worktree` of an older commit), so the
trees never share a process; configurations are interleaved round by round,
so the VM's drift hits all of them alike. A child loads
LLM(quantization=Q) on the embedded default model, waits for every bucket's
compilation (a tree's first run compiles in the background), warms them, and
reports ms per decode step (--model: another model instead): the best of 2 timings of N greedy steps of B
different P-token prompts (128 unless given), minus a 1-step run of the
same prompts (so prefill does not count). Medians over rounds are printed;
every run goes to JSON.

    python scripts/bench_decode_ab.py --config "before=/tmp/before" --config "after=." \\
        --runs gguf:1:64,gguf:32:24 --rounds 3 --json ab.json

A `--runs` entry Q:B:N[:P] is quantization Q ("none" for float weights),
batch B, N decode steps, P prompt tokens (default 128); N = 0 times the
prefill instead (the prompts and their first token in one step, prefix
caching off; ms per step); a LABEL=TREE@Q1+Q2
config runs only those quantizations (a scheme the old tree lacks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time
from jaxinfer import LLM, SamplingParams
q, batch, steps, prompt_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = sys.argv[5] or None
# steps 0 times the prompts' prefill alone, every prompt token computed (no prefix cache).
llm = LLM(model, progress=False, quantization=None if q == "none" else q, max_num_seqs=max(batch, 8),
          **({} if steps else {"enable_prefix_caching": False, "max_num_batched_tokens": batch * prompt_len}))
llm.wait_compiled()  # a first run of a tree compiles its buckets in the background: not while timing
prompts = [[1 + (i * 131 + j * 7) % 40000 for j in range(prompt_len)] for i in range(batch)]

def run(n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start

run(2)
if steps == 0:
    run(1)
    print(json.dumps({"ms": 1e3 * min(run(1) for _ in range(3))}))
else:
    run(steps)  # every bucket compiled and warm
    print(json.dumps({"ms": 1e3 * min((run(steps) - run(1)) / (steps - 1) for _ in range(2))}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True, help="LABEL=TREE[@Q1+Q2] (repeatable)")
    parser.add_argument("--runs", default="gguf:1:64,gguf:32:24", help="Q:B:N entries (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="", help="a model path (default: the embedded default model)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    configs = []
    for entry in args.config:
        label, tree = entry.split("=", 1)
        tree, _, only = tree.partition("@")
        configs.append((label, os.path.abspath(tree), set(only.split("+")) if only else None))
    runs = [(q, int(b), int(n), int(rest[0]) if rest else 128)
            for q, b, n, *rest in (r.split(":") for r in args.runs.split(","))]
    results: dict = {}
    for round_index in range(args.rounds):
        for q, batch, steps, prompt_len in runs:
            for label, tree, only in configs:
                if only is not None and q not in only:
                    continue
                env = dict(os.environ, PYTHONPATH=tree)
                done = subprocess.run([sys.executable, "-c", CHILD, q, str(batch), str(steps), str(prompt_len),
                                       args.model],
                                      env=env, cwd=tree, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"{label} {q} batch {batch} failed:\n{done.stderr[-2000:]}")
                ms = json.loads(done.stdout.strip().splitlines()[-1])["ms"]
                results.setdefault(f"{label} {q} batch {batch} prompt {prompt_len}", []).append(ms)
                print(f"round {round_index} {label:>8} {q:>8} batch {batch:>3} prompt {prompt_len:>5}: "
                      f"{ms:8.2f} ms/step", flush=True)
    print(f"\n{'config':>40} {'median ms/step':>15}  rounds")
    for key, values in results.items():
        print(f"{key:>40} {statistics.median(values):15.2f}  {[round(v, 2) for v in values]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_decode_ab", "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
