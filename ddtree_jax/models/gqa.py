"""Grouped-query attention: the attention kind of Qwen3, Llama and Qwen3-MoE layers (and the drafter).

Its cache entry is `KVEntry`: per layer keys and values, cached [B, Hkv, S, D] (time axis 2), in flight
[B, T, Hkv, D]. Under tensor parallelism query heads and K/V heads split over "model" (K/V heads
repeated when fewer than devices: sharding.py); the all-reduce follows o_proj.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ddtree_jax.attention import kernel
from ddtree_jax.collectives import Axis
from ddtree_jax.config import LayerDims
from ddtree_jax.kernels.tree_attention import tree_attention_reference
from ddtree_jax.kv_cache import SharedRows
from ddtree_jax.models.common import all_reduce, apply_rope, rms_norm
from ddtree_jax.sharding import DATA, MODEL
from ddtree_jax.weights import WeightSpec, fused_weight, linear, norm

# attend(q, k_new, v_new) -> [B, T, Hq, D]: the caller closes over the cache and the mask.
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


class KVEntry(NamedTuple):
    """One layer's keys and values: cached [B, Hkv, S, D], in flight [B, T, Hkv, D]."""

    k: jax.Array
    v: jax.Array

    time_axis = 2  # of the cached leaves (kv_cache.py); in-flight leaves have time on axis 1

    @classmethod
    def cache_spec(cls) -> KVEntry:
        """PartitionSpecs of the cached leaves: rows over "data", K/V heads over "model"."""
        return cls(P(DATA, MODEL), P(DATA, MODEL))

    @classmethod
    def new_spec(cls) -> KVEntry:
        """PartitionSpecs of the in-flight leaves [B, T, Hkv, D]."""
        return cls(P(DATA, None, MODEL), P(DATA, None, MODEL))


class StackedKVEntry(NamedTuple):
    """Every layer's keys and values in one entry (a scan over the layers, `TargetConfig.scan_layers`):
    cached [B, L, Hkv, S, D] (time axis 3), in flight [B, T, L, Hkv, D]. Rows stay on axis 0, so the
    cache's row-wise and time-wise code (kv_cache.py, refills) treats it as any other entry; layer i's
    cache is a dynamic slice on axis 1 (`layer_entry`)."""

    k: jax.Array
    v: jax.Array

    time_axis = 3

    @classmethod
    def cache_spec(cls) -> StackedKVEntry:
        """PartitionSpecs of the cached leaves: rows over "data", K/V heads over "model"."""
        return cls(P(DATA, None, MODEL), P(DATA, None, MODEL))

    @classmethod
    def new_spec(cls) -> StackedKVEntry:
        """PartitionSpecs of the in-flight leaves [B, T, L, Hkv, D]."""
        return cls(P(DATA, None, None, MODEL), P(DATA, None, None, MODEL))


def layer_entry(stacked: StackedKVEntry, layer: jax.Array | int) -> KVEntry:
    """Layer `layer`'s cached K/V [B, Hkv, S, D] of a stacked cache (a dynamic slice, traced index)."""
    return KVEntry(*(jax.lax.dynamic_index_in_dim(x, layer, 1, keepdims=False) for x in stacked))


def cache_shapes(
    num_layers: int, dims: LayerDims, batch: int, capacity: int, tp: int, dtype: jnp.dtype
) -> list[KVEntry]:
    """Global shapes of a cache on a mesh of `tp` model devices (one K/V head per device when fewer)."""
    shape = jax.ShapeDtypeStruct((batch, max(dims.num_kv_heads, tp), capacity, dims.head_dim), dtype)
    return [KVEntry(shape, shape) for _ in range(num_layers)]


def stacked_cache_shapes(
    num_layers: int, dims: LayerDims, batch: int, capacity: int, tp: int, dtype: jnp.dtype
) -> list[StackedKVEntry]:
    """`cache_shapes` as one stacked entry [B, L, Hkv, S, D] (a scan over the layers)."""
    shape = (batch, num_layers, max(dims.num_kv_heads, tp), capacity, dims.head_dim)
    leaf = jax.ShapeDtypeStruct(shape, dtype)
    return [StackedKVEntry(leaf, leaf)]


