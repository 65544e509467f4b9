"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): the attention kind of `deepseek_v3` layers.

Per token and layer the cache holds only the normalised latent c [C = kv_lora_rank] and the rotated
RoPE key shared by all heads k_rope [R = qk_rope_head_dim] (`LatentEntry`: cached [B, S, C] and
[B, S, R], time axis 1, no head axis). Every head h reads it through kv_b_proj, viewed [C, H, N + V]:
its first N columns W_uk[h] make the keys' no-RoPE part, the other V columns W_uv[h] the values.

Two forms of the same attention (softmax over q_nope . k_nope + q_rope . k_rope, times softmax_scale):
  absorbed  decode, drafter features, tree verify: queries mapped into latent space,
            q_latent[h] = W_uk[h] q_nope[h]; ddtree_jax.kernels.mla_attention attends over [cache ; new]
            under the mask; its latent output goes through W_uv[h]
  expanded  prefill (no cache): per-head keys and values built from the new tokens' latents
Which is cheaper, counted per head: both pay 2 C (N + V) FLOPs per token once (the absorbed form to map
each query, the expanded one to expand each key); per (query, key) pair the absorbed form costs
2 (C + R) + 2 C = 2176 FLOPs against 2 (N + R) + 2 V = 640 expanded (Kimi-K2: C 512, R 64, N 128, V 128).
With a cache of S >> T keys the expanded form would expand all S cached latents every call (S x 2 C (N + V)
per head), so decode and verify are absorbed; a prefill of T tokens has T keys for T queries: expanded
is 3.4x fewer attention FLOPs, and the only choice here (measurement on the H200: by the lead).

Tensor parallelism: query heads (q_b_proj or q_proj columns, kv_b_proj columns, o_proj rows) split
over "model", all-reduce after o_proj. The latent cache has no head axis: every device holds all of it
(replicated over "model", rows over "data"), and computes the latent of every token itself (q_a_proj
and kv_a_proj_with_mqa are replicated): results/notes.md gives the memory this costs at TP8.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ddtree_jax.attention import kernel
from ddtree_jax.collectives import Axis
from ddtree_jax.kernels.flash import MASK_VALUE
from ddtree_jax.kv_cache import SharedRows
from ddtree_jax.models.common import all_reduce, apply_rope, dense_weight, matmul, rms_norm
from ddtree_jax.sharding import DATA
from ddtree_jax.weights import WeightSpec, linear, norm

Rope = tuple[jax.Array, jax.Array]  # cos, sin [B, T, R / 2] (yarn's attention factor included)


@dataclasses.dataclass(frozen=True)
class MLADims:
    """The shape of one MLA layer (HF DeepseekV3Config fields)."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: a direct q_proj
    kv_lora_rank: int  # C
    qk_nope_head_dim: int  # N
    qk_rope_head_dim: int  # R
    v_head_dim: int  # V
    rms_norm_eps: float
    rope_interleave: bool  # HF's interleaved pairs (2i, 2i + 1) on the RoPE part
    softmax_scale: float  # (N + R) ** -0.5, times yarn's mscale(factor, mscale_all_dim) ** 2

    @property
    def qk_head_dim(self) -> int:
        """N + R: the width of one head's query and key."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class LatentEntry(NamedTuple):
    """One layer's latent cache: latent [B, S, C] and RoPE key [B, S, R] (in flight [B, T, ...])."""

    latent: jax.Array
    k_rope: jax.Array

    time_axis = 1  # of the cached leaves (kv_cache.py); in-flight leaves have time on axis 1 too

    @classmethod
    def cache_spec(cls) -> LatentEntry:
        """Rows over "data"; replicated over "model" (no head axis to split)."""
        return cls(P(DATA), P(DATA))

    @classmethod
    def new_spec(cls) -> LatentEntry:
        """The in-flight leaves [B, T, ...]: as cached."""
        return cls(P(DATA), P(DATA))


