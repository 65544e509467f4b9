"""Decode-time tree attention on Mosaic GPU (Hopper: wgmma, TMA, warp specialisation).

The contract of `ddtree_jax.kernels.tree_attention` (the Triton kernel) and of its jnp reference
`tree_attention_reference`: q [B, T, Hq, D] attends to the cache [B, Hkv, S, D] up to lengths [B]
(the last `window` entries of it with a window) and to the in-flight k_new, v_new [B, T, Hkv, D]
under mask [B, T, T] -> [B, T, Hq, D] in q's dtype (bf16 or f16: wgmma's 16-bit operands).

Layout. XLA packs the G = Hq / Hkv query heads of each K/V head with the T nodes into rows
`node * G + head` ([B, Hkv, R, D], R = T * G, padded to whole 64-row tiles: wgmma's M), moves the
in-flight K/V to the cache's layout ([B, Hkv, Tn, D], Tn padded to whole cache tiles) and turns the
mask into a float32 bias over packed rows ([B, Rq, Tn]: 0 where a node sees a new token, MASK_VALUE
elsewhere). `plgpu.kernel` grid (row tiles, B * Hkv, splits); a program (a CTA) is
`compute_wgs` compute warpgroups of 64 rows each plus one memory warpgroup:
- the memory warpgroup streams this split's share of the visible cache tiles, then (last split
  only) the in-flight tiles, into `stages` shared-memory slots by TMA, each slot guarded by a
  "full" barrier (TMA bytes arrived) and a "free" barrier (every compute warpgroup done with it);
- each compute warpgroup loads its 64 query rows once (TMA), then per tile: S = Q K^T (wgmma,
  float32 accumulator), the online softmax in base 2 (finite running-max start, as the Triton
  kernel), O += P V (wgmma, P in registers), releasing K as soon as S is read and V after P V.
  Only the first and the last tile of a sequence's range are masked (window start, length end);
  the last tile of a cache whose S (a multiple of 8) is not one of tile_k is read shifted back so that TMA
  never leaves the cache, its already-seen keys masked. In-flight tiles add the bias.
With one split the program writes the normalised output (bf16, through shared memory and TMA);
with several, float32 partials (acc, max, sum in log2 units) that `flash.combine_splits` (the Triton
kernel's XLA merge) combines. Splits divide each sequence's own visible range (dynamic trip counts).

`mma_form` "registers" (the GPU default) feeds P to the second wgmma from registers and
accumulates in place; "smem" stages P in shared memory and adds a fresh P V accumulator in
registers: what the CPU interpreter (`interpret=True`, jax's GPU interpret mode: TMA, barriers,
wgmma with shared-memory operands, warpgroups as threads) can run, since it has no wgmma with a
register operand and no accumulator initialised from a value. Both run on the GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from ddtree_jax.kernels.flash import LOG2E, M_INIT, MASK_VALUE, combine_splits
from ddtree_jax.kernels.tree_attention import tree_attention_reference
from ddtree_jax.kernels.tuning import (
    NUM_SMS_H200,
    TMA_ROW_TILE,
    WG_ROWS,
    TreeMgpuTuning,
    resolve_tree_mgpu_tuning,
)

__all__ = ["tree_attention_mgpu", "tree_attention_reference", "TMA_ROW_TILE"]

MEMORY_REGISTERS = 40  # per thread: the TMA warpgroup gives its registers to the compute ones


def compute_registers(compute_wgs: int) -> int:
    """Registers per thread of a compute warpgroup: the rule of Pallas's warp-specialised pipeline
    (64k registers less the memory warpgroup's, shared evenly, at most 256, a multiple of 8)."""
    return min(256, (512 - MEMORY_REGISTERS) // compute_wgs) // 8 * 8


def interpret_params(interpret: bool | plgpu.InterpretGPUParams) -> plgpu.InterpretGPUParams | bool:
    """`plgpu.kernel`'s interpret argument: the GPU interpreter's parameters, or False (compile)."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else False


def _pack_inputs(q, k_new, v_new, mask, tun: TreeMgpuTuning):
    """q -> [B, Hkv, Rq, D] (row = node * G + head, zero rows past R); k_new, v_new ->
    [B, Hkv, Tn, D] (zero rows past T); mask -> float32 bias [B, Rq, Tn] (0 seen, MASK_VALUE not)."""
    b, t, hq, d = q.shape
    hkv = k_new.shape[2]
    g = hq // hkv
    rq = tun.row_tiles * tun.tile_q
    tn = tun.new_tiles * tun.tile_k
    qp = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, rq - t * g), (0, 0)))
    kn, vn = (jnp.pad(x.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, tn - t), (0, 0))) for x in (k_new, v_new))
    seen = jnp.repeat(mask.astype(bool), g, axis=1)  # [B, T * G, T]
    seen = jnp.pad(seen, ((0, 0), (0, rq - t * g), (0, tn - t)))
    bias = jnp.where(seen, 0.0, MASK_VALUE).astype(jnp.float32)
    return qp, kn, vn, bias


def _unpack_rows(x: jax.Array, num_nodes: int, group: int) -> jax.Array:
    """[B, Hkv, >= T * G, D] -> [B, T, Hkv * G, D] (drops padding rows)."""
    b, hkv, _, d = x.shape
    x = x[:, :, : num_nodes * group].reshape(b, hkv, num_nodes, group, d)
    return x.transpose(0, 2, 1, 3, 4).reshape(b, num_nodes, hkv * group, d)


def _tree_attention_kernel(
    len_ref,  # [B] int32
    q_ref,  # [B, Hkv, Rq, D]
    k_ref,  # [B, Hkv, S, D]
    v_ref,  # [B, Hkv, S, D]
    kn_ref,  # [B, Hkv, Tn, D]
    vn_ref,  # [B, Hkv, Tn, D]
    bias_ref,  # [B, Rq, Tn] float32
    *refs,
    tun: TreeMgpuTuning,
    kv_heads: int,
    window: int | None,
    scale_log2: float,
):
    """One program: `compute_wgs` compute warpgroups (64 query rows each) and a memory warpgroup."""
    n_out = 1 if tun.splits == 1 else 3
    out_refs, (q_smem, slots, p_smem, barriers) = refs[:n_out], refs[n_out:]
    q_bar, k_full, v_full, k_free, v_free, sched, done = barriers
    (k_smem, v_smem), staging = slots
    c_wgs, bk, stages, splits = tun.compute_wgs, tun.tile_k, tun.stages, tun.splits
    s_len, d = k_ref.shape[2], k_ref.shape[3]
    dtype = q_ref.dtype

    row_tile, bh, split = lax.axis_index("rows"), lax.axis_index("bh"), lax.axis_index("split")
    wg = lax.axis_index("wg")
    bi, hi_ = bh // kv_heads, bh % kv_heads

    # This split's share of the visible tiles [tile_lo, tile_hi) (tile = bk cache rows, absolute).
    hi = jnp.minimum(len_ref[bi], s_len)
    lo = jnp.maximum(hi - window, 0) if window is not None else jnp.int32(0)
    tile_lo = lo // bk
    num_tiles = jnp.maximum((hi + bk - 1) // bk - tile_lo, 0)
    per_split = (num_tiles + splits - 1) // splits
    first = jnp.minimum(split * per_split, num_tiles)
    last = jnp.minimum(first + per_split, num_tiles)
    n_cache = last - first
    n_new = jnp.where(split == splits - 1, tun.new_tiles, 0) if splits > 1 else jnp.int32(tun.new_tiles)

    def cache_start(j):
        """First cache row of step j's tile (shifted back to stay inside the cache), and the tile."""
        blk = tile_lo + first + j
        return jnp.minimum(blk * bk, s_len - bk), blk

    @pl.when(wg == c_wgs)
    def _memory_warpgroup():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        def issue(j, k_src, v_src):
            slot = lax.rem(j, stages)

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(k_free.at[slot])

            plgpu.copy_gmem_to_smem(k_src, k_smem.at[slot], k_full.at[slot])

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(v_free.at[slot])

            plgpu.copy_gmem_to_smem(v_src, v_smem.at[slot], v_full.at[slot])

        @pl.loop(0, n_cache)
        def _cache(j):
            start, _ = cache_start(j)
            rows = pl.ds(start, bk)
            issue(j, k_ref.at[bi, hi_, rows], v_ref.at[bi, hi_, rows])

        @pl.loop(0, n_new)
        def _new(i):
            rows = pl.ds(i * bk, bk)
            issue(n_cache + i, kn_ref.at[bi, hi_, rows], vn_ref.at[bi, hi_, rows])

        # Observe the consumption of the last slots too: a waiter sees every phase of a barrier (what
        # jax's GPU interpreter checks; on the GPU it only delays this warpgroup's exit).
        @pl.loop(jnp.maximum(n_cache + n_new - stages, 0), n_cache + n_new)
        def _drain(j):
            plgpu.barrier_wait(k_free.at[lax.rem(j, stages)])
            plgpu.barrier_wait(v_free.at[lax.rem(j, stages)])

    @pl.when(wg < c_wgs)
    def _compute_warpgroup():
        plgpu.set_max_registers(compute_registers(c_wgs), action="increase")
        row0 = row_tile * tun.tile_q + wg * WG_ROWS
        my_q = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[bi, hi_, pl.ds(row0, WG_ROWS)], my_q, q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])

        def rendezvous():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        def step(j, carry, kind):
            """One tile: kind "full" (no mask), "masked" (cache tile at the range's ends) or "new"."""
            acc, m, l = carry
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(k_full.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, my_q, k_smem.at[slot].T)
                if tun.pingpong:
                    rendezvous()
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, bk), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            t = s * scale_log2
            if kind == "masked":
                start, blk = cache_start(j)
                pos = start + plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, bk), 1, layout=plgpu.Layout.WGMMA)
                ok = (pos >= jnp.maximum(lo, blk * bk)) & (pos < hi)
                t = jnp.where(ok, t, MASK_VALUE)
            elif kind == "new":
                i = j - n_cache
                tile = bias_ref.at[bi, pl.ds(row0, WG_ROWS), pl.ds(i * bk, bk)]
                t = t + plgpu.load(tile, layout=plgpu.Layout.WGMMA, optimized=False)
            m_new = jnp.maximum(m, t.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(t - lax.broadcast_in_dim(m_new, t.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            if tun.pingpong:
                plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(v_full.at[slot])
            if tun.pingpong:
                plgpu.barrier_wait(sched)
            if tun.mma_form == "registers":

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            else:
                my_p = p_smem.at[wg]
                my_p[...] = p.astype(dtype)
                plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, my_p, v_smem.at[slot])
                    return acc_ref[...]

                acc = acc + pl.run_scoped(pv, plgpu.ACC((WG_ROWS, d), jnp.float32))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        carry = (
            plgpu.layout_cast(jnp.zeros((WG_ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((WG_ROWS,), M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        )
        # Masked cache steps: the range's first tile when the window start is not tile-aligned,
        # its last when the length is not; the tiles between run unmasked.
        pro = ((lo % bk != 0) & (first == 0) & (n_cache > 0)).astype(jnp.int32)
        epi = ((hi % bk != 0) & (last == num_tiles) & (n_cache - pro > 0)).astype(jnp.int32)
        if tun.pingpong:
            pl.when(wg == 1)(rendezvous)
        carry = lax.fori_loop(0, pro, functools.partial(step, kind="masked"), carry)
        carry = lax.fori_loop(pro, n_cache - epi, functools.partial(step, kind="full"), carry)
        carry = lax.fori_loop(n_cache - epi, n_cache, functools.partial(step, kind="masked"), carry)
        carry = lax.fori_loop(n_cache, n_cache + n_new, functools.partial(step, kind="new"), carry)
        if tun.pingpong:
            pl.when(wg == 0)(rendezvous)
        acc, m, l = carry

        out_rows = min(WG_ROWS, tun.out_rows)
        dst_rows = pl.ds(row0, out_rows)
        if splits == 1:
            (o_ref,) = out_refs
            out = acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])
            my_q[...] = out.astype(dtype)  # Q is read: its tile stages the output
            plgpu.commit_smem()
            src = my_q if out_rows == WG_ROWS else my_q.at[pl.ds(0, out_rows)]
            plgpu.copy_smem_to_gmem(src, o_ref.at[bi, hi_, dst_rows])
        else:
            acc_ref, m_ref, l_ref = out_refs
            acc_stage, m_stage, l_stage = staging
            if c_wgs > 1:  # the staging aliases the K/V slots: every warpgroup must be done with them
                plgpu.barrier_arrive(done)
                plgpu.barrier_wait(done)
            acc_stage.at[wg][...] = acc
            m_stage.at[wg][...] = m
            l_stage.at[wg][...] = l
            plgpu.commit_smem()
            src_rows = pl.ds(0, out_rows)
            plgpu.copy_smem_to_gmem(acc_stage.at[wg, src_rows], acc_ref.at[split, bi, hi_, dst_rows])
            plgpu.copy_smem_to_gmem(m_stage.at[wg, src_rows], m_ref.at[split, bi, hi_, dst_rows])
            plgpu.copy_smem_to_gmem(l_stage.at[wg, src_rows], l_ref.at[split, bi, hi_, dst_rows])
        plgpu.wait_smem_to_gmem(0)


def _scratch(tun: TreeMgpuTuning, d: int, dtype) -> list:
    """Shared memory and barriers of one program (order: `_tree_attention_kernel`'s refs)."""
    c, bk = tun.compute_wgs, tun.tile_k
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # 16-bit, 128-byte rows
    q_smem = plgpu.SMEM((c, WG_ROWS, d), dtype, transforms=tiled)
    kv = tuple(plgpu.SMEM((tun.stages, bk, d), dtype, transforms=tiled) for _ in range(2))
    staging = ()
    if tun.splits > 1:
        tiled32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
        staging = (
            plgpu.SMEM((c, WG_ROWS, d), jnp.float32, transforms=tiled32),
            plgpu.SMEM((c, WG_ROWS), jnp.float32),
            plgpu.SMEM((c, WG_ROWS), jnp.float32),
        )
    slots = plgpu.RefUnion(kv, staging) if staging else (kv, ())
    p_smem = plgpu.SMEM((c, WG_ROWS, bk), dtype, transforms=tiled) if tun.mma_form == "smem" else None
    barriers = (
        plgpu.Barrier(num_barriers=c),  # q
        plgpu.Barrier(num_barriers=tun.stages),  # k full
        plgpu.Barrier(num_barriers=tun.stages),  # v full
        plgpu.Barrier(num_arrivals=c, num_barriers=tun.stages),  # k free
        plgpu.Barrier(num_arrivals=c, num_barriers=tun.stages),  # v free
        plgpu.Barrier(num_arrivals=c) if tun.pingpong else None,  # schedule
        plgpu.Barrier(num_arrivals=c) if c > 1 and tun.splits > 1 else None,  # done with the slots
    )
    return [q_smem, slots, p_smem, barriers]


@functools.partial(
    jax.jit,
    static_argnames=(
        "window", "interpret", "tile_k", "stages", "compute_wgs", "splits", "pingpong", "mma_form",
        "num_sms",
    ),
)  # fmt: skip
def tree_attention_mgpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    mask: jax.Array,
    *,
    window: int | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
    tile_k: int | None = None,
    stages: int | None = None,
    compute_wgs: int | None = None,
    splits: int | None = None,
    pingpong: bool | None = None,
    mma_form: str | None = None,
    num_sms: int = NUM_SMS_H200,
) -> jax.Array:
    """Mosaic GPU tree attention; same contract as `tree_attention_reference` (16-bit q and cache).

    Tuning (static; None = `resolve_tree_mgpu_tuning`'s default). `interpret` (True or the interpreter's
    parameters, e.g. with race detection) runs jax's GPU interpreter on the CPU (the "smem" mma form).
    """
    b, t, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    if k_new.shape != (b, t, hkv, d) or mask.shape != (b, t, t) or k_cache.shape != (b, hkv, s, d):
        raise ValueError(
            f"shapes q {q.shape}, k_cache {k_cache.shape}, k_new {k_new.shape}, mask {mask.shape}"
        )
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_cache.dtype != q.dtype or k_new.dtype != q.dtype:
        raise ValueError(f"q, caches and new K/V must share a 16-bit dtype, got {q.dtype}, {k_cache.dtype}")
    if interpret:
        mma_form = "smem"
    tun = resolve_tree_mgpu_tuning(
        q.shape, k_cache.shape, tile_k=tile_k, stages=stages, compute_wgs=compute_wgs, splits=splits,
        pingpong=pingpong, mma_form=mma_form, num_sms=num_sms,
    )  # fmt: skip
    qp, kn, vn, bias = _pack_inputs(q, k_new, v_new, mask, tun)
    if tun.splits == 1:
        out_type = jax.ShapeDtypeStruct((b, hkv, tun.out_rows, d), q.dtype)
    else:
        part = (tun.splits, b, hkv, tun.out_rows)
        out_type = (
            jax.ShapeDtypeStruct((*part, d), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        )
    kernel = functools.partial(
        _tree_attention_kernel, tun=tun, kv_heads=hkv, window=window, scale_log2=d**-0.5 * LOG2E
    )
    out = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(tun.row_tiles, b * hkv, tun.splits),
        grid_names=("rows", "bh", "split"),
        num_threads=tun.compute_wgs + 1,
        thread_name="wg",
        scratch_types=_scratch(tun, d, q.dtype),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
        kernel_name="tree_attention_mgpu",
    )(lengths.astype(jnp.int32), qp, k_cache, v_cache, kn, vn, bias)
    if tun.splits > 1:
        out = combine_splits(*out)
    return _unpack_rows(out, t, hq // hkv).astype(q.dtype)
