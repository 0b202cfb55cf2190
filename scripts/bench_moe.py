"""CPU decode cost of a mixture of experts against its active size
(BENCHMARKS.md, "Mixture of experts").

Three random Qwen3-family models with the same attention, embeddings and head:

  moe      E experts of moe_ffn each, top-k routing (Qwen3-MoE)
  dense    one dense MLP of k * moe_ffn: the MoE's active size (Qwen3)
  moe_all  the MoE's weights with every expert active (top-E)

each as float32 safetensors (quantization "none") and, with --gguf, as a
GGUF file of that type written by the gguf package, loaded as the CPU
default does (its blocks kept). Every measurement is its own process:
LLM(model), every bucket compiled and warm, then ms per decode step of B
different prompts: (N greedy steps - 1 step) / (N - 1), best of 2; medians
over --rounds, the configurations interleaved round by round so the VM's
drift hits them alike. With --llama-bench, llama.cpp's llama-bench runs the
same GGUF files (tg N at batch 1, --threads from --llama-threads) as the CPU peer.

    python scripts/bench_moe.py --gguf Q8_0 --batches 1,8 --rounds 3 --llama-bench /path/to/llama-bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.gguf_writer writes the GGUF files

CHILD = """
import json, sys, time
from jaxinfer import LLM, SamplingParams
path, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(path, progress=False, max_num_seqs=max(batch, 8), max_model_len=512)
llm.wait_compiled()
vocab = llm.model.config.vocab_size
prompts = [[1 + (i * 131 + j * 7) % (vocab - 1) for j in range(64)] for i in range(batch)]

def run(n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start

run(2)
run(steps)
print(json.dumps({"ms": 1e3 * min((run(steps) - run(1)) / (steps - 1) for _ in range(2)),
                  "quantization": llm.model.quantization}))
"""


def build_models(args, workdir: Path) -> dict[str, Path]:
    """HF directories (and GGUF files) of the three models; reused when present."""
    import torch
    import transformers

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                  max_position_embeddings=4096, tie_word_embeddings=False)
    moe_config = transformers.Qwen3MoeConfig(**common, num_experts=args.experts, num_experts_per_tok=args.top_k,
                                             moe_intermediate_size=args.moe_ffn, intermediate_size=args.moe_ffn,
                                             norm_topk_prob=True)
    dense_config = transformers.Qwen3Config(**common, intermediate_size=args.top_k * args.moe_ffn)
    paths = {}
    for name, config, cls in (("moe", moe_config, transformers.Qwen3MoeForCausalLM),
                              ("dense", dense_config, transformers.Qwen3ForCausalLM)):
        directory = workdir / name
        if not (directory / "config.json").exists() or (args.gguf and not (workdir / f"{name}.gguf").exists()):
            torch.manual_seed(0)
            model = cls(config).eval()
            model.save_pretrained(directory, safe_serialization=True)
            if args.gguf:
                from tests.gguf_writer import write_gguf

                write_gguf(model, workdir / f"{name}.gguf", getattr(__import__("gguf").GGMLQuantizationType, args.gguf),
                           arch="qwen3", vocab=True)
                if name == "moe":
                    model.config.num_experts_per_tok = args.experts
                    write_gguf(model, workdir / "moe_all.gguf", getattr(__import__("gguf").GGMLQuantizationType,
                                                                          args.gguf), vocab=True)
            del model
        paths[name] = directory
    all_active = workdir / "moe_all"
    if not (all_active / "config.json").exists():
        all_active.mkdir(exist_ok=True)
        config = json.loads((workdir / "moe" / "config.json").read_text())
        config["num_experts_per_tok"] = args.experts
        (all_active / "config.json").write_text(json.dumps(config))
        for f in (workdir / "moe").glob("*.safetensors*"):
            os.symlink(f, all_active / f.name)
    paths["moe_all"] = all_active
    if args.gguf:
        for name in ("moe", "dense", "moe_all"):
            paths[f"{name} {args.gguf}"] = workdir / f"{name}.gguf"
    return paths


def measure(path: Path, batch: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(batch), str(steps)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_bench(binary: str, path: Path, steps: int, threads: int) -> float:
    """llama.cpp's ms per token generating `steps` tokens at batch 1."""
    out = subprocess.run([binary, "-m", str(path), "-p", "0", "-n", str(steps), "-t", str(threads), "-r", "3",
                          "-o", "json"],
                         capture_output=True, text=True, check=True)
    return 1e3 / json.loads(out.stdout)[0]["avg_ts"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/jaxinfer-bench-moe")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-ffn", type=int, default=1024)
    parser.add_argument("--gguf", default=None, help="also write and time GGUF files of this type (e.g. Q8_0)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-bench", default=None, help="a llama.cpp llama-bench binary: time the GGUF files")
    parser.add_argument("--llama-threads", default="2", help="llama-bench --threads values, e.g. 1,2")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    paths = build_models(args, workdir)
    batches = [int(b) for b in args.batches.split(",")]
    results: dict = {}
    for _ in range(args.rounds):
        for batch in batches:
            for name, path in paths.items():
                results.setdefault(f"{name} b{batch}", []).append(measure(path, batch, args.steps)["ms"])
        if args.llama_bench:
            for threads in (int(t) for t in args.llama_threads.split(",")):
                for name, path in paths.items():
                    if path.suffix == ".gguf":
                        results.setdefault(f"llama.cpp t{threads} {name} b1", []).append(
                            llama_bench(args.llama_bench, path, args.steps, threads))
    summary = {key: statistics.median(values) for key, values in results.items()}
    for key, ms in summary.items():
        print(f"{key:32s} {ms:8.2f} ms/step   runs {['%.2f' % v for v in results[key]]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results, "median_ms": summary}, indent=1))
    if args.workdir == "/tmp/jaxinfer-bench-moe" and os.environ.get("JAXINFER_BENCH_KEEP") != "1":
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
