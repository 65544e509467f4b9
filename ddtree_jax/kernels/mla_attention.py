"""Absorbed multi-head latent attention (DeepSeek-V3 / Kimi-K2 MLA) over a latent cache, for decode.

The same decode-time contract as `tree_attention` (cache prefix up to `lengths`, T in-flight
tokens under a [B, T, T] mask: ancestor mask for verify, all ones for a drafter block, causal for
chains, T = 1 for AR), in MLA's absorbed form. Per token the cache holds the normalised latent c
(C = kv_lora_rank = 512) and the rotated RoPE key k_rope (R = qk_rope_head_dim = 64), shared by all
heads. With kv_b_proj.weight viewed as [H, N + V, C], W_uk[h] its first N rows and W_uv[h] the
other V, the caller absorbs the key half into the queries (q_latent[h] = W_uk[h]^T q_nope[h]) and
maps the output through the value half (W_uv[h] o[h], [V]); here

  score(h, i, j) = (q_latent[h, i] . c[j] + q_rope[h, i] . k_rope[j]) * softmax_scale
  o[h, i]        = sum_j softmax_j(score(h, i, j)) c[j]

Shapes: q_latent [B, T, H, C], q_rope [B, T, H, R]; latent_cache [B, S, C], rope_cache [B, S, R];
lengths [B] int32; latent_new [B, T, C], rope_new [B, T, R]; mask [B, T, T] bool/int8 (node i sees
in-flight token j) -> o [B, T, H, C] in q_latent's dtype. `softmax_scale` is explicit: yarn's
mscale changes it (DeepSeek-V3: 192**-0.5 * mscale**2).

Kernel layout (`mla_attention`): grid (row tiles x value splits, B, splits). Every head shares one
cache entry, so a program packs heads and nodes into rows `node * H + head` (q_latent reshaped to
[B, T * H, C] for free) and takes a tile of `tile_q` of them; it streams its share of the visible cache in
tiles of `tile_k` entries (C + R = 576 values each), using the latent part of each tile twice:
as key (with q_latent) and as value. Online softmax in float32, base 2, as in `tree_attention`; the last split
also attends to the in-flight tokens under `mask`. Several splits write float32 partials (acc, max,
sum) that the jnp combine of kernels/flash.py merges (the cache loop, the in-flight loop and the
online softmax are flash.py's too, the default tuning kernels/tuning.py's). With value splits,
adjacent programs share a row tile: each computes the same scores and accumulates its 1 /
value_splits of the C output columns (a smaller float32 accumulator, at the price of the score
matmul done again).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ddtree_jax.kernels.flash import (
    LOG2E,
    MASK_VALUE,
    combine_splits,
    empty_carry,
    load_rows,
    next_pow2,
    online_softmax_step,
    qk,
    stream_cache,
    stream_new,
)
from ddtree_jax.kernels.tuning import NUM_SMS_H200, resolve_mla_tuning


def mla_attention_reference(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent_cache: jax.Array,
    rope_cache: jax.Array,
    lengths: jax.Array,
    latent_new: jax.Array,
    rope_new: jax.Array,
    mask: jax.Array,
    *,
    softmax_scale: float,
    window: int | None = None,
) -> jax.Array:
    """Pure-jnp absorbed MLA attention (float32 scores, materialised): [B, T, H, C].

    `window` keeps the last `window` cache entries.
    """
    f32 = jnp.float32
    s = latent_cache.shape[1]
    ql = q_latent.astype(f32) * softmax_scale
    qr = q_rope.astype(f32) * softmax_scale
    # Scores over the cache prefix [B, T, H, S] and over the in-flight tokens [B, T, H, T].
    s_cache = jnp.einsum("bthc,bsc->bths", ql, latent_cache.astype(f32))
    s_cache += jnp.einsum("bthr,bsr->bths", qr, rope_cache.astype(f32))
    pos = jnp.arange(s)[None, :]
    valid = pos < lengths[:, None]
    if window is not None:
        valid &= pos >= (lengths[:, None] - window)
    s_cache = jnp.where(valid[:, None, None, :], s_cache, MASK_VALUE)
    s_new = jnp.einsum("bthc,bjc->bthj", ql, latent_new.astype(f32))
    s_new += jnp.einsum("bthr,bjr->bthj", qr, rope_new.astype(f32))
    s_new = jnp.where(mask.astype(bool)[:, :, None, :], s_new, MASK_VALUE)
    scores = jnp.concatenate([s_cache, s_new], axis=-1)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(scores > MASK_VALUE / 2, jnp.exp(scores - m), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("bths,bsc->bthc", p[..., :s], latent_cache.astype(f32))
    out += jnp.einsum("bthj,bjc->bthc", p[..., s:], latent_new.astype(f32))
    return out.astype(q_latent.dtype)


def _mla_attention_kernel(
    len_ref,  # [] int32: valid cache entries of this sequence
    ql_ref,  # [T * H, C] absorbed queries, row = node * H + head
    qr_ref,  # [T * H, R]
    c_ref,  # [S, C] latent cache of this sequence
    kr_ref,  # [S, R] RoPE keys
    cn_ref,  # [T, C] in-flight latents
    krn_ref,  # [T, R]
    mask_ref,  # [T, T] int8
    *out_refs,  # splits == 1: o [T * H, C]; else acc [T * H, C] f32, m [T * H] f32, l [T * H] f32
    num_nodes: int,
    heads: int,
    cache_len: int,
    tile_q: int,
    value_splits: int,
    tile_k: int,
    tile_new: int,
    splits: int,
    window: int | None,
    scale_log2: float,
):
    tile, split = pl.program_id(0), pl.program_id(2)
    row_tile, part = tile // value_splits, tile % value_splits  # the parts of one row tile are adjacent
    latent_dim, rope_dim = ql_ref.shape[-1], qr_ref.shape[-1]
    value_dim = latent_dim // value_splits  # output columns of this program: [v0, v0 + value_dim)
    v0 = part * value_dim
    masked = MASK_VALUE / scale_log2  # a raw score that scales to MASK_VALUE
    rows = row_tile * tile_q + jnp.arange(tile_q, dtype=jnp.int32)
    row_ok = rows < num_nodes * heads
    node = rows // heads
    ccol = jnp.arange(latent_dim, dtype=jnp.int32)
    rcol = jnp.arange(rope_dim, dtype=jnp.int32)
    vcol = v0 + jnp.arange(value_dim, dtype=jnp.int32)
    ql = pltriton.load(ql_ref.at[rows[:, None], ccol[None, :]], mask=row_ok[:, None], other=0)
    qr = pltriton.load(qr_ref.at[rows[:, None], rcol[None, :]], mask=row_ok[:, None], other=0)

    def scores(c, kr):
        """Raw scores [tile_q, K] of the tile's rows against K latents [K, C] and RoPE keys [K, R]."""
        return qk(ql, c) + qk(qr, kr)

    def cache_tile(carry, start, ok):
        c = load_rows(c_ref.at[pl.ds(start, tile_k), :], ok)
        kr = load_rows(kr_ref.at[pl.ds(start, tile_k), :], ok)
        raw = scores(c, kr) if ok is None else jnp.where(ok[None, :], scores(c, kr), masked)
        # The value tile [K, value_dim]: the whole latent tile itself, or this part's columns of it,
        # loaded again (from L1/L2: the tile was just read for the scores).
        v = c if value_splits == 1 else load_rows(c_ref.at[pl.ds(start, tile_k), pl.ds(v0, value_dim)], ok)
        return online_softmax_step(carry, raw, v, scale_log2)

    def new_tile(carry, cols, col_ok, seen):
        cn = pltriton.load(cn_ref.at[cols[:, None], ccol[None, :]], mask=col_ok[:, None], other=0)
        krn = pltriton.load(krn_ref.at[cols[:, None], rcol[None, :]], mask=col_ok[:, None], other=0)
        raw = jnp.where(seen() != 0, scores(cn, krn), masked)
        if value_splits > 1:
            cn = pltriton.load(cn_ref.at[cols[:, None], vcol[None, :]], mask=col_ok[:, None], other=0)
        return online_softmax_step(carry, raw, cn, scale_log2)

    carry = empty_carry(tile_q, value_dim)
    carry = stream_cache(
        carry,
        len_ref[...],
        split,
        cache_tile,
        cache_len=cache_len,
        tile_k=tile_k,
        splits=splits,
        window=window,
    )
    carry = stream_new(
        carry,
        new_tile,
        mask_ref,
        node,
        row_ok,
        num_nodes=num_nodes,
        tile_new=tile_new,
        split=split,
        splits=splits,
    )

    acc, m, l = carry
    at_rows = (rows[:, None], vcol[None, :])
    if splits == 1:
        (o_ref,) = out_refs
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        pltriton.store(o_ref.at[at_rows], out.astype(o_ref.dtype), mask=row_ok[:, None])
    else:
        acc_ref, m_ref, l_ref = out_refs
        pltriton.store(acc_ref.at[at_rows], acc, mask=row_ok[:, None])
        first_part = row_ok & (part == 0)  # every part has the same max and sum
        pltriton.store(m_ref.at[rows], m, mask=first_part)
        pltriton.store(l_ref.at[rows], l, mask=first_part)


