"""Batch-1 decode speed per weight scheme on a Llama-3-8B-shaped model with
random weights, and the quantized matmul kernel against XLA on its layer shapes.

Decode: 32 layers, hidden 4096, ffn 14336, 32/8 heads of 128, vocab 128256,
bf16. Params are built on the device in the layout of
jaxinfer.models.llama.param_shapes, each stacked weight one layer at a time,
then quantized per stacked weight with jaxinfer.quant.schemes.quantize (int8
per channel, int4 groups of 128, fp8 per channel; lm_head stays bf16 unless
--quantize-head, as in quantize_params). One scheme's model lives on the
device at a time. Steps run through the real model code: models.llama.forward
on the platform's backend (jaxinfer/backends/: its weight layout, layer loop,
attention and linear, which on a GPU sends few-row quantized matmuls to
pallas_kernels/quantized_matmul.py). `--steps` greedy steps run inside one
jitted loop (so host dispatch is not timed) from a fixed context of
`--context` cached tokens.
  Reported per scheme: step ms, tok/s, weight bytes read per step (every
  parameter except the embedding table, of which a step reads one row),
  achieved bandwidth = weight bytes / step time, its share of the measured
  device copy bandwidth, speedup over bf16, and whether the compiled step
  contains the Pallas kernel.
  Reference: gpt-fast reports 1.48x (int8) and 1.88x (int4) over bf16 for
  Llama-2-7B on an A100.

Matmul (M = 1 row, bf16 x, the 8B layer shapes 4096x4096, 4096x14336,
14336x4096, 4096x1024):
  pallas        pallas_kernels.quantized_matmul
  xla-dequant   x @ dequantize(w) under XLA (dequantized weight in bf16)
  xla-scale     (x @ q) * scales (XLA; per-channel schemes only, the XLA
                path of quant/linear.py for them)
  bf16          x @ w with the unquantized bf16 weight (cuBLAS)
  Each timed call runs the matmul over enough distinct weights (>= 512 MB of
  bf16) that no weight is served from L2, and reports time per matmul.
  The "scan" table runs the same matmuls the way the model does, inside
  lax.scan over a stacked [copies, in, out] weight (a per-layer slice), plus
  the kernel reading the stack in place by layer_index: if "pallas" there is
  much slower than "pallas-layer-index", XLA copies each layer's slice before
  the custom call and the model should pass the stack.

GPU:  python scripts/bench_quantized_decode.py          (writes bench_quantized_decode.json)
CPU:  python scripts/bench_quantized_decode.py --tiny   (a smoke run in interpret mode; times are meaningless)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a plain checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from jaxinfer.backends import choose_backend  # noqa: E402
from jaxinfer.bench_timing import copy_bandwidth_gbs, time_ms  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.models.kv_cache import allocate_kv_cache  # noqa: E402
from jaxinfer.models.llama import forward, param_shapes  # noqa: E402
from jaxinfer.models.paged_attention import PagedAttentionMetadata  # noqa: E402
from jaxinfer.quant.schemes import quantize  # noqa: E402
from jaxinfer.quant.tensor import QuantizedTensor, dequantize  # noqa: E402
from pallas_kernels import quantized_matmul as kernel  # noqa: E402
from pallas_kernels.quantized_matmul import matmul_tiling  # noqa: E402


def quantized_matmul(x, q, **kwargs):
    """The kernel on a QuantizedTensor's arrays."""
    return kernel.quantized_matmul(x, q.data, q.scales, q.offsets, scheme=q.scheme, group_size=q.group_size, **kwargs)

LLAMA3_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=8192,
)
TINY = ModelConfig(
    architecture="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=1024,
)
LLAMA3_8B_MATMUL_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 1024)]
TINY_MATMUL_SHAPES = [(256, 128)]
# scheme name -> (quantize() scheme, group_size); "bf16" is the unquantized model.
SCHEMES = {"bf16": None, "int8": ("int8", None), "int4": ("int4", 128), "fp8": ("fp8", None)}
BLOCK_SIZE = 16
DTYPE = jnp.bfloat16




def nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


# ---------------------------------------------------------------- decode


@functools.partial(jax.jit, static_argnames=("shape", "scale"))
def _random_matrix(key, *, shape, scale):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(DTYPE)


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stack, layer, value):
    return stack.at[layer].set(value)


_quantize = jax.jit(quantize, static_argnames=("scheme", "group_size"))


def random_stacked_weight(key, shape):
    """[layers, in, out] bf16 built one layer at a time, so that the float32
    random draw is one layer's worth, never the whole stack."""
    stack = jnp.zeros(shape, DTYPE)
    scale = shape[-2] ** -0.5  # keeps activations O(1) through the layers
    for layer in range(shape[0]):
        stack = _set_layer(stack, layer, _random_matrix(jax.random.fold_in(key, layer), shape=shape[1:], scale=scale))
    return stack


