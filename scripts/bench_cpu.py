"""Decode and prefill speed on CPU: jaxinfer against HF transformers (and llama.cpp
when llama-cpp-python is importable) on the same GGUF file, in one process.

Engines and configurations (all greedy, one thread per core everywhere):
  hf         transformers' LlamaForCausalLM loaded from the GGUF (dequantized to
             float32), torch.set_num_threads(cores)
  jaxinfer   one LLM per --schemes entry: "none" (float32 weights dequantized
             from the GGUF, the default before quantization="auto"), "gguf" (the
             file's Q8_0/Q4_0/Q4_1 blocks kept: what "auto" picks on CPU), "gguf-a8"
             (the blocks and head times int8-rounded activations, as llama.cpp), or a
             load-time scheme ("int8", "int4", "fp8", "w8a8"); XLA uses every core.
             "SCHEME/KV" sets the KV cache dtype too ("gguf/int8": gguf weights,
             int8 KV cache) and "SCHEME:BACKEND" the attention backend
             ("gguf:jnp": without the native CPU attention kernel); without them,
             the engine's defaults
  llama.cpp  the GGUF as stored, n_threads = cores, batch 1 only (optional)

Workloads (the same real token ids, from the model's tokenizer, for every engine):
  decode   per --batch-sizes B: B different --prompt-len-token prompts, then
           --output-len greedy tokens each with EOS ignored. Decode tok/s = B /
           (time of one decode step), a step being all B sequences advancing one
           token (the first token comes from the prefill, so output-len - 1 steps):
             jaxinfer: jaxinfer.benchmark.run_latency (as `jaxinfer bench latency`),
               the mean of the steps that contain no prompt tokens;
             hf: generate(max_new_tokens = min_new_tokens = output-len), each
               step's end time-stamped by a stopping criterion: (last - first) /
               (output-len - 1).
           "prompt tok/s": B * prompt-len / the time of the prefill step (jaxinfer)
           or to the first token (hf) of the same run.
  prefill  one --prefill-len-token prompt: prefill-len / the time of its prefill
           (jaxinfer: the prefill step, run_latency's prefill_s; hf: one forward,
           logits of the last position only; llama.cpp: eval).

For jaxinfer at batch 1 the table also gives the weight bytes read per decode
step (weight_bytes_per_step: the embedding table only when no other head reads
instead, since the lookup reads one row), the bandwidth that implies, and
its share of the memory read bandwidth measured with a jitted reduction over a
--bandwidth-mb array (median of 5 runs).

Engine settings of jaxinfer: max_num_seqs = the largest batch,
max_num_batched_tokens = enough for each batch's prompts (and the prefill prompt)
in one step (as HF's single prefill forward), a KV pool that holds the largest
batch, prefix caching off (the prompts repeat across runs).

Every engine is loaded first; then each batch size runs --repeats rounds in
which every engine decodes once (see measure: the VM's speed drifts, so the
ratio to HF is the median of the rounds' ratios), and the same for the prefill.
Each timing is the median of the rounds, after a warm-up. The greedy tokens
of jaxinfer (float) and HF at batch 1 are compared over the first 16 tokens; a
mismatch is reported as a warning (float32 sums in a different order can flip a
near-tie), not an error.

    python scripts/bench_cpu.py                       # writes bench_cpu.json
    python scripts/bench_cpu.py --batch-sizes 1,8 --output-len 16 --prefill-len 128 --schemes none,int8
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a plain checkout

import jax  # noqa: E402

from jaxinfer import benchmark  # noqa: E402
from jaxinfer.bench_timing import copy_bandwidth_gbs, read_bandwidth_gbs, weight_bytes_per_step  # noqa: E402
from jaxinfer.loading.checkpoint import default_model_path, open_checkpoint  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK_TOKENS = 16
BLOCK_SIZE = 16  # the engine's default block_size, for sizing the KV pool
PARAGRAPH = (
    "The river runs through the old town, past the market square and under seven stone bridges. "
    "In the morning the fishermen bring their boats to the quay, and the bakers open their doors "
    "before the sun rises over the hills. Children walk to school along the water, and in the "
    "evening the lamps are lit one by one while the bells of the cathedral ring the hour. "
)


# -- inputs and machine ----------------------------------------------------------
def make_prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of `length` real token ids: windows at successive offsets of a
    tokenized English text, so no two rows of a batch are the same."""
    text, ids = PARAGRAPH, []
    while len(ids) < length + batch:
        text += PARAGRAPH
        ids = tokenizer.encode(text)
    return [list(ids[i:i + length]) for i in range(batch)]


