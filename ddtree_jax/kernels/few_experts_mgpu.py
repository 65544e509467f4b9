"""`few_experts` on Mosaic GPU (Hopper): the same contract and layout (kernels/few_experts.py: every
distinct chosen expert read once for all N tokens, K split over programs, float32 partials summed in
XLA), with the program of kernels/fused_experts.py: the expert's 64 columns are wgmma's M operand
(from shared memory, transposed), the tokens its N (N padded to a multiple of 8, `tile_t`), each K step's
boxes brought by TMA into `stages` buffers; FP8 and INT4 dequantised in registers into a shared tile
(fused_experts' `_weight_tile`, INT4 in its 512-row step order with x's columns permuted to match).

Grid (U slots, N_w / 64 column blocks, splits); program (u, c, s) streams K steps [s S, (s + 1) S) of
slot u's expert and writes its [64, tile_t] float32 partial per weight (transposed: Mosaic GPU stores
32-bit tiles in the accumulator's orientation) to out[s, u, w, 64 c : 64 (c + 1), :]. A slot past the
distinct experts (-1) runs nothing and leaves its partials unwritten; `few_experts_mgpu` zeroes them
(jnp.where on the slot) before the combine. At one token the wgmma's N is 8 (7 rows of zeros): the
tensor cores idle, what counts is that 384 programs stream the 8 experts at Qwen3-30B-A3B's shape.

Each call builds its kernel body afresh (functools.partial per call: jax#40847).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_jax.kernels import fused_experts as fe
from ddtree_jax.kernels.few_experts import distinct_experts, slot_weights
from ddtree_jax.kernels.tuning import default_few_splits

TILE_N = fe.TILE_N


def supported(gate: fe.ExpertWeight, up: fe.ExpertWeight, down: fe.ExpertWeight, dtype: jnp.dtype) -> bool:
    """Whether the kernel takes these experts and activations: the fused kernel's rules (64-multiple
    TMA tiles, bf16 / f16, FP8 blocks nesting 128 x 64, INT4 words with groups of 32)."""
    return fe.supported(gate, up, down, dtype)


def _program(slot_ref, x_ref, *refs, ops, tile_t, stages, steps, per_slot, dtype):
    """One (slot, 64 columns, K split) program: stream `steps` K steps, write the float32 partials."""
    out_ref = refs[-1]
    sizes = [len(op.arrays) for op in ops]
    weight_refs = [tuple(refs[sum(sizes[:i]) : sum(sizes[: i + 1])]) for i in range(len(ops))]
    u, c, s = lax.axis_index("slot"), lax.axis_index("col"), lax.axis_index("split")
    e = slot_ref[u]
    step_k = ops[0].step_k
    first = s * steps
    copies = 1 + sum(8 if op.fmt == "int4" else 1 for op in ops)
    scratch = [plgpu.SMEM((stages, tile_t, step_k), dtype)]
    for op in ops:
        scratch += fe._buffers(op, stages, dtype)
    scratch += [plgpu.SMEM((step_k, TILE_N), dtype), plgpu.SMEM((len(ops), TILE_N, tile_t), jnp.float32)]
    scratch.append(plgpu.Barrier(num_arrivals=copies, num_barriers=stages))

    def issue(step, slot, xs, bufs, barrier):
        rows = pl.ds(u * tile_t if per_slot else 0, tile_t)
        plgpu.copy_gmem_to_smem(x_ref.at[rows, pl.ds(step * step_k, step_k)], xs.at[slot], barrier.at[slot])
        for op, r, b in zip(ops, weight_refs, bufs, strict=True):
            fe._issue(op, r, b, e, c, step, slot, barrier.at[slot])

    def in_smem(xs, *rest):
        barrier, o_smem, deq = rest[-1], rest[-2], rest[-3]
        flat, bufs, at = rest[:-3], [], 0
        for op in ops:
            n = len(fe._buffers(op, stages, dtype))
            bufs.append(list(flat[at : at + n]))
            at += n

        @pl.when(e >= 0)  # scratch allocated by every program (the GPU interpreter's bookkeeping)
        def _():
            run(xs, bufs, deq, o_smem, barrier)

    def run(xs, bufs, deq, o_smem, barrier):
        lax.fori_loop(0, stages, lambda i, _: issue(first + i, i, xs, bufs, barrier), None)

        def accumulate(acc):
            accs = [acc.at[pl.ds(i * TILE_N, TILE_N)] for i in range(len(ops))]

            def step(i, carry):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(barrier.at[slot])
                tokens = xs.at[slot].T  # [step_k, tile_t]
                for op, r, b, a in zip(ops, weight_refs, bufs, accs, strict=True):
                    tile = fe._weight_tile(op, r, b, deq, e, c, first + i, slot, dtype)
                    plgpu.wgmma(a, tile.T, tokens)
                    plgpu.wgmma_wait(0)

                @pl.when(i + stages < steps)
                def _():
                    issue(first + i + stages, slot, xs, bufs, barrier)

                return carry

            lax.fori_loop(0, steps, step, None)
            return acc[...]

        out = pl.run_scoped(accumulate, plgpu.ACC((len(ops) * TILE_N, tile_t), jnp.float32))
        for i in range(len(ops)):
            o_smem.at[i][...] = lax.slice(out, (i * TILE_N, 0), ((i + 1) * TILE_N, tile_t))
        plgpu.commit_smem()
        for i in range(len(ops)):
            plgpu.copy_smem_to_gmem(o_smem.at[i], out_ref.at[s, u, i, pl.ds(c * TILE_N, TILE_N)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(in_smem, *scratch)


def expert_gemv_mgpu(
    x: jax.Array,
    slots: jax.Array,
    ops: tuple[fe.Operand, ...],
    *,
    tile_t: int,
    per_slot: bool,
    splits: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x [tile_t, K padded] (shared) or [U tile_t, K padded] (per_slot), kernel column order, times
    slot u's expert of each weight in `ops` -> float32 partials [splits, U, len(ops), N, tile_t]
    (garbage where the slot is -1)."""
    num_slots, n = slots.shape[0], ops[0].n
    if any(op.n != n or op.k != ops[0].k or op.fmt != ops[0].fmt for op in ops):
        raise ValueError("few experts kernel: gate and up must have one shape and format")
    if x.shape[1] != ops[0].k_padded or tile_t % 8:
        raise ValueError(f"x {x.shape} does not fit K {ops[0].k_padded} / tile_t {tile_t}")
    k_steps = ops[0].steps
    splits = splits or default_few_splits(num_slots * (n // TILE_N), k_steps)
    if k_steps % splits:
        raise ValueError(f"splits {splits} must divide the {k_steps} K steps")
    steps = k_steps // splits
    stages = min(fe.choose_stages(ops, tile_t, x.dtype), steps)
    body = functools.partial(
        _program, ops=ops, tile_t=tile_t, stages=stages, steps=steps, per_slot=per_slot, dtype=x.dtype
    )
    call = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, num_slots, len(ops), n, tile_t), jnp.float32),
        grid=(num_slots, n // TILE_N, splits),
        grid_names=("slot", "col", "split"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )
    return call(slots, x, *[a for op in ops for a in op.arrays])


@functools.partial(jax.jit, static_argnames=("interpret",))
def few_experts_mgpu(
    x: jax.Array,
    experts: jax.Array,
    here: jax.Array,
    weights: jax.Array,
    gate: fe.ExpertWeight,
    up: fe.ExpertWeight,
    down: fe.ExpertWeight,
    *,
    interpret: bool = False,
) -> jax.Array:
    """The routed experts' weighted mix for x [N, H] (few_experts' contract) on Mosaic GPU."""
    n = x.shape[0]
    g, u, d = (fe.operand(w, x.dtype) for w in (gate, up, down))
    num_local = g.arrays[0].shape[0]
    slots = distinct_experts(experts, here, num_local)  # [U]
    live = (slots >= 0)[:, None, None]
    tile_t = -(-n // 8) * 8
    xt = fe.kernel_columns(jnp.pad(x, ((0, tile_t - n), (0, 0))), g)  # [tile_t, K_g]
    gu = jnp.sum(expert_gemv_mgpu(xt, slots, (g, u), tile_t=tile_t, per_slot=False, interpret=interpret), 0)
    gt, ut = gu[:, 0], gu[:, 1]  # [U, I, tile_t]
    act = jnp.where(live, gt / (1.0 + jnp.exp(-gt)) * ut, 0.0).astype(x.dtype).transpose(0, 2, 1)
    rows = fe.kernel_columns(act.reshape(-1, act.shape[-1]), d)  # [U tile_t, K_d]
    y = jnp.sum(expert_gemv_mgpu(rows, slots, (d,), tile_t=tile_t, per_slot=True, interpret=interpret), 0)
    y = jnp.where(live, y[:, 0], 0.0)[:, :, :n]  # [U, H, N]
    out = jnp.einsum("uhn,nu->nh", y, slot_weights(experts, here, weights, slots))
    return out[:, : down.width or None].astype(x.dtype)
