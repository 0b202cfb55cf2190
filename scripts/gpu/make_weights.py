"""A random Llama-3.1-8B-shaped checkpoint in HF's layout (bf16, one
safetensors shard per layer plus an index; its config's context too, 131,072
tokens), written on the GPU for speed: what scripts/gpu_check.sh serves.
Random weights: speed and start-up only, no text.

    python scripts/gpu/make_weights.py DIR [LAYERS]      (DIMS=hidden,ffn,vocab to change the shape)
"""

import json
import os
import sys
import time

import torch
from safetensors.torch import save_file

directory = sys.argv[1]
num_layers = int(sys.argv[2]) if len(sys.argv) > 2 else 32
start = time.time()
hidden, ffn, vocab = (int(x) for x in os.environ.get("DIMS", "4096,14336,128256").split(","))
heads, kv_heads = 32, 8
head_dim = hidden // heads
device = os.environ.get("DEV", "cuda" if torch.cuda.is_available() else "cpu")
config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=hidden,
              intermediate_size=ffn, num_hidden_layers=num_layers, num_attention_heads=heads,
              num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=500000.0,
              # Llama-3.1's context and RoPE scaling: an engine given no max_model_len serves 131,072 tokens.
              max_position_embeddings=131072,
              rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192),
              tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001,
              hidden_act="silu", attention_bias=False, mlp_bias=False)
os.makedirs(directory, exist_ok=True)
with open(f"{directory}/config.json", "w") as f:
    json.dump(config, f)
generator = torch.Generator(device=device).manual_seed(0)


def random(*shape):
    return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=generator) * 0.02


def ones(n):
    return torch.ones(n, device=device, dtype=torch.bfloat16)


weight_map = {}


def save(tensors, name):
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, f"{directory}/{name}", metadata={"format": "pt"})
    weight_map.update({k: name for k in tensors})


save({"model.embed_tokens.weight": random(vocab, hidden), "lm_head.weight": random(vocab, hidden),
      "model.norm.weight": ones(hidden)}, "model-00000.safetensors")
kv = kv_heads * head_dim
for i in range(num_layers):
    p = f"model.layers.{i}."
    save({p + "self_attn.q_proj.weight": random(hidden, hidden), p + "self_attn.k_proj.weight": random(kv, hidden),
          p + "self_attn.v_proj.weight": random(kv, hidden), p + "self_attn.o_proj.weight": random(hidden, hidden),
          p + "mlp.gate_proj.weight": random(ffn, hidden), p + "mlp.up_proj.weight": random(ffn, hidden),
          p + "mlp.down_proj.weight": random(hidden, ffn), p + "input_layernorm.weight": ones(hidden),
          p + "post_attention_layernorm.weight": ones(hidden)}, f"model-{i + 1:05d}.safetensors")
with open(f"{directory}/model.safetensors.index.json", "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
print(f"weights written in {time.time() - start:.1f}s", flush=True)