def build_params(config: ModelConfig, scheme: str, quantize_head: bool, seed: int = 0) -> dict:
    """Random params of `config` on the device; linear weights quantized per stacked weight."""
    shapes = param_shapes(config)
    key = jax.random.key(seed)
    spec = SCHEMES[scheme]

    def linear_weight(name, shape):
        name_key = jax.random.fold_in(key, 100 + sorted(shapes["layers"]).index(name))
        w = random_stacked_weight(name_key, shape) if len(shape) == 3 else _random_matrix(
            name_key, shape=shape, scale=shape[0] ** -0.5)
        if spec is None:
            return w
        quantized = _quantize(w, spec[0], spec[1])
        w.delete()  # free the bf16 stack before the next weight is built
        return quantized

    layers = {}
    for name, shape in shapes["layers"].items():
        layers[name] = jnp.ones(shape, DTYPE) if name.endswith("norm") else linear_weight(name, shape)
    params = {
        "embed": _random_matrix(jax.random.fold_in(key, 1), shape=shapes["embed"], scale=1.0),
        "layers": layers,
        "final_norm": jnp.ones(shapes["final_norm"], DTYPE),
    }
    if "lm_head" in shapes:
        head = _random_matrix(jax.random.fold_in(key, 2), shape=shapes["lm_head"], scale=config.hidden_size**-0.5)
        params["lm_head"] = _quantize(head, spec[0], spec[1]) if (spec and quantize_head) else head
    return params


@functools.partial(jax.jit, static_argnames=("config", "backend", "steps"), donate_argnames=("kv_cache",))
def decode_steps(params, kv_cache, token, start_pos, block_table, *, config: ModelConfig, backend, steps: int):
    """`steps` greedy batch-1 decode steps from position start_pos, as the
    engine runs a pure-decode step (one token, decode=True attention)."""

    def step(i, carry):
        token, kv_cache = carry
        pos = start_pos + i
        meta = PagedAttentionMetadata(
            slot_mapping=(block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)[None],
            positions=pos[None],
            token_seq=jnp.zeros((1,), jnp.int32),
            block_tables=block_table[None],
            context_lens=(pos + 1)[None],
            query_start=jnp.array([0, 1], jnp.int32),
        )
        attention = backend.paged_attention(meta, config.sliding_window, True, None)
        hidden, kv_cache = forward(params, config, token[None, None], pos[None, None], attention, kv_cache,
                                   backend=backend)
        logits = backend.logits(params, hidden[0])
        return jnp.argmax(logits[0]).astype(jnp.int32), kv_cache

    return lax.fori_loop(0, steps, step, (token, kv_cache))


def bench_decode(args, config: ModelConfig, scheme: str, copy_gbs: float | None) -> dict:
    start = time.perf_counter()
    backend = choose_backend().with_dtype(DTYPE).with_attention(args.attention)
    params = backend.arrange_weights(build_params(config, scheme, args.quantize_head))
    jax.block_until_ready(params)
    build_s = time.perf_counter() - start
    weight_bytes = nbytes({k: v for k, v in params.items() if k != "embed"})

    max_tokens = args.context + args.steps
    num_blocks = 1 + math.ceil(max_tokens / BLOCK_SIZE)  # block 0 is the null block
    kv_cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE, DTYPE)
    block_table = jnp.arange(1, num_blocks, dtype=jnp.int32)
    static = dict(config=config, backend=backend, steps=args.steps)
    run = functools.partial(decode_steps, **static)
    token, start_pos = jnp.int32(1), jnp.int32(args.context)
    # The kernel is a jitted function: its name is in the step's module exactly when linear() called it.
    kernel_used = "quantized_matmul" in decode_steps.lower(params, kv_cache, token, start_pos, block_table,
                                                           **static).as_text()

    start = time.perf_counter()
    token, kv_cache = run(params, kv_cache, token, start_pos, block_table)
    jax.block_until_ready(token)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        token, kv_cache = run(params, kv_cache, token, start_pos, block_table)  # same context every call
        jax.block_until_ready(token)
        times.append(time.perf_counter() - start)
    step_ms = 1e3 * statistics.median(times) / args.steps
    gbs = weight_bytes / (step_ms * 1e-3) / 1e9
    del params, kv_cache
    return {
        "scheme": scheme, "step_ms": step_ms, "tok_s": 1e3 / step_ms, "weight_GB": weight_bytes / 1e9,
        "GB/s": gbs, "share_of_copy_bw": gbs / copy_gbs if copy_gbs else None, "pallas_kernel_in_step": kernel_used,
        "build_s": build_s, "compile_and_first_call_s": compile_s, "last_token": int(token),
    }


# ---------------------------------------------------------------- matmul


