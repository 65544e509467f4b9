"""The routed experts of a few tokens (decode, small trees) as split-K GEMVs over every SM (Pallas Triton).

Contract of `few_experts` and of its reference `few_experts_reference` (same signature, the one of
`fused_experts.fused_experts`): x [N, H] (bf16 / f16), experts [N, k] int32 local expert ids, here
[N, k] bool (the slot's expert is held on this device), weights [N, k] routing weights, gate / up
[E, H, I] and down [E, I, H], each a `fused_experts.ExpertWeight` ("plain", "fp8" e4m3 with float32
block scales as HF's weight_block_size, "int4" int32 words of 8 nibbles with group scales, the
compressed-tensors pack-quantized layout) -> [N, H] in x's dtype: per token, the routing-weighted sum
over its held slots of down(silu(x gate) * (x up)).

Layout. The distinct held experts of the N tokens fill U = min(E, N k) slots (`distinct_experts`,
-1 past them); every slot's expert is read once, for all N tokens at once (the tokens that did not
choose it get routing weight 0 in the combine): at a few tokens the kernel is bound by the weight
bytes, and N x U dots of 16-row tiles cost nothing beside them. Two launches of one kernel
(`expert_gemv`):
  gate_up  grid (U, I / tile_n, splits): program (u, j, s) reads rows [s K / splits, (s + 1) K / splits)
           of columns j of gate and up of slot u's expert once, against x's matching columns, and
           writes float32 partials [splits, U, M, I] (M = N padded to a 16-row dot tile)
  down     the same over act [U, M, I] = silu(sum g) * (sum u) (XLA sums the splits), one act block
           per slot -> partials [splits, U, M, H]
then the combine (XLA): out[n] = sum_u w[n, u] sum_s y[s, u, n], w[n, u] the routing weights of token
n's held slots whose expert is slot u's. The K splits are what spreads one token's 8 experts over
132 SMs: at Qwen3-30B-A3B's shape, one token, 8 x 6 column tiles x 8 splits = 384 programs for
gate_up and 8 x 16 x 3 = 384 for down (kernels.tuning.resolve_few_tuning). A slot past the distinct
experts runs no K step and writes zeros.

Weights are read at their stored width: bf16 tiles as they are; FP8 tiles as bf16 (e4m3 values are
exact in it), the dot times the tile's one block scale (tiles nest in the scale blocks);
INT4 tiles of tile_k / 8 word rows, nibble b of word row r being weight row 8 r + b, so a step is 8
dots of x's columns 8 r + b against nibble b (scaled by the group's scale, rounded to the scale's
dtype as the checkpoint defines it).

Two backends of one layout: this file's Triton kernel (any CUDA GPU; the project's default on
non-Hopper GPUs, e.g. sm120) and kernels/few_experts_mgpu.py on Mosaic GPU (Hopper: the fused kernel's
wgmma program, TMA-fed, with a K split). Which one a Hopper GPU runs is the dispatch table's
(kernels.tuning.MOE_GPU_DISPATCH) once results/h200/recipes/moe_few_token.sh has timed both.

jax#40847 (0.11.x): a Pallas kernel function reused with a different grid keeps its first trace, so
`expert_gemv` builds a fresh kernel closure per call (tests/test_few_experts.py runs two grids).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ddtree_jax.kernels.fused_experts import ExpertWeight, _dequantized
from ddtree_jax.kernels.tuning import FewTuning, resolve_few_tuning

FORMATS = ("plain", "fp8", "int4")
DOT_ROWS = 16  # the smallest M of a Triton dot


def why_not(w: ExpertWeight, dtype: jnp.dtype) -> str | None:
    """Why the kernel cannot read expert weight w [E, K, N] against activations of `dtype` (local
    shapes), or None when it can (the tiles: `tuning.resolve_few_tuning`)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"activations must be bfloat16 or float16, not {jnp.dtype(dtype)}"
    if w.fmt not in FORMATS:
        return f"expert weight format {w.fmt!r} not one of {FORMATS}"
    if w.fmt == "int4" and (w.w.dtype != jnp.int32 or w.scale is None):
        return "INT4 weights must be int32 words with group scales"
    try:
        resolve_few_tuning(w.fmt, _rows(w), w.w.shape[-1], 1, block=_block(w))
    except ValueError as e:
        return str(e)
    return None


def supported(gate: ExpertWeight, up: ExpertWeight, down: ExpertWeight, dtype: jnp.dtype) -> bool:
    """Whether the kernel takes these experts (one format for all three) and activations."""
    same = gate.fmt == up.fmt == down.fmt and gate.w.shape == up.w.shape
    return same and all(why_not(w, dtype) is None for w in (gate, up, down))


def _rows(w: ExpertWeight) -> int:
    """K per expert as stored (fp8: padded to whole blocks; int4: 8 rows per word row)."""
    return w.w.shape[-2] * (8 if w.fmt == "int4" else 1)


