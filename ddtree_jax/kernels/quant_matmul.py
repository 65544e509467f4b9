"""Grouped matmul over rows sorted by expert that reads the experts' stored bytes (INT4 words, FP8, bf16).

Contract (`grouped_matmul` and its jnp reference `grouped_matmul_reference`): x [P, K] sorted by
expert, the stacked experts W [E, K, N] as stored (`Experts`), group_sizes [E] -> [P, N] in x's
dtype (rows past sum(group_sizes) are zeros). `ddtree_jax.quant.arrays.kernel_experts` lays a
quantized weight out as `Experts`; `quant.arrays.pallas_ragged_matmul` is this kernel under the
contract of `quant.arrays.ragged_matmul` (a weight in, the same result out).

Kernel layout: a host-free tile schedule cuts every expert's rows into tiles of `tile_m` (a tile
never spans two experts; at most min(E, P) + P // tile_m tiles, the rest empty); the grid is
(tiles, N / tile_n, splits of K). A program loads its tile's rows of x once per K step, dequantises
its [tile_k, tile_n] slab of the tile's expert in registers (INT4: nibble j of word row r is weight
row 8r + j, so the slab is 8 dots of the x columns 8r + j against nibble j; scales gathered per row)
and accumulates in float32. Only the experts that own rows are read, each slab once per tile. Splits
of K write float32 partials that a jnp sum merges (more programs for one-token decode).
Expert weights are flattened to 2-D ([E * rows, N]) and read by gathered row indices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ddtree_jax.kernels.tuning import default_grouped_splits

FORMATS = ("plain", "fp8", "int4")


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["w", "scale"], meta_fields=["fmt", "rows", "cols", "block"]
)
@dataclasses.dataclass(frozen=True)
class Experts:
    """Stacked expert weights [E, K, N] as stored, flattened to 2-D (`rows` = K per expert as stored):

      plain  w [E * K, N] (any float dtype); scale unused ([1, 1])
      fp8    w [E * K_pad, N_pad] float8_e4m3fn, zero-padded to whole blocks; scale [E * K_pad / bk,
             N_pad / bn] float32; block (bk, bn)
      int4   w [E * K / 8, N] int32: nibble j (bits 4j..4j+3) of word r holds row 8r + j, stored + 8;
             scale [E * K / g, N] (bf16 as published); block (g, 1)

    `cols`: the N of the result (fp8: the logical N, before padding).
    """

    w: jax.Array
    scale: jax.Array
    fmt: str
    rows: int
    cols: int
    block: tuple[int, int] = (1, 1)

    @property
    def num_experts(self) -> int:
        """E."""
        return self.w.shape[0] * (8 if self.fmt == "int4" else 1) // self.rows


def _dequantize(experts: Experts, dtype: jnp.dtype) -> jax.Array:
    """[E, rows, N_stored] in `dtype`: the stored values times their scales in float32 (int4: rounded to
    the scale's dtype first, as the checkpoint defines it)."""
    e, n, f32 = experts.num_experts, experts.w.shape[-1], jnp.float32
    if experts.fmt == "plain":
        return experts.w.reshape(e, experts.rows, n).astype(dtype)
    bk, bn = experts.block
    if experts.fmt == "fp8":
        blocked = experts.w.astype(f32).reshape(e, experts.rows // bk, bk, n // bn, bn)
        scale = experts.scale.reshape(e, experts.rows // bk, n // bn)[:, :, None, :, None]
        return (blocked * scale).reshape(e, experts.rows, n).astype(dtype)
    shifts = jnp.arange(0, 32, 4, dtype=jnp.int32)[None, :, None]
    nibbles = ((experts.w[:, None, :] >> shifts) & 0xF) - 8  # [E * K / 8, 8, N]: row 8r + j
    values = nibbles.reshape(e, experts.rows // bk, bk, n).astype(f32)
    scale = experts.scale.reshape(e, experts.rows // bk, 1, n).astype(f32)
    return (values * scale).astype(experts.scale.dtype).reshape(e, experts.rows, n).astype(dtype)


def grouped_matmul_reference(x: jax.Array, experts: Experts, group_sizes: jax.Array) -> jax.Array:
    """Pure-jnp grouped matmul (the weights dequantised whole, then `jax.lax.ragged_dot`); the contract
    of `grouped_matmul`."""
    w = _dequantize(experts, x.dtype)
    pad = experts.rows - x.shape[-1]
    x = jnp.pad(x, ((0, 0), (0, pad))) if pad else x
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32))[:, : experts.cols]


def tile_schedule(group_sizes: jax.Array, num_rows: int, tile_m: int) -> tuple[jax.Array, ...]:
    """(expert, first row, end row) int32 [tiles] of every row tile; empty tiles have first == end."""
    num_experts = group_sizes.shape[0]
    max_tiles = max(1, min(num_experts, num_rows) + num_rows // tile_m)
    sizes = group_sizes.astype(jnp.int32)
    tiles = (sizes + tile_m - 1) // tile_m
    cum = jnp.cumsum(tiles)
    offsets = jnp.cumsum(sizes) - sizes
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    owner = jnp.searchsorted(cum, t, side="right").astype(jnp.int32)
    e = jnp.minimum(owner, num_experts - 1)
    start = offsets[e] + (t - (cum[e] - tiles[e])) * tile_m
    end = jnp.minimum(start + tile_m, offsets[e] + sizes[e])
    valid = owner < num_experts
    return e, jnp.where(valid, start, 0), jnp.where(valid, end, 0)


def _kernel(
    e_ref,
    start_ref,
    end_ref,
    x_ref,
    w_ref,
    s_ref,
    o_ref,
    *,
    fmt: str,
    k_rows: int,
    tile_m: int,
    tile_n: int,
    tile_k: int,
    steps: int,
    group: tuple[int, int],
    scale_dtype,
):
    """One (tile, column tile, K split): acc [tile_m, tile_n] over `steps` K tiles."""
    n0 = pl.program_id(1) * tile_n
    k_first = pl.program_id(2) * steps
    e, start, end = e_ref[...], start_ref[...], end_ref[...]
    rows = start + jnp.arange(tile_m, dtype=jnp.int32)
    row_ok = rows < end
    cols = n0 + jnp.arange(tile_n, dtype=jnp.int32)

    def x_cols(k_index):  # [tile_m, len(k_index)]
        return pltriton.load(x_ref.at[rows[:, None], k_index[None, :]], mask=row_ok[:, None], other=0)

    def step(kb, acc):
        k0 = kb * tile_k
        if fmt == "int4":
            r = jnp.arange(tile_k // 8, dtype=jnp.int32)
            words = pltriton.load(w_ref.at[(e * (k_rows // 8) + k0 // 8 + r)[:, None], cols[None, :]])
            srow = e * (k_rows // group[0]) + (k0 + 8 * r) // group[0]
            scale = pltriton.load(s_ref.at[srow[:, None], cols[None, :]]).astype(jnp.float32)
            for j in range(8):
                nib = ((words >> (4 * j)) & 0xF) - 8
                w = (nib.astype(jnp.float32) * scale).astype(scale_dtype).astype(x_ref.dtype)
                acc += jnp.dot(x_cols(k0 + 8 * r + j), w, preferred_element_type=jnp.float32)
            return acc
        k = k0 + jnp.arange(tile_k, dtype=jnp.int32)
        w = pltriton.load(w_ref.at[(e * k_rows + k)[:, None], cols[None, :]])
        if fmt == "fp8":
            srow = e * (k_rows // group[0]) + k // group[0]
            scale = pltriton.load(s_ref.at[srow[:, None], (cols // group[1])[None, :]])
            w = (w.astype(jnp.float32) * scale).astype(x_ref.dtype)
        return acc + jnp.dot(x_cols(k), w.astype(x_ref.dtype), preferred_element_type=jnp.float32)

    count = jnp.clip(end - start, 0, 1) * steps  # 0 for an empty tile (arithmetic: Triton-safe)
    acc = lax.fori_loop(k_first, k_first + count, step, jnp.zeros((tile_m, tile_n), jnp.float32))
    pltriton.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=row_ok[:, None])


@functools.partial(
    jax.jit,
    static_argnames=("tile_m", "tile_n", "tile_k", "splits", "num_warps", "num_stages", "interpret"),
)
def grouped_matmul(
    x: jax.Array,
    experts: Experts,
    group_sizes: jax.Array,
    *,
    tile_m: int = 16,
    tile_n: int = 128,
    tile_k: int | None = None,
    splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """Pallas (Triton) grouped matmul; the contract of `grouped_matmul_reference` (module docstring)."""
    if experts.fmt not in FORMATS:
        raise ValueError(f"expert format {experts.fmt!r} not one of {FORMATS}")
    fmt, w2, s2, k_rows, group = experts.fmt, experts.w, experts.scale, experts.rows, experts.block
    n = w2.shape[-1]
    p, k = x.shape
    tile_k = tile_k or (256 if fmt == "int4" else 128)
    if fmt == "fp8" and (group[0] % tile_k and tile_k % group[0]):
        raise ValueError(f"tile_k {tile_k} and the fp8 block {group[0]} must nest")
    if k_rows % tile_k or n % tile_n:
        raise ValueError(f"K {k_rows} / N {n} must be multiples of tile_k {tile_k} / tile_n {tile_n}")
    x = jnp.pad(x, ((0, 0), (0, k_rows - k))) if k_rows > k else x
    e, start, end = tile_schedule(group_sizes, p, tile_m)
    k_tiles = k_rows // tile_k
    splits = splits or default_grouped_splits(e.shape[0] * (n // tile_n), k_tiles)
    if k_tiles % splits:
        raise ValueError(f"splits {splits} must divide the {k_tiles} K tiles")
    kernel = functools.partial(
        _kernel,
        fmt=fmt,
        k_rows=k_rows,
        tile_m=tile_m,
        tile_n=tile_n,
        tile_k=tile_k,
        steps=k_tiles // splits,
        group=group,
        scale_dtype=s2.dtype,
    )
    tile = pl.BlockSpec((None,), lambda t, j, s: (t,))
    whole = [pl.BlockSpec(a.shape, lambda t, j, s: (0, 0)) for a in (x, w2, s2)]
    out_dtype = x.dtype if splits == 1 else jnp.float32
    out = pl.pallas_call(
        kernel,
        grid=(e.shape[0], n // tile_n, splits),
        in_specs=[tile, tile, tile, *whole],
        out_specs=pl.BlockSpec((None, p, n), lambda t, j, s: (s, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, p, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"grouped_matmul_{fmt}",
    )(e, start, end, x, w2, s2)
    out = out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
    covered = jnp.arange(p) < jnp.sum(group_sizes)
    return jnp.where(covered[:, None], out, 0)[:, : experts.cols]
