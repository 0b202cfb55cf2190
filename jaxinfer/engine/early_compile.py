"""An engine's first programs compiled while its model's weights load.

Compiling a step needs its arguments' shapes, not the weights. Where the
backend computes the params' layout from the config alone (abstract_params:
a float checkpoint on one device, on the GPU and plain XLA backends), LLM
builds the engine's runner on those shapes before load() reads a weight,
lowers the serving programs of each layout's smallest bucket (what a short
first request runs) on the calling thread and compiles them on a pool of
their own while the weights load; the engine built after the load adopts
each whose arguments came out the same (CompiledPrograms.adopt), and its own
warm-up does the rest. The KV pool's shape is an argument of every program,
so the pool is sized here too, from the free device memory less the weights'
bytes in that layout, and the engine allocates it at that size.

Lowering stays on the calling thread, before any weight is read: JAX's
tracing on two threads at once is what engine/tracing_turns.py guards
against, and the loader traces (its device-side transposes). Anything that
comes out other than predicted (another layout, another pool) is compiled
again as without this: the early work can be lost, never wrong.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor, wait

import jax
from jax.sharding import SingleDeviceSharding

from jaxinfer.engine.executable_cache import argument_signature
from jaxinfer.engine.config import EngineConfig, ModelShape, choose_num_blocks
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.models import kv_cache
from jaxinfer.quant.params import params_nbytes

log = logging.getLogger(__name__)


class EarlyCompile:
    """The early compile of one engine (see the module docstring): its KV
    pool's size, the params it predicted, and the runner compiling them."""

    def __init__(self, shape: ModelShape, config: EngineConfig, params: dict, device: SingleDeviceSharding):
        self.num_blocks = choose_num_blocks(shape, config, reserved_bytes=params_nbytes(params))
        self.params = params
        cache = kv_cache.kv_cache_shapes(shape.config, self.num_blocks, config.block_size, shape.dtype, device,
                                         config.kv_cache_dtype, fp8_dtype=shape.backend.kv_fp8_dtype)
        self._runner = ModelRunner.for_engine(_Shapes(shape, params), config, cache)
        self._pool = ThreadPoolExecutor(shape.backend.compile_threads, thread_name_prefix="jaxinfer-early-compile")
        self._futures = self._runner.compile_first(self._pool)
        self._pool.shutdown(wait=False)  # its threads end with the last compilation
        log.info("compiling %d program(s) while the weights load (KV pool: %d blocks)", len(self._futures),
                 self.num_blocks)

    @classmethod
    def start(cls, shape: ModelShape, config: EngineConfig, quantization: str | None) -> EarlyCompile | None:
        """Start the early compile for an engine of `config` on a model of
        `shape` whose weights load as `quantization`, or None where the
        params' layout is not known before they load (quantized weights, a
        mesh, LoRA buffers, a draft model's pool, several hosts, a backend
        that arranges them on the host)."""
        if (quantization is not None or shape.mesh is not None or config.enable_lora or config.speculative is not None
                or jax.process_count() > 1):
            return None
        device = SingleDeviceSharding(jax.devices()[0])
        params = shape.backend.abstract_params(shape.config, shape.dtype, device)
        if params is None:
            return None
        try:
            return cls(shape, config, params, device)
        except Exception:  # the engine compiles after the load as it would without this
            log.exception("compiling while the weights load failed; the programs compile after the load")
            return None

    def finished(self, model) -> EarlyCompile | None:
        """This early compile if `model`, as loaded, has the params it was
        compiled for (its KV pool size then stands), else None (logged)."""
        if argument_signature(model.params) == argument_signature(self.params):
            return self
        log.warning("the loaded params differ from those predicted from the config: the programs compiled while "
                    "they loaded are not used")
        return None

    def compiled(self) -> ModelRunner:
        """The runner holding the early programs, once all are compiled."""
        wait(self._futures)
        return self._runner


class _Shapes:
    """A model as ModelRunner.for_engine reads one, with params that are shapes only."""

    def __init__(self, shape: ModelShape, params: dict):
        self.config, self.backend, self.mesh, self.params = shape.config, shape.backend, shape.mesh, params
