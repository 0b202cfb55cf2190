"""The CPU backend: the native C++ kernels of jaxinfer/native/ where they
serve, the plain XLA path (backends/xla.py) everywhere else.

  loading      quantization="auto" keeps a GGUF file's own blocks (the same
               numbers as the dequantized floats in a third of the bytes,
               multiplied by the kernels without a float copy); K-quants
               (Q2_K .. Q6_K) at the file's size (quant/kquant.py), a
               weight mixing block types one stack per type
               (quant/mixed_stack.py); an untied head in its blocks (a
               100k-vocabulary float head would be most of a decode
               step's bytes), a tied one's float table for the lookup and
               past FEW_ROW_HEAD_MAX_ROWS rows, plus its blocks for the
               kernels up to there (few_row_head).
               The quantized layer weights the exact kernel multiplies are
               stored in its tiles of columns (quant/tensor.py, `tile`).
  layer loop   lax.scan over the stacked layers; quantized weights (and a
               MoE's experts, float too) reach linear() as LayerOf, the
               stack plus the layer index, so a kernel reads its layer in
               place (a slice handed to a custom call would be copied by
               XLA first; a scan's slice of the experts would copy all of
               them where a token reads a few).
  operations   native/matmul.py for quantized layer weights (the exact
               kernel up to max_rows() rows, q, k and v in one call; the
               int8-activation kernel for "gguf-a8" weights),
               native/kquant_matmul.py for K-quant ones (the same two
               paths; a mixed stack's layer under a switch on its type), a
               MoE's experts through native/expert_matmul.py (float32) and
               native/matmul.py's expert entry (int8 / int4), reading only
               the selected experts, the head through the same kernels
               where they pay, and
               native/paged_attention.py for attention_backend="xla".
  settings     glibc keeps freed host memory (backends/host_memory.py); the
               kernels build on threads while the weights load.

native=False (a mesh: GSPMD cannot split a custom call and would gather
its operands whole) keeps the loading choices and runs the XLA path.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.backends.host_memory import keep_freed_host_memory
from jaxinfer.backends.xla import XlaBackend
from jaxinfer.models.attention import AttentionFn
from jaxinfer.models.paged_attention import (PagedAttentionMetadata, paged_cache_attention, verification_attention,
                                             write_new_kv)
from jaxinfer.native import expert_matmul, kquant_matmul, matmul, paged_attention
from jaxinfer.native.build import cpu_has
from jaxinfer.quant.kquant import KQuantTensor
from jaxinfer.quant.layer_weights import LayerOf
from jaxinfer.quant.linear import linear
from jaxinfer.quant.mixed_stack import MixedStack
from jaxinfer.quant.params import ROUTED_KEYS, quantize_weight
from jaxinfer.quant.schemes import int8_blocks
from jaxinfer.quant.tensor import QuantizedTensor

# Rows up to which a tied GGUF head's Q8_0 copy (few_row_head) beats the
# float table: a quarter of the bytes, and past ~8 rows the exact kernel's
# register-tiled path. The head alone on the 2-core Zen 4 dev VM (medians of
# 30 alternated calls, BENCHMARKS.md, stop 31): 32 / 64 / 128 rows 11.0 /
# 20.6 / 39.7 ms against 15.7 / 23.7 / 44.2 from the float table; 256 rows
# 79.4 against 75.3. (Stop 26's kernel, before stop 29's faster many-row
# path, lost from 48 rows and set 32.)
FEW_ROW_HEAD_MAX_ROWS = 128


@dataclasses.dataclass(frozen=True)
class CpuBackend(XlaBackend):

    # Whether the native kernels may run (False on a mesh).
    native: bool = True

    # -- loading ---------------------------------------------------------------
    def with_dtype(self, dtype) -> CpuBackend:
        return self  # XLA:CPU computes float32 dots in float32 whatever they ask

    def auto_dtype(self, stored) -> np.dtype:
        """float32 whatever the checkpoint stores: a bfloat16 weight widens to
        float32 exactly, and bfloat16 dots are slow on CPU at a few rows."""
        return np.dtype(np.float32)

    def auto_quantization(self, source) -> str | None:
        return "gguf" if hasattr(source, "get_quantized") else None

    def keeps_gguf_head_quantized(self) -> bool:
        """An untied head the file stores in blocks stays in them, multiplied
        by the native kernels at every row count they take (a 151,936 x 896
        vocabulary in float32 is 545 MB a decode step; as Q6_K, 112 MB)."""
        return self.native

    def keeps_k_quants_as_stored(self) -> bool:
        """K-quants at the file's size, multiplied by native/kquant_matmul.cc
        (and q8_matmul.cc's K-quant handler), which need AVX-512."""
        return self.native and cpu_has("avx512f")

    def wants_tied_head_as_stored(self, quantization: str | None) -> bool:
        return self.native and quantization == "gguf"

    def layout(self, params: dict) -> dict:
        """The quantized weights the exact kernel multiplies, in its tiles of
        columns, one weight at a time (the untiled copy is freed as it goes):
        a kernel task then reads one contiguous run of memory (BENCHMARKS.md,
        "Tiled weights"). The stacked layers and the tied head's few-row copy
        (dropped where the kernel cannot take it); the lm_head stays plain,
        since the embedding lookup reads its columns. In place, weight by
        weight, so that only one untiled copy is held at a time."""
        if not self.native:
            return params
        layers = params["layers"]
        for key in layers:
            layers[key] = _tiled(layers[key])
        head = params.pop("few_row_head", None)
        if head is not None and (isinstance(head, KQuantTensor) or matmul.supports(1, head)):
            params["few_row_head"] = _tiled(head)
        # An untied head in its blocks (no lookup reads its columns while
        # "embed" is there): tiled, as the layers, so that a one-row step
        # streams it (the K-quant kernels read tiles only).
        if isinstance(params.get("lm_head"), (QuantizedTensor, KQuantTensor)) and "embed" in params:
            params["lm_head"] = _tiled(params["lm_head"])
        _start_kquant_builds(params)
        return params

    # -- process and engine settings ---------------------------------------------
    def start_kernel_builds(self, quantization: str | None) -> None:
        """Build (or load, once cached) the native kernels on threads while the
        weights load: the first run on a machine compiles each for ~2 s, which
        would otherwise land, one after the other, on warm-up's first trace.
        The int8-activation matmul only for the load that uses it ("gguf-a8")."""
        if not self.native:
            return
        builds = [paged_attention.available, matmul.available]
        if quantization == "gguf-a8":
            builds.append(matmul.q8_available)
        for available in builds:
            threading.Thread(target=available, daemon=True).start()

    def start_engine(self) -> None:
        keep_freed_host_memory()  # the steps' temporaries are host memory here (host_memory.py says why)

    # -- the layer loop ------------------------------------------------------------
    def run_layers(self, body, carry, layers: dict, num_layers: int):
        if not self.native:
            return super().run_layers(body, carry, layers, num_layers)
        stacked = {k: w for k, w in layers.items()
                   if isinstance(w, (QuantizedTensor, KQuantTensor, MixedStack)) or k in ROUTED_KEYS}
        sliced = {k: w for k, w in layers.items() if k not in stacked}

        def with_stacked(carry, p, layer_index):
            return body(carry, {**p, **{k: LayerOf(w, layer_index) for k, w in stacked.items()}}, layer_index)

        return super().run_layers(with_stacked, carry, sliced, num_layers)

    # -- operations ----------------------------------------------------------------
    def linear(self, x, w):
        if not isinstance(w, LayerOf):
            return linear(x, w)
        rows = math.prod(x.shape[:-1])
        stacked = w.stacked
        if isinstance(stacked, MixedStack):  # the branch of the layer's block type runs
            return stacked.apply(w.index, lambda part, index: self.linear(x, LayerOf(part, index)))
        if isinstance(stacked, KQuantTensor):
            return self._kquant_linear(x, stacked, w.index, rows)
        if stacked.activation_block and matmul.supports_q8(rows, stacked):
            y = matmul.q8_matmul(x.reshape(rows, -1), stacked, w.index)
            return y.astype(x.dtype).reshape(*x.shape[:-1], stacked.out_features)
        if matmul.supports(rows, stacked):
            # A weight with an activation block multiplies the quantized
            # activations in float here: the same numbers.
            xq = int8_blocks(x, stacked.activation_block) if stacked.activation_block else x
            y = matmul.quantized_matmul(xq.reshape(rows, -1), stacked, w.index)
            return y.astype(x.dtype).reshape(*x.shape[:-1], stacked.out_features)
        return linear(x, w.layer())

    def _kquant_linear(self, x, w: KQuantTensor, layer_index, rows: int):
        """x @ layer layer_index of a K-quant stack: the int8-activation kernel
        for "gguf-a8" weights, else the exact one (on the int8-rounded
        activations where the weight has an activation block: the same
        numbers), else the XLA path."""
        x2 = x.reshape(rows, -1)
        if w.activation_block and kquant_matmul.supports_q8(rows, w):
            y = kquant_matmul.q8_kquant_matmul(x2, w, layer_index)
        elif kquant_matmul.supports(rows, w):
            xq = int8_blocks(x2, w.activation_block) if w.activation_block else x2
            y = kquant_matmul.kquant_matmul(xq, w, layer_index)
        else:
            return linear(x, LayerOf(w, layer_index).layer())
        return y.astype(x.dtype).reshape(*x.shape[:-1], w.out_features)

    def linears(self, x, ws: list) -> list:
        """One kernel call for every weight where the kernel takes them all
        together (one layer each of stacked weights, the same layer, no
        activation block: matmul.supports_together; K-quant stacks of any
        kinds together: kquant_matmul). A weight stored one stack per block
        type (MixedStack) goes on its own, the others together."""
        rows = math.prod(x.shape[:-1])
        if any(isinstance(w, LayerOf) and isinstance(w.stacked, MixedStack) for w in ws):
            alone = [isinstance(w, LayerOf) and isinstance(w.stacked, MixedStack) for w in ws]
            rest = [w for w, a in zip(ws, alone) if not a]
            together = iter(self.linears(x, rest) if rest else [])
            return [self.linear(x, w) if a else next(together) for w, a in zip(ws, alone)]
        if (len(ws) > 1 and all(isinstance(w, LayerOf) and isinstance(w.stacked, KQuantTensor)
                                and w.index is ws[0].index and not w.stacked.activation_block
                                and kquant_matmul.supports(rows, w.stacked) for w in ws)):
            ys = kquant_matmul.kquant_matmuls(x.reshape(rows, -1), [w.stacked for w in ws], ws[0].index)
            return [y.astype(x.dtype).reshape(*x.shape[:-1], w.stacked.out_features) for y, w in zip(ys, ws)]
        if (len(ws) > 1 and all(isinstance(w, LayerOf) and w.index is ws[0].index for w in ws)
                and not any(w.stacked.activation_block for w in ws)
                and matmul.supports_together(rows, [w.stacked for w in ws])):
            ys = matmul.quantized_matmuls(x.reshape(rows, -1), [w.stacked for w in ws], ws[0].index)
            return [y.astype(x.dtype).reshape(*x.shape[:-1], w.stacked.out_features) for y, w in zip(ys, ws)]
        return [self.linear(x, w) for w in ws]

    def expert_linears(self, x, ws: list, expert_ids) -> list:
        """The selected experts only, from the stacks in place: float32
        experts through native/expert_matmul.py, int8 / int4 ones through
        native/matmul.py's expert entry (for "gguf-a8" weights on the
        activations rounded to their int8 blocks first: the same numbers);
        other forms (bfloat16, fp8, w8a8) the reference's ragged_dot on
        their layer."""
        if all(isinstance(w, LayerOf) and w.index is ws[0].index for w in ws):
            stacks = [w.stacked for w in ws]
            if expert_matmul.supports(stacks):
                ys = expert_matmul.expert_matmuls(x, stacks, ws[0].index, expert_ids)
                return [y.astype(x.dtype) for y in ys]
            if (all(isinstance(w, QuantizedTensor) for w in stacks) and matmul.supports_experts(stacks)
                    and len({w.activation_block for w in stacks}) == 1):
                block = stacks[0].activation_block
                xq = int8_blocks(x, block) if block else x
                ys = matmul.quantized_expert_matmuls(xq, stacks, ws[0].index, expert_ids)
                return [y.astype(x.dtype) for y in ys]
        return super().expert_linears(x, [w.layer() if isinstance(w, LayerOf) else w for w in ws], expert_ids)

    def logits(self, params: dict, hidden) -> jax.Array:
        """A tied GGUF head's own blocks (few_row_head) up to
        FEW_ROW_HEAD_MAX_ROWS rows, where the kernel serves them: a quarter
        of the float head's bytes, the same values (batch-1 decode). A
        quantized [hidden, vocab] head goes to the kernels as the one layer
        of a stack (a leading axis of 1 is a free reshape) so they read it in
        place."""
        if not self.native:
            return super().logits(params, hidden)
        few_row_head = params.get("few_row_head")
        rows = math.prod(hidden.shape[:-1])
        if few_row_head is not None and rows <= FEW_ROW_HEAD_MAX_ROWS and _kernel_takes(rows, few_row_head):
            return self.linear(hidden, _in_place(few_row_head)).astype(jnp.float32)
        head = params.get("lm_head")
        if isinstance(head, (QuantizedTensor, KQuantTensor)) and len(head.shape) == 2:
            return self.linear(hidden, _in_place(head)).astype(jnp.float32)
        return super().logits(params, hidden)

    def paged_attention(self, meta: PagedAttentionMetadata, sliding_window, decode: bool, mesh) -> AttentionFn:
        if not self._native_attention(mesh):
            return super().paged_attention(meta, sliding_window, decode, mesh)
        reference = paged_cache_attention(meta, sliding_window, "jnp", decode, mesh)

        def attend(q, k, v, kv_cache, layer_index):
            if not paged_attention.supports(q, kv_cache[0]):
                return reference(q, k, v, kv_cache, layer_index)
            kv_cache, (k_pool, v_pool, k_scales, v_scales) = write_new_kv(kv_cache, layer_index, k, v, meta)
            out = paged_attention.paged_attention(q[0], k_pool, v_pool, layer_index, meta.block_tables,
                                                  meta.context_lens, meta.query_start, k_scales=k_scales,
                                                  v_scales=v_scales, sliding_window=sliding_window)
            return out[None].astype(q.dtype), kv_cache

        return attend

    def verification_attention(self, meta: PagedAttentionMetadata, rows: int, sliding_window, mesh) -> AttentionFn:
        if not self._native_attention(mesh):
            return super().verification_attention(meta, rows, sliding_window, mesh)
        reference = verification_attention(meta, rows, sliding_window, "jnp", mesh)

        def attend(q, k, v, kv_cache, layer_index):
            if not paged_attention.supports(q, kv_cache[0]):
                return reference(q, k, v, kv_cache, layer_index)
            kv_cache, (k_pool, v_pool, k_scales, v_scales) = write_new_kv(kv_cache, layer_index, k, v, meta)
            num_tokens, num_heads, head_dim = q.shape[1:]
            per_seq = q[0].reshape(num_tokens // rows, rows, num_heads, head_dim)
            out = paged_attention.paged_decode_attention(per_seq, k_pool, v_pool, layer_index, meta.block_tables,
                                                         meta.context_lens, k_scales=k_scales, v_scales=v_scales,
                                                         sliding_window=sliding_window)
            return out.reshape(1, num_tokens, num_heads, head_dim).astype(q.dtype), kv_cache

        return attend

    def _native_attention(self, mesh) -> bool:
        """attention_backend "xla" runs the native kernel, on one device."""
        return self.native and self.attention == "xla" and mesh is None

    # -- speculative decoding ---------------------------------------------------------
    def eagle_head_layout(self, head: dict) -> dict:
        """The EAGLE draft head as drafting multiplies it with the exact
        kernel: each matrix int8 in groups of 64 rows, in the kernel's tiles,
        as the one layer of a stack (LayerOf) so the kernel reads it in place.
        A draft step then reads 9.5 MB instead of 36 MB of float32
        (BENCHMARKS.md, issue 17). Drafts only propose, verification is by the
        target, so the rounding can cost acceptance, never exactness. Left as
        it is where the kernel does not take tiles (no AVX-512)."""
        if not self.native:
            return head

        def quantized(w):
            return quantize_weight(jnp.asarray(w, jnp.float32)[None], "int8", group_size=64)

        top = {k: quantized(head[k]) for k in ("fc", "lm_head") if k in head}
        layer = {k: quantized(w) for k, w in head["layer"].items() if w.ndim == 2}  # not the norms
        if not all(matmul.tileable(q) for q in [*top.values(), *layer.values()]):
            return head
        stacked = lambda q: LayerOf(q.tiled(matmul.TILE), jnp.int32(0))  # noqa: E731
        return {**head, **{k: stacked(q) for k, q in top.items()},
                "layer": {**head["layer"], **{k: stacked(q) for k, q in layer.items()}}}


def _tiled(w):
    """w in the exact kernel's tiles where the kernel multiplies it
    (matmul.tileable, and a MoE's experts: tileable_experts; K-quants
    wherever their kernels run: they read tiles only), else as it is; each
    part of a MixedStack so."""
    if isinstance(w, MixedStack):
        return w.replace_parts(_tiled)
    if isinstance(w, KQuantTensor):
        return w.tiled(kquant_matmul.TILE) if kquant_matmul.tileable(w) else w
    if isinstance(w, QuantizedTensor) and (matmul.tileable(w) or matmul.tileable_experts(w)):
        return w.tiled(matmul.TILE)
    return w


def _kernel_takes(rows: int, head) -> bool:
    """Whether a native kernel multiplies `rows` rows by a head (a [hidden, vocab] weight)."""
    if isinstance(head, KQuantTensor):
        return kquant_matmul.supports(rows, head) or (head.activation_block and kquant_matmul.supports_q8(rows, head))
    return matmul.supports(rows, head)


def _start_kquant_builds(params: dict) -> None:
    """Build the K-quant kernels on threads where the params hold K-quants
    (only then: each is ~15 s of a machine's first start), while the
    engine's programs are traced."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, KQuantTensor))
    kquants = [w for w in leaves if isinstance(w, KQuantTensor)]
    builds = [kquant_matmul.available] if kquants else []
    if any(w.activation_block for w in kquants):
        builds.append(kquant_matmul.q8_available)
    for available in builds:
        threading.Thread(target=available, daemon=True).start()


def _in_place(head) -> LayerOf:
    """A quantized [hidden, vocab] head as the one layer of a stack, so that a
    native kernel reads it in place (a leading axis of 1 is a free reshape)."""
    return LayerOf(jax.tree.map(lambda a: a[None], head), jnp.int32(0))
