"""Greedy tokens and their logprobs for a fixed set of configurations, as JSON:
run it before and after a change that must not move a number (a refactor),
then compare the two files with --compare.

    python scripts/output_fingerprint.py --out before.json
    python scripts/output_fingerprint.py --out after.json --compare before.json

The configurations: the embedded default model (its GGUF blocks, "gguf-a8",
float weights, the reference attention, n-gram speculative decoding) and a
tiny random HF Llama (float32, int8, int4, fp8, w8a8, a PEFT LoRA adapter, a
Qwen2-MoE). Every bucket the engine compiles is compiled before it runs
(warmup="all"), so no output depends on which program was ready.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.tiny_models / tests.lora_helpers build the HF references

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


def attention_option(name: str) -> dict:
    """The reference attention under whichever name this version of the engine takes."""
    import inspect

    from jaxinfer.engine.config import EngineConfig

    fields = inspect.signature(EngineConfig).parameters
    return {"attention": name} if "attention" in fields else {"attention_backend": "jnp"}


def run(llm, prompts, lora=None) -> list:
    from jaxinfer import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    result = []
    for out in outs:
        c = out.outputs[0]
        chosen = [step[token].logprob for step, token in zip(c.logprobs, c.token_ids)]
        result.append({"tokens": list(c.token_ids), "logprobs": chosen})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", help="an earlier --out file: exit 1 unless every number is identical")
    parser.add_argument("--only", nargs="*", help="names of configurations to run (default: all)")
    args = parser.parse_args()

    from jaxinfer import LLM, LoRARequest
    from tests.lora_helpers import make_adapter
    from tests.tiny_models import make_hf_model, save_hf_model

    common = dict(progress=False, max_model_len=256, warmup="all")
    tmp = Path(tempfile.mkdtemp())
    llama = make_hf_model("llama")
    save_hf_model(llama, tmp / "llama")
    save_hf_model(make_hf_model("qwen2_moe"), tmp / "moe")
    tiny_prompts = [[1, 5, 9, 2, 7], [3, 3, 8], [11, 4, 6, 2, 9, 12, 1]]

    def default(**kw):
        return lambda: run(LLM(**common, **kw), PROMPTS)

    def tiny(directory="llama", **kw):
        return lambda: run(LLM(str(tmp / directory), **common, **kw), tiny_prompts)

    def lora():
        adapter = make_adapter(llama, tmp / "adapter", seed=1, r=8, target_modules=["q_proj", "v_proj", "down_proj"])
        llm = LLM(str(tmp / "llama"), **common, enable_lora=True, max_lora_rank=8)
        return run(llm, tiny_prompts, LoRARequest("a", 1, adapter))

    configs = {
        "default": default(),
        "default-gguf-a8": default(quantization="gguf-a8"),
        "default-float": default(quantization=None),
        "default-reference-attention": default(**attention_option("reference")),
        "default-ngram": default(speculative={"method": "ngram", "num_speculative_tokens": 3}),
        "tiny-float32": tiny(dtype="float32"),
        "tiny-int8": tiny(quantization="int8"),
        "tiny-int4": tiny(quantization="int4"),
        "tiny-fp8": tiny(quantization="fp8"),
        "tiny-w8a8": tiny(quantization="w8a8"),
        "tiny-lora": lora,
        "tiny-moe": tiny("moe", dtype="float32"),
    }
    results = {}
    for name, make in configs.items():
        if args.only and name not in args.only:
            continue
        results[name] = make()
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(name, [r["tokens"][:6] for r in results[name]], flush=True)
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        changed = [name for name in results if name in before and before[name] != results[name]]
        print("identical:", [n for n in results if n in before and n not in changed])
        print("changed:", changed)
        sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
