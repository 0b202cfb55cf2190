"""The CPU backend's weights (backends/cpu.py): which native kernel multiplies
each form of weight at how many rows, and the layout the kernels read them
in. The one table of those choices: the native wrappers (native/matmul.py,
kquant_matmul.py, expert_matmul.py) say only what a kernel can take, and
quant/linear.py is the XLA reference everything else falls back to.

  a layer weight, x [rows, in] by one layer of a stack read in place (LayerOf):
    QuantizedTensor with activation_block   q8_matmul.cc, any rows
    QuantizedTensor int8 / int4             matmul.cc up to max_exact_rows()
    KQuantTensor with activation_block      q8_matmul.cc's K-quant handler, any rows
    KQuantTensor                            kquant_matmul.cc up to KQUANT_MAX_ROWS
    a MixedStack of K-quants                either K-quant kernel, as a KQuantTensor: the
                                            call reads the part that holds the layer
    another MixedStack's layer              its part's kernel, under a switch (LayerOf.apply)
    an InputOrdered's layer                 its weight's, on the activations gathered by its
                                            order first (models/llama.py, adapted_linears)
    anything else                           the reference on the sliced layer
  The exact kernels (matmul.cc, kquant_matmul.cc) take a weight with an
  activation block where the int8-activation one does not, on the
  activations rounded to its blocks first: the same numbers. Weights of one
  layer on the same x (q, k and v; gate and up) share one call where one
  kernel takes them all: either K-quant kernel; matmul.cc with no
  activation block, one group size, offsets on all or none.

  a MoE's experts [layers, experts, in, out], only the selected ones read:
    float32                                 expert_matmul.cc
    int8 / int4, one activation block       matmul.cc's expert entry
    anything else                           the reference's ragged_dot

  the head (logits): a tied GGUF head's own blocks (few_row_head) up to
  FEW_ROW_HEAD_MAX_ROWS rows where a kernel takes them, else a quantized
  [hidden, vocab] lm_head, each as the one layer of a stack (in_place).

The native kernels are registered for XLA's CPU platform only; a kernel
that failed to build (available() False) is never chosen.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.native import expert_matmul, kquant_matmul, matmul
from jaxinfer.native.build import cpu_has, cpu_runs_vec16
from jaxinfer.quant.input_order import InputOrdered
from jaxinfer.quant.kquant import KQuantTensor
from jaxinfer.quant.layer_weights import LayerOf
from jaxinfer.quant.linear import linear
from jaxinfer.quant.mixed_stack import MixedStack
from jaxinfer.quant.schemes import int8_blocks
from jaxinfer.quant.tensor import QuantizedTensor

# Rows up to which matmul.cc beats XLA's path (a float copy of the weight,
# then a GEMM that shares it across the rows): the engine's steps are 256
# rows by default, so a larger max_num_batched_tokens takes XLA past 512
# (BENCHMARKS.md, "Why the CPU path is built this way", native kernels).
# Past 8 rows that is the kernel's register-tiled path (vec16.h). With
# AVX2's 16 registers its tile is a quarter as wide: the default model's
# projections x 30 layers on the Zen 3 VM, kernel against XLA on the same
# tiled weights, 128 rows 330 / 464 ms, 256 620 / 625, 512 1190 / 1062. A
# CPU with neither runs the few-row loop there, which loses to XLA from ~24
# rows.
EXACT_MAX_ROWS = 512
EXACT_MAX_ROWS_AVX2 = 256
EXACT_MAX_ROWS_WITHOUT_VEC16 = 8
# Rows up to which kquant_matmul.cc serves (as matmul.cc); past it the reference.
KQUANT_MAX_ROWS = 512
# Rows up to which a tied GGUF head's own blocks (few_row_head) beat the
# float table: a quarter of the bytes, and past ~8 rows the exact kernel's
# register-tiled path; past 128 rows the float table's dot wins
# (BENCHMARKS.md, "Why the CPU path is built this way", the head).
FEW_ROW_HEAD_MAX_ROWS = 128


def max_exact_rows() -> int:
    """The rows up to which matmul.cc multiplies a layer weight on this CPU."""
    if cpu_has("avx512f"):
        return EXACT_MAX_ROWS
    return EXACT_MAX_ROWS_AVX2 if cpu_runs_vec16() else EXACT_MAX_ROWS_WITHOUT_VEC16


@dataclasses.dataclass(frozen=True)
class WeightKernel:
    """A native kernel for one layer of stacked weights."""

    name: str
    available: Callable[[], bool]
    # (x [rows, in], stacks, layer_index) -> [float32 [rows, out] per stack]
    matmuls: Callable
    # Float activations: a weight with an activation block gets them rounded
    # to its int8 blocks first. (The int8-activation kernels round them.)
    exact: bool
    # Whether one call takes all of these stacks (each one this kernel's); None: one weight a call.
    together: Callable[[list], bool] | None

    def __call__(self, x, stacks: list, layer_index) -> list:
        """[x [..., in] @ layer layer_index of w for w in stacks], each [..., out] in x.dtype."""
        rows = math.prod(x.shape[:-1])
        x2 = x.reshape(rows, -1)
        if self.exact and _activation_block(stacks[0]):
            x2 = int8_blocks(x2, stacks[0].activation_block)
        ys = self.matmuls(x2, stacks, layer_index)
        return [y.astype(x.dtype).reshape(*x.shape[:-1], w.out_features) for y, w in zip(ys, stacks)]

    def takes_together(self, stacks: list) -> bool:
        # An exact kernel rounds x to one weight's activation blocks (__call__): none may have them.
        return (self.together is not None and not (self.exact and any(_activation_block(w) for w in stacks))
                and self.together(stacks))


def _activation_block(w) -> int:
    """A stacked weight's activation block (0: float activations); a
    MixedStack's 0: the exact kernel takes its parts only without one
    (kernel_for)."""
    return 0 if isinstance(w, MixedStack) else w.activation_block


def _one_at_a_time(matmul_fn):
    return lambda x, stacks, layer_index: [matmul_fn(x, w, layer_index) for w in stacks]


EXACT = WeightKernel("matmul.cc", matmul.available, matmul.quantized_matmuls, True, matmul.share_attributes)
Q8 = WeightKernel("q8_matmul.cc", matmul.q8_available, _one_at_a_time(matmul.q8_matmul), False, None)
KQUANT = WeightKernel("kquant_matmul.cc", kquant_matmul.available, kquant_matmul.kquant_matmuls, True,
                      lambda stacks: True)
KQUANT_Q8 = WeightKernel("q8_matmul.cc (K-quant)", kquant_matmul.q8_available, kquant_matmul.q8_kquant_matmuls,
                         False, lambda stacks: True)


def kernel_for(rows: int, w) -> WeightKernel | None:
    """The kernel that multiplies x [rows, in] by (a layer of) w, a weight as
    stored (one matrix or a stack of layers), or None: the reference."""
    if jax.default_backend() != "cpu" or rows < 1:
        return None
    if isinstance(w, MixedStack):
        # One call whatever the layer's part (no switch, and q|k|v share it):
        # where one K-quant kernel takes every part.
        exact = all(isinstance(p, KQuantTensor) and not p.activation_block for p in w.parts)
        candidates = [(KQUANT_Q8, kquant_matmul.supports_q8(w)),
                      (KQUANT, exact and rows <= KQUANT_MAX_ROWS and kquant_matmul.supports(w))]
    elif isinstance(w, KQuantTensor):
        candidates = [(KQUANT_Q8, w.activation_block and kquant_matmul.supports_q8(w)),
                      (KQUANT, rows <= KQUANT_MAX_ROWS and kquant_matmul.supports(w))]
    elif isinstance(w, QuantizedTensor):
        candidates = [(Q8, w.activation_block and matmul.supports_q8(w)),
                      (EXACT, rows <= max_exact_rows() and matmul.supports(w))]
    else:
        return None
    return next((kernel for kernel, takes in candidates if takes and kernel.available()), None)


def linears(x, ws: list) -> list:
    """[x @ w for w in ws] (the CPU backend's linear and linears): each layer
    weight (LayerOf) by its kernel, one call for all where one kernel takes
    them together; a MixedStack's layer that no kernel takes whole by its
    part's; the reference for the rest."""
    rows = math.prod(x.shape[:-1])
    mixed = [isinstance(w, LayerOf) and isinstance(w.stacked, MixedStack) and kernel_for(rows, w.stacked) is None
             for w in ws]
    rest = iter(_linears_unmixed(x, [w for w, m in zip(ws, mixed) if not m]))
    return [w.apply(lambda stacked, index: linears(x, [LayerOf(stacked, index)])[0]) if m else next(rest)
            for w, m in zip(ws, mixed)]


def _linears_unmixed(x, ws: list) -> list:
    rows = math.prod(x.shape[:-1])
    kernels = [kernel_for(rows, w.stacked) if isinstance(w, LayerOf) else None for w in ws]
    if len(ws) > 1 and kernels[0] is not None and all(
            k is kernels[0] and w.index is ws[0].index for k, w in zip(kernels, ws)):
        stacks = [w.stacked for w in ws]
        if kernels[0].takes_together(stacks):
            return kernels[0](x, stacks, ws[0].index)
    return [linear(x, w.layer() if isinstance(w, LayerOf) else w) if k is None else k(x, [w.stacked], w.index)[0]
            for k, w in zip(kernels, ws)]


@dataclasses.dataclass(frozen=True)
class ExpertKernel:
    """A native kernel for a MoE's stacks of experts, reading the selected ones only."""

    name: str
    # (x [rows, in], stacks, layer_index, expert_ids) -> [float32 [rows, out] per stack]
    matmuls: Callable

    def __call__(self, x, ws: list, expert_ids) -> list:
        """Rows x [rows, in] sorted by expert, each by its expert of one layer of
        each stack (LayerOf) -> [rows, out] in x.dtype for each."""
        stacks = [w.stacked for w in ws]
        block = stacks[0].activation_block if isinstance(stacks[0], QuantizedTensor) else 0
        xq = int8_blocks(x, block) if block else x
        return [y.astype(x.dtype) for y in self.matmuls(xq, stacks, ws[0].index, expert_ids)]


FLOAT_EXPERTS = ExpertKernel("expert_matmul.cc", expert_matmul.expert_matmuls)
QUANTIZED_EXPERTS = ExpertKernel("matmul.cc (experts)", matmul.quantized_expert_matmuls)


def expert_kernel_for(ws: list) -> ExpertKernel | None:
    """The kernel that multiplies the rows by these experts (one layer of each
    stack, LayerOf, the same layer), or None: the reference."""
    if jax.default_backend() != "cpu" or not all(isinstance(w, LayerOf) and w.index is ws[0].index for w in ws):
        return None
    stacks = [w.stacked for w in ws]
    if expert_matmul.supports(stacks) and expert_matmul.available():
        return FLOAT_EXPERTS
    if (all(isinstance(w, QuantizedTensor) for w in stacks) and len({w.activation_block for w in stacks}) == 1
            and matmul.supports_experts(stacks) and matmul.experts_available()):
        return QUANTIZED_EXPERTS
    return None


def head(params: dict, rows: int) -> LayerOf | None:
    """The head a kernel multiplies `rows` rows of hidden states by, as the
    one layer of a stack (in_place), or None: the reference's head (the
    float table, or an lm_head the kernels do not take). A few_row_head up
    to FEW_ROW_HEAD_MAX_ROWS rows, and at any row count where it is the
    head's only copy (layout dropped the float table)."""
    few_row_head = params.get("few_row_head")
    if few_row_head is not None and ("embed" not in params or (
            rows <= FEW_ROW_HEAD_MAX_ROWS and kernel_for(rows, few_row_head) is not None)):
        return in_place(few_row_head)
    lm_head = params.get("lm_head")
    if isinstance(lm_head, (QuantizedTensor, KQuantTensor)) and len(lm_head.shape) == 2:
        return in_place(lm_head)
    return None


def in_place(w) -> LayerOf:
    """A quantized [hidden, vocab] head as the one layer of a stack, so that a
    native kernel reads it in place (a leading axis of 1 is a free reshape)."""
    return LayerOf(jax.tree.map(lambda a: a[None], w), jnp.int32(0))


# -- layout ----------------------------------------------------------------------------
def layout(params: dict) -> dict:
    """The quantized weights the kernels read in tiles of columns, tiled, one
    weight at a time (the untiled copy is freed as it goes, so only one is
    held at a time): a kernel task then reads one contiguous run of memory
    (BENCHMARKS.md, "Why the CPU path is built this way", tiled weights).
    The stacked layers and the tied head's few-row copy (dropped where no
    kernel takes it); a tied lm_head stays plain, since the embedding
    lookup reads its columns. Starts the K-quant kernels' builds."""
    layers = params["layers"]
    for key in layers:
        layers[key] = tiled(layers[key])
    few_row_head = params.pop("few_row_head", None)
    if few_row_head is not None and keeps_few_row_head(few_row_head):
        params["few_row_head"] = tiled(few_row_head)
        if lookup_reads_head(few_row_head):
            params.pop("embed", None)  # where the load read it
    # An untied head in its blocks (no lookup reads its columns while
    # "embed" is there): tiled, as the layers, so that a one-row step
    # streams it (the K-quant kernels read tiles only).
    if isinstance(params.get("lm_head"), (QuantizedTensor, KQuantTensor)) and "embed" in params:
        params["lm_head"] = tiled(params["lm_head"])
    return params


def keeps_few_row_head(few_row_head) -> bool:
    """Whether a tied GGUF head's own blocks stay, for the kernels that read
    them. A K-quant head is kept unasked: its kernels read tiles only, and
    asking would wait for their build."""
    return isinstance(few_row_head, KQuantTensor) or bool(kernel_for(1, few_row_head))


def lookup_reads_head(few_row_head) -> bool:
    """Whether the embedding lookup reads a tied head's own blocks instead
    of a float table (models/llama.py, embed), so that none is kept. An int8
    or K-quant copy (a GGUF's Q8_0 or Q6_K table) holds every number of the
    float table, which would cost 108 MB for the default model and 545 MB
    for a 151k-vocabulary 0.5B. Past FEW_ROW_HEAD_MAX_ROWS the head's rows
    then run the kernel too, where the float table's dot was a little faster
    (256 rows 79.4 vs 75.3 ms): rows past 128 are rare on CPU, the memory is
    every run's."""
    return keeps_few_row_head(few_row_head) and (isinstance(few_row_head, KQuantTensor) or (
        isinstance(few_row_head, QuantizedTensor) and few_row_head.scheme == "int8"))


def tileable(w: QuantizedTensor) -> bool:
    """Whether w (a layer weight or a MoE's stack of experts, plain) goes in
    tiles: where a kernel that reads tiles multiplies it, i.e. the exact
    kernel's layer weights (the int8-activation kernel reads the plain
    layout, where tiles were slower) and the experts' kernel's stacks."""
    if w.data.ndim == 4:
        return matmul.tileable_experts(w) and jax.default_backend() == "cpu" and matmul.experts_available()
    return not w.activation_block and matmul.tileable(w) and kernel_for(1, w) is EXACT


def tiled(w):
    """w in its kernel's tiles where a kernel reads it so (tileable; K-quants
    wherever their kernels run: they read tiles only), else as it is; each
    part of a MixedStack so, and the weight of an InputOrdered (its order
    is the activations')."""
    if isinstance(w, MixedStack):
        return w.replace_parts(tiled)
    if isinstance(w, InputOrdered):
        return w.with_weight(tiled(w.weight))
    if isinstance(w, KQuantTensor):
        return w.tiled(kquant_matmul.TILE) if kquant_matmul.tileable(w) else w
    if isinstance(w, QuantizedTensor) and tileable(w):
        return w.tiled(matmul.TILE)
    return w


def start_kquant_builds(params: dict) -> None:
    """Where the params hold K-quants: the int8-activation kernel's build on a
    thread (a "gguf-a8" load's), and their kinds' exact kernels loaded before
    returning (built first where not cached): a program read back from the
    executable cache calls them with no trace that would load them."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, KQuantTensor))
    kquants = [w for w in leaves if isinstance(w, KQuantTensor)]
    if not kquants:
        return
    if any(w.activation_block for w in kquants):
        threading.Thread(target=kquant_matmul.q8_available, daemon=True).start()
    kquant_matmul.load_kinds(kquant_matmul.kinds_of(kquants))


def kquant_builds(int8_activations: bool, kinds) -> list:
    """The K-quant kernels' build-and-load calls, one a thread: the exact
    kernel's handler, each kind's kernels (kinds: KINDS' names), and the
    int8-activation kernel for a "gguf-a8" load."""
    return [kquant_matmul.available, *(functools.partial(kquant_matmul.load_kinds, [kind]) for kind in sorted(kinds)),
            *([kquant_matmul.q8_available] if int8_activations else [])]
