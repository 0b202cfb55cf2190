"""Start-up time: from a fresh Python process to the first generated token.

Each measurement is its own process (`python -c`), so imports, loading and
compilation all count, as they do for a user. Three cache states, one after
the other in the same cache directory: "cold" (empty: no compiled program and
no native CPU kernel built yet), "warm, 2nd run" (what the cold run stored: it
exits right after its first token, stopping the background compilation, so
only the programs compiled by then) and "warm" (everything: the 2nd run waits
for its background compilation before it exits).
Configurations are interleaved round by round, so drift of the VM hits all
of them alike; medians are printed and every run goes to JSON.

Each `--config LABEL=TREE[;LLM KEYWORDS]` is a source tree to import
jaxinfer from (e.g. a `git worktree` of an older commit, for before/after in
one run) and optional extra LLM() keywords:

    python scripts/bench_startup.py --config "before=/tmp/old" --config "after=." \
        --config "after, all compiled first=.;warmup='all'" --rounds 3 --json startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import time
start = time.perf_counter()
from jaxinfer import LLM, SamplingParams
imported = time.perf_counter()
llm = LLM(progress=False{options})
ready = time.perf_counter()
llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
first = time.perf_counter()
print("RESULT", imported - start, ready - start, first - start, flush=True)
if {finish}:
    llm.wait_compiled()
"""
STATES = ("cold", "warm, 2nd run", "warm")


def run_child(tree: str, cache_dir: str, keywords: str, finish: bool) -> dict:
    # The native CPU kernels' build cache lives in the same directory: "cold" is a
    # machine's very first run, with nothing compiled by XLA or by g++.
    env = dict(os.environ, JAXINFER_CACHE_DIR=cache_dir, JAXINFER_KERNEL_CACHE_DIR=os.path.join(cache_dir, "kernels"),
               PYTHONPATH=os.path.abspath(tree))
    env.pop("JAXINFER_DISABLE_COMPILATION_CACHE", None)
    out = subprocess.run([sys.executable, "-c", CHILD.format(options=keywords, finish=finish)], env=env, cwd=tree,
                         capture_output=True, text=True, check=True)
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT"))
    imported, ready, first = (float(x) for x in line.split()[1:])
    return {"import_s": imported, "llm_ready_s": ready, "first_token_s": first}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=None,
                        help="LABEL=TREE[;KEYWORDS] (repeatable; default: this tree, default options)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    configs = {}
    for config in args.config or ["this=."]:
        label, rest = config.split("=", 1)
        tree, _, keywords = rest.partition(";")
        configs[label] = (tree, f", {keywords}" if keywords else "")
    runs = []
    for round_ in range(args.rounds):
        for label, (tree, keywords) in configs.items():
            with tempfile.TemporaryDirectory() as cache:
                for state in STATES:
                    result = run_child(tree, cache, keywords, finish=state == "warm, 2nd run")
                    runs.append({"config": label, "cache": state, "round": round_, **result})
                    print(f"round {round_} {label} {state}: first token {result['first_token_s']:.2f} s", flush=True)
    width = max(len(label) for label in configs)
    print(f"\n{'config':>{width}} {'cache':>13} {'import s':>9} {'LLM() s':>8} {'first token s':>14}")
    summary = []
    for label in configs:
        for state in STATES:
            mine = [r for r in runs if r["config"] == label and r["cache"] == state]
            med = {k: statistics.median(r[k] for r in mine) for k in ("import_s", "llm_ready_s", "first_token_s")}
            summary.append({"config": label, "cache": state, **med})
            print(f"{label:>{width}} {state:>13} {med['import_s']:>9.2f} {med['llm_ready_s']:>8.2f} "
                  f"{med['first_token_s']:>14.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median": summary, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
