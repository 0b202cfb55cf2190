"""Train an EAGLE-style draft head (jaxinfer/engine/spec/eagle_head.py) for a target
model on text the target generates itself, with optax.

1. Data: the target (through the engine's batched generation, `LLM.generate`)
   answers ~1,000 prompts built from the lists below: chat turns through the
   chat template (explanations, facts, lists, poems, stories, code requests in
   three languages, some with a system turn) and raw code and prose starts;
   half greedy, half sampled at temperature 0.7 with a per-prompt seed. The
   text goes to --data as JSON lines, 64 prompts at a time, so an interrupted
   run goes on where it stopped. Every 20th prompt is held out (evaluation
   only); none is one of scripts/bench_speculative.py's prompts, so the
   benchmark measures the head on chat it never saw.
2. Features: one cache-free forward per sequence gives the target's pre-norm
   hidden state f_p at every position and its greedy next token argmax(logits_p).
3. Draft vocabulary (EAGLE-3): the --draft-vocab tokens most often the
   target's greedy next token in the training text; the head gets its own
   output matrix over them (started from the target's columns) and a d2t map
   back to target ids.
4. Training-time test (EAGLE-3): windows of `window` entries (x_p, f_{p-1});
   step 1 predicts f^_p from the real features, step j (up to --ttt-steps,
   the K the head is meant for) from step j-1's predictions, attending as
   drafting does (ttt_attention), so later draft positions are trained on the
   head's own features. Per step: cross-entropy against the target's greedy
   token over the draft vocabulary plus smooth-L1 to the real feature,
   weighted 0.8^(j-1).
5. Resumable: head, optimizer state and step go to --state every
   --save-every steps; the same command resumes from it (each epoch's batch
   order depends only on seed and epoch); --stop-after N ends a piece after N
   steps. The head is written when the last epoch ends.
6. Evaluation on held-out sequences: per draft position j, the fraction of
   positions where draft j equals the target's greedy token given the earlier
   ones did ("hit j"), and the mean accepted length that implies.

Needs optax: `pip install -e ".[train]"`. The command that made the shipped
head, and what it cost, are in checkpoints/README.md.
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
    "black holes", "dinosaurs", "the stock market", "sleep", "climate change", "the French revolution",
    "machine learning", "bees", "the immune system", "renewable energy", "ancient Egypt", "octopuses",
    "public libraries", "time zones", "democracy", "the periodic table", "rock climbing", "origami", "tides",
    "the Great Wall of China", "video games", "nutrition", "airplanes", "friendship", "budgeting", "yoga",
    "the solar system", "wolves", "smartphones", "the Renaissance", "rivers", "gardening", "encryption",
    "hurricanes", "the violin", "pizza", "social media", "dolphins", "the Amazon river", "3D printing",
]
CHAT_TEMPLATES = [
    "Explain {} to a ten-year-old.", "Give me three facts about {}.", "Write a short poem about {}.",
    "What are the pros and cons of {}?", "Describe the history of {} in a paragraph.",
    "Write a short story that involves {}.", "How does {} work?", "List five questions a student might ask about {}.",
    "Write a list of tips for someone who wants to learn about {}.", "Summarize what you know about {}.",
    "Why is {} important?", "Compare {} with something from everyday life.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "finds the largest element of a list", "counts the vowels in a word", "merges two sorted lists",
    "removes duplicates from a list", "converts Celsius to Fahrenheit", "reads a file and counts its lines",
    "computes the average of a list of numbers", "checks whether a string is a palindrome",
    "returns the n-th Fibonacci number", "sorts a list with insertion sort", "flattens a nested list",
    "parses a date string", "finds the greatest common divisor of two numbers",
]
CODE_LANGUAGES = ["Python", "JavaScript", "C"]
SYSTEMS = ["You are a helpful assistant.", "You are a friendly teacher who answers briefly.",
           "You are a concise technical assistant."]
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
    "Shopping list:\n1.", "Top 10 reasons to visit Italy:\n1.", "Abstract\n\nIn this paper we",
]


def build_prompts(tokenizer, seed: int = 0) -> list[list[int]]:
    """Every training prompt, in a seeded order: chat turns through the chat
    template (explanations, lists, poems, stories, code requests; some with a
    system turn), then raw code and prose starts. None of them is one of
    scripts/bench_speculative.py's prompts, which stay held out."""
    def chat(text, system=None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return tokenizer.encode(templated, add_special_tokens=False)

    texts = [t.format(s) for s in SUBJECTS for t in CHAT_TEMPLATES]
    texts += [f"Write a {lang} function that {task}." for task in CODE_TASKS for lang in CODE_LANGUAGES]
    prompts = [chat(t, SYSTEMS[i % 8] if i % 8 < len(SYSTEMS) else None) for i, t in enumerate(texts)]
    prompts += [tokenizer.encode(s) for s in CODE_STARTS + TEXT_STARTS]
    order = np.random.default_rng(seed).permutation(len(prompts))
    return [prompts[i] for i in order]


def is_held_out(index: int) -> bool:
    """Every 20th prompt is held out from training (evaluation only), so any
    prefix of the generated data has held-out sequences."""
    return index % 20 == 0


def generate_data(model_path, prompts, path: Path, max_tokens: int, seed: int, rounds: int = 1,
                  chunk: int = 64) -> None:
    """Append the target's completions to `path` (JSON lines {"i", "prompt",
    "completion"}), `chunk` per LLM.generate call: `rounds` answers to every
    prompt, sequence i = round * len(prompts) + prompt index. Round 0 answers
    half the prompts greedily (the acceptance that matters most) and half
    sampled at temperature 0.7; later rounds sample every prompt again at 0.7
    with another seed, which is more text of the same kind where a greedy
    answer would only repeat. Each sequence has its own seed, so its text does
    not depend on which run or chunk generated it; resumable: sequences
    already in the file are skipped."""
    from jaxinfer import LLM, SamplingParams

    done = {json.loads(line)["i"] for line in path.read_text().splitlines()} if path.exists() else set()
    todo = [i for i in range(len(prompts) * rounds) if i not in done]
    if not todo:
        return
    llm = LLM(model_path, max_num_seqs=chunk, max_num_batched_tokens=512, progress=False)

    def params(i):
        if i < len(prompts) and i % 2 == 0:
            return SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return SamplingParams(temperature=0.7, top_p=0.95, max_tokens=max_tokens, seed=seed + i)

    start = time.perf_counter()
    for c in range(0, len(todo), chunk):
        idx = todo[c: c + chunk]
        outputs = llm.generate([prompts[i % len(prompts)] for i in idx], [params(i) for i in idx], use_tqdm=False)
        with path.open("a") as f:
            for i, o in zip(idx, outputs):
                f.write(json.dumps({"i": i, "prompt": prompts[i % len(prompts)],
                                    "completion": list(o.outputs[0].token_ids)}) + "\n")
        n = len(done) + c + len(idx)
        print(f"generated {n}/{len(prompts) * rounds} sequences [{time.perf_counter() - start:.0f}s]", flush=True)


def read_data(path: Path) -> list[tuple[int, list[int], list[int]]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((r["i"], r["prompt"], r["completion"]) for r in rows)


@functools.partial(jax.jit, static_argnums=(1, 3))
def target_features(params, config, tokens, backend):
    """Pre-norm features [T, hidden] and the target's greedy next tokens [T]."""
    from jaxinfer.models.attention import full_sequence_attention
    from jaxinfer.models.llama import forward
    from jaxinfer.engine.spec.eagle_head import feature_logits

    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)[None]
    features, _ = forward(params, config, tokens[None], positions, full_sequence_attention(positions),
                          backend=backend, final_norm=False)
    logits = feature_logits(params, config, features[0], backend=backend)
    return features[0], jnp.argmax(logits, -1).astype(jnp.int32)


def make_windows(model, data, window: int):
    """Windows of `window` consecutive entries: tokens [N, W], features
    [N, W + 1, H] (entry i reads features[i] = f_{q-1} and should predict
    features[i + 1] = f_q), labels [N, W] (the target's greedy token after
    x_q), loss mask [N, W], positions [N, W] (0 marks padding: entries start at
    position 1). Features are float16 to halve the memory of a large run."""
    out = {k: [] for k in ("tokens", "features", "labels", "mask", "positions")}
    for _, prompt, completion in data:
        ids = np.asarray(prompt + completion, np.int32)
        length = len(ids)
        padded = np.zeros(-(-length // 64) * 64, np.int32)
        padded[:length] = ids
        feats, greedy = target_features(model.params, model.config, padded, model.backend)
        feats, greedy = np.asarray(feats[:length], np.float16), np.asarray(greedy[:length])
        q = np.arange(1, length)  # entry q: token x_q, input f_{q-1}, target f_q, label argmax(logits_q)
        for start in range(0, len(q) - 1, window):
            sel = q[start: start + window]
            if sel[-1] < len(prompt) - 1:  # all prompt: nothing to learn there (see the mask below)
                continue
            pad = window - len(sel)
            padw = lambda a: np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])  # noqa: E731
            out["tokens"].append(padw(ids[sel]))
            out["features"].append(padw(feats[np.concatenate([sel - 1, sel[-1:]])]))
            out["labels"].append(padw(greedy[sel]))
            # Learn where the next token is generated text, as drafting is used there.
            out["mask"].append(padw((sel >= len(prompt) - 1).astype(np.float32)))
            out["positions"].append(padw(sel.astype(np.int32)))
    return {k: np.stack(v) for k, v in out.items()}


def cached_windows(model, train, held_out, window: int, data_path: Path):
    """make_windows of the training and held-out sequences, kept beside the
    data (DATA.windowsW.npz) so that a training run done in pieces computes
    the target's features once (a forward per sequence: minutes for a few
    thousand). The cache names the sequences it holds and is rebuilt when the
    data differs."""
    path = data_path.with_name(f"{data_path.stem}.windows{window}.npz")
    key = json.dumps([[row[0] for row in train], [row[0] for row in held_out], str(model.source)])
    if path.exists():
        cached = np.load(path)
        if str(cached["key"]) == key:
            split = lambda prefix: {k[len(prefix):]: cached[k] for k in cached.files if k.startswith(prefix)}  # noqa: E731
            return split("train."), split("eval.")
    train_w, eval_w = make_windows(model, train, window), make_windows(model, held_out, window)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, key=key, **{f"train.{k}": v for k, v in train_w.items()},
             **{f"eval.{k}": v for k, v in eval_w.items()})
    tmp.replace(path)
    return train_w, eval_w


