"""Quantized weights kept small on the device, and the matmuls that read them.

Layouts (ours, [in, out] like every weight here; leading dims, e.g. experts [E, ...], pass through):
  Fp8Weight   w      float8_e4m3fn [..., in_pad, out_pad]  (zero-padded to whole blocks)
              scale  float32       [..., in_pad / bi, out_pad / bo]
  Int4Weight  q      int32 [..., in / 8, out]: nibble k (bits 4k..4k+3) of word j holds row 8j + k,
                     stored + 8 (the checkpoint's words, transposed); or int4 [..., in, out]
              scale  bf16 (the checkpoint's dtype) [..., in / g, out]
Plain arrays are accepted wherever a weight is, so model code calls one set of functions.

Every matmul dequantises inside the jitted computation (`dequantize` is elementwise on the stored
bytes plus a broadcast of the scales) so that XLA can fuse it into the dot's operand instead of
writing a bf16 copy of the weight; `scripts/bench_quant.py` measures whether it does on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.errors import DDTreeError
from ddtree_jax.quant.formats import E4M3, blocks


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["w", "scale"], meta_fields=["shape", "block"]
)
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """FP8 e4m3 weight with float32 block scales; `shape` is the logical (in, out)."""

    w: jax.Array  # [..., in_pad, out_pad] float8_e4m3fn
    scale: jax.Array  # [..., in_pad / bi, out_pad / bo] float32
    shape: tuple[int, int]  # logical (in, out)
    block: tuple[int, int]  # (bi, bo): our order, the config's weight_block_size reversed


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "scale"], meta_fields=["group"])
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """Symmetric int4 weight, 8 values per int32 word along `in` (or a jnp.int4 array), group scales."""

    q: jax.Array  # [..., in / 8, out] int32, or [..., in, out] int4
    scale: jax.Array  # [..., in / group, out] (bf16 as published)
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        """The logical (in, out)."""
        rows = self.q.shape[-2] * (8 if self.q.dtype == jnp.int32 else 1)
        return rows, self.q.shape[-1]


Weight = jax.Array | Fp8Weight | Int4Weight


# ---- checkpoint [out, in] -> our layout, on the host -------------------------------------------------


def fp8_host(
    weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 [..., out, in], float32 [..., ceil(out/bo), ceil(in/bi)]) -> (w [..., in_pad, out_pad],
    scale [..., in_pad/bi, out_pad/bo]); block is the config's (bo, bi)."""
    bo, bi = block
    n_out, n_in = weight.shape[-2:]
    want = (*weight.shape[:-2], blocks(n_out, bo), blocks(n_in, bi))
    if tuple(scale_inv.shape) != want:
        raise DDTreeError(
            f"fp8 scales have shape {list(scale_inv.shape)}, weight {list(weight.shape)} needs {list(want)}"
        )
    pad = [(0, 0)] * (weight.ndim - 2) + [(0, want[-2] * bo - n_out), (0, want[-1] * bi - n_in)]
    w = np.asarray(weight, dtype=E4M3)
    if any(p for _, p in pad):  # copies; whole blocks stay memory-mapped views
        w = np.pad(w.view(np.uint8), pad).view(E4M3)
    return np.swapaxes(w, -1, -2), np.swapaxes(np.asarray(scale_inv, np.float32), -1, -2)


