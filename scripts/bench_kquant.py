"""K-quant files against llama.cpp on CPU, in one run: decode at batch 1 and
batch 32, prefill, and the bytes a decode step reads against the file's.

For each --models file (scripts/make_kquant_gguf.py writes one per llama.cpp
mix), jaxinfer loads it once per --schemes entry ("gguf": the exact default;
"gguf-a8": int8 activations, as llama.cpp multiplies a GGUF) and then, round
after round, times every jaxinfer configuration and llama.cpp's own tools
alternately, so the (shared, drifting) VM's speed hits all alike; the
medians of the rounds are printed with the ratios.

  jaxinfer   jaxinfer.benchmark.run_latency: batch B of --prompt-len-token
             prompts, the mean decode step (B / step = tok/s), and one
             --prefill-len prompt's prefill step (its tokens / time)
  llama.cpp  `llama-bench -p PREFILL -n OUTPUT -t 1,CORES` (prefill and batch-1
             decode tok/s) and `llama-batched-bench -npp PROMPT -ntg OUTPUT
             -npl 32 -pps` (its S_TG: batch-32 decode tok/s, the 32
             sequences over one shared prompt's cache, so that their prefill
             does not take minutes), each the better of 1 and CORES threads,
             from --llama-cpp-bin, a build of llama.cpp on this machine (not a
             dependency)

Bytes: jaxinfer.bench_timing.weight_bytes_per_step (every weight a one-row
step multiplies) against the sum of the file's tensor bytes (what llama.cpp
reads for a step, the tied embedding counted once, as the head).

    python scripts/bench_kquant.py --llama-cpp-bin /tmp/llama.cpp/build/bin \\
        --models /tmp/Q4_K_M.gguf,/tmp/Q6_K.gguf --rounds 3 --json kquant.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a plain checkout

from jaxinfer import LLM, benchmark  # noqa: E402
from jaxinfer.bench_timing import weight_bytes_per_step  # noqa: E402
from jaxinfer.loading.gguf_file import GGUFFile  # noqa: E402

BLOCK_SIZE = 16


def llama_bench(bin_dir: str, model: str, threads: int, prefill: int, output: int) -> dict:
    """Prefill and batch-1 decode tok/s: the better of 1 thread and `threads`
    (on a shared VM llama.cpp's threads wait for each other at every
    operation's barrier, and one descheduled thread stalls the step: 2
    threads decoded the default model at 3 tok/s where 1 thread gave 49)."""
    counts = ",".join(sorted({"1", str(threads)}))
    out = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", model, "-t", counts, "-p", str(prefill),
                          "-n", str(output), "-r", "2", "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    prefill = max(r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    decode = max(r["avg_ts"] for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return {"prefill": prefill, "b1": decode}


def llama_batched(bin_dir: str, model: str, threads: int, prompt: int, output: int, batch: int) -> float:
    """Batch-`batch` decode tok/s (S_TG): the better of 1 thread and `threads`, as llama_bench."""
    return max(_llama_batched(bin_dir, model, t, prompt, output, batch) for t in sorted({1, threads}))


def _llama_batched(bin_dir: str, model: str, threads: int, prompt: int, output: int, batch: int) -> float:
    out = subprocess.run([os.path.join(bin_dir, "llama-batched-bench"), "-m", model, "-t", str(threads),
                          "-c", str(prompt + batch * output + 64), "-b", "2048", "-ub", "512", "-npp", str(prompt),
                          "-ntg", str(output), "-npl", str(batch), "-pps"], capture_output=True, text=True, check=True)
    # The table's row: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2] == str(batch) and re.fullmatch(r"[\d.]+", cells[7]):
            return float(cells[7])
    raise RuntimeError(f"no batch-{batch} row in llama-batched-bench's output:\n{out.stdout[-2000:]}")


def file_tensor_bytes(path: str) -> int:
    return sum(int(t.data.nbytes) for t in GGUFFile(path).tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", required=True, help="comma-separated .gguf files")
    parser.add_argument("--llama-cpp-bin", required=True, help="folder with llama-bench and llama-batched-bench")
    parser.add_argument("--schemes", default="gguf,gguf-a8")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    threads = os.cpu_count() or 1
    results = {}
    for model in args.models.split(","):
        name = os.path.basename(model)
        blocks = math.ceil((args.prompt_len + args.output_len) / BLOCK_SIZE) + 1
        llms = {s: LLM(model, quantization=s, max_num_seqs=args.batch, progress=False, enable_prefix_caching=False,
                       max_num_batched_tokens=max(args.prefill_len, 256),
                       max_model_len=args.prompt_len + args.output_len + args.prefill_len,
                       num_kv_blocks=1 + max(args.batch * blocks, args.prefill_len // BLOCK_SIZE + 2))
                for s in args.schemes.split(",")}
        entry = {"file_tensor_bytes": file_tensor_bytes(model),
                 "bytes_per_step": {s: weight_bytes_per_step(llm.model.params) for s, llm in llms.items()},
                 "rounds": []}
        print(f"{name}: file tensors {entry['file_tensor_bytes'] / 1e6:.1f} MB, a decode step reads "
              + ", ".join(f"{s} {b / 1e6:.1f} MB" for s, b in entry["bytes_per_step"].items()), flush=True)
        for llm in llms.values():  # warm: every bucket compiled
            benchmark.run_latency(llm, 1, args.prompt_len, 4)
            benchmark.run_latency(llm, args.batch, args.prompt_len, 4)
        for round_index in range(args.rounds):
            row = {}
            for s, llm in llms.items():
                row[f"{s} b1"] = benchmark.run_latency(llm, 1, args.prompt_len, args.output_len)["decode_tokens_per_s"]
                row[f"{s} b{args.batch}"] = benchmark.run_latency(llm, args.batch, args.prompt_len,
                                                                  args.output_len)["decode_tokens_per_s"]
                prefill = benchmark.run_latency(llm, 1, args.prefill_len, 2)
                row[f"{s} prefill"] = args.prefill_len / prefill["prefill_s"]
            cpp = llama_bench(args.llama_cpp_bin, model, threads, args.prefill_len, args.output_len)
            row["llama.cpp b1"], row["llama.cpp prefill"] = cpp["b1"], cpp["prefill"]
            row[f"llama.cpp b{args.batch}"] = llama_batched(args.llama_cpp_bin, model, threads, args.prompt_len,
                                                           args.output_len, args.batch)
            entry["rounds"].append(row)
            print(f"  round {round_index}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
        medians = {k: statistics.median(r[k] for r in entry["rounds"]) for k in entry["rounds"][0]}
        entry["medians"] = medians
        for s in llms:
            ratios = {w: statistics.median(r[f"{s} {w}"] / r[f"llama.cpp {w}"] for r in entry["rounds"])
                      for w in ("b1", f"b{args.batch}", "prefill")}
            entry.setdefault("ratios", {})[s] = ratios
            print(f"  {s}: " + ", ".join(f"{w} {medians[f'{s} {w}']:.1f} tok/s = {ratios[w]:.2f}x llama.cpp "
                                         f"({medians[f'llama.cpp {w}']:.1f})" for w in ratios), flush=True)
        results[name] = entry
        del llms
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_kquant", "threads": threads, "args": vars(args), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
