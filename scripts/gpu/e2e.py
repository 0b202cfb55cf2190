"""The engine on an 8B-shaped checkpoint on one GPU (scripts/gpu_check.sh):
start-up, decode latency per batch, a long-context request, offline
throughput, the host's share of the step time, and what the compiled decode
step launches, as JSON (written after every part: a run cut short by its time
limit keeps what it measured).

    python scripts/gpu/e2e.py DIR OUT.json [--backend gpu|xla] [--max-model-len N] [--batches 1,16,64]
                              [--long-context 32768] [--throughput 256] [--start-only] [--deadline S]
                              [--hlo-dir DIR] [--rehearse]

No --max-model-len: the engine's default, the model config's own context
(131,072 for Llama-3.1), as a user who sets no option meets it. --backend
xla runs the plain XLA reference backend (layers under a scan over stacked
weights) for a before/after in the same run. Times from this script's first
line: the process start to the engine serving (the smallest bucket of each
layout compiled), to the first token of a short prompt (a user's first
request) and to every program compiled. Weight-read time = the weights a one-row step reads
at the device copy bandwidth measured here (read + write bytes counted).

Device step = the step's device programs (forward and sampler) queued back to
back with no host work between them; host share = 1 - device step / the
engine's median step time: the share of a step the device waits for the host.
The compiled decode step of each batch (scripts/gpu/compiled_hlo.py): its
kernels per layer, the weights it copies or concatenates (XLA's dot merger
would), and the bytes the decode attention's kernels write per step.

--rehearse runs this script where no GPU is at hand (gpu_check.sh's
REHEARSE=1): the GPU backend's layout, buckets and unrolled programs,
compiled for the CPU with XLA's attention and norms in place of its Pallas
kernels, in float32 (interpreted, a decode kernel copies the whole KV pool
at every program of its grid, and XLA's CPU scatter into a bfloat16 pool
converts all of it to float32 and back: minutes a step at the default
context). Its numbers measure nothing; it shows that every part runs and
writes what summary.py reads.
"""

import time

START = time.time()

import argparse  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.backends import GpuBackend, XlaBackend  # noqa: E402
from jaxinfer.bench_timing import copy_bandwidth_gbs, weight_bytes_per_step  # noqa: E402
from jaxinfer.benchmark import run_latency, run_throughput, synthetic_requests  # noqa: E402
from jaxinfer.engine.sampler import SamplingMetadata  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from compiled_hlo import DECODE_ATTENTION, step_report  # noqa: E402


class _ReferenceLLM:
    """LLM's engine on a forced backend (the shape run_latency reads)."""

    def __init__(self, directory, backend, dtype, **options):
        from jaxinfer.engine.config import EngineConfig
        from jaxinfer.engine.engine import LLMEngine
        from jaxinfer.loading.model import load

        self.model = load(directory, dtype=dtype, progress=False, backend=backend)
        self.engine = LLMEngine(self.model, EngineConfig(**options), progress=False)

    def wait_compiled(self):
        self.engine.wait_compiled()


def device_step_ms(engine, batch: int, context: int = 192, iters: int = 30) -> float:
    """A decode step of `batch` sequences of `context` tokens: its forward and
    sampler programs queued `iters` times with nothing else, per step."""
    runner = engine.runner
    blocks_per_seq = -(-context // runner.block_size)
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(batch)]
    inputs = runner.inputs([[1]] * batch, [context - 1] * batch, [1] * batch, tables)
    num_seqs = len(inputs.attn_meta.context_lens)
    sampling = SamplingMetadata.from_params([None] * batch, [0] * batch, [0] * batch, num_seqs)
    masks = runner._no_mask(num_seqs)

    def step():
        logits, _ = runner.forward(inputs)
        return runner._sample(logits, sampling, None, False, runner._sampler_work([], False), masks)

    jax.block_until_ready(step())
    start = time.perf_counter()
    for _ in range(iters):
        out = step()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters * 1e3


