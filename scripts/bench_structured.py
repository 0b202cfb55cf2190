"""Structured outputs' cost, default model:

1. decode step time with every row constrained by a JSON schema vs none, at
   batch 1 / 8 / 32, interleaved (each round runs every batch size both ways)
   and the ratio taken per round, then the median of the rounds: the shared
   CPU's speed drifts over tens of seconds;
2. time to first mask (compiling a fresh schema, then filling its first
   mask) and the per-token mask time (host time filling bitmasks / rows);
3. compile time of a 50-property schema.

    python scripts/bench_structured.py [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxinfer import LLM, SamplingParams, StructuredOutputsParams

# Stays inside JSON for a long time (at least 40 items), so no row finishes mid-measurement.
LONG = {"type": "object", "properties": {"items": {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "score": {"type": "number", "minimum": 0, "maximum": 100},
                                     "tag": {"enum": ["a", "b", "c"]}},
    "required": ["name", "score", "tag"], "additionalProperties": False}}}, "required": ["items"]}


def fifty_properties(salt: str) -> dict:
    kinds = [{"type": "string", "maxLength": 32}, {"type": "integer", "minimum": 0}, {"type": "boolean"},
             {"enum": ["x", "y", "z"]}, {"type": "array", "items": {"type": "number"}, "maxItems": 5}]
    props = {f"{salt}_p{i}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props)[:25], "additionalProperties": False}


def step_time(llm, batch: int, constrained: bool, steps: int, seed: int) -> tuple[float, int]:
    """Median seconds per decode step with `batch` rows; and how many rows got masks."""
    engine = llm.engine
    spec = StructuredOutputsParams(json=LONG) if constrained else None
    ids = []
    for i in range(batch):
        request_id = f"b{batch}-{int(constrained)}-{seed}-{i}"
        engine.add_request(request_id, llm.tokenizer.encode(f"Item list {i}:"),
                           SamplingParams(temperature=1.0, seed=seed + i, max_tokens=200, ignore_eos=True,
                                          structured_outputs=spec))
        ids.append(request_id)
    while any(not s.output_token_ids for s in engine.scheduler.running) or engine.scheduler.waiting \
            or engine._pending:
        engine.step()  # compile (cached after the first round), prefill
    masks_before = engine.runner.num_masks
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    rows = engine.runner.num_masks - masks_before
    for request_id in ids:
        engine.abort(request_id)
    return statistics.median(times), rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    start = time.perf_counter()
    llm = LLM(progress=False, max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256)
    llm.wait_compiled()
    print(f"engine ready in {time.perf_counter() - start:.1f} s")
    engine, compiler = llm.engine, llm.engine.grammar_compiler

    # Time to first mask: the llguidance tokenizer (once per engine), then per fresh schema.
    start = time.perf_counter()
    compiler.lltokenizer
    print(f"llguidance tokenizer built in {1e3 * (time.perf_counter() - start):.0f} ms (first structured request only)")
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    bitmask = allocate_token_bitmask(1, llm.model.config.vocab_size)
    first, compile_small = [], []
    for k in range(5):
        schema = dict(LONG, title=f"fresh-{k}")
        start = time.perf_counter()
        compiled = compiler.compile(StructuredOutputsParams(json=schema))
        compiled_at = time.perf_counter()
        fill_next_token_bitmask(compiled.new_matcher(), bitmask, 0)
        first.append(time.perf_counter() - start)
        compile_small.append(compiled_at - start)
    print(f"time to first mask (small schema): median {1e3 * statistics.median(first):.2f} ms "
          f"(compile {1e3 * statistics.median(compile_small):.2f} ms), 5 fresh schemas")
    big = []
    for k in range(3):
        start = time.perf_counter()
        compiled = compiler.compile(StructuredOutputsParams(json=fifty_properties(f"s{k}")))
        big.append(time.perf_counter() - start)
    matcher = compiled.new_matcher()
    start = time.perf_counter()
    fill_next_token_bitmask(matcher, bitmask, 0)
    print(f"50-property schema: compile median {1e3 * statistics.median(big):.1f} ms "
          f"(runs: {', '.join(f'{1e3 * t:.1f}' for t in big)}), first mask {1e3 * (time.perf_counter() - start):.2f} ms")

    batches = (1, 8, 32)
    ratios = {b: [] for b in batches}
    plain_t, masked_t = {b: [] for b in batches}, {b: [] for b in batches}
    per_token = {b: [] for b in batches}
    for r in range(args.rounds):
        for b in batches:
            mask_before, rows_before = engine.runner.mask_time, engine.runner.num_masks
            masked, rows = step_time(llm, b, True, args.steps, seed=1000 * r)
            mask_s = engine.runner.mask_time - mask_before
            per_token[b].append(mask_s / max(1, engine.runner.num_masks - rows_before))
            plain, _ = step_time(llm, b, False, args.steps, seed=1000 * r)
            assert rows == b * args.steps, (rows, b)
            plain_t[b].append(plain)
            masked_t[b].append(masked)
            ratios[b].append(masked / plain)
        print(f"round {r}: " + ", ".join(f"b{b} {1e3 * plain_t[b][-1]:.1f}/{1e3 * masked_t[b][-1]:.1f} ms"
                                         for b in batches))
    print("\n| batch | step, none constrained ms | step, all constrained ms | ratio (median of rounds) "
          "| per-row mask fill us |")
    print("|---:|---:|---:|---:|---:|")
    for b in batches:
        print(f"| {b} | {1e3 * statistics.median(plain_t[b]):.1f} | {1e3 * statistics.median(masked_t[b]):.1f} "
              f"| {statistics.median(ratios[b]):.3f} ({', '.join(f'{x:.3f}' for x in ratios[b])}) "
              f"| {1e6 * statistics.median(per_token[b]):.0f} |")
    print(f"\nnum_compilations {llm.stats()['num_compilations']} (all at warm-up: "
          f"{len(engine.runner.programs())} programs)")
    np.testing.assert_equal(engine.runner.warmed_up, True)


if __name__ == "__main__":
    main()