def _check_shapes(q_latent, q_rope, latent_cache, rope_cache, latent_new, rope_new, mask) -> None:
    """Raise unless the shapes agree and C, R are powers of two >= 16 (Triton's load and dot rules)."""
    b, t, h, c = q_latent.shape
    s, r = latent_cache.shape[1], rope_cache.shape[-1]
    expected = {
        "q_rope": (q_rope.shape, (b, t, h, r)),
        "latent_cache": (latent_cache.shape, (b, s, c)),
        "rope_cache": (rope_cache.shape, (b, s, r)),
        "latent_new": (latent_new.shape, (b, t, c)),
        "rope_new": (rope_new.shape, (b, t, r)),
        "mask": (mask.shape, (b, t, t)),
    }
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(f"{name} has shape {tuple(got)}, expected {want}")
    for name, v in (("latent dim", c), ("rope dim", r)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} = {v} must be a power of two >= 16")


@functools.partial(
    jax.jit,
    static_argnames=(
        "softmax_scale",
        "window",
        "interpret",
        "tile_q",
        "tile_k",
        "splits",
        "num_warps",
        "num_stages",
        "value_splits",
        "num_sms",
    ),
)
def mla_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent_cache: jax.Array,
    rope_cache: jax.Array,
    lengths: jax.Array,
    latent_new: jax.Array,
    rope_new: jax.Array,
    mask: jax.Array,
    *,
    softmax_scale: float,
    window: int | None = None,
    interpret: bool = False,
    tile_q: int | None = None,
    tile_k: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    value_splits: int | None = None,
    num_sms: int = NUM_SMS_H200,
) -> jax.Array:
    """Pallas (Triton) absorbed MLA attention; same contract as `mla_attention_reference`.

    Tuning (static; None = the default of `resolve_mla_tuning`): tile_q packed rows (node * H + head)
    per program, tile_k cache rows per step (both powers of two >= 16), splits of each sequence's
    visible cache range, Triton num_warps / num_stages, value_splits programs sharing a row tile,
    each computing the scores and 1 / value_splits of the output columns, num_sms for the split
    heuristic.
    """
    _check_shapes(q_latent, q_rope, latent_cache, rope_cache, latent_new, rope_new, mask)
    b, t, h, c = q_latent.shape
    s, r = latent_cache.shape[1], rope_cache.shape[-1]
    tuning = resolve_mla_tuning(
        q_latent.shape,
        s,
        tile_q=tile_q,
        tile_k=tile_k,
        splits=splits,
        num_warps=num_warps,
        num_stages=num_stages,
        value_splits=value_splits,
        num_sms=num_sms,
    )
    splits = tuning["splits"]
    tile_new = min(max(16, next_pow2(t)), 64)
    kernel = functools.partial(
        _mla_attention_kernel,
        num_nodes=t,
        heads=h,
        cache_len=s,
        tile_q=tuning["tile_q"],
        value_splits=tuning["value_splits"],
        tile_k=tuning["tile_k"],
        tile_new=tile_new,
        splits=splits,
        window=window,
        scale_log2=softmax_scale * LOG2E,
    )

    def whole(*dims):
        """A BlockSpec holding all of sequence b's `dims`-shaped slice of a [B, *dims] input."""
        return pl.BlockSpec((None, *dims), lambda rt, bi, sp: (bi,) + (0,) * len(dims))

    in_specs = [
        whole(),
        whole(t * h, c),
        whole(t * h, r),
        whole(s, c),
        whole(s, r),
        whole(t, c),
        whole(t, r),
        whole(t, t),
    ]
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((b, t * h, c), q_latent.dtype)]
        out_specs = [whole(t * h, c)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((splits, b, t * h, c), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, t * h), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, t * h), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, t * h, c), lambda rt, bi, sp: (sp, bi, 0, 0)),
            pl.BlockSpec((None, None, t * h), lambda rt, bi, sp: (sp, bi, 0)),
            pl.BlockSpec((None, None, t * h), lambda rt, bi, sp: (sp, bi, 0)),
        ]
    outs = pl.pallas_call(
        kernel,
        grid=(tuning["row_tiles"] * tuning["value_splits"], b, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(
            num_warps=tuning["num_warps"], num_stages=tuning["num_stages"]
        ),
        interpret=interpret,
        name="mla_attention",
    )(
        lengths.astype(jnp.int32),
        q_latent.reshape(b, t * h, c),
        q_rope.reshape(b, t * h, r),
        latent_cache,
        rope_cache,
        latent_new,
        rope_new,
        mask.astype(jnp.int8),
    )
    if splits == 1:
        return outs[0].reshape(b, t, h, c)
    return combine_splits(*outs).reshape(b, t, h, c).astype(q_latent.dtype)
