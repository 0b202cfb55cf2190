"""Calibration at conversion time: AWQ, activation-aware int4 weight
quantization (Lin et al. 2023).

A few input channels of each linear carry much larger activations than the
rest, and the rounding error of the weight rows they multiply dominates the
output error. AWQ scales those rows up by s before rounding (so they get
relatively finer steps) and divides the activation by s, which it folds
exactly into the op that produces the activation, so the float model is
unchanged and no extra op runs at inference:

    y = (x / s) @ Q(diag(s) W)

Per group of linears that share an input, s = mean|x| ** alpha (per input
channel, normalised so that sqrt(max * min) = 1) for the alpha on a grid over
[0, 1] that minimises the MSE of the block's output against float on the
calibration activations. alpha = 0 is plain round-to-nearest, so the search
never does worse than RTN on the calibration data.

Groups and where 1/s is folded (our weights are [in, out]: rows = inputs):

    wq, wk, wv      attn_norm weight    loss on the attention block output
    wo              wv (and bv) output columns; with GQA one v channel feeds
                    the `num_queries_per_kv` query heads of its group, so one
                    scale per v channel is shared by those wo rows
    w_gate, w_up    mlp_norm weight     loss on the MLP output
    w_down          w_up output columns (silu(gate) * up is linear in up)

Dividing an output column by s commutes with quantize_int4 (its min, max and
step all scale by s), so the order of the folds does not matter.

Then (clip=True, as in the reference implementation) each group column of
the scaled wv, wo, w_gate, w_up and w_down may be clipped to a fraction of
its [min, max] range, chosen per column to minimise that group's share of
the output error: fewer levels are spent on rare extreme weights.

Layers are processed one at a time (the model itself runs them under
lax.scan): layer i's scales are searched on the inputs produced by the
already quantized layers 0..i-1, so later layers calibrate on the
activations they will actually see (the reference implementation passes the
float output on instead); within a layer every group is searched on the
float layer's activations, as there.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.backends import XlaBackend
from jaxinfer.config import ModelConfig
from jaxinfer.models.attention import attention_reference
from jaxinfer.models.layers import rms_norm, rotary_tables
from jaxinfer.models.llama import attention_values, decoder_layer, mlp_hidden
from jaxinfer.quant.schemes import quantize_int4
from jaxinfer.quant.tensor import QuantizedTensor, dequantize

log = logging.getLogger(__name__)

LINEAR_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
DEFAULT_GROUP_SIZE = 128
# The reference implementation's clipping grid: shrink a group column's range
# by up to 45% in 5% steps. q and k are not clipped (as there): their error
# reaches the output through softmax(q k^T), which a per-column weight error
# measure does not see.
CLIP_RATIOS = 1.0 - np.arange(10, dtype=np.float32) / 20
CLIPPED_KEYS = ("wv", "wo", "w_gate", "w_up", "w_down")
# Channels whose mean |x| is ~0 would get s ~ 0 for alpha > 0 and blow up 1/s.
MIN_ACTIVATION = 1e-4
# The layers run one at a time on float32 arrays: the plain XLA operations.
REFERENCE = XlaBackend()


def awq_quantize_params(
    params: dict, config: ModelConfig, calibration_token_batches, group_size=128, grid_size=20, *, clip: bool = True
):
    """-> a new params dict whose seven per-layer linear weights are int4
    QuantizedTensors (stacked over layers) after AWQ scaling, with the
    inverse scales folded into the norms, wv/bv and w_up.

    calibration_token_batches: token id arrays, each [T] or [B, T] (lengths
    may differ; they are padded and the padding masked out).
    group_size: rows per int4 scale (None: 128); a weight whose input size
    it does not divide uses gcd(in, group_size) rows (SmolLM2's 576-wide
    hidden: 64 for 128), the rule quant/params.py applies to its default.
    grid_size: number of alpha values tried, evenly spaced on [0, 1].
    clip: after scaling, also search per group column a clipping ratio of its
    [min, max] (CLIP_RATIOS) that minimises that column's output error.
    Embeddings and the head stay float. Float inputs may be float32 or
    bfloat16; QuantizedTensor inputs are dequantized first.
    """
    group_size = group_size or DEFAULT_GROUP_SIZE
    folded, clip_ratios = _awq_fold(params, config, calibration_token_batches, group_size, grid_size, clip)
    out = dict(params)
    layers = dict(params["layers"])
    for key, value in folded.items():
        if key in LINEAR_KEYS:
            rows = awq_group_size(value.shape[-2], group_size)
            if key in clip_ratios:
                value = _clip(value, clip_ratios[key], rows)
            layers[key] = quantize_int4(value, rows)
        else:
            layers[key] = value.astype(params["layers"][key].dtype)
    out["layers"] = layers
    return out


def awq_scale_params(params: dict, config: ModelConfig, calibration_token_batches, group_size=128, grid_size=20):
    """The float model with AWQ's searched scales folded in, before rounding:
    the same function as `params` (up to float rounding), whose linear weights
    quantize_int4 turns into awq_quantize_params(..., clip=False)'s result."""
    folded, _ = _awq_fold(params, config, calibration_token_batches, group_size or DEFAULT_GROUP_SIZE, grid_size, False)
    out = dict(params)
    out["layers"] = {k: v.astype(_float_dtype(params["layers"][k])) for k, v in folded.items()}
    return out


