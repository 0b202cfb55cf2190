"""Speculative decoding against plain decoding: acceptance rate, mean accepted
length and speedup, per proposer, batch size and kind of prompt.

Prompts of three kinds, `per batch` distinct ones each: "code" (repetitive,
code-like raw completions: Python functions, JSON records, C enums of one
shape), "summarize" (chat: summarize the given paragraphs, so the answer
copies from the prompt), "open" (chat: open-ended questions). Every request
is greedy with max_tokens = --output-len (EOS ends it), so every engine emits
the same tokens and the speedup is plain wall time over speculative wall
time for the same batch (--temperature T > 0: sampled with a seed per request,
which speculative decoding keeps token-for-token too). Engines: "plain", "ngram", "eagle" (the trained
draft head in checkpoints/, or --eagle-head), "draft_model" (the
draft is the target itself unless --draft-model says otherwise: with a
greedy draft equal to the target every draft is accepted, so it measures the
machinery's overhead at the best possible acceptance) and "draft_model:Q"
(the draft quantized with Q, e.g. int4: cheaper, slightly less accurate;
it rounds float weights, so the target needs --quantization none, as a
GGUF target on CPU otherwise keeps its own blocks).
Each drafts at every step it may; "M+adaptive" (e.g. eagle+adaptive) is
method M with the engine's default adaptive rule, drafting only while that
measures faster than plain decoding (jaxinfer/engine/spec/policy.py).
All engines live in one process with the same KV pool size, so they share
compiled programs; each configuration is run --repeats times, engines
interleaved so that they see the same machine noise, and the fastest run
of each is kept. Prints a table and writes JSON.

Per draft position j it also reports how often draft j was accepted, of
the verifications that offered a j-th draft.

Run: python scripts/bench_speculative.py [--batch-sizes 1,8,32] [--num-speculative-tokens 4] [--temperature 0]
     [--output-len 64] [--methods plain,ngram,eagle,draft_model] [--json bench_speculative.json]
     python scripts/bench_speculative.py --quantization none --methods plain,draft_model,draft_model:int4
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import jax

PARAGRAPHS = [
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Shop owners worried that "
    "removing parking spaces would hurt their business, while cyclists argued that safer lanes would bring more "
    "customers on foot and by bike. The council agreed to a six-month trial and will count visitors before deciding.",
    "Honeybees communicate the location of flowers with a waggle dance. The angle of the dance relative to gravity "
    "shows the direction of the food compared with the sun, and the length of the waggle run tells the distance. "
    "Other bees follow the dancer, learn the route and fly straight to the flowers.",
    "A small bakery started selling bread made from an old wheat variety grown by a farmer nearby. The loaves cost "
    "more than ordinary bread, but customers say they taste better and stay fresh longer. The baker now plans to "
    "open a second shop and to buy the farmer's whole harvest next year.",
    "Researchers tested whether short walks after meals lower blood sugar. Volunteers who walked for ten minutes "
    "after eating had smaller spikes in blood sugar than those who sat down. The effect was strongest after dinner, "
    "and the researchers suggest that even light movement helps muscles absorb glucose.",
    "The museum reopened its dinosaur hall after two years of renovation. The skeletons were cleaned and remounted "
    "in more accurate poses, and new screens explain how scientists date fossils. Visitors can also watch "
    "technicians prepare bones in a glass-walled laboratory.",
    "Heavy rain flooded several roads in the valley overnight. Emergency crews rescued drivers stuck in their cars, "
    "and schools closed for the day. The weather service expects the river to peak on Thursday afternoon and asks "
    "residents near the banks to move valuables upstairs.",
    "A software team replaced its nightly builds with tests that run on every change. Bugs are now found within "
    "minutes instead of the next morning, and developers spend less time searching for the change that broke "
    "something. The team says the switch took a month but paid off within weeks.",
    "Volunteers planted two thousand trees along the old railway line that crosses the town. The trees will give "
    "shade to the walking path, reduce noise from the highway and provide food for birds. Local schools adopted "
    "sections of the path and will water the young trees during the summer.",
]

TOPICS = [
    "the ocean", "a lighthouse keeper", "learning to cook", "the first day at a new school", "a lost cat",
    "winter in the mountains", "a robot that paints", "an old library", "a train journey", "a garden in spring",
    "the night sky", "a busy market", "a friendly dragon", "a rainy afternoon", "a bicycle trip", "a clock maker",
]
OPEN_TEMPLATES = ["Write a short story about {}.", "What are some interesting facts about {}?"]


def code_prompt(i: int) -> str:
    """Raw completions of a repetitive structure, cut in the middle of a repetition."""
    names = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    name = f"{names[i % len(names)]}{i // len(names) or ''}"
    if i % 4 == 0:
        ops = [("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"), ("mod", "%")]
        body = "".join(f"def {op}_{name}(a, b):\n    \"\"\"Return a {sym} b.\"\"\"\n    return a {sym} b\n\n\n"
                       for op, sym in ops[:3])
        return f"# Arithmetic helpers for {name}.\n\n{body}def {ops[3][0]}_{name}(a, b):\n"
    if i % 4 == 1:
        people = ["alice", "bob", "carol", "dave", "erin", "frank"]
        rows = ",\n".join(f'  {{"id": {k + 1}, "name": "{p}", "team": "{name}", "active": true}}'
                          for k, p in enumerate(people[:4]))
        return f"[\n{rows},\n  {{\"id\": 5, \"name\": \"{people[4]}\","
    if i % 4 == 2:
        colors = ["RED", "GREEN", "BLUE", "YELLOW", "BLACK", "WHITE", "ORANGE"]
        cases = "".join(f"    case COLOR_{c}:\n        return \"{c.lower()}\";\n" for c in colors[:4])
        return f"const char *{name}_color_name(enum color c) {{\n    switch (c) {{\n{cases}    case COLOR_"
    items = ["Home", "About", "Products", "Contact", "Blog", "Careers"]
    lis = "".join(f'  <li class="nav-item"><a href="/{it.lower()}" class="nav-link">{it}</a></li>\n'
                  for it in items[:4])
    return f'<ul class="nav {name}">\n{lis}  <li class="nav-item"><a href="/'


def build_prompts(tokenizer, kind: str, count: int) -> list[list[int]]:
    def chat(text):
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return tokenizer.encode(templated, add_special_tokens=False)

    if kind == "code":
        return [tokenizer.encode(code_prompt(i)) for i in range(count)]
    if kind == "summarize":
        n = len(PARAGRAPHS)
        pairs = [(i, (i + d) % n) for d in range(1, n) for i in range(n)]
        return [chat("Summarize the following text in a few sentences.\n\n" + PARAGRAPHS[a] + "\n\n" + PARAGRAPHS[b])
                for a, b in pairs[:count]]
    questions = [t.format(topic) for t in OPEN_TEMPLATES for topic in TOPICS]
    return [chat(q) for q in questions[:count]]


def count_positions(llm, k: int) -> dict:
    """Counts, per draft position j (1..k), of verifications that offered a
    j-th draft ("offered") and that accepted it ("accepted"), read from each
    step's output as the engine's output processor receives it."""
    counts = {"offered": [0] * k, "accepted": [0] * k}
    processor = llm.engine.output_processor
    process = processor.process

    def counting(batch, out, requests):
        for i, num_drafts in enumerate(batch.num_drafts):
            if num_drafts:
                accepted = min(int(out.num_emitted[i]) - 1, num_drafts)
                for j in range(num_drafts):
                    counts["offered"][j] += 1
                    counts["accepted"][j] += j < accepted
        return process(batch, out, requests)

    processor.process = counting
    return counts


def run(llm, prompts, output_len: int, temperature: float = 0.0, one_at_a_time: bool = False) -> dict:
    from jaxinfer import SamplingParams

    if temperature > 0:
        params = [SamplingParams(temperature=temperature, max_tokens=output_len, seed=1000 + i)
                  for i in range(len(prompts))]
    else:
        params = SamplingParams(temperature=0.0, max_tokens=output_len)
    before = llm.stats()
    counts = getattr(llm, "_position_counts", None)
    counts_before = {key: list(v) for key, v in counts.items()} if counts else None
    start = time.perf_counter()
    if one_at_a_time:  # batch 1 over several prompts: each request alone, in turn
        outputs = [llm.generate([p], params if temperature == 0 else [params[i]], use_tqdm=False)[0]
                   for i, p in enumerate(prompts)]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.stats()
    diff = {k: after[k] - before[k] for k in ("spec_proposed_tokens", "spec_accepted_tokens", "spec_verifications",
                                              "num_compilations")}
    positions = ({key: [a - b for a, b in zip(counts[key], counts_before[key])] for key in counts}
                 if counts else None)
    return {"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "token_ids": [o.outputs[0].token_ids for o in outputs], "positions": positions, **diff}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--batch1-prompts", type=int, default=1, help="at batch 1, run this many prompts one "
                        "after another (acceptance over one prompt is noisy)")
    parser.add_argument("--kinds", default="code,summarize,open")
    parser.add_argument("--methods", default="plain,ngram,eagle,draft_model")
    parser.add_argument("--quantization", default="auto", help="the target's weights ('none': float, which "
                        "draft_model:Q needs)")
    parser.add_argument("--eagle-head", default=None, help="EAGLE head file (default: the one in checkpoints/)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled, seeded")
    parser.add_argument("--disable-by-batch-size", default="default", help="'default' (the method's measured "
                        "crossover), 'none' (draft at every batch size) or an int")
    parser.add_argument("--draft-model", default=None, help="draft checkpoint (default: the target itself)")
    parser.add_argument("--json", default="bench_speculative.json")
    args = parser.parse_args()

    from jaxinfer import LLM

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    kinds, methods = args.kinds.split(","), args.methods.split(",")
    k = args.num_speculative_tokens
    max_batch = max(batch_sizes)
    max_model_len = 1024
    block_size = 16
    # The same pool for every engine (the draft model's pool would otherwise
    # shrink the target's), so all engines share compiled programs.
    num_blocks = max_batch * -(-(320 + args.output_len + k) // block_size) + 1
    options = dict(dtype=args.dtype, progress=False, max_model_len=max_model_len, block_size=block_size,
                   max_num_seqs=max_batch, num_kv_blocks=num_blocks,
                   quantization=None if args.quantization == "none" else args.quantization)
    disable = ({} if args.disable_by_batch_size == "default" else
               {"disable_by_batch_size": None if args.disable_by_batch_size == "none" else int(args.disable_by_batch_size)})

    def spec_for(method):
        # "M+adaptive": the engine's default, drafting only while it measures faster; plain M drafts at
        # every step it may, which is what acceptance is measured on.
        method, adaptive = method.removesuffix("+adaptive"), method.endswith("+adaptive")
        spec = spec_for_method(method)
        return spec if spec is None else {**spec, **disable, "adaptive": adaptive}

    def spec_for_method(method):
        if method == "plain":
            return None
        if method == "ngram":
            return {"method": "ngram", "num_speculative_tokens": k}
        if method == "eagle":  # the head shipped for the default model, or --eagle-head
            return {"method": "eagle", "num_speculative_tokens": k, "model": args.eagle_head}
        name, _, quantization = method.partition(":")
        if name != "draft_model":
            raise SystemExit(f"unknown method {method!r}")
        return {"method": "draft_model", "num_speculative_tokens": k, "model": args.draft_model,
                "quantization": quantization or None}

    engines = {}
    for method in methods:
        start = time.perf_counter()
        engines[method] = LLM(args.model, speculative=spec_for(method), **options)
        engines[method].wait_compiled()
        if method != "plain":
            engines[method]._position_counts = count_positions(engines[method], k)
        print(f"{method}: loaded and compiled in {time.perf_counter() - start:.1f}s", flush=True)
    tokenizer = next(iter(engines.values())).tokenizer
    prompts = {kind: build_prompts(tokenizer, kind, max(max_batch, args.batch1_prompts)) for kind in kinds}
    for method, llm in engines.items():  # first-call costs outside the timings
        llm.generate([prompts[kinds[0]][0]], None, use_tqdm=False)

    results = []
    for kind in kinds:
        for batch in batch_sizes:
            runs = {m: [] for m in engines}
            for _ in range(args.repeats):  # engines interleaved within each repeat
                for m, llm in engines.items():
                    runs[m].append(run(llm, prompts[kind][:batch if batch > 1 else args.batch1_prompts], args.output_len,
                                       args.temperature, one_at_a_time=batch == 1))
            base = min(r["wall_s"] for r in runs["plain"]) if "plain" in runs else None
            reference = runs["plain"][0]["token_ids"] if "plain" in runs else None
            for m, rs in runs.items():
                best = min(rs, key=lambda r: r["wall_s"])
                proposed = sum(r["spec_proposed_tokens"] for r in rs)
                accepted = sum(r["spec_accepted_tokens"] for r in rs)
                verifications = sum(r["spec_verifications"] for r in rs)
                row = {
                    "kind": kind, "batch": batch, "method": m,
                    "wall_s": best["wall_s"], "output_tokens": best["output_tokens"],
                    "output_tokens_per_s": best["output_tokens"] / best["wall_s"],
                    "acceptance_rate": accepted / proposed if proposed else None,
                    "mean_accepted_length": 1 + accepted / verifications if verifications else None,
                    "speedup": base / best["wall_s"] if base else None,
                    "same_tokens_as_plain": reference is None or all(r["token_ids"] == reference for r in rs),
                    "compilations_during_runs": sum(r["num_compilations"] for r in rs),
                }
                if rs[0]["positions"]:
                    offered = [sum(r["positions"]["offered"][j] for r in rs) for j in range(k)]
                    took = [sum(r["positions"]["accepted"][j] for r in rs) for j in range(k)]
                    row["acceptance_per_position"] = [a / o if o else None for a, o in zip(took, offered)]
                results.append(row)
                print(f"{kind:9s} b={batch:<3d} {m:11s} {row['output_tokens_per_s']:7.1f} tok/s  "
                      f"speedup {row['speedup'] or 0:.2f}  acceptance {row['acceptance_rate'] or 0:.2f}  "
                      f"mean accepted length {row['mean_accepted_length'] or 0:.2f}"
                      + (" per position " + " ".join("-" if a is None else f"{a:.2f}"
                                                     for a in row["acceptance_per_position"])
                         if row.get("acceptance_per_position") else ""), flush=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = jax.devices()[0]
    model = next(iter(engines.values())).model.source
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature} (seeded)"
    print(f"\n{model}, K={k}, output-len {args.output_len}, {sampling}, {device.platform} ({platform.processor() or ''}), "
          f"commit {commit}")
    print("| kind | batch | method | output tok/s | speedup | acceptance rate | mean accepted length | "
          "accepted per draft position |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for r in results:
        def fmt(x, spec=".2f"):
            return "-" if x is None else format(x, spec)
        print(f"| {r['kind']} | {r['batch']} | {r['method']} | {r['output_tokens_per_s']:.1f} | {fmt(r['speedup'])} | "
              f"{fmt(r['acceptance_rate'])} | {fmt(r['mean_accepted_length'])} | "
              + " / ".join(fmt(a) for a in r.get("acceptance_per_position") or []) + " |")
    with open(args.json, "w") as f:
        json.dump({"model": model, "num_speculative_tokens": k, "output_len": args.output_len, "commit": commit,
                   "device": f"{device.platform} {device.device_kind}", "draft_model": args.draft_model,
                   "temperature": args.temperature, "disable_by_batch_size": args.disable_by_batch_size,
                   "results": results}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
