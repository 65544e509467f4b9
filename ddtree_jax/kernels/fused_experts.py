"""The routed experts of a few tokens (decode and verify) in two Pallas kernels on Mosaic GPU (Hopper).

Contract of `fused_experts` and of its reference `fused_experts_reference` (same signature):
x [N, H] (bf16 or f16), experts [N, k] int32 local expert ids, here [N, k] bool (the slot's expert is
held on this device), weights [N, k] routing weights, gate / up [E, H, I] and down [E, I, H], each an
`ExpertWeight`: plain arrays in one of three formats, "plain" (x's dtype), "fp8" (e4m3 with float32
scales of 128 x 128 blocks) or "int4" (int32 words, bf16 scales of groups of 32); quant.arrays'
`expert_weight` makes one from the package's stored weights -> [N, H] in x's dtype: per token, the
routing-weighted sum over its held slots of down(silu(x gate) * (x up)). Under shard_map the shapes
are the local ones.

Layout. The (token, slot) pairs are grouped by expert into tiles of `tile_t` rows (a tile never spans
two experts; at most min(E, N k) + N k // tile_t tiles, the rest empty: `schedule`); an XLA gather
puts each tile's token rows into x_rows [tiles * tile_t, H], zero rows padding a tile. Two launches:
  gate_up  grid (tiles, I / 64): program (t, c) streams the 64 columns c of its expert's gate and up
           over H and writes act[tile t rows, c] = silu(x g) * (x u) in x's dtype
  down     grid (tiles, H / 64): streams the 64 columns c of down over I -> y^T[c, tile t rows] (float32;
           Mosaic GPU stores 32-bit tiles only in the accumulator's orientation)
then the combine (XLA): out[n] = sum over held slots s of weights[n, s] * y[row(n, s)]. A program of an
empty tile exits at once, so only the chosen experts are read, each 64-column slice once per tile.

A program: one warpgroup; the expert's 64 columns are the wgmma M operand (read from shared memory
transposed), the tile's tokens its N (tile_t, a multiple of 8), a float32 accumulator [64, tile_t].
Each K step's boxes arrive by TMA into `stages` buffers, one barrier per buffer. bf16 / f16 weights
feed wgmma as they arrive; FP8 and INT4 are dequantised in registers into a shared-memory tile first:
  FP8   steps of 128 rows; one float32 scale per 128 x 128 block, i.e. one scalar per (step, program).
  INT4  steps of 512 rows = 64 int32 word rows. Word row r holds rows 8r..8r+7 (nibble b = row 8r + b),
        all of group r // 4. Four TMA boxes of 16 word rows (word rows 4g + i, g < 16, read through
        the free view [E, K/32, 4 I] of the words at column offset i I) stack in (i, g) order into
        [64, 64], and the scale box [16, 64] is copied four times beside them, so scales line up row
        for row; nibble b of the stack becomes tile rows b 64 + i 16 + g = row 32 g + 8 i + b of the
        step. The same permutation is applied to the columns of x (and act) in XLA
        (`int4_permutation`); K past the words (e.g. I = 768) reads zeros (TMA's out-of-bounds fill).
Mosaic GPU's TMA wants every tiled global dim a multiple of its 64-element tile: `supported` says
which weights qualify (e.g. not Qwen3-30B-A3B's 768 / 8 = 96 columns per device under tp 8).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

TILE_N = 64  # output columns per program: the M of one warpgroup's wgmma
INT4_STEP = 512  # K rows per INT4 step: 64 word rows, stacked from 4 boxes
INT4_BOX = 16  # word rows per INT4 box (16 groups of 32 rows)
SMEM_BYTES = 200 * 1024  # of the H100 / H200's 227 KiB per program (CTA), leaving room for Mosaic's own
MAX_STAGES = 4
FORMATS = ("plain", "fp8", "int4")


class Schedule(NamedTuple):
    """Where the (token, slot) pairs go: tiles of `tile_t` rows, one expert each."""

    tile_expert: jax.Array  # [tiles] int32: the local expert of each tile, -1 for an empty tile
    row: jax.Array  # [N, k] int32: each slot's row in the tile layout (meaningless where not held)
    source: jax.Array  # [tiles * tile_t] int32: the token of each row, -1 for a padding row


def max_tiles(pairs: int, num_experts: int, tile_t: int) -> int:
    """Tiles enough for any routing of `pairs` pairs: one partial tile per expert present, plus full ones."""
    return max(1, min(num_experts, pairs) + pairs // tile_t)


def schedule(experts: jax.Array, here: jax.Array, num_experts: int, tile_t: int) -> Schedule:
    """The tile layout of experts [N, k] (held slots only), built on the device; pairs keep token order
    within an expert."""
    n, k = experts.shape
    pairs = n * k
    key = jnp.where(here, experts, num_experts).reshape(-1)  # absent slots sort past every expert
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts]
    tiles = (sizes + tile_t - 1) // tile_t
    tile_end = jnp.cumsum(tiles)
    tile_first = tile_end - tiles
    t = jnp.arange(max_tiles(pairs, num_experts, tile_t), dtype=jnp.int32)
    owner = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)
    tile_expert = jnp.where(owner < num_experts, owner, -1)
    held = key < num_experts
    e = jnp.minimum(key, num_experts - 1)
    position = jnp.zeros((pairs,), jnp.int32).at[order].set(jnp.arange(pairs, dtype=jnp.int32))
    rank = position - (jnp.cumsum(sizes) - sizes)[e]  # the pair's place among its expert's pairs
    row = (tile_first[e] + rank // tile_t) * tile_t + rank % tile_t
    num_rows = t.shape[0] * tile_t
    token = jnp.arange(pairs, dtype=jnp.int32) // k
    source = jnp.full((num_rows,), -1, jnp.int32).at[jnp.where(held, row, num_rows)].set(token, mode="drop")
    return Schedule(tile_expert, row.astype(jnp.int32).reshape(n, k), source)


def default_tile_t(pairs: int, num_experts: int) -> int:
    """Rows per tile: the power of two in [8, 64] at or above the mean pairs per chosen expert."""
    mean = -(-pairs // max(1, min(num_experts, pairs)))
    tile = 8
    while tile < min(mean, 64):
        tile *= 2
    return tile


# ---- the weights as the kernel reads them ---------------------------------------------------------


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["w", "scale"],
    meta_fields=["fmt", "block", "group", "width"],
)
@dataclasses.dataclass(frozen=True)
class ExpertWeight:
    """One stacked expert weight [E, K, N] as plain arrays and its format's constants (the kernel's
    input; `quant.arrays.expert_weight` builds it from an Fp8Weight, an Int4Weight or a plain array)."""

    fmt: str  # one of FORMATS
    # plain: [E, K, N] in x's dtype; fp8: float8_e4m3fn [E, K_pad, N_pad] (zero-padded to whole blocks);
    # int4: int32 words [E, K / 8, N], nibble b (bits 4b..4b+3) of word row r = row 8r + b, stored + 8
    w: jax.Array
    scale: jax.Array | None = None  # fp8: float32 [E, K_pad / bi, N_pad / bo]; int4: [E, K / group, N]
    block: tuple[int, int] = (1, 1)  # fp8: the scale block (rows bi, columns bo)
    group: int = 1  # int4: rows per scale
    width: int = 0  # fp8: the logical N before the block padding; 0: N as stored


@dataclasses.dataclass(frozen=True)
class Operand:
    """One stacked expert weight [E, K, N] as the kernel streams it."""

    fmt: str  # "plain", "fp8" or "int4"
    arrays: tuple  # plain: (w [E, K, N]); fp8: (w, scale); int4: (words view [E, K/32, 4 N], scale)
    k: int  # rows as stored (fp8: padded to blocks; int4: 8 per word)
    n: int  # columns as stored
    step_k: int  # K rows per pipeline step
    block: tuple[int, int] = (1, 1)  # fp8 scale block (rows, columns)
    scale_dtype: jnp.dtype = jnp.float32

    @property
    def steps(self) -> int:
        return -(-self.k // self.step_k)

    @property
    def k_padded(self) -> int:
        """Columns the kernel's x rows must have (zeros past k)."""
        return self.steps * self.step_k


