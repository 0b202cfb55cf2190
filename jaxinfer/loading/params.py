"""Turn checkpoint tensors (HF names and orientation) into the params pytree.

Every loader exposes a `TensorSource` with HF tensor names: `names()` and
`get(name) -> np.ndarray` in HF orientation ([out, in] for linear weights).
GGUF renames and un-permutes its tensors to fit, so this module is the one
place that knows how checkpoint tensors map onto models/llama.py's layout.
Tensors are read, checked, cast and placed on the device by READ_THREADS
worker threads, at most that many at once, so host memory holds at most
that many tensors; the results are taken in checkpoint order, so the params
are those of a one-at-a-time read, bit for bit. The work is copying out of
memory-mapped files and numpy casts and repacking, which run without the
GIL, so reads of several tensors overlap each other and the device copies.

Layer weights come out stacked [layers, ...], or, for a backend that keeps
one array per layer (its `per_layer_weights`, the GPU's), as PerLayer
(quant/layer_weights.py) with no stacked copy ever made.

Linear weights may come out as QuantizedTensors (quant/tensor.py), stacked
per layer like arrays: `quantization="gguf"` keeps a GGUF file's Q8_0 / Q4_0 /
Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K blocks (sources offering `get_quantized`; the head where
the backend keeps it so, backends/; where the backend keeps K-quants as stored, Q2_K .. Q6_K
as KQuantTensors at the file's size, quant/kquant.py, and a weight whose layers mix block
types as one stack per type, quant/mixed_stack.py),
"gguf-a8" the same with the head and int8 activations (GGUF_QUANTIZATIONS), and "int8" | "int4" | "fp8" |
"w8a8" quantize each float32 weight as it is read (round to nearest, as
quant/params.py's quantize_params; the head stays float except for the
HEAD_SCHEMES, where it is quantized too and a tied model keeps no float
embedding table).

With a mesh (tensor parallelism, parallel/), every tensor goes straight into
its shards: each device gets only its slice of the host tensor
(parallel/placement.py; a memory-mapped safetensors tensor is read slice by
slice), RTN quantization runs sharded under jit with the parts' declared
output shardings, and per-layer slices are stacked on their own devices.
No tensor is ever assembled whole on one device. When the KV heads are
fewer than the devices, wk / wv / bk / bv are read with each KV head
repeated (parallel/sharding.py, the KV-head rule).
On a mesh the tensors are read one at a time: the sharded RTN runs programs
whose cross-device reductions must be launched in the same order on every
device (and, on several hosts, by every process), which reads finishing in
any order on worker threads would not keep.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Protocol

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.backends import XlaBackend
from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.models.llama import param_shapes
from jaxinfer.models.moe import moe_param_shapes
from jaxinfer.parallel.mesh import tensor_parallel_size
from jaxinfer.quant.input_order import InputOrdered
from jaxinfer.quant.kquant import KQuantTensor
from jaxinfer.quant.layer_weights import PerLayer
from jaxinfer.quant.mixed_stack import MixedStack
from jaxinfer.quant.params import HEAD_SCHEMES, QUANTIZED_KEYS, quantize_weight, with_int8_activations
from jaxinfer.quant.tensor import SCHEMES, QuantizedTensor, as_int8_groups
from jaxinfer.utils import host_empty

log = logging.getLogger(__name__)

# "gguf-a8": the file's blocks as "gguf", the head too (a tied model's
# token_embd as lm_head; the float table stays for the lookup), and every
# quantized weight multiplies activations quantized to int8 blocks
# (quant/tensor.py, activation_block): how llama.cpp runs a GGUF.
GGUF_QUANTIZATIONS = ("gguf", "gguf-a8")
# "stored": a quantized HF checkpoint's own weights (GPTQ, AWQ, compressed-
# tensors, fp8: loading/prequantized/), each linear in the form it maps onto,
# a MoE's experts one stack [experts, in, out] per layer (loading/experts.py),
# the head too where the file quantizes it; sources offering `get_stored`.
STORED = "stored"
QUANTIZATIONS = (*GGUF_QUANTIZATIONS, STORED, *SCHEMES)

# Tensors read at once (build_params): enough to keep a few host cores and
# the disk busy; each one in flight holds its host copy.
READ_THREADS = 4

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class TensorSource(Protocol):
    description: str

    def names(self): ...

    def get(self, name: str) -> np.ndarray: ...

    # Optional (GGUF): get_quantized(name) -> QuantizedTensor [in, out] with
    # numpy leaves, or None where the stored type has no direct quantized form.
    # Optional (quantized HF checkpoints): get_stored(name), the same, None
    # where the weight is stored float.


# Our per-layer parameter -> (HF tensor name inside model.layers.{i}., transpose?)
_LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
    # A MoE's (models/moe.py): experts stacked [experts, out, in] per layer
    # (loading/experts.py gives every checkpoint's layout these names);
    # "transpose" swaps the last two axes.
    "router": ("mlp.gate.weight", True),
    "expert_gate": ("mlp.experts.gate_proj.weight", True),
    "expert_up": ("mlp.experts.up_proj.weight", True),
    "expert_down": ("mlp.experts.down_proj.weight", True),
    "shared_w_gate": ("mlp.shared_expert.gate_proj.weight", True),
    "shared_w_up": ("mlp.shared_expert.up_proj.weight", True),
    "shared_w_down": ("mlp.shared_expert.down_proj.weight", True),
    "shared_expert_gate": ("mlp.shared_expert_gate.weight", True),
}
_DENSE_MLP_KEYS = ("w_gate", "w_up", "w_down")
_GLOBAL_TENSORS = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def resolve_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return np.dtype(DTYPES[dtype])
    return np.dtype(dtype)


def _flip(shape) -> tuple:
    """A shape with its last two axes swapped (HF [..., out, in] <-> ours [..., in, out])."""
    shape = tuple(shape)
    return shape[:-2] + shape[-2:][::-1]


def _check_shape(source: TensorSource, name: str, shape, transpose: bool, expected_shape: tuple) -> None:
    """shape: in params orientation; the message speaks the checkpoint's (HF) orientation."""
    if tuple(shape) != tuple(expected_shape):
        flip = _flip if transpose else tuple
        raise CheckpointError(
            f"tensor {name} in {source.description} has shape {flip(shape)}, but the config implies {flip(expected_shape)}"
        )