def choose_draft_vocab(labels, mask, vocab_size: int, size: int):
    """The `size` target tokens most often the target's greedy next token in
    generated text (ties by id, so the choice is reproducible), sorted by id;
    -> (d2t [size], t2d [vocab_size] with -1 for tokens outside, coverage)."""
    counts = np.bincount(labels[mask > 0].ravel(), minlength=vocab_size)
    d2t = np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)
    t2d = np.full(vocab_size, -1, np.int32)
    t2d[d2t] = np.arange(size, dtype=np.int32)
    return d2t, t2d, float(counts[d2t].sum() / max(counts.sum(), 1))


def ttt_attention(step: int, valid):
    """Training-time test: attention of draft step `step` (1 = the real
    entries) over the window. Row p of step j stands for the j-th draft made
    right after real entry p - j + 1, so it sees what drafting would: the real
    entries up to p - j + 1 (step 1's keys) and, of each later step i <= j,
    only its own chain's entry, row p - (j - i). The keys of steps 1..j-1
    arrive as the 'cache' and this step's are appended to it."""
    def attend(q, k, v, cache, layer_index):
        keys, values = cache
        keys, values = keys + [k], values + [v]
        batch, length, num_heads, head_dim = q.shape
        p = jnp.arange(length)[:, None]
        r = jnp.arange(length)[None, :]
        blocks = [r <= p - (step - 1)] + [r == p - (step - i) for i in range(2, step + 1)]
        mask = jnp.concatenate(blocks, axis=1)[None] & jnp.tile(valid, (1, step))[:, None, :]  # [B, T, step*T]
        k_all, v_all = jnp.concatenate(keys, axis=1), jnp.concatenate(values, axis=1)
        kv_heads = k_all.shape[2]
        qg = q.reshape(batch, length, kv_heads, num_heads // kv_heads, head_dim)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_all, preferred_element_type=jnp.float32) * head_dim ** -0.5
        scores = jnp.where(mask[:, None, None], scores, -1e30)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_all.dtype), v_all, preferred_element_type=jnp.float32)
        return out.reshape(batch, length, num_heads, head_dim).astype(q.dtype), (keys, values)

    return attend


