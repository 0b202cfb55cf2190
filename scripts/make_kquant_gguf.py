"""Writes a K-quant GGUF of a ~0.3B Llama for speed comparisons (BENCHMARKS.md,
"K-quant files"): hidden 1024, 24 layers of 16 heads (4 KV heads), MLP 2816 (--mlp 4864: ~0.47B, a 0.5B's),
SmolLM2's tokenizer and 49,152-token vocabulary (copied from the embedded
default model's GGUF), tied embeddings. Every row length is a multiple of 256,
so every weight is a K-quant, each of the type llama.cpp's quantizer gives it
for --mix (its llama-quant.cpp rules for a non-Falcon model with 4 query heads
per KV head):

  Q4_K_M  Q4_K; Q6_K for attn_v and ffn_down in the "more bits" layers (the
          first and last eighth, and every third between)
  Q5_K_M  Q5_K; Q6_K as Q4_K_M's
  Q6_K    Q6_K
  Q3_K_M  Q3_K; attn_v Q5_K in layers 0-1, else Q4_K; ffn_down Q5_K in the first
          sixteenth, else Q4_K; attn_output Q4_K
  Q2_K    Q2_K; attn_v Q4_K; ffn_down and attn_output Q3_K
and Q6_K for the embeddings (the head) in all of them.

The blocks are random (tests/gguf_writer.py, random_k_blocks), so the model's text
is noise: it measures speed, not quality. No model hub is reachable from the dev
machines, and the default model's 576-wide rows are not whole K-quant super-blocks
(llama.cpp quantizes those to other types).

    python scripts/make_kquant_gguf.py /tmp/kquant.gguf --mix Q4_K_M
    python scripts/make_kquant_gguf.py /tmp/kquant05.gguf --mix Q4_K_M --mlp 4864
    python scripts/bench_cpu.py --model /tmp/kquant.gguf --schemes gguf --batch-sizes 1,8,32

--shape 8b lays out Llama-3.1-8B's shapes instead (hidden 4096, 32 layers of 32
heads, 8 KV heads, MLP 14336, an untied Q6_K head; the vocabulary stays the
tokenizer's 49,152 rather than 128,256): ~4.6 GB at Q4_K_M, for start-up and
memory at that size.
"""

from __future__ import annotations

import argparse
import os
import sys

import gguf
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a plain checkout

from jaxinfer.loading.checkpoint import default_model_path  # noqa: E402
from tests.gguf_writer import random_k_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
VOCAB = 49152
# --shape -> (hidden, layers, heads, KV heads, MLP, tied embeddings)
SHAPES = {"0.3b": (1024, 24, 16, 4, 2816, True), "8b": (4096, 32, 32, 8, 14336, False)}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M / Q5_K_M give Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


# --mix -> (layer, layers) -> {"base": the file's type, weight name: its own type}
MIXES = {
    "Q4_K_M": lambda i, n: {"base": Q.Q4_K, **({"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K} if more_bits(i, n) else {})},
    "Q5_K_M": lambda i, n: {"base": Q.Q5_K, **({"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K} if more_bits(i, n) else {})},
    "Q6_K": lambda i, n: {"base": Q.Q6_K},
    "Q3_K_M": lambda i, n: {"base": Q.Q3_K, "attn_v": Q.Q5_K if i < 2 else Q.Q4_K,
                            "ffn_down": Q.Q5_K if i < n // 16 else Q.Q4_K, "attn_output": Q.Q4_K},
    "Q2_K": lambda i, n: {"base": Q.Q2_K, "attn_v": Q.Q4_K, "ffn_down": Q.Q3_K, "attn_output": Q.Q3_K},
}
VALUE_WRITERS = {gguf.GGUFValueType.ARRAY: "add_array", gguf.GGUFValueType.STRING: "add_string",
                 gguf.GGUFValueType.UINT32: "add_uint32", gguf.GGUFValueType.BOOL: "add_bool"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the .gguf file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mix", default="Q4_K_M", choices=sorted(MIXES), help="llama.cpp's file type to lay out")
    parser.add_argument("--shape", default="0.3b", choices=sorted(SHAPES), help="the model's shapes")
    parser.add_argument("--mlp", type=int, help="the MLP's width (a multiple of 256; default the shape's)")
    args = parser.parse_args()
    hidden, layers, heads, kv_heads, mlp, tied = SHAPES[args.shape]
    mlp = args.mlp or mlp
    if mlp % 256:
        parser.error(f"--mlp {mlp} is not a multiple of 256 (K-quant super-blocks)")
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(args.out, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(mlp)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    for name, field in gguf.GGUFReader(str(default_model_path())).fields.items():
        if name.startswith("tokenizer."):
            getattr(writer, VALUE_WRITERS[field.types[0]])(name, field.contents())
    rng = np.random.default_rng(args.seed)
    writer.add_tensor("token_embd.weight", random_k_blocks(rng, Q.Q6_K, VOCAB, hidden), raw_dtype=Q.Q6_K)
    if not tied:
        writer.add_tensor("output.weight", random_k_blocks(rng, Q.Q6_K, VOCAB, hidden), raw_dtype=Q.Q6_K)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        types = MIXES[args.mix](i, layers)
        weights = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
                   "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
                   "ffn_gate": (mlp, hidden), "ffn_up": (mlp, hidden), "ffn_down": (hidden, mlp)}
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, (rows, columns) in weights.items():
            qtype = types.get(name, types["base"])
            writer.add_tensor(f"blk.{i}.{name}.weight", random_k_blocks(rng, qtype, rows, columns), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
