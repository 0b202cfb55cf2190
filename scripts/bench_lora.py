"""What LoRA costs a decode step, on the embedded default model.

Writes four random rank-16 PEFT adapters of every target (q k v o gate up
down) into a temp dir, builds the default model twice (without LoRA, and
with enable_lora=True, max_loras=4, max_lora_rank=16) and times decode steps
(the forward and the sampler of a pure-decode bucket, every sequence at
--context tokens) for

    base        the engine without LoRA (the programs take no LoRA input)
    lora-0      the LoRA engine, no request with an adapter
    lora-1      the LoRA engine, every row with the same adapter
    lora-4      the LoRA engine, rows cycling through 4 distinct adapters

at each batch size. The VM is shared and its speed drifts (up to 2x within
seconds when others run), so configurations are interleaved step by step:
each round times --steps single steps of every configuration, the
configurations in a fresh shuffled order for each step, and takes each
configuration's median; the table gives the median over rounds of each
round's ratio to base (and the spread of those ratios).
Adapter load time: reading + checking the PEFT files (host) and writing a
device slot, medians.

--forms times the LoRA term alone in the model's shapes (30 layers under
lax.scan, the seven targets, 4 slots, rank 16) in each form of
models/lora.py (gather, one-hot, ragged), rows with 4 distinct adapters.

    python scripts/bench_lora.py [--batch-sizes 1,32] [--rounds 7] [--json out.json]
    python scripts/bench_lora.py --forms [--batch-sizes 1,2,4,8,16,32]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_SEQ_IDS = itertools.count()
ENGINE = dict(max_model_len=256, max_num_seqs=32, max_num_batched_tokens=64)
PEFT_NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
              "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def write_adapter(directory: Path, config, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter of every target, in PEFT's file layout."""
    from safetensors.numpy import save_file

    from jaxinfer.lora.adapter import target_shapes

    rng = np.random.default_rng(seed)
    tensors = {}
    for key, (fan_in, fan_out) in target_shapes(config).items():
        for layer in range(config.num_layers):
            prefix = f"base_model.model.model.layers.{layer}.{PEFT_NAMES[key]}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, fan_in ** -0.5, (rank, fan_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.01, (fan_out, rank)).astype(np.float32)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=rank, lora_alpha=2 * rank, bias="none",
        target_modules=[name.split(".")[1] for name in PEFT_NAMES.values()])))
    return str(directory)


def decode_step(llm, batch: int, context: int, lora_slots):
    """A callable running one decode step (forward + sampler) of `batch`
    sequences at `context` tokens, rows with lora_slots[i] (None: no LoRA input)."""
    from jaxinfer.engine.sampler import SamplingMetadata

    engine, runner = llm.engine, llm.engine.runner
    rng = np.random.default_rng(0)
    tables, tokens = [], []
    for i in range(batch):
        seq_id = ("bench", next(_SEQ_IDS))
        engine.block_manager.allocate_prefix(seq_id, [])
        assert engine.block_manager.allocate(seq_id, context)
        tables.append(engine.block_manager.block_table(seq_id))
        tokens.append(rng.integers(0, llm.model.config.vocab_size, 1).tolist())  # the one token the step computes
    inputs = runner.inputs(tokens, [context - 1] * batch, [1] * batch, tables, seq_lora_slots=lora_slots)
    num_seqs = len(inputs.attn_meta.context_lens)
    sampling = SamplingMetadata.from_params([None] * num_seqs, [0] * num_seqs, [0] * num_seqs, num_seqs)

    def step():
        logits, _ = runner.forward(inputs)
        jax.block_until_ready(runner._sample(logits, sampling, None, False, runner._sampler_work([], False),
                                             runner._no_mask(num_seqs)))

    return step


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_steps(args) -> dict:
    from jaxinfer import LLM, LoRARequest

    base = LLM(progress=False, **ENGINE)
    lora = LLM(progress=False, enable_lora=True, max_loras=4, max_lora_rank=16, **ENGINE)
    for llm in (base, lora):  # every bucket compiled: no step pads into a larger one meanwhile
        llm.wait_compiled()
    config = lora.model.checkpoint_config
    slots = lora.engine.lora
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_adapter(Path(tmp) / f"a{i}", config, 16, seed=i) for i in range(4)]
        read_s, write_s = [], []
        for i, path in enumerate(paths):
            start = time.perf_counter()
            slots.register(LoRARequest(f"a{i}", i + 1, path))
            read_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            slots.acquire(i + 1)  # pinned for the whole run: slot i + 1
            write_s.append(time.perf_counter() - start)
    results = {"load": {"read_and_check_s": statistics.median(read_s), "slot_write_s": statistics.median(write_s),
                        "rank": 16, "targets": 7}, "steps": {}}
    for batch in args.batch_sizes:
        configs = {
            "base": decode_step(base, batch, args.context, None),
            "lora-0": decode_step(lora, batch, args.context, [0] * batch),
            "lora-1": decode_step(lora, batch, args.context, [1] * batch),
            "lora-4": decode_step(lora, batch, args.context, [1 + i % 4 for i in range(batch)]),
        }
        for step in configs.values():  # warm (compiled at start-up; first runs touch memory)
            step(), step()
        ratios = {name: [] for name in configs}
        times = {name: [] for name in configs}
        order = list(configs)
        for _ in range(args.rounds):
            samples = {name: [] for name in configs}
            for _ in range(args.steps):
                random.shuffle(order)
                for name in order:
                    samples[name].append(timed(configs[name], 1))
            round_times = {name: statistics.median(samples[name]) for name in configs}
            for name in configs:
                times[name].append(round_times[name])
                ratios[name].append(round_times[name] / round_times["base"])
        results["steps"][batch] = {name: {"ratio_median": statistics.median(ratios[name]),
                                          "ratio_min": min(ratios[name]), "ratio_max": max(ratios[name]),
                                          "ms_median": 1e3 * statistics.median(times[name])} for name in configs}
    return results