def losses(head, target_params, config, batch, feature_scale, num_steps: int, backend):
    """Training-time test over num_steps draft steps: step 1 reads the
    target's real features; step j reads step j-1's predicted features (entry
    p gets the prediction made at p - 1), with the attention drafting would
    have (ttt_attention), so the head is trained where it drafts: on its own
    earlier predictions, at every draft position up to K. Per step:
    cross-entropy of the draft-vocabulary logits against the target's greedy
    token (tokens outside the draft vocabulary are skipped: they can never be
    drafted), plus smooth-L1 of the predicted feature against the real one."""
    from jaxinfer.engine.spec.eagle_head import draft_logits, head_features

    valid = batch["positions"] > 0
    length = valid.shape[1]
    labels = batch["labels"]  # draft ids, -1 outside the draft vocabulary
    base = batch["mask"] * (labels >= 0)
    real = batch["features"][:, :-1].astype(jnp.float32)
    targets = batch["features"][:, 1:].astype(jnp.float32)
    inputs, cache = real, ([], [])
    loss, metrics = 0.0, {}
    for step in range(1, num_steps + 1):
        pred, cache = head_features(head, target_params, config, batch["tokens"], inputs, batch["positions"],
                                    ttt_attention(step, valid), cache, backend=backend)
        logp = jax.nn.log_softmax(draft_logits(head, target_params, config, pred, backend=backend), axis=-1)
        nll = -jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        reg = jnp.mean(optax_huber((pred - targets) / feature_scale), axis=-1)
        hit = (jnp.argmax(logp, -1) == labels).astype(jnp.float32)
        # Rows before step - 1 have no chain of step drafts inside the window.
        mask = base * (jnp.arange(length) >= step - 1)[None]
        mean = lambda x: (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)  # noqa: E731
        loss = loss + 0.8 ** (step - 1) * (mean(nll) + mean(reg))
        metrics[f"nll{step}"], metrics[f"acc{step}"] = mean(nll), mean(hit)
        # Coverage-corrected accuracy: a label outside the draft vocabulary is a miss.
        full = batch["mask"] * (jnp.arange(length) >= step - 1)[None]
        metrics[f"hit{step}"] = (hit * full).sum() / jnp.maximum(full.sum(), 1.0)
        inputs = jnp.concatenate([jnp.zeros_like(pred[:, :1]), pred[:, :-1]], axis=1)
    return loss, metrics


