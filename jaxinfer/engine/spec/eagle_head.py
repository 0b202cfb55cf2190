"""The EAGLE-style draft head: one transformer layer that predicts the target's
next feature from its current feature and the next token.

A *feature* f_p is the target's last-layer residual stream at position p,
before the final norm (`forward(..., final_norm=False)`); the target's own
logits for token p + 1 are lm_head(final_norm(f_p)). The head reads entry
(x_p, f_{p-1}) for position p, the embedding of token x_p beside the feature
of the position before it, and predicts f_p:

    h = concat(embed[x_p], f_{p-1}) @ fc        [2 * hidden, hidden]
    f^_p = decoder_layer(layer, h)              one Llama block, causal over the window
    logits(x_{p+1}) = lm_head(final_norm(f^_p))   the target's own norm and head

The embedding, final norm and output head are the target's, so the head adds
only fc and one layer (4.2 M parameters for SmolLM2-135M). Drafting feeds its
own predicted feature back: entry (d_1, f^_n) at position n + 1, and so on.

A head may carry a reduced draft vocabulary (EAGLE-3): its own output matrix
lm_head [hidden, V_d] over the V_d target tokens the target writes most
often, and d2t [V_d], each draft id's target id. Drafting then scores V_d
tokens instead of the target's whole vocabulary (49,152 for SmolLM2: that
matmul cost as much as the head itself on CPU) and maps its argmax back to
a target id. A token outside the draft vocabulary is never drafted, which
costs acceptance only where the target writes a rare token; verification is
against the target, so outputs are unaffected either way.

Attention sees a window of the last `window` entries only, with no cache of
its own between steps: the target's features already summarize the long
context, and a window keeps the head stateless (nothing to roll back after
verification or preemption). Training (scripts/train_draft_head.py) uses the
same window.

A head is a safetensors file (float16) whose metadata records the window and
the target's shape, checked at load so a head is never used on a target it
was not trained for.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models.attention import attention_reference
from jaxinfer.models.layers import rms_norm, rotary_tables
from jaxinfer.models.llama import decoder_layer, embed_tokens
from jaxinfer.models.residual import settled

# The head trained for the embedded default model (scripts/train_draft_head.py).
DEFAULT_HEAD = Path(__file__).resolve().parents[3] / "checkpoints" / "eagle-smollm2-135m-instruct.safetensors"
_LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def head_shapes(config: ModelConfig) -> dict:
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = {
        "attn_norm": (c.hidden_size,), "wq": (c.hidden_size, q_dim), "wk": (c.hidden_size, kv_dim),
        "wv": (c.hidden_size, kv_dim), "wo": (q_dim, c.hidden_size), "mlp_norm": (c.hidden_size,),
        "w_gate": (c.hidden_size, c.intermediate_size), "w_up": (c.hidden_size, c.intermediate_size),
        "w_down": (c.intermediate_size, c.hidden_size),
    }
    return {"fc": (2 * c.hidden_size, c.hidden_size), "layer": layer}


def init_head(config: ModelConfig, key, target_params: dict | None = None) -> dict:
    """Random head; with target_params, the layer starts as a copy of the
    target's last layer (a head that already speaks the target's feature
    space trains much faster than one from scratch), and fc as [0; I], which
    passes the feature through."""
    if target_params is not None:
        from jaxinfer.quant.input_order import InputOrdered, logical_value
        from jaxinfer.quant.tensor import QuantizedTensor

        def last(w):  # a quantized target (the default GGUF loads as int4/int8 codes) starts the head dequantized
            if isinstance(w, (QuantizedTensor, InputOrdered)):
                return logical_value(w)[-1]
            return jnp.asarray(w[-1], jnp.float32)

        layer = {name: last(target_params["layers"][name]) for name in _LAYER_KEYS}
    else:
        shapes = head_shapes(config)["layer"]
        keys = jax.random.split(key, len(shapes))
        layer = {name: jnp.ones(shape, jnp.float32) if name.endswith("norm")
                 else jax.random.normal(k, shape, jnp.float32) * shape[0] ** -0.5
                 for k, (name, shape) in zip(keys, shapes.items())}
    h = config.hidden_size
    fc = jnp.concatenate([jnp.zeros((h, h)), jnp.eye(h)], axis=0).astype(jnp.float32)
    return {"fc": fc, "layer": layer}


def head_features(head: dict, target_params: dict, config: ModelConfig, tokens, features, positions,
                  attention, kv_cache=None, *, backend):
    """Run the head over entries (tokens [B, T], features [B, T, hidden] =
    f_{p-1}, positions [B, T] = p) with the given attention (models/attention
    interface); returns (predicted features f^_p [B, T, hidden], kv_cache).
    backend: the target's (backends/), whose arrange_eagle_head laid the head out."""
    with backend.precision():
        x = embed_tokens(target_params, tokens)
        x = backend.linear(jnp.concatenate([x, features.astype(x.dtype)], axis=-1), _in_dtype(head["fc"], x.dtype))
        layer = {k: _in_dtype(w, x.dtype) for k, w in head["layer"].items()}
        x, kv_cache = decoder_layer(layer, config, x, rotary_tables(config, positions), attention, kv_cache, 0,
                                    backend=backend)
        return settled(x), kv_cache


