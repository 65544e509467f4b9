"""Decode-time tree attention: T new queries over a per-sequence cache prefix plus T in-flight keys.

One signature serves every decode-time call of the engine:
  target verify   T = budget + 1 tree nodes, `mask` = ancestor mask
  drafter block   T = block size, `mask` = all ones (the block is bidirectional)
  autoregressive  T = 1, `mask` = [[1]]

Shapes: q [B, T, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; lengths [B] int32 (valid cache entries
of each sequence); k_new, v_new [B, T, Hkv, D]; mask [B, T, T] bool/int8 (node i sees new token j)
-> [B, T, Hq, D] in q's dtype. Hq = G * Hkv (GQA: query head h reads K/V head h // G).

Kernel layout (`tree_attention`): grid (row tiles, B * Hkv, splits). A program packs the G query
heads of one K/V head with the T nodes into packed rows `node * G + head` (a tile of `tile_q` of
them, loaded with a gather straight from q, no transpose), streams its share of the visible cache
[max(0, len - window), len) in tiles of `tile_k` (full tiles unmasked, the one partial tile
with masked loads), and runs an online softmax in float32 (base 2, finite running-max start).
The last split also attends to the T in-flight keys under `mask`. With one split the program
writes the normalised output; with several it writes float32 partials (acc, max, sum) that a
merge combines: a second small Pallas kernel (`merge="pallas"`, one launch) or jnp ops that XLA
fuses (`merge="xla"`, two or three launches). Splits divide the visible range of each sequence
(dynamic), so short sequences in a long cache still spread over all programs.

Defaults live in kernels/tuning.py, `DECODE_TUNING` (one 16-row query tile: T = 1 decode) and
`TREE_TUNING` (larger trees); `resolve_tree_tuning` turns them into the tuning of a shape. The cache
loop, the in-flight loop and the online softmax are kernels/flash.py's, shared with `mla_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ddtree_jax.kernels.flash import (
    LOG2E,
    M_INIT,
    MASK_VALUE,
    cdiv,
    combine_splits,
    empty_carry,
    load_rows,
    next_pow2,
    online_softmax_step,
    qk,
    stream_cache,
    stream_new,
)
from ddtree_jax.kernels.tuning import NUM_SMS_H200, resolve_tree_tuning


def tree_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    mask: jax.Array,
    *,
    window: int | None = None,
) -> jax.Array:
    """Pure-jnp tree attention (materialises the scores).

    `window` keeps the last `window` cache entries.
    """
    b, t, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    scale = d**-0.5
    qg = q.reshape(b, t, hkv, g, d).astype(jnp.float32) * scale
    # Scores over the cache prefix: [B, Hkv, G, T, S].
    s_cache = jnp.einsum("bthgd,bhsd->bhgts", qg, k_cache.astype(jnp.float32))
    pos = jnp.arange(s)[None, :]
    valid = pos < lengths[:, None]
    if window is not None:
        valid &= pos >= (lengths[:, None] - window)
    s_cache = jnp.where(valid[:, None, None, None, :], s_cache, MASK_VALUE)
    # Scores over the in-flight tokens: [B, Hkv, G, T, T].
    s_new = jnp.einsum("bthgd,bjhd->bhgtj", qg, k_new.astype(jnp.float32))
    s_new = jnp.where(mask.astype(bool)[:, None, None, :, :], s_new, MASK_VALUE)
    scores = jnp.concatenate([s_cache, s_new], axis=-1)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - m)
    p = jnp.where(scores > MASK_VALUE / 2, p, 0.0)
    # The sums run as dots, cache and in-flight parts apart: XLA's CPU reductions group their terms
    # by the reduced length, its dots do not, so a row's result does not depend on the capacity S
    # (the masked slots add exact zeros): batch invariance (scheduler.py).
    total = jnp.einsum("bhgts,s->bhgt", p[..., :s], jnp.ones((s,), jnp.float32))
    total += jnp.einsum("bhgtj,j->bhgt", p[..., s:], jnp.ones((t,), jnp.float32))
    p = p / jnp.maximum(total, 1e-30)[..., None]
    out = jnp.einsum("bhgts,bhsd->bthgd", p[..., :s], v_cache.astype(jnp.float32))
    out += jnp.einsum("bhgtj,bjhd->bthgd", p[..., s:], v_new.astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q.dtype)


def _tree_attention_kernel(
    len_ref,  # [] int32: valid cache entries of this sequence
    q_ref,  # [T, G, D]
    k_ref,  # [S, D]
    v_ref,  # [S, D]
    kn_ref,  # [T, D] in-flight keys of this K/V head
    vn_ref,  # [T, D]
    mask_ref,  # [T, T] int8
    *out_refs,  # splits == 1: o [T, G, D]; else acc [T, G, D] f32, m [T, G] f32, l [T, G] f32
    num_nodes: int,
    group: int,
    cache_len: int,
    tile_q: int,
    tile_k: int,
    tile_new: int,
    splits: int,
    window: int | None,
    scale_log2: float,
):
    row_tile, split = pl.program_id(0), pl.program_id(2)
    head_dim = q_ref.shape[-1]
    masked = MASK_VALUE / scale_log2  # a raw score that scales to MASK_VALUE
    rows = row_tile * tile_q + jnp.arange(tile_q, dtype=jnp.int32)  # packed row = node*G + head
    node, head = rows // group, rows % group
    row_ok = rows < num_nodes * group
    dcol = jnp.arange(head_dim, dtype=jnp.int32)
    q = pltriton.load(q_ref.at[node[:, None], head[:, None], dcol[None, :]], mask=row_ok[:, None], other=0)

    def cache_tile(carry, start, ok):
        # (pltriton.load, not ref[...]: in interpret mode it also traces when tile_k > S.)
        k = load_rows(k_ref.at[pl.ds(start, tile_k), :], ok)
        v = load_rows(v_ref.at[pl.ds(start, tile_k), :], ok)
        raw = qk(q, k) if ok is None else jnp.where(ok[None, :], qk(q, k), masked)
        return online_softmax_step(carry, raw, v, scale_log2)

    def new_tile(carry, cols, col_ok, seen):
        kn = pltriton.load(kn_ref.at[cols[:, None], dcol[None, :]], mask=col_ok[:, None], other=0)
        vn = pltriton.load(vn_ref.at[cols[:, None], dcol[None, :]], mask=col_ok[:, None], other=0)
        raw = jnp.where(seen() != 0, qk(q, kn), masked)
        return online_softmax_step(carry, raw, vn, scale_log2)

    carry = empty_carry(tile_q, head_dim)
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
    if splits == 1:
        (o_ref,) = out_refs
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        pltriton.store(
            o_ref.at[node[:, None], head[:, None], dcol[None, :]],
            out.astype(o_ref.dtype),
            mask=row_ok[:, None],
        )
    else:
        acc_ref, m_ref, l_ref = out_refs
        pltriton.store(acc_ref.at[node[:, None], head[:, None], dcol[None, :]], acc, mask=row_ok[:, None])
        pltriton.store(m_ref.at[node, head], m, mask=row_ok)
        pltriton.store(l_ref.at[node, head], l, mask=row_ok)


@functools.partial(
    jax.jit,
    static_argnames=(
        "window",
        "interpret",
        "tile_q",
        "tile_k",
        "splits",
        "num_warps",
        "num_stages",
        "merge",
        "num_sms",
    ),
)
def tree_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    mask: jax.Array,
    *,
    window: int | None = None,
    interpret: bool = False,
    tile_q: int | None = None,
    tile_k: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    merge: str | None = None,
    num_sms: int = NUM_SMS_H200,
) -> jax.Array:
    """Pallas (Triton) tree attention; same contract as `tree_attention_reference`.

    Tuning (static; None = the default of `resolve_tree_tuning`): tile_q packed query rows per
    program, tile_k cache rows per step (both powers of two >= 16), splits of each sequence's
    visible cache range, Triton num_warps / num_stages, merge of the split partials ("pallas" or
    "xla"), num_sms for the split heuristic.
    """
    b, t, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    assert k_new.shape == (b, t, hkv, d) and mask.shape == (b, t, t), (k_new.shape, mask.shape)
    tuning = resolve_tree_tuning(
        q.shape,
        k_cache.shape,
        tile_q=tile_q,
        tile_k=tile_k,
        splits=splits,
        num_warps=num_warps,
        num_stages=num_stages,
        merge=merge,
        num_sms=num_sms,
    )
    tile_q, tile_k, splits = tuning["tile_q"], tuning["tile_k"], tuning["splits"]
    tile_new = min(max(16, next_pow2(t)), 64)

    kernel = functools.partial(
        _tree_attention_kernel,
        num_nodes=t,
        group=g,
        cache_len=s,
        tile_q=tile_q,
        tile_k=tile_k,
        tile_new=tile_new,
        splits=splits,
        window=window,
        scale_log2=d**-0.5 * LOG2E,
    )

    def per_seq(bh):
        return bh // hkv

    def per_head(bh):
        return bh % hkv

    in_specs = [
        pl.BlockSpec((None,), lambda r, bh, sp: (per_seq(bh),)),
        pl.BlockSpec((None, t, None, g, d), lambda r, bh, sp: (per_seq(bh), 0, per_head(bh), 0, 0)),
        pl.BlockSpec((None, None, s, d), lambda r, bh, sp: (per_seq(bh), per_head(bh), 0, 0)),
        pl.BlockSpec((None, None, s, d), lambda r, bh, sp: (per_seq(bh), per_head(bh), 0, 0)),
        pl.BlockSpec((None, t, None, d), lambda r, bh, sp: (per_seq(bh), 0, per_head(bh), 0)),
        pl.BlockSpec((None, t, None, d), lambda r, bh, sp: (per_seq(bh), 0, per_head(bh), 0)),
        pl.BlockSpec((None, t, t), lambda r, bh, sp: (per_seq(bh), 0, 0)),
    ]
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((b, t, hkv, g, d), q.dtype)]
        out_specs = [in_specs[1]]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((splits, b, t, hkv, g, d), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, t, hkv, g), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, t, hkv, g), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec(
                (None, None, t, None, g, d),
                lambda r, bh, sp: (sp, per_seq(bh), 0, per_head(bh), 0, 0),
            ),
            pl.BlockSpec((None, None, t, None, g), lambda r, bh, sp: (sp, per_seq(bh), 0, per_head(bh), 0)),
            pl.BlockSpec((None, None, t, None, g), lambda r, bh, sp: (sp, per_seq(bh), 0, per_head(bh), 0)),
        ]
    outs = pl.pallas_call(
        kernel,
        grid=(tuning["row_tiles"], b * hkv, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(
            num_warps=tuning["num_warps"], num_stages=tuning["num_stages"]
        ),
        interpret=interpret,
        name="tree_attention",
    )(
        lengths.astype(jnp.int32),
        q.reshape(b, t, hkv, g, d),
        k_cache,
        v_cache,
        k_new,
        v_new,
        mask.astype(jnp.int8),
    )
    if splits == 1:
        return outs[0].reshape(b, t, hq, d)
    if tuning["merge"] == "pallas":
        return merge_splits(*outs, out_dtype=q.dtype, interpret=interpret).reshape(b, t, hq, d)
    return combine_splits(*outs).reshape(b, t, hq, d).astype(q.dtype)


MERGE_TILE = 4096  # f32 elements of one partial tile (splits x outputs) that a merge program loads


def _merge_splits_kernel(
    acc_ref, m_ref, l_ref, o_ref, *, splits: int, group: int, head_dim: int, size: int, tile: int
):
    """One program merges `tile` outputs (flat over node, head, d) of one (sequence, K/V head).

    acc_ref [splits, T, G, D], m_ref / l_ref [splits, T, G] (log2 units) -> o_ref [T, G, D]. All
    splits load at once as one [splits (padded), tile] array: no loop, one memory round trip.
    """
    sp_pad = next_pow2(splits)
    flat = pl.program_id(0) * tile + jnp.arange(tile, dtype=jnp.int32)
    ok = flat < size
    node, head, dcol = flat // (group * head_dim), (flat // head_dim) % group, flat % head_dim
    sp = jnp.arange(sp_pad, dtype=jnp.int32)[:, None]
    ok2 = (sp < splits) & ok[None, :]
    # Padding splits read as empty partials (max M_INIT, sum 0, acc 0): weight 0, or 1 times 0.
    m = pltriton.load(m_ref.at[sp, node[None, :], head[None, :]], mask=ok2, other=M_INIT)
    l = pltriton.load(l_ref.at[sp, node[None, :], head[None, :]], mask=ok2, other=0.0)
    acc = pltriton.load(acc_ref.at[sp, node[None, :], head[None, :], dcol[None, :]], mask=ok2, other=0.0)
    m_all = jnp.max(m, axis=0)
    w = jnp.exp2(m - m_all[None, :])
    l_all = jnp.sum(w * l, axis=0)
    out = jnp.sum(w * acc, axis=0) / jnp.where(l_all > 0, l_all, 1.0)
    pltriton.store(o_ref.at[node, head, dcol], out.astype(o_ref.dtype), mask=ok)


def merge_splits(
    acc: jax.Array, m: jax.Array, l: jax.Array, *, out_dtype: jnp.dtype, interpret: bool = False
) -> jax.Array:
    """Pallas merge of split partials: acc [splits, B, T, Hkv, G, D] f32, m, l [splits, B, T, Hkv, G]
    (log2 units) -> [B, T, Hkv, G, D] in out_dtype; same result as `flash.combine_splits`, one launch."""
    splits, b, t, hkv, g, d = acc.shape
    if splits > MERGE_TILE:
        raise ValueError(f"{splits} splits exceed the merge tile {MERGE_TILE}")
    size = t * g * d
    tile = min(MERGE_TILE // next_pow2(splits), next_pow2(size))
    kernel = functools.partial(
        _merge_splits_kernel, splits=splits, group=g, head_dim=d, size=size, tile=tile
    )

    def per_seq(bh):
        return bh // hkv

    def per_head(bh):
        return bh % hkv

    part = pl.BlockSpec((splits, None, t, None, g), lambda i, bh: (0, per_seq(bh), 0, per_head(bh), 0))
    full = pl.BlockSpec((splits, None, t, None, g, d), lambda i, bh: (0, per_seq(bh), 0, per_head(bh), 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(cdiv(size, tile), b * hkv),
        in_specs=[full, part, part],
        out_specs=pl.BlockSpec((None, t, None, g, d), lambda i, bh: (per_seq(bh), 0, per_head(bh), 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, t, hkv, g, d), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="tree_attention_merge",
    )(acc, m, l)
