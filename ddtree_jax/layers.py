"""The pieces of a Qwen3/Llama decoder layer as pure functions over parameter dicts.

Shapes: x [B, T, H]; q [B, T, Hq, D]; k, v [B, T, Hkv, D]; positions [B, T] int32.

Under tensor parallelism (sharding.py) these run per device on local shapes: the head counts come
from the weights' shapes, never from the config, and `model_axis` names the mesh axis to all-reduce
over after o_proj and down_proj (Megatron); None on one device.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.collectives import Axis, psum
from ddtree_jax.config import LayerDims
from ddtree_jax.weights import WeightSpec, linear, norm

# attend(q, k_new, v_new) -> [B, T, Hq, D]: the caller closes over the cache and the mask.
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def layer_specs(prefix: str, path: tuple, dims: LayerDims) -> list[WeightSpec]:
    """The weights of one decoder layer; HF names under `prefix` (e.g. 'model.layers.3.')."""
    h, hq, hkv, ff = (
        dims.hidden_size,
        dims.num_heads * dims.head_dim,
        dims.num_kv_heads * dims.head_dim,
        dims.intermediate_size,
    )
    attn, mlp_ = prefix + "self_attn.", prefix + "mlp."
    specs = [
        norm((*path, "attn_norm"), prefix + "input_layernorm.weight", h),
        linear((*path, "q_proj"), attn + "q_proj.weight", h, hq, (None, "heads"), dims.num_heads),
        linear((*path, "k_proj"), attn + "k_proj.weight", h, hkv, (None, "kv_heads"), dims.num_kv_heads),
        linear((*path, "v_proj"), attn + "v_proj.weight", h, hkv, (None, "kv_heads"), dims.num_kv_heads),
        linear((*path, "o_proj"), attn + "o_proj.weight", hq, h, ("heads", None), dims.num_heads),
        norm((*path, "mlp_norm"), prefix + "post_attention_layernorm.weight", h),
        linear((*path, "gate_proj"), mlp_ + "gate_proj.weight", h, ff, (None, "ff")),
        linear((*path, "up_proj"), mlp_ + "up_proj.weight", h, ff, (None, "ff")),
        linear((*path, "down_proj"), mlp_ + "down_proj.weight", ff, h, ("ff", None)),
    ]
    if dims.qk_norm:
        specs += [
            norm((*path, "q_norm"), attn + "q_norm.weight", dims.head_dim),
            norm((*path, "k_norm"), attn + "k_norm.weight", dims.head_dim),
        ]
    return specs


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, scaled in the input dtype (as HF does)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, D/2] in float32 for the given absolute positions."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on [B, T, heads, D], in x's dtype."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def project_kv(p: dict, x: jax.Array, dims: LayerDims, rope: tuple[jax.Array, jax.Array]):
    """K (normed, rotated) and V of x: [B, T, Hkv, D] each (Hkv: the heads this device holds)."""
    b, t, _ = x.shape
    k = (x @ p["k_proj"]).reshape(b, t, -1, dims.head_dim)
    v = (x @ p["v_proj"]).reshape(b, t, -1, dims.head_dim)
    if dims.qk_norm:
        k = rms_norm(k, p["k_norm"], dims.rms_norm_eps)
    return apply_rope(k, *rope), v


def project_q(p: dict, x: jax.Array, dims: LayerDims, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Q (normed, rotated): [B, T, Hq, D] (Hq: the heads this device holds)."""
    b, t, _ = x.shape
    q = (x @ p["q_proj"]).reshape(b, t, -1, dims.head_dim)
    if dims.qk_norm:
        q = rms_norm(q, p["q_norm"], dims.rms_norm_eps)
    return apply_rope(q, *rope)


def mlp(p: dict, x: jax.Array, model_axis: Axis = None) -> jax.Array:
    """SwiGLU feed-forward (columns split over `model_axis`: partial sums all-reduced)."""
    return psum((jax.nn.silu(x @ p["gate_proj"]) * (x @ p["up_proj"])) @ p["down_proj"], model_axis)


def decoder_layer(
    p: dict,
    x: jax.Array,
    dims: LayerDims,
    rope: tuple[jax.Array, jax.Array],
    attend: Attend,
    model_axis: Axis = None,
    dropout: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One pre-norm decoder layer; returns the new hidden state and this layer's in-flight K/V.

    `dropout` (training only) applies to each branch's output before it joins the residual stream.
    """
    b, t, _ = x.shape
    branch = dropout or (lambda y: y)
    with jax.named_scope("attention"):
        h = rms_norm(x, p["attn_norm"], dims.rms_norm_eps)
        q = project_q(p, h, dims, rope)
        k, v = project_kv(p, h, dims, rope)
        out = attend(q, k, v).reshape(b, t, -1)
        x = x + branch(psum(out @ p["o_proj"], model_axis))
    with jax.named_scope("mlp"):
        x = x + branch(mlp(p, rms_norm(x, p["mlp_norm"], dims.rms_norm_eps), model_axis))
    return x, (k, v)