class _Placement:
    """Where tensors go on a mesh: their shards; `expand` repeats KV heads
    (the KV-head rule, parallel/sharding.py)."""

    def __init__(self, config: ModelConfig, mesh):
        from jaxinfer.parallel.sharding import check_divisible, kv_head_replication

        self.mesh = mesh
        self.tp = tensor_parallel_size(mesh)
        check_divisible(config, self.tp)
        self.kv_replication = kv_head_replication(config.num_kv_heads, self.tp)
        self.num_kv_heads = config.num_kv_heads

    def expand(self, path: str, array):
        from jaxinfer.parallel.sharding import KV_KEYS, expand_kv_weight

        if self.kv_replication == 1 or path not in KV_KEYS:
            return array
        return expand_kv_weight(array, self.num_kv_heads, self.kv_replication)

    def shardings(self, path: str, tree, layer: bool):
        """NamedShardings for `tree` (an array or a QuantizedTensor, numpy or
        ShapeDtypeStructs) as parameter `path`; layer: one layer's slice."""
        from jaxinfer.parallel.placement import layer_shardings
        from jaxinfer.parallel.sharding import named

        if layer:  # specs are declared for the stacked shape: add the layer axis, then drop it
            stacked = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((1, *x.shape), x.dtype), tree)
            return layer_shardings(named(_path_specs(path, stacked, self.tp), self.mesh))
        return named(_path_specs(path, tree, self.tp), self.mesh)

    def put(self, path: str, array: np.ndarray, dtype, layer: bool = False) -> jax.Array:
        from jaxinfer.parallel.placement import put

        array = self.expand(path, array)
        return put(array, self.shardings(path, array, layer), dtype)

    def put_quantized(self, path: str, q: QuantizedTensor, layer: bool = False) -> QuantizedTensor:
        from jaxinfer.parallel.placement import put_tree

        q = self.expand(path, q)
        return put_tree(q, self.shardings(path, q, layer))

    def quantize(self, path: str, w: jax.Array, quantization: str, name: str, layer: bool = True) -> QuantizedTensor:
        # Sharded RTN: scales of a row-parallel weight reduce across shards (GSPMD).
        from jaxinfer.parallel.placement import Hashable

        fn = functools.partial(quantize_weight, scheme=quantization, name=name)
        out = self.shardings(path, jax.eval_shape(fn, w), layer=layer)
        return _sharded_quantizer(quantization, Hashable(out))(w)

    def stack(self, path: str, per_layer: list):
        from jaxinfer.parallel.placement import stack

        stacked = jax.eval_shape(lambda *xs: jax.tree_util.tree_map(lambda *l: jnp.stack(l), *xs), *per_layer)
        return stack(per_layer, self.shardings(path, stacked, layer=False))


