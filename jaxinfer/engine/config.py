"""EngineConfig (the engine's options, checked) and the size of the KV pool."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import InitVar, dataclass

import jax
import numpy as np

from jaxinfer.backends.attention import check_attention_name
from jaxinfer.backends.xla import XlaBackend
from jaxinfer.engine.spec.config import SpeculativeConfig
from jaxinfer.loading.model import Model
from jaxinfer.models import kv_cache
from jaxinfer.parallel.mesh import context_parallel_size

log = logging.getLogger(__name__)

WARMUPS = ("background", "all", "on_demand")


@dataclass
class EngineConfig:
    max_model_len: int
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.9
    # None: the model's backend's defaults (for_backend; backends/: every
    # (tokens, seqs) bucket pair compiles at start-up, so CPU keeps the grid
    # small; a GPU needs wide batches to fill it).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "continuous"
    # The attention implementation (backends/attention.py): "reference",
    # "native" (CPU) or "pallas"; None: the model's backend's default.
    attention: str | None = None
    # "auto" (the model's dtype), "int8" or "fp8" (see models/kv_cache.py).
    kv_cache_dtype: str = "auto"
    # None, or {"method": "ngram" | "draft_model" | "eagle", "num_speculative_tokens": k, ...}
    # (see engine/spec/config.py); parsed into a SpeculativeConfig.
    speculative: dict | SpeculativeConfig | None = None
    # Structured outputs: seconds a request waits for its grammar to compile
    # before it fails (the compile runs on a worker thread, off the step path).
    structured_outputs_compile_timeout: float = 10.0
    # Schedule and launch step N + 1 while step N runs on the device
    # (engine/engine.py); None: the model's backend's default (on with a
    # GPU, where the host's share of a step is largest; off on CPU, where
    # the host work would share the cores the step runs on). Not with
    # speculative decoding (a step's drafts come from the previous step's outputs).
    async_scheduling: bool | None = None
    # Which step programs compile before the engine serves, and when the rest
    # do (engine/compiled_programs.py, warmup): "background" (serve once each
    # layout's smallest bucket is compiled, compile the rest on a thread),
    # "all" (every bucket first), or "on_demand" (the smallest buckets first,
    # each other bucket when a step first needs it: only what runs compiles,
    # and that step waits for it). The environment variable JAXINFER_WARMUP
    # sets the default. Across processes "background" runs as "all": lockstep
    # hosts must pick the same buckets.
    warmup: str = dataclasses.field(default_factory=lambda: os.environ.get("JAXINFER_WARMUP", "background"))
    # LoRA (lora/): serve PEFT adapters, up to max_loras distinct ones in a
    # step, each of rank <= max_lora_rank (vLLM's names and defaults).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # The attention option's older name, accepted for one release.
    attention_backend: InitVar[str | None] = None
    # warmup's older form, accepted for one release: True is "background", False "all".
    background_compile: InitVar[bool | None] = None

    def __post_init__(self, attention_backend=None, background_compile=None):
        if attention_backend is not None:
            if self.attention is not None:
                raise ValueError("give attention or its older name attention_backend, not both")
            self.attention = attention_backend
        if background_compile is not None:
            self.warmup = "background" if background_compile else "all"
        if self.warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {WARMUPS}, got {self.warmup!r} (the default comes from the "
                             "environment variable JAXINFER_WARMUP when it is set)")
        check_attention_name(self.attention)
        kv_cache.check_kv_cache_dtype(self.kv_cache_dtype)
        self.speculative = SpeculativeConfig.parse(self.speculative)
        if self.async_scheduling and self.speculative is not None:
            raise ValueError("async_scheduling does not work with speculative decoding (each step's drafts come "
                             "from the previous step's outputs); leave it unset or False")
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is None and name.startswith("max_num"):
                continue  # the backend's default (for_backend)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if None not in (self.max_num_seqs, self.max_num_batched_tokens) and \
                self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks must be an int >= 2 (block 0 is reserved), got {self.num_kv_blocks!r}")
        if not (isinstance(self.structured_outputs_compile_timeout, (int, float))
                and self.structured_outputs_compile_timeout > 0):
            raise ValueError("structured_outputs_compile_timeout must be a positive number of seconds, got "
                             f"{self.structured_outputs_compile_timeout!r}")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.enable_lora and self.speculative is not None:
            raise ValueError("enable_lora with speculative decoding is not supported (the drafts would come "
                             "from the base model, not the request's adapter)")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")

    def for_backend(self, backend: XlaBackend) -> EngineConfig:
        """This config with the defaults of the model's backend filled in
        (batch sizes, async scheduling), checked again as a whole."""
        return dataclasses.replace(
            self, max_num_seqs=self.max_num_seqs or backend.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or backend.max_num_batched_tokens,
            async_scheduling=(backend.async_scheduling and self.speculative is None
                              if self.async_scheduling is None else self.async_scheduling))

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative is not None else 0


def check_context_parallel(config: EngineConfig, mesh) -> None:
    """What context parallelism (models/ring_attention.py) does not serve yet, refused up front."""
    cp = context_parallel_size(mesh)
    if cp == 1:
        return
    if config.kv_cache_dtype != "auto":
        raise ValueError("context_parallel_size > 1 needs kv_cache_dtype='auto' (a float KV cache)")
    if config.speculative is not None:
        raise ValueError("context_parallel_size > 1 does not support speculative decoding")
    if config.enable_lora:
        raise ValueError("context_parallel_size > 1 does not support LoRA adapters yet")
    if config.attention not in (None, "reference", "xla", "jnp"):
        raise ValueError("context_parallel_size > 1 runs its own ring attention (plain jnp); attention must be "
                         "'reference' or unset")
    if config.num_kv_blocks is not None and config.num_kv_blocks % cp:
        raise ValueError(f"num_kv_blocks ({config.num_kv_blocks}) must be a multiple of context_parallel_size ({cp}): "
                         "each device holds num_kv_blocks / context_parallel_size blocks")
    if config.num_kv_blocks is not None and config.num_kv_blocks // cp < 2:
        raise ValueError(f"num_kv_blocks must give each of the {cp} context devices at least 2 blocks")


@dataclass(frozen=True)
class ModelShape:
    """What sizing the KV pool needs of a model (a loaded Model has the same
    fields), known before its weights are read (load's before_weights)."""

    config: object  # ModelConfig, as the model runs it
    dtype: object
    mesh: object
    backend: XlaBackend


def kv_block_bytes(model: Model | ModelShape, block_size: int, kv_cache_dtype: str = "auto") -> int:
    return kv_cache.kv_block_bytes(model.config, block_size, model.dtype, kv_cache_dtype)


def _pool_budget(model: Model | ModelShape, config: EngineConfig, per_block: int,
                 reserved_bytes: int = 0) -> tuple[int, str]:
    """The KV pool's bytes on each device (the model's backend decides:
    kv_cache_budget) and what the number is."""
    devices = [jax.devices()[0]] if model.mesh is None else [
        d for d in model.mesh.devices.flat if d.process_index == jax.process_index()]
    blocks_per_request = -(-config.max_model_len // config.block_size)
    return model.backend.kv_cache_budget(devices, config.kv_cache_memory_fraction, (blocks_per_request + 1) * per_block,
                                         config.max_num_seqs * blocks_per_request * per_block, reserved_bytes)


def choose_num_blocks(model: Model | ModelShape, config: EngineConfig, extra_block_bytes: int = 0,
                      reserved_bytes: int = 0) -> int:
    """extra_block_bytes: memory per block of another pool with as many blocks
    (a draft model's), which shares the budget. reserved_bytes: memory the
    device still has to give the model's weights (a pool sized before they
    load: engine/early_compile.py)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_block_bytes(model, config.block_size, config.kv_cache_dtype) + extra_block_bytes
    if model.mesh is not None:  # the pool is split on KV heads: each device holds 1 / N of every block
        per_block = -(-per_block // model.mesh.size)
    budget, _ = _pool_budget(model, config, per_block, reserved_bytes)
    num_blocks = max(2, budget // per_block + 1)
    cp = context_parallel_size(model.mesh)
    num_blocks = max(cp, num_blocks // cp * cp)  # context parallelism: the same block count on every device
    if jax.process_count() > 1:
        # Lockstep hosts must build the same pool (same shapes, same programs): the smallest wins.
        from jax.experimental import multihost_utils

        num_blocks = int(np.min(multihost_utils.process_allgather(np.int64(num_blocks))))
    return num_blocks


def fit_default_context(model: Model | ModelShape, config: EngineConfig) -> EngineConfig:
    """A max_model_len taken from the model (not given) when the KV pool can
    hold one request of it; else the longest context the pool holds, said in
    one line (the pool already grows to one full request where the backend
    has the memory: kv_cache_budget)."""
    num_blocks = choose_num_blocks(model, config)
    usable = num_blocks - 1  # block 0 is the null block
    if usable * config.block_size >= config.max_model_len:
        return config
    per_block = kv_block_bytes(model, config.block_size, config.kv_cache_dtype)
    budget = "num_kv_blocks" if config.num_kv_blocks is not None else _pool_budget(model, config, per_block)[1]
    fitted = usable * config.block_size
    log.warning("max_model_len %d, not the model's %d: the KV pool (%s) holds %d blocks of %d tokens "
                "(%.2f MiB a block); more with num_kv_blocks, kv_cache_memory_fraction or kv_cache_dtype='int8'",
                fitted, config.max_model_len, budget, usable, config.block_size, per_block / 2**20)
    return dataclasses.replace(config, max_model_len=fitted)
