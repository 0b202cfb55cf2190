"""Decode speed on CPU of int4 GPTQ and AWQ checkpoints (loaded as stored,
loading/prequantized/) against the engine's own int4 (a float checkpoint
quantized at load, quant/params.py) on the same random Llama.

The model: a random LlamaForCausalLM built from a config (default hidden
1024, intermediate 2816, 8 layers, 16 / 4 heads of 64, vocab 32000, untied
head), saved with transformers' save_pretrained (float32) once in a temp
dir; from it a GPTQ checkpoint (4 bits, group 128, symmetric, the "gptq"
zeros) and an AWQ GEMM one (4 bits, group 128, zero points), written by the
formats' packing rules (tests/prequantized_writers.py, as the loading tests
write them).

Variants (one LLM each, all loaded before timing):
  int4   the float dir, quantization="int4" (its default group size)
  gptq   the GPTQ dir, quantization="stored"
  awq    the AWQ dir, quantization="stored"

First, by construction, per variant: each stacked layer weight's form
(scheme, group size, offsets or not, tile, scale dtype, activation block)
and the head's, and the native custom calls (by target name) in the lowered
forward of 1 and of --batch-sizes' largest rows (models.llama.forward on the
model's backend, full-sequence attention: the linears and head a decode step
of that many rows runs), and whether that whole lowered program is the same
text as int4's (the params are its arguments, so the same forms give the
same program). Differences are printed.

Then per batch size B: B fixed prompts of --prompt-len token ids, greedy,
--output-len tokens each with EOS ignored, through LLM.generate, after a
warm-up generate (compiles). tokens/s = B * output-len / wall time of the
generate (its prefill included). The three variants run in turn in each of
--rounds rounds (the machine's speed drifts and other work shares it: the
alternation spreads that over all three); reported: the median tokens/s
and the median over rounds of each variant's ratio to int4 in the same round.

    python scripts/bench_prequantized.py --json bench_prequantized.json
    python scripts/bench_prequantized.py --hidden 256 --intermediate 768 --layers 2 --vocab 1024 --rounds 2
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a plain checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from jaxinfer import LLM  # noqa: E402
from jaxinfer.models.attention import full_sequence_attention  # noqa: E402
from jaxinfer.models.llama import forward  # noqa: E402
from jaxinfer.quant.tensor import QuantizedTensor  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from tests.prequantized_writers import awq_checkpoint, gptq_checkpoint  # noqa: E402
from tests.tiny_models import save_hf_model  # noqa: E402

VARIANTS = ("int4", "gptq", "awq")
CUSTOM_CALL = re.compile(r"custom_call @([\w.]+)\(")


def build_checkpoints(args, root: Path) -> dict[str, tuple[Path, str]]:
    """variant -> (directory, quantization)."""
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    dirs = {name: root / name for name in VARIANTS}
    for d in dirs.values():
        d.mkdir()
    save_hf_model(hf, dirs["int4"])
    gptq_checkpoint(hf, dirs["gptq"], 4, args.group_size, sym=True, fmt="gptq", reference=False)
    awq_checkpoint(hf, dirs["awq"], args.group_size, reference=False)
    return {"int4": (dirs["int4"], "int4"), "gptq": (dirs["gptq"], "stored"), "awq": (dirs["awq"], "stored")}


def form(w) -> dict:
    if isinstance(w, QuantizedTensor):
        return dict(type="QuantizedTensor", scheme=w.scheme, group_size=w.group_size,
                    offsets=None if w.offsets is None else str(w.offsets.dtype), tile=w.tile,
                    scales=str(w.scales.dtype), activation_block=w.activation_block,
                    data=f"{w.data.dtype}{list(w.data.shape)}")
    return dict(type=type(w).__name__, dtype=str(getattr(w, "dtype", None)), shape=list(getattr(w, "shape", ())))


def forms(params: dict) -> dict:
    out = {f"layers/{k}": form(w) for k, w in params["layers"].items() if k.startswith("w")}
    for key in ("lm_head", "few_row_head"):
        if key in params:
            out[key] = form(params[key])
    return out


def lowered_forward(model, rows: int) -> str:
    """The lowered forward of `rows` tokens (its linears and head) as text."""
    tokens = jnp.zeros((1, rows), jnp.int32)
    positions = jnp.arange(rows, dtype=jnp.int32)[None]
    backend, config = model.backend, model.config

    def step(params, tokens):
        hidden, _ = forward(params, config, tokens, positions, full_sequence_attention(positions), backend=backend)
        return backend.logits(params, hidden)
    return jax.jit(step).lower(model.params, tokens).as_text()


def custom_calls(text: str) -> dict:
    """Native calls by target name in a lowered program."""
    return dict(sorted(collections.Counter(CUSTOM_CALL.findall(text)).items()))


def generate_tok_s(llm, prompts, params) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == len(prompts) * params.max_tokens, produced
    return produced / elapsed


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def compare_construction(llms: dict, max_rows: int) -> dict:
    """variant -> its weight forms and native calls at 1 and max_rows rows; the differences printed."""
    lowered = {name: {rows: lowered_forward(llm.model, rows) for rows in (1, max_rows)} for name, llm in llms.items()}
    construction = {name: dict(forms=forms(llm.model.params),
                               custom_calls={rows: custom_calls(text) for rows, text in lowered[name].items()},
                               same_program_as_int4={rows: text == lowered["int4"][rows]
                                                     for rows, text in lowered[name].items()})
                    for name, llm in llms.items()}
    print("\nweight forms (int4 = the engine's own, quantization='int4'):")
    for key, ref in construction["int4"]["forms"].items():
        print(f"  {key:16s} int4: {ref}")
        for name in VARIANTS[1:]:
            other = construction[name]["forms"].get(key)
            print(f"  {'':16s} {name}: {'same' if other == ref else other}")
    print("native custom calls in the lowered forward (target: count):")
    for name in VARIANTS:
        for rows, calls in construction[name]["custom_calls"].items():
            same = name != "int4" and calls == construction["int4"]["custom_calls"][rows]
            identical = construction[name]["same_program_as_int4"][rows]
            print(f"  {name:5s} {rows:3d} rows: {'same as int4' if same else calls}"
                  f"{'; the whole lowered program identical to int4' if identical and name != 'int4' else ''}")
    return construction


def time_decode(args, llms: dict, batch_sizes: list[int]) -> dict:
    """batch size -> variant -> tokens/s per round, their median, the median ratio to int4."""
    rng = np.random.default_rng(0)
    sampling = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    results = {}
    for batch in batch_sizes:
        prompts = [[int(t) for t in rng.integers(1, args.vocab, args.prompt_len)] for _ in range(batch)]
        for llm in llms.values():  # warm-up: compiles this batch's programs
            llm.generate(prompts, sampling, use_tqdm=False)
        rounds = []
        for r in range(args.rounds):
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]  # each variant goes first in turn
            rounds.append({name: generate_tok_s(llms[name], prompts, sampling) for name in order})
            print(f"batch {batch} round {r + 1}: " + "  ".join(f"{n} {rounds[-1][n]:.1f}" for n in VARIANTS),
                  flush=True)
        results[batch] = {name: dict(tok_s=[rd[name] for rd in rounds],
                                     median_tok_s=median(rd[name] for rd in rounds),
                                     ratio_to_int4=median(rd[name] / rd["int4"] for rd in rounds))
                          for name in VARIANTS}
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--group-size", type=int, default=128, help="GPTQ's and AWQ's group size")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    with tempfile.TemporaryDirectory(prefix="bench_prequantized_") as tmp:
        t0 = time.perf_counter()
        checkpoints = build_checkpoints(args, Path(tmp))
        print(f"checkpoints written in {time.perf_counter() - t0:.1f} s", flush=True)
        llms = {}
        for name, (directory, quantization) in checkpoints.items():
            llms[name] = LLM(str(directory), quantization=quantization, progress=False,
                             max_model_len=args.max_model_len, max_num_seqs=max(batch_sizes),
                             enable_prefix_caching=False, warmup="all")
            assert llms[name].model.quantization == quantization, llms[name].model.quantization
        construction = compare_construction(llms, max(batch_sizes))
        results = time_decode(args, llms, batch_sizes)

    cpu = cpu_model()
    print(f"\n{cpu}, {os.cpu_count()} CPUs; {args.layers} layers, hidden {args.hidden}, "
          f"intermediate {args.intermediate}, vocab {args.vocab}; prompt {args.prompt_len}, "
          f"{args.output_len} tokens, {args.rounds} rounds")
    print(f"{'batch':>5s} {'variant':8s} {'tok/s (median)':>15s} {'ratio to int4':>14s}  per round")
    for batch, by_variant in results.items():
        for name, res in by_variant.items():
            rounds = " ".join(f"{t:.1f}" for t in res["tok_s"])
            print(f"{batch:5d} {name:8s} {res['median_tok_s']:15.1f} {res['ratio_to_int4']:14.3f}  {rounds}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            cpu=cpu, cpus=os.cpu_count(), jax=jax.__version__, args=vars(args), construction=construction,
            results={str(b): r for b, r in results.items()}), indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