def empty_cache(
    num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int, dtype: jnp.dtype
):
    """A zeroed GQA cache with all lengths 0."""
    from ddtree_jax.kv_cache import KVCache

    shape = (batch, num_kv_heads, capacity, head_dim)
    layers = [KVEntry(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)]
    return KVCache(layers, jnp.zeros((batch,), jnp.int32))


def attention_specs(
    prefix: str, path: tuple, dims: LayerDims, fuse: bool = False, q_apart: bool = False
) -> list[WeightSpec]:
    """q/k/v/o projections (and Qwen3's q/k norms) of one layer; HF names under `prefix` + 'self_attn.'.
    `fuse`: q, k and v as one weight "qkv_proj" [H, Hkv, Hq / Hkv + 2, D] (`weights.join`; axis
    "kv_groups": sharding.py), which `project_qkv` applies as one matmul. `q_apart` (with `fuse`): q
    its own weight and k, v one "kv_proj" [H, Hkv, 2, D], so that `project_kv` reads no query columns
    (the drafter's layout: its context K/V are projected every round without queries)."""
    h, hq, hkv = dims.hidden_size, dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    attn = prefix + "self_attn."
    q, k, v = (
        linear((*path, "q_proj"), attn + "q_proj.weight", h, hq, (None, "heads"), dims.num_heads),
        linear((*path, "k_proj"), attn + "k_proj.weight", h, hkv, (None, "kv_heads"), dims.num_kv_heads),
        linear((*path, "v_proj"), attn + "v_proj.weight", h, hkv, (None, "kv_heads"), dims.num_kv_heads),
    )
    if fuse and q_apart:
        shape = (h, dims.num_kv_heads, 2, dims.head_dim)
        specs = [q, fused_weight((*path, "kv_proj"), [k, v], "kv", shape, (None, "kv_groups", None, None))]
    elif fuse:
        group = dims.num_heads // dims.num_kv_heads + 2
        shape = (h, dims.num_kv_heads, group, dims.head_dim)
        specs = [fused_weight((*path, "qkv_proj"), [q, k, v], "qkv", shape, (None, "kv_groups", None, None))]
    else:
        specs = [q, k, v]
    specs.append(linear((*path, "o_proj"), attn + "o_proj.weight", hq, h, ("heads", None), dims.num_heads))
    if dims.qk_norm:
        specs += [
            norm((*path, "q_norm"), attn + "q_norm.weight", dims.head_dim),
            norm((*path, "k_norm"), attn + "k_norm.weight", dims.head_dim),
        ]
    return specs


def project_qkv(
    p: dict, x: jax.Array, dims: LayerDims, rope: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, KVEntry]:
    """Q [B, T, Hq, D] and the K/V entry [B, T, Hkv, D] of x (normed, rotated; the heads this device
    holds): one matmul of a fused "qkv_proj" [H, Hkv, Hq / Hkv + 2, D], else `project_q`, `project_kv`
    (two matmuls with a "kv_proj", three unfused)."""
    if "qkv_proj" not in p:
        return project_q(p, x, dims, rope), project_kv(p, x, dims, rope)
    b, t, h = x.shape
    w = p["qkv_proj"]  # this device's groups [H, G_local, Hq_group + 2, D]
    groups, per, d = w.shape[1:]
    qkv = (x @ w.reshape(h, -1)).reshape(b, t, groups, per, d)
    q = qkv[:, :, :, : per - 2].reshape(b, t, groups * (per - 2), d)
    k, v = qkv[:, :, :, per - 2], qkv[:, :, :, per - 1]
    if dims.qk_norm:
        q = rms_norm(q, p["q_norm"], dims.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], dims.rms_norm_eps)
    return apply_rope(q, *rope), KVEntry(apply_rope(k, *rope), v)