def why_not(w: ExpertWeight, dtype: jnp.dtype) -> str | None:
    """Why the kernel cannot stream expert weight w [E, K, N] against activations of `dtype` (local
    shapes), or None when it can."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"activations must be bfloat16 or float16 for wgmma, not {jnp.dtype(dtype)}"
    if w.fmt not in FORMATS:
        return f"expert weight format {w.fmt!r} not one of {FORMATS}"
    if w.fmt == "int4":
        if w.w.dtype != jnp.int32 or w.group != 32:
            return "INT4 weights must be int32 words with groups of 32"
        k, n = w.w.shape[-2] * 8, w.w.shape[-1]
    elif w.fmt == "fp8":
        bi, bo = w.block
        if bi % 128 or bo % TILE_N:
            return f"FP8 blocks {w.block} must nest 128-row steps and {TILE_N}-column programs"
        k, n = w.w.shape[-2:]
    else:
        if w.w.dtype != dtype:
            want = jnp.dtype(dtype)
            return f"plain expert weights must have the activations' dtype {want}, not {w.w.dtype}"
        k, n = w.w.shape[-2:]
    if k % TILE_N or n % TILE_N:
        return f"expert weight rows {k} and columns {n} must be multiples of {TILE_N} (TMA tiles)"
    return None


def supported(gate: ExpertWeight, up: ExpertWeight, down: ExpertWeight, dtype: jnp.dtype) -> bool:
    """Whether the kernel takes these experts (same format for all three) and activations."""
    same = gate.fmt == up.fmt == down.fmt
    return same and all(why_not(w, dtype) is None for w in (gate, up, down))


def operand(w: ExpertWeight, dtype: jnp.dtype) -> Operand:
    """The kernel's view of expert weight w [E, K, N] (no copy: the INT4 view is a reshape)."""
    reason = why_not(w, dtype)
    if reason is not None:
        raise ValueError(f"fused experts kernel: {reason}")
    if w.fmt == "int4":
        e, kw, n = w.w.shape
        view = w.w.reshape(e, kw // 4, 4 * n)
        return Operand("int4", (view, w.scale), kw * 8, n, INT4_STEP, scale_dtype=w.scale.dtype)
    k, n = w.w.shape[-2:]
    if w.fmt == "fp8":
        return Operand("fp8", (w.w, w.scale), k, n, 128, w.block)
    return Operand("plain", (w.w,), k, n, 128 if k % 128 == 0 else TILE_N)


def int4_permutation(columns: int) -> np.ndarray:
    """For each column of the kernel's INT4 step order, the column of x it holds ([columns rounded up
    to INT4_STEP]; indices past `columns` mean zero): step column b 64 + i 16 + g holds row 32 g + 8 i + b
    of its step (module docstring)."""
    c = np.arange(INT4_STEP)
    within = 32 * (c % INT4_BOX) + 8 * ((c // INT4_BOX) % 4) + c // 64
    steps = -(-columns // INT4_STEP)
    return (np.arange(steps)[:, None] * INT4_STEP + within[None]).reshape(-1)


def kernel_columns(a: jax.Array, op: Operand) -> jax.Array:
    """a [R, K] -> the kernel's x [R, op.k_padded]: zero-padded, and permuted for INT4."""
    pad = op.k_padded - a.shape[1]
    if op.fmt != "int4":
        return jnp.pad(a, ((0, 0), (0, pad))) if pad else a
    perm = int4_permutation(a.shape[1])
    padded = jnp.pad(a, ((0, 0), (0, perm.shape[0] - a.shape[1])))
    return padded[:, perm]


# ---- the kernel ------------------------------------------------------------------------------------


def _buffers(op: Operand, stages: int, dtype) -> list:
    """Shared-memory buffers of one weight's boxes, `stages` deep."""
    if op.fmt == "int4":
        rows = 4 * INT4_BOX
        return [
            plgpu.SMEM((stages, rows, TILE_N), jnp.int32),
            plgpu.SMEM((stages, rows, TILE_N), op.scale_dtype),
        ]
    return [plgpu.SMEM((stages, op.step_k, TILE_N), op.arrays[0].dtype)]


def _copies(op: Operand) -> int:
    return 8 if op.fmt == "int4" else 1


def _stage_bytes(ops: tuple[Operand, ...], tile_t: int, dtype) -> int:
    step_k = ops[0].step_k
    total = tile_t * step_k * jnp.dtype(dtype).itemsize
    for op in ops:
        if op.fmt == "int4":
            total += 4 * INT4_BOX * TILE_N * (4 + jnp.dtype(op.scale_dtype).itemsize)
        else:
            total += op.step_k * TILE_N * op.arrays[0].dtype.itemsize
    return total


def choose_stages(ops: tuple[Operand, ...], tile_t: int, dtype) -> int:
    """Pipeline depth that fits shared memory beside the dequantised tile and the output tile."""
    fixed = tile_t * TILE_N * 4
    if ops[0].fmt != "plain":
        fixed += ops[0].step_k * TILE_N * jnp.dtype(dtype).itemsize
    fit = (SMEM_BYTES - fixed) // _stage_bytes(ops, tile_t, dtype)
    return int(max(1, min(MAX_STAGES, ops[0].steps, fit)))


def _issue(op: Operand, refs: tuple, bufs: list, e, c, step, slot, barrier) -> None:
    """Start the TMA copies of one weight's boxes for K step `step` into buffer `slot`."""
    if op.fmt == "int4":
        words, scale = refs
        rows = pl.ds(step * INT4_BOX, INT4_BOX)
        for i in range(4):
            stacked = pl.ds(i * INT4_BOX, INT4_BOX)
            cols = pl.ds(i * op.n + c * TILE_N, TILE_N)
            plgpu.copy_gmem_to_smem(words.at[e, rows, cols], bufs[0].at[slot, stacked], barrier)
            plgpu.copy_gmem_to_smem(
                scale.at[e, rows, pl.ds(c * TILE_N, TILE_N)], bufs[1].at[slot, stacked], barrier
            )
        return
    box = refs[0].at[e, pl.ds(step * op.step_k, op.step_k), pl.ds(c * TILE_N, TILE_N)]
    plgpu.copy_gmem_to_smem(box, bufs[0].at[slot], barrier)


def _weight_tile(op: Operand, refs: tuple, bufs: list, deq, e, c, step, slot, dtype):
    """The bf16 / f16 shared-memory tile [step_k, 64] of one weight at K step `step` (dequantised into
    `deq` for FP8 and INT4)."""
    if op.fmt == "plain":
        return bufs[0].at[slot]
    if op.fmt == "fp8":
        bi, bo = op.block
        scale = refs[1][e, (step * op.step_k) // bi, (c * TILE_N) // bo]
        deq[...] = (bufs[0][slot].astype(jnp.float32) * scale).astype(dtype)
    else:
        words = plgpu.load(bufs[0].at[slot], layout=plgpu.Layout.WGMMA, optimized=False)
        scale = plgpu.load(bufs[1].at[slot], layout=plgpu.Layout.WGMMA, optimized=False).astype(jnp.float32)
        rows = 4 * INT4_BOX
        for b in range(8):
            q = ((words >> (4 * b)) & 0xF) - 8
            value = (q.astype(jnp.float32) * scale).astype(op.scale_dtype).astype(dtype)
            deq[pl.ds(b * rows, rows), :] = value
    plgpu.commit_smem()
    return deq


def _program(tile_ref, x_ref, *refs, ops, tile_t, stages, dtype, out_dtype):
    """One (tile, 64 output columns) program: stream K, multiply, write the tile's rows of the output."""
    out_ref = refs[-1]
    sizes = [len(op.arrays) for op in ops]
    weight_refs = [tuple(refs[sum(sizes[:i]) : sum(sizes[: i + 1])]) for i in range(len(ops))]
    t, c = lax.axis_index("tile"), lax.axis_index("col")
    e = tile_ref[t]
    steps, step_k = ops[0].steps, ops[0].step_k
    copies = 1 + sum(_copies(op) for op in ops)
    scratch = [plgpu.SMEM((stages, tile_t, step_k), dtype)]
    for op in ops:
        scratch += _buffers(op, stages, dtype)
    rows_first = jnp.dtype(out_dtype).itemsize == 2  # else [N, rows]: Mosaic stores 32-bit tiles unturned
    out_tile = (tile_t, TILE_N) if rows_first else (TILE_N, tile_t)
    scratch += [plgpu.SMEM((step_k, TILE_N), dtype), plgpu.SMEM(out_tile, out_dtype)]
    scratch.append(plgpu.Barrier(num_arrivals=copies, num_barriers=stages))

    def issue(step, slot, xs, bufs, barrier):
        rows = pl.ds(t * tile_t, tile_t)
        plgpu.copy_gmem_to_smem(x_ref.at[rows, pl.ds(step * step_k, step_k)], xs.at[slot], barrier.at[slot])
        for op, r, b in zip(ops, weight_refs, bufs, strict=True):
            _issue(op, r, b, e, c, step, slot, barrier.at[slot])

    def in_smem(xs, *rest):
        barrier, o_smem, deq = rest[-1], rest[-2], rest[-3]
        flat = rest[:-3]
        bufs, at = [], 0
        for op in ops:
            n = len(_buffers(op, stages, dtype))
            bufs.append(list(flat[at : at + n]))
            at += n

        # allocated in every program, used in those of a tile: the GPU interpreter's bookkeeping of
        # shared memory needs every device to allocate alike (expert parallelism diverges here)
        @pl.when(e >= 0)
        def _():
            run(xs, bufs, deq, o_smem, barrier)

    def run(xs, bufs, deq, o_smem, barrier):
        # a traced step: INT4 boxes may reach past K (TMA fills zeros), which a static start would refuse
        lax.fori_loop(0, min(stages, steps), lambda s, _: issue(s, s, xs, bufs, barrier), None)

        def accumulate(acc):
            # one accumulator, a 64-row slice per weight: the GPU interpreter keeps one register
            # allocation per program apart from other devices' (two raced under shard_map)
            accs = [acc.at[pl.ds(i * TILE_N, TILE_N)] for i in range(len(ops))]

            def step(s, carry):
                slot = lax.rem(s, stages)
                plgpu.barrier_wait(barrier.at[slot])
                tokens = xs.at[slot].T  # [step_k, tile_t]
                for op, r, b, acc in zip(ops, weight_refs, bufs, accs, strict=True):
                    tile = _weight_tile(op, r, b, deq, e, c, s, slot, dtype)
                    plgpu.wgmma(acc, tile.T, tokens)
                    plgpu.wgmma_wait(0)

                @pl.when(s + stages < steps)
                def _():
                    issue(s + stages, slot, xs, bufs, barrier)

                return carry

            lax.fori_loop(0, steps, step, None)
            out = acc[...]
            if len(accs) == 2:  # gate, up -> silu(gate) * up
                g = lax.slice(out, (0, 0), (TILE_N, tile_t))
                u = lax.slice(out, (TILE_N, 0), (2 * TILE_N, tile_t))
                return g / (1.0 + jnp.exp(-g)) * u
            return out

        out = pl.run_scoped(accumulate, plgpu.ACC((len(ops) * TILE_N, tile_t), jnp.float32))
        rows, cols = pl.ds(t * tile_t, tile_t), pl.ds(c * TILE_N, TILE_N)
        if rows_first:
            o_smem.T[...] = out.astype(out_dtype)
            dst = out_ref.at[rows, cols]
        else:
            o_smem[...] = out.astype(out_dtype)
            dst = out_ref.at[cols, rows]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, dst)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(in_smem, *scratch)


def expert_matmul(
    x_rows: jax.Array,
    tile_expert: jax.Array,
    ops: tuple[Operand, ...],
    *,
    tile_t: int,
    out_dtype,
    interpret: bool = False,
) -> jax.Array:
    """x_rows [tiles * tile_t, K padded] (kernel column order) times each tile's expert of every
    weight in `ops` (one, or gate and up: then silu(x g) * (x u)) -> [tiles * tile_t, N] in out_dtype
    of 16 bits, or its transpose [N, tiles * tile_t] in float32."""
    num_rows, width = x_rows.shape
    n = ops[0].n
    if any(op.n != n or op.k != ops[0].k or op.fmt != ops[0].fmt for op in ops):
        raise ValueError("fused experts kernel: gate and up must have one shape and format")
    if width != ops[0].k_padded or num_rows % tile_t or tile_t % 8:
        raise ValueError(f"x rows {x_rows.shape} do not fit K {ops[0].k_padded} / tile_t {tile_t}")
    dtype = x_rows.dtype
    stages = choose_stages(ops, tile_t, dtype)
    body = functools.partial(
        _program, ops=ops, tile_t=tile_t, stages=stages, dtype=dtype, out_dtype=jnp.dtype(out_dtype)
    )
    call = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(
            (num_rows, n) if jnp.dtype(out_dtype).itemsize == 2 else (n, num_rows), out_dtype
        ),
        grid=(num_rows // tile_t, n // TILE_N),
        grid_names=("tile", "col"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )
    arrays = [a for op in ops for a in op.arrays]
    return call(tile_expert, x_rows, *arrays)


def combine(y_t: jax.Array, row: jax.Array, here: jax.Array, weights: jax.Array) -> jax.Array:
    """y_t [H, rows] per pair (float32, transposed) -> [N, H]: each token's held slots weighted and summed."""
    picked = y_t[:, row.reshape(-1)].reshape(y_t.shape[0], *row.shape)  # [H, N, k]
    w = jnp.where(here, weights.astype(jnp.float32), 0.0)
    return jnp.einsum("hnk,nk->nh", jnp.where(here[None], picked, 0.0), w)


# jitted: a forward's layers share one trace and one lowering of it (Mosaic's layout inference runs
# once, not once per layer: ~1 s a layer on the CPU otherwise)
@functools.partial(jax.jit, static_argnames=("tile_t", "interpret"))
def fused_experts(
    x: jax.Array,
    experts: jax.Array,
    here: jax.Array,
    weights: jax.Array,
    gate: ExpertWeight,
    up: ExpertWeight,
    down: ExpertWeight,
    *,
    tile_t: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The routed experts' weighted mix for x [N, H] (module docstring) through the two kernels."""
    n, k = experts.shape
    g, u, d = (operand(w, x.dtype) for w in (gate, up, down))
    num_local = g.arrays[0].shape[0]
    tile_t = tile_t or default_tile_t(n * k, num_local)
    plan = schedule(experts, here, num_local, tile_t)
    rows = jnp.where((plan.source >= 0)[:, None], x[jnp.maximum(plan.source, 0)], jnp.zeros((), x.dtype))
    act = expert_matmul(
        kernel_columns(rows, g),
        plan.tile_expert,
        (g, u),
        tile_t=tile_t,
        out_dtype=x.dtype,
        interpret=interpret,
    )
    y_t = expert_matmul(
        kernel_columns(act, d),
        plan.tile_expert,
        (d,),
        tile_t=tile_t,
        out_dtype=jnp.float32,
        interpret=interpret,
    )
    out = combine(y_t, plan.row, here, weights)
    width = down.width or out.shape[1]  # fp8: drop the block padding
    return out[:, :width].astype(x.dtype)


def fused_experts_reference(
    x: jax.Array,
    experts: jax.Array,
    here: jax.Array,
    weights: jax.Array,
    gate: ExpertWeight,
    up: ExpertWeight,
    down: ExpertWeight,
    *,
    tile_t: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`fused_experts` in jnp: each slot gathers its expert's dequantised matrices."""
    del tile_t, interpret
    act = jax.nn.silu(_slot_matmul(x, gate, experts)) * _slot_matmul(x, up, experts)  # [N, k, I]
    out = _slot_matmul(act, down, experts)  # [N, k, H]
    weighted = jnp.where(here[..., None], out * weights[..., None], jnp.zeros((), out.dtype))
    return jnp.sum(weighted, axis=1)


def _dequantized(w: ExpertWeight, dtype: jnp.dtype) -> jax.Array:
    """The stored [..., K (fp8: padded), N] weight's values in `dtype` as its format defines them: fp8
    value x block scale, int4 (nibble - 8) x group scale rounded to the scale's dtype (float32 math)."""
    if w.fmt == "fp8":
        (bi, bo), (kp, n_pad), lead = w.block, w.w.shape[-2:], w.w.shape[:-2]
        blocked = w.w.astype(jnp.float32).reshape(*lead, kp // bi, bi, n_pad // bo, bo)
        return (blocked * w.scale[..., :, None, :, None]).reshape(w.w.shape).astype(dtype)
    if w.fmt == "int4":
        shifts = jnp.arange(8, dtype=jnp.uint32)[:, None] * 4
        nibbles = (w.w[..., :, None, :].view(jnp.uint32) >> shifts) & 0xF  # [..., K/8, 8, N]
        q = nibbles.astype(jnp.float32).reshape(*w.w.shape[:-2], -1, w.group, w.w.shape[-1]) - 8
        values = q * w.scale.astype(jnp.float32)[..., :, None, :]
        return values.reshape(*w.w.shape[:-2], -1, w.w.shape[-1]).astype(w.scale.dtype).astype(dtype)
    return w.w.astype(dtype)


def _slot_matmul(x: jax.Array, w: ExpertWeight, experts: jax.Array) -> jax.Array:
    """x [N, K'] (shared by the slots) or [N, k, K'] (one row per slot), K' <= K, times each slot's expert
    of w [E, K, N_w] -> [N, k, N] (fp8: the logical N, the block padding dropped)."""
    chosen = jax.tree.map(lambda a: a[experts], w)  # [N, k, ...] of the stored form
    full = _dequantized(chosen, x.dtype)  # [N, k, K, N_w]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, full.shape[-2] - x.shape[-1])])
    out = jnp.einsum("ni,nkio->nko" if x.ndim == 2 else "nki,nkio->nko", x, full)
    return out[..., : w.width or None]
