"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2, Qwen3) as pure functions.

Parameters are a plain dict pytree. Per-layer weights are stacked on a leading
`num_layers` axis and the layers run under `lax.scan`, so the compiled program
holds one layer body whatever the depth. Matrices are stored [in, out] so that
activations multiply them from the left (`x @ w`):

    embed        [vocab, hidden]
    layers/      attn_norm [L, hidden]
                 wq [L, hidden, heads*head_dim]   bq [L, heads*head_dim]     (qkv_bias)
                 wk [L, hidden, kv_heads*head_dim] bk [L, kv_heads*head_dim] (qkv_bias)
                 wv [L, hidden, kv_heads*head_dim] bv [L, kv_heads*head_dim] (qkv_bias)
                 q_norm [L, head_dim]  k_norm [L, head_dim]                  (qk_norm)
                 wo [L, heads*head_dim, hidden]
                 mlp_norm [L, hidden]
                 w_gate [L, hidden, ffn]  w_up [L, hidden, ffn]  w_down [L, ffn, hidden]
    final_norm   [hidden]
    lm_head      [hidden, vocab]        (absent when embeddings are tied, unless quantized)
    few_row_head [hidden, vocab]        (optional) a QuantizedTensor of exactly the head's
                                        values, multiplied instead where quant/cpu_matmul.py's
                                        few-row kernel serves the rows (a GGUF's Q8_0 head
                                        beside its float table: loading/params.py)

Any linear weight (the seven per-layer ones and lm_head) may instead be a
QuantizedTensor (quant/tensor.py) of the same logical shape; every matmul goes
through quant/linear.py, which dispatches on the type. The embedding table
stays a float array (it is gathered, not multiplied), except that a tied model
whose head is quantized per channel may drop it: each token's embedding is
then its column of the head (embed_tokens).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.models.attention import AttentionFn
from jaxinfer.models.layers import apply_rope, rms_norm, rope_inv_freq
from jaxinfer.models.lora import lora_delta
from jaxinfer.quant import cpu_matmul
from jaxinfer.quant.linear import linear, linears
from jaxinfer.quant.tensor import LayerOf, QuantizedTensor


def param_shapes(config: ModelConfig) -> dict:
    """The shape of every parameter, in the layout documented above."""
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    L = c.num_layers
    layers = {
        "attn_norm": (L, c.hidden_size),
        "wq": (L, c.hidden_size, q_dim),
        "wk": (L, c.hidden_size, kv_dim),
        "wv": (L, c.hidden_size, kv_dim),
        "wo": (L, q_dim, c.hidden_size),
        "mlp_norm": (L, c.hidden_size),
        "w_gate": (L, c.hidden_size, c.intermediate_size),
        "w_up": (L, c.hidden_size, c.intermediate_size),
        "w_down": (L, c.intermediate_size, c.hidden_size),
    }
    if c.qkv_bias:
        layers.update(bq=(L, q_dim), bk=(L, kv_dim), bv=(L, kv_dim))
    if c.qk_norm:
        layers.update(q_norm=(L, c.head_dim), k_norm=(L, c.head_dim))
    shapes = {"embed": (c.vocab_size, c.hidden_size), "layers": layers, "final_norm": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (c.hidden_size, c.vocab_size)
    return shapes


def adapted_linear(x, p: dict, key: str, lora_slots=None):
    """linear(x, p[key]) plus the LoRA term of each row's adapter when the
    step serves adapters (lora_slots int32 [B, T], buffers in p["lora"]; see
    models/lora.py). Without lora_slots it is exactly linear."""
    return adapted_linears(x, p, (key,), lora_slots)[0]


def adapted_linears(x, p: dict, keys, lora_slots=None) -> list:
    """adapted_linear of each key on the same x: one native kernel call for
    all of them where it takes them (quant/linear.py, linears)."""
    ys = linears(x, [p[key] for key in keys])
    if lora_slots is None:
        return ys
    return [y + lora_delta(x, *p["lora"][key], lora_slots) for y, key in zip(ys, keys)]


def decoder_layer(p: dict, config: ModelConfig, x, positions, inv_freq, attention: AttentionFn, kv_cache, layer_index,
                  lora_slots=None):
    """One transformer block over x [B, T, hidden] with one layer's weights `p`
    (the per-layer dicts above without the leading L axis); returns (x, kv_cache).
    lora_slots: None, or each row's adapter slot int32 [B, T] (lora/slots.py).
    Shared by the model body and the EAGLE draft head (engine/spec/eagle_head.py)."""
    c = config
    h = rms_norm(x, p["attn_norm"], c.rms_norm_eps)
    values, kv_cache = attention_values(p, c, h, positions, inv_freq, attention, kv_cache, layer_index, lora_slots)
    x = x + adapted_linear(values, p, "wo", lora_slots)
    h = rms_norm(x, p["mlp_norm"], c.rms_norm_eps)
    return x + adapted_linear(mlp_hidden(p, h, lora_slots), p, "w_down", lora_slots), kv_cache


def attention_values(p: dict, config: ModelConfig, h, positions, inv_freq, attention: AttentionFn, kv_cache,
                     layer_index, lora_slots=None):
    """The attention of one layer on its normed input h [B, T, hidden]: the
    values before wo [B, T, heads * head_dim], and the cache. A piece of its
    own because AWQ calibration (jaxinfer/calibration.py) scales its inputs."""
    c = config
    batch, seq = h.shape[:2]

    def heads(y, b, num_heads):
        y = y if b not in p else y + p[b]
        return y.reshape(batch, seq, num_heads, c.head_dim)

    q, k, v = adapted_linears(h, p, ("wq", "wk", "wv"), lora_slots)
    q = heads(q, "bq", c.num_heads)
    k = heads(k, "bk", c.num_kv_heads)
    v = heads(v, "bv", c.num_kv_heads)
    if c.qk_norm:
        q = rms_norm(q, p["q_norm"], c.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], c.rms_norm_eps)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    out, kv_cache = attention(q, k, v, kv_cache, layer_index)
    return out.reshape(batch, seq, c.num_heads * c.head_dim), kv_cache


