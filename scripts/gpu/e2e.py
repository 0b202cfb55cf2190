"""The engine on an 8B-shaped checkpoint on one GPU (scripts/gpu_check.sh):
start-up, decode latency per batch, offline throughput, and the host's share
of the step time, as JSON.

    python scripts/gpu/e2e.py DIR OUT.json [--backend gpu|xla] [--batches 1,16,64] [--throughput]
                                            [--start-only]

--backend xla runs the plain XLA reference backend (layers under a scan over
stacked weights: the engine's GPU path before the backend seam) for a
before/after in the same run. Times from this script's first line: the
process start to the engine serving (largest buckets compiled) and to every
program compiled. Weight-read time = the weights a one-row step reads at the
device copy bandwidth measured here (read + write bytes counted).

Host share of a decode step = 1 - (the step's device programs, forward and
sampler, queued back to back with no host work between them) / (the
engine's step time): the share of a step the device waits for the host.
"""

import time

START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402

from jaxinfer import LLM  # noqa: E402
from jaxinfer.backends import XlaBackend  # noqa: E402
from jaxinfer.bench_timing import copy_bandwidth_gbs, weight_bytes_per_step  # noqa: E402
from jaxinfer.benchmark import run_latency, run_throughput, synthetic_requests  # noqa: E402
from jaxinfer.engine.sampler import SamplingMetadata  # noqa: E402


class _ReferenceLLM:
    """LLM's engine on a forced backend (the shape run_latency reads)."""

    def __init__(self, directory, backend, **options):
        from jaxinfer.engine.config import EngineConfig
        from jaxinfer.engine.engine import LLMEngine
        from jaxinfer.loading.model import load

        self.model = load(directory, dtype="bfloat16", progress=False, backend=backend)
        self.engine = LLMEngine(self.model, EngineConfig(**options), progress=False)

    def wait_compiled(self):
        self.engine.wait_compiled()


def device_step_ms(engine, batch: int, context: int = 192, iters: int = 30) -> float:
    """A decode step of `batch` sequences of `context` tokens: its forward and
    sampler programs queued `iters` times with nothing else, per step."""
    runner = engine.runner
    blocks_per_seq = -(-context // runner.block_size)
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(batch)]
    inputs = runner.inputs([[1] * context] * batch, [context - 1] * batch, [1] * batch, tables)
    num_seqs = len(inputs.attn_meta.context_lens)
    sampling = SamplingMetadata.from_params([None] * batch, [0] * batch, [0] * batch, num_seqs)
    masks = runner._no_mask(num_seqs)

    def step():
        logits, _ = runner.forward(inputs)
        return runner._sample(logits, sampling, None, False, runner._sampler_work([]), masks)

    jax.block_until_ready(step())
    start = time.perf_counter()
    for _ in range(iters):
        out = step()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("json")
    parser.add_argument("--backend", default="gpu", choices=["gpu", "xla"])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--throughput", action="store_true")
    parser.add_argument("--start-only", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    result = {"backend": args.backend, "devices": str(jax.devices()), "jax": jax.__version__,
              "imported_s": time.time() - START}
    if not args.start_only:  # before the engine takes the free memory for its KV pool
        result["copy_GBps"] = copy_bandwidth_gbs(2 << 30, 20)
    options = dict(max_model_len=4096)
    if args.max_num_seqs:
        options["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.backend == "gpu":
        llm = LLM(args.directory, dtype="auto", progress=False, **options)
    else:
        llm = _ReferenceLLM(args.directory, XlaBackend(attention="pallas"), **options)
    result["ready_s"] = time.time() - START
    llm.wait_compiled()
    result["compiled_s"] = time.time() - START
    engine = llm.engine
    result["programs"] = len(engine.runner.programs())
    result["programs_loaded"] = engine.runner.num_loaded
    print(json.dumps(result), flush=True)
    if not args.start_only:
        weight_bytes = weight_bytes_per_step(llm.model.params)
        result["weight_bytes"] = weight_bytes
        result["weight_read_ms"] = weight_bytes / (result["copy_GBps"] * 1e9) * 1e3
        for batch in batches:
            latency = run_latency(llm, batch, 128, 64)
            latency["device_step_ms"] = device_step_ms(engine, batch)
            latency["host_share_of_step_time"] = max(0.0, 1 - latency["device_step_ms"]
                                                     / latency["decode_step_ms_median"])
            latency["step_over_weight_read"] = latency["decode_step_ms_mean"] / result["weight_read_ms"]
            result[f"latency_b{batch}"] = latency
            print(batch, json.dumps(latency), flush=True)
            json.dump(result, open(args.json, "w"), indent=1)
        if args.throughput:
            requests = synthetic_requests(llm.model.config.vocab_size, 256, 256, 128, range_ratio=0.5)
            result["throughput_256x256x128"] = run_throughput(llm, requests)
            print(json.dumps(result["throughput_256x256x128"]), flush=True)
    result["stats"] = {k: v for k, v in engine.stats().items() if isinstance(v, (int, float))}
    result["total_s"] = time.time() - START
    json.dump(result, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
