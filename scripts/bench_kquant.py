"""K-quant files against llama.cpp on CPU, in one run: decode at batch 1 and
batch 32, prefill, a user's batch-1 generate end to end, the start of a fresh
process to its first token and its peak memory, and the bytes a decode step
reads against the file's.

For each --models file (scripts/make_kquant_gguf.py writes one per llama.cpp
mix), jaxinfer loads it once per --schemes entry ("gguf": the exact default;
"gguf-a8": int8 activations, as llama.cpp multiplies a GGUF) and then, round
after round, times every jaxinfer configuration and llama.cpp's own tools
alternately, so the (shared, drifting) VM's speed hits all alike; the
medians of the rounds are printed in one table per file, with the ratios
(each the median of the rounds' ratios). Both engines get the same context,
--ctx (jaxinfer's max_model_len, llama.cpp's -c where the tool takes one).

  jaxinfer   jaxinfer.benchmark.run_latency: batch B of --prompt-len-token
             prompts, the mean decode step (B / step = tok/s), and one
             --prefill-len prompt's prefill step (its tokens / time);
             end to end: LLM.generate of one --prompt-len-token prompt to
             --output-len greedy tokens, output tokens / wall time (prefill,
             scheduling and detokenizing included)
  llama.cpp  `llama-bench -p PREFILL -n OUTPUT -pg PROMPT,OUTPUT -t 1,CORES`
             (prefill and batch-1 decode tok/s; end to end from the -pg test:
             its OUTPUT tokens over the time of PROMPT + OUTPUT) and
             `llama-batched-bench -npp PROMPT -ntg OUTPUT -npl 32 -pps` (its
             S_TG: batch-32 decode tok/s, the 32 sequences over one shared
             prompt's cache, so that their prefill does not take minutes),
             each the better of 1 and CORES threads, from --llama-cpp-bin, a
             build of llama.cpp on this machine (not a dependency)

Start, as a user runs each engine: a fresh process, timed by this script from
its spawn to the first generated token reaching its stdout, and its peak RSS
(GNU time's %M, /usr/bin/time: the process or the largest of its children).
jaxinfer: `python -c` that imports jaxinfer, builds `LLM(model,
max_model_len=CTX)` (the default scheme), generates one greedy token of
"Hello, my name is" (then prints a marker line: the first token), then
--start-tokens more. "warm" runs with the user's caches filled by a warm-up
start (compiled programs, native kernels, the prepared GGUF params);
"empty caches" with fresh JAXINFER_CACHE_DIR and JAXINFER_KERNEL_CACHE_DIR
(a first-time user; skip with --no-cold-start). llama.cpp: `llama-completion
-m FILE -c CTX -n START_TOKENS -t T -p "Hello, my name is" --temp 0 -no-cnv`,
T the thread count of the round's faster llama-bench decode; it keeps no cache between runs, so one number stands for
both; the file is in the page cache for both engines.

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
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a plain checkout

from jaxinfer import LLM, SamplingParams, benchmark  # noqa: E402
from jaxinfer.bench_timing import weight_bytes_per_step  # noqa: E402
from jaxinfer.loading.gguf_file import GGUFFile  # noqa: E402

BLOCK_SIZE = 16
START_PROMPT = "Hello, my name is"
FIRST_TOKEN = "FIRST-TOKEN"  # the jaxinfer child's line once its first token is out

JAXINFER_START = r"""
import json, logging, sys, time
start = time.perf_counter()
prepared = []  # what the prepared-params cache (jaxinfer/loading/prepared_cache.py) says
logging.getLogger("jaxinfer.loading.prepared_cache").addHandler(logging.Handler())
logging.getLogger("jaxinfer.loading.prepared_cache").handlers[-1].emit = lambda r: prepared.append(r.getMessage())
logging.getLogger("jaxinfer.loading.prepared_cache").setLevel(logging.INFO)
from jaxinfer import LLM, SamplingParams
from jaxinfer.utils import source_fingerprint
imported = time.perf_counter()
llm = LLM(sys.argv[1], max_model_len=int(sys.argv[2]), progress=False)
ready = time.perf_counter()
llm.generate([sys.argv[3]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
first = time.perf_counter()
print("%s", flush=True)
out = llm.generate([sys.argv[3]], SamplingParams(temperature=0, max_tokens=int(sys.argv[4]), ignore_eos=True),
                   use_tqdm=False)
print(json.dumps({"quantization": llm.model.quantization, "tokens": len(out[0].outputs[0].token_ids),
                  "import_s": imported - start, "llm_s": ready - imported, "generate_1_s": first - ready,
                  "prepared": "hit" if any("read from" in m for m in prepared) else "miss",
                  "source_fingerprint": source_fingerprint()}), flush=True)
llm.wait_compiled()
""" % FIRST_TOKEN


def timed_start(command: list[str], env: dict | None, first_token) -> dict:
    """Runs `command` to its end: seconds from its spawn until its stdout so
    far satisfies first_token(bytes), peak RSS (MB) and its stdout. Read as it
    comes, not by lines: llama.cpp writes its tokens without a newline. The
    peak is GNU time's (%M: the command's ru_maxrss, its waited-for children
    included): this process's own child would report at least this process's
    RSS, which the kernel carries across fork and exec."""
    with tempfile.TemporaryFile() as errors, tempfile.NamedTemporaryFile("r") as peak:
        start = time.perf_counter()
        process = subprocess.Popen(["/usr/bin/time", "-f", "%M", "-o", peak.name, *command], env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors)
        first, out = None, b""
        while chunk := os.read(process.stdout.fileno(), 65536):
            out += chunk
            if first is None and first_token(out):
                first = time.perf_counter() - start
        process.stdout.close()
        if process.wait() or first is None:
            errors.seek(0)
            raise RuntimeError(f"{command[:3]}: exit {process.returncode}, first token {first}\n"
                               f"{out.decode(errors='replace')[-2000:]}\n"
                               f"{errors.read().decode(errors='replace')[-3000:]}")
        peak_kb = int(peak.read().split()[-1])
    return {"first_token_s": first, "peak_rss_mb": peak_kb / 1024, "stdout": out.decode(errors="replace")}


def jaxinfer_start(model: str, ctx: int, tokens: int, cache_dir: str | None) -> dict:
    """A user's `LLM(model, max_model_len=ctx)` in a fresh process; cache_dir:
    where its caches go (None: the user's own, filled by an earlier start)."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env.pop("JAXINFER_DISABLE_COMPILATION_CACHE", None)
    if cache_dir:
        env.update(JAXINFER_CACHE_DIR=os.path.join(cache_dir, "xla"),
                   JAXINFER_KERNEL_CACHE_DIR=os.path.join(cache_dir, "kernels"))
    result = timed_start([sys.executable, "-c", JAXINFER_START, model, str(ctx), START_PROMPT, str(tokens)], env,
                         lambda out: f"\n{FIRST_TOKEN}\n".encode() in b"\n" + out)
    result.update(json.loads(result.pop("stdout").splitlines()[-1]))
    return result


def llama_start(bin_dir: str, model: str, ctx: int, tokens: int, threads: int) -> dict:
    """llama-completion as a user runs it, on `threads` threads (llama-bench's
    faster count this round: its default, all cores, can decode 30x slower on
    a shared VM, see llama_bench), greedy, the prompt not echoed, so its first
    stdout byte is the first token; special tokens printed and end-of-text
    ignored, so that every token shows."""
    result = timed_start([os.path.join(bin_dir, "llama-completion"), "-m", model, "-c", str(ctx), "-n", str(tokens),
                          "-t", str(threads), "-p", START_PROMPT, "--temp", "0", "-no-cnv", "--no-display-prompt",
                          "--special", "--ignore-eos"], None, lambda out: bool(out))
    result.update(threads=threads, tokens=result.pop("stdout"))
    return result


def llama_bench(bin_dir: str, model: str, threads: int, prefill: int, prompt: int, output: int) -> dict:
    """Prefill, batch-1 decode and end-to-end batch-1 tok/s (`prompt` tokens
    then `output`, the output tokens over the whole time): the better of 1
    thread and `threads` (on a shared VM llama.cpp's threads wait for each
    other at every operation's barrier, and one descheduled thread stalls the
    step: 2 threads decoded the default model at 3 tok/s where 1 thread gave
    49)."""
    counts = ",".join(sorted({"1", str(threads)}))
    out = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", model, "-t", counts, "-p", str(prefill),
                          "-n", str(output), "-pg", f"{prompt},{output}", "-r", "2", "-o", "json"],
                         capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    prefill = max(r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    decode = max((r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0), key=lambda r: r["avg_ts"])
    # the -pg row's avg_ts counts its prompt and output tokens over the time
    both = max(r["avg_ts"] for r in rows if r["n_gen"] > 0 and r["n_prompt"] > 0)
    return {"prefill": prefill, "b1": decode["avg_ts"], "e2e b1": both * output / (prompt + output),
            "b1 threads": decode["n_threads"]}


def jaxinfer_generate(llm, prompt: int, output: int) -> float:
    """LLM.generate of one `prompt`-token prompt to `output` greedy tokens:
    output tokens / seconds, what a user's call gets."""
    (tokens, _), = benchmark.synthetic_requests(llm.model.config.vocab_size, 1, prompt, output)
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    llm.wait_compiled()
    start = time.perf_counter()
    out = llm.generate([tokens], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert len(out[0].outputs[0].token_ids) == output
    return output / seconds


def llama_batched(bin_dir: str, model: str, threads: int, prompt: int, output: int, batch: int, ctx: int) -> float:
    """Batch-`batch` decode tok/s (S_TG): the better of 1 thread and `threads`, as llama_bench."""
    return max(_llama_batched(bin_dir, model, t, prompt, output, batch, ctx) for t in sorted({1, threads}))


def _llama_batched(bin_dir: str, model: str, threads: int, prompt: int, output: int, batch: int, ctx: int) -> float:
    out = subprocess.run([os.path.join(bin_dir, "llama-batched-bench"), "-m", model, "-t", str(threads),
                          "-c", str(max(ctx, prompt + batch * output + 64)), "-b", "2048", "-ub", "512",
                          "-npp", str(prompt), "-ntg", str(output), "-npl", str(batch), "-pps"],
                         capture_output=True, text=True, check=True)
    # The table's row: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2] == str(batch) and re.fullmatch(r"[\d.]+", cells[7]):
            return float(cells[7])
    raise RuntimeError(f"no batch-{batch} row in llama-batched-bench's output:\n{out.stdout[-2000:]}")


def file_tensor_bytes(path: str) -> int:
    return sum(int(t.data.nbytes) for t in GGUFFile(path).tensors)


WORKLOADS = ("b1", "bBATCH", "prefill", "e2e b1")
START = {"first token s": ".2f", "peak RSS MB": ".0f"}  # a start's measurements, their format


def table(entry: dict, schemes: list[str], batch: int, prefill: int, prompt: int, output: int, cold: bool) -> str:
    """The medians and each jaxinfer number's ratio to llama.cpp's, a row a measurement."""
    medians, ratios = entry["medians"], entry["ratios"]
    default = entry["start_quantization"]
    names = {"b1": "batch 1 decode tok/s", f"b{batch}": f"batch {batch} decode tok/s",
             "prefill": f"prefill {prefill} tok/s", "e2e b1": f"batch 1 end to end tok/s ({prompt} + {output})"}
    lines = ["| | " + " | ".join(f"jaxinfer {s}" for s in schemes) + " | llama.cpp |",
             "|---|" + "---:|" * (len(schemes) + 1)]
    for w, name in names.items():
        cells = [f"{medians[f'{s} {w}']:.1f} ({ratios[s][w]:.2f}x)" for s in schemes]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {medians[f'llama.cpp {w}']:.1f} |")
    for case in ("warm", "empty caches") if cold else ("warm",):
        for metric, form in START.items():
            key = f"start {case} {metric}"
            cells = [f"{medians[f'{s} {key}']:{form}} ({ratios[s][key]:.2f}x)" if s == default else "-"
                     for s in schemes]
            lines.append(f"| start ({case}): {metric} | " + " | ".join(cells)
                         + f" | {medians[f'llama.cpp start {metric}']:{form}} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", required=True, help="comma-separated .gguf files")
    parser.add_argument("--llama-cpp-bin", required=True,
                        help="folder with llama-bench, llama-batched-bench and llama-completion")
    parser.add_argument("--schemes", default="gguf,gguf-a8")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--ctx", type=int, default=4096,
                        help="context of both engines: jaxinfer's max_model_len, llama.cpp's -c")
    parser.add_argument("--start-tokens", type=int, default=16,
                        help="greedy tokens a start generates after its first")
    parser.add_argument("--no-cold-start", dest="cold_start", action="store_false",
                        help="skip jaxinfer's start with empty caches (a first-time user's; the slowest part)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    threads = os.cpu_count() or 1
    schemes = args.schemes.split(",")
    batch_key = f"b{args.batch}"
    workloads = [w.replace("bBATCH", batch_key) for w in WORKLOADS]
    cases = ("warm", "empty caches") if args.cold_start else ("warm",)
    results = {}
    for model in args.models.split(","):
        name = os.path.basename(model)
        started = time.perf_counter()
        blocks = math.ceil((args.prompt_len + args.output_len) / BLOCK_SIZE) + 1
        llms = {s: LLM(model, quantization=s, max_num_seqs=args.batch, progress=False, enable_prefix_caching=False,
                       max_num_batched_tokens=max(args.prefill_len, 256),
                       max_model_len=max(args.ctx, args.prompt_len + args.output_len, args.prefill_len + 2),
                       num_kv_blocks=1 + max(args.batch * blocks, args.prefill_len // BLOCK_SIZE + 2))
                for s in schemes}
        entry = {"file_tensor_bytes": file_tensor_bytes(model),
                 "bytes_per_step": {s: weight_bytes_per_step(llm.model.params) for s, llm in llms.items()},
                 "rounds": [], "start_runs": []}
        print(f"{name}: file tensors {entry['file_tensor_bytes'] / 1e6:.1f} MB, a decode step reads "
              + ", ".join(f"{s} {b / 1e6:.1f} MB" for s, b in entry["bytes_per_step"].items()), flush=True)
        for llm in llms.values():  # warm: every bucket compiled
            benchmark.run_latency(llm, 1, args.prompt_len, 4)
            benchmark.run_latency(llm, args.batch, args.prompt_len, 4)
            jaxinfer_generate(llm, args.prompt_len, 4)
        # fills the user's caches for the warm starts
        warmup = jaxinfer_start(model, args.ctx, args.start_tokens, None)
        default, fingerprint = warmup["quantization"], warmup["source_fingerprint"]
        entry["start_quantization"] = default
        if default not in llms:
            raise SystemExit(f"LLM({name}) loads {default!r}, not in --schemes {args.schemes}: its start has no column")
        for round_index in range(args.rounds):
            row, starts = {}, {}
            for s, llm in llms.items():
                row[f"{s} b1"] = benchmark.run_latency(llm, 1, args.prompt_len, args.output_len)["decode_tokens_per_s"]
                row[f"{s} {batch_key}"] = benchmark.run_latency(llm, args.batch, args.prompt_len,
                                                                args.output_len)["decode_tokens_per_s"]
                prefill = benchmark.run_latency(llm, 1, args.prefill_len, 2)
                row[f"{s} prefill"] = args.prefill_len / prefill["prefill_s"]
                row[f"{s} e2e b1"] = jaxinfer_generate(llm, args.prompt_len, args.output_len)
            starts["warm"] = jaxinfer_start(model, args.ctx, args.start_tokens, None)
            if starts["warm"]["source_fingerprint"] != fingerprint:
                print("  warning: jaxinfer's sources changed since the last start (its caches are per source "
                      "fingerprint): this warm start was not; run from a tree nobody edits", flush=True)
            fingerprint = starts["warm"]["source_fingerprint"]
            if args.cold_start:
                with tempfile.TemporaryDirectory() as empty:
                    starts["empty caches"] = jaxinfer_start(model, args.ctx, args.start_tokens, empty)
            for case, start in starts.items():
                for metric, field in zip(START, ("first_token_s", "peak_rss_mb")):
                    row[f"{default} start {case} {metric}"] = start[field]
            cpp = llama_bench(args.llama_cpp_bin, model, threads, args.prefill_len, args.prompt_len, args.output_len)
            for w in ("b1", "prefill", "e2e b1"):
                row[f"llama.cpp {w}"] = cpp[w]
            row[f"llama.cpp {batch_key}"] = llama_batched(args.llama_cpp_bin, model, threads, args.prompt_len,
                                                         args.output_len, args.batch, args.ctx)
            starts["llama.cpp"] = llama_start(args.llama_cpp_bin, model, args.ctx, args.start_tokens,
                                              cpp["b1 threads"])
            for metric, field in zip(START, ("first_token_s", "peak_rss_mb")):
                row[f"llama.cpp start {metric}"] = starts["llama.cpp"][field]
            entry["rounds"].append(row)
            entry["start_runs"].append(starts)
            print(f"  round {round_index}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
        medians = {k: statistics.median(r[k] for r in entry["rounds"]) for k in entry["rounds"][0]}
        entry["medians"] = medians
        for s in llms:
            keys = [(w, w) for w in workloads]
            if s == default:  # the start's ratios: jaxinfer's time or memory over llama.cpp's
                keys += [(f"start {case} {metric}", f"start {metric}") for case in cases for metric in START]
            entry.setdefault("ratios", {})[s] = {
                key: statistics.median(r[f"{s} {key}"] / r[f"llama.cpp {cpp_key}"] for r in entry["rounds"])
                for key, cpp_key in keys}
        entry["seconds"] = time.perf_counter() - started
        print(f"\n{name}, medians of {args.rounds} rounds, context {args.ctx} "
              f"(ratio: jaxinfer / llama.cpp, the median of the rounds'; {entry['seconds']:.0f} s):")
        print(table(entry, schemes, args.batch, args.prefill_len, args.prompt_len, args.output_len, args.cold_start),
              flush=True)
        results[name] = entry
        del llms
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_kquant", "threads": threads, "args": vars(args), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
