"""Train an EAGLE-style draft head (jaxinfer/engine/spec/eagle_head.py) for a target
model on text the target generates itself, with optax.

1. Data: the target answers chat prompts and continues raw code/text starts
   built from the templates below (sampled at temperature 0.7, plus greedy
   answers), through the engine (`LLM.generate`).
2. Features: one cache-free forward per sequence gives the target's pre-norm
   hidden state f_p at every position and its greedy next token argmax(logits_p).
3. Training: windows of `window` consecutive entries (x_p, f_{p-1}); the head
   predicts f^_p, trained with smooth-L1 to f_p (scaled by the features' RMS)
   plus cross-entropy of lm_head(norm(f^_p)) against the target's greedy
   token, for entries whose next token lies in generated text. A second
   pass feeds the head its own predicted features (entry p reads f^_{p-1}),
   as drafting does from the second draft on, with the same losses.
4. Evaluation on held-out sequences: top-1 agreement of the head's first and
   second draft with the target (the greedy acceptance rate per draft).

Prompts here are distinct from scripts/bench_speculative.py's, so the
benchmark measures the head on text it was not trained on.

Needs optax: `pip install -e ".[train]"`.

Reproduce the shipped head (about 22 min on the 2-core CPU VM, 10 of them generating text):
    python scripts/train_draft_head.py --out checkpoints/eagle-smollm2-135m-instruct.safetensors
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SUBJECTS = [
    "volcanoes", "the water cycle", "photosynthesis", "the Roman empire", "electric cars", "honey", "chess",
    "the moon landing", "coral reefs", "coffee", "the printing press", "penguins", "solar panels", "jazz music",
    "the human heart", "rainforests", "bread baking", "the internet", "glaciers", "recycling", "earthquakes",
    "the piano", "vaccines", "desert animals", "paper money", "the Olympic games", "tea ceremonies", "bridges",
    "owls", "compost", "wind turbines", "the alphabet", "submarines", "mushrooms", "marathons", "telescopes",
]
TEMPLATES = [
    "Explain {} to a ten-year-old.", "Give me three facts about {}.", "Write a short poem about {}.",
    "What are the pros and cons of {}?", "Describe the history of {} in a paragraph.",
    "Write a short story that involves {}.", "How does {} work?", "List five questions a student might ask about {}.",
]
CODE_STARTS = [
    "def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef list_files(path):\n",
    "def is_prime(n):\n", "# Sort a list of numbers with bubble sort\ndef bubble_sort(items):\n",
    "SELECT name, age FROM users WHERE", "<html>\n<head>\n  <title>", "def read_csv(path):\n    rows = []\n",
    "for i in range(10):\n", "def celsius_to_fahrenheit(c):\n", "const express = require('express');\n",
    "#include <stdio.h>\n\nint main(void) {\n", "def merge(a, b):\n    result = []\n",
    '{\n  "name": "example",\n  "version": "1.0.0",\n', "def count_words(text):\n",
    "class Point:\n    def __init__(self, x, y):\n",
]
TEXT_STARTS = [
    "Once upon a time, in a small village by the sea,", "The most important thing to know about gardening is",
    "Dear hiring manager,\n\n", "In this tutorial we will learn how to", "The weather forecast for tomorrow:",
    "Chapter 1\n\nThe door creaked open and", "Step 1: Preheat the oven to", "Meeting notes, Monday:\n-",
]


def build_prompts(tokenizer):
    def chat(text):
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return tokenizer.encode(templated, add_special_tokens=False)

    prompts = [chat(t.format(s)) for s in SUBJECTS for t in TEMPLATES]
    prompts += [tokenizer.encode(s) for s in CODE_STARTS + TEXT_STARTS]
    return prompts


def generate_data(llm, prompts, max_tokens: int, seed: int):
    from jaxinfer import SamplingParams

    sampled = [SamplingParams(temperature=0.7, top_p=0.95, max_tokens=max_tokens, seed=seed + i)
               for i in range(len(prompts))]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rng = np.random.default_rng(seed)
    greedy_idx = set(rng.choice(len(prompts), len(prompts) // 3, replace=False).tolist())
    params = [greedy if i in greedy_idx else p for i, p in enumerate(sampled)]
    outputs = llm.generate(prompts, params)
    return [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outputs)]


@functools.partial(jax.jit, static_argnums=1)
def target_features(params, config, tokens):
    """Pre-norm features [T, hidden] and the target's greedy next tokens [T]."""
    from jaxinfer.models.attention import full_sequence_attention
    from jaxinfer.models.llama import forward
    from jaxinfer.engine.spec.eagle_head import feature_logits

    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)[None]
    features, _ = forward(params, config, tokens[None], positions, full_sequence_attention(positions),
                          final_norm=False)
    return features[0], jnp.argmax(feature_logits(params, config, features[0]), -1).astype(jnp.int32)