def awq_group_size(in_features: int, group_size: int) -> int:
    if group_size < 2 or group_size % 2:
        raise ValueError(f"int4 group_size must be an even number >= 2, got {group_size}")
    return math.gcd(in_features, group_size)


def fold_scales(layer: dict, config: ModelConfig, scales: dict) -> dict:
    """Apply per-input-channel scales to one layer's float params (no layer
    axis) without changing the function it computes.

    scales: "qkv" [hidden], "o" [num_kv_heads * head_dim] (one per v channel),
    "gate_up" [hidden], "down" [intermediate]; all positive.
    """
    out = dict(layer)
    qkv, o, gate_up, down = scales["qkv"], scales["o"], scales["gate_up"], scales["down"]
    out["attn_norm"] = layer["attn_norm"] / qkv
    for key in ("wq", "wk", "wv"):
        out[key] = layer[key] * qkv[:, None]
    out["wv"] = out["wv"] / o[None, :]
    if "bv" in layer:
        out["bv"] = layer["bv"] / o
    out["wo"] = layer["wo"] * _v_scales_to_o_rows(o, config)[:, None]
    out["mlp_norm"] = layer["mlp_norm"] / gate_up
    out["w_gate"] = layer["w_gate"] * gate_up[:, None]
    out["w_up"] = layer["w_up"] * gate_up[:, None] / down[None, :]
    out["w_down"] = layer["w_down"] * down[:, None]
    return out


def layer_forward(layer: dict, config: ModelConfig, x, positions, valid):
    """One transformer layer as the model computes it (models/llama.py), with
    full-sequence causal attention over the real tokens: x [B, T, hidden] ->
    [B, T, hidden]."""
    return decoder_layer(layer, config, x, rotary_tables(config, positions), _causal(config, positions, valid),
                         None, 0, backend=REFERENCE)[0]


def _attention_values(layer, config: ModelConfig, h, positions, valid):
    """The attention output before wo: [B, T, num_heads * head_dim]."""
    return attention_values(layer, config, h, rotary_tables(config, positions), _causal(config, positions, valid),
                            None, 0, backend=REFERENCE)[0]


def _causal(config: ModelConfig, positions, valid):
    """Causal attention among a batch's tokens, padding (valid False) masked out."""
    def attend(q, k, v, kv_cache, layer_index):
        out = attention_reference(q, k, v, positions, positions, k_valid=valid, sliding_window=config.sliding_window)
        return out, kv_cache

    return attend


def _v_scales_to_o_rows(o, config: ModelConfig):
    """[kv_heads * head_dim] -> [heads * head_dim]: query head h reads kv head
    h // num_queries_per_kv (attention_reference's grouping)."""
    c = config
    per_kv = o.reshape(c.num_kv_heads, 1, c.head_dim)
    return jnp.broadcast_to(per_kv, (c.num_kv_heads, c.num_queries_per_kv, c.head_dim)).reshape(-1)


