"""Absorbed MLA attention over a latent cache on Mosaic GPU (Hopper: wgmma, TMA, warp specialisation).

The contract of `ddtree_jax.kernels.mla_attention` (the Triton kernel) and of its reference
`mla_attention_reference`: q_latent [B, T, H, C], q_rope [B, T, H, R]; latent_cache [B, S, C],
rope_cache [B, S, R]; lengths [B]; latent_new [B, T, C], rope_new [B, T, R]; mask [B, T, T]
-> [B, T, H, C]; score = (q_latent . c + q_rope . k_rope) * softmax_scale, value = the latent c.
Kimi-K2 / DeepSeek-V3 widths: C = 512, R = 64 (C a multiple of 128 up to 512, R of 64 here).

Layout. Every head reads the same cache entry, so rows `node * H + head` (q_latent reshaped for
free to [B, T * H, C]) are packed into 64-row tiles (wgmma's M). The float32 accumulator of a tile,
64 x 512, is too big for one warpgroup's registers, so a program runs two compute warpgroups that
split the value columns (as FlashMLA does) plus a memory warpgroup:
- the memory warpgroup streams the split's cache tiles (tile_k entries of C + R values) and then
  (last split) the in-flight ones into `stages` slots by TMA;
- the score warpgroup (0) computes S = Q_latent C^T + Q_rope K_rope^T (wgmma, contraction C + R),
  masks, runs the online softmax (base 2, finite start, as the Triton kernel), publishes P (bf16)
  and the rescale factor alpha of each row in shared memory, and accumulates P V on value columns
  [0, C/2);
- the value warpgroup (1) waits for P, rescales its accumulator by alpha and accumulates P V on
  columns [C/2, C).
The cache tile is used twice, as key and as value, from the same slot. Splits, masking, the
in-flight part (a float32 bias over packed rows) and the outputs follow `tree_attention_mgpu`.
`mma_form` as there: "registers" (GPU) feeds the score warpgroup's P from registers and accumulates
in place, "smem" (what jax's CPU interpreter runs) reads P from shared memory and adds fresh
accumulators.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from ddtree_jax.kernels.flash import LOG2E, M_INIT, MASK_VALUE, combine_splits
from ddtree_jax.kernels.mla_attention import _check_shapes, mla_attention_reference
from ddtree_jax.kernels.tree_attention_mgpu import MEMORY_REGISTERS, compute_registers, interpret_params
from ddtree_jax.kernels.tuning import NUM_SMS_H200, WG_ROWS, MlaMgpuTuning, resolve_mla_mgpu_tuning

__all__ = ["mla_attention_mgpu", "mla_attention_reference"]

def _pack_inputs(q_latent, q_rope, latent_new, rope_new, mask, tun: MlaMgpuTuning):
    """Rows node * H + head padded to whole tiles; in-flight entries padded to whole tiles; the mask
    as a float32 bias over packed rows [B, Rq, Tn] (0 seen, MASK_VALUE not)."""
    b, t, h, c = q_latent.shape
    rq, tn = tun.row_tiles * WG_ROWS, tun.new_tiles * tun.tile_k

    def rows(x):
        return jnp.pad(x.reshape(b, t * h, x.shape[-1]), ((0, 0), (0, rq - t * h), (0, 0)))

    def entries(x):
        return jnp.pad(x, ((0, 0), (0, tn - t), (0, 0)))

    seen = jnp.pad(jnp.repeat(mask.astype(bool), h, axis=1), ((0, 0), (0, rq - t * h), (0, tn - t)))
    bias = jnp.where(seen, 0.0, MASK_VALUE).astype(jnp.float32)
    return rows(q_latent), rows(q_rope), entries(latent_new), entries(rope_new), bias


def _mla_attention_kernel(
    len_ref,  # [B] int32
    ql_ref,  # [B, Rq, C]
    qr_ref,  # [B, Rq, R]
    c_ref,  # [B, S, C]
    kr_ref,  # [B, S, R]
    cn_ref,  # [B, Tn, C]
    krn_ref,  # [B, Tn, R]
    bias_ref,  # [B, Rq, Tn] float32
    *refs,
    tun: MlaMgpuTuning,
    window: int | None,
    scale_log2: float,
):
    """One program: score warpgroup (0), value warpgroup (1), memory warpgroup (2)."""
    n_out = 1 if tun.splits == 1 else 3
    out_refs, (ql_smem, qr_smem, slots, p_smem, stats, barriers) = refs[:n_out], refs[n_out:]
    q_bar, full, free, p_full, p_free = barriers
    (c_smem, kr_smem), staging = slots
    bk, stages, splits = tun.tile_k, tun.stages, tun.splits
    s_len, latent = c_ref.shape[1], c_ref.shape[2]
    half = latent // 2
    dtype = ql_ref.dtype

    row_tile, bi, split = lax.axis_index("rows"), lax.axis_index("b"), lax.axis_index("split")
    wg = lax.axis_index("wg")
    row0 = row_tile * WG_ROWS

    hi = jnp.minimum(len_ref[bi], s_len)
    lo = jnp.maximum(hi - window, 0) if window is not None else jnp.int32(0)
    tile_lo = lo // bk
    num_tiles = jnp.maximum((hi + bk - 1) // bk - tile_lo, 0)
    per_split = (num_tiles + splits - 1) // splits
    first = jnp.minimum(split * per_split, num_tiles)
    last = jnp.minimum(first + per_split, num_tiles)
    n_cache = last - first
    n_new = jnp.where(split == splits - 1, tun.new_tiles, 0) if splits > 1 else jnp.int32(tun.new_tiles)
    n_steps = n_cache + n_new

    def cache_start(j):
        blk = tile_lo + first + j
        return jnp.minimum(blk * bk, s_len - bk), blk

    @pl.when(wg == 2)
    def _memory_warpgroup():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        def issue(j, c_src, kr_src):
            slot = lax.rem(j, stages)

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])

            plgpu.copy_gmem_to_smem(c_src, c_smem.at[slot], full.at[slot])
            plgpu.copy_gmem_to_smem(kr_src, kr_smem.at[slot], full.at[slot])

        @pl.loop(0, n_cache)
        def _cache(j):
            entries = pl.ds(cache_start(j)[0], bk)
            issue(j, c_ref.at[bi, entries], kr_ref.at[bi, entries])

        @pl.loop(0, n_new)
        def _new(i):
            entries = pl.ds(i * bk, bk)
            issue(n_cache + i, cn_ref.at[bi, entries], krn_ref.at[bi, entries])

        # Observe the consumption of the last slots too (see `tree_attention_mgpu`).
        @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
        def _drain(j):
            plgpu.barrier_wait(free.at[lax.rem(j, stages)])

    def zeros_acc():
        return plgpu.layout_cast(jnp.zeros((WG_ROWS, half), jnp.float32), plgpu.Layout.WGMMA)

    def accumulate(acc, p, slot, col0, p_regs):
        """acc [64, C/2] += P [64, bk] @ V[:, col0:col0 + C/2] (V = the slot's latents)."""
        v = c_smem.at[slot, :, pl.ds(col0, half)]
        if tun.mma_form == "registers":

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p if p_regs else p_smem, v)

            return pl.run_state(pv)(plgpu.ACC.init(acc))

        def pv_fresh(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v)
            return acc_ref[...]

        return acc + pl.run_scoped(pv_fresh, plgpu.ACC((WG_ROWS, half), jnp.float32))

    def write_out(acc, l, col0, stage):
        """This warpgroup's value columns of the normalised output (one split)."""
        (o_ref,) = out_refs
        out = acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])
        stage[...] = out.astype(dtype)
        plgpu.commit_smem()
        out_rows = min(WG_ROWS, tun.out_rows)
        src = stage if out_rows == WG_ROWS else stage.at[pl.ds(0, out_rows)]
        plgpu.copy_smem_to_gmem(src, o_ref.at[bi, pl.ds(row0, out_rows), pl.ds(col0, half)])

    def write_partial(acc, col0, stage):
        """This warpgroup's float32 partial accumulator (several splits)."""
        acc_ref = out_refs[0]
        stage[...] = acc
        plgpu.commit_smem()
        out_rows = min(WG_ROWS, tun.out_rows)
        src = stage if out_rows == WG_ROWS else stage.at[pl.ds(0, out_rows)]
        plgpu.copy_smem_to_gmem(src, acc_ref.at[split, bi, pl.ds(row0, out_rows), pl.ds(col0, half)])

    @pl.when(wg == 0)
    def _score_warpgroup():
        plgpu.set_max_registers(compute_registers(2), action="increase")
        rows = pl.ds(row0, WG_ROWS)
        plgpu.copy_gmem_to_smem(ql_ref.at[bi, rows], ql_smem, q_bar)
        plgpu.copy_gmem_to_smem(qr_ref.at[bi, rows], qr_smem, q_bar)
        plgpu.barrier_wait(q_bar)

        def step(j, carry, kind):
            acc, m, l = carry
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(full.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, ql_smem, c_smem.at[slot].T)
                plgpu.wgmma(acc_ref, qr_smem, kr_smem.at[slot].T)
                return acc_ref[...]

            t = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, bk), jnp.float32)) * scale_log2
            if kind == "masked":
                start, blk = cache_start(j)
                pos = start + plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, bk), 1, layout=plgpu.Layout.WGMMA)
                t = jnp.where((pos >= jnp.maximum(lo, blk * bk)) & (pos < hi), t, MASK_VALUE)
            elif kind == "new":
                tile = bias_ref.at[bi, rows, pl.ds((j - n_cache) * bk, bk)]
                t = t + plgpu.load(tile, layout=plgpu.Layout.WGMMA, optimized=False)
            m_new = jnp.maximum(m, t.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(t - lax.broadcast_in_dim(m_new, t.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(dtype)

            @pl.when(j > 0)
            def _():
                plgpu.barrier_wait(p_free)  # the value warpgroup is done with the last P and alpha

            p_smem[...] = p16
            stats.at[0][...] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_full)
            acc = accumulate(acc, p16, slot, 0, p_regs=True)
            plgpu.barrier_arrive(free.at[slot])
            return acc, m_new, l

        carry = (
            zeros_acc(),
            plgpu.layout_cast(jnp.full((WG_ROWS,), M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        )
        pro = ((lo % bk != 0) & (first == 0) & (n_cache > 0)).astype(jnp.int32)
        epi = ((hi % bk != 0) & (last == num_tiles) & (n_cache - pro > 0)).astype(jnp.int32)
        carry = lax.fori_loop(0, pro, functools.partial(step, kind="masked"), carry)
        carry = lax.fori_loop(pro, n_cache - epi, functools.partial(step, kind="full"), carry)
        carry = lax.fori_loop(n_cache - epi, n_cache, functools.partial(step, kind="masked"), carry)
        carry = lax.fori_loop(n_cache, n_steps, functools.partial(step, kind="new"), carry)
        acc, m, l = carry

        # The row statistics for the value warpgroup (and the partial outputs): one more P phase.
        @pl.when(n_steps > 0)
        def _():
            plgpu.barrier_wait(p_free)

        stats.at[0][...] = m
        stats.at[1][...] = l
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_full)
        if splits == 1:
            write_out(acc, l, 0, staging[0])
        else:
            _, m_ref, l_ref = out_refs
            write_partial(acc, 0, staging[0])
            out_rows = min(WG_ROWS, tun.out_rows)
            dst = pl.ds(row0, out_rows)
            plgpu.copy_smem_to_gmem(stats.at[0, pl.ds(0, out_rows)], m_ref.at[split, bi, dst])
            plgpu.copy_smem_to_gmem(stats.at[1, pl.ds(0, out_rows)], l_ref.at[split, bi, dst])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _value_warpgroup():
        plgpu.set_max_registers(compute_registers(2), action="increase")

        def step(j, acc):
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(full.at[slot])
            plgpu.barrier_wait(p_full)
            alpha = plgpu.load(stats.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            acc = accumulate(acc, None, slot, half, p_regs=False)
            plgpu.barrier_arrive(p_free)
            plgpu.barrier_arrive(free.at[slot])
            return acc

        acc = lax.fori_loop(0, n_steps, step, zeros_acc())
        plgpu.barrier_wait(p_full)
        l = plgpu.load(stats.at[1], layout=plgpu.Layout.WGMMA.reduce(1))
        if splits == 1:
            write_out(acc, l, half, staging[1])
        else:
            write_partial(acc, half, staging[1])
        plgpu.wait_smem_to_gmem(0)


def _scratch(tun: MlaMgpuTuning, latent: int, rope: int, dtype) -> list:
    """Shared memory and barriers of one program (order: `_mla_attention_kernel`'s refs)."""
    bk = tun.tile_k
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    cache = (
        plgpu.SMEM((tun.stages, bk, latent), dtype, transforms=tiled),
        plgpu.SMEM((tun.stages, bk, rope), dtype, transforms=tiled),
    )
    # Output staging (one tile per compute warpgroup) aliases the slots: each warpgroup writes it
    # only once the other is past its last P V (the final P phase), and no copy is left in flight.
    if tun.splits > 1:
        staging_type = (jnp.float32, (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)))
    else:
        staging_type = (dtype, tiled)
    staging = tuple(
        plgpu.SMEM((WG_ROWS, latent // 2), staging_type[0], transforms=staging_type[1]) for _ in range(2)
    )
    slots = plgpu.RefUnion(cache, staging)
    barriers = (
        plgpu.Barrier(num_arrivals=2),  # queries: latent and rope copies
        plgpu.Barrier(num_arrivals=2, num_barriers=tun.stages),  # slot full: latent and rope copies
        plgpu.Barrier(num_arrivals=2, num_barriers=tun.stages),  # slot free: both compute warpgroups
        plgpu.Barrier(),  # P and alpha published (score warpgroup)
        plgpu.Barrier(),  # P and alpha consumed (value warpgroup)
    )
    return [
        plgpu.SMEM((WG_ROWS, latent), dtype, transforms=tiled),
        plgpu.SMEM((WG_ROWS, rope), dtype, transforms=tiled),
        slots,
        plgpu.SMEM((WG_ROWS, bk), dtype, transforms=tiled),
        plgpu.SMEM((2, WG_ROWS), jnp.float32),  # alpha per step; max and sum at the end
        barriers,
    ]


@functools.partial(
    jax.jit,
    static_argnames=(
        "softmax_scale", "window", "interpret", "tile_k", "stages", "splits", "mma_form", "num_sms",
    ),
)  # fmt: skip
def mla_attention_mgpu(
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
    interpret: bool | plgpu.InterpretGPUParams = False,
    tile_k: int | None = None,
    stages: int | None = None,
    splits: int | None = None,
    mma_form: str | None = None,
    num_sms: int = NUM_SMS_H200,
) -> jax.Array:
    """Mosaic GPU absorbed MLA attention; same contract as `mla_attention_reference` (16-bit inputs).

    Tuning (static; None = `resolve_mla_mgpu_tuning`'s default). `interpret` (True or the interpreter's
    parameters) runs jax's GPU interpreter on the CPU (the "smem" mma form).
    """
    _check_shapes(q_latent, q_rope, latent_cache, rope_cache, latent_new, rope_new, mask)
    b, t, h, c = q_latent.shape
    s, r = latent_cache.shape[1], rope_cache.shape[-1]
    dtypes = {x.dtype for x in (q_latent, q_rope, latent_cache, rope_cache, latent_new, rope_new)}
    if len(dtypes) != 1 or q_latent.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"queries, caches and new entries must share a 16-bit dtype, got {dtypes}")
    if interpret:
        mma_form = "smem"
    tun = resolve_mla_mgpu_tuning(
        q_latent.shape, s, r, tile_k=tile_k, stages=stages, splits=splits, mma_form=mma_form,
        num_sms=num_sms,
    )  # fmt: skip
    ql, qr, cn, krn, bias = _pack_inputs(q_latent, q_rope, latent_new, rope_new, mask, tun)
    if tun.splits == 1:
        out_type = jax.ShapeDtypeStruct((b, tun.out_rows, c), q_latent.dtype)
    else:
        part = (tun.splits, b, tun.out_rows)
        out_type = (
            jax.ShapeDtypeStruct((*part, c), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        )
    kernel = functools.partial(
        _mla_attention_kernel, tun=tun, window=window, scale_log2=softmax_scale * LOG2E
    )
    out = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(tun.row_tiles, b, tun.splits),
        grid_names=("rows", "b", "split"),
        num_threads=3,
        thread_name="wg",
        scratch_types=_scratch(tun, c, r, q_latent.dtype),
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=interpret_params(interpret),
        kernel_name="mla_attention_mgpu",
    )(lengths.astype(jnp.int32), ql, qr, latent_cache, rope_cache, cn, krn, bias)
    if tun.splits > 1:
        out = combine_splits(*out)
    return out[:, : t * h].reshape(b, t, h, c).astype(q_latent.dtype)
