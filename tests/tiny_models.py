"""Tiny random HF checkpoints, written with transformers' own save_pretrained,
as independent references for the jaxinfer model code."""

from __future__ import annotations

import numpy as np
import torch
import transformers

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)

# name -> (config class, model class, overrides of BASE)
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_mqa_tied": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "llama3_rope_scaling": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "mistral_sliding_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, num_key_value_heads=1)),
    # Tensor parallelism (tests/parallel/test_tensor_data_parallel.py): 8 query heads split over up
    # to 8 devices, 2 KV heads (split at TP 2, replicated at TP 4 and 8),
    # head_dim 16: the smallest the Pallas kernels take.
    "llama_tp": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16)),
    # GGUF K-quants (tests/quant/test_weight_schemes.py): every linear's input width a multiple of their 256-weight blocks
    "llama_kquant": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=256, intermediate_size=256)),
    "llama_kquant_tied": ("LlamaConfig", "LlamaForCausalLM",
                          dict(hidden_size=256, intermediate_size=256, tie_word_embeddings=True)),
    # Context parallelism (tests/parallel/test_context_parallel.py): very small, so 32k-token
    # prompts stay cheap on CPU, with room for them in its positions.
    "llama_ring": ("LlamaConfig", "LlamaForCausalLM",
                   dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, max_position_embeddings=40960, rope_theta=500000.0)),
    # biases on q/k/v (repeated with the KV heads) and tied embeddings
    "qwen2_tp": ("Qwen2Config", "Qwen2ForCausalLM",
                 dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)),
    # Mixtures of experts (models/moe.py): several expert counts, top-k 1 / 2 /
    # 8, Qwen2-MoE's shared expert, dense and sparse layers mixed.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral_top1": ("MixtralConfig", "MixtralForCausalLM",
                     dict(num_local_experts=3, num_experts_per_tok=1, sliding_window=16)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=96, num_hidden_layers=3, mlp_only_layers=[2],
                       tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=16, num_experts_per_tok=8, moe_intermediate_size=48, norm_topk_prob=True,
                       head_dim=32, decoder_sparse_step=2, num_hidden_layers=4)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2)),
    # Expert and tensor parallelism (tests/parallel_checks.py): 4 experts split
    # whole over 2 and 4 devices, each split on its hidden size over 8; 8
    # experts (whole at 2 / 4 / 8) beside a shared expert and a dense layer.
    "mixtral_tp": ("MixtralConfig", "MixtralForCausalLM",
                   dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                        num_experts_per_tok=2)),
    "qwen2_moe_tp": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                     dict(num_attention_heads=8, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32, shared_expert_intermediate_size=96, num_hidden_layers=3,
                          mlp_only_layers=[1], tie_word_embeddings=True)),
}
MOE_VARIANTS = ("mixtral", "mixtral_top1", "qwen2_moe", "qwen3_moe", "olmoe")


def make_hf_model(variant: str, seed: int = 0):
    config_cls, model_cls, overrides = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    # Default init (std 0.02, norms at 1) gives near-zero logits and would let
    # a swapped norm or a missing bias pass unnoticed; use larger, distinct values.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    return model


def save_hf_model(model, directory, max_shard_size=None):
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


def hf_logits(model, token_ids) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)]), use_cache=False)
    return out.logits[0].float().numpy()


def hf_greedy(model, token_ids, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(token_ids)]),
            attention_mask=torch.ones(1, len(token_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            # No EOS: the engine's ignore_eos keeps EOS a token like any other;
            # min_new_tokens would instead mask it out where it is the argmax.
            eos_token_id=None,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(token_ids) :].tolist()


def assert_logits_close(actual, expected, rtol=1e-4):
    """max |diff| below rtol times the scale of the reference logits."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = float(np.abs(expected).max())
    err = float(np.abs(actual - expected).max())
    assert err < rtol * scale, f"max |diff| {err:.3g} exceeds {rtol} x logit scale {scale:.3g}"