# attend(p, q_nope [B, T, h, N], q_rope [B, T, h, R], new entry [B, T, ...]) -> [B, T, h, V]
Attend = Callable[[dict, jax.Array, jax.Array, LatentEntry], jax.Array]


def cache_shapes(
    num_layers: int, dims: MLADims, batch: int, capacity: int, dtype: jnp.dtype
) -> list[LatentEntry]:
    """Global shapes of a latent cache (the same on every mesh: replicated over "model")."""
    latent = jax.ShapeDtypeStruct((batch, capacity, dims.kv_lora_rank), dtype)
    k_rope = jax.ShapeDtypeStruct((batch, capacity, dims.qk_rope_head_dim), dtype)
    return [LatentEntry(latent, k_rope) for _ in range(num_layers)]


def attention_specs(prefix: str, path: tuple, dims: MLADims) -> list[WeightSpec]:
    """The projections of one MLA layer; HF names under `prefix` + 'self_attn.'; heads over "model"."""
    attn, h, heads = prefix + "self_attn.", dims.hidden_size, dims.num_heads
    c, r = dims.kv_lora_rank, dims.qk_rope_head_dim
    q_out = heads * dims.qk_head_dim
    if dims.q_lora_rank is None:
        q = [linear((*path, "q_proj"), attn + "q_proj.weight", h, q_out, (None, "heads"), heads)]
    else:
        q = [
            linear((*path, "q_a_proj"), attn + "q_a_proj.weight", h, dims.q_lora_rank, (None, None)),
            norm((*path, "q_a_layernorm"), attn + "q_a_layernorm.weight", dims.q_lora_rank),
            linear(
                (*path, "q_b_proj"), attn + "q_b_proj.weight", dims.q_lora_rank, q_out, (None, "heads"), heads
            ),
        ]
    kv_out = heads * (dims.qk_nope_head_dim + dims.v_head_dim)
    return q + [
        linear((*path, "kv_a_proj_with_mqa"), attn + "kv_a_proj_with_mqa.weight", h, c + r, (None, None)),
        norm((*path, "kv_a_layernorm"), attn + "kv_a_layernorm.weight", c),
        linear((*path, "kv_b_proj"), attn + "kv_b_proj.weight", c, kv_out, (None, "heads"), heads),
        linear((*path, "o_proj"), attn + "o_proj.weight", heads * dims.v_head_dim, h, ("heads", None), heads),
    ]


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF's `rope_interleave` RoPE on [B, T, heads, R]: pairs (2i, 2i + 1) rotated by frequency i; the
    result comes out de-interleaved (rotated evens, then rotated odds), as HF lays it out."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rotate(x: jax.Array, dims: MLADims, rope: Rope) -> jax.Array:
    """The RoPE part of queries or keys [B, T, heads, R], in the layout the config asks for."""
    return (apply_rope_interleaved if dims.rope_interleave else apply_rope)(x, *rope)


def project_q(p: dict, x: jax.Array, dims: MLADims, rope: Rope) -> tuple[jax.Array, jax.Array]:
    """q_nope [B, T, h, N] and rotated q_rope [B, T, h, R] of normed x [B, T, H] (h: local heads)."""
    b, t, _ = x.shape
    if dims.q_lora_rank is None:
        q = matmul(x, p["q_proj"])
    else:
        q = matmul(rms_norm(matmul(x, p["q_a_proj"]), p["q_a_layernorm"], dims.rms_norm_eps), p["q_b_proj"])
    q = q.reshape(b, t, -1, dims.qk_head_dim)
    return q[..., : dims.qk_nope_head_dim], rotate(q[..., dims.qk_nope_head_dim :], dims, rope)


def project_latent(p: dict, x: jax.Array, dims: MLADims, rope: Rope) -> LatentEntry:
    """The cache entry of normed x [B, T, H]: normalised latent [B, T, C], rotated RoPE key [B, T, R]."""
    kv = matmul(x, p["kv_a_proj_with_mqa"])
    c = dims.kv_lora_rank
    latent = rms_norm(kv[..., :c], p["kv_a_layernorm"], dims.rms_norm_eps)
    k_rope = rotate(kv[..., None, c:], dims, rope)[:, :, 0]
    return LatentEntry(latent, k_rope)


