"""The GPU backend's decode step of the 8B-shaped model (llama8b_config.py),
compiled for an H100 on a machine with no GPU: what the compiled step
launches (compiled_hlo.py: kernels per layer, weights copied, bytes the
attention writes), read without weights or a device. XLA compiles it for
the target described in h100_target.txtpb through the CUDA plugin's
deviceless topology; with no device to time candidates on, it picks GEMM
configurations by its heuristics instead of autotuning, so a GPU's own
compile (scripts/gpu/e2e.py) may choose other GEMM kernels, not other
fusions.

    bash scripts/gpu/deviceless_env.sh      (once: the CUDA plugin beside .venv, in .gpu/deviceless)
    .gpu/deviceless/bin/python scripts/gpu/deviceless.py [--batches 1,16,64] [--max-model-lens 4096,131072]
        [--layers 32] [--json deviceless.json] [--hlo-dir DIR] [--xla-option NAME=VALUE ...] [--verify-rows R]

The params are the loader's layout for the GPU backend computed from the
config's shapes (the backend's abstract_params), so no checkpoint is read.
"""

import os

# The plugin checks the CUDA driver's and libraries' versions as it loads; with no driver there is none to check.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE))

from compiled_hlo import DECODE_ATTENTION, step_report  # noqa: E402
from llama8b_config import hf_config  # noqa: E402

from jaxinfer.backends import GpuBackend  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.engine.config import EngineConfig  # noqa: E402
from jaxinfer.engine.inputs import build_inputs  # noqa: E402
from jaxinfer.engine.programs import forward_step  # noqa: E402
from jaxinfer.models.kv_cache import kv_cache_shapes  # noqa: E402


def placed(tree, sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding), tree)


def option_value(text: str) -> tuple:
    """NAME=VALUE -> (NAME, VALUE as XLA takes it: a bool, an int, or the text)."""
    name, _, value = text.partition("=")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    return name, int(value) if value.lstrip("-").isdigit() else value


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=str(HERE / "h100_target.txtpb"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--max-model-lens", default=None, help="default: 4096 and the config's own context")
    parser.add_argument("--json", default="deviceless.json")
    parser.add_argument("--hlo-dir", default=None, help="write each compiled step here (HLO text)")
    parser.add_argument("--verify-rows", type=int, default=0,
                        help="R > 1: the verify step of speculative decoding (R rows a sequence) instead of decode")
    parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an XLA option on top of the backend's compiler_options (to see what one changes)")
    args = parser.parse_args()
    config = ModelConfig.from_hf_dict(hf_config(args.layers))
    lens = [int(n) for n in (args.max_model_lens or f"4096,{config.max_position_embeddings}").split(",")]
    target = Path(args.target).read_text()
    topology = topologies.get_topology_desc(platform="cuda", target_config=target, topology="1x1x1")
    device = NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), PartitionSpec())
    dtype = jnp.bfloat16
    backend = GpuBackend().with_dtype(dtype)
    options = {**(backend.compiler_options() or {}), **dict(map(option_value, args.xla_option))}
    block_size = EngineConfig(max_model_len=max(lens)).block_size
    params = backend.abstract_params(config, dtype, device)
    cache = kv_cache_shapes(config, max(lens) // block_size + 1, block_size, dtype, device)
    result = {"jax": jax.__version__, "target": topology.devices[0].device_kind, "layers": args.layers,
              "xla_options": options, "steps": []}
    rows = max(1, args.verify_rows)
    layout = "verify" if rows > 1 else "decode"
    step = f"verify step ({rows} rows a sequence)" if rows > 1 else "decode step"
    print(f"{step} of the 8B-shaped model, {args.layers} layers, compiled for {result['target']} with no GPU")
    print(f"{'max_model_len':>13} {'batch':>5} {'bucket':>6} {'kernels':>7} {'per layer':>9} {'weight copies':>13} "
          f"{'attention writes MiB':>20} {'compile s':>9}")
    buckets = backend.decode_buckets(backend.max_num_seqs)
    for max_model_len in lens:
        for batch in (int(b) for b in args.batches.split(",")):
            # The program the engine runs a batch of this many sequences in (padded to its decode bucket).
            seqs = min(b for b in buckets if b >= batch)
            inputs = build_inputs([], [], [], [], num_tokens=seqs * rows, num_seqs=seqs, layout=layout,
                                  block_size=block_size, max_blocks_per_seq=max_model_len // block_size)
            step_inputs = placed(jax.tree.map(np.asarray, tuple(inputs[:3])), device)
            start = time.perf_counter()
            compiled = forward_step.trace(params, cache, *step_inputs, config=config, backend=backend,
                                          layout=layout).lower(lowering_platforms=("cuda",)).compile(options)
            seconds = time.perf_counter() - start
            text = compiled.as_text()
            if args.hlo_dir:
                Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
                Path(args.hlo_dir, f"{layout}_{max_model_len}_{batch}.hlo").write_text(text)
            report = {"max_model_len": max_model_len, "batch": batch, "bucket": seqs, "compile_s": seconds,
                      **step_report(text, args.layers, DECODE_ATTENTION)}
            result["steps"].append(report)
            print(f"{max_model_len:>13} {batch:>5} {seqs:>6} {report['kernels']:>7} "
                  f"{report['kernels_per_layer']:>9.2f} "
                  f"{report['weight_copies']:>13} {report['attention_bytes_written'] / 2**20:>20.2f} {seconds:>9.1f}",
                  flush=True)
            Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