def machine_info(threads: int) -> dict:
    info = {"cpu_model": platform.processor() or platform.machine(), "cpu_flags": None}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        info["cpu_model"] = fields.get("Model name", info["cpu_model"]).strip()
        info["cpu_flags"] = fields.get("Flags", "").split()
        info["cpus"] = fields.get("CPU(s)", "").strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    import torch
    import transformers

    info.update(threads=threads, platform=platform.platform(), python=platform.python_version(),
                jax=jax.__version__, jaxlib=importlib.metadata.version("jaxlib"),
                torch=torch.__version__, transformers=transformers.__version__,
                date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    return info


def git_commit() -> dict:
    def git(*args):
        return subprocess.run(["git", "--no-optional-locks", *args], cwd=REPO, capture_output=True, text=True).stdout
    return {"commit": git("rev-parse", "HEAD").strip() or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip())}


# -- HF transformers -------------------------------------------------------------
class Engine:
    """One configuration under test: decode(batch) -> (seconds per decode step,
    seconds of the prompts' prefill or None); prefill() -> seconds for the
    prefill prompt; tokens: its first greedy tokens at batch 1."""

    def __init__(self, engine, config, decode, prefill, tokens, **info):
        self.engine, self.config, self.decode, self.prefill, self.tokens, self.info = (
            engine, config, decode, prefill, tokens, info)


