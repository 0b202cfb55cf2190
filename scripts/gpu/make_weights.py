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

from llama8b_config import KV_HEADS, hf_config

directory = sys.argv[1]
num_layers = int(sys.argv[2]) if len(sys.argv) > 2 else 32
start = time.time()
hidden, ffn, vocab = (int(x) for x in os.environ.get("DIMS", "4096,14336,128256").split(","))
config = hf_config(num_layers, hidden, ffn, vocab)
device = os.environ.get("DEV", "cuda" if torch.cuda.is_available() else "cpu")
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
kv = KV_HEADS * config["head_dim"]
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