@functools.lru_cache(maxsize=None)
def _sharded_quantizer(quantization: str, out_shardings):
    """One jitted RTN per scheme and output sharding, shared by all layers of a weight
    (a fresh jit per layer would compile once per layer)."""
    return jax.jit(functools.partial(quantize_weight, scheme=quantization), out_shardings=out_shardings.value)


def _path_specs(path: str, tree, tp: int):
    from jaxinfer.parallel.sharding import param_specs

    *parents, name = path.split("/")
    nested = {name: tree}
    for parent in reversed(parents):
        nested = {parent: nested}
    specs = param_specs(nested, tp)
    for part in path.split("/"):
        specs = specs[part]
    return specs


def _get(source: TensorSource, name: str, transpose: bool, expected_shape: tuple) -> np.ndarray:
    """The checked host tensor in params orientation (a view where possible: nothing copied yet)."""
    if name not in source.names():
        raise CheckpointError(f"{source.description} lacks tensor {name}")
    array = source.get(name)
    _check_shape(source, name, _flip(array.shape) if transpose else array.shape, transpose, expected_shape)
    return np.swapaxes(array, -1, -2) if transpose else array


def _read(source: TensorSource, name: str, transpose: bool, expected_shape: tuple, dtype,
          placement: _Placement | None = None, path: str = "", layer: bool = False) -> jax.Array:
    array = _get(source, name, transpose, expected_shape)
    if placement is None:
        if transpose:
            # The stored [out, in] bytes go to the device as they lie in the
            # file (a memory-mapped tensor is copied, not rearranged) and are
            # transposed there: numpy's transposing copy ran at ~0.1 GB/s on
            # one host core, most of an 8B model's load.
            return _swap_last_axes(jax.device_put(np.ascontiguousarray(np.swapaxes(array, -1, -2), dtype=dtype)))
        return jax.device_put(np.ascontiguousarray(array, dtype=dtype))
    return placement.put(path, array, dtype, layer)


_swap_last_axes = jax.jit(lambda a: jnp.swapaxes(a, -1, -2))  # a 2-D weight or a MoE's [experts, out, in] stack


def _read_direct(source: TensorSource, name: str, expected_shape: tuple, placement: _Placement | None = None,
                 path: str = "", layer: bool = False, k_quants: bool = False,
                 tiled: bool = False) -> QuantizedTensor | KQuantTensor | None:
    """The checkpoint's own quantized form of a linear weight, on the device,
    or None; k_quants: K-quant blocks as stored (KQuantTensor; one device
    only), in the CPU kernels' tiles where `tiled` and the source can."""
    if name not in source.names():
        raise CheckpointError(f"{source.description} lacks tensor {name}")
    if hasattr(source, "get_stored"):
        q = source.get_stored(name)
    else:
        q = source.get_quantized(name, k_quants_as_stored=True, tiled=tiled) if k_quants else source.get_quantized(name)
    if q is None:
        return None
    _check_shape(source, name, q.shape, True, expected_shape)
    if placement is None:
        return jax.device_put(q)
    return placement.put_quantized(path, q, layer)


def _read_quantized(source, name: str, expected_shape: tuple, quantization: str,
                    placement: _Placement | None = None, path: str = "", k_quants: bool = False,
                    tiled: bool = False):
    """A linear weight [in, out] quantized per `quantization` (None from "gguf"
    when the stored type has no direct form). RTN starts from float32, not
    from the requested dtype, so bfloat16 loads do not round twice."""
    if quantization in GGUF_QUANTIZATIONS or quantization == STORED:
        return _read_direct(source, name, expected_shape, placement, path, layer=True, k_quants=k_quants,
                            tiled=tiled)
    w = _read(source, name, True, expected_shape, np.float32, placement, path, layer=True)
    if placement is None:
        return quantize_weight(w, quantization, name=name)
    return placement.quantize(path, w, quantization, name)


