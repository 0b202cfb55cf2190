"""The GPU backend: weights one array per layer, the layers unrolled, the
Pallas kernels (pallas_kernels/) for attention and for quantized weights at
a few rows.

  layout       every layer weight as PerLayer (quant/layer_weights.py): one
               array per layer. A lax.scan over stacked [layers, ...]
               weights makes XLA materialise each layer's slice before the
               GEMM: a one-row matvec over 32 stacked 4096 x 14336 bf16
               layers ran at 1,231 GB/s on an H200, the same layers as
               separate arrays at 3,800 GB/s (BENCHMARKS.md, "GPU").
  layer loop   a Python loop over the layers (one traced body per layer:
               more to compile than a scan, each weight read once in place).
  operations   quantized weights through pallas_kernels/quantized_matmul.py
               up to PALLAS_MAX_ROWS rows; a MoE's float experts through
               pallas_kernels/expert_matmul.py at decode sizes (each row
               reads its own expert only; XLA's ragged_dot reads them all); attention through the Pallas
               decode and prefill kernels (attention "pallas", the default
               here: backends/attention.py); everything else XLA's.
  settings     float32 dots at full precision unless TF32 is asked for
               (with_dtype), wide default batches, a small compile grid
               compiled 8 programs at a time, no lax.cond in the sampler,
               async scheduling.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.backends.xla import XlaBackend
from jaxinfer.quant.layer_weights import PerLayer
from jaxinfer.quant.linear import linear
from jaxinfer.quant.schemes import int8_blocks
from jaxinfer.quant.tensor import QuantizedTensor
from jaxinfer.utils import powers_of_two

# Rows up to which the fused kernel is used (decode batches). A matmul of
# `rows` rows does 2 * rows flops per weight; the kernel reads 0.5 (int4)
# or 1 (int8) byte per weight, so it stays memory bound until rows reaches
# roughly 35 (int4) / 70 (int8) on an H100/H200 (~150 flops per byte), while
# XLA's dequantize + GEMM moves about 4 extra bytes per weight (writing and
# re-reading the dequantized copy). Past 64 rows the dot's efficiency
# decides, where XLA's GEMM is the safer choice. Not yet timed on a GPU.
PALLAS_MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class GpuBackend(XlaBackend):
    # Wide batches fill a GPU; its compile grid may be larger.
    max_num_seqs: ClassVar[int] = 128
    max_num_batched_tokens: ClassVar[int] = 2048
    attentions: ClassVar[tuple[str, ...]] = ("pallas", "reference")
    # An unrolled model's compilation is long and mostly one thread's work;
    # a GPU's host has the cores to run several.
    compile_threads: ClassVar[int] = 8
    # An XLA conditional on a GPU copies its predicate to the host and waits
    # for it: the host stalls until the step so far has run, so it can queue
    # nothing ahead, and the step splits into several CUDA graphs. The host
    # picks a sample program holding just the work the batch needs instead
    # (engine/sampler.py, SamplerWork).
    conditional_skips: ClassVar[bool] = False
    # A decode step of a few ms on the device leaves the host's work per step
    # (scheduling, inputs, outputs) exposed unless it overlaps the next.
    async_scheduling: ClassVar[bool] = True

    attention: str = "pallas"

    def select_by_layer(self, layer_index, layers: tuple[int, ...], chosen, other):
        """The unrolled loop hands a concrete layer index: choose while
        tracing, so each layer's program holds only its own kind."""
        return chosen() if int(layer_index) in layers else other()

    def compiler_options(self) -> dict | None:
        """XLA's GPU dot merger (threshold 32 MB by default) turns dots that
        share an input into one dot over a concatenated weight: q/k/v, and
        gate/up, would be copied into a new weight on every step, an extra
        read and write of those weights in a step bound by reading them.
        Threshold 0 merges none: each weight is read once, in place."""
        return {"xla_gpu_dot_merger_threshold_mb": 0}

    def decode_buckets(self, max_num_seqs: int) -> list[int]:
        """Powers of four (and the largest): each is a whole unrolled model to
        compile, and a decode step is bound by reading the weights, which
        padding rows do not add to (a padding row attends to no keys)."""
        sizes = powers_of_two(1, max_num_seqs)
        return [n for n in sizes if n.bit_length() % 2 == 1 or n == sizes[-1]]

    def mixed_seq_buckets(self, num_tokens: int, seq_buckets: list[int]) -> list[int]:
        """One sequence bucket per token bucket (as many as it has tokens, up
        to the largest): each program is a whole unrolled model to compile,
        and padding sequences cost a mixed step almost nothing (a table row
        and a context length each, attended to over no keys)."""
        return [min(num_tokens, seq_buckets[-1])]

    def arrange_weights(self, params: dict) -> dict:
        """Every stacked layer weight as one array per layer. The stacked copy
        of each is dropped as soon as it is split, so the extra memory is one
        weight's at a time."""
        layers = params["layers"]
        for key in layers:
            if not isinstance(layers[key], PerLayer):
                layers[key] = PerLayer.unstack(layers[key])
        return params

    def run_layers(self, body, carry, layers: dict, num_layers: int):
        with self.precision():
            for i in range(num_layers):
                p = {k: w[i] if isinstance(w, PerLayer) else jax.tree.map(lambda a: a[i], w)
                     for k, w in layers.items()}
                # A concrete index (numpy, not traced): select_by_layer chooses
                # by it while tracing.
                carry = body(carry, p, np.int32(i))
        return carry

    def expert_linears(self, x, ws: list, expert_ids) -> list:
        from pallas_kernels import expert_matmul

        if all(expert_matmul.supports(w, x.shape[0]) for w in ws):
            return [expert_matmul.expert_matmul(x, w, expert_ids, interpret=self.interpret) for w in ws]
        return super().expert_linears(x, ws, expert_ids)

    def linear(self, x, w):
        rows = math.prod(x.shape[:-1])
        if isinstance(w, QuantizedTensor) and rows <= PALLAS_MAX_ROWS:
            from pallas_kernels import quantized_matmul

            plain = w.untiled()
            if plain.data.ndim == 2 and quantized_matmul.supports(plain.data, plain.scheme, plain.group_size, rows):
                xq = int8_blocks(x, w.activation_block) if w.activation_block else x
                y = quantized_matmul.quantized_matmul(xq.reshape(rows, -1), plain.data, plain.scales, plain.offsets,
                                                      scheme=plain.scheme, group_size=plain.group_size,
                                                      interpret=self.interpret)
                return y.astype(x.dtype).reshape(*x.shape[:-1], plain.out_features)
        return linear(x, w)