def _block(w: ExpertWeight) -> tuple[int, int]:
    """The scale block (rows, columns): fp8's block, int4's (group, 1), plain (1, 1)."""
    return w.block if w.fmt == "fp8" else (w.group, 1) if w.fmt == "int4" else (1, 1)


def distinct_experts(experts: jax.Array, here: jax.Array, num_experts: int) -> jax.Array:
    """The distinct held experts of experts [N, k], ascending, in U = min(E, N k) slots, -1 past them."""
    key = jnp.where(here, experts, num_experts).reshape(-1)
    present = jnp.zeros((num_experts + 1,), jnp.bool_).at[key].set(True)[:num_experts]
    slots = min(num_experts, experts.size)
    return jnp.nonzero(present, size=slots, fill_value=-1)[0].astype(jnp.int32)


def slot_weights(experts: jax.Array, here: jax.Array, weights: jax.Array, slots: jax.Array) -> jax.Array:
    """[N, U] float32: each token's routing weight on each slot's expert (summed over its held slots
    of that expert; 0 where it did not choose it)."""
    match = (experts[:, :, None] == slots[None, None, :]) & here[:, :, None]  # [N, k, U]
    return jnp.sum(jnp.where(match, weights.astype(jnp.float32)[:, :, None], 0.0), axis=1)


def _flat(w: ExpertWeight) -> tuple[jax.Array, jax.Array]:
    """The stored values and scales flattened to 2-D ([E * rows, N], [E * rows / bk, N / bn]); a
    (1, 1) placeholder scale for plain weights."""
    values = w.w.reshape(-1, w.w.shape[-1])
    if w.fmt == "plain":
        return values, jnp.zeros((1, 1), jnp.float32)
    return values, w.scale.reshape(-1, w.scale.shape[-1])


