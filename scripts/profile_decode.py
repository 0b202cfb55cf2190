"""Where the milliseconds of one decode step go, on CPU.

Runs real decode steps of the engine at a batch size and context length,
then times each part of the step on its own as a jitted program over the
engine's own params and KV pool:

    step        LLMEngine.step() of a pure-decode batch (median wall time)
    host        the engine's own count of host time per step (scheduling,
                input building, output processing, detokenizing, dispatch)
    device      the engine's count of time from dispatch to results on the host
    forward     the forward program of that bucket, timed alone
    sample      the sampler program, timed alone
    matmuls     the seven projections of every layer under the same lax.scan
    attention   the KV write and paged attention of every layer
    head        the output head (logits over the vocabulary)
    rest        forward - matmuls - attention - head: norms, RoPE, embedding,
                residuals, the scan's own slicing

and the bytes of weights a one-row step reads (bench_timing.weight_bytes_per_step,
the count bench_cpu.py uses) per step time, against the read bandwidth
measured here (a jitted sum over 512 MiB). Parts timed alone overlap less
than inside the step, so "rest" can be slightly negative; it is the
remainder, not a measurement.

    python scripts/profile_decode.py [--batch-sizes 1,32] [--context 128] [--quantization gguf] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default="auto", help="as LLM(quantization=...); none: float weights")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before the timed decode steps")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.bench_timing import read_bandwidth_gbs, time_ms, weight_bytes_per_step
    from jaxinfer.engine.programs import forward_step, sample_step
    from jaxinfer.engine.sampler import SamplingMetadata
    from jaxinfer.models.layers import rms_norm

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(args.model, quantization=None if args.quantization == "none" else args.quantization, max_num_seqs=max(16, max(batch_sizes)),
              max_num_batched_tokens=max(256, max(batch_sizes)), progress=False)
    llm.wait_compiled()
    engine, runner = llm.engine, llm.engine.runner
    backend = runner.backend  # the model's platform backend: its layer loop and operations
    config, params = llm.model.config, llm.model.params
    weight_bytes = weight_bytes_per_step(params)
    bandwidth = read_bandwidth_gbs(512 * 2**20)
    results = {"model": llm.model.source, "quantization": llm.model.quantization, "weight_bytes": weight_bytes,
               "read_bandwidth_gbs": bandwidth, "context": args.context, "batches": []}
    print(f"{llm.model.source}: {weight_bytes / 1e6:.0f} MB of weights read per one-row step; "
          f"read bandwidth {bandwidth:.1f} GB/s")

    for batch in batch_sizes:
        rng = np.random.default_rng(0)
        # Chunked prefill lets the first sequences decode while later prompts
        # are still prefilled: every sequence must outlive all of those steps
        # and the timed ones, or the "batch" shrinks before it is measured.
        prefill_steps = -(-batch * args.context // engine.config.max_num_batched_tokens)
        params_greedy = SamplingParams(temperature=0.0, max_tokens=prefill_steps + args.iters + 8, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"p{batch}-{i}", rng.integers(100, 1000, args.context).tolist(), params_greedy)
        while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running) or \
                engine.scheduler.waiting:
            engine.step()
        engine.step()  # first pure-decode step
        step_times = []
        host_before, device_before = engine.host_time, engine.device_time
        for _ in range(args.iters):
            start = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - start)
        step_ms = 1e3 * statistics.median(step_times)
        host_ms = 1e3 * (engine.host_time - host_before) / args.iters
        device_ms = 1e3 * (engine.device_time - device_before) / args.iters

        # The same step's device programs, alone, on the engine's own inputs.
        seqs = list(engine.scheduler.running)
        assert len(seqs) == batch, f"{len(seqs)} sequences left of {batch}"
        tables = [engine.block_manager.block_table(s.seq_id) for s in seqs]
        # Recompute each sequence's last cached token: its slot is allocated
        # (the newest token's is only allocated when the scheduler owes it).
        inputs = runner.inputs([s.token_ids_between(s.num_computed_tokens - 1, s.num_computed_tokens) for s in seqs],
                               [s.num_computed_tokens - 1 for s in seqs],
                               [1] * len(seqs), tables)
        num_seqs = len(inputs.attn_meta.context_lens)

        def forward(kv, tokens, meta, idx):
            return forward_step(params, kv, tokens, meta, idx, config=config, backend=backend, layout=inputs.layout)

        # The pool is donated into the forward: keep feeding the returned one back.
        cache = [runner.kv_cache]

        def run_forward():
            logits, _, cache[0] = forward(cache[0], *inputs[:3])
            return logits

        forward_ms = time_ms(run_forward, iters=args.iters)
        runner.kv_cache = cache[0]
        sampling = SamplingMetadata.from_params([s.params for s in seqs], [0] * len(seqs), [1] * len(seqs), num_seqs)
        logits = jnp.zeros((num_seqs, config.vocab_size), jnp.float32)
        sample_ms = time_ms(lambda: sample_step(logits, sampling, None, *runner._no_mask(num_seqs), full=False,
                                                work=runner._sampler_work(seqs, False), feed_size=runner.feed_size),
                            iters=args.iters)

        x = jnp.ones((num_seqs, config.hidden_size), llm.model.dtype)

        @jax.jit
        def matmuls(layers, x):
            # Through the backend's layer loop and linear, as the model multiplies them.
            def layer(x, w, index):
                q, k, v = backend.linears(x, [w[n] for n in ("wq", "wk", "wv")])
                o = backend.linear(q, w["wo"])
                gate, up = backend.linears(x + o, [w["w_gate"], w["w_up"]])
                return x + backend.linear(jax.nn.silu(gate) * up, w["w_down"]) + 1e-3 * (k.sum() + v.sum())
            return backend.run_layers(layer, x, layers, config.num_layers)

        matmul_ms = time_ms(matmuls, params["layers"], x, iters=args.iters)

        meta = inputs.attn_meta
        q = jnp.ones((1, num_seqs, config.num_heads, config.head_dim), llm.model.dtype)
        kv = jnp.ones((1, num_seqs, config.num_kv_heads, config.head_dim), llm.model.dtype)

        @functools.partial(jax.jit, donate_argnums=0)
        def attention_only(kv_cache, meta):
            attend = backend.paged_attention(meta, config.sliding_window, True, None)

            def layer(carry, _, index):
                out, kv_cache = carry
                return attend(q + out, kv, kv, kv_cache, index)
            return backend.run_layers(layer, (jnp.zeros_like(q), kv_cache), {}, config.num_layers)

        def run_attention():
            out, cache[0] = attention_only(cache[0], meta)
            return out

        cache[0] = runner.kv_cache
        attention_ms = time_ms(run_attention, iters=args.iters)
        runner.kv_cache = cache[0]
        head_ms = time_ms(jax.jit(lambda p, x: backend.logits(p, rms_norm(x, p["final_norm"], 1e-5))), params, x,
                          iters=args.iters)
        row = {
            "batch": batch, "step_ms": step_ms, "forward_ms": forward_ms, "sample_ms": sample_ms,
            "host_ms": host_ms, "device_ms": device_ms, "matmuls_ms": matmul_ms, "attention_ms": attention_ms,
            "head_ms": head_ms, "rest_ms": forward_ms - matmul_ms - attention_ms - head_ms,
            "tokens_per_s": batch / (step_ms / 1e3),
            "weight_read_share_of_bandwidth": weight_bytes / (step_ms / 1e3) / 1e9 / bandwidth,
        }
        results["batches"].append(row)
        for r in engine.requests.copy():
            engine.abort(r)

    keys = ["step", "host", "device", "forward", "sample", "matmuls", "attention", "head", "rest"]
    print(f"{'batch':>5} " + " ".join(f"{k + ' ms':>12}" for k in keys) + f" {'tok/s':>8} {'BW share':>8}")
    for row in results["batches"]:
        print(f"{row['batch']:>5} " + " ".join(f"{row[k + '_ms']:>12.2f}" for k in keys)
              + f" {row['tokens_per_s']:>8.1f} {row['weight_read_share_of_bandwidth']:>8.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
