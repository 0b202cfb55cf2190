"""The backend seam, and its plain XLA implementation: the reference that runs
on any platform and that every other backend's kernels are tested against.

A backend is chosen once, when a model is loaded (backends/__init__.py,
choose_backend), and holds every platform decision, so that the model code
(models/llama.py) reads as one forward pass:

  loading      the quantization "auto" picks, which head forms a GGUF load
               keeps, and how the loaded weights are laid out (`layout`:
               stacked as loaded, tiled for a CPU kernel, one array per layer)
  layer loop   `run_layers`: how the layers are iterated over that layout
  operations   `linear` / `linears` (every weight scheme, fused projections),
               `expert_linears` (a MoE's grouped expert matmuls),
               `logits` (the head), `paged_attention` and
               `verification_attention` (prefill and decode over the paged
               pool, by the implementation the `attention` option names:
               backends/attention.py)
  settings     the float32 matmul precision of every program, the XLA
               compiler options of the engine's programs, the engine's
               default batch sizes, the KV pool's size and storage dtype,
               and process set-up (kernel builds, host memory)

A backend is a frozen dataclass: hashable, so the jitted programs take it as
a static argument, and its repr (part of the executable cache's key) names
every field that changes what they compile to. Adding a platform means
adding a backend, not editing the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.backends.attention import (ATTENTION_ALIASES, check_attention_name, over_paged_pool, pallas_kernel,
                                         reference_kernel)
from jaxinfer.models.attention import AttentionFn
from jaxinfer.models.layers import rms_norm
from jaxinfer.models.llama import param_shapes
from jaxinfer.models.paged_attention import PagedAttentionMetadata
from jaxinfer.models.residual import settled
from jaxinfer.quant.layer_weights import LayerOf
from jaxinfer.quant.linear import grouped_linear, linear
from jaxinfer.quant.mixed_stack import MixedStack
from jaxinfer.utils import powers_of_two


@dataclasses.dataclass(frozen=True)
class XlaBackend:
    """Plain XLA on any platform: weights stacked [layers, ...] as loaded, the
    layers under one lax.scan (the compiled program holds one layer body
    whatever the depth), every operation in jnp (quant/linear.py,
    models/paged_attention.py), no platform setting."""

    # The engine's defaults on this platform (engine/config.py): every (tokens,
    # seqs) bucket pair compiles at start-up, so a CPU keeps the grid small.
    max_num_seqs: ClassVar[int] = 16
    max_num_batched_tokens: ClassVar[int] = 256
    # The attention implementations this backend runs (backends/attention.py),
    # its default first.
    attentions: ClassVar[tuple[str, ...]] = ("reference", "pallas")
    # Programs the engine compiles at once at start-up (engine/compiled_programs.py).
    compile_threads: ClassVar[int] = 1
    # Whether programs skip work no row of a batch needs with lax.cond
    # (engine/sampler.py), or compute it and select per row.
    conditional_skips: ClassVar[bool] = True
    # The engine's default for async_scheduling (engine/config.py).
    async_scheduling: ClassVar[bool] = False
    # What an fp8 KV pool holds (models/kv_cache.py): float8_e4m3fn, which
    # the kernels and XLA's scatter take as is.
    kv_fp8_dtype: ClassVar[np.dtype] = np.dtype(jnp.float8_e4m3fn)
    # The KV pool's size where the devices report no memory to measure
    # (kv_cache_budget).
    host_kv_cache_bytes: ClassVar[int] = 512 * 2**20
    # Whether the loader hands arrange_weights each layer weight as one array
    # per layer (PerLayer, quant/layer_weights.py), made so as it is read,
    # instead of stacked [layers, ...].
    per_layer_weights: ClassVar[bool] = False

    # The attention implementation every program runs (with_attention).
    attention: str = "reference"
    # Run the Pallas kernels in interpret mode (off a GPU: tests).
    interpret: bool = False
    # Let a float32 model's dots run as TF32 (the explicit opt-in; with_dtype).
    allow_tf32: bool = False
    # jax.default_matmul_precision inside the layer loop and the head (None:
    # JAX's default for the platform); set by with_dtype.
    matmul_precision: str | None = None

    def __post_init__(self):
        # The older option names, resolved once here: "pallas_interpret" is
        # Pallas in interpret mode; "xla" the platform's own non-Pallas attention.
        name = check_attention_name(self.attention)
        if name == "pallas_interpret":
            object.__setattr__(self, "interpret", True)
        if name == "xla":
            name = "native" if "native" in self.attentions else "reference"
        name = ATTENTION_ALIASES.get(name, name)
        if name not in self.attentions:
            raise ValueError(f"attention {name!r} does not run on {type(self).__name__}; it runs {self.attentions}")
        object.__setattr__(self, "attention", name)

    def with_attention(self, attention: str | None) -> XlaBackend:
        """The same backend with the `attention` option applied (None: this
        backend's default): the one place an engine's choice is resolved.
        Pallas runs compiled on a GPU and in interpret mode elsewhere."""
        attention = attention or self.attentions[0]
        interpret = self.interpret or (attention == "pallas" and jax.default_backend() != "gpu")
        return dataclasses.replace(self, attention=attention, interpret=interpret)

    def with_dtype(self, dtype) -> XlaBackend:
        """The backend for a model computing in `dtype` (load() binds it).
        float32 means float32: JAX runs a float32 dot as TF32 on a GPU (and
        in bfloat16 passes on a TPU) unless it asks for full precision, so a
        float32 model's programs are traced with precision "highest" unless
        allow_tf32. Other dtypes keep JAX's default."""
        full = np.dtype(dtype) == np.float32 and not self.allow_tf32
        return dataclasses.replace(self, matmul_precision="highest" if full else None)

    def auto_dtype(self, stored) -> np.dtype:
        """What dtype="auto" computes in, given the dtype the checkpoint stores
        its float weights in (None: not a float dtype, e.g. GGUF blocks): as
        stored (vLLM's rule), bfloat16 for block-quantized files."""
        return np.dtype(stored) if stored is not None else np.dtype(jnp.bfloat16)

    # -- loading ---------------------------------------------------------------
    def auto_quantization(self, source) -> str | None:
        """What quantization="auto" loads `source` as: here as stored."""
        return None

    def keeps_gguf_head_quantized(self) -> bool:
        """Whether a "gguf" load keeps a head the file stores quantized in its
        blocks (else it is loaded float)."""
        return True

    def keeps_k_quants_as_stored(self) -> bool:
        """Whether a "gguf" load holds a file's K-quant weights (Q2_K .. Q6_K)
        as stored (quant/kquant.py: the file's size, multiplied by a kernel
        that expands them) and a weight whose layers mix block types one
        stack per type (quant/mixed_stack.py); else as int8 / int4 groups
        (Q4_K, Q5_K, Q6_K; mixed stacks widened to int8) or dequantized
        (Q2_K, Q3_K). Here (every platform without such a kernel): no."""
        return False

    def lookup_reads_head(self, few_row_head) -> bool:
        """Whether a tied model's embedding lookup reads `few_row_head` (its
        head in the file's blocks, wants_tied_head_as_stored) instead of a
        float table, which the load then does not read."""
        return False

    def tiles_k_quants(self) -> bool:
        """Whether the K-quant weights it keeps as stored are read straight
        into its kernels' tiles of columns (quant/kquant.py, tile) instead
        of the plain layout that arrange_weights would tile."""
        return False

    def wants_tied_head_as_stored(self, quantization: str | None) -> bool:
        """Whether a load that dequantizes a tied model's head also keeps the
        file's own blocks of it as params["few_row_head"] (a CPU kernel's)."""
        return False

    def arrange_weights(self, params: dict) -> dict:
        """Loaded params (layer weights stacked [layers, ...]) -> the form
        this backend's run_layers and operations read. Here: as loaded."""
        return params

    def abstract_params(self, config, dtype, sharding) -> dict | None:
        """What arrange_weights makes of a float checkpoint of `config` whose
        weights load in `dtype` (every one of them, as load() reads a float
        checkpoint), as shapes placed by `sharding`, known before any weight
        is read: what a step can be compiled for while the weights load
        (engine/early_compile.py; scripts/gpu/deviceless.py compiles with no
        device at all). None where the layout is not computed from shapes
        alone (CpuBackend's tiles are arranged in numpy)."""
        stacked = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype), param_shapes(config),
                               is_leaf=lambda x: isinstance(x, tuple))
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                            jax.eval_shape(self.arrange_weights, stacked))

    def start_weight_kernel_builds(self, params: dict) -> None:
        """Start building the kernels that arranged `params` need (arrange_weights
        does; a load that reads arranged params back from a cache calls it)."""

    # -- process and engine settings ---------------------------------------------
    def start_kernel_builds(self, quantization: str | None, source=None) -> None:
        """Start building the platform's kernels in the background (load(),
        once the checkpoint is open: while its weights load). source: the
        checkpoint's tensors, for the kernels their types need."""

    def start_engine(self) -> None:
        """Process settings an engine on this platform wants (LLMEngine start)."""

    def kv_cache_budget(self, devices, memory_fraction: float, one_request_bytes: int,
                        every_request_bytes: int, reserved_bytes: int = 0) -> tuple[int, str]:
        """The bytes the KV pool may take on each of `devices` (the engine's
        devices on this host), and what that number is, for messages: a
        fraction of the free memory where the devices report it (the fullest
        device decides: every one holds a slice of every block), else
        enough for every sequence at full length (every_request_bytes) up to
        host_kv_cache_bytes. one_request_bytes: one sequence at full length.
        reserved_bytes: memory each device still has to give the weights (a
        pool sized before they load), not free for the pool."""
        stats = [d.memory_stats() for d in devices]
        if all(s and "bytes_limit" in s for s in stats):
            free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats) - reserved_bytes
            return int(free * memory_fraction), f"kv_cache_memory_fraction={memory_fraction} of free device memory"
        return (min(every_request_bytes, self.host_kv_cache_bytes),
                f"the default of {self.host_kv_cache_bytes // 2**20} MiB")

    def zeros(self, shape: tuple, dtype) -> jax.Array:
        """A zeroed array on the default device (the KV pool's allocation)."""
        return jnp.zeros(shape, dtype)

    def decode_buckets(self, max_num_seqs: int) -> list[int]:
        """The batch sizes the engine compiles a pure-decode (and a
        verification) step for: every power of two up to max_num_seqs."""
        return powers_of_two(1, max_num_seqs)

    def mixed_seq_buckets(self, num_tokens: int, seq_buckets: list[int]) -> list[int]:
        """The sequence-count buckets the engine compiles a mixed step (prompt
        chunks and decode rows) of num_tokens tokens for, out of seq_buckets
        (each (tokens, seqs) pair is a program): every one up to num_tokens."""
        return [s for s in seq_buckets if s <= num_tokens]

    def compiler_options(self) -> dict | None:
        """XLA options the engine compiles its programs with (jax's
        Lowered.compile(compiler_options=...)): per program, so nothing
        leaks into the user's own jitted code. None: XLA's defaults. (They
        are a function of the backend's class and fields, whose repr keys
        the executable cache.)"""
        return None

    def precision(self):
        """The context every model computation is traced in (matmul_precision)."""
        if self.matmul_precision is None:
            return contextlib.nullcontext()
        return jax.default_matmul_precision(self.matmul_precision)

    # -- the layer loop ------------------------------------------------------------
    def run_layers(self, body, carry, layers: dict, num_layers: int):
        """carry = body(carry, p, layer_index) for each layer in order, where p
        holds that layer's weights (layers' leaves without their layer axis)
        and layer_index is an int32 scalar (traced here: a choice by layer
        goes through select_by_layer)."""
        # A weight stored one stack per format (a GGUF that mixes block types
        # within it) cannot be sliced by the scan: it reaches the body whole,
        # with the layer index (quant/mixed_stack.py).
        mixed = {k: w for k, w in layers.items() if isinstance(w, MixedStack)}
        scanned = {k: w for k, w in layers.items() if k not in mixed}

        def step(carry, per_layer):
            p, layer_index = per_layer
            p = {**p, **{k: LayerOf(w, layer_index) for k, w in mixed.items()}}
            return body(carry, p, layer_index), None

        with self.precision():
            carry, _ = jax.lax.scan(step, carry, (scanned, jnp.arange(num_layers, dtype=jnp.int32)))
        return carry

    def select_by_layer(self, layer_index, layers: tuple[int, ...], chosen, other):
        """chosen() for the layers in `layers`, other() for the rest, inside
        run_layers' body: under lax.cond on the scanned (traced) index."""
        return jax.lax.cond(jnp.isin(layer_index, jnp.asarray(layers, jnp.int32)), chosen, other)

    # -- operations ----------------------------------------------------------------
    def linear(self, x, w):
        """x [..., in] @ one layer's weight w (as run_layers hands it, or a
        model-level one) -> [..., out] in x.dtype."""
        return linear(x, w)

    def linears(self, x, ws: list) -> list:
        """[linear(x, w) for w in ws]: weights on the same input (a layer's q,
        k and v; gate and up), which a kernel may take in one call."""
        return [self.linear(x, w) for w in ws]

    def expert_linears(self, x, ws: list, expert_ids) -> list:
        """Rows x [rows, in] sorted by expert (expert_ids int32 [rows],
        non-decreasing) -> [x[r] @ w[expert_ids[r]] for each row r] [rows,
        out] for each of ws (one layer's experts [experts, in, out], as
        run_layers hands them): one jax.lax.ragged_dot per weight over the
        groups of rows (quant/linear.py, grouped_linear). The reference: a
        TPU groups the rows in ragged_dot; elsewhere XLA expands it into a
        masked product with every expert, which is why the CPU and GPU
        backends multiply the selected experts in kernels of their own."""
        group_sizes = jnp.bincount(expert_ids, length=ws[0].shape[0]).astype(jnp.int32)
        return [grouped_linear(x, w, group_sizes) for w in ws]

    def rms_norm(self, x, weight, eps: float):
        """A layer's or the final RMSNorm of the residual stream x [..., hidden]."""
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x, weight, eps: float):
        """The residual stream x (an array, or a Residual: models/residual.py)
        -> (x as an array, its rms_norm)."""
        x = settled(x)
        return x, self.rms_norm(x, weight, eps)

    def linear_parts(self, x, w):
        """x @ w as float32 partial sums [k, ..., out] for the next
        add_rms_norm to add (models/residual.py), or None: take linear's
        result. None here: XLA's own GEMM and add."""
        return None

    def logits(self, params: dict, hidden) -> jax.Array:
        """Hidden states [..., hidden] -> float32 vocabulary logits: the head
        (an untied or quantized lm_head), else the tied embedding table."""
        with self.precision():
            if "lm_head" in params:
                logits = self.linear(hidden, params["lm_head"])
            else:
                logits = jnp.einsum("...d,vd->...v", hidden, params["embed"])
        return logits.astype(jnp.float32)

    def paged_attention(self, meta: PagedAttentionMetadata, sliding_window, decode: bool, mesh) -> AttentionFn:
        """The attention of a step over the paged pool (models/attention.py's
        interface); decode: one new token per sequence."""
        return over_paged_pool(meta, self.attention_kernel(meta, sliding_window, decode, None, mesh))

    def verification_attention(self, meta: PagedAttentionMetadata, rows: int, sliding_window, mesh) -> AttentionFn:
        """The attention of a step with exactly `rows` query rows per sequence
        (speculative verification)."""
        return over_paged_pool(meta, self.attention_kernel(meta, sliding_window, False, rows, mesh), rows)

    def attention_kernel(self, meta: PagedAttentionMetadata, sliding_window, decode: bool, rows: int | None, mesh):
        """The implementation `attention` names, as a kernel of backends/attention.py."""
        if self.attention == "pallas":
            return pallas_kernel(meta, sliding_window, decode, rows, self.interpret, mesh)
        return reference_kernel(meta, sliding_window, rows)

    # -- speculative decoding ---------------------------------------------------------
    def arrange_eagle_head(self, head: dict) -> dict:
        """An EAGLE draft head's weights (engine/spec/eagle_head.py) as this
        backend's drafting multiplies them: here as loaded."""
        return head