def bench_forms(args) -> dict:
    """The LoRA term alone, per form, in the default model's shapes."""
    from jaxinfer.loading.model import load
    from jaxinfer.lora.adapter import target_shapes
    from jaxinfer.models import lora

    config = load(progress=False).config
    L, S, r = config.num_layers, 4, 16
    rng = np.random.default_rng(0)
    buffers = {key: (jnp.asarray(rng.normal(size=(L, i, S, r)), jnp.float32),
                     jnp.asarray(rng.normal(size=(L, S, r, o)), jnp.float32))
               for key, (i, o) in target_shapes(config).items()}
    shapes = target_shapes(config)
    results = {}
    for rows in args.batch_sizes:
        x = {key: jnp.asarray(rng.normal(size=(rows, i)), jnp.float32) for key, (i, _) in shapes.items()}
        slots = jnp.asarray([1 + k % 4 for k in range(rows)], jnp.int32)
        programs = {}
        for form in ("gather", "one-hot", "ragged"):
            def layers(buffers, x, slots, form=form):
                def body(total, per_layer):
                    out = sum(lora._FORMS[form](x[k], a, b, slots).sum() for k, (a, b) in per_layer.items())
                    return total + out, None
                return jax.lax.scan(body, jnp.float32(0), buffers)[0]

            fn = jax.jit(layers)
            jax.block_until_ready(fn(buffers, x, slots))
            programs[form] = lambda fn=fn: jax.block_until_ready(fn(buffers, x, slots))
        times = {form: [] for form in programs}
        order = list(programs)
        for _ in range(args.rounds):
            random.shuffle(order)
            for form in order:
                times[form].append(timed(programs[form], args.steps))
        results[rows] = {form: 1e3 * statistics.median(t) for form, t in times.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="single steps timed per configuration per round, interleaved (median)")
    parser.add_argument("--forms", action="store_true", help="time the LoRA term alone in each form instead")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.forms:
        results = {"forms_ms": bench_forms(args)}
        print(f"{'rows':>5}  " + "  ".join(f"{f:>9}" for f in ("gather", "one-hot", "ragged")) + "   (ms, LoRA term alone)")
        for rows, forms in results["forms_ms"].items():
            print(f"{rows:>5}  " + "  ".join(f"{forms[f]:9.2f}" for f in ("gather", "one-hot", "ragged")))
    else:
        results = bench_steps(args)
        load = results["load"]
        print(f"adapter load (rank 16, 7 targets): read + check {1e3 * load['read_and_check_s']:.0f} ms, "
              f"slot write {1e3 * load['slot_write_s']:.0f} ms")
        print(f"{'batch':>5}  {'config':<7} {'ratio to base (median)':>22}  {'min..max':>12}  {'ms':>7}")
        for batch, configs in results["steps"].items():
            for name, row in configs.items():
                print(f"{batch:>5}  {name:<7} {row['ratio_median']:22.3f}  "
                      f"{row['ratio_min']:5.2f}..{row['ratio_max']:<5.2f}  {row['ms_median']:7.1f}")
    device = jax.devices()[0]
    results["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip()
    results["device"] = f"{device.platform} {device.device_kind}"
    results["host"] = platform.processor() or platform.machine()
    results["jax"] = jax.__version__
    print(f"commit {results['commit']}, {results['device']}, jax {results['jax']}")
    results["command"] = "python scripts/bench_lora.py " + " ".join(
        f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if k not in ("json", "forms")) + (" --forms" if args.forms else "")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