def matmul_variants(scheme: str, interpret: bool) -> dict:
    """name -> fn(x, w_bf16, w_quantized) for one row of x."""
    variants = {
        "pallas": lambda x, w, q: quantized_matmul(x, q, interpret=interpret),
        "xla-dequant": lambda x, w, q: jnp.matmul(x, dequantize(q, x.dtype),
                                                  preferred_element_type=jnp.float32).astype(x.dtype),
        "bf16": lambda x, w, q: x @ w,
    }
    if scheme in ("int8", "fp8"):  # per channel: the scale multiplies the output
        variants["xla-scale"] = lambda x, w, q: (jnp.matmul(x, q.data.astype(x.dtype), preferred_element_type=jnp.float32)
                                                 * q.scales[0]).astype(x.dtype)
    return variants


def bench_matmul(args, shapes, copy_gbs) -> tuple[list, list]:
    """Time per matmul over `copies` distinct weights (no L2 reuse): one call
    runs them back to back (flat), or under lax.scan over the stack (scan)."""
    flat_rows, scan_rows = [], []
    for in_features, out_features in shapes:
        bf16_bytes = in_features * out_features * 2
        copies = 2 if args.tiny else max(2, math.ceil(args.matmul_bytes / bf16_bytes))
        key = jax.random.key(in_features * 7 + out_features)
        stack = jnp.stack([_random_matrix(jax.random.fold_in(key, c), shape=(in_features, out_features),
                                          scale=in_features**-0.5) for c in range(copies)])
        x = jax.random.normal(jax.random.fold_in(key, 1 << 20), (1, in_features), DTYPE)
        for scheme in args.matmul_schemes:
            kind, group = SCHEMES[scheme]
            q_stack = _quantize(stack, kind, group)
            q_list = [jax.tree_util.tree_map(lambda a, c=c: a[c], q_stack) for c in range(copies)]
            w_list = [stack[c] for c in range(copies)]
            tiling = matmul_tiling(kind, q_stack.group_size, in_features, out_features, 1)
            base = {"scheme": scheme, "shape": f"{in_features}x{out_features}", "copies": copies,
                    "tiling": tiling._asdict()}
            variants = matmul_variants(scheme, args.interpret)
            expected = None
            for name, fn in variants.items():
                flat = jax.jit(lambda x, ws, qs, fn=fn: [fn(x, w, q) for w, q in zip(ws, qs)])
                row = dict(base, variant=name)
                try:
                    out = flat(x, w_list, q_list)[0]
                    expected = out if expected is None else expected
                    row["max_abs_diff_vs_pallas"] = float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                                                          - expected.astype(jnp.float32))))
                    ms = time_ms(flat, x, w_list, q_list, iters=args.iters) / copies
                except Exception as e:  # a variant that cannot run (memory, lowering) is reported, not fatal
                    flat_rows.append(dict(row, error=f"{type(e).__name__}: {str(e)[:200]}"))
                    continue
                read = q_stack.nbytes // copies if name != "bf16" else bf16_bytes
                gbs = read / (ms * 1e-3) / 1e9
                flat_rows.append(dict(row, us=1e3 * ms, weight_MB=read / 1e6, **{"GB/s": gbs},
                                      share_of_copy_bw=gbs / copy_gbs if copy_gbs else None))
            scan_rows += bench_scan(args, x, stack, q_stack, base, copy_gbs)
            del q_stack, q_list
        del stack
    for rows in (flat_rows, scan_rows):
        by_key = {(r["scheme"], r["shape"], r["variant"]): r.get("us") for r in rows}
        for r in rows:
            xla = by_key.get((r["scheme"], r["shape"], "xla-dequant"))
            if "us" in r and xla:
                r["speedup_vs_xla_dequant"] = xla / r["us"]
    return flat_rows, scan_rows


