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
               The quantized weights a kernel reads in tiles of columns are
               stored so (quant/tensor.py, `tile`; cpu_weights.py, layout).
  layer loop   lax.scan over the stacked layers; quantized weights (and a
               MoE's experts, float too) reach linear() as LayerOf, the
               stack plus the layer index, so a kernel reads its layer in
               place (a slice handed to a custom call would be copied by
               XLA first; a scan's slice of the experts would copy all of
               them where a token reads a few).
  operations   the weights (linear, linears, a MoE's experts, the head)
               through the native kernel that cpu_weights.py picks for
               their form and row count, the XLA reference where none; and
               native/paged_attention.py for attention="native" (the
               default).
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

from jaxinfer.backends import cpu_weights
from jaxinfer.backends.host_memory import available_host_bytes, keep_freed_host_memory
from jaxinfer.backends.xla import XlaBackend
from jaxinfer.models.paged_attention import PagedAttentionMetadata
from jaxinfer.native import kquant_matmul, matmul, paged_attention, zeroed_buffer
from jaxinfer.native.build import cpu_runs_vec16
from jaxinfer.quant.input_order import InputOrdered
from jaxinfer.quant.kquant import KQuantTensor
from jaxinfer.quant.layer_weights import LayerOf
from jaxinfer.quant.mixed_stack import MixedStack
from jaxinfer.quant.params import ROUTED_KEYS, quantize_weight
from jaxinfer.quant.tensor import QuantizedTensor


@dataclasses.dataclass(frozen=True)
class CpuBackend(XlaBackend):

    attentions: ClassVar[tuple[str, ...]] = ("native", "reference", "pallas")
    # XLA:CPU has no fp8 scatter: it converts the whole pool to f16 and back
    # around every write (0.2 s per write into a 700-block pool of the
    # default model), while a uint8 scatter is in place. So an fp8 pool holds
    # its e4m3fn bit patterns as uint8; readers view them through as_fp8.
    kv_fp8_dtype: ClassVar[np.dtype] = np.dtype(np.uint8)

    attention: str = "native"
    # Whether the native kernels may run (False on a mesh).
    native: bool = True

    def __post_init__(self):
        if self.attention in ("native", "xla") and not self.native:  # on a mesh the reference runs
            object.__setattr__(self, "attention", "reference")
        super().__post_init__()

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
        (AVX-512, or AVX2 with FMA and F16C) and, with int8 activations,
        q8_matmul.cc's K-quant handler (AVX512-VNNI or AVX2; elsewhere the exact
        kernel on the rounded activations)."""
        return self.native and cpu_runs_vec16()

    def lookup_reads_head(self, few_row_head) -> bool:
        return self.native and cpu_weights.lookup_reads_head(few_row_head)

    def tiles_k_quants(self) -> bool:
        """The K-quant kernels read tiles only (cpu_weights.tiled)."""
        return self.keeps_k_quants_as_stored()

    def wants_tied_head_as_stored(self, quantization: str | None) -> bool:
        return self.native and quantization == "gguf"

    def arrange_weights(self, params: dict) -> dict:
        """The weights as the native kernels read them (cpu_weights.py, layout)."""
        if not self.native:
            return params
        params = cpu_weights.layout(params)
        self.start_weight_kernel_builds(params)
        return params

    def abstract_params(self, config, dtype, sharding) -> dict | None:
        """The native kernels' tiles are arranged in numpy, not traced: none."""
        if self.native:
            return None
        return super().abstract_params(config, dtype, sharding)

    def start_weight_kernel_builds(self, params: dict) -> None:
        """Where the params hold K-quants: their kinds' exact kernels loaded
        before this returns (a program read back from the executable cache
        calls them; started early by start_kernel_builds, so this mostly
        waits), the int8-activation kernel on a thread."""
        if self.native:
            cpu_weights.start_kquant_builds(params)

    # -- process and engine settings ---------------------------------------------
    def start_kernel_builds(self, quantization: str | None, source=None) -> None:
        """Build (or load, once cached) the native kernels on threads while the
        weights load: the first run on a machine compiles each for 3-5 s, which
        would otherwise land, one after the other, on warm-up's first trace.
        The int8-activation matmul only for the load that uses it ("gguf-a8");
        the K-quant kernels where the file holds K-quants it keeps as stored,
        first, as they take longest (the handler and each kind the file holds
        on a thread of its own: kquant_matmul.load_kinds; started here rather
        than once the weights are arranged, so they build beside the load)."""
        if not self.native:
            return
        kept_as_stored = quantization in ("gguf", "gguf-a8") and self.keeps_k_quants_as_stored()
        kinds = getattr(source, "k_quant_kinds", frozenset())
        # matmul.cc multiplies grouped int8 / int4 codes: a GGUF's classic
        # blocks, its K-quants where not kept as stored, any other source's
        # quantized weights. A file of K-quants alone needs it nowhere (~2 s
        # of a 2-core first start); a trace that does builds it then.
        grouped = (quantization not in ("gguf", "gguf-a8") or getattr(source, "holds_grouped_blocks", True)
                   or (kinds and not kept_as_stored))
        builds = [paged_attention.available, zeroed_buffer.available, *([matmul.available] if grouped else [])]
        if quantization == "gguf-a8":
            builds.append(matmul.q8_available)
        if kept_as_stored and kinds:
            builds[:0] = cpu_weights.kquant_builds(quantization == "gguf-a8", kinds)
        for available in builds:
            threading.Thread(target=available, daemon=True).start()

    def zeros(self, shape: tuple, dtype) -> jax.Array:
        """Zeroed host memory left unallocated until written
        (native/zeroed_buffer.py): the KV pool costs no time at start and
        becomes resident only as far as its blocks are used."""
        if not self.native:
            return super().zeros(shape, dtype)
        return zeroed_buffer.zeros(shape, dtype)

    def kv_cache_budget(self, devices, memory_fraction: float, one_request_bytes: int,
                        every_request_bytes: int, reserved_bytes: int = 0) -> tuple[int, str]:
        """Host memory: enough for every sequence at full length, up to
        host_kv_cache_bytes, but never less than one sequence of the full
        context, up to half of the host's available memory (past it, that
        half: the longest context it holds), so that a model's own context
        (32k tokens for a 0.5B Qwen2.5: 805 MB of float32 K/V) runs with no
        option set, as llama.cpp's does. reserved_bytes: host memory the
        weights still have to take."""
        room = (available_host_bytes() - reserved_bytes) // 2
        budget = min(every_request_bytes, max(self.host_kv_cache_bytes, min(one_request_bytes, room)))
        return budget, (f"the CPU default: every sequence at full length up to "
                        f"{self.host_kv_cache_bytes // 2**20} MiB, one at least if half the available "
                        f"{room * 2 / 2**30:.1f} GiB holds it")

    def start_engine(self) -> None:
        keep_freed_host_memory()  # the steps' temporaries are host memory here (host_memory.py says why)

    # -- the layer loop ------------------------------------------------------------
    def run_layers(self, body, carry, layers: dict, num_layers: int):
        if not self.native:
            return super().run_layers(body, carry, layers, num_layers)
        stacked = {k: w for k, w in layers.items()
                   if isinstance(w, (QuantizedTensor, KQuantTensor, MixedStack, InputOrdered)) or k in ROUTED_KEYS}
        sliced = {k: w for k, w in layers.items() if k not in stacked}

        def with_stacked(carry, p, layer_index):
            return body(carry, {**p, **{k: LayerOf(w, layer_index) for k, w in stacked.items()}}, layer_index)

        return super().run_layers(with_stacked, carry, sliced, num_layers)

    # -- operations ----------------------------------------------------------------
    def linear(self, x, w):
        return cpu_weights.linears(x, [w])[0]

    def linears(self, x, ws: list) -> list:
        """Each weight through the kernel cpu_weights.py picks for its form
        and the row count (one call for those of one layer that a kernel
        takes together), the reference for the rest."""
        return cpu_weights.linears(x, ws)

    def expert_linears(self, x, ws: list, expert_ids) -> list:
        """The selected experts only, from the stacks in place, where a kernel
        takes them (cpu_weights.py); other forms (bfloat16, fp8, w8a8) the
        reference's ragged_dot on their layer."""
        kernel = cpu_weights.expert_kernel_for(ws)
        if kernel is None:
            return super().expert_linears(x, [w.layer() if isinstance(w, LayerOf) else w for w in ws], expert_ids)
        return kernel(x, ws, expert_ids)

    def logits(self, params: dict, hidden) -> jax.Array:
        """A tied GGUF head's own blocks (few_row_head) up to
        FEW_ROW_HEAD_MAX_ROWS rows where a kernel takes them (a quarter of
        the float head's bytes, the same values), or a quantized lm_head,
        each read in place by the kernels (cpu_weights.py, head); else the
        reference's."""
        head = cpu_weights.head(params, math.prod(hidden.shape[:-1])) if self.native else None
        if head is None:
            return super().logits(params, hidden)
        return self.linear(hidden, head).astype(jnp.float32)

    def attention_kernel(self, meta: PagedAttentionMetadata, sliding_window, decode: bool, rows: int | None, mesh):
        """"native": native/paged_attention.py, which reads the pool in place
        and serves every step layout (the reference where it cannot run:
        its pool dtype or head size, or no compiler to build it)."""
        if self.attention != "native" or mesh is not None:
            return super().attention_kernel(meta, sliding_window, decode, rows, mesh)
        reference = super().attention_kernel(meta, sliding_window, decode, rows, mesh)  # "reference" here

        def kernel(q, k, v, pools, layer_index):
            k_pool, v_pool, k_scales, v_scales = pools
            if not paged_attention.supports(q, k_pool):
                return reference(q, k, v, pools, layer_index)
            if rows is not None:
                return paged_attention.paged_decode_attention(q, k_pool, v_pool, layer_index, meta.block_tables,
                                                              meta.context_lens, k_scales=k_scales, v_scales=v_scales,
                                                              sliding_window=sliding_window)
            return paged_attention.paged_attention(q, k_pool, v_pool, layer_index, meta.block_tables,
                                                   meta.context_lens, meta.query_start, k_scales=k_scales,
                                                   v_scales=v_scales, sliding_window=sliding_window)

        return kernel

    # -- speculative decoding ---------------------------------------------------------
    def arrange_eagle_head(self, head: dict) -> dict:
        """The EAGLE draft head as drafting multiplies it with the exact
        kernel: each matrix int8 in groups of 64 rows, in the kernel's tiles,
        as the one layer of a stack (LayerOf) so the kernel reads it in place.
        A draft step then reads 9.5 MB instead of 36 MB of float32
        (BENCHMARKS.md, "Speculative decoding"). Drafts only propose, verification is by the
        target, so the rounding can cost acceptance, never exactness. Left as
        it is where the kernel does not take tiles (neither AVX-512 nor AVX2
        with FMA and F16C)."""
        if not self.native:
            return head

        def quantized(w):
            return quantize_weight(jnp.asarray(w, jnp.float32)[None], "int8", group_size=64)

        top = {k: quantized(head[k]) for k in ("fc", "lm_head") if k in head}
        layer = {k: quantized(w) for k, w in head["layer"].items() if w.ndim == 2}  # not the norms
        if not all(cpu_weights.tileable(q) for q in [*top.values(), *layer.values()]):
            return head
        stacked = lambda q: LayerOf(q.tiled(matmul.TILE), jnp.int32(0))  # noqa: E731
        return {**head, **{k: stacked(q) for k, q in top.items()},
                "layer": {**head["layer"], **{k: stacked(q) for k, q in layer.items()}}}

