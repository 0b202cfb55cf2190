"""PEFT LoRA adapters: read one directory, check it against the base model,
and return its weights in the engine's layout.

A PEFT directory holds `adapter_config.json` and `adapter_model.safetensors`
with, per adapted linear of layer i,

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight  [r, in]
    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_B.weight  [out, r]
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight

and the adapted linear computes W x + scale * B (A x), scale = alpha / r, or
alpha / sqrt(r) with `use_rslora`; `rank_pattern` / `alpha_pattern` give
some modules their own r / alpha. We return A^T [L, in, r_max] and
scale * B^T [L, r_max, out] per target (models/llama.py's names: wq, wk, ...),
zero-padded to the engine's max_lora_rank and zero for layers the adapter
leaves alone, so every adapter has the same shapes (slots.py needs that).

Row order: jaxinfer's q/k weights are in HF's row order whatever the
checkpoint (loading/gguf.py undoes GGUF's permutation at load), which is the
order PEFT's lora_B rows were trained in, so B is used as stored.

Refused, with an AdapterError naming the problem: DoRA (`use_dora`),
`modules_to_save` (a full copy of the head or embeddings), `bias` other than
"none", LoRA on any other module (embeddings, lm_head), a rank above
max_lora_rank, shapes that do not match the base model, and
`adapter_model.bin` (a pickle: loading one runs arbitrary code, so we never
unpickle; convert it to safetensors first). A mixture of experts serves
adapters on its attention projections only: LoRA on its experts, shared
expert or dense MLPs is refused (their weights are grouped per expert,
which the per-row adapter term of models/lora.py does not follow).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.errors import RequestError
from jaxinfer.loading.safetensors import SafetensorsFile

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

# PEFT module name -> the base weight it adapts (models/llama.py).
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.(?P<module>model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<target>\w+_proj))"
    r"\.lora_(?P<part>[AB])\.weight$")


class AdapterError(RequestError):
    """A LoRA adapter cannot be served (unsupported feature, bad shapes, missing files)."""


@dataclass
class LoRAAdapter:
    name: str
    lora_int_id: int
    path: str
    rank: int  # the largest rank among its modules
    # target (wq, ...) -> (A [L, in, max_lora_rank], scale * B [L, max_lora_rank, out]), float32
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable base weight."""
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h, f = c.hidden_size, c.intermediate_size
    shapes = {"wq": (h, q_dim), "wk": (h, kv_dim), "wv": (h, kv_dim), "wo": (q_dim, h)}
    if not c.num_experts:  # a MoE: the attention only (see the module docstring)
        shapes.update({"w_gate": (h, f), "w_up": (h, f), "w_down": (f, h)})
    return shapes


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: a key names a module by its
    trailing dotted components, or is a regular expression matching them."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.fullmatch(rf"(?:.*\.)?(?:{key})", module):
            return value
    return default


def read_adapter_config(path: Path, name: str) -> dict:
    if not path.is_dir():
        raise AdapterError(f"LoRA adapter {name!r}: {path} is not a directory")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {path}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"LoRA adapter {name!r}: cannot read {config_file}: {e}") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"LoRA adapter {name!r}: peft_type {peft_type} is not supported (only LORA)")
    if config.get("use_dora"):
        raise AdapterError(f"LoRA adapter {name!r}: DoRA (use_dora) is not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"LoRA adapter {name!r}: modules_to_save {config['modules_to_save']} is not supported "
                           "(full copies of the head or embeddings per adapter)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported (only 'none')")
    return config


def load_adapter(name: str, lora_int_id: int, path, config: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read and check a PEFT directory against the base model `config` (the
    checkpoint's, not a tensor-parallel run's); raises AdapterError."""
    path = Path(path)
    adapter_config = read_adapter_config(path, name)
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        if (path / PICKLE_FILE).exists():
            raise AdapterError(f"LoRA adapter {name!r}: only {PICKLE_FILE} found; it is a pickle, which we never "
                               f"load (unpickling runs code): save the adapter as {WEIGHTS_FILE}")
        raise AdapterError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {path}")
    try:
        tensors = SafetensorsFile(weights_file)
        names = list(tensors.names())
    except Exception as e:  # a corrupt header: say which file
        raise AdapterError(f"LoRA adapter {name!r}: cannot read {weights_file}: {e}") from None

    base_rank = int(adapter_config.get("r", 8))
    base_alpha = float(adapter_config.get("lora_alpha", base_rank))
    rank_pattern = adapter_config.get("rank_pattern") or {}
    alpha_pattern = adapter_config.get("alpha_pattern") or {}
    rslora = bool(adapter_config.get("use_rslora", False))
    shapes = target_shapes(config)
    L = config.num_layers

    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    modules: dict[tuple[int, str], str] = {}
    for tensor_name in names:
        if config.num_experts and ".mlp." in tensor_name:
            raise AdapterError(f"LoRA adapter {name!r}: tensor {tensor_name}: LoRA on the MLP or experts of a "
                               "mixture of experts is not supported; adapt its attention projections "
                               "(q_proj, k_proj, v_proj, o_proj)")
        match = _TENSOR_NAME.match(tensor_name)
        if match is None or match["target"] not in TARGETS:
            kind = "DoRA magnitude" if "lora_magnitude" in tensor_name else "LoRA on this module"
            raise AdapterError(f"LoRA adapter {name!r}: tensor {tensor_name}: {kind} is not supported "
                               f"(targets: {', '.join(TARGETS)})")
        layer = int(match["layer"])
        if layer >= L:
            raise AdapterError(f"LoRA adapter {name!r}: tensor {tensor_name} is for layer {layer}, "
                               f"but the base model has {L} layers")
        key = (layer, TARGETS[match["target"]])
        pairs.setdefault(key, {})[match["part"]] = tensors.get(tensor_name)
        modules[key] = match["module"]

    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    largest = 0
    for (layer, target), parts in sorted(pairs.items()):
        module = modules[(layer, target)]
        if set(parts) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name!r}: {module} has lora_{''.join(parts)} but not both A and B")
        a, b = parts["A"], parts["B"]
        fan_in, fan_out = shapes[target]
        rank = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != fan_in or b.shape != (fan_out, rank):
            raise AdapterError(
                f"LoRA adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, but the base "
                f"model's weight takes {fan_in} inputs to {fan_out} outputs (A [r, {fan_in}], B [{fan_out}, r]): "
                "an adapter for another model?")
        expected_rank = int(_pattern_value(rank_pattern, module, base_rank))
        if rank != expected_rank:
            raise AdapterError(f"LoRA adapter {name!r}: {module} has rank {rank} but its config says {expected_rank}")
        if rank > max_lora_rank:
            raise AdapterError(f"LoRA adapter {name!r}: {module} has rank {rank}, above max_lora_rank="
                               f"{max_lora_rank}; raise max_lora_rank")
        largest = max(largest, rank)
        alpha = float(_pattern_value(alpha_pattern, module, base_alpha))
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        if target not in weights:
            weights[target] = (np.zeros((L, fan_in, max_lora_rank), np.float32),
                               np.zeros((L, max_lora_rank, fan_out), np.float32))
        a_stack, b_stack = weights[target]
        a_stack[layer, :, :rank] = np.asarray(a, np.float32).T
        b_stack[layer, :rank, :] = scale * np.asarray(b, np.float32).T
    if not weights:
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    return LoRAAdapter(name, lora_int_id, str(path), largest, weights)