def make_windows(model, data, window: int, stride: int):
    """Windows of entries: tokens [N, W], input features [N, W, H], target
    features [N, W, H], labels [N, W], loss mask [N, W], positions [N, W]."""
    out = {k: [] for k in ("tokens", "features", "targets", "labels", "mask", "positions")}
    for prompt, completion in data:
        ids = np.asarray(prompt + completion, np.int32)
        length = len(ids)
        padded = np.zeros(-(-length // 64) * 64, np.int32)
        padded[:length] = ids
        feats, greedy = target_features(model.params, model.config, padded)
        feats, greedy = np.asarray(feats[:length], np.float32), np.asarray(greedy[:length])
        # Entry q = 1 .. length-1: token x_q, input f_{q-1}, target f_q, label argmax(logits_q).
        q = np.arange(1, length)
        # stride < window: entries are seen both early and late in a window.
        for start in range(0, len(q) - 1, stride):
            sel = q[start: start + window]
            n = len(sel)
            pad = window - n
            padw = lambda a: np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])  # noqa: E731
            out["tokens"].append(padw(ids[sel]))
            out["features"].append(padw(feats[sel - 1]))
            out["targets"].append(padw(feats[sel]))
            out["labels"].append(padw(greedy[sel]))
            # Learn where the next token is generated text, as drafting is used there.
            out["mask"].append(padw((sel >= len(prompt) - 1).astype(np.float32)))
            out["positions"].append(padw(sel.astype(np.int32)))
    return {k: np.stack(v) for k, v in out.items()}


def losses(head, target_params, config, batch, feature_scale):
    from jaxinfer.engine.spec.eagle_head import feature_logits, head_features, window_attention

    valid = batch["positions"] > 0
    attention = window_attention(valid)

    def one_pass(features):
        pred, _ = head_features(head, target_params, config, batch["tokens"], features, batch["positions"], attention)
        logp = jax.nn.log_softmax(feature_logits(target_params, config, pred), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1)[..., 0]
        reg = jnp.mean(optax_huber((pred - batch["targets"]) / feature_scale), axis=-1)
        hit = (jnp.argmax(logp, -1) == batch["labels"]).astype(jnp.float32)
        return pred, nll, reg, hit

    mask = batch["mask"]
    total = jnp.maximum(mask.sum(), 1.0)
    pred1, nll1, reg1, hit1 = one_pass(batch["features"])
    # Second pass: entry p reads the head's own f^_{p-1} (the first entry keeps the real one).
    shifted = jnp.concatenate([batch["features"][:, :1], pred1[:, :-1]], axis=1)
    _, nll2, reg2, hit2 = one_pass(shifted)
    mean = lambda x: (x * mask).sum() / total  # noqa: E731
    loss = mean(reg1) + 0.1 * mean(nll1) + 0.5 * (mean(reg2) + 0.1 * mean(nll2))
    return loss, {"nll1": mean(nll1), "reg1": mean(reg1), "acc1": mean(hit1), "nll2": mean(nll2), "acc2": mean(hit2)}


