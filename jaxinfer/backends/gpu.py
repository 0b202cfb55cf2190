"""The GPU backend: weights one array per layer, the layers unrolled, the
Pallas kernels (pallas_kernels/) for attention and for quantized weights at
a few rows.

  layout       every layer weight as PerLayer (quant/layer_weights.py): one
               array per layer. A lax.scan over stacked [layers, ...]
               weights makes XLA materialise each layer's slice before the
               GEMM: a one-row matvec over 32 stacked 4096 x 14336 bf16
               layers ran at 1,231 GB/s on an H200, the same layers as
               separate arrays at 3,800 GB/s (BENCHMARKS.md, "GPU").
               The weights a layer multiplies on the same input (q|k|v,
               gate|up, a shared expert's gate|up) are stored concatenated
               along `out` (FusedColumns): one GEMM or kernel launch reads
               them, in place, where XLA's dot merger would copy them into
               a new weight on every step.
  layer loop   a Python loop over the layers (one traced body per layer:
               more to compile than a scan, each weight read once in place).
  operations   quantized weights through pallas_kernels/quantized_matmul.py
               up to PALLAS_MAX_ROWS rows; a MoE's float experts through
               pallas_kernels/expert_matmul.py at decode sizes (each row
               reads its own expert only; XLA's ragged_dot reads them all); attention through the Pallas
               decode and prefill kernels (attention "pallas", the default
               here: backends/attention.py; a decode step's kernel writes
               the step's K/V into the pool itself); RMSNorm through
               pallas_kernels/rms_norm.py for one row, and at decode sizes
               with wo's or w_down's split-K partial sums added in the same
               kernel (linear_parts, add_rms_norm); everything else XLA's.
  settings     float32 dots at full precision unless TF32 is asked for
               (with_dtype), wide default batches, a small compile grid
               compiled 8 programs at a time, no lax.cond in the sampler,
               async scheduling.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.backends.attention import pallas_decode_over_pool
from jaxinfer.backends.xla import XlaBackend
from jaxinfer.models.attention import AttentionFn
from jaxinfer.models.paged_attention import PagedAttentionMetadata
from jaxinfer.models.residual import Residual
from jaxinfer.quant.fused_columns import FusedColumns, FusedPart, fused_key
from jaxinfer.quant.layer_weights import PerLayer
from jaxinfer.quant.linear import linear
from jaxinfer.quant.schemes import int8_blocks
from jaxinfer.quant.tensor import QuantizedTensor
from jaxinfer.utils import autotune_cache_dir, powers_of_two

# Rows up to which the fused kernel is used (decode batches). A matmul of
# `rows` rows does 2 * rows flops per weight; the kernel reads 0.5 (int4)
# or 1 (int8) byte per weight, so it stays memory bound until rows reaches
# roughly 35 (int4) / 70 (int8) on an H100/H200 (~150 flops per byte), while
# XLA's dequantize + GEMM moves about 4 extra bytes per weight (writing and
# re-reading the dequantized copy). Past 64 rows the dot's efficiency
# decides, where XLA's GEMM is the safer choice. Not yet timed on a GPU.
PALLAS_MAX_ROWS = 64

# The smallest decode bucket (decode_buckets): a lone sequence's.
SMALLEST_DECODE_BUCKET = 4

# Rows up to which a decode step's wo and w_down leave their split-K partial
# sums to the next norm's kernel (linear_parts). Splitting K gives a GEMM of
# few rows enough programs to read its weight at full bandwidth; its float32
# partials ([k, rows, hidden]) grow with the rows, and past 64 rows the GEMM
# has programs enough without the split.
SPLIT_K_MAX_ROWS = 64


def split_k(inner: int) -> int:
    """How many slices linear_parts cuts an inner dimension into: up to 8
    (XLA's own split for 8B's wo and w_down at decode sizes), each of at
    least 512 (a slice's GEMM reads its weight rows in long runs), dividing
    it exactly; 1 for a small model's."""
    k = 8
    while k > 1 and (inner % k or inner // k < 512):
        k //= 2
    return k


# The weights a layer multiplies on the same input, in the order the model
# asks for them (backend.linears in models/llama.py and models/moe.py).
FUSED_GROUPS = (("wq", "wk", "wv"), ("w_gate", "w_up"), ("shared_w_gate", "shared_w_up"))


def _on_one_device(w) -> bool:
    """Whether every array of w lives on one device: a weight split over a
    tensor-parallel mesh is split per weight along out (parallel/sharding.py),
    which a concatenation of the whole weights would not keep. A traced
    weight (the layout computed from shapes under jax.eval_shape, as
    scripts/gpu/deviceless.py does) is on no device yet: it counts as one."""
    return all(not isinstance(a, jax.Array) or isinstance(a, jax.core.Tracer) or len(a.sharding.device_set) == 1
               for a in jax.tree.leaves(w))


def _form(w):
    """What must agree between weights concatenated along out: everything
    but the out axis (scheme, groups, dtypes, the input width)."""
    if isinstance(w, QuantizedTensor):
        return ("quantized", w.scheme, w.group_size, w.activation_block, w.tile, w.data.dtype, w.data.shape[:-1],
                w.scales.dtype, w.scales.shape[:-1], None if w.offsets is None else w.offsets.dtype)
    if isinstance(w, (jax.Array, np.ndarray)):
        return ("array", w.dtype, w.shape[:-1])
    return None  # another form (a K-quant tensor): not concatenated


def fusable(parts: list) -> bool:
    """Whether one layer's weights `parts` concatenate exactly along out:
    all 2-D arrays, or all untiled QuantizedTensors of one scheme, group
    size and dtype (int8, int4, fp8, w8a8: their groups run along `in`), of
    the same input width, on one device."""
    forms = {_form(w) for w in parts}
    form = forms.pop() if len(forms) == 1 else None
    if form is None or (form[0] == "quantized" and form[4]):  # a tiled tensor's out axis is cut in tiles
        return False
    shape = parts[0].shape
    return len(shape) == 2 and all(_on_one_device(w) for w in parts)


def concatenate_columns(parts: list):
    """The weights `parts` (fusable) as one [in, sum(out)]."""
    first = parts[0]
    if isinstance(first, QuantizedTensor):
        def cat(arrays):
            return jnp.concatenate(arrays, axis=-1)

        offsets = None if first.offsets is None else cat([w.offsets for w in parts])
        return dataclasses.replace(first, data=cat([w.data for w in parts]), scales=cat([w.scales for w in parts]),
                                   offsets=offsets)
    return jnp.concatenate(parts, axis=-1)


def _whole_group(ws: list) -> FusedColumns | None:
    """The FusedColumns ws are the parts of, all of them in order, or None."""
    if not ws or not all(isinstance(w, FusedPart) for w in ws):
        return None
    fused = ws[0].fused
    if any(w.fused is not fused for w in ws) or [w.index for w in ws] != list(range(len(fused.names))):
        return None
    return fused


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
    # Whether a decode step adds wo's and w_down's outputs to the residual
    # stream in the next norm's Pallas kernel (linear_parts): off on a mesh,
    # where GSPMD cannot split a custom call and would gather the partial
    # sums whole to every device.
    residual_in_norm: bool = True

    def select_by_layer(self, layer_index, layers: tuple[int, ...], chosen, other):
        """The unrolled loop hands a concrete layer index: choose while
        tracing, so each layer's program holds only its own kind."""
        return chosen() if int(layer_index) in layers else other()

    def compiler_options(self) -> dict | None:
        """XLA's GPU dot merger (threshold 32 MB by default) turns dots that
        share an input into one dot over a concatenated weight, copied into a
        new weight on every step: an extra read and write of those weights in
        a step bound by reading them. The groups that share an input are
        stored concatenated already (arrange_weights); a group left apart
        (forms that differ, a tensor-parallel split) must stay apart too.
        Threshold 0 merges none: each weight is read once, in place.

        XLA's rematerialization is off: its estimate of a step's memory
        counts a Pallas kernel's output aliased to its input (the decode
        kernel writing the KV pool in place) as a second pool, and to fit the
        phantom it recomputes GEMMs, reading their weights twice, where the
        real buffer assignment aliases the pool and needs no temporary of its
        size. A step's other temporaries are activations, small beside the
        headroom the KV pool leaves (engine/config.py).

        With compilation caching on, XLA's autotuning results are kept across
        processes in a directory shared by every jaxinfer version on the same
        XLA (utils.autotune_cache_dir says why)."""
        options = {"xla_gpu_dot_merger_threshold_mb": 0, "xla_disable_hlo_passes": "rematerialization"}
        autotune = autotune_cache_dir()
        if autotune is not None:
            options["xla_gpu_per_fusion_autotune_cache_dir"] = str(autotune)
        return options

    def decode_buckets(self, max_num_seqs: int) -> list[int]:
        """Powers of four from SMALLEST_DECODE_BUCKET (and the largest): each
        is a whole unrolled model to compile, and a decode step is bound by
        reading the weights, which padding rows do not add to (a padding row
        attends to no keys). A lone sequence runs in four rows, with the
        GEMMs and norms of several rows (linear_parts says why one row is
        another path)."""
        sizes = powers_of_two(1, max_num_seqs)
        return [n for n in sizes if (n >= SMALLEST_DECODE_BUCKET and n.bit_length() % 2 == 1) or n == sizes[-1]]

    @staticmethod
    def _split_seqs(meta: PagedAttentionMetadata) -> int:
        """The sequences a decode or verify step's attention sizes its splits
        for: one in the smallest bucket, which is a lone sequence's (its 32
        splits with 8 KV heads fill the GPU on a long context, where the
        bucket's four would give it 8); else the bucket's."""
        seqs = meta.context_lens.shape[0]
        return 1 if seqs <= SMALLEST_DECODE_BUCKET else seqs

    def mixed_seq_buckets(self, num_tokens: int, seq_buckets: list[int]) -> list[int]:
        """One sequence bucket per token bucket (as many as it has tokens, up
        to the largest): each program is a whole unrolled model to compile,
        and padding sequences cost a mixed step almost nothing (a table row
        and a context length each, attended to over no keys)."""
        return [min(num_tokens, seq_buckets[-1])]

    # The loader gives every layer weight one array per layer as it reads
    # them (loading/params.py): no stacked copy to split here.
    per_layer_weights: ClassVar[bool] = True

    def arrange_weights(self, params: dict) -> dict:
        """Every layer weight as one array per layer (as the loader gives
        them, per_layer_weights; a stacked one, restored from a jaxinfer
        checkpoint, is split here, its stacked copy dropped as soon as it
        is), and each of FUSED_GROUPS whose weights concatenate exactly in
        every layer (fusable: not where their forms differ, nor split over a
        mesh) as one FusedColumns per layer under fused_key(names). Each
        layer's parts are dropped as soon as they are concatenated, so the
        extra memory is one layer's group at a time."""
        layers = params["layers"]
        for key in layers:
            if not isinstance(layers[key], PerLayer):
                layers[key] = PerLayer.unstack(layers[key])
        for names in FUSED_GROUPS:
            if not all(isinstance(layers.get(name), PerLayer) for name in names):
                continue
            num_layers = len(layers[names[0]])
            if not all(fusable([layers[name][i] for name in names]) for i in range(num_layers)):
                continue
            parts = {name: list(layers.pop(name)) for name in names}
            fused = []
            for i in range(num_layers):
                weights = [parts[name][i] for name in names]
                sizes = tuple(int(w.shape[-1]) for w in weights)
                fused.append(FusedColumns(concatenate_columns(weights), names, sizes))
                for name in names:
                    parts[name][i] = None
                del weights
            layers[fused_key(names)] = PerLayer(fused)
        return params

    def run_layers(self, body, carry, layers: dict, num_layers: int):
        with self.precision():
            for i in range(num_layers):
                p = {}
                for k, w in layers.items():
                    layer = w[i] if isinstance(w, PerLayer) else jax.tree.map(lambda a: a[i], w)
                    # A fused group reaches the model as its weights, each under its own name.
                    p.update(layer.parts() if isinstance(layer, FusedColumns) else {k: layer})
                # A concrete index (numpy, not traced): select_by_layer chooses
                # by it while tracing.
                carry = body(carry, p, np.int32(i))
        return carry

    def expert_linears(self, x, ws: list, expert_ids) -> list:
        from pallas_kernels import expert_matmul

        if all(expert_matmul.supports(w, x.shape[0]) for w in ws):
            return [expert_matmul.expert_matmul(x, w, expert_ids, interpret=self.interpret) for w in ws]
        return super().expert_linears(x, ws, expert_ids)

    def linears(self, x, ws: list) -> list:
        """The parts of a fused group, all of them in order: one linear over
        the group's concatenated weight, its output split by weight."""
        fused = _whole_group(ws)
        if fused is None:
            return [self.linear(x, w) for w in ws]
        y = self.linear(x, fused.weight)
        return jnp.split(y, np.cumsum(fused.sizes)[:-1].tolist(), axis=-1)

    def _norm_kernel(self, kernel, xla, *args, eps: float):
        """kernel(*args, eps) (pallas_kernels/rms_norm.py) compiled for a GPU,
        in interpret mode where this backend interprets Pallas; lowered for
        another platform (a CPU test of this layout), xla(*args)."""
        if self.interpret:
            return kernel(*args, eps, interpret=True)
        return jax.lax.platform_dependent(*args, cuda=functools.partial(kernel, eps=eps), default=xla)

    def rms_norm(self, x, weight, eps: float):
        """One row (a batch-1 decode step) through the Pallas kernel: XLA
        runs a single row's norm as two kernels, several rows as one."""
        if math.prod(x.shape[:-1]) != 1:
            return super().rms_norm(x, weight, eps)
        from pallas_kernels.rms_norm import rms_norm as pallas_rms_norm

        return self._norm_kernel(pallas_rms_norm, functools.partial(super().rms_norm, eps=eps), x, weight, eps=eps)

    def linear_parts(self, x, w):
        """x @ w for a step of 2 to SPLIT_K_MAX_ROWS rows (decode, verify) and
        a float weight (wo, w_down; not quantized, not on a mesh) as the
        float32 partial sums of split_k(in) slices of the inner dimension,
        for add_rms_norm's kernel to add: the split-K XLA makes of such a GEMM
        by itself, its reduction moved into the norm's kernel. One row stays
        XLA's: it rewrites a one-row batched dot into a reduction over a
        transposed float32 copy of the weight (decode_buckets runs a lone
        sequence in four rows)."""
        rows = math.prod(x.shape[:-1])
        if not (self.residual_in_norm and isinstance(w, jax.Array) and w.ndim == 2
                and jnp.issubdtype(w.dtype, jnp.floating) and 2 <= rows <= SPLIT_K_MAX_ROWS):
            return None
        k = split_k(w.shape[0])
        if k == 1:
            return jnp.matmul(x, w, preferred_element_type=jnp.float32)[None]
        parts = jnp.einsum("rki,kio->kro", x.reshape(rows, k, -1), w.reshape(k, -1, w.shape[1]),
                           preferred_element_type=jnp.float32)
        return parts.reshape(k, *x.shape[:-1], w.shape[1])

    def add_rms_norm(self, x, weight, eps: float):
        """A Residual's partial sums added to its stream and the sum normed in
        one Pallas kernel. An array: rms_norm."""
        if not isinstance(x, Residual):
            return x, self.rms_norm(x, weight, eps)
        from pallas_kernels.rms_norm import add_rms_norm as pallas_add_rms_norm

        xla = super().add_rms_norm
        return self._norm_kernel(pallas_add_rms_norm, lambda stream, parts, w: xla(Residual(stream, parts), w, eps),
                                 x.stream, x.parts, weight, eps=eps)

    def paged_attention(self, meta: PagedAttentionMetadata, sliding_window, decode: bool, mesh) -> AttentionFn:
        """A decode step's Pallas attention on one device takes q, k and v as
        one array and writes k and v into a float pool itself
        (backends/attention.py, pallas_decode_over_pool): no scatter kernels,
        and q, k and v come out of one fusion. Needs rematerialization off
        (compiler_options says why)."""
        if self.attention == "pallas" and decode and mesh is None:
            return pallas_decode_over_pool(meta, sliding_window, self.interpret, split_seqs=self._split_seqs(meta))
        return super().paged_attention(meta, sliding_window, decode, mesh)

    def verification_attention(self, meta: PagedAttentionMetadata, rows: int, sliding_window, mesh) -> AttentionFn:
        """A verify step's (`rows` per sequence) as a decode step's (paged_attention)."""
        if self.attention == "pallas" and mesh is None:
            return pallas_decode_over_pool(meta, sliding_window, self.interpret, rows, self._split_seqs(meta))
        return super().verification_attention(meta, rows, sliding_window, mesh)

    def linear(self, x, w):
        if isinstance(w, FusedPart):
            w = w.weight()
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
