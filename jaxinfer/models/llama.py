"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2, Qwen3, and the
mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) as pure functions.

Parameters are a plain dict pytree. Per-layer weights are loaded stacked on a
leading `num_layers` axis; how they are then stored and iterated (a scan
over the stack, or one array per layer in an unrolled loop) and which
implementation each matmul, the attention and the head run is the choice
of the `backend` (jaxinfer/backends/), chosen once at load: this file
never tests the platform. Matrices are stored [in, out] so that activations
multiply them from the left (`x @ w`):

    embed        [vocab, hidden]
    layers/      attn_norm [L, hidden]
                 wq [L, hidden, heads*head_dim]   bq [L, heads*head_dim]     (qkv_bias)
                 wk [L, hidden, kv_heads*head_dim] bk [L, kv_heads*head_dim] (qkv_bias)
                 wv [L, hidden, kv_heads*head_dim] bv [L, kv_heads*head_dim] (qkv_bias)
                 q_norm [L, head_dim]  k_norm [L, head_dim]                  (qk_norm)
                   (OLMoE: [L, heads*head_dim] and [L, kv_heads*head_dim], qk_norm_per_head off)
                 wo [L, heads*head_dim, hidden]
                 mlp_norm [L, hidden]
                 w_gate [L, hidden, ffn]  w_up [L, hidden, ffn]  w_down [L, ffn, hidden]
                                        (a dense model, or a MoE with dense_layers)
                 router, expert_*, shared_*   the experts of a MoE (models/moe.py)
    final_norm   [hidden]
    lm_head      [hidden, vocab]        (absent when embeddings are tied, unless quantized)
    few_row_head [hidden, vocab]        (optional) a QuantizedTensor or KQuantTensor of exactly
                                        the head's values, which the CPU backend multiplies
                                        where its kernel serves the rows (a GGUF's tied head
                                        in its blocks: loading/params.py); where it is int8
                                        or a K-quant the CPU backend drops the float `embed`
                                        table and the lookup reads its columns (embed_tokens)

A MoE whose layers mix dense and sparse MLPs (Qwen's mlp_only_layers /
decoder_sparse_step) holds both kinds of weight for every layer, zeros
where a layer is of the other kind, so that every layer weight stays one
stack the layer loop can scan, and each layer runs only its own kind
(the backend's select_by_layer: lax.cond in a scan, a plain choice in an
unrolled loop). Real checkpoints of these families are all sparse; the padding
is the price of keeping one form for the rare mixed one.