def _stack(per_layer: list):
    return jax.tree_util.tree_map(_stack_leaves, *per_layer)


def _stack_leaves(*leaves):
    # On the host in numpy where every layer is there: jnp.stack compiles an
    # XLA program per shape and layer count (~15 ms each on CPU, dozens a
    # load); into aligned memory, which the device array then keeps.
    if all(isinstance(a, np.ndarray) or a.sharding.device_set <= _host_devices() for a in leaves):
        stacked = host_empty((len(leaves), *leaves[0].shape), leaves[0].dtype)
        np.stack([np.asarray(a) for a in leaves], out=stacked)
        return jax.device_put(stacked)
    return jnp.stack(leaves)


def _host_devices() -> set:
    return set(jax.devices("cpu")) if jax.default_backend() == "cpu" else set()


def _kind(w: QuantizedTensor | KQuantTensor):
    """What must agree for layers to stack as one array."""
    if isinstance(w, KQuantTensor):
        return (w.kind,)
    if isinstance(w, InputOrdered):  # act-order rows (quant/input_order.py): the label is static too
        return ("ordered", w.order_of, *_kind(w.weight))
    return w.scheme, w.group_size, w.offsets is None


def _stored_layers(config: ModelConfig, key: str) -> range | tuple:
    """The layers whose checkpoint holds layer weight `key`: a MoE's dense
    MLP only in its dense layers, its experts only in the sparse ones. The
    other layers get zeros (models/llama.py: a model mixing both kinds holds
    both for every layer)."""
    if config.num_experts and key in _DENSE_MLP_KEYS:
        return config.dense_layers
    if key in moe_param_shapes(config):
        return config.sparse_layers
    return range(config.num_layers)


def _every_layer(per_layer: list, stored, num_layers: int) -> list:
    """The weights read for the `stored` layers, zeros (in the first's form) for the others."""
    if len(stored) == num_layers:
        return per_layer
    read = dict(zip(stored, per_layer))
    return [read[i] if i in read else _zeros_like(per_layer[0]) for i in range(num_layers)]


def _zeros_like(w):
    """A layer of zeros in the form of w (an array or a QuantizedTensor, on w's devices)."""
    return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), w)


def _in_order(thunks: Iterable[Callable], pool: ThreadPoolExecutor | None, ahead: int) -> Iterator:
    """Each thunk's result, in the thunks' order. With a pool, up to `ahead`
    thunks run at once (the one whose result is next among them), so at
    most that many tensors are in flight; without one, each runs here, in turn."""
    if pool is None:
        for thunk in thunks:
            yield thunk()
        return
    pending = collections.deque()
    for thunk in thunks:
        pending.append(pool.submit(thunk))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def build_params(
    config: ModelConfig, source: TensorSource, dtype="float32", progress: bool = True, quantization: str | None = None,
    mesh=None, backend: XlaBackend | None = None, read_threads: int | None = None,
) -> dict:
    """quantization: None or one of QUANTIZATIONS (see the module docstring).
    mesh: None (the default device) or a ("model",) mesh to shard over
    (parallel/sharding.py); the params then fit sharded_config(config, mesh.size).
    backend: which head forms a GGUF load keeps (default: the reference's)
    and whether layer weights come out stacked or one array per layer
    (per_layer_weights), for backend.arrange_weights to arrange.
    read_threads: tensors read at once (default READ_THREADS; 1 reads them
    one at a time on this thread; on a mesh always 1, see the module docstring)."""
    backend = backend or XlaBackend()
    dtype = resolve_dtype(dtype)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization in GGUF_QUANTIZATIONS and not hasattr(source, "get_quantized"):
        raise ValueError(f'quantization="{quantization}" needs a GGUF checkpoint; {source.description} is not one')
    if quantization == STORED and not hasattr(source, "get_stored"):
        raise ValueError(f'quantization="{STORED}" needs a quantized HF checkpoint; {source.description} is not one')
    read_threads = READ_THREADS if read_threads is None else read_threads
    if read_threads < 1:
        raise ValueError(f"read_threads must be at least 1, got {read_threads}")
    placement = None if mesh is None else _Placement(config, mesh)
    threads = 1 if placement is not None else read_threads
    pool = ThreadPoolExecutor(threads, thread_name_prefix="read-weights") if threads > 1 else None
    try:
        return _build_params(config, source, dtype, progress, quantization, placement, backend, pool, threads)
    finally:
        if pool is not None:  # after an error: reads not yet started are dropped, running ones finish
            pool.shutdown(wait=True, cancel_futures=True)