def compiled_step_report(engine, batch: int, num_layers: int, hlo_path: Path | None) -> dict:
    """What the compiled decode step of `batch` sequences launches (compiled_hlo.py)."""
    runner = engine.runner
    program = ("forward", *runner.bucket(batch, batch)[:2], "decode")
    text = runner._executables[program].as_text()
    if hlo_path is not None:
        with gzip.open(hlo_path, "wt") as file:
            file.write(text)
    cost = runner._executables[program].cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"bucket": program[1], **step_report(text, num_layers, DECODE_ATTENTION),
            "xla_bytes_accessed": float((cost or {}).get("bytes accessed", -1))}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("json")
    parser.add_argument("--backend", default="gpu", choices=["gpu", "xla"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--long-context", type=int, default=0, help="one request of this many prompt tokens")
    parser.add_argument("--throughput", type=int, nargs="?", const=256, default=0,
                        help="offline requests (256 without a number) of 128-384 tokens in, 64-192 out")
    parser.add_argument("--start-only", action="store_true")
    parser.add_argument("--deadline", type=float, default=float(os.environ.get("PART_LIMIT", 1e9)),
                        help="seconds this run may take (its time limit; gpu_check.sh's part() sets PART_LIMIT): "
                             "a part that would end past it is skipped")
    parser.add_argument("--hlo-dir", default=None, help="write the compiled decode steps here (gzipped text)")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--rehearse", action="store_true",
                        help="no GPU: the GPU backend's programs compiled for the CPU, to rehearse this script")
    args = parser.parse_args()
    if args.rehearse:  # choose_backend picks the GPU's backend class, with its own fields for it
        import jaxinfer.backends

        jaxinfer.backends.backend_class = lambda platform=None: GpuBackend
    result = {"backend": args.backend, "devices": str(jax.devices()), "jax": jax.__version__,
              "imported_s": time.time() - START, "skipped": []}

    def save():
        result["total_s"] = time.time() - START
        json.dump(result, open(args.json, "w"), indent=1)

    def may_start(part: str, seconds: float) -> bool:
        """Whether `part`, which takes about `seconds` on an H100, ends before the deadline."""
        if time.time() - START + seconds < args.deadline:
            return True
        result["skipped"].append(part)
        return False

    if not args.start_only:  # before the engine takes the free memory for its KV pool
        # 2 GiB: far past any cache; a CPU's fresh output pages make the rehearsal's probe slow, so it copies less.
        result["copy_GBps"] = copy_bandwidth_gbs((64 << 20) if args.rehearse else (2 << 30), 20)
    options = {}
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name):
            options[name] = getattr(args, name)
    if args.rehearse:
        options["attention"] = "reference"
    if args.backend == "gpu":
        llm = LLM(args.directory, dtype="float32" if args.rehearse else "auto", progress=False, **options)
    else:  # the engine's attention option decides (with_attention): Pallas, as the GPU backend's default
        llm = _ReferenceLLM(args.directory, XlaBackend(), "float32" if args.rehearse else "bfloat16",
                            **{"attention": "pallas", **options, "max_model_len": args.max_model_len or 4096})
    result["ready_s"] = time.time() - START
    if args.backend == "gpu":  # a user's first request, while the other buckets compile
        llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        result["first_token_s"] = time.time() - START
    llm.wait_compiled()
    result["compiled_s"] = time.time() - START
    engine = llm.engine
    result["max_model_len"] = engine.config.max_model_len
    result["num_kv_blocks"] = engine.block_manager.num_usable_blocks
    result["programs"] = len(engine.runner.programs())
    result["programs_loaded"] = engine.runner.num_loaded
    result["programs_compiled_while_loading"] = engine.runner.num_adopted  # engine/early_compile.py
    result["load_s"] = llm.model.load_seconds
    print(json.dumps(result), flush=True)
    save()
    batches = [int(b) for b in args.batches.split(",") if b]
    result["skipped"] += [f"batch {b}: over max_num_seqs {engine.config.max_num_seqs}" for b in batches
                          if b > engine.config.max_num_seqs]
    batches = [b for b in batches if b <= engine.config.max_num_seqs]
    if not args.start_only:
        num_layers = llm.model.config.num_layers
        if args.hlo_dir:
            Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
        for batch in batches:
            hlo = Path(args.hlo_dir) / f"decode_b{batch}.hlo.txt.gz" if args.hlo_dir and batch == batches[0] else None
            try:
                result[f"compiled_b{batch}"] = compiled_step_report(engine, batch, num_layers, hlo)
            except Exception as error:  # a report, not the measurement: keep measuring
                result[f"compiled_b{batch}"] = {"error": repr(error)}
        save()
        weight_bytes = weight_bytes_per_step(llm.model.params)
        result["weight_bytes"] = weight_bytes
        result["weight_read_ms"] = weight_bytes / (result["copy_GBps"] * 1e9) * 1e3
        for batch in batches:
            if not may_start(f"latency_b{batch}", 10):
                continue
            latency = run_latency(llm, batch, 128, 64)
            latency["device_step_ms"] = device_step_ms(engine, batch)
            latency["host_share_of_step_time"] = max(0.0, 1 - latency["device_step_ms"]
                                                     / latency["decode_step_ms_median"])
            latency["step_over_weight_read"] = latency["decode_step_ms_mean"] / result["weight_read_ms"]
            result[f"latency_b{batch}"] = latency
            print(batch, json.dumps(latency), flush=True)
            save()
        shares = [result[k]["host_share_of_step_time"] for k in result if k.startswith("latency_b")]
        if shares:
            result["median_host_share"] = statistics.median(shares)
        context = args.long_context
        if context and context + 64 > engine.max_context_len:
            result["skipped"].append(f"long_context {context}: over the engine's {engine.max_context_len}")
        elif context and may_start("long_context", 25):
            long = run_latency(llm, 1, context, 64)
            long["device_step_ms"] = device_step_ms(engine, 1, context)
            long["host_share_of_step_time"] = max(0.0, 1 - long["device_step_ms"] / long["decode_step_ms_median"])
            result["long_context"] = long
            print(json.dumps(long), flush=True)
            save()
        if args.throughput and may_start("throughput", 40):
            requests = synthetic_requests(llm.model.config.vocab_size, args.throughput, 256, 128, range_ratio=0.5)
            result["throughput"] = run_throughput(llm, requests)
            print(json.dumps(result["throughput"]), flush=True)
    result["stats"] = {k: v for k, v in engine.stats().items() if isinstance(v, (int, float))}
    save()


if __name__ == "__main__":
    main()