def setup_hf(path, threads, prompts, prefill_prompt, output_len) -> Engine:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    class StepClock(transformers.StoppingCriteria):
        """Called by generate once per emitted token: the time of each step's end."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def generate(ids, new_tokens):
        """-> (time to the first token, mean decode step, new token ids) of one generate call."""
        clock = StepClock()
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False,
                                 stopping_criteria=transformers.StoppingCriteriaList([clock]))
        assert len(clock.times) == new_tokens, (len(clock.times), new_tokens)
        step = (clock.times[-1] - clock.times[0]) / (new_tokens - 1) if new_tokens > 1 else None
        return clock.times[0] - start, step, out[:, ids.shape[1]:].tolist()

    def prefill_s(ids):
        # logits_to_keep=1: only the last row's logits, as in generate's own prefill.
        with torch.inference_mode():
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
            return time.perf_counter() - start

    generate(torch.tensor(prompts[:1]), 2)  # warm-up
    prefill_s(torch.tensor([prefill_prompt]))  # warm-up: the first forward of a shape is slower
    tokens = generate(torch.tensor(prompts[:1]), min(CHECK_TOKENS, output_len))[2][0]

    def decode(batch):
        _, step, _ = generate(torch.tensor(prompts[:batch]), output_len)
        return step, None

    return Engine("hf", "float32", decode, lambda: prefill_s(torch.tensor([prefill_prompt])), tokens)


# -- jaxinfer --------------------------------------------------------------------
def latency(llm, prompts, output_len) -> dict:
    """benchmark.run_latency, the timing of `jaxinfer bench latency`, on these prompts
    in place of its random ones (so jaxinfer and HF see the same token ids)."""
    def requests(vocab_size, num_prompts, input_len, max_tokens, **_):
        return [(list(p), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)) for p in prompts]

    with mock.patch.object(benchmark, "synthetic_requests", requests):
        return benchmark.run_latency(llm, len(prompts), len(prompts[0]), output_len)


def setup_jaxinfer(path, scheme, prompts, prefill_prompt, batch_sizes, output_len) -> Engine:
    from jaxinfer import LLM

    max_batch, prompt_len = max(batch_sizes), len(prompts[0])
    blocks_per_seq = math.ceil((prompt_len + output_len) / BLOCK_SIZE) + 1
    weights_kv, _, backend = scheme.partition(":")
    weights, _, kv_cache_dtype = weights_kv.partition("/")
    options = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}
    options.update({"attention": backend} if backend else {})
    llm = LLM(str(path), quantization=None if weights == "none" else weights, progress=False, **options,
              max_num_seqs=max_batch, max_num_batched_tokens=max(max_batch * prompt_len, len(prefill_prompt)),
              num_kv_blocks=1 + max(max_batch * blocks_per_seq, math.ceil(len(prefill_prompt) / BLOCK_SIZE) + 1),
              # The longest request timed: a pool sized for the benchmark cannot hold the model's full context.
              max_model_len=max(prompt_len + output_len, len(prefill_prompt) + output_len),
              enable_prefix_caching=False)
    llm.wait_compiled()  # every bucket compiled before any timing
    check = SamplingParams(temperature=0.0, max_tokens=min(CHECK_TOKENS, output_len), ignore_eos=True)
    tokens = list(llm.generate([prompts[0]], check, use_tqdm=False)[0].outputs[0].token_ids)  # also a warm-up
    latency(llm, [prefill_prompt], 1)  # warm-up

    def decode(batch):
        run = latency(llm, prompts[:batch], output_len)
        return run["decode_step_ms_mean"] * 1e-3, run["prefill_s"]

    return Engine("jaxinfer", scheme, decode, lambda: latency(llm, [prefill_prompt], 1)["prefill_s"], tokens,
                  weight_bytes_per_step=weight_bytes_per_step(llm.model.params), llm=llm,
                  compilations=llm.stats()["num_compilations"], preemptions=llm.stats()["num_preemptions"])


# -- llama.cpp (optional) ----------------------------------------------------------
def setup_llama_cpp(path, threads, prompt, prefill_prompt, output_len) -> Engine:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=max(len(prompt) + output_len, len(prefill_prompt)) + 8,
                n_batch=max(len(prompt), len(prefill_prompt)), n_threads=threads, n_threads_batch=threads,
                verbose=False)

    def prefill_s(tokens):
        llm.reset()  # forget the cached prompt: the next eval starts from position 0
        start = time.perf_counter()
        llm.eval(tokens)
        return time.perf_counter() - start

    def decode(batch):
        llm.reset()
        for i, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True)):
            if i == 0:
                first = time.perf_counter()  # the first token comes from the prefill
            if i + 1 == output_len:
                return (time.perf_counter() - first) / (output_len - 1), None

    prefill_s(prompt[:16])  # warm-up
    return Engine("llama.cpp", "gguf", decode, lambda: prefill_s(prefill_prompt), None, batch_sizes=(1,))


def measure(engines: list[Engine], batch_sizes, repeats, log):
    """Interleaved: for each batch size, `repeats` rounds in which every engine
    runs once, so the engines of one round are timed seconds apart. The VM's
    speed drifts by up to 2x over tens of seconds; the ratio to HF is the median
    of each round's ratio, which that drift cancels out of."""
    decode, prefill = [], []
    for batch in batch_sizes:
        runs = {e: [] for e in engines if batch in e.info.get("batch_sizes", (batch,))}
        for _ in range(repeats):
            for engine in runs:
                runs[engine].append(engine.decode(batch))
        hf = next((r for e, r in runs.items() if e.engine == "hf"), None)
        for engine, r in runs.items():
            steps = [step for step, _ in r]
            row = dict(engine=engine.engine, config=engine.config, batch_size=batch,
                       decode_step_ms=median(steps) * 1e3, decode_tokens_per_s=batch / median(steps),
                       decode_step_ms_runs=[t * 1e3 for t in steps],
                       ratio_to_hf=median(h / t for (h, _), t in zip(hf, steps)) if hf else None)
            if r[0][1] is not None:
                row["prompt_prefill_s"] = median(p for _, p in r)
            decode.append(row)
            log(row)
    times = {e: [] for e in engines}
    for _ in range(repeats):
        for engine in engines:
            times[engine].append(engine.prefill())
    hf = next((t for e, t in times.items() if e.engine == "hf"), None)
    for engine, t in times.items():
        prefill.append(dict(engine=engine.engine, config=engine.config, prefill_s=median(t),
                            ratio_to_hf=median(h / x for h, x in zip(hf, t)) if hf else None))
    return decode, prefill