def _in_dtype(w, dtype):
    """A float array cast to the activations' dtype; a weight the backend laid
    out in another form (arrange_eagle_head) as it is, for it to multiply."""
    return w.astype(dtype) if isinstance(w, (jax.Array, np.ndarray)) else w


def feature_logits(target_params: dict, config: ModelConfig, features, *, backend):
    """The target's logits from (predicted) features: its final norm and head."""
    return backend.logits(target_params, rms_norm(features, target_params["final_norm"], config.rms_norm_eps))


def draft_logits(head: dict, target_params: dict, config: ModelConfig, features, *, backend):
    """The head's logits from (predicted) features: over its draft vocabulary
    when it has one (the target's final norm, then the head's own lm_head),
    else the target's full logits."""
    if "lm_head" not in head:
        return feature_logits(target_params, config, features, backend=backend)
    normed = rms_norm(features, target_params["final_norm"], config.rms_norm_eps)
    with backend.precision():
        return backend.linear(normed, _in_dtype(head["lm_head"], normed.dtype)).astype(jnp.float32)


def to_target_ids(head: dict, draft_ids):
    """Draft-vocabulary ids -> target ids (the identity without a draft vocabulary)."""
    return jnp.take(head["d2t"], draft_ids) if "d2t" in head else draft_ids


def window_attention(valid):
    """Causal attention among the entries of a window; valid [B, T] marks real entries."""
    index = jnp.broadcast_to(jnp.arange(valid.shape[1], dtype=jnp.int32), valid.shape)

    def attend(q, k, v, kv_cache, layer_index):
        return attention_reference(q, k, v, index, index, k_valid=valid), kv_cache

    return attend


def _metadata(config: ModelConfig, window: int, extra: dict) -> dict:
    c = config
    target = {"hidden_size": c.hidden_size, "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
              "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size}
    return {"format": "jaxinfer-eagle-head", "window": str(window), "target": json.dumps(target),
            "training": json.dumps(extra)}


def save_head(path, head: dict, config: ModelConfig, window: int, training_info: dict) -> None:
    from safetensors.numpy import save_file

    tensors = {"fc": np.asarray(head["fc"], np.float16)}
    tensors.update({f"layer.{k}": np.asarray(v, np.float16) for k, v in head["layer"].items()})
    if "lm_head" in head:
        tensors["lm_head"] = np.asarray(head["lm_head"], np.float16)
        tensors["d2t"] = np.asarray(head["d2t"], np.int32)
    save_file(tensors, str(path), metadata=_metadata(config, window, training_info))


def load_head(path, config: ModelConfig, dtype) -> tuple[dict, int]:
    """-> (head params on the device in `dtype`, window). A clear ValueError
    when the file is not a head, or was trained for another target shape."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"speculative['model']: EAGLE head {path} does not exist"
                         + (" (train one with scripts/train_draft_head.py)" if path == DEFAULT_HEAD else ""))
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"EAGLE head {path} cannot be read: {e}") from e
    if meta.get("format") != "jaxinfer-eagle-head":
        raise ValueError(f"{path} is not a jaxinfer EAGLE head (no 'format: jaxinfer-eagle-head' metadata)")
    expected = json.loads(_metadata(config, 0, {})["target"])
    trained_for = json.loads(meta["target"])
    if trained_for != expected:
        raise ValueError(f"EAGLE head {path} was trained for a target with {trained_for}, "
                         f"but this target has {expected}")
    shapes = head_shapes(config)
    head = {"fc": tensors["fc"], "layer": {k: tensors[f"layer.{k}"] for k in shapes["layer"]}}
    for name, shape in [("fc", shapes["fc"])] + [(f"layer.{k}", s) for k, s in shapes["layer"].items()]:
        array = head["fc"] if name == "fc" else head["layer"][name[6:]]
        if array.shape != shape:
            raise ValueError(f"EAGLE head {path}: tensor {name} has shape {array.shape}, expected {shape}")
    if "lm_head" in tensors or "d2t" in tensors:
        lm_head, d2t = tensors.get("lm_head"), tensors.get("d2t")
        if (lm_head is None or d2t is None or lm_head.ndim != 2 or lm_head.shape[0] != config.hidden_size
                or d2t.shape != (lm_head.shape[1],)):
            raise ValueError(f"EAGLE head {path}: a draft vocabulary needs lm_head [{config.hidden_size}, V] "
                             f"and d2t [V]")
        if d2t.min() < 0 or d2t.max() >= config.vocab_size:
            raise ValueError(f"EAGLE head {path}: d2t names ids outside the target's vocabulary")
        head["lm_head"] = lm_head
    head = jax.tree.map(lambda a: jax.device_put(np.asarray(a, dtype)), head)
    if "d2t" in tensors:
        head["d2t"] = jax.device_put(np.asarray(tensors["d2t"], np.int32))
    return head, int(meta["window"])

