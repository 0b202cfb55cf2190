"""Start-up of a GGUF on CPU: time to load, time to first token, and peak
resident memory, for the embedded default model (`LLM()`, SmolLM2-135M Q4_1)
and a K-quant file (`python scripts/make_kquant_gguf.py /tmp/kquant.gguf`).

Each measurement is a fresh process that builds `LLM(model)`, generates one
token (the first-token time), then 32 greedy tokens. A thread samples the
process's RSS (/proc/self/statm) every 5 ms, so the peak of each phase is
known, and the overall peak is checked against getrusage's ru_maxrss. The
first run of each model is a warm-up (not counted): it fills the caches a
user's second start finds (compiled programs, native kernels, a prepared
GGUF's params: loading/prepared_cache.py), so the table is a warm start;
`--cold-cache` gives every run a fresh cache directory instead, and
`--no-prepared-cache` converts the GGUF at every start (the compiled
programs still warm). Each run says whether its params came from the
prepared cache. Models are interleaved round by round; medians.

    python scripts/make_kquant_gguf.py /tmp/kquant.gguf --mix Q4_K_M
    python scripts/bench_gguf_start.py --model default --model /tmp/kquant.gguf --rounds 3 --json start.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, logging, os, resource, threading, time
start = time.perf_counter()
prepared = []  # what the prepared-params cache (jaxinfer/loading/prepared_cache.py) said
class Prepared(logging.Handler):
    def emit(self, record):
        prepared.append(record.getMessage())
logging.getLogger("jaxinfer.loading.prepared_cache").addHandler(Prepared())
logging.getLogger("jaxinfer.loading.prepared_cache").setLevel(logging.INFO)
page = os.sysconf("SC_PAGE_SIZE")
peaks = {"phase": "import", "import": 0}
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
def sample():
    while True:
        value = rss()
        if value > peaks[peaks["phase"]]:
            peaks[peaks["phase"]] = value
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
def phase(name):
    peaks[peaks["phase"]] = max(peaks[peaks["phase"]], rss())
    peaks[name] = rss()
    peaks["phase"] = name
from jaxinfer import LLM, SamplingParams
imported = time.perf_counter()
phase("load")
llm = LLM({model}progress=False)
ready = time.perf_counter()
phase("generate")
greedy = SamplingParams(temperature=0, max_tokens=1)
llm.generate(["Hello"], greedy, use_tqdm=False)
first = time.perf_counter()
out = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                   use_tqdm=False)
done = time.perf_counter()
phase("end")
status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith("Rss"))
print("RESULT", json.dumps({
    "import_s": imported - start, "load_s": llm.model.load_seconds, "llm_ready_s": ready - imported,
    "first_token_s": first - imported, "generate_32_s": done - first,
    "tokens": len(out[0].outputs[0].token_ids),
    "prepared": "hit" if any("read from" in m for m in prepared) else "miss",
    "peak_load_mb": peaks["load"] / 2**20, "peak_generate_mb": peaks["generate"] / 2**20,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "end_rss_anon_mb": int(status["RssAnon"].split()[0]) / 1024,
    "end_rss_file_mb": int(status["RssFile"].split()[0]) / 1024,
}), flush=True)
llm.wait_compiled()
"""
METRICS = ("load_s", "first_token_s", "peak_rss_mb", "peak_load_mb", "peak_generate_mb", "end_rss_anon_mb",
           "end_rss_file_mb", "generate_32_s")


def run_child(model: str, cache_dir: str | None, prepared_cache: bool = True) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env.pop("JAXINFER_DISABLE_COMPILATION_CACHE", None)
    if not prepared_cache:
        env["JAXINFER_PREPARED_CACHE_BYTES"] = "0"
    if cache_dir:
        env.update(JAXINFER_CACHE_DIR=cache_dir)
    argument = "" if model == "default" else repr(model) + ", "
    out = subprocess.run([sys.executable, "-c", CHILD.replace("{model}", argument)], env=env, capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(f"{model}: exit {out.returncode}\n{out.stderr[-3000:]}")
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT "):])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help='"default" (LLM() with no model) or a .gguf path')
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold-cache", action="store_true", help="a fresh cache directory for every run")
    parser.add_argument("--no-prepared-cache", action="store_true",
                        help="convert the GGUF at every start (the other caches stay warm)")
    parser.add_argument("--json", help="write every run and the medians here")
    args = parser.parse_args()
    models = args.model or ["default"]
    runs = {m: [] for m in models}
    if not args.cold_cache:
        for model in models:
            run_child(model, None, not args.no_prepared_cache)  # the warm-up: fills the caches
    for r in range(args.rounds):
        for model in models:
            with tempfile.TemporaryDirectory() as fresh:
                result = run_child(model, fresh if args.cold_cache else None, not args.no_prepared_cache)
            runs[model].append(result)
            print(f"round {r + 1} {model}: " + ", ".join(f"{k} {result[k]:.2f}" for k in METRICS)
                  + f", prepared params {result['prepared']}", flush=True)
    medians = {m: {k: statistics.median(run[k] for run in runs[m]) for k in METRICS} for m in models}
    print()
    print("| model | load s | first token s | peak RSS MB | peak in load MB | peak in generate MB | "
          "end RSS anon / file MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m, v in medians.items():
        print(f"| {m} | {v['load_s']:.2f} | {v['first_token_s']:.2f} | {v['peak_rss_mb']:.0f} | "
              f"{v['peak_load_mb']:.0f} | {v['peak_generate_mb']:.0f} | "
              f"{v['end_rss_anon_mb']:.0f} / {v['end_rss_file_mb']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "cold_cache": args.cold_cache,
                       "prepared_cache": not args.no_prepared_cache, "medians": medians, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