def bench_scan(args, x, stack, q_stack: QuantizedTensor, base: dict, copy_gbs) -> list:
    copies = stack.shape[0]

    def scanned(fn):
        def run(x, w_stack):
            def body(carry, w):
                return carry, fn(x, w)
            return lax.scan(body, 0, w_stack)[1]
        return jax.jit(run)

    def by_layer_index(x, q_stack):
        def body(carry, layer):
            return carry, quantized_matmul(x, q_stack, layer_index=layer, interpret=args.interpret)
        return lax.scan(body, 0, jnp.arange(copies, dtype=jnp.int32))[1]

    variants = {
        "pallas": (scanned(lambda x, q: quantized_matmul(x, q, interpret=args.interpret)), q_stack),
        "pallas-layer-index": (jax.jit(by_layer_index), q_stack),
        "xla-dequant": (scanned(lambda x, q: jnp.matmul(x, dequantize(q, x.dtype), preferred_element_type=jnp.float32)
                                .astype(x.dtype)), q_stack),
        "bf16": (scanned(lambda x, w: x @ w), stack),
    }
    rows = []
    for name, (fn, weights) in variants.items():
        row = dict(base, variant=name)
        try:
            ms = time_ms(fn, x, weights, iters=args.iters) / copies
        except Exception as e:
            rows.append(dict(row, error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        read = nbytes(weights) // copies
        gbs = read / (ms * 1e-3) / 1e9
        rows.append(dict(row, us=1e3 * ms, **{"GB/s": gbs}, share_of_copy_bw=gbs / copy_gbs if copy_gbs else None))
    return rows


# ---------------------------------------------------------------- report


def print_table(rows, columns):
    print(" | ".join(f"{c:>14}" for c in columns))
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, r.get("error", "") if c == columns[-1] else "")
            cells.append(f"{v:>14.4g}" if isinstance(v, float) else f"{str(v)[:70]:>14}")
        print(" | ".join(cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU in interpret mode (smoke run)")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--matmul-schemes", nargs="+", default=["int8", "int4", "fp8"],
                        choices=[s for s in SCHEMES if s != "bf16"])
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed call")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (median)")
    parser.add_argument("--context", type=int, default=512, help="cached tokens before the timed steps")
    parser.add_argument("--quantize-head", action="store_true", help="quantize lm_head too")
    parser.add_argument("--attention", "--attention-backend", dest="attention", default=None,
                        help="default: the backend's (pallas on GPU, native on CPU)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per matmul variant (median)")
    parser.add_argument("--matmul-bytes", type=float, default=512e6,
                        help="bf16 bytes of distinct weights per matmul timing (>> L2)")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-matmul", action="store_true")
    parser.add_argument("--json", default="bench_quantized_decode.json")
    args = parser.parse_args()

    on_gpu = jax.default_backend() == "gpu"
    args.interpret = not on_gpu
    if args.attention is None:
        args.attention = "pallas" if on_gpu else "native"
    if args.tiny:
        config, shapes = TINY, TINY_MATMUL_SHAPES
        args.steps, args.repeats, args.iters, args.context = min(args.steps, 2), min(args.repeats, 1), 1, 16
    else:
        config, shapes = LLAMA3_8B, LLAMA3_8B_MATMUL_SHAPES
    if not on_gpu and not args.tiny:
        print("warning: no GPU; this is an interpret-mode run of the full-size model (very slow)", file=sys.stderr)

    device = jax.devices()[0]
    copy_gbs = copy_bandwidth_gbs(1 << 24 if args.tiny else 1 << 30, args.iters)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"{device.platform} ({device.device_kind}), jax {jax.__version__}, commit {commit or '?'}, "
          f"copy bandwidth {copy_gbs:.0f} GB/s, attention {args.attention}"
          + (" [interpret mode / CPU: times are not measurements]" if not on_gpu else ""))

    decode_rows = []
    if not args.skip_decode:
        for scheme in args.schemes:
            decode_rows.append(bench_decode(args, config, scheme, copy_gbs))
            print(f"  built and ran {scheme}: {decode_rows[-1]['step_ms']:.3f} ms/step", flush=True)
        bf16 = next((r["step_ms"] for r in decode_rows if r["scheme"] == "bf16"), None)
        for r in decode_rows:
            r["speedup_vs_bf16"] = bf16 / r["step_ms"] if bf16 else None
        print(f"\ndecode, batch 1, context {args.context}, {config.num_layers} layers, hidden {config.hidden_size} "
              f"(gpt-fast, A100, Llama-2-7B: int8 1.48x, int4 1.88x over bf16)")
        print_table(decode_rows, ["scheme", "step_ms", "tok_s", "weight_GB", "GB/s", "share_of_copy_bw",
                                  "speedup_vs_bf16", "pallas_kernel_in_step"])

    flat_rows, scan_rows = [], []
    if not args.skip_matmul:
        flat_rows, scan_rows = bench_matmul(args, shapes, copy_gbs)
        columns = ["scheme", "shape", "variant", "us", "GB/s", "share_of_copy_bw", "speedup_vs_xla_dequant"]
        print("\nmatmul, M = 1, bf16 x, distinct weights back to back (time per matmul)")
        print_table(flat_rows, columns + ["max_abs_diff_vs_pallas"])
        print("\nmatmul inside lax.scan over a stacked weight, as the model runs (time per matmul)")
        print_table(scan_rows, columns)

    result = {
        "benchmark": "quantized_decode", "device": f"{device.platform} {device.device_kind}", "host": platform.node(),
        "jax": jax.__version__, "commit": commit, "date": time.strftime("%Y-%m-%d"), "config": vars(args),
        "model": {k: getattr(config, k) for k in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                                                  "num_kv_heads", "head_dim", "vocab_size")},
        "copy_bandwidth_GBs": copy_gbs, "decode": decode_rows, "matmul": flat_rows, "matmul_scan": scan_rows,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
