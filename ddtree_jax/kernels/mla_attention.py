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
[B, T * H, C] for free) and takes a tile of `block_q` of them; it streams its share of the visible cache in
blocks of `block_k` entries (C + R = 576 values each), using the latent part of each block twice:
as key (with q_latent) and as value. Online softmax in float32, base 2, as in `tree_attention`; the last split
also attends to the in-flight tokens under `mask`. Several splits write float32 partials (acc, max,
sum) that the jnp combine of `tree_attention` merges. With value splits, adjacent programs share a
row tile: each computes the same scores and accumulates its 1 / value_splits of the C output
columns (a smaller float32 accumulator, at the price of the score matmul done again).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ddtree_jax.kernels.tree_attention import (
    LOG2E,
    M_INIT,
    MASK_VALUE,
    NUM_SMS_H200,
    _cdiv,
    _combine_splits,
    _next_pow2,
    _online_softmax_step,
    _qk,
)


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
    block_q: int,
    value_splits: int,
    block_k: int,
    block_new: int,
    num_new_blocks: int,
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
    rows = row_tile * block_q + jnp.arange(block_q, dtype=jnp.int32)
    row_ok = rows < num_nodes * heads
    node = rows // heads
    ccol = jnp.arange(latent_dim, dtype=jnp.int32)
    rcol = jnp.arange(rope_dim, dtype=jnp.int32)
    vcol = v0 + jnp.arange(value_dim, dtype=jnp.int32)
    ql = pltriton.load(ql_ref.at[rows[:, None], ccol[None, :]], mask=row_ok[:, None], other=0)
    qr = pltriton.load(qr_ref.at[rows[:, None], rcol[None, :]], mask=row_ok[:, None], other=0)

    def scores(c, kr):
        """Raw scores [block_q, K] of the tile's rows against K latents [K, C] and RoPE keys [K, R]."""
        return _qk(ql, c) + _qk(qr, kr)

    def values(ref, start, c, mask=None):
        """The value tile [K, value_dim]: the whole latent block `c` itself, or this part's columns
        of it, loaded again (from L1/L2: the block was just read for the scores)."""
        if value_splits == 1:
            return c
        at = ref.at[pl.ds(start, c.shape[0]), pl.ds(v0, value_dim)]
        return pltriton.load(at) if mask is None else pltriton.load(at, mask=mask, other=0)

    carry = (
        jnp.zeros((block_q, value_dim), jnp.float32),
        jnp.full((block_q,), M_INIT, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )

    # Cache part: this split's share of the visible blocks [lo, hi) (dynamic per sequence); full
    # blocks unmasked, the one partial block with masked loads.
    hi = jnp.minimum(len_ref[...], cache_len)
    lo = jnp.maximum(hi - window, 0) if window is not None else jnp.int32(0)
    num_full = (hi - lo) // block_k
    num_blocks = (hi - lo + block_k - 1) // block_k
    per_split = (num_blocks + splits - 1) // splits
    first = split * per_split
    last = jnp.minimum(first + per_split, num_blocks)

    def full_block(j, carry):
        start = lo + j * block_k
        c = pltriton.load(c_ref.at[pl.ds(start, block_k), :])
        kr = pltriton.load(kr_ref.at[pl.ds(start, block_k), :])
        return _online_softmax_step(carry, scores(c, kr), values(c_ref, start, c), scale_log2)

    def tail_block(carry):
        start = lo + num_full * block_k
        ok = start + jnp.arange(block_k, dtype=jnp.int32) < hi
        c = pltriton.load(c_ref.at[pl.ds(start, block_k), :], mask=ok[:, None], other=0)
        kr = pltriton.load(kr_ref.at[pl.ds(start, block_k), :], mask=ok[:, None], other=0)
        raw = jnp.where(ok[None, :], scores(c, kr), masked)
        return _online_softmax_step(carry, raw, values(c_ref, start, c, ok[:, None]), scale_log2)

    carry = lax.fori_loop(first, jnp.minimum(last, num_full), full_block, carry)
    has_tail = (num_full < num_blocks) & (first <= num_full) & (num_full < last)
    carry = lax.cond(has_tail, tail_block, lambda c: c, carry)

    # In-flight part: the T new tokens under the tree mask, done by the last split.
    def new_block(b, carry):
        cols = b * block_new + jnp.arange(block_new, dtype=jnp.int32)
        col_ok = cols < num_nodes
        cn = pltriton.load(cn_ref.at[cols[:, None], ccol[None, :]], mask=col_ok[:, None], other=0)
        krn = pltriton.load(krn_ref.at[cols[:, None], rcol[None, :]], mask=col_ok[:, None], other=0)
        seen = pltriton.load(
            mask_ref.at[node[:, None], cols[None, :]],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0,
        )
        raw = jnp.where(seen != 0, scores(cn, krn), masked)
        if value_splits > 1:
            at_v = cn_ref.at[cols[:, None], vcol[None, :]]
            cn = pltriton.load(at_v, mask=col_ok[:, None], other=0)
        return _online_softmax_step(carry, raw, cn, scale_log2)

    def new_part(carry):
        return lax.fori_loop(0, num_new_blocks, new_block, carry)

    carry = new_part(carry) if splits == 1 else lax.cond(split == splits - 1, new_part, lambda c: c, carry)

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


MAX_SPLITS = 256


def default_splits(
    batch: int,
    row_tiles: int,
    cache_len: int,
    block_k: int,
    *,
    num_sms: int = NUM_SMS_H200,
    min_blocks_per_split: int = 4,
    programs_per_sm: int = 1,
) -> int:
    """Cache splits (flash-decoding): the fewest within 10% of the least waves x blocks per program.

    `row_tiles` counts the programs of one sequence and split (row tiles x value splits). The first
    H200 run fits time = waves x blocks per program x 3.2 us (+ ~30 us of launches and combine) on
    every row, whatever the tile (16 or 64 rows, 4 or 8 warps): a program's loop step has a fixed
    latency, so what counts is the steps of the longest program, not bytes or FLOPs. Hence splits
    until the programs fill the SMs' slots (`programs_per_sm`: 2 for 4-warp 16-row tiles, 1 for the
    8-warp 64-row ones), counted in whole waves: at B = 1, T = 64, H = 64 (64 tiles) 3 splits make
    192 programs, two waves of a third of the cache each (2.2 ms measured), 2 splits one wave of
    half. A split's float32 partial is 2 kB per row, written and re-read: ties go to fewer splits.
    """
    num_blocks = _cdiv(cache_len, block_k)
    cap = max(1, min(MAX_SPLITS, _cdiv(num_blocks, min_blocks_per_split)))
    slots = num_sms * programs_per_sm
    cost = {sp: _cdiv(batch * row_tiles * sp, slots) * _cdiv(num_blocks, sp) for sp in range(1, cap + 1)}
    least = min(cost.values())
    return min(sp for sp in cost if cost[sp] <= 1.1 * least)


def resolve_tuning(
    q_shape: tuple[int, ...],
    cache_len: int,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    value_splits: int | None = None,
    num_sms: int = NUM_SMS_H200,
) -> dict:
    """The tuning `mla_attention` uses for q_latent's shape [B, T, H, C]; None picks the default.

    Defaults from the first H200 run's fit (see `default_splits` and results/notes.md, "The MLA
    kernel, second pass") and the sweep of scripts/bench_mla_attention.py (2026-12-01). Packed
    rows (T x H) of one sequence:
    - up to 16 (a TP8 shard's decode, 8 heads): one 16-row tile, 4 warps (the float32
      accumulator, 16 x 512, is 64 registers per thread), two programs per SM.
    - above: 64-row tiles with 8 warps (the configuration the first run compiled and measured at
      T = 64): at TP1 decode (64 heads) ALL rows in ONE tile, so each cache block is loaded once per
      sequence and split where 16-row tiles loaded it 4 times, and a loop step does 4x the work in
      the same measured time.
    Cache blocks of 576 keys: 64 rows (72 kB of bf16 per stage, 2 stages) behind 64-row tiles, where
    the H200 sweep measured them 1.1x / 1.4x / 1.3x faster than 32 (64 heads T = 1, 64 heads T = 64,
    8 heads T = 64, all at 32k); 32 rows behind 16-row tiles (8 heads, T = 1: 50.8 us against 64.2).
    `value_splits` (default 1) splits the C output columns over programs sharing a row tile, each
    recomputing the scores: smaller accumulators at the price of the score matmul done again; C /
    value_splits must be a power of two >= 16.
    """
    b, t, h, c = q_shape
    rows = t * h
    block_q = block_q or (16 if rows <= 16 else 64)
    block_k = block_k or (32 if block_q <= 16 else 64)
    value_splits = value_splits or 1
    num_warps = num_warps or (4 if block_q <= 16 else 8)
    num_stages = num_stages or 2
    for name, v in (("block_q", block_q), ("block_k", block_k), ("C / value_splits", c // value_splits)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} = {v} must be a power of two >= 16")
    if c % value_splits:
        raise ValueError(f"value_splits = {value_splits} must divide the latent width {c}")
    row_tiles = _cdiv(rows, block_q)
    if splits is None:
        per_sm = 2 if block_q <= 16 and num_warps <= 4 else 1
        programs = row_tiles * value_splits
        splits = default_splits(b, programs, cache_len, block_k, num_sms=num_sms, programs_per_sm=per_sm)
    return dict(
        block_q=block_q,
        block_k=block_k,
        splits=splits,
        num_warps=num_warps,
        num_stages=num_stages,
        value_splits=value_splits,
        row_tiles=row_tiles,
    )


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
        "block_q",
        "block_k",
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
    block_q: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    value_splits: int | None = None,
    num_sms: int = NUM_SMS_H200,
) -> jax.Array:
    """Pallas (Triton) absorbed MLA attention; same contract as `mla_attention_reference`.

    Tuning (static; None = the default of `resolve_tuning`): block_q packed rows (node * H + head)
    per program, block_k cache rows per step (both powers of two >= 16), splits of each sequence's
    visible cache range, Triton num_warps / num_stages, value_splits programs sharing a row tile,
    each computing the scores and 1 / value_splits of the output columns, num_sms for the split
    heuristic.
    """
    _check_shapes(q_latent, q_rope, latent_cache, rope_cache, latent_new, rope_new, mask)
    b, t, h, c = q_latent.shape
    s, r = latent_cache.shape[1], rope_cache.shape[-1]
    tuning = resolve_tuning(
        q_latent.shape,
        s,
        block_q=block_q,
        block_k=block_k,
        splits=splits,
        num_warps=num_warps,
        num_stages=num_stages,
        value_splits=value_splits,
        num_sms=num_sms,
    )
    splits = tuning["splits"]
    block_new = min(max(16, _next_pow2(t)), 64)
    kernel = functools.partial(
        _mla_attention_kernel,
        num_nodes=t,
        heads=h,
        cache_len=s,
        block_q=tuning["block_q"],
        value_splits=tuning["value_splits"],
        block_k=tuning["block_k"],
        block_new=block_new,
        num_new_blocks=_cdiv(t, block_new),
        splits=splits,
        window=window,
        scale_log2=softmax_scale * LOG2E,
    )

    def whole(*dims):
        """A block holding all of sequence b's `dims`-shaped slice of a [B, *dims] input."""
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
    return _combine_splits(*outs).reshape(b, t, h, c).astype(q_latent.dtype)