# -- report ------------------------------------------------------------------------
def table(headers: list[str], rows: list[list]) -> str:
    """Text left-aligned, numbers right-aligned, '-' for missing values."""
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.2f}" if abs(v) < 100 else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def report(decode, prefill, read_gbs) -> str:
    """The decode and prefill tables (ratio_to_hf: median of the rounds' ratios, see measure)."""
    decode_rows = [[r["engine"], r["config"], r["batch_size"], r["decode_tokens_per_s"], r["decode_step_ms"],
                    r["ratio_to_hf"], r["batch_size"] * r["prompt_len"] / r["prompt_prefill_s"]
                    if r.get("prompt_prefill_s") else None,
                    r["weight_bytes_per_step"] / 2**20 if "weight_bytes_per_step" in r else None,
                    r.get("weights_GBs"),
                    100 * r["share_of_read_bandwidth"] if "share_of_read_bandwidth" in r else None]
                   for r in sorted(decode, key=lambda r: r["batch_size"])]
    prefill_rows = [[r["engine"], r["config"], r["prefill_len"], r["prefill_tokens_per_s"], r["prefill_s"] * 1e3,
                     r["ratio_to_hf"]] for r in prefill]
    return "\n\n".join([
        table(["engine", "weights", "batch", "decode tok/s", "ms/step", "x HF", "prompt tok/s", "weight MiB/step",
               "weight GB/s", f"% of {read_gbs:.1f} GB/s"], decode_rows),
        table(["engine", "weights", "prompt tokens", "prefill tok/s", "ms", "x HF"], prefill_rows),
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--schemes", default="none,gguf,gguf-a8,int8,w8a8",
                        help="jaxinfer weight schemes: none (float32), gguf, gguf-a8, int8, int4, fp8, w8a8, each optionally "
                             "/KV for a KV cache dtype and :BACKEND for an attention backend, e.g. gguf/int8:jnp "
                             "(default %(default)s)")
    parser.add_argument("--batch-sizes", default="1,8,32,64", help="decode batch sizes (default %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence when decoding")
    parser.add_argument("--output-len", type=int, default=64, help="greedy tokens per sequence (>= 2)")
    parser.add_argument("--prefill-len", type=int, default=512, help="tokens of the prefill prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--bandwidth-mb", type=int, default=512, help="MiB of the read-bandwidth array")
    parser.add_argument("--json", default="bench_cpu.json", metavar="PATH", help="results (default %(default)s)")
    args = parser.parse_args()
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    if args.output_len < 2 or min(batch_sizes) < 1 or args.repeats < 1:
        parser.error("--output-len must be >= 2, batch sizes and --repeats >= 1")

    path = default_model_path() if args.model is None else Path(args.model).resolve()
    if path.suffix != ".gguf":
        parser.error("--model must be a .gguf file (HF transformers loads the same file)")
    _, _, tokenizer, _ = open_checkpoint(path)
    prompts = make_prompts(tokenizer, max(batch_sizes), args.prompt_len)
    prefill_prompt = make_prompts(tokenizer, 1, args.prefill_len)[0]
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    machine = machine_info(threads)
    print(f"{path.name}: {machine['cpu_model']}, {threads} threads, jax {jax.__version__}, torch {machine['torch']}")

    def log(row):
        ratio = "" if row["ratio_to_hf"] is None else f", {row['ratio_to_hf']:.2f}x HF"
        print(f"  {row['engine']:<9} {row['config']:<12} batch {row['batch_size']:>3}: "
              f"{row['decode_tokens_per_s']:8.1f} tok/s ({row['decode_step_ms']:.1f} ms/step{ratio})", flush=True)

    read_gbs = read_bandwidth_gbs(args.bandwidth_mb * 2**20)
    copy_gbs = copy_bandwidth_gbs(args.bandwidth_mb * 2**20, iters=5)
    print(f"memory read bandwidth {read_gbs:.1f} GB/s (jitted sum over {args.bandwidth_mb} MiB)", flush=True)

    print("hf transformers (load)", flush=True)
    engines = [setup_hf(path, threads, prompts, prefill_prompt, args.output_len)]
    for scheme in schemes:
        print(f"jaxinfer {scheme} (load + compile)", flush=True)
        engines.append(setup_jaxinfer(path, scheme, prompts, prefill_prompt, batch_sizes, args.output_len))
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    if llama_cpp is not None:
        print(f"llama.cpp {llama_cpp.__version__}", flush=True)
        machine["llama_cpp"] = llama_cpp.__version__
        engines.append(setup_llama_cpp(path, threads, prompts[0], prefill_prompt, args.output_len))
    decode, prefill = measure(engines, batch_sizes, args.repeats, log)
    for engine in engines:
        if engine.engine != "jaxinfer":
            continue
        stats = engine.info["llm"].stats()
        for key, what in (("num_compilations", "compilation(s) after warm-up"), ("num_preemptions", "preemption(s)")):
            if stats[key] > engine.info[key.removeprefix("num_")]:
                print(f"warning: jaxinfer {engine.config}: {what} in the timed runs", file=sys.stderr)
        for row in decode:
            if row["engine"] == "jaxinfer" and row["config"] == engine.config and row["batch_size"] == 1:
                step = row["decode_step_ms"] * 1e-3
                weight_bytes = engine.info["weight_bytes_per_step"]
                row.update(weight_bytes_per_step=weight_bytes, weights_GBs=weight_bytes / step / 1e9,
                           share_of_read_bandwidth=weight_bytes / step / 1e9 / read_gbs)
    tokens = {("hf" if e.engine == "hf" else f"{e.engine}-{e.config}"): e.tokens for e in engines}
    hf_tokens = tokens["hf"]
    for r in decode:
        r.update(prompt_len=args.prompt_len, output_len=args.output_len)
    for r in prefill:
        r.update(prefill_len=args.prefill_len, prefill_tokens_per_s=args.prefill_len / r["prefill_s"])

    checked = min(CHECK_TOKENS, args.output_len)
    jax_tokens = tokens.get("jaxinfer-none")
    agree = None if jax_tokens is None or hf_tokens is None else jax_tokens[:checked] == hf_tokens[:checked]
    print()
    print(report(decode, prefill, read_gbs))
    if agree is False:
        first = next(i for i, (a, b) in enumerate(zip(jax_tokens, hf_tokens)) if a != b)
        print(f"\nwarning: greedy tokens of jaxinfer (float32) and HF differ from token {first} of the first "
              f"{checked} at batch 1 (float32 summation order; not a failure)")
    elif agree:
        print(f"\njaxinfer (float32) and HF agree on the first {checked} greedy tokens at batch 1")

    result = {
        "benchmark": "bench_cpu", "model": str(path), **git_commit(), "machine": machine, "config": vars(args),
        "bandwidth": {"read_GBs": read_gbs, "copy_GBs": copy_gbs, "array_MiB": args.bandwidth_mb,
                      "note": "read: jitted sum (the share's denominator); copy: bench_timing.copy_bandwidth_gbs"},
        "decode": decode, "prefill": prefill,
        "greedy_check": {"tokens": checked, "agree": agree,
                         "token_ids": {k: v[:checked] for k, v in tokens.items() if v is not None}},
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
