"""Overhead of the sharded code path on one device: mesh of 1 vs the plain path.

`LLM(..., tensor_parallel_size=1)` runs everything the tensor-parallel path
runs (params and pool placed with NamedShardings on a 1-device mesh, host
inputs put replicated, `mesh` a static argument of every program, logits and
tokens under sharding constraints, shard_map around the Pallas kernels) on a
single device; without the option the engine runs the plain single-device
path. Both engines are built in one process and their decode steps timed in
alternating rounds, so drift of the machine hits both alike; the spread of
each path's rounds is the noise the difference is compared with.

Run: python scripts/bench_mesh_overhead.py [--model M] [--batch-size 8] [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess

import jax


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--attention", "--attention-backend", dest="attention", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from jaxinfer import LLM
    from jaxinfer.benchmark import run_latency

    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    options = dict(dtype=dtype, progress=False, max_model_len=args.input_len + args.output_len + 16,
                   max_num_seqs=max(8, args.batch_size), attention=args.attention)
    engines = {"plain": LLM(args.model, **options), "mesh of 1": LLM(args.model, tensor_parallel_size=1, **options)}
    run_latency(engines["plain"], args.batch_size, args.input_len, 4)  # first-use effects, both paths
    run_latency(engines["mesh of 1"], args.batch_size, args.input_len, 4)
    rounds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            result = run_latency(llm, args.batch_size, args.input_len, args.output_len)
            rounds[name].append(result["decode_step_ms_mean"])
    summary = {}
    for name, values in rounds.items():
        summary[name] = {"median_ms": statistics.median(values), "min_ms": min(values), "max_ms": max(values),
                         "rounds_ms": values}
    plain, mesh = summary["plain"], summary["mesh of 1"]
    difference = mesh["median_ms"] - plain["median_ms"]
    noise = max(plain["max_ms"] - plain["min_ms"], mesh["max_ms"] - mesh["min_ms"])
    result = {
        "device": str(jax.devices()[0]),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "machine": platform.processor() or platform.machine(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "config": vars(args) | {"dtype": dtype},
        "decode_step": summary,
        "difference_ms": difference,
        "difference_pct": 100 * difference / plain["median_ms"],
        "noise_ms (largest round spread)": noise,
        "within_noise": abs(difference) <= noise,
    }
    print(f"{result['device']}: decode step, batch {args.batch_size}, median of {args.rounds} rounds")
    for name, s in summary.items():
        print(f"  {name:<10} {s['median_ms']:.3f} ms  (rounds {s['min_ms']:.3f} .. {s['max_ms']:.3f})")
    print(f"  mesh - plain = {difference:+.3f} ms ({result['difference_pct']:+.1f}%), noise {noise:.3f} ms, "
          f"within noise: {result['within_noise']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
