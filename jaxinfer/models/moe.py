"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): routing
and the routed experts, as pure functions over one layer's weights.

    router              [hidden, experts]             float, never quantized
    expert_gate         [experts, hidden, moe_ffn]    stacked per expert
    expert_up           [experts, hidden, moe_ffn]
    expert_down         [experts, moe_ffn, hidden]
    shared_w_gate       [hidden, shared_ffn]          Qwen2-MoE's shared expert
    shared_w_up         [hidden, shared_ffn]
    shared_w_down       [shared_ffn, hidden]
    shared_expert_gate  [hidden, 1]                   its sigmoid gate, float

(with the leading layer axis in the params, models/llama.py). Each token
goes through num_experts_per_tok experts, chosen by the router, and only
those: its rows are sorted by expert and the expert matmuls are the
backend's `expert_linears`, group by group (a grouped matmul:
jax.lax.ragged_dot in the XLA reference, native kernels on CPU, a Pallas
kernel on GPU), never a pass over every expert.

Routing is computed in float32 whatever the model's dtype, as every family
does in transformers: softmax over all experts, the top k, and (Mixtral
always, Qwen and OLMoE when `norm_topk_prob`) the k weights divided by their
sum. A token's route depends on its own hidden state only, so a sequence's
tokens never depend on the batch beside it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig


def moe_param_shapes(config: ModelConfig) -> dict:
    """The per-layer MoE weights' shapes, with the layer axis (empty for a dense model)."""
    c = config
    if not c.num_experts:
        return {}
    L, E, h, f = c.num_layers, c.num_experts, c.hidden_size, c.moe_intermediate_size
    shapes = {"router": (L, h, E), "expert_gate": (L, E, h, f), "expert_up": (L, E, h, f),
              "expert_down": (L, E, f, h)}
    if c.shared_expert_intermediate_size:
        s = c.shared_expert_intermediate_size
        shapes.update(shared_w_gate=(L, h, s), shared_w_up=(L, h, s), shared_w_down=(L, s, h),
                      shared_expert_gate=(L, h, 1))
    return shapes


def route(router_logits, num_experts_per_tok: int, norm_topk_prob: bool):
    """float32 router logits [T, experts] -> (weights float32 [T, k], experts
    int32 [T, k]): the softmax's k largest probabilities (ties to the lower
    expert index, as torch.topk), renormalised to sum to 1 when
    norm_topk_prob."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, num_experts_per_tok)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def gate_logits(x, w):
    """x [T, hidden] @ a float gate w [hidden, n] -> float32 [T, n] (the
    router's logits, or the shared expert's gate). In float32 from the inputs
    on, so the choice of experts is as exact as the model's activations allow."""
    return jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def moe_mlp(p: dict, config: ModelConfig, h, *, backend):
    """The MoE MLP of one layer on its normed input h [..., hidden] -> [..., hidden]."""
    c = config
    k = c.num_experts_per_tok
    shape = h.shape
    x = h.reshape(math.prod(shape[:-1]), shape[-1])
    weights, experts = route(gate_logits(x, p["router"]), k, c.norm_topk_prob)
    # Row t * k + j is token t's j-th expert. The rows are sorted by expert
    # (stably: by token within an expert) once for the layer's three expert
    # matmuls, which the backend multiplies group by group, each group by its
    # expert alone; then put back in token order, a gather rather than a
    # scatter-add so that each token's k results add up in rank order on every
    # platform.
    expert_ids = experts.reshape(-1)
    order = jnp.argsort(expert_ids, stable=True)
    sorted_ids = expert_ids[order]
    rows = x[order // k]
    gate, up = backend.expert_linears(rows, [p["expert_gate"], p["expert_up"]], sorted_ids)
    (down,) = backend.expert_linears(jax.nn.silu(gate) * up, [p["expert_down"]], sorted_ids)
    unsorted = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    down = down[unsorted].reshape(-1, k, shape[-1])
    out = jnp.sum(down.astype(jnp.float32) * weights[..., None], axis=1)  # float32, in rank order
    if c.shared_expert_intermediate_size:
        gate, up = backend.linears(x, [p["shared_w_gate"], p["shared_w_up"]])
        shared = backend.linear(jax.nn.silu(gate) * up, p["shared_w_down"])
        scale = jax.nn.sigmoid(gate_logits(x, p["shared_expert_gate"]))
        out = out + scale * shared.astype(jnp.float32)
    return out.astype(h.dtype).reshape(shape)