def optax_huber(x):
    import optax

    return optax.huber_loss(x, delta=1.0)


def save_state(path: Path, head, opt_state, step: int, fingerprint: str) -> None:
    """The training state (head, optimizer state, step) as one .npz, written
    beside and renamed, so an interrupted save never leaves a broken file."""
    leaves = jax.tree.leaves((head, opt_state))
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, step=step, fingerprint=fingerprint, **{f"leaf{i}": np.asarray(x) for i, x in enumerate(leaves)})
    tmp.replace(path)


def load_state(path: Path, head, opt_state, fingerprint: str):
    data = np.load(path)
    if str(data["fingerprint"]) != fingerprint:
        raise SystemExit(f"{path} was saved by a run with other options ({data['fingerprint']}); "
                         f"this run is {fingerprint}")
    treedef = jax.tree.structure((head, opt_state))
    leaves = [jnp.asarray(data[f"leaf{i}"]) for i in range(treedef.num_leaves)]
    head, opt_state = jax.tree.unflatten(treedef, leaves)
    return head, opt_state, int(data["step"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default="checkpoints/eagle-smollm2-135m-instruct.safetensors")
    parser.add_argument("--data", default="eagle_data.jsonl", help="JSON lines of generated text: extended "
                        "(resumably) until it holds --rounds answers to each of --num-sequences prompts, then trained on")
    parser.add_argument("--num-sequences", type=int, default=0, help="the first N prompts of the seeded order (0: all 987)")
    parser.add_argument("--rounds", type=int, default=3, help="answers per prompt (round 0 half greedy, later "
                        "rounds sampled with other seeds)")
    parser.add_argument("--generate-only", action="store_true", help="stop after generating the data")
    parser.add_argument("--state", default=None, help="training state (.npz): resumed from when present, "
                        "saved every --save-every steps (default: OUT with .state.npz)")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--stop-after", type=int, default=None, help="optimizer steps to run in this piece "
                        "(the state is saved; run again to go on)")
    parser.add_argument("--export", action="store_true", help="write the head from the saved state as it is "
                        "(a run stopped early), without training further")
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (0: the target's)")
    parser.add_argument("--ttt-steps", type=int, default=4, help="draft steps unrolled in training (K)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="windows per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the training log here")
    args = parser.parse_args()

    import optax

    from jaxinfer import load
    from jaxinfer.engine.spec.eagle_head import init_head, save_head

    start = time.perf_counter()
    model = load(args.model, progress=False)
    prompts = build_prompts(model.tokenizer, args.seed)[: args.num_sequences or None]
    data_path = Path(args.data)
    generate_data(args.model, prompts, data_path, args.max_tokens, args.seed, args.rounds)
    if args.generate_only:
        return
    data = [row for row in read_data(data_path) if row[0] < len(prompts) * args.rounds]
    # Held out by prompt, so no answer to a held-out prompt is trained on in any round.
    held_out = [row for row in data if is_held_out(row[0] % len(prompts))]
    train = [row for row in data if not is_held_out(row[0] % len(prompts))]
    gen_s = time.perf_counter() - start
    train_w, eval_w = cached_windows(model, train, held_out, args.window, data_path)
    config, target = model.config, model.params
    if args.draft_vocab:
        d2t, t2d, coverage = choose_draft_vocab(train_w["labels"], train_w["mask"], config.vocab_size,
                                                args.draft_vocab)
    else:
        d2t, t2d, coverage = np.arange(config.vocab_size, dtype=np.int32), np.arange(config.vocab_size), 1.0
    for w in (train_w, eval_w):
        w["labels"] = t2d[w["labels"]]
    feature_scale = float(np.sqrt(np.mean(train_w["features"][:, :4].astype(np.float32) ** 2)))
    num = len(train_w["tokens"])
    print(f"data: {len(train)} train / {len(held_out)} held-out sequences, {num} windows of {args.window}, "
          f"{int(train_w['mask'].sum())} trained entries, draft vocabulary {len(d2t)} covering {coverage:.1%} "
          f"of labels, feature RMS {feature_scale:.3f} [{gen_s:.0f}s to here]", flush=True)

    head = init_head(config, jax.random.key(args.seed), target)
    if args.draft_vocab:
        # The draft output matrix starts as the target's own columns for the chosen tokens.
        eye = jnp.eye(config.hidden_size, dtype=target["final_norm"].dtype)
        head["lm_head"] = jnp.asarray(np.asarray(model.backend.logits(target, eye))[:, d2t], jnp.float32)
    trainable = head
    steps_per_epoch = num // args.batch_size
    total_steps = steps_per_epoch * args.epochs
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, total_steps // 20), total_steps, args.lr / 20)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = optimizer.init(trainable)
    fingerprint = json.dumps({k: v for k, v in sorted(vars(args).items())
                              if k in ("window", "draft_vocab", "ttt_steps", "epochs", "batch_size", "lr", "seed",
                                       "num_sequences", "max_tokens", "rounds")} | {"windows": num})
    state_path = Path(args.state or Path(args.out).with_suffix(".state.npz"))
    step = 0
    if state_path.exists():
        trainable, opt_state, step = load_state(state_path, trainable, opt_state, fingerprint)
        print(f"resumed from {state_path} at step {step}/{total_steps}", flush=True)
    d2t_device = jnp.asarray(d2t)

    def with_vocab(params):
        return params | {"d2t": d2t_device} if args.draft_vocab else params

    # The target's weights are arguments, not closed-over constants (XLA would constant-fold them).
    @jax.jit
    def train_step(params, opt_state, target, batch):
        (loss, metrics), grads = jax.value_and_grad(
            lambda h: losses(h, target, config, batch, feature_scale, args.ttt_steps, model.backend),
            has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    @jax.jit
    def eval_step(params, target, batch):
        return losses(params, target, config, batch, feature_scale, args.ttt_steps, model.backend)

    def evaluate(params):
        sums, batches = {}, 0
        for i in range(0, len(eval_w["tokens"]), args.batch_size):  # the last, smaller batch compiles once more
            _, metrics = eval_step(params, target, {k: v[i: i + args.batch_size] for k, v in eval_w.items()})
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            batches += 1
        metrics = {k: v / max(batches, 1) for k, v in sums.items()}
        # Expected tokens per verification if draft j is accepted with probability hit_j given draft j-1 was.
        run, metrics["expected_accepted_length"] = 1.0, 1.0
        for j in range(1, args.ttt_steps + 1):
            run *= metrics.get(f"hit{j}", 0.0)
            metrics["expected_accepted_length"] += run
        return metrics

    def fmt(metrics):
        return " ".join(f"{k} {v:.3f}" for k, v in metrics.items() if not k.startswith("nll"))

    log = []
    if step == 0:
        log.append({"step": 0, "eval": evaluate(trainable)})
        print(f"step 0: held-out {fmt(log[0]['eval'])}", flush=True)
    stop = total_steps if args.stop_after is None else min(total_steps, step + args.stop_after)
    if args.export:
        stop = step
    t0 = time.perf_counter()
    while step < stop:
        epoch, b = divmod(step, steps_per_epoch)
        # Each epoch's order depends only on the seed and the epoch, so a resumed run sees the same batches.
        order = np.random.default_rng([args.seed, epoch]).permutation(num)
        idx = np.sort(order[b * args.batch_size: (b + 1) * args.batch_size])
        trainable, opt_state, loss, metrics = train_step(trainable, opt_state, target,
                                                         {k: v[idx] for k, v in train_w.items()})
        step += 1
        if step % 20 == 0:
            print(f"step {step}/{total_steps} loss {float(loss):.4f} {fmt({k: float(v) for k, v in metrics.items()})}"
                  f" [{(time.perf_counter() - t0) / 20:.2f} s/step]", flush=True)
            t0 = time.perf_counter()
        if step % args.save_every == 0 or step == stop:
            save_state(state_path, trainable, opt_state, step, fingerprint)
        if step % steps_per_epoch == 0 or step == stop:
            log.append({"step": step, "epoch": step / steps_per_epoch, "eval": evaluate(trainable)})
            print(f"step {step} (epoch {step / steps_per_epoch:.2f}): held-out {fmt(log[-1]['eval'])}", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(log) + "\n")
    if step < total_steps and not args.export:
        print(f"stopped at step {step}/{total_steps}; run the same command again to go on from {state_path}")
        return
    info = {"target": Path(str(model.source)).name, "window": args.window, "epochs": args.epochs, "steps": step,
            "total_steps": total_steps,
            "ttt_steps": args.ttt_steps, "draft_vocab": len(d2t), "draft_vocab_coverage": coverage,
            "train_sequences": len(train), "held_out_sequences": len(held_out),
            "held_out": log[-1]["eval"] if log else evaluate(trainable),
            "command": "python scripts/train_draft_head.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                if v is not None and v is not False and k not in ("json", "stop_after", "export"))}
    save_head(args.out, with_vocab(trainable), config, args.window, info)
    print(f"wrote {args.out}: {json.dumps(info)}")


if __name__ == "__main__":
    main()