def _groups(w, group_size: int):
    """[..., in, out] -> float32 [..., in // group_size, group_size, out]."""
    return w.astype(jnp.float32).reshape(*w.shape[:-2], w.shape[-2] // group_size, group_size, w.shape[-1])


def _round_int4(w, group_size: int):
    """dequantize(quantize_int4(w, group_size)) without packing the nibbles:
    the same float32 operations, so the same values, at a fraction of the
    cost inside the search loop (tests/quant/test_awq.py checks the equality)."""
    g = _groups(w, group_size)
    low, high = jnp.min(g, axis=-2, keepdims=True), jnp.max(g, axis=-2, keepdims=True)
    scales = (high - low) / 15.0
    scales = jnp.where(scales > 0, scales, 1.0)
    q = jnp.clip(jnp.round((g - low) / scales), 0, 15)
    return (q * scales + low).reshape(w.shape)


def _clip(w, ratios, group_size: int):
    """Clip each group column of w [..., in, out] to ratio x its [min, max]
    (ratios [..., in // group_size, out]); quantize_int4 then spreads its 16
    levels over the narrower range."""
    g = _groups(w, group_size)
    low, high = jnp.min(g, axis=-2, keepdims=True), jnp.max(g, axis=-2, keepdims=True)
    r = ratios[..., None, :]
    return jnp.clip(g, r * low, r * high).reshape(w.shape)


def _float_dtype(w):
    return jnp.float32 if isinstance(w, QuantizedTensor) else w.dtype


def _layer(w, i: int):
    """Layer i of a stacked array or QuantizedTensor."""
    if isinstance(w, QuantizedTensor):
        return jax.tree_util.tree_map(lambda a: a[i], w)
    return w[i]


def _as_float32(w):
    return dequantize(w) if isinstance(w, QuantizedTensor) else jnp.asarray(w, jnp.float32)


def _pad_batches(batches, vocab_size: int):
    """Token batches of any lengths -> (tokens [N, T] int32, valid [N, T] bool)."""
    rows = []
    for index, batch in enumerate(batches):
        batch = np.asarray(batch)
        if batch.ndim == 1:
            batch = batch[None]
        if batch.ndim != 2 or batch.size == 0:
            raise ValueError(f"calibration batch {index} must be a non-empty [T] or [B, T] array, got {batch.shape}")
        if not np.issubdtype(batch.dtype, np.integer):
            raise ValueError(f"calibration batch {index} holds {batch.dtype}, not token ids")
        if batch.min() < 0 or batch.max() >= vocab_size:
            raise ValueError(
                f"calibration batch {index} has token ids {batch.min()}..{batch.max()} outside [0, {vocab_size})"
            )
        rows.extend(batch)
    if not rows:
        raise ValueError("AWQ needs calibration tokens; calibration_token_batches is empty")
    length = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), length), np.int32)
    valid = np.zeros((len(rows), length), bool)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
        valid[i, : len(r)] = True
    return tokens, valid