Any linear weight (the seven per-layer ones, the experts and lm_head) may instead be a
QuantizedTensor (quant/tensor.py) of the same logical shape, and a layer
weight of an act-order checkpoint an InputOrdered (quant/input_order.py: its
rows permuted, the activations gathered to match in adapted_linears); every
matmul goes through the backend's linear, whose reference is quant/linear.py. The embedding table
stays a float array (it is gathered, not multiplied), except that a tied model
whose head is quantized per channel may drop it: each token's embedding is
then its column of the head (embed_tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.models.attention import AttentionFn
from jaxinfer.models.layers import apply_rope, rms_norm, rotary_tables
from jaxinfer.models.lora import lora_delta
from jaxinfer.models.moe import moe_mlp, moe_param_shapes
from jaxinfer.models.residual import Residual, settled
from jaxinfer.quant.input_order import input_groups


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
    }
    if c.has_dense_mlp:
        layers.update(w_gate=(L, c.hidden_size, c.intermediate_size), w_up=(L, c.hidden_size, c.intermediate_size),
                      w_down=(L, c.intermediate_size, c.hidden_size))
    layers.update(moe_param_shapes(c))
    if c.qkv_bias:
        layers.update(bq=(L, q_dim), bk=(L, kv_dim), bv=(L, kv_dim))
    if c.qk_norm and c.qk_norm_per_head:
        layers.update(q_norm=(L, c.head_dim), k_norm=(L, c.head_dim))
    elif c.qk_norm:
        layers.update(q_norm=(L, q_dim), k_norm=(L, kv_dim))
    shapes = {"embed": (c.vocab_size, c.hidden_size), "layers": layers, "final_norm": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (c.hidden_size, c.vocab_size)
    return shapes


def adapted_linear(x, p: dict, key: str, lora_slots=None, *, backend):
    """backend.linear(x, p[key]) plus the LoRA term of each row's adapter when
    the step serves adapters (lora_slots int32 [B, T], buffers in p["lora"];
    see models/lora.py). Without lora_slots it is exactly the linear."""
    return adapted_linears(x, p, (key,), lora_slots, backend=backend)[0]


def adapted_linears(x, p: dict, keys, lora_slots=None, *, backend) -> list:
    """adapted_linear of each key on the same x (backend.linears, which may
    take them in one kernel call). Weights stored with their input rows
    permuted (quant/input_order.py: act-order checkpoints) multiply x
    gathered by their order, once for the weights that share one; the LoRA
    term reads x as it is."""
    ys = [None] * len(keys)
    for x_in, indices, ws in input_groups(x, [p[key] for key in keys]):
        for i, y in zip(indices, backend.linears(x_in, ws)):
            ys[i] = y
    if lora_slots is None:
        return ys
    # A MoE serves adapters on the attention only (lora/adapter.py): its dense MLPs have no buffers.
    return [y + lora_delta(x, *p["lora"][key], lora_slots) if key in p["lora"] else y for y, key in zip(ys, keys)]


def decoder_layer(p: dict, config: ModelConfig, x, rope, attention: AttentionFn, kv_cache, layer_index,
                  lora_slots=None, *, backend):
    """One transformer block over the residual stream x [B, T, hidden] with
    one layer's weights `p` (the per-layer dicts above without the leading
    L axis, in the form the backend's run_layers hands them); returns (x,
    kv_cache). x, in and out, is an array or a Residual (models/residual.py:
    the last projection left for the next norm to add; settled() makes it
    an array). rope: the step's rotary tables (models/layers.py,
    rotary_tables).
    lora_slots: None, or each row's adapter slot int32 [B, T] (lora/slots.py).
    Shared by the model body and the EAGLE draft head (engine/spec/eagle_head.py)."""
    c = config
    x, h = backend.add_rms_norm(x, p["attn_norm"], c.rms_norm_eps)
    values, kv_cache = attention_values(p, c, h, rope, attention, kv_cache, layer_index, lora_slots,
                                        backend=backend)
    x, h = backend.add_rms_norm(projected(x, values, p, "wo", lora_slots, backend=backend), p["mlp_norm"],
                                c.rms_norm_eps)
    return feed_forward(p, c, x, h, layer_index, lora_slots, backend=backend), kv_cache


def projected(x, inputs, p: dict, key: str, lora_slots=None, *, backend):
    """The residual stream x plus inputs @ p[key] (a layer's wo or w_down,
    adapted): a Residual where the backend leaves the add to the next norm's
    kernel (backend.linear_parts), else the sum."""
    if lora_slots is None:
        parts = backend.linear_parts(inputs, p[key])
        if parts is not None:
            return Residual(x, parts)
    return x + adapted_linear(inputs, p, key, lora_slots, backend=backend)


def feed_forward(p: dict, config: ModelConfig, x, h, layer_index, lora_slots=None, *, backend):
    """The residual stream x after one layer's MLP on its normed input h:
    the dense one, or the routed experts (models/moe.py), or for a model
    that mixes them the one of this layer's kind (see the module docstring)."""
    c = config

    def dense():
        return projected(x, mlp_hidden(p, h, lora_slots, backend=backend), p, "w_down", lora_slots, backend=backend)

    def sparse():
        return x + moe_mlp(p, c, h, backend=backend)

    if not c.num_experts:
        return dense()
    if not c.dense_layers:
        return sparse()
    # Both kinds' results must be alike to select between them: arrays.
    return backend.select_by_layer(layer_index, tuple(c.dense_layers), lambda: settled(dense()), sparse)


def attention_values(p: dict, config: ModelConfig, h, rope, attention: AttentionFn, kv_cache,
                     layer_index, lora_slots=None, *, backend):
    """The attention of one layer on its normed input h [B, T, hidden]: the
    values before wo [B, T, heads * head_dim], and the cache. A piece of its
    own because AWQ calibration (jaxinfer/calibration.py) scales its inputs."""
    c = config
    batch, seq = h.shape[:2]

    def heads(y, b, num_heads):
        y = y if b not in p else y + p[b]
        return y.reshape(batch, seq, num_heads, c.head_dim)

    q, k, v = adapted_linears(h, p, ("wq", "wk", "wv"), lora_slots, backend=backend)
    if c.qk_norm and not c.qk_norm_per_head:  # OLMoE: over the whole projection, before the heads split
        q = rms_norm(q, p["q_norm"], c.rms_norm_eps)  # (no OLMoE has q/k/v biases: config.py refuses them)
        k = rms_norm(k, p["k_norm"], c.rms_norm_eps)
    q = heads(q, "bq", c.num_heads)
    k = heads(k, "bk", c.num_kv_heads)
    v = heads(v, "bv", c.num_kv_heads)
    if c.qk_norm and c.qk_norm_per_head:
        q = rms_norm(q, p["q_norm"], c.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], c.rms_norm_eps)
    q = apply_rope(q, rope)
    k = apply_rope(k, rope)
    out, kv_cache = attention(q, k, v, kv_cache, layer_index)
    return out.reshape(batch, seq, c.num_heads * c.head_dim), kv_cache


