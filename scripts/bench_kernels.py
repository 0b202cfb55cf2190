"""Attention kernel benchmark: our Pallas kernels against their plain-jnp
references under XLA and against JAX's shipped peers.

Decode (one query token per sequence, paged cache, bf16):
  ours       pallas_kernels.paged_decode_attention
  jnp-ref    its plain-jnp reference, jitted
  xla-engine jaxinfer's "xla" backend (tiled online softmax in jnp)
  jax-paged  jax.experimental.pallas.ops.gpu.paged_attention (its own
             [kv_heads, pages, page_size, head_dim] layout, built untimed)
  Reported: time, achieved bandwidth = bytes of K/V read / time, and that as
  a share of the measured device-to-device copy bandwidth.
Prefill (one sequence, the whole prompt as one chunk over the paged cache):
  ours       pallas_kernels.paged_prefill_attention
  jnp-ref    its plain-jnp reference (skipped where it would not fit)
  jax-sdpa   jax.nn.dot_product_attention(is_causal=True) on contiguous K/V,
             and with implementation="cudnn" where available
  Reported: time and TFLOP/s of causal attention (2 matmuls, half the square).

Every variant is checked against ours before it is timed (max abs difference
is printed), so a broken kernel cannot post a fast number.

GPU:  python scripts/bench_kernels.py            (writes bench_kernels.json)
CPU:  python scripts/bench_kernels.py --quick --interpret   (a smoke run, not a measurement)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a plain checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxinfer.bench_timing import copy_bandwidth_gbs, time_ms  # noqa: E402
from pallas_kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference  # noqa: E402
from pallas_kernels.paged_prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_reference,
)




def paged_cache(rng_key, num_seqs, context_len, num_kv_heads, head_dim, block_size, dtype):
    """A one-layer pool with each sequence's blocks scattered (a random permutation)."""
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = 1 + num_seqs * blocks_per_seq
    k_key, v_key, perm_key = jax.random.split(rng_key, 3)
    shape = (1, num_blocks, block_size, num_kv_heads, head_dim)
    k_pool = jax.random.normal(k_key, shape, dtype)
    v_pool = jax.random.normal(v_key, shape, dtype)
    tables = 1 + jax.random.permutation(perm_key, num_blocks - 1).reshape(num_seqs, blocks_per_seq)
    return k_pool, v_pool, tables.astype(jnp.int32)