def _build_params(config: ModelConfig, source: TensorSource, dtype: np.dtype, progress: bool,
                  quantization: str | None, placement: _Placement | None, backend: XlaBackend,
                  pool: ThreadPoolExecutor | None, threads: int) -> dict:
    # K-quant blocks as stored, and mixed block types one stack per type,
    # where the backend multiplies them so (on one device: the stacks are
    # not split over a mesh).
    k_quants = backend.keeps_k_quants_as_stored() and placement is None
    # ... read straight into the tiles its kernels read, where it reads tiles.
    tiled = k_quants and backend.tiles_k_quants()
    # "gguf-a8" marks its weights after the load (with_int8_activations), which
    # decides float16 scales over a whole stacked weight: it stays stacked.
    per_layer_layout = backend.per_layer_weights and quantization != "gguf-a8"
    shapes = param_shapes(config)
    total = len(shapes["layers"]) * config.num_layers + len(shapes) - 1
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False)

    def read_global(key: str, shape: tuple):
        name, transpose = _GLOBAL_TENSORS[key]
        # Load-time RTN leaves the head float (quantize_params' include_head
        # default); a GGUF head stored quantized stays as stored where the
        # backend multiplies it so (not on CPU, where XLA casts a quantized
        # head to float whole on every step, see quant/params.py's
        # HEAD_SCHEMES, and the float head is the faster one). "gguf-a8"'s
        # kernel multiplies it as stored.
        keep_head = key == "lm_head" and (quantization in ("gguf-a8", STORED) or (
            quantization == "gguf" and backend.keeps_gguf_head_quantized()))
        head = _read_direct(source, name, shape, placement, key, k_quants=k_quants, tiled=tiled) if keep_head else None
        # A head quantized below is read in float32, so it is rounded once.
        read_dtype = np.float32 if quantization in HEAD_SCHEMES and key in ("embed", "lm_head") else dtype
        return head if head is not None else _read(source, name, transpose, shape, read_dtype, placement, key)

    def read_layer(key: str, name: str, shape: tuple, quantized: bool):
        if quantized:
            return _read_quantized(source, name, shape[1:], quantization, placement, f"layers/{key}", k_quants,
                                   tiled)
        transpose = _LAYER_TENSORS[key][1]
        return _read(source, name, transpose, shape[1:], dtype, placement, f"layers/{key}", layer=True)

    # A tied head kept in the file's blocks (the CPU kernels', few_row_head),
    # read first: where the embedding lookup reads it, no float table is
    # read at all (dequantizing a 50M-weight table was most of a 0.5B's read).
    few_row_head = None
    if backend.wants_tied_head_as_stored(quantization) and config.tie_word_embeddings:
        few_row_head = _tied_head_as_stored(source, config, placement, k_quants, tiled)
    float_embed = few_row_head is None or not backend.lookup_reads_head(few_row_head)
    global_keys = [key for key in shapes if key != "layers" and (key != "embed" or float_embed)]
    layer_names = {key: [f"model.layers.{i}.{_LAYER_TENSORS[key][0]}" for i in _stored_layers(config, key)]
                   for key in shapes["layers"]}

    def quantized(key: str) -> bool:
        return key in QUANTIZED_KEYS and quantization is not None

    # K-quant layers the source repacks straight into one stack (GGUF on
    # CPU): the stream's reads fill it in place, nothing is stacked after.
    filled = {}
    if tiled and not per_layer_layout and hasattr(source, "stacked_k_quants"):
        for key in shapes["layers"]:
            if quantized(key) and len(_stored_layers(config, key)) == config.num_layers:
                filled[key] = source.stacked_k_quants(layer_names[key])
        filled = {key: fills for key, fills in filled.items() if fills is not None}

    # Every tensor in checkpoint order, one stream: the next weight's reads
    # start while the last layers of this one finish.
    thunks = [functools.partial(read_global, key, shapes[key]) for key in global_keys]
    thunks += [filled[key][0][i] if key in filled else functools.partial(read_layer, key, name, shape, quantized(key))
               for key, shape in shapes["layers"].items() for i, name in enumerate(layer_names[key])]
    results = _in_order(thunks, pool, threads)
    params = {}
    for key in global_keys:
        params[key] = next(results)
        bar.update()
    layers = {}
    for key, shape in shapes["layers"].items():
        stored = _stored_layers(config, key)
        names = layer_names[key]
        per_layer = [next(results) for _ in names]
        if key in filled:
            stacked = filled[key][1]()
            _check_shape(source, names[0], stacked.shape[1:], True, shape[1:])
            layers[key] = jax.device_put(stacked)  # aligned host memory: kept, not copied
            bar.update(config.num_layers)
            continue
        if quantized(key):
            kinds = {None if w is None else _kind(w) for w in per_layer}
            if len(kinds) > 1 and None not in kinds and any(isinstance(w, KQuantTensor) for w in per_layer):
                # Layers in different block types, K-quants among them, each
                # kept at its own size: one stack per type (quant/mixed_stack.py),
                # or each layer as it is where the backend keeps them apart.
                # (Mixes of the classic types stay one widened stack below.)
                every = _every_layer(per_layer, stored, config.num_layers)
                layers[key] = PerLayer(every) if per_layer_layout else MixedStack.of(every, _kind, _stack)
                bar.update(config.num_layers)
                del per_layer, every
                continue
            if len(kinds) > 1 and None not in kinds and placement is None and quantization != STORED:
                # Layers in different block types (a Q4_K_M file stores some
                # layers' ffn_down and attn_v as Q6_K, the others as Q4_K): one
                # stacked form that holds each exactly, int8 codes in groups small
                # enough for every layer's scales.
                group_size = math.gcd(*(w.group_size for w in per_layer))
                per_layer = [as_int8_groups(w, group_size) for w in per_layer]
                kinds = {_kind(w) for w in per_layer}
            if len(kinds) != 1 or None in kinds:
                # Some layer's type has no direct form (or, on a mesh, the layers
                # mix types): this weight goes float for all layers.
                if kinds != {None}:
                    log.warning("%s: layers mix quantized forms; loading %s dequantized", source.description, key)
                per_layer = list(_in_order([functools.partial(read_layer, key, name, shape, False) for name in names],
                                           pool, threads))
        per_layer = _every_layer(per_layer, stored, config.num_layers)
        bar.update(config.num_layers)
        if per_layer_layout:
            layers[key] = PerLayer(per_layer)
        else:
            layers[key] = _stack(per_layer) if placement is None else placement.stack(f"layers/{key}", per_layer)
        del per_layer  # free the unstacked copies before the next weight
    params["layers"] = layers
    bar.close()
    if quantization in HEAD_SCHEMES:
        params["lm_head"] = _quantized_head(params, quantization, placement)
    if quantization == "gguf-a8" and "lm_head" not in params and config.tie_word_embeddings:
        head = _tied_head_as_stored(source, config, placement, k_quants, tiled)
        if head is not None:
            params["lm_head"] = head
    if few_row_head is not None:
        # The float head is the faster one past a few rows (see keep_head
        # above); at a few rows a kernel reads the file's blocks, a quarter of
        # the bytes (backends/cpu.py, logits).
        params["few_row_head"] = few_row_head
    if quantization == "gguf-a8":
        params = with_int8_activations(params)
    return params


def _tied_head_as_stored(source: TensorSource, config: ModelConfig, placement, k_quants: bool = False,
                         tiled: bool = False):
    """A tied model's head in the file's own blocks (its embedding table, read
    as a linear weight [hidden, vocab]), or None where its type has no direct form."""
    name = _GLOBAL_TENSORS["embed"][0]  # HF [vocab, hidden] = [out, in]
    return _read_direct(source, name, (config.hidden_size, config.vocab_size), placement, "lm_head",
                        k_quants=k_quants, tiled=tiled)


def _quantized_head(params: dict, quantization: str, placement: _Placement | None) -> QuantizedTensor:
    """The head [hidden, vocab] quantized; a tied model's float table leaves `params`."""
    head = params.pop("lm_head") if "lm_head" in params else params.pop("embed").T
    head = head.astype(jnp.float32)
    if placement is None:
        return quantize_weight(head, quantization, name="lm_head")
    return placement.quantize("lm_head", head, quantization, "lm_head", layer=False)