def mlp_hidden(p: dict, h, lora_slots=None, *, backend):
    """The MLP's activations before w_down: silu(h @ w_gate) * (h @ w_up)."""
    gate, up = adapted_linears(h, p, ("w_gate", "w_up"), lora_slots, backend=backend)
    return jax.nn.silu(gate) * up


def forward(params: dict, config: ModelConfig, tokens, positions, attention: AttentionFn, kv_cache=None, *, backend,
            final_norm: bool = True, lora_slots=None):
    """Run the transformer body on `backend` (jaxinfer/backends/; the one the
    params were laid out for at load).

    tokens, positions: int32 [B, T]. `attention` implements the attention of
    one layer (see models/attention.py); `kv_cache` is its state for all
    layers (or None). The cache rides in the layer loop's carry, so each
    layer updates only its new tokens' slots in place instead of XLA copying
    a whole layer slice of the cache per step. Returns (hidden [B, T, hidden]
    after the final norm, updated kv_cache); with final_norm=False the hidden
    states are the last layer's residual stream before the norm (the
    features an EAGLE draft head reads). lora_slots: None, or each token's
    adapter slot int32 [B, T], with the adapters' buffers in
    params["layers"]["lora"] (lora/slots.py).
    """
    c = config
    rope = rotary_tables(c, positions)  # once for every layer
    x = embed_tokens(params, tokens)

    def layer(carry, p, layer_index):
        x, kv_cache = carry
        return decoder_layer(p, c, x, rope, attention, kv_cache, layer_index, lora_slots,
                             backend=backend)

    x, kv_cache = backend.run_layers(layer, (x, kv_cache), params["layers"], c.num_layers)
    if not final_norm:
        return settled(x), kv_cache
    return backend.add_rms_norm(x, params["final_norm"], c.rms_norm_eps)[1], kv_cache


def embed_tokens(params: dict, tokens):
    """Embeddings [..., hidden] of int tokens [...], in the params' float dtype.
    Without a float `embed` table (tied embeddings held only quantized: an
    int8 head, or a GGUF's Q8_0 or K-quant table as few_row_head), token t's embedding
    is column t of the head, dequantized: the same numbers the head
    multiplies by, and the same the float table held."""
    if "embed" in params:
        return params["embed"][tokens]
    head = params["few_row_head"] if "few_row_head" in params else params["lm_head"]
    return head.columns(tokens).astype(params["final_norm"].dtype)

