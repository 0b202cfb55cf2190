"""`load()` and `Model`: a checkpoint's config, params and tokenizer, plus a
cache-free full-sequence forward for scoring and parity checks."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.backends import XlaBackend, choose_backend
from jaxinfer.config import ModelConfig
from jaxinfer.loading.checkpoint import open_checkpoint
from jaxinfer.loading.orbax import OrbaxCheckpoint
from jaxinfer.loading.params import GGUF_QUANTIZATIONS, QUANTIZATIONS, STORED, build_params, resolve_dtype
from jaxinfer.loading.prepared_cache import PreparedParamsCache
from jaxinfer.models.attention import full_sequence_attention
from jaxinfer.models.llama import forward
from jaxinfer.parallel.mesh import tensor_parallel_size
from jaxinfer.quant.params import quantize_params
from jaxinfer.utils import bucket_size, enable_compilation_cache


class Model:
    """config: the config the params run with; on a mesh whose size exceeds the
    KV heads that is parallel/sharding.py's sharded_config (KV heads repeated).
    mesh: None (one device) or the ("model",) mesh the params are sharded over.
    quantization: how the weights were loaded (load()'s choice, "auto" resolved).
    checkpoint_config: the checkpoint's own config (differs from `config` only
    in KV heads repeated on a mesh); what LoRA adapters are checked against.
    backend: the platform backend the params are laid out for (backends/),
    with its default attention; every program runs the model through it."""

    def __init__(self, config: ModelConfig, params: dict, tokenizer, dtype, source: str = "", load_seconds=0.0,
                 mesh=None, quantization: str | None = None, checkpoint_config: ModelConfig | None = None,
                 backend: XlaBackend | None = None):
        self.mesh = mesh
        self.backend = backend or choose_backend(mesh).with_dtype(dtype)
        self.quantization = quantization
        self.config = config
        self.checkpoint_config = checkpoint_config or config
        self.params = params
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.source = source
        self.load_seconds = load_seconds

    def __repr__(self):
        c = self.config
        return (
            f"Model({self.source!r}, {c.architecture}, layers={c.num_layers}, hidden={c.hidden_size}, "
            f"heads={c.num_heads}/{c.num_kv_heads}, vocab={c.vocab_size}, dtype={self.dtype})"
        )

    def on_mesh(self, mesh) -> "Model":
        """The same model with its params copied, shard by shard, to another
        mesh of the same size (a data-parallel replica's device group)."""
        from jaxinfer.parallel.placement import shard_params

        if self.mesh is None or mesh.size != self.mesh.size:
            raise ValueError("on_mesh copies a sharded model to a mesh of the same size")
        return Model(self.config, shard_params(self.params, mesh), self.tokenizer, self.dtype, self.source,
                     self.load_seconds, mesh, self.quantization, self.checkpoint_config, self.backend)

    def logits(self, token_ids) -> np.ndarray:
        """Full-sequence forward without a cache: float32 logits [T, vocab].

        The sequence is padded at the end to a power-of-two bucket so that
        varied lengths share compilations; causal attention keeps padding from
        affecting the real positions.
        """
        token_ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        length = len(token_ids)
        if length == 0:
            raise ValueError("token_ids is empty")
        if token_ids.min() < 0 or token_ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got {token_ids.min()}..{token_ids.max()}")
        padded = np.zeros(bucket_size(length), np.int32)
        padded[:length] = token_ids
        return np.asarray(_full_logits(self.params, self.config, padded[None], self.backend))[0, :length]


@functools.partial(jax.jit, static_argnums=(1, 3))
def _full_logits(params, config: ModelConfig, tokens, backend):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    attention = full_sequence_attention(positions, config.sliding_window)
    hidden, _ = forward(params, config, tokens, positions, attention, backend=backend)
    return backend.logits(params, hidden)


def choose_quantization(quantization: str | None, source, backend: XlaBackend) -> str | None:
    """Resolve quantization="auto", the default of load(), LLM and the CLI: the
    fastest form that loses nothing against the file, which is the backend's
    choice (auto_quantization). On CPU that is a GGUF's own blocks ("gguf":
    the same numbers as the dequantized float weights, in a third of the
    bytes, multiplied by native kernels without a float copy); a float
    checkpoint stays as stored, since every faster scheme changes its
    numbers. On GPUs the weights stay as stored until the GGUF block kernels
    there have been timed.

    Not "gguf-a8", though it is faster still (1.4x at batch 1, 1.7x at batch
    32 on the dev VM) and its perplexity is within 0.1% of the float model's:
    rounding activations to int8 amplifies float rounding noise. The same
    prompt forwarded with 7 more tokens after it (other shapes, other
    summation orders) gives its positions logits up to 4.6e-5 apart under
    "gguf" and up to 1.1 apart under "gguf-a8", so a prefix-cache hit or a
    different batch can change a greedy decode at a near tie, which the
    exact default never does (BENCHMARKS.md).

    A quantized HF checkpoint (GPTQ, AWQ, compressed-tensors, fp8) keeps
    its own weights ("stored") on every platform: they are the model as
    published, and a float copy would be 4-8x the bytes."""
    if quantization != "auto":
        return quantization
    if getattr(source, "prequantized", False):
        return STORED
    return backend.auto_quantization(source)


def load(model=None, dtype="auto", progress: bool = True, quantization: str | None = "auto", mesh=None,
         backend: XlaBackend | None = None, before_weights=None, read_threads: int | None = None) -> Model:
    """Load a model: None (the embedded SmolLM2-135M-Instruct), a HF directory
    (config.json + safetensors), a .gguf file, or a jaxinfer checkpoint directory
    (`jaxinfer convert`). dtype: of the unquantized weights and the
    activations: "auto" (the backend's auto_dtype: float32 on CPU, elsewhere
    the dtype the checkpoint stores its float weights in, bfloat16 for a
    GGUF's blocks), float32, bfloat16 or float16.

    quantization: "auto" (choose_quantization: a GGUF's own blocks on CPU,
    otherwise as stored), None (float weights; GGUF blocks dequantized), "gguf" (keep
    a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K linear
    weights quantized as int8 / int4 in the file's groups, other types
    dequantized), "gguf-a8" (the same, the head too, multiplying activations
    rounded to int8 blocks of 32 on the fly: quant/tensor.py's
    activation_block; opt-in, see choose_quantization), or "int8" | "int4" | "fp8"
    (round-to-nearest of the float32 linear weights at load time: int8 / fp8
    per output channel, int4 in groups of 128 rows or fewer, see
    quant/params.py; the embedding, head and norms stay float), or "w8a8"
    (int8 per channel for the linear weights and the head, a tied model's
    lookup reading the head; activations quantized to int8 per row on the fly,
    quant/linear.py: the fastest scheme on CPU, opt-in because it changes the
    numbers, see BENCHMARKS.md for its perplexity), or "stored" (a quantized
    HF checkpoint's own GPTQ / AWQ / compressed-tensors / fp8 weights in the
    forms of quant/tensor.py, loading/prequantized/: what "auto" loads there;
    None loads them dequantized to float).

    mesh: None (one device), or a ("model",) mesh (parallel/mesh.py): every
    weight is loaded or restored straight into its shards (parallel/sharding.py).

    backend: the platform backend (backends/; default choose_backend(mesh)),
    bound to the dtype (with_dtype). It decides what "auto" loads and which
    head forms a GGUF load keeps, and lays the loaded params out for itself
    (backend.arrange_weights: e.g. tiled for the CPU kernels, one array per layer on
    a GPU). Tools that need the stacked layout whatever the platform
    (checkpoint conversion, calibration) pass XlaBackend().

    before_weights: None, or a function called with (config as the model
    will run it, dtype, mesh, backend, quantization) once the checkpoint's
    config is read and before any weight is, to decide (or refuse) what
    depends on those alone, such as the KV pool, or to start compiling
    (LLM).

    read_threads: tensors read at once from a safetensors or GGUF file
    (loading/params.py's build_params; default READ_THREADS, 1 one at a time)."""
    if quantization not in (None, "auto", *QUANTIZATIONS):
        raise ValueError(f"quantization must be None, 'auto' or one of {QUANTIZATIONS}, got {quantization!r}")
    enable_compilation_cache()
    start = time.perf_counter()
    np_dtype = None if dtype == "auto" else resolve_dtype(dtype)  # a bad name fails before any reading
    config, source, tokenizer, description = open_checkpoint(model)
    backend = backend or choose_backend(mesh)
    if np_dtype is None:
        np_dtype = backend.auto_dtype(getattr(source, "stored_dtype", None))
    backend = backend.with_dtype(np_dtype)
    quantization = choose_quantization(quantization, source, backend)
    backend.start_kernel_builds(quantization, source)  # while the weights load
    run_config = config
    if mesh is not None:
        from jaxinfer.parallel.sharding import sharded_config

        # Checks the sizes divide before anything is read.
        run_config = sharded_config(config, tensor_parallel_size(mesh))
    if before_weights is not None:
        before_weights(run_config, np_dtype, mesh, backend, quantization)
    if isinstance(source, OrbaxCheckpoint):  # a jaxinfer checkpoint: restored by orbax onto the device(s)
        if quantization in (*GGUF_QUANTIZATIONS, STORED):
            raise ValueError(f'quantization="{quantization}" needs a {"GGUF" if quantization != STORED else "quantized HF"} '
                             f'checkpoint; {description} is not one')
        sharding = None if mesh is None else _orbax_shardings(source, config, mesh)
        params = source.restore(np_dtype, sharding=sharding, progress=progress)
        if mesh is not None:
            from jaxinfer.parallel.placement import expand_kv_params

            params = expand_kv_params(params, config.num_kv_heads, mesh)
        if quantization is not None:
            params = quantize_params(params, quantization)
            if mesh is not None:
                from jaxinfer.parallel.placement import shard_params

                params = shard_params(params, mesh)
        params = backend.arrange_weights(params)
    else:
        # A GGUF loaded before with the same options reads back its arranged params instead of converting.
        prepared = PreparedParamsCache.for_gguf_load(source, mesh, quantization, np_dtype, backend)
        params = prepared.read() if prepared else None
        if params is not None:
            backend.start_weight_kernel_builds(params)
        else:
            params = backend.arrange_weights(build_params(config, source, np_dtype, progress=progress,
                                                          quantization=quantization, mesh=mesh, backend=backend,
                                                          read_threads=read_threads))
            if prepared:
                prepared.write_behind(params)
    jax.block_until_ready(params)
    return Model(run_config, params, tokenizer, np_dtype, description, time.perf_counter() - start, mesh,
                 quantization, config, backend)


def _orbax_shardings(source: OrbaxCheckpoint, config: ModelConfig, mesh):
    """(stored path, shape, dtype) -> the NamedSharding orbax restores that array
    into: its declared spec, or replicated for KV weights whose heads are
    repeated after the restore (the KV-head rule; they are small)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxinfer.parallel.sharding import KV_KEYS, kv_head_replication, stored_spec

    replicate_kv = kv_head_replication(config.num_kv_heads, tensor_parallel_size(mesh)) > 1

    def sharding_for(path, shape, dtype):
        head, _, last = path.rpartition("/")
        param = head if last in ("data", "scales", "offsets") and "scheme" in source.structure.get(head, {}) else path
        if replicate_kv and param in KV_KEYS:
            return NamedSharding(mesh, PartitionSpec())
        logical = tuple(source.structure[param]["shape"])
        return NamedSharding(mesh, stored_spec(path, tuple(shape), logical, tensor_parallel_size(mesh)))

    return sharding_for
