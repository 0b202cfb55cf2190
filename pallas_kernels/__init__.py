"""Pallas kernels, each beside the plain-jnp reference it is tested against.

paged_decode_attention   one to a few query tokens per sequence over the paged
                         KV cache: GQA packing, split-k with a log-sum-exp merge
                         (a second small kernel),
                         int8/fp8 K/V with per-token scales
paged_prefill_attention  flash attention of ragged query chunks over the paged
                         cache, causal mask aligned bottom-right
rms_norm                 RMSNorm of one row in one program (XLA runs a lone row's norm as
                         two kernels); the GPU backend's batch-1 decode step calls it
quantized_matmul         x @ W for int8 / int4 / fp8 quantized weights (plain arrays),
                         dequantized in registers (decode-sized x); the GPU
                         backend's `linear` (jaxinfer/backends/gpu.py) calls it

Written for the Triton GPU lowering (JAX 0.10 and 0.11); tests run them with
interpret=True on CPU. The engine reaches them through its backends:
jaxinfer/backends/attention.py (the `attention` option "pallas") and
jaxinfer/backends/gpu.py.
"""