def _awq_fold(params, config: ModelConfig, batches, group_size: int, grid_size: int, clip: bool):
    """-> (float32 stacked layer params with the searched scales folded in,
    {linear key: clipping ratios [L, in // group, out]}, empty without clip)."""
    if grid_size < 1:
        raise ValueError(f"grid_size must be >= 1, got {grid_size}")
    if config.num_experts:
        raise ValueError("AWQ calibration does not support mixtures of experts yet (its scale search runs the "
                         "dense MLP); quantize a MoE with int4 (round to nearest) instead")
    for key in LINEAR_KEYS:
        awq_group_size(params["layers"][key].shape[-2], group_size)  # validates early
    tokens, valid = _pad_batches(batches, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    valid = jnp.asarray(valid)
    x = _as_float32(params["embed"])[jnp.asarray(tokens)]
    alphas = jnp.linspace(0.0, 1.0, grid_size, dtype=jnp.float32)
    folded, ratios = [], []
    for i in range(config.num_layers):
        layer = {k: _as_float32(_layer(v, i)) for k, v in params["layers"].items()}
        new_layer, layer_ratios, x, report = _awq_layer(
            layer, x, positions, valid, alphas, config=config, group_size=group_size, clip=clip
        )
        folded.append(new_layer)
        ratios.append(layer_ratios)
        if log.isEnabledFor(logging.INFO):
            parts = ", ".join(
                f"{name} alpha {float(alphas[int(best)]):.2f} mse {float(rtn):.3g}->{float(awq):.3g}"
                for name, (best, rtn, awq) in report.items()
            )
            log.info("AWQ layer %d: %s", i, parts)

    def stack(dicts):
        return {k: jnp.stack([d[k] for d in dicts]) for k in dicts[0]}

    return stack(folded), stack(ratios)


@functools.partial(jax.jit, static_argnames=("config", "group_size", "clip"))
def _awq_layer(layer, x, positions, valid, alphas, *, config: ModelConfig, group_size: int, clip: bool):
    """Search one layer's scales (and clipping ratios), fold the scales, and
    run the quantized layer.

    -> (folded float layer, {key: clipping ratios}, next layer's input from
        the quantized layer, {group: (best alpha index, RTN loss, AWQ loss)})."""
    c = config
    weight = valid.astype(jnp.float32)[..., None]
    count = jnp.sum(weight)

    def mean_abs(a):  # per channel, over the real tokens
        return jnp.sum(jnp.abs(a) * weight, axis=(0, 1)) / count

    def mse(a, b):
        return jnp.sum(jnp.square(a - b) * weight) / (count * a.shape[-1])

    def fake_quant(w):
        return _round_int4(w, awq_group_size(w.shape[-2], group_size))

    def scales_for(activation, alpha):
        s = jnp.exp(alpha * jnp.log(jnp.maximum(activation, MIN_ACTIVATION)))
        return s / jnp.sqrt(jnp.max(s) * jnp.min(s))

    def search(activation, loss):
        losses = jax.lax.map(lambda a: loss(scales_for(activation, a)), alphas)
        best = jnp.argmin(losses)
        return scales_for(activation, alphas[best]), (best, losses[0], losses[best])

    # The float layer's activations: the inputs and targets of every search.
    h_attn = rms_norm(x, layer["attn_norm"], c.rms_norm_eps)
    values = _attention_values(layer, c, h_attn, positions, valid)
    attn_out = values @ layer["wo"]
    h_mlp = rms_norm(x + attn_out, layer["mlp_norm"], c.rms_norm_eps)
    hidden = mlp_hidden(layer, h_mlp, backend=REFERENCE)
    mlp_out = hidden @ layer["w_down"]

    def qkv_loss(s):
        scaled = dict(layer, **{k: fake_quant(layer[k] * s[:, None]) for k in ("wq", "wk", "wv")})
        return mse(_attention_values(scaled, c, h_attn / s, positions, valid) @ layer["wo"], attn_out)

    def o_loss(s_v):
        s = _v_scales_to_o_rows(s_v, c)
        return mse((values / s) @ fake_quant(layer["wo"] * s[:, None]), attn_out)

    def gate_up_loss(s):
        scaled = dict(layer, **{k: fake_quant(layer[k] * s[:, None]) for k in ("w_gate", "w_up")})
        return mse(mlp_hidden(scaled, h_mlp / s, backend=REFERENCE) @ layer["w_down"], mlp_out)

    def down_loss(s):
        return mse((hidden / s) @ fake_quant(layer["w_down"] * s[:, None]), mlp_out)

    # One scale per v channel: the mean |x| of the query heads it feeds.
    value_activation = mean_abs(values).reshape(c.num_kv_heads, c.num_queries_per_kv, c.head_dim).mean(1)
    scales, report = {}, {}
    for name, activation, loss in (
        ("qkv", mean_abs(h_attn), qkv_loss),
        ("o", value_activation.reshape(-1), o_loss),
        ("gate_up", mean_abs(h_mlp), gate_up_loss),
        ("down", mean_abs(hidden), down_loss),
    ):
        scales[name], report[name] = search(activation, loss)

    folded = fold_scales(layer, c, scales)
    ratios = {}
    if clip:
        # Each folded weight's input in the folded model.
        inputs = dict(
            wv=h_attn / scales["qkv"],
            wo=values / _v_scales_to_o_rows(scales["o"], c),
            w_gate=h_mlp / scales["gate_up"],
            w_up=h_mlp / scales["gate_up"],
            w_down=hidden / scales["down"],
        )
        for key in CLIPPED_KEYS:
            ratios[key] = _search_clip(folded[key], inputs[key] * jnp.sqrt(weight), group_size)
    quantized = dict(folded)
    for key in LINEAR_KEYS:
        w = folded[key]
        if key in ratios:
            w = _clip(w, ratios[key], awq_group_size(w.shape[-2], group_size))
        quantized[key] = fake_quant(w)
    return folded, ratios, layer_forward(quantized, c, x, positions, valid), report


def _search_clip(w, x, group_size: int):
    """Per group column of w [in, out], the CLIP_RATIOS entry minimising
    sum over tokens of (x_group . (Q(clipped) - w)_group column)^2 -- each
    group's share of the output error, cross-group terms ignored as in the
    reference implementation -- via the group's Gram matrix of x [..., in]
    (padding rows already zeroed)."""
    rows = awq_group_size(w.shape[-2], group_size)
    g = _groups(w, rows)  # [groups, rows, out]
    xg = x.reshape(-1, g.shape[0], rows)
    gram = jnp.einsum("nki,nkj->kij", xg, xg)

    def error(ratio):
        delta = _groups(_round_int4(_clip(w, jnp.full((g.shape[0], g.shape[2]), ratio), rows), rows), rows) - g
        return jnp.sum(delta * jnp.einsum("kij,kjo->kio", gram, delta), axis=1)

    candidates = jnp.asarray(CLIP_RATIOS)
    errors = jax.lax.map(error, candidates)  # [ratios, groups, out]
    return candidates[jnp.argmin(errors, axis=0)]
