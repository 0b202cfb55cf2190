"""Context-parallel checks, run by tests/parallel/test_context_parallel.py in one
subprocess whose XLA_FLAGS give JAX 8 virtual CPU devices.
`python -m tests.ring_checks GROUP...`; each group asserts and prints what it
compared; a failure exits non-zero.

References are independent of the code under test: float64 numpy attention
over the logical (unpaged) K/V for the attention itself, and for the engine
the single-device model's uncached full-sequence forward (models/attention.py,
one device, no pool, no ring).
"""

from __future__ import annotations

import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM, SamplingParams, load
from jaxinfer.errors import RequestError
from tests.parallel_checks import compiled_forward, count_compilations, log
from tests.tiny_models import make_hf_model, save_hf_model

VOCAB = 128
ENGINE = dict(block_size=16, max_num_seqs=2, max_num_batched_tokens=512)


# -- the attention alone, against float64 numpy --------------------------------------------


def numpy_attention(q, k, v, q_pos, sliding_window=None):
    """float64: q [R, H, D] at positions q_pos [R] over one sequence's k, v [L, KV, D] (key i at position i)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = np.repeat(k.astype(np.float64), heads // kv_heads, axis=1)
    v = np.repeat(v.astype(np.float64), heads // kv_heads, axis=1)
    scores = np.einsum("rhd,lhd->rhl", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    key_pos = np.arange(k.shape[0])
    mask = key_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= q_pos[:, None] - key_pos[None, :] < sliding_window
    scores = np.where(mask[:, None, :], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("rhl,lhd->rhd", probs, v)


def attention_group():
    """ring_cache_attention on a ragged step (cached prefixes of many blocks,
    new chunks, a decode row) over a block-split pool whose blocks were
    handed out by the block manager, against float64 numpy over each
    sequence's whole K/V; with a sliding window too; and the pool afterwards
    holds every new row at its slot."""
    from jaxinfer.engine.block_manager import BlockManager
    from jaxinfer.engine.inputs import build_inputs
    from jaxinfer.models.ring_attention import ring_cache_attention
    from jaxinfer.parallel.mesh import replica_meshes
    from jaxinfer.parallel.sharding import kv_cache_specs, named

    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim, block_size, layers = 4, 2, 8, 4, 2
    for cp, tp in ((2, 1), (4, 1), (8, 1), (2, 2)):
        mesh = replica_meshes(tp, context_parallel_size=cp)[0]
        num_blocks = cp * 24
        # (cached tokens, new tokens) per sequence; the step's rows: 5 + 7 + 1 = 13, bucket 16
        for layout, shapes in (("mixed", [(37, 5), (0, 7), (50, 1)]), ("decode", [(37, 1), (66, 1)])):
            bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False, num_devices=cp)
            lengths = [c + n for c, n in shapes]
            tables = []
            for i, length in enumerate(lengths):
                bm.allocate_prefix(i, [0] * length)
                assert bm.allocate(i, length)
                tables.append(bm.block_table(i))
            # Every sequence's blocks spread over the devices (most room first).
            owners = [{b // (num_blocks // cp) for b in t} for t in tables]
            assert all(len(o) == min(cp, len(t)) for o, t in zip(owners, tables)), (owners, tables)
            k_all = [rng.normal(size=(n, kv_heads, head_dim)).astype(np.float32) for n in lengths]
            v_all = [rng.normal(size=(n, kv_heads, head_dim)).astype(np.float32) for n in lengths]
            # NaN wherever nothing was written: a slot past a context (or a block nobody
            # holds) that leaked into the softmax would show.
            pool_k = np.full((layers, num_blocks, block_size, kv_heads, head_dim), np.nan, np.float32)
            pool_v = pool_k.copy()
            layer = 1
            for i, (cached, _) in enumerate(shapes):  # the cached prefix, written in earlier steps
                for pos in range(cached):
                    b, o = tables[i][pos // block_size], pos % block_size
                    pool_k[layer, b, o], pool_v[layer, b, o] = k_all[i][pos], v_all[i][pos]
            num_tokens = 16 if layout == "mixed" else len(shapes)
            num_seqs = 8 if layout == "mixed" else len(shapes)
            inputs = build_inputs([[0] * n for _, n in shapes], [c for c, _ in shapes], [n for _, n in shapes], tables,
                                  num_tokens=num_tokens, num_seqs=num_seqs, layout=layout, block_size=block_size,
                                  max_blocks_per_seq=-(-80 // block_size))
            meta = inputs.attn_meta
            q = rng.normal(size=(num_tokens, heads, head_dim)).astype(np.float32)
            k_new = np.zeros((num_tokens, kv_heads, head_dim), np.float32)
            v_new = np.zeros_like(k_new)
            start = 0
            for i, (cached, new) in enumerate(shapes):
                k_new[start:start + new], v_new[start:start + new] = k_all[i][cached:], v_all[i][cached:]
                start += new
            # The window is a traced argument, so one compilation serves both: 9 tokens, and one
            # longer than every sequence (no window in effect; the engine runs the window=None form).
            attend = jax.jit(lambda q, k, v, pools, meta, window, layout=layout: ring_cache_attention(
                meta, window, layout == "decode", mesh)(q, k, v, pools, jnp.int32(layer)))
            for window in (None, 9):
                pools = jax.device_put((jnp.asarray(pool_k), jnp.asarray(pool_v)), named(kv_cache_specs(False, True),
                                                                                           mesh))
                out, (new_k_pool, new_v_pool) = attend(q[None], k_new[None], v_new[None], pools, meta,
                                                       jnp.int32(2**30 if window is None else window))
                out = np.asarray(out[0])
                err = 0.0
                start = 0
                for i, (cached, new) in enumerate(shapes):
                    q_pos = np.arange(cached, cached + new)
                    want = numpy_attention(q[start:start + new], k_all[i], v_all[i], q_pos, window)
                    err = max(err, float(np.abs(out[start:start + new] - want).max()))
                    start += new
                assert err < 1e-5, (cp, tp, layout, window, err)
                new_k_pool = np.asarray(new_k_pool)
                for i, length in enumerate(lengths):
                    stored = np.stack([new_k_pool[layer, tables[i][p // block_size], p % block_size]
                                       for p in range(length)])
                    np.testing.assert_array_equal(stored, k_all[i])
            log(f"attention CP{cp} x TP{tp} {layout}: equals float64 numpy (max err {err:.1e}, with and without "
                f"a sliding window); the pool holds every row at its slot")


# -- the engine, against the single-device model -------------------------------------------


_SHARED = {}


def shared_model():
    """(checkpoint directory, Reference) shared by the groups of one process:
    writing the checkpoint and compiling the reference forward cost seconds."""
    if not _SHARED:
        directory = save_hf_model(make_hf_model("llama_ring", seed=3), tempfile.mkdtemp())
        _SHARED.update(directory=directory, reference=Reference(load(directory, progress=False)))
    return _SHARED["directory"], _SHARED["reference"]


def greedy(n, logprobs=3):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


class Reference:
    """The single-device model's uncached full-sequence logits (float64
    log-softmax), memoised: every context-parallel run of the same request
    is checked against the same forward."""

    def __init__(self, model):
        self.model, self.cache = model, {}

    def logprobs(self, tokens):
        key = tuple(tokens)
        if key not in self.cache:
            logits = self.model.logits(tokens).astype(np.float64)
            logits -= logits.max(-1, keepdims=True)
            self.cache[key] = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return self.cache[key]


def check_against_reference(reference, prompts, outputs, tol=1e-4):
    """Each completion is the single-device model's greedy continuation, and
    its top logprobs equal the model's: one uncached forward of prompt +
    completion per request (teacher forcing)."""
    err = 0.0
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        logprobs = reference.logprobs(list(prompt) + completion.token_ids[:-1])[len(prompt) - 1:]
        assert completion.token_ids == logprobs.argmax(-1).tolist(), (len(prompt), completion.token_ids)
        for row, entry in zip(logprobs, completion.logprobs):
            for token, lp in entry.items():
                err = max(err, abs(lp.logprob - row[token]))
    assert err < tol, err
    return err


def engine_group():
    """Prompts of 1k to 8k tokens (chunked: 512-token steps) and a short one
    at CP 8 and CP 2 x TP 2 (CP 4 runs in the capacity group): greedy
    continuations and logprobs equal the single-device model's; no
    compilation after warm-up; a prefix-cache hit on a long shared prefix
    serves the same tokens; every device holds 1 / C of the pool; the
    compiled CP 2 x TP 2 steps hold only the expected collectives."""
    directory, reference = shared_model()
    rng = np.random.default_rng(1)
    long_prompt = rng.integers(0, VOCAB, 8000).tolist()
    prompts = [rng.integers(0, VOCAB, 1024).tolist(), long_prompt[:2600], rng.integers(0, VOCAB, 9).tolist()]
    shared = long_prompt[:2048] + rng.integers(0, VOCAB, 100).tolist()  # hits 2048 cached tokens of prompts[1]
    for cp, tp, longest in ((8, None, long_prompt), (2, 2, None)):
        start = time.perf_counter()
        per_device = 544 // (tp or 1)  # 8704 tokens' worth at CP 8; the 8k prompt and the others together
        llm = LLM(directory, progress=False, context_parallel_size=cp, tensor_parallel_size=tp,
                  max_model_len=8192 + 16, num_kv_blocks=cp * per_device, **ENGINE)
        startup = time.perf_counter() - start
        pool = llm.engine.runner.kv_cache[0]
        for shard in pool.addressable_shards:
            assert shard.data.shape[1] == per_device, shard.data.shape  # each device holds its 1 / cp of the blocks
        batch = prompts + ([longest] if longest else [])
        llm.wait_compiled()  # the buckets left to the background compile, before counting
        with count_compilations(llm) as compiled:
            outputs = llm.generate(batch, greedy(3), use_tqdm=False)
            hits_before = llm.stats()["prefix_cache_hits"]
            hit = llm.generate([shared], greedy(3), use_tqdm=False)
        assert not compiled, f"compiled after warm-up: {compiled}"
        hits = llm.stats()["prefix_cache_hits"] - hits_before
        assert hits == 2048, hits
        err = check_against_reference(reference, batch + [shared], outputs + hit)
        log(f"engine CP{cp} x TP{tp or 1}: prompts {[len(p) for p in batch]} + a {hits}-token prefix hit equal "
            f"single-device (max |logprob diff| {err:.1e}), no compilation after warm-up, startup {startup:.1f}s")
        if tp:  # CP 4 is checked in the capacity group; CP 8's programs differ only in C (compiling them costs ~6 s)
            check_collectives(llm, cp, tp)


def capacity_group():
    """A context that does not fit one device's KV budget (num_kv_blocks
    blocks) fits across 4 devices holding that many blocks each, is served
    correctly, and the reported maximum context is 4x; during the prompt the
    devices' blocks stay balanced. And what context parallelism refuses at
    start-up."""
    directory, reference = shared_model()
    per_device = 64  # blocks of 16 tokens: 63 usable on one device (the null block), 1008 tokens
    prompt = np.random.default_rng(2).integers(0, VOCAB, 3000).tolist()
    # One device with this budget could not hold it (the engine refuses such a request up front,
    # tests/engine/test_engine.py); CP 4 with the same budget per device must serve it.
    assert -(-(len(prompt) + 2) // 16) > per_device - 1
    # One sequence: max_num_seqs 1 spares compiling the 2-row programs.
    llm = LLM(directory, progress=False, max_model_len=8192, num_kv_blocks=4 * per_device, context_parallel_size=4,
              **{**ENGINE, "max_num_seqs": 1})
    assert {s.data.shape[1] for s in llm.engine.runner.kv_cache[0].addressable_shards} == {per_device}
    max_one, max_four = (per_device - 1) * 16, llm.stats()["max_context_len"]
    assert max_four == (4 * per_device - 1) * 16, max_four  # all 4 devices' blocks, less the null block
    # Past the maximum context: refused up front, the message naming it.
    try:
        llm.generate([prompt + prompt], greedy(2), use_tqdm=False)
        raise AssertionError("a request longer than the maximum context was accepted")
    except RequestError as e:
        assert f"maximum context {max_four} tokens" in str(e), e
    # Watch the allocator while the prompt's chunks run: no device ever holds more than one block above another.
    bm = llm.engine.block_manager
    spread = []
    original = bm.allocate

    def watched(seq_id, num_tokens):
        ok = original(seq_id, num_tokens)
        free = bm._free.free_per_device()
        free[0] += 1  # device 0's null block
        spread.append(max(free) - min(free))
        return ok

    bm.allocate = watched
    llm.wait_compiled()  # the buckets left to the background compile, before counting
    with count_compilations(llm) as compiled:
        outputs = llm.generate([prompt], greedy(2), use_tqdm=False)
    assert not compiled, f"compiled after warm-up: {compiled}"
    assert spread and max(spread) <= 1, spread
    err = check_against_reference(reference, [prompt], outputs)
    log(f"capacity: {len(prompt)} tokens, more than one device's {per_device} blocks hold ({max_one} tokens), "
        f"served by CP4 with {per_device} per device (max context {max_four}); equal single-device "
        f"(|logprob diff| {err:.1e}); blocks per device never more than 1 apart over {len(spread)} allocations")
    check_collectives(llm, 4, 1)
    refused = [(dict(kv_cache_dtype="int8"), "kv_cache_dtype='auto'"),
               (dict(attention="pallas"), "attention must be 'reference' or unset"),
               (dict(speculative=dict(method="ngram", num_speculative_tokens=2)), "speculative"),
               (dict(enable_lora=True), "LoRA"),
               (dict(num_kv_blocks=4 * per_device + 2), "multiple of context_parallel_size")]
    for options, message in refused:
        try:
            LLM(directory, progress=False, context_parallel_size=4, max_model_len=256, **options)
            raise AssertionError(f"context parallelism accepted {options}")
        except ValueError as e:
            assert message in str(e), (options, e)
    log(f"capacity: refused at start-up with CP4: {[next(iter(o)) for o, _ in refused]}")


# -- the compiled programs' collectives ------------------------------------------------------


def collectives(llm, layout):
    text, n_tok, n_seq = compiled_forward(llm, layout)
    found = []
    for line in text.split("\n"):
        op = re.search(r" (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(", line)
        if op:
            # The result's shape; a tuple result (the CPU backend's all-to-all: one piece per device) by its first piece.
            shape = re.search(r"= \(?([a-z0-9]+\[[0-9,]*\])", line)
            found.append((op.group(1), shape.group(1)))
    return found, n_tok, n_seq


def check_collectives(llm, cp, tp):
    """The compiled forward programs contain only the expected collectives: a
    prompt step, the ring's collective-permutes (new K/V [T/C, KV, 2D];
    queries [T/C, H, D]; partial statistics sent home [T/C, KV, G, D + 2])
    and the logits rows; a decode step, the one
    all-gather of the partial statistics [C, T, KV, G, D + 2]; plus, with TP,
    its usual all-reduces of [tokens, hidden] and the logits gather. Nothing
    of the pool's or a whole step's K/V is ever gathered."""
    hidden, heads, kv_heads, head_dim = 32, 4, 2, 8
    kv, group = kv_heads // tp, heads // kv_heads
    for layout in ("mixed", "decode"):
        found, n_tok, n_seq = collectives(llm, layout)
        rows = n_tok // cp
        allowed = {("all-reduce", f"f32[{n_seq},{hidden}]")}  # the sampled rows' hidden states, token-split
        if layout == "mixed":
            allowed |= {("collective-permute", f"f32[{rows},{kv},{2 * head_dim}]"),
                        ("collective-permute", f"f32[{rows},{heads // tp},{head_dim}]"),  # the queries
                        ("collective-permute", f"f32[{rows},{kv},{group},{head_dim + 2}]")}  # the partials
            tp_rows = rows
        else:
            allowed |= {("all-gather", f"f32[{cp},{n_tok},{kv},{group},{head_dim + 2}]")}
            tp_rows = n_tok
        if tp > 1:
            allowed |= {("all-reduce", f"f32[1,{tp_rows},{hidden}]"), ("all-gather", f"f32[{n_seq},{VOCAB}]")}
        assert set(found) <= allowed, (cp, tp, layout, sorted(set(found) - allowed))
        permutes = sum(op == "collective-permute" for op, _ in found)
        gathers = [t for op, t in found if op == "all-gather" and t != f"f32[{n_seq},{VOCAB}]"]
        if layout == "mixed":
            # Per layer (the scan body): the K/V ring, the query ring and the partials
            # sent home, C - 1 hops each.
            assert permutes == 3 * (cp - 1), found
            assert not gathers, found
        else:
            assert permutes == 0 and len(gathers) == 1, found
        log(f"CP{cp} x TP{tp} {layout} step collectives: {found}")


GROUPS = {"attention": attention_group, "engine": engine_group, "capacity": capacity_group}

if __name__ == "__main__":
    for group in sys.argv[1:]:
        start = time.perf_counter()
        GROUPS[group]()
        log(f"{group}: ok in {time.perf_counter() - start:.1f}s")