def _make_kernel(
    *, fmt: str, num_w: int, m: int, k_rows: int, tun: FewTuning, block, per_slot: bool, scale_dtype, dtype
):
    """A fresh kernel closure for one grid (jax#40847): program (slot, column tile, K split)."""
    tile_n, tile_k, steps = tun.tile_n, tun.tile_k, tun.steps

    def kernel(slot_ref, x_ref, *refs):
        w_refs, s_refs, o_refs = refs[:num_w], refs[num_w : 2 * num_w], refs[2 * num_w :]
        u = pl.program_id(0)
        e = slot_ref[...]
        n0 = pl.program_id(1) * tile_n
        cols = n0 + jnp.arange(tile_n, dtype=jnp.int32)
        x_rows = (u * m if per_slot else 0) + jnp.arange(m, dtype=jnp.int32)

        def x_cols(k_index):  # [m, len(k_index)]
            return pltriton.load(x_ref.at[x_rows[:, None], k_index[None, :]])

        def step(kb, accs):
            k0 = kb * tile_k
            if fmt == "int4":
                r = jnp.arange(tile_k // 8, dtype=jnp.int32)
                srow = (e * (k_rows // block[0]) + (k0 + 8 * r) // block[0])[:, None]
                words, scales = [], []
                for w_ref, s_ref in zip(w_refs, s_refs, strict=True):
                    words.append(
                        pltriton.load(w_ref.at[(e * (k_rows // 8) + k0 // 8 + r)[:, None], cols[None, :]])
                    )
                    scales.append(pltriton.load(s_ref.at[srow, cols[None, :]]).astype(jnp.float32))
                accs = list(accs)
                for b in range(8):
                    xb = x_cols(k0 + 8 * r + b)
                    for i in range(num_w):
                        q = ((words[i] >> (4 * b)) & 0xF) - 8
                        w = (q.astype(jnp.float32) * scales[i]).astype(scale_dtype).astype(dtype)
                        accs[i] += jnp.dot(xb, w, preferred_element_type=jnp.float32)
                return tuple(accs)
            k = k0 + jnp.arange(tile_k, dtype=jnp.int32)
            xk = x_cols(k)
            out = []
            for w_ref, s_ref, acc in zip(w_refs, s_refs, accs, strict=True):
                w = pltriton.load(w_ref.at[(e * k_rows + k)[:, None], cols[None, :]])
                part = jnp.dot(xk, w.astype(dtype), preferred_element_type=jnp.float32)
                if fmt == "fp8":  # the tile lies in one scale block: e4m3 is exact in bf16, scale the dot
                    scale = s_ref[e * (k_rows // block[0]) + k0 // block[0], n0 // block[1]]
                    part = part * scale
                out.append(acc + part)
            return tuple(out)

        first = pl.program_id(2) * steps
        count = jnp.clip(e + 1, 0, 1) * steps  # no K step for a slot past the distinct experts
        zeros = tuple(jnp.zeros((m, tile_n), jnp.float32) for _ in range(num_w))
        accs = lax.fori_loop(first, first + count, step, zeros)
        for o_ref, acc in zip(o_refs, accs, strict=True):
            o_ref[...] = acc

    return kernel


def expert_gemv(
    x: jax.Array,
    slots: jax.Array,
    ws: tuple[ExpertWeight, ...],
    *,
    per_slot: bool,
    tuning: dict | None = None,
    interpret: bool = False,
) -> list[jax.Array]:
    """x [M, K'] (shared by the slots) or [U M, K'] (per_slot: M rows per slot), K' <= K, times slot
    u's expert of each weight in `ws` (one, or gate and up, one shape) -> per weight the float32
    partials [splits, U, M, N_stored] of the K splits."""
    w0 = ws[0]
    fmt, k_rows, n = w0.fmt, _rows(w0), w0.w.shape[-1]
    num_slots = slots.shape[0]
    m = x.shape[0] // num_slots if per_slot else x.shape[0]
    tun = resolve_few_tuning(fmt, k_rows, n, num_slots, block=_block(w0), **(tuning or {}))
    x = jnp.pad(x, ((0, 0), (0, k_rows - x.shape[1]))) if k_rows > x.shape[1] else x
    flat = [_flat(w) for w in ws]
    kernel = _make_kernel(
        fmt=fmt,
        num_w=len(ws),
        m=m,
        k_rows=k_rows,
        tun=tun,
        block=_block(w0),
        per_slot=per_slot,
        scale_dtype=flat[0][1].dtype,
        dtype=x.dtype,
    )
    slot = pl.BlockSpec((None,), lambda u, j, s: (u,))
    arrays = [x] + [v for v, _ in flat] + [s for _, s in flat]
    whole = [pl.BlockSpec(a.shape, lambda u, j, s: (0, 0)) for a in arrays]
    part = jax.ShapeDtypeStruct((tun.splits, num_slots, m, n), jnp.float32)
    outs = pl.pallas_call(
        kernel,
        grid=(num_slots, n // tun.tile_n, tun.splits),
        in_specs=[slot, *whole],
        out_specs=[pl.BlockSpec((None, None, m, tun.tile_n), lambda u, j, s: (s, u, 0, j)) for _ in ws],
        out_shape=[part for _ in ws],
        compiler_params=pltriton.CompilerParams(num_warps=tun.num_warps, num_stages=tun.num_stages),
        interpret=interpret,
        name=f"few_experts_{fmt}",
    )(slots, *arrays)
    return list(outs)


def dot_rows(tokens: int) -> int:
    """M: the tokens padded to a power of two of at least one dot tile's 16 rows."""
    m = DOT_ROWS
    while m < tokens:
        m *= 2
    return m


# jitted: a forward's layers share one trace and lowering
@functools.partial(jax.jit, static_argnames=("interpret",))
def few_experts(
    x: jax.Array,
    experts: jax.Array,
    here: jax.Array,
    weights: jax.Array,
    gate: ExpertWeight,
    up: ExpertWeight,
    down: ExpertWeight,
    *,
    interpret: bool = False,
) -> jax.Array:
    """The routed experts' weighted mix for x [N, H] (module docstring) through two split-K launches."""
    n = x.shape[0]
    num_local = gate.w.shape[0]
    slots = distinct_experts(experts, here, num_local)  # [U]
    xm = jnp.pad(x, ((0, dot_rows(n) - n), (0, 0)))  # [M, H]
    g, u = expert_gemv(xm, slots, (gate, up), per_slot=False, interpret=interpret)
    g, u = jnp.sum(g, axis=0), jnp.sum(u, axis=0)  # [U, M, I]
    act = (g / (1.0 + jnp.exp(-g)) * u).astype(x.dtype)
    (y,) = expert_gemv(act.reshape(-1, act.shape[-1]), slots, (down,), per_slot=True, interpret=interpret)
    y = jnp.sum(y, axis=0)[:, :n]  # [U, N, H]
    out = jnp.einsum("unh,nu->nh", y, slot_weights(experts, here, weights, slots))
    return out[:, : down.width or None].astype(x.dtype)


def few_experts_reference(
    x: jax.Array,
    experts: jax.Array,
    here: jax.Array,
    weights: jax.Array,
    gate: ExpertWeight,
    up: ExpertWeight,
    down: ExpertWeight,
    *,
    interpret: bool = False,
) -> jax.Array:
    """`few_experts` in jnp, per expert: every local expert's dequantised matrices on every token,
    weighted by the token's routing weights on that expert (0 where not chosen)."""
    del interpret
    num_local = gate.w.shape[0]
    per_expert = slot_weights(experts, here, weights, jnp.arange(num_local, dtype=jnp.int32))  # [N, E]
    g, u, d = (_dequantized(w, jnp.float32) for w in (gate, up, down))
    xs = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, g.shape[-2] - x.shape[-1])))
    a = jnp.einsum("nh,ehi->eni", xs, g)
    act = (jax.nn.silu(a) * jnp.einsum("nh,ehi->eni", xs, u)).astype(x.dtype).astype(jnp.float32)
    y = jnp.einsum("eni,eih->enh", act, d)
    out = jnp.einsum("enh,ne->nh", y, per_expert)
    return out[:, : down.width or None].astype(x.dtype)
