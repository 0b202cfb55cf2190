"""The 8B-shaped model the GPU check measures: Llama-3.1-8B's HF config
(its 131,072-token context and llama3 RoPE scaling), for make_weights.py,
which writes random weights under it, and deviceless.py, which compiles
its steps from the shapes alone."""

HEADS, KV_HEADS = 32, 8


def hf_config(num_layers: int = 32, hidden: int = 4096, ffn: int = 14336, vocab: int = 128256) -> dict:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=hidden,
                intermediate_size=ffn, num_hidden_layers=num_layers, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, head_dim=hidden // HEADS, rms_norm_eps=1e-5, rope_theta=500000.0,
                # Llama-3.1's context and RoPE scaling: an engine given no max_model_len serves 131,072 tokens.
                max_position_embeddings=131072,
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192),
                tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001,
                hidden_act="silu", attention_bias=False, mlp_bias=False)
