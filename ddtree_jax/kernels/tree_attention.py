"""Decode-time tree attention: T new queries over a per-sequence cache prefix plus T in-flight keys.

One signature serves every decode-time call of the engine:
  target verify   T = budget + 1 tree nodes, `mask` = ancestor mask
  drafter block   T = block size, `mask` = all ones (the block is bidirectional)
  autoregressive  T = 1, `mask` = [[1]]

Shapes: q [B, T, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; lengths [B] int32 (valid cache entries
of each sequence); k_new, v_new [B, T, Hkv, D]; mask [B, T, T] bool/int8 (node i sees new token j)
-> [B, T, Hq, D] in q's dtype. Hq = G * Hkv (GQA: query head h reads K/V head h // G).

Kernel layout (`tree_attention`): grid (row tiles, B * Hkv, splits). A program packs the G query
heads of one K/V head with the T nodes into packed rows `node * G + head` (a tile of `block_q` of
them, loaded with a gather straight from q, no transpose), streams its share of the visible cache
[max(0, len - window), len) in blocks of `block_k` (full blocks unmasked, the one partial block
with masked loads), and runs an online softmax in float32 (base 2, finite running-max start).
The last split also attends to the T in-flight keys under `mask`. With one split the program
writes the normalised output; with several it writes float32 partials (acc, max, sum) that a
merge combines: a second small Pallas kernel (`merge="pallas"`, one launch) or jnp ops that XLA
fuses (`merge="xla"`, two or three launches). Splits divide the visible range of each sequence
(dynamic), so short sequences in a long cache still spread over all programs.

Defaults live in one place, `DECODE_TUNING` (one 16-row query tile: T = 1 decode) and
`TREE_TUNING` (larger trees); `resolve_tuning` turns them into the tuning of a shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MASK_VALUE = -1e30  # finite, so a fully masked row gives zeros instead of NaN


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
    # (the masked slots add exact zeros): batch invariance (generation.py).
    total = jnp.einsum("bhgts,s->bhgt", p[..., :s], jnp.ones((s,), jnp.float32))
    total += jnp.einsum("bhgtj,j->bhgt", p[..., s:], jnp.ones((t,), jnp.float32))
    p = p / jnp.maximum(total, 1e-30)[..., None]
    out = jnp.einsum("bhgts,bhsd->bthgd", p[..., :s], v_cache.astype(jnp.float32))
    out += jnp.einsum("bhgtj,bjhd->bthgd", p[..., s:], v_new.astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q.dtype)


LOG2E = 1.4426950408889634
# The running max starts here: finite (no inf - inf = NaN) and far above MASK_VALUE, so that
# exp2(MASK_VALUE - m) is exactly 0 even on rows that see nothing yet.
M_INIT = 0.5 * MASK_VALUE
NUM_SMS_H200 = 132
MAX_SPLITS = 64

# Default tunings, the one place to change them (issue 22 item 2: scripts/h200_decode.sh sweeps
# around DECODE_TUNING). `waves`: programs to aim for, in units of num_sms (splits fill the grid up to
# waves * num_sms programs); `min_blocks_per_split`: block_k blocks a split streams at least.
# DECODE_TUNING applies when the packed query rows G * T fit one 16-row tile (T = 1 decode): short
# programs (one block each at 1k context) fill the SMs, and a Pallas merge replaces XLA's fusions.
DECODE_TUNING = dict(block_k=128, num_warps=4, num_stages=2, waves=4, min_blocks_per_split=1, merge="pallas")
TREE_TUNING = dict(block_k=64, num_warps=4, num_stages=3, waves=2, min_blocks_per_split=4, merge="xla")
MERGES = ("pallas", "xla")


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a, b):
    return (a + b - 1) // b


def _online_softmax_step(carry, raw, v, scale_log2: float):
    """One flash step over raw scores [Q, K] = q . k (masked entries = MASK_VALUE / scale_log2).

    The max and the softmax run in log2 units: p = exp2(raw * scale_log2 - m), one FMA per score.
    """
    acc, m, l = carry
    m_new = jnp.maximum(m, jnp.max(raw, axis=1) * scale_log2)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(raw * scale_log2 - m_new[:, None])
    l_new = alpha * l + jnp.sum(p, axis=1)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_new, l_new


def _qk(q, k):
    """q [Q, D] . k [K, D]^T -> float32 [Q, K]."""
    return lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


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
    block_q: int,
    block_k: int,
    block_new: int,
    num_new_blocks: int,
    splits: int,
    window: int | None,
    scale_log2: float,
):
    row_tile, split = pl.program_id(0), pl.program_id(2)
    head_dim = q_ref.shape[-1]
    masked = MASK_VALUE / scale_log2  # a raw score that scales to MASK_VALUE
    rows = row_tile * block_q + jnp.arange(block_q, dtype=jnp.int32)  # packed row = node*G + head
    node, head = rows // group, rows % group
    row_ok = rows < num_nodes * group
    dcol = jnp.arange(head_dim, dtype=jnp.int32)
    q = pltriton.load(q_ref.at[node[:, None], head[:, None], dcol[None, :]], mask=row_ok[:, None], other=0)

    carry = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), M_INIT, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )

    # Cache part: this split's share of the visible blocks [lo, hi), dynamic per sequence. Only
    # the last block of the range can be partial: full blocks run unmasked, the tail masked.
    hi = jnp.minimum(len_ref[...], cache_len)
    lo = jnp.maximum(hi - window, 0) if window is not None else jnp.int32(0)
    num_full = (hi - lo) // block_k
    num_blocks = (hi - lo + block_k - 1) // block_k
    per_split = (num_blocks + splits - 1) // splits
    first = split * per_split
    last = jnp.minimum(first + per_split, num_blocks)

    def full_block(j, carry):
        start = lo + j * block_k
        # (pltriton.load, not ref[...]: in interpret mode it also traces when block_k > S.)
        k = pltriton.load(k_ref.at[pl.ds(start, block_k), :])
        v = pltriton.load(v_ref.at[pl.ds(start, block_k), :])
        return _online_softmax_step(carry, _qk(q, k), v, scale_log2)

    def tail_block(carry):
        start = lo + num_full * block_k
        ok = start + jnp.arange(block_k, dtype=jnp.int32) < hi
        k = pltriton.load(k_ref.at[pl.ds(start, block_k), :], mask=ok[:, None], other=0)
        v = pltriton.load(v_ref.at[pl.ds(start, block_k), :], mask=ok[:, None], other=0)
        raw = jnp.where(ok[None, :], _qk(q, k), masked)
        return _online_softmax_step(carry, raw, v, scale_log2)

    carry = lax.fori_loop(first, jnp.minimum(last, num_full), full_block, carry)
    has_tail = (num_full < num_blocks) & (first <= num_full) & (num_full < last)
    carry = lax.cond(has_tail, tail_block, lambda c: c, carry)

    # In-flight part: the T new keys under the tree mask, done by the last split (the lightest).
    def new_block(c, carry):
        cols = c * block_new + jnp.arange(block_new, dtype=jnp.int32)
        col_ok = cols < num_nodes
        kn = pltriton.load(kn_ref.at[cols[:, None], dcol[None, :]], mask=col_ok[:, None], other=0)
        vn = pltriton.load(vn_ref.at[cols[:, None], dcol[None, :]], mask=col_ok[:, None], other=0)
        seen = pltriton.load(
            mask_ref.at[node[:, None], cols[None, :]],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0,
        )
        raw = jnp.where(seen != 0, _qk(q, kn), masked)
        return _online_softmax_step(carry, raw, vn, scale_log2)

    def new_part(carry):
        return lax.fori_loop(0, num_new_blocks, new_block, carry)

    last_split = split == splits - 1
    carry = new_part(carry) if splits == 1 else lax.cond(last_split, new_part, lambda c: c, carry)

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


def default_splits(
    batch: int,
    kv_heads: int,
    row_tiles: int,
    cache_len: int,
    block_k: int,
    *,
    num_sms: int = NUM_SMS_H200,
    min_blocks_per_split: int,
    waves: int,
) -> int:
    """Cache splits so that about `waves` programs run per SM, each with a few blocks to stream."""
    want = _cdiv(waves * num_sms, batch * kv_heads * row_tiles)
    cap = max(1, _cdiv(cache_len, block_k * min_blocks_per_split))
    return max(1, min(want, cap, MAX_SPLITS))


def resolve_tuning(
    q_shape: tuple[int, ...],
    cache_shape: tuple[int, ...],
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    merge: str | None = None,
    waves: int | None = None,
    min_blocks_per_split: int | None = None,
    num_sms: int = NUM_SMS_H200,
) -> dict:
    """The tuning `tree_attention` uses for these shapes; None picks the default.

    Defaults by packed rows G * T: one tile of up to 128 rows; a single 16-row tile (AR decode)
    takes `DECODE_TUNING`, larger trees `TREE_TUNING` and tile the rows over the grid's first axis.
    TREE_TUNING comes from the H200 sweep (results/h200/bench_attention.json, read in
    results/h200/README.md): 4 warps beat 8 everywhere, 3 stages beat 2 with 64-row K blocks, and
    128-row query tiles halve the K/V re-reads of big trees. `waves` and `min_blocks_per_split` only
    steer the default splits.
    """
    b, t, hq, d = q_shape
    hkv, s = cache_shape[1], cache_shape[2]
    g = hq // hkv
    if hq != g * hkv:
        raise ValueError(f"query heads {hq} not a multiple of K/V heads {hkv}")
    block_q = block_q or min(max(16, _next_pow2(g * t)), 128)
    base = DECODE_TUNING if g * t <= 16 else TREE_TUNING
    block_k = block_k or base["block_k"]
    num_warps = num_warps or base["num_warps"]
    # An explicit block_k keeps the sweep's rule: 2 stages with 128-row blocks, 3 below.
    if num_stages is None:
        num_stages = base["num_stages"] if block_k == base["block_k"] else (2 if block_k >= 128 else 3)
    merge = merge or base["merge"]
    if merge not in MERGES:
        raise ValueError(f"merge {merge!r} not one of {MERGES}")
    for name, v in (("block_q", block_q), ("block_k", block_k), ("head dim", d)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} = {v} must be a power of two >= 16")
    row_tiles = _cdiv(g * t, block_q)
    if splits is None:
        splits = default_splits(
            b,
            hkv,
            row_tiles,
            s,
            block_k,
            num_sms=num_sms,
            min_blocks_per_split=min_blocks_per_split or base["min_blocks_per_split"],
            waves=waves or base["waves"],
        )
    return dict(
        block_q=block_q,
        block_k=block_k,
        splits=splits,
        num_warps=num_warps,
        num_stages=num_stages,
        merge=merge,
        row_tiles=row_tiles,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "window",
        "interpret",
        "block_q",
        "block_k",
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
    block_q: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    merge: str | None = None,
    num_sms: int = NUM_SMS_H200,
) -> jax.Array:
    """Pallas (Triton) tree attention; same contract as `tree_attention_reference`.

    Tuning (static; None = the default of `resolve_tuning`): block_q packed query rows per
    program, block_k cache rows per step (both powers of two >= 16), splits of each sequence's
    visible cache range, Triton num_warps / num_stages, merge of the split partials ("pallas" or
    "xla"), num_sms for the split heuristic.
    """
    b, t, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    assert k_new.shape == (b, t, hkv, d) and mask.shape == (b, t, t), (k_new.shape, mask.shape)
    tuning = resolve_tuning(
        q.shape,
        k_cache.shape,
        block_q=block_q,
        block_k=block_k,
        splits=splits,
        num_warps=num_warps,
        num_stages=num_stages,
        merge=merge,
        num_sms=num_sms,
    )
    block_q, block_k, splits = tuning["block_q"], tuning["block_k"], tuning["splits"]
    block_new = min(max(16, _next_pow2(t)), 64)

    kernel = functools.partial(
        _tree_attention_kernel,
        num_nodes=t,
        group=g,
        cache_len=s,
        block_q=block_q,
        block_k=block_k,
        block_new=block_new,
        num_new_blocks=_cdiv(t, block_new),
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
    return _combine_splits(*outs).reshape(b, t, hq, d).astype(q.dtype)


def _combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merge split partials: acc [splits, ..., D], m, l [splits, ...] (log2 units) -> [..., D]."""
    m_all = jnp.max(m, axis=0)
    w = jnp.exp2(m - m_all[None])
    l_all = jnp.sum(w * l, axis=0)
    acc_all = jnp.sum(w[..., None] * acc, axis=0)
    return acc_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]