def kv_b(p: dict, dims: MLADims, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """kv_b_proj split per local head: W_uk [C, h, N] (key half) and W_uv [C, h, V] (value half); a
    quantized kv_b_proj dequantised to `dtype` (it is small: C x H (N + V))."""
    w = dense_weight(p["kv_b_proj"], dtype)
    w = w.reshape(dims.kv_lora_rank, -1, dims.qk_nope_head_dim + dims.v_head_dim)
    return w[..., : dims.qk_nope_head_dim], w[..., dims.qk_nope_head_dim :]


def attention(
    p: dict, h: jax.Array, dims: MLADims, rope: Rope, attend: Attend, model_axis: Axis = None
) -> tuple[jax.Array, LatentEntry]:
    """MLA of normed h [B, T, H] -> (output [B, T, H] all-reduced, the new tokens' latent entry)."""
    b, t, _ = h.shape
    q_nope, q_rope = project_q(p, h, dims, rope)
    entry = project_latent(p, h, dims, rope)
    out = attend(p, q_nope, q_rope, entry).reshape(b, t, -1)
    return all_reduce(matmul(out, p["o_proj"]), model_axis), entry


def absorbed_attend(
    impl: str,
    entry: LatentEntry,
    lengths: jax.Array,
    mask: jax.Array,
    dims: MLADims,
    window: int | None = None,
    shared: SharedRows | None = None,
) -> Attend:
    """attend over one cached layer up to `lengths` [B] plus the new tokens under mask [B, T, T], in the
    absorbed form (`impl`: an MLA implementation of attention.KERNELS); with `shared`, over the rows
    the sequences share once the new tokens are in them (`SharedRows`)."""
    fn = kernel(impl, "mla")

    def attend(p: dict, q_nope: jax.Array, q_rope: jax.Array, new: LatentEntry) -> jax.Array:
        w_uk, w_uv = kv_b(p, dims, q_nope.dtype)
        q_latent = jnp.einsum("bthn,chn->bthc", q_nope, w_uk)
        cached = entry if shared is None else shared.view(entry, new)
        o = fn(
            q_latent,
            q_rope,
            cached.latent,
            cached.k_rope,
            lengths,
            new.latent,
            new.k_rope,
            mask,
            softmax_scale=dims.softmax_scale,
            window=window,
        )
        return jnp.einsum("bthc,chv->bthv", o, w_uv)

    return attend


def expanded_attend(mask: jax.Array, dims: MLADims) -> Attend:
    """attend over the new tokens only (prefill) in the expanded form: per-head keys and values."""

    def attend(p: dict, q_nope: jax.Array, q_rope: jax.Array, new: LatentEntry) -> jax.Array:
        w_uk, w_uv = kv_b(p, dims, new.latent.dtype)
        k_nope = jnp.einsum("bjc,chn->bjhn", new.latent, w_uk)
        v = jnp.einsum("bjc,chv->bjhv", new.latent, w_uv)
        f32 = jnp.float32
        scores = jnp.einsum("bthn,bjhn->bhtj", q_nope, k_nope, preferred_element_type=f32)
        scores += jnp.einsum("bthr,bjr->bhtj", q_rope, new.k_rope, preferred_element_type=f32)
        scores = jnp.where(mask.astype(bool)[:, None], scores * dims.softmax_scale, MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return jnp.einsum("bhtj,bjhv->bthv", probs, v)

    return attend


def layer_attend(
    impl: str, cache, layer: int, mask: jax.Array, dims: MLADims, window: int | None = None
) -> Attend:
    """The attend of decoder layer `layer`: absorbed over its cache entry, expanded when cache is None."""
    if cache is None:
        return expanded_attend(mask, dims)
    shared = cache if isinstance(cache, SharedRows) else None
    return absorbed_attend(impl, cache.layers[layer], cache.lengths, mask, dims, window, shared)