def project_kv(p: dict, x: jax.Array, dims: LayerDims, rope: tuple[jax.Array, jax.Array]) -> KVEntry:
    """K (normed, rotated) and V of x: [B, T, Hkv, D] each (Hkv: the heads this device holds): one
    matmul of a fused "kv_proj" [H, Hkv, 2, D], two unfused; a fused "qkv_proj" (the target's layout)
    computes the query heads too (and drops them)."""
    if "qkv_proj" in p:
        return project_qkv(p, x, dims, rope)[1]
    b, t, h = x.shape
    if "kv_proj" in p:
        w = p["kv_proj"]  # this device's groups [H, G_local, 2, D]
        kv = (x @ w.reshape(h, -1)).reshape(b, t, w.shape[1], 2, w.shape[3])
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]
    else:
        k = (x @ p["k_proj"]).reshape(b, t, -1, dims.head_dim)
        v = (x @ p["v_proj"]).reshape(b, t, -1, dims.head_dim)
    if dims.qk_norm:
        k = rms_norm(k, p["k_norm"], dims.rms_norm_eps)
    return KVEntry(apply_rope(k, *rope), v)


def project_q(p: dict, x: jax.Array, dims: LayerDims, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Q (normed, rotated): [B, T, Hq, D] (Hq: the heads this device holds)."""
    b, t, _ = x.shape
    q = (x @ p["q_proj"]).reshape(b, t, -1, dims.head_dim)
    if dims.qk_norm:
        q = rms_norm(q, p["q_norm"], dims.rms_norm_eps)
    return apply_rope(q, *rope)


def attention(
    p: dict,
    h: jax.Array,
    dims: LayerDims,
    rope: tuple[jax.Array, jax.Array],
    attend: Attend,
    model_axis: Axis = None,
) -> tuple[jax.Array, KVEntry]:
    """Self-attention of normed h [B, T, H] -> (output [B, T, H] all-reduced, the new K/V entry)."""
    b, t, _ = h.shape
    q, entry = project_qkv(p, h, dims, rope)
    out = attend(q, entry.k, entry.v).reshape(b, t, -1)
    return all_reduce(out @ p["o_proj"], model_axis), entry


def cache_attend(
    impl: str,
    entry: KVEntry,
    lengths: jax.Array,
    mask: jax.Array,
    window: int | None = None,
    shared: SharedRows | None = None,
) -> Attend:
    """attend(q, k_new, v_new) over one cached layer up to `lengths` [B] plus the new tokens under mask;
    with `shared`, over the rows the sequences share once the new tokens are in them (`SharedRows`)."""
    fn = kernel(impl, "gqa")

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        cached = entry if shared is None else shared.view(entry, KVEntry(k, v))
        return fn(q, cached.k, cached.v, lengths, k, v, mask, window=window)

    return attend


def self_attend(mask: jax.Array) -> Attend:
    """attend(q, k, v) over the new tokens only (prefill: nothing cached yet)."""

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        b, _, hkv, d = k.shape
        empty = k[:, :0].reshape(b, hkv, 0, d)
        lengths = jnp.zeros((b,), jnp.int32)
        return tree_attention_reference(q, empty, empty, lengths, k, v, mask)

    return attend


def layer_attend(
    impl: str, cache, layer: int | jax.Array, mask: jax.Array, window: int | None = None
) -> Attend:
    """The attend of decoder layer `layer`: over its cache entry, or the new tokens alone (cache None).
    A stacked cache (one `StackedKVEntry`) is read at `layer`, which may be traced (inside a scan)."""
    if cache is None:
        return self_attend(mask)
    first = cache.layers[0]
    entry = layer_entry(first, layer) if isinstance(first, StackedKVEntry) else cache.layers[layer]
    shared = cache if isinstance(cache, SharedRows) else None
    return cache_attend(impl, entry, cache.lengths, mask, window, shared)