MERGE_TILE = 4096  # f32 elements of one partial tile (splits x outputs) that a merge program loads


def _merge_splits_kernel(
    acc_ref, m_ref, l_ref, o_ref, *, splits: int, group: int, head_dim: int, size: int, block: int
):
    """One program merges `block` outputs (flat over node, head, d) of one (sequence, K/V head).

    acc_ref [splits, T, G, D], m_ref / l_ref [splits, T, G] (log2 units) -> o_ref [T, G, D]. All
    splits load at once as a [splits (padded), block] tile: no loop, one memory round trip.
    """
    sp_pad = _next_pow2(splits)
    flat = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
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
    (log2 units) -> [B, T, Hkv, G, D] in out_dtype; same result as `_combine_splits`, one launch."""
    splits, b, t, hkv, g, d = acc.shape
    if splits > MERGE_TILE:
        raise ValueError(f"{splits} splits exceed the merge tile {MERGE_TILE}")
    size = t * g * d
    block = min(MERGE_TILE // _next_pow2(splits), _next_pow2(size))
    kernel = functools.partial(
        _merge_splits_kernel, splits=splits, group=g, head_dim=d, size=size, block=block
    )

    def per_seq(bh):
        return bh // hkv

    def per_head(bh):
        return bh % hkv

    part = pl.BlockSpec((splits, None, t, None, g), lambda i, bh: (0, per_seq(bh), 0, per_head(bh), 0))
    full = pl.BlockSpec((splits, None, t, None, g, d), lambda i, bh: (0, per_seq(bh), 0, per_head(bh), 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(_cdiv(size, block), b * hkv),
        in_specs=[full, part, part],
        out_specs=pl.BlockSpec((None, t, None, g, d), lambda i, bh: (per_seq(bh), 0, per_head(bh), 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, t, hkv, g, d), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="tree_attention_merge",
    )(acc, m, l)


# -- The prefix and the tree apart, merged by log-sum-exp (issue 22) ----------------------------------
#
# Every tree node attends the whole committed prefix [0, len) unmasked; only the T x T in-flight part
# carries the ancestor mask. So the prefix part is plain (padded-length) attention, which a library
# kernel can run, and the small masked part can be merged in afterwards from each part's normalised
# output and log-sum-exp. Queries are packed as rows r = node * G + head per K/V head: [B, Hkv, T*G, D].


def _pack_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """q [B, T, Hq, D] -> [B, Hkv, T * G, D], row = node * G + head."""
    b, t, hq, d = q.shape
    g = hq // kv_heads
    return q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * g, d)


def _unpack_rows(x: jax.Array, num_nodes: int) -> jax.Array:
    """[B, Hkv, T * G, D] -> [B, T, Hq, D] (the inverse of `_pack_queries`)."""
    b, hkv, r, d = x.shape
    g = r // num_nodes
    return x.reshape(b, hkv, num_nodes, g, d).transpose(0, 2, 1, 3, 4).reshape(b, num_nodes, hkv * g, d)


def prefix_attention_reference(
    qp: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Packed rows qp [B, Hkv, R, D] over cache [0, len): output [B, Hkv, R, D] f32, lse [B, Hkv, R] f32.

    lse is the natural log-sum-exp of the scaled scores (-inf on an empty prefix, output 0 there).
    """
    d, s = qp.shape[-1], k_cache.shape[2]
    scores = jnp.einsum("bhrd,bhsd->bhrs", qp.astype(jnp.float32) * d**-0.5, k_cache.astype(jnp.float32))
    valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    scores = jnp.where(valid, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # -inf where nothing is valid
    p = jnp.where(valid, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return jnp.einsum("bhrs,bhsd->bhrd", p, v_cache.astype(jnp.float32)), lse


def prefix_attention_cudnn(
    qp: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`prefix_attention_reference` through cuDNN's fused flash attention (GPU only; wgmma on Hopper).

    jax 0.11.2's public `jax.nn.dot_product_attention` does not return the log-sum-exp; its backend
    `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` does (`return_residual=True`),
    takes the cache's own [B, N, S, H] layout (`qkv_layout="BNTH"`), bfloat16, and per-row key
    lengths (`kv_seqlen` with a padding mask). A private module: pinned to this jax version.
    """
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    b, _, r, d = qp.shape
    out, lse = cudnn_attention.dot_product_attention(
        qp,
        k_cache,
        v_cache,
        q_seqlen=jnp.full((b,), r, jnp.int32),
        kv_seqlen=lengths.astype(jnp.int32),
        scale=d**-0.5,
        mask_type=cudnn_attention.MaskType.PADDING,
        qkv_layout="BNTH",
        return_residual=True,
    )
    empty = (lengths <= 0)[:, None, None]
    lse = jnp.where(empty, -jnp.inf, lse.reshape(qp.shape[:3]).astype(jnp.float32))
    return jnp.where(empty[..., None], 0.0, out.astype(jnp.float32)), lse


def _tree_part(qp: jax.Array, k_new: jax.Array, v_new: jax.Array, mask: jax.Array, group: int):
    """The in-flight part: rows qp [B, Hkv, T*G, D] over k_new/v_new [B, T, Hkv, D] under mask
    [B, T, T] -> output [B, Hkv, T*G, D] f32, lse [B, Hkv, T*G] f32 (-inf on a row that sees none)."""
    d = qp.shape[-1]
    scores = jnp.einsum("bhrd,bjhd->bhrj", qp.astype(jnp.float32) * d**-0.5, k_new.astype(jnp.float32))
    seen = jnp.repeat(mask.astype(bool), group, axis=1)[:, None]  # [B, 1, T*G, T]
    scores = jnp.where(seen, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    p = jnp.where(seen, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return jnp.einsum("bhrj,bjhd->bhrd", p, v_new.astype(jnp.float32)), lse


def merge_by_lse(parts: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
    """Softmax over the union of disjoint key sets from each set's (normalised output [..., D],
    natural lse [...]); a set with lse -inf adds nothing; a row no set sees gets zeros (as in
    `tree_attention_reference`)."""
    m = jnp.max(jnp.stack([lse for _, lse in parts]), axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    weights = [jnp.exp(lse - m) for _, lse in parts]
    total = sum(weights)
    acc = sum(w[..., None] * out for w, (out, _) in zip(weights, parts, strict=True))
    return acc / jnp.where(total > 0, total, 1.0)[..., None]


PREFIX_KERNELS = {"reference": prefix_attention_reference, "cudnn": prefix_attention_cudnn}


@functools.partial(jax.jit, static_argnames=("prefix",))
def tree_attention_merged(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    mask: jax.Array,
    *,
    prefix: str = "cudnn",
) -> jax.Array:
    """Tree attention (contract of `tree_attention_reference`, no window) as an unmasked prefix
    part (`PREFIX_KERNELS[prefix]`) and the masked in-flight part, merged by log-sum-exp."""
    hkv = k_cache.shape[1]
    qp = _pack_queries(q, hkv)
    out = merge_by_lse(
        [
            PREFIX_KERNELS[prefix](qp, k_cache, v_cache, lengths),
            _tree_part(qp, k_new, v_new, mask, q.shape[2] // hkv),
        ]
    )
    return _unpack_rows(out, q.shape[1]).astype(q.dtype)
