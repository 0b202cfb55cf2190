"""ModelConfig: the architecture hyper-parameters the model code reads.

One dataclass covers the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3); the
differences between them are flags (`qkv_bias`, `qk_norm`, `sliding_window`,
`rope_scaling`, `tie_word_embeddings`), not subclasses.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxinfer.errors import CheckpointError, UnsupportedModelError

# HF `model_type` -> our architecture name. Mistral is Llama with a sliding
# window; Qwen2 adds q/k/v biases; Qwen3 adds per-head q/k RMSNorm.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
_HF_ARCHITECTURE_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_SCALING = (None, "default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Frozen dataclasses must stay hashable (the config is a static jit
    # argument), so rope_scaling is stored as a sorted tuple of items.
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unknown architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        rope_type = self.rope_scaling_dict.get("rope_type") if self.rope_scaling else None
        if rope_type not in SUPPORTED_ROPE_SCALING:
            raise UnsupportedModelError(
                f"rope_scaling type {rope_type!r} is not supported; supported: llama3, linear"
            )

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling or ())

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        """Build from a transformers `config.json` dictionary."""
        classes = hf.get("architectures") or []
        architecture = next((_HF_ARCHITECTURE_CLASSES[c] for c in classes if c in _HF_ARCHITECTURE_CLASSES), None)
        architecture = architecture or hf.get("model_type")
        if architecture not in SUPPORTED_ARCHITECTURES:
            named = classes[0] if classes else architecture
            raise UnsupportedModelError(
                f"unknown architecture {named!r} in config.json; supported: {', '.join(_HF_ARCHITECTURE_CLASSES)}"
            )
        if architecture == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
            raise UnsupportedModelError("Llama checkpoints with attention_bias/mlp_bias are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        num_heads = hf["num_attention_heads"]
        # transformers < 5 writes rope_theta + rope_scaling; >= 5 writes one
        # rope_parameters dict holding both. Either key name may carry the type.
        rope = dict(hf.get("rope_parameters") or {})
        rope.update(hf.get("rope_scaling") or {})
        rope_theta = float(hf.get("rope_theta") or rope.pop("rope_theta", 10000.0))
        rope.pop("rope_theta", None)
        rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type") or "default"
        rope_scaling = None if rope["rope_type"] == "default" else tuple(sorted(rope.items()))
        sliding_window = None
        if architecture == "mistral":
            sliding_window = hf.get("sliding_window")
        elif hf.get("use_sliding_window") and hf.get("sliding_window"):
            raise UnsupportedModelError(f"{architecture} with use_sliding_window=true is not supported")
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "qwen2",
            qk_norm=architecture == "qwen3",
            sliding_window=sliding_window,
        )

    @classmethod
    def from_hf_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path} not found") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
        try:
            return cls.from_hf_dict(hf)
        except KeyError as e:
            raise CheckpointError(f"{path} lacks the field {e.args[0]!r}") from None
