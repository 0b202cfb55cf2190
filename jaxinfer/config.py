"""ModelConfig: the architecture hyper-parameters the model code reads.

One dataclass covers the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) and
its mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE); the
differences between them are flags (`qkv_bias`, `qk_norm`, `sliding_window`,
`rope_scaling`, `tie_word_embeddings`, the expert fields), not subclasses.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxinfer.errors import CheckpointError, UnsupportedModelError

# HF `model_type` -> our architecture name. Mistral is Llama with a sliding
# window; Qwen2 adds q/k/v biases; Qwen3 adds per-head q/k RMSNorm. The
# mixtures of experts replace the MLP of (some) layers by routed experts
# (models/moe.py): Mixtral is Mistral's, Qwen2-MoE adds a shared expert,
# Qwen3-MoE is Qwen3's, OLMoE normalises q and k over the whole projection.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_HF_ARCHITECTURE_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
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
    # q_norm / k_norm over each head's head_dim (Qwen3), or over the whole
    # projection, heads * head_dim (OLMoE).
    qk_norm_per_head: bool = True
    # Mixture of experts (models/moe.py); num_experts 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's MLP hidden size
    # Renormalise the top-k routing probabilities to sum to 1 (Mixtral always;
    # Qwen and OLMoE as their config says).
    norm_topk_prob: bool = False
    # Qwen2-MoE's shared expert, which every token passes through, scaled by
    # sigmoid(h @ shared_expert_gate); 0: none.
    shared_expert_intermediate_size: int = 0
    # Layers of a MoE model that keep a dense MLP of intermediate_size
    # (Qwen's mlp_only_layers / decoder_sparse_step).
    dense_layers: tuple = ()

    def __post_init__(self):
        # A JSON round trip (loading/orbax.py) gives a list; the config must stay hashable.
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise CheckpointError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must lie in 1..num_experts ({self.num_experts})"
            )
        if self.num_experts and not self.sparse_layers:
            raise CheckpointError("a mixture of experts with no sparse layer: give it num_experts=0")
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

    @property
    def sparse_layers(self) -> tuple:
        """The layers whose MLP is routed experts (none for a dense model)."""
        if not self.num_experts:
            return ()
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def has_dense_mlp(self) -> bool:
        """Whether any layer runs the dense MLP (w_gate, w_up, w_down)."""
        return not self.num_experts or bool(self.dense_layers)

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
        if architecture in ("llama", "qwen3_moe", "olmoe") and (hf.get("attention_bias") or hf.get("mlp_bias")):
            raise UnsupportedModelError(f"{architecture} checkpoints with attention_bias/mlp_bias are not supported")
        if hf.get("clip_qkv") is not None:
            raise UnsupportedModelError(f"clip_qkv ({hf['clip_qkv']}) is not supported")
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
        if architecture in ("mistral", "mixtral"):
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
            qkv_bias=architecture == "qwen2" or (architecture == "qwen2_moe" and hf.get("qkv_bias", True)),
            qk_norm=architecture in ("qwen3", "qwen3_moe", "olmoe"),
            qk_norm_per_head=architecture != "olmoe",
            sliding_window=sliding_window,
            **_moe_fields(architecture, hf),
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


def _moe_fields(architecture: str, hf: dict) -> dict:
    """The expert fields of a config.json (none for a dense family). Qwen's
    layer L is sparse when it is not in mlp_only_layers and (L + 1) is a
    multiple of decoder_sparse_step; every other family's layers all are."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    # transformers >= 5 writes Qwen's num_experts as num_local_experts, Mixtral's name.
    num_experts = hf["num_local_experts"] if "num_local_experts" in hf else hf["num_experts"]
    if architecture == "mixtral":
        fields = dict(moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
    else:
        fields = dict(moe_intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    num_layers = hf["num_hidden_layers"]
    dense_layers = ()
    if architecture in ("qwen2_moe", "qwen3_moe"):
        step = hf.get("decoder_sparse_step") or 1
        mlp_only = set(hf.get("mlp_only_layers") or ())
        dense_layers = tuple(i for i in range(num_layers)
                             if i in mlp_only or not (num_experts > 0 and (i + 1) % step == 0))
    if architecture == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = hf.get("shared_expert_intermediate_size") or 0
    if not num_experts or len(dense_layers) == num_layers:
        return {}  # no sparse layer: a dense model
    return dict(num_experts=num_experts, num_experts_per_tok=hf["num_experts_per_tok"], dense_layers=dense_layers,
                **fields)