def int4_host(packed: np.ndarray, scale: np.ndarray, n_in: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [..., out, in/8], scale [..., out, in/g]) -> (q [..., in/8, out], scale [..., in/g, out])."""
    if n_in % group or packed.shape[-1] * 8 != n_in or scale.shape[-1] * group != n_in:
        raise DDTreeError(
            f"int4 weight of {n_in} inputs: packed {list(packed.shape)} and scale {list(scale.shape)} "
            f"do not match group {group}"
        )
    return np.swapaxes(np.asarray(packed, np.int32), -1, -2), np.swapaxes(np.asarray(scale), -1, -2)


def as_int4(w: Int4Weight) -> Int4Weight:
    """The same weight with its values unpacked into a jnp.int4 array [..., in, out] (4 bits each)."""
    if w.q.dtype == jnp.int4:
        return w
    return Int4Weight(_nibbles(w.q).astype(jnp.int4), w.scale, w.group)


# ---- dequantisation (jnp) ----------------------------------------------------------------------------


def _nibbles(words: jax.Array) -> jax.Array:
    """int32 [..., n/8, out] -> int32 values in [-8, 7], [..., n, out] (lowest nibble = first row)."""
    shifts = (jnp.arange(8, dtype=jnp.int32) * 4)[:, None]
    nib = jnp.right_shift(words[..., :, None, :].view(jnp.uint32), shifts.astype(jnp.uint32)) & 0xF
    nib = nib.astype(jnp.int32)  # [..., n/8, 8, out]
    return nib.reshape(*words.shape[:-2], words.shape[-2] * 8, words.shape[-1]) - 8


def _int4_values(w: Int4Weight, dtype: jnp.dtype) -> jax.Array:
    """[..., in, out]: q * scale in float32, rounded to the scale's dtype, then cast to `dtype`."""
    q = (w.q.astype(jnp.int32) if w.q.dtype == jnp.int4 else _nibbles(w.q)).astype(jnp.float32)
    n_in, n_out = q.shape[-2:]
    grouped = q.reshape(*q.shape[:-2], n_in // w.group, w.group, n_out)
    deq = grouped * w.scale.astype(jnp.float32)[..., :, None, :]
    return deq.reshape(q.shape).astype(w.scale.dtype).astype(dtype)


def _fp8_padded(w: Fp8Weight, dtype: jnp.dtype) -> jax.Array:
    """[..., in_pad, out_pad]: e4m3 value * block scale in float32, cast to `dtype`."""
    bi, bo = w.block
    ip, op = w.w.shape[-2:]
    lead = w.w.shape[:-2]
    blocked = w.w.astype(jnp.float32).reshape(*lead, ip // bi, bi, op // bo, bo)
    return (blocked * w.scale[..., :, None, :, None]).reshape(*lead, ip, op).astype(dtype)


def dequantize(w: Weight, dtype: jnp.dtype) -> jax.Array:
    """The weight [..., in, out] in `dtype`, as the format defines it."""
    if isinstance(w, Fp8Weight):
        return _fp8_padded(w, dtype)[..., : w.shape[0], : w.shape[1]]
    if isinstance(w, Int4Weight):
        return _int4_values(w, dtype)
    return w.astype(dtype)


def _operand(w: Weight, dtype: jnp.dtype) -> tuple[jax.Array, int]:
    """(the dequantised weight as the dot reads it [..., in_pad, out_pad], the logical out).

    Under `shard_map` the arrays are local while `Fp8Weight.shape` stays global: a split dim is never
    padded (load.check_placeable), so slicing to the global size is a no-op there."""
    if isinstance(w, Fp8Weight):
        return _fp8_padded(w, dtype), w.shape[1]
    full = dequantize(w, dtype)
    return full, full.shape[-1]


def _pad_in(x: jax.Array, rows: int) -> jax.Array:
    """x [..., in] -> [..., rows] with zeros (fp8 weights are padded to whole blocks)."""
    pad = rows - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


# ---- matmuls -----------------------------------------------------------------------------------------


def matmul(x: jax.Array, w: Weight) -> jax.Array:
    """x [..., in] @ W [in, out] -> [..., out] in x's dtype."""
    full, n_out = _operand(w, x.dtype)
    return (_pad_in(x, full.shape[-2]) @ full)[..., :n_out]


def ragged_matmul(x: jax.Array, w: Weight, group_sizes: jax.Array) -> jax.Array:
    """Rows sorted by expert: x [M, in], W [E, in, out], group_sizes [E] (rows per expert, summing to
    at most M; rows past the sum give zeros) -> [M, out] through `jax.lax.ragged_dot`."""
    full, n_out = _operand(w, x.dtype)
    return jax.lax.ragged_dot(_pad_in(x, full.shape[-2]), full, group_sizes.astype(jnp.int32))[..., :n_out]


def kernel_experts(w: Weight):
    """A stacked expert weight [E, in, out] laid out for the Pallas grouped matmul
    (`ddtree_jax.kernels.quant_matmul.Experts`: the stored arrays flattened to 2-D)."""
    from ddtree_jax.kernels.quant_matmul import Experts

    if isinstance(w, Int4Weight):
        if w.q.dtype != jnp.int32:
            raise ValueError("the kernel reads int32 words; pass the checkpoint's layout, not as_int4")
        e, kw, n = w.q.shape
        return Experts(w.q.reshape(e * kw, n), w.scale.reshape(-1, n), "int4", kw * 8, n, (w.group, 1))
    if isinstance(w, Fp8Weight):
        e, kp, n = w.w.shape
        scale = w.scale.reshape(-1, w.scale.shape[-1])
        return Experts(w.w.reshape(e * kp, n), scale, "fp8", kp, w.shape[1], w.block)
    e, k, n = w.shape
    return Experts(w.reshape(e * k, n), jnp.zeros((1, 1), jnp.float32), "plain", k, n)


def pallas_ragged_matmul(x: jax.Array, w: Weight, group_sizes: jax.Array, **tuning) -> jax.Array:
    """`ragged_matmul` by the Pallas Triton kernel, which reads the stored bytes of the experts that own
    rows (`ddtree_jax.kernels.quant_matmul.grouped_matmul`; `tuning`: its tile, split and interpret
    options)."""
    from ddtree_jax.kernels.quant_matmul import grouped_matmul

    return grouped_matmul(x, kernel_experts(w), group_sizes, **tuning)


def expert_weight(w: Weight):
    """A stacked expert weight [E, in, out] as the fused expert kernel reads it
    (`ddtree_jax.kernels.fused_experts.ExpertWeight`: the stored arrays, the scales and the format's
    constants; no copy)."""
    from ddtree_jax.kernels.fused_experts import ExpertWeight

    if isinstance(w, Int4Weight):
        return ExpertWeight("int4", w.q, w.scale, group=w.group)
    if isinstance(w, Fp8Weight):
        return ExpertWeight("fp8", w.w, w.scale, block=w.block, width=w.shape[1])
    return ExpertWeight("plain", w)


def slot_matmul(x: jax.Array, w: Weight, experts: jax.Array) -> jax.Array:
    """Each token's k chosen experts: x [N, in] (shared by the slots) or [N, k, in] (one row per slot),
    W [E, in, out], experts [N, k] -> [N, k, out]. Gathers the stored bytes of N k experts and contracts
    without repeating x per slot: on the H200 this einsum ran a Qwen3-30B-A3B layer at one token in
    0.126 ms against 0.191 ms for `gather_matmul` on x repeated k times (results/notes.md)."""
    chosen = jax.tree.map(lambda a: a[experts], w)  # [N, k, in, out] (stored form)
    full, n_out = _operand(chosen, x.dtype)
    spec = "ni,nkio->nko" if x.ndim == 2 else "nki,nkio->nko"
    return jnp.einsum(spec, _pad_in(x, full.shape[-2]), full)[..., :n_out]


def gather_matmul(x: jax.Array, w: Weight, expert: jax.Array) -> jax.Array:
    """Row p times its own expert: x [P, in], W [E, in, out], expert [P] -> [P, out] (`slot_matmul`
    with one slot per row). Gathers the stored (quantized) bytes of P experts: for small P."""
    return slot_matmul(x[:, None], w, expert[:, None])[:, 0]


def reduce_matmul(x: jax.Array, w: Weight, expert: jax.Array | None = None) -> jax.Array:
    """x [P, in] times W [in, out] (or its own expert of W [E, in, out] when `expert` [P] is given) as a
    float32 multiply and sum over `in`: one elementwise-plus-reduction that XLA can fuse with the gather
    and the dequantisation, reading the stored bytes once. Meant for a few rows (decode)."""
    chosen = w if expert is None else jax.tree.map(lambda a: a[expert], w)
    full, n_out = _operand(chosen, jnp.float32)
    xs = _pad_in(x, full.shape[-2]).astype(jnp.float32)
    return jnp.sum(xs[:, :, None] * full, axis=-2)[..., :n_out].astype(x.dtype)


def sorted_matmul(x: jax.Array, w: Weight, expert: jax.Array, grouped=ragged_matmul) -> jax.Array:
    """Row p times its own expert via a sort by expert, a grouped matmul (`ragged_matmul` or one of
    its signature, e.g. `pallas_ragged_matmul`) and the inverse permutation."""
    order = jnp.argsort(expert, stable=True)
    sizes = jnp.bincount(expert, length=num_experts(w))
    y = grouped(x[order], w, sizes)
    return y[jnp.argsort(order)]


def with_expert_axis(w: Weight) -> Weight:
    """A dense weight [in, out] as one expert [1, in, out]."""
    return jax.tree.map(lambda a: a[None], w)


def stored(w: Weight) -> jax.Array:
    """The stored values of a weight (int4 words or values, e4m3, or the plain array itself)."""
    return w.w if isinstance(w, Fp8Weight) else w.q if isinstance(w, Int4Weight) else w


def num_experts(w: Weight) -> int:
    """E of a stacked expert weight [E, in, out]."""
    return stored(w).shape[0]


def stored_bytes(w: Weight) -> int:
    """Device bytes of a weight: the stored values (int4: half a byte each) plus the scales."""
    bits = {jnp.dtype(jnp.int4): 4, jnp.dtype(jnp.uint4): 4}
    return sum(int(a.size) * bits.get(a.dtype, 8 * a.dtype.itemsize) // 8 for a in jax.tree.leaves(w))
