"""Building blocks of the Llama-family transformer: RMSNorm, rotary embeddings.

All functions are pure and shape-polymorphic; they compute in float32 where
precision matters (norm statistics, rotary angles) and return the input dtype.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig


def rms_norm(x, weight, eps: float):
    """RMSNorm as the HF Llama/Qwen code computes it: statistics in float32,
    normalised activations cast back to the input dtype before the weight."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))
    return weight * normed.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse rotary frequencies [head_dim // 2] in float64 numpy (a compile-time
    constant), with the checkpoint's rope_scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling_dict
    rope_type = scaling.get("rope_type")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        # Llama 3.1 stretches only the low frequencies (long wavelengths) by
        # `factor`, keeps the high ones, and interpolates smoothly in between.
        factor = scaling["factor"]
        low_factor = scaling.get("low_freq_factor", 1.0)
        high_factor = scaling.get("high_freq_factor", 4.0)
        original_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (original_len / wavelen - low_factor) / (high_factor - low_factor)
        interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = np.where(
            wavelen < original_len / high_factor,
            inv_freq,
            np.where(wavelen > original_len / low_factor, inv_freq / factor, interpolated),
        )
    return inv_freq


def rotary_tables(config: ModelConfig, positions):
    """(cos, sin) float32 [..., T, 1, head_dim // 2] of the positions [..., T]:
    computed once per step and shared by every layer (each layer rotates
    its q and k by the same angles)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(rope_inv_freq(config), jnp.float32)
    return jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]  # broadcast over heads


def apply_rope(x, rope):
    """Rotate x [..., T, heads, head_dim] by the angles of rope = (cos, sin)
    (rotary_tables of its positions).

    Uses the "rotate half" pairing (dimension i with i + head_dim/2) that HF
    checkpoints assume; GGUF Llama weights are un-permuted at load to match.
    """
    cos, sin = rope
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