def optax_huber(x):
    import optax

    return optax.huber_loss(x, delta=1.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default="checkpoints/eagle-smollm2-135m-instruct.safetensors")
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--stride", type=int, default=None, help="entries between window starts (default: window)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="windows per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-prompts", type=int, default=None, help="use only the first N prompts (smoke runs)")
    parser.add_argument("--json", default=None, help="write the training log here")
    parser.add_argument("--data", default=None, help="JSON file caching the generated text: written when "
                        "missing, read (skipping generation) when present")
    args = parser.parse_args()

    import optax

    from jaxinfer import LLM
    from jaxinfer.engine.spec.eagle_head import init_head, save_head

    start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    if args.data and Path(args.data).exists():  # generated text of an earlier run with the same options
        from jaxinfer import load

        model = load(args.model)
        data = [(list(p), list(c)) for p, c in json.loads(Path(args.data).read_text())]
        # Shuffle the (unused) prompt list anyway: the draw depends only on its length, so the
        # generator is left in the same state and the training order matches a run that generated.
        rng.shuffle(build_prompts(model.tokenizer))
    else:
        llm = LLM(args.model, max_num_seqs=64, max_num_batched_tokens=512)
        model = llm.model
        prompts = build_prompts(llm.tokenizer)
        rng.shuffle(prompts)
        prompts = prompts[: args.limit_prompts]
        data = generate_data(llm, prompts, args.max_tokens, args.seed)
        del llm
        if args.data:
            Path(args.data).write_text(json.dumps(data))
    num_held_out = max(1, len(data) // 10)
    held_out, train = data[:num_held_out], data[num_held_out:]
    gen_s = time.perf_counter() - start
    train_w = make_windows(model, train, args.window, args.stride or args.window)
    eval_w = make_windows(model, held_out, args.window, args.window)
    feature_scale = float(np.sqrt(np.mean(train_w["targets"] ** 2)))
    num = len(train_w["tokens"])
    print(f"data: {len(train)} train / {len(held_out)} held-out sequences, {num} windows of {args.window}, "
          f"{int(train_w['mask'].sum())} trained entries, feature RMS {feature_scale:.3f} [{gen_s:.0f}s generation]")

    head = init_head(model.config, jax.random.key(args.seed), model.params)
    steps_per_epoch = num // args.batch_size
    total_steps = steps_per_epoch * args.epochs
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, total_steps // 20), total_steps, args.lr / 20)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = optimizer.init(head)
    config, target = model.config, model.params

    # The target's weights are arguments, not closed-over constants (XLA would constant-fold them).
    @jax.jit
    def train_step(head, opt_state, target, batch):
        (loss, metrics), grads = jax.value_and_grad(losses, has_aux=True)(head, target, config, batch, feature_scale)
        updates, opt_state = optimizer.update(grads, opt_state, head)
        return optax.apply_updates(head, updates), opt_state, loss, metrics

    @jax.jit
    def eval_step(head, target, batch):
        return losses(head, target, config, batch, feature_scale)

    def evaluate(head):
        sums, weight = {}, 0.0
        for i in range(0, len(eval_w["tokens"]), args.batch_size):
            batch = {k: v[i: i + args.batch_size] for k, v in eval_w.items()}
            if len(batch["tokens"]) < args.batch_size:
                break
            w = float(batch["mask"].sum())
            _, metrics = eval_step(head, target, batch)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w
            weight += w
        return {k: v / max(weight, 1.0) for k, v in sums.items()}

    log = [{"step": 0, "eval": evaluate(head)}]
    print(f"step 0: held-out {log[0]['eval']}")
    step = 0
    for epoch in range(args.epochs):
        order = rng.permutation(num)
        for b in range(steps_per_epoch):
            idx = order[b * args.batch_size: (b + 1) * args.batch_size]
            head, opt_state, loss, metrics = train_step(head, opt_state, target, {k: v[idx] for k, v in train_w.items()})
            step += 1
            if step % 20 == 0:
                print(f"step {step}/{total_steps} loss {float(loss):.4f} "
                      + " ".join(f"{k} {float(v):.3f}" for k, v in metrics.items()), flush=True)
        log.append({"step": step, "epoch": epoch + 1, "eval": evaluate(head)})
        print(f"epoch {epoch + 1}: held-out {log[-1]['eval']}", flush=True)
    info = {"target": model.source, "window": args.window, "epochs": args.epochs, "steps": step,
            "train_sequences": len(train), "held_out": log[-1]["eval"], "seconds": time.perf_counter() - start,
            "command": "python scripts/train_draft_head.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "json")}
    save_head(args.out, head, config, args.window, info)
    print(f"wrote {args.out}: {json.dumps(info)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "log": log}, f, indent=1)


if __name__ == "__main__":
    main()
