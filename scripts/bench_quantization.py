"""Quantization quality and size: perplexity and checkpoint size per weight
scheme and KV-cache dtype, on one fixed public-domain text.

For the default model (or --model): converts it with `jaxinfer convert` logic
to each scheme (none, int8, int4 RTN, int4-awq calibrated on
tests/data/calibration_text.txt, fp8) in a temporary directory, measures the
checkpoint's size on disk and the parameters' bytes in memory, loads it back
and computes the sliding-window perplexity of tests/data/eval_text.txt (an
essay written for this project and dedicated to CC0; the calibration text is
a different one). The float model is also scored with an int8 and an fp8 KV
cache, and a GGUF source with its own blocks kept (`quantization="gguf"`).
Prints a table and writes JSON.

Run: python scripts/bench_quantization.py [--model M] [--context-len 1024] [--json bench_quantization.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--schemes", default="none,int8,int4,int4-awq,fp8")
    parser.add_argument("--json", default="bench_quantization.json")
    args = parser.parse_args()

    import jax

    from jaxinfer import load
    from jaxinfer.convert import convert_model, disk_size
    from jaxinfer.perplexity import perplexity_of_text
    from jaxinfer.quant.params import params_nbytes

    text = (DATA / "eval_text.txt").read_text(encoding="utf-8")
    base = load(args.model, progress=False, quantization=None)
    rows = []

    def score(name, model, kv="auto", checkpoint_bytes=None):
        start = time.perf_counter()
        result = perplexity_of_text(model, text, context_len=args.context_len, kv_cache_dtype=kv)
        rows.append({"weights": name, "kv_cache": kv, "perplexity": result.perplexity, "mean_nll": result.mean_nll,
                     "tokens_scored": result.num_tokens_scored, "params_bytes": params_nbytes(model.params),
                     "checkpoint_bytes": checkpoint_bytes, "seconds": time.perf_counter() - start})
        print(f"{name:10s} kv {kv:5s} ppl {result.perplexity:8.4f}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for scheme in args.schemes.split(","):
            out = Path(tmp) / scheme
            calibration = DATA / "calibration_text.txt" if scheme == "int4-awq" else None
            convert_model(base, out, scheme, calibration=calibration, progress=False, log=lambda *_: None)
            model = load(str(out), progress=False)
            score(scheme, model, checkpoint_bytes=disk_size(out))
            if scheme == "none":
                for kv in ("int8", "fp8"):
                    score(scheme, model, kv=kv, checkpoint_bytes=disk_size(out))
            del model
    if str(base.source).endswith(".gguf"):
        score("gguf", load(args.model, progress=False, quantization="gguf"),
              checkpoint_bytes=Path(base.source).stat().st_size)

    reference = next(r["perplexity"] for r in rows if r["weights"] == "none" and r["kv_cache"] == "auto")
    print()
    print("| weights | KV cache | perplexity | vs float | params in memory (MB) | checkpoint on disk (MB) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        r["relative"] = r["perplexity"] / reference - 1
        size = f"{r['checkpoint_bytes'] / 1e6:.1f}" if r["checkpoint_bytes"] else "-"
        print(f"| {r['weights']} | {r['kv_cache']} | {r['perplexity']:.4f} | {r['relative']:+.2%} | "
              f"{r['params_bytes'] / 1e6:.1f} | {size} |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(args.json, "w") as f:
        json.dump({"model": str(base.source), "text": "tests/data/eval_text.txt", "context_len": args.context_len,
                   "tokens_scored": rows[0]["tokens_scored"], "commit": commit, "jax": jax.__version__,
                   "machine": platform.platform(), "device": str(jax.devices()[0]), "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