def max_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def bench_decode(args, batch, context_len, copy_gbs):
    num_heads, num_kv_heads, head_dim, block_size, dtype = args.num_heads, args.num_kv_heads, args.head_dim, 16, args.dtype
    key = jax.random.key(batch * 100003 + context_len)
    k_pool, v_pool, tables = paged_cache(key, batch, context_len, num_kv_heads, head_dim, block_size, dtype)
    q = jax.random.normal(jax.random.fold_in(key, 1), (batch, 1, num_heads, head_dim), dtype)
    lens = jnp.full((batch,), context_len, jnp.int32)
    layer = jnp.int32(0)
    variants = {
        "ours": jax.jit(lambda q, k, v, t, n: paged_decode_attention(q, k, v, layer, t, n, interpret=args.interpret)),
        "jnp-ref": jax.jit(lambda q, k, v, t, n: paged_decode_attention_reference(q, k, v, layer, t, n)),
        "xla-engine": jax.jit(lambda q, k, v, t, n: _engine_xla_decode(q, k, v, t, n)),
    }
    inputs = {name: (q, k_pool, v_pool, tables, lens) for name in variants}
    if not args.interpret or args.with_jax_peers:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        # The shipped kernel's layout: [kv_heads, pages, page_size, head_dim], built outside the timing.
        k_pages, v_pages = (jnp.moveaxis(p[0], 2, 0) for p in (k_pool, v_pool))
        # It leaves the 1/sqrt(head_dim) softmax scale to the caller, and wants the
        # pages per sequence divisible by k_splits, and those by pages_per_compute_block.
        pages = tables.shape[1]
        k_splits = next(k for k in (16, 8, 4, 2, 1) if pages % k == 0)
        per_block = next(p for p in (8, 4, 2, 1) if (pages // k_splits) % p == 0)
        variants["jax-paged"] = jax.jit(
            lambda q, k, v, t, n: paged_attention(q[:, 0] * head_dim**-0.5, k, v, t, n, k_splits=k_splits,
                                                  pages_per_compute_block=per_block,
                                                  interpret=args.interpret)[:, None]
        )
        inputs["jax-paged"] = (q, k_pages, v_pages, tables, lens)
    kv_bytes = 2 * batch * context_len * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
    ours_out = variants["ours"](*inputs["ours"])
    rows = []
    for name, fn in variants.items():
        try:
            diff = max_diff(fn(*inputs[name]), ours_out)
            ms = time_ms(fn, *inputs[name], iters=args.iters)
        except Exception as e:  # a peer that cannot run this shape (memory, unsupported) is reported, not fatal
            rows.append({"kernel": "decode", "variant": name, "batch": batch, "context": context_len,
                         "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        gbs = kv_bytes / (ms * 1e-3) / 1e9
        rows.append({"kernel": "decode", "variant": name, "batch": batch, "context": context_len, "ms": ms,
                     "GB/s": gbs, "share_of_copy_bw": gbs / copy_gbs if copy_gbs else None,
                     "max_abs_diff_vs_ours": diff})
    return rows


def _engine_xla_decode(q, k_pool, v_pool, tables, lens):
    from jaxinfer.models.paged_attention import PagedAttentionMetadata, paged_attention_reference

    batch = q.shape[0]
    meta = PagedAttentionMetadata(
        slot_mapping=jnp.zeros(batch, jnp.int32), positions=lens - 1, token_seq=jnp.arange(batch, dtype=jnp.int32),
        block_tables=tables, context_lens=lens, query_start=jnp.arange(batch + 1, dtype=jnp.int32),
    )
    return paged_attention_reference(q[:, 0], k_pool, v_pool, meta, layer_index=0)[:, None].astype(q.dtype)


def bench_prefill(args, num_tokens):
    num_heads, num_kv_heads, head_dim, block_size, dtype = args.num_heads, args.num_kv_heads, args.head_dim, 16, args.dtype
    key = jax.random.key(num_tokens)
    k_pool, v_pool, tables = paged_cache(key, 1, num_tokens, num_kv_heads, head_dim, block_size, dtype)
    q = jax.random.normal(jax.random.fold_in(key, 1), (num_tokens, num_heads, head_dim), dtype)
    lens = jnp.array([num_tokens], jnp.int32)
    query_start = jnp.array([0, num_tokens], jnp.int32)
    layer = jnp.int32(0)
    # Contiguous K/V in token order for the dense peers: [1, T, KV, D].
    k_dense, v_dense = (p[0][tables[0]].reshape(1, -1, num_kv_heads, head_dim)[:, :num_tokens] for p in (k_pool, v_pool))
    paged_inputs = (q, k_pool, v_pool, tables, lens, query_start)
    variants = {
        "ours": (jax.jit(lambda q, k, v, t, n, s: paged_prefill_attention(q, k, v, layer, t, n, s,
                                                                          interpret=args.interpret)), paged_inputs),
    }
    # The reference materializes [T, context, H] scores: only where that fits comfortably.
    if num_tokens * num_tokens * num_heads * 4 <= args.reference_max_bytes:
        variants["jnp-ref"] = (jax.jit(lambda q, k, v, t, n, s: paged_prefill_attention_reference(q, k, v, layer, t, n, s)),
                               paged_inputs)
    for impl in ("xla", "cudnn") if jax.default_backend() == "gpu" else ("xla",):
        variants[f"jax-sdpa-{impl}"] = (
            jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(q[None], k, v, is_causal=True,
                                                                           implementation=impl)[0]),
            (q, k_dense, v_dense),
        )
    flops = 4 * num_heads * head_dim * num_tokens * (num_tokens + 1) / 2  # QK^T and PV over the causal half
    ours_out = variants["ours"][0](*paged_inputs)
    rows = []
    for name, (fn, inputs) in variants.items():
        try:
            diff = max_diff(fn(*inputs), ours_out)
            ms = time_ms(fn, *inputs, iters=args.iters)
        except Exception as e:
            rows.append({"kernel": "prefill", "variant": name, "tokens": num_tokens,
                         "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        rows.append({"kernel": "prefill", "variant": name, "tokens": num_tokens, "ms": ms,
                     "TFLOP/s": flops / (ms * 1e-3) / 1e12, "max_abs_diff_vs_ours": diff})
    return rows


def with_ratios(rows, key_fields):
    """Add ours' speed relative to each variant of the same shape (>1: ours is faster)."""
    ours = {tuple(r[k] for k in key_fields): r["ms"] for r in rows if r["variant"] == "ours" and "ms" in r}
    for r in rows:
        if "ms" in r:
            r["ours_speedup"] = r["ms"] / ours[tuple(r[k] for k in key_fields)]
    return rows


def print_table(rows, columns):
    print(" | ".join(f"{c:>13}" for c in columns))
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, r.get("error", "") if c == "ms" else "")
            cells.append(f"{v:>13.4g}" if isinstance(v, float) else f"{str(v)[:60]:>13}")
        print(" | ".join(cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny grid (for a CPU smoke run)")
    parser.add_argument("--interpret", action="store_true", help="run the Pallas kernels in interpret mode")
    parser.add_argument("--with-jax-peers", action="store_true", help="also run JAX's paged_attention in interpret mode")
    parser.add_argument("--dtype", default="bfloat16")
    # Llama-3-8B attention shape by default.
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reference-max-bytes", type=float, default=8e9)
    parser.add_argument("--json", default="bench_kernels.json")
    args = parser.parse_args()
    if args.quick:
        decode_grid = [(b, c) for b in (1, 4) for c in (64, 256)]
        prefill_grid = [64, 128]
        args.iters = min(args.iters, 3)
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
    else:
        decode_grid = [(b, c) for b in (1, 8, 32, 128) for c in (512, 2048, 8192, 32768) if b * c <= 1 << 20]
        prefill_grid = [1024, 4096, 8192, 16384]

    device = jax.devices()[0]
    copy_gbs = copy_bandwidth_gbs(1 << 30 if not args.quick else 1 << 24, args.iters)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"{device.platform} ({device.device_kind}), jax {jax.__version__}, commit {commit or '?'}, dtype {args.dtype}, "
          f"H={args.num_heads} KV={args.num_kv_heads} D={args.head_dim}, copy bandwidth {copy_gbs:.0f} GB/s"
          + (" [interpret mode: times are not kernel measurements]" if args.interpret else ""))

    decode_rows = with_ratios([r for b, c in decode_grid for r in bench_decode(args, b, c, copy_gbs)], ("batch", "context"))
    print("\ndecode (1 query token per sequence, block_size 16)")
    print_table(decode_rows, ["variant", "batch", "context", "ms", "GB/s", "share_of_copy_bw", "ours_speedup",
                              "max_abs_diff_vs_ours"])
    prefill_rows = with_ratios([r for t in prefill_grid for r in bench_prefill(args, t)], ("tokens",))
    print("\nprefill (one sequence, whole prompt as one chunk, causal)")
    print_table(prefill_rows, ["variant", "tokens", "ms", "TFLOP/s", "ours_speedup", "max_abs_diff_vs_ours"])

    result = {
        "device": f"{device.platform} {device.device_kind}", "host": platform.node(), "jax": jax.__version__,
        "commit": commit, "config": vars(args), "copy_bandwidth_GBs": copy_gbs,
        "decode": decode_rows, "prefill": prefill_rows,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