def mlp_hidden(p: dict, h, lora_slots=None):
    """The MLP's activations before w_down: silu(h @ w_gate) * (h @ w_up)."""
    gate, up = adapted_linears(h, p, ("w_gate", "w_up"), lora_slots)
    return jax.nn.silu(gate) * up


def forward(params: dict, config: ModelConfig, tokens, positions, attention: AttentionFn, kv_cache=None,
            final_norm: bool = True, lora_slots=None, native_weights: bool = True):
    """Run the transformer body.

    tokens, positions: int32 [B, T]. `attention` implements the attention of
    one layer (see models/attention.py); `kv_cache` is its state for all
    layers (or None). The cache rides in the scan carry, not in xs/ys, so each
    layer updates only its new tokens' slots in place instead of XLA copying
    a whole layer slice of the cache per step. Returns (hidden [B, T, hidden]
    after the final norm, updated kv_cache); with final_norm=False the hidden
    states are the last layer's residual stream before the norm (the
    features an EAGLE draft head reads). lora_slots: None, or each token's
    adapter slot int32 [B, T], with the adapters' buffers in
    params["layers"]["lora"] (lora/slots.py). native_weights=False: never
    hand quantized weights to the native CPU kernel (a mesh splits them).
    """
    c = config
    inv_freq = rope_inv_freq(c)
    x = embed_tokens(params, tokens)
    # Quantized weights stay stacked and reach linear() as LayerOf (unless a
    # mesh splits them): a native CPU kernel reads its layer in place, where
    # a slice would be copied for it (quant/cpu_matmul.py).
    stacked = {k: w for k, w in params["layers"].items() if native_weights and isinstance(w, QuantizedTensor)}
    sliced = {k: w for k, w in params["layers"].items() if k not in stacked}

    def layer(carry, per_layer):
        x, kv_cache = carry
        p, layer_index = per_layer
        p = {**p, **{k: LayerOf(w, layer_index) for k, w in stacked.items()}}
        return decoder_layer(p, c, x, positions, inv_freq, attention, kv_cache, layer_index, lora_slots), None

    layer_indices = jnp.arange(c.num_layers, dtype=jnp.int32)
    (x, kv_cache), _ = jax.lax.scan(layer, (x, kv_cache), (sliced, layer_indices))
    if not final_norm:
        return x, kv_cache
    return rms_norm(x, params["final_norm"], c.rms_norm_eps), kv_cache


def embed_tokens(params: dict, tokens):
    """Embeddings [..., hidden] of int tokens [...], in the params' float dtype.
    Without a float `embed` table (tied embeddings, head quantized per
    channel), token t's embedding is column t of the head: data[:, t] times
    its one scale, the same numbers the head multiplies by."""
    if "embed" in params:
        return params["embed"][tokens]
    head = params["lm_head"]
    columns = jnp.moveaxis(jnp.take(head.data, tokens, axis=-1), 0, -1).astype(jnp.float32)
    return (columns * head.scales[0][tokens][..., None]).astype(params["final_norm"].dtype)


def _in_place(head: QuantizedTensor) -> LayerOf:
    """A quantized [hidden, vocab] head as the one layer of a stack, so that a
    native kernel reads it in place (a leading axis of 1 is a free reshape)."""
    return LayerOf(jax.tree.map(lambda a: a[None], head), jnp.int32(0))


# Rows up to which a tied GGUF head's Q8_0 copy (few_row_head) beats the
# float table: a quarter of the bytes, and past ~8 rows the exact kernel's
# register-tiled path. The head alone on the 2-core Zen 4 dev VM (medians of
# 30 alternated calls, BENCHMARKS.md, stop 31): 32 / 64 / 128 rows 11.0 /
# 20.6 / 39.7 ms against 15.7 / 23.7 / 44.2 from the float table; 256 rows
# 79.4 against 75.3. (Stop 26's kernel, before stop 29's faster many-row
# path, lost from 48 rows and set 32.)
FEW_ROW_HEAD_MAX_ROWS = 128


def compute_logits(params: dict, hidden, native_weights: bool = True):
    """Project hidden states to float32 vocabulary logits (tied or untied head;
    a quantized head of tied embeddings is stored as lm_head too).
    native_weights: as in forward."""
    few_row_head = params.get("few_row_head")
    rows = math.prod(hidden.shape[:-1])
    if (native_weights and few_row_head is not None and rows <= FEW_ROW_HEAD_MAX_ROWS
            and cpu_matmul.supports(rows, few_row_head)):
        # A quarter of the float head's bytes, the same values (batch-1 decode).
        logits = linear(hidden, _in_place(few_row_head))
    elif "lm_head" in params:
        head = params["lm_head"]
        if native_weights and isinstance(head, QuantizedTensor) and head.data.ndim == 2:
            head = _in_place(head)
        logits = linear(hidden, head)
    else:
        logits = jnp.einsum("...d,vd->...v", hidden, params["embed"])
    return logits.astype(jnp.float32)
