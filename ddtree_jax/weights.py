"""Weight declarations: one `WeightSpec` per tensor drives checkpoint loading, random init and sharding."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

Path_ = tuple[str | int, ...]
Params = dict[str, Any]  # nested dicts and lists of arrays


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One parameter: where it lives in our pytree, its HF tensor name, our shape and logical axes."""

    path: Path_
    hf_name: str
    shape: tuple[int, ...]  # our layout: linear weights are [in, out]
    axes: tuple[str | None, ...]  # logical axis per dim: "vocab", "heads", "kv_heads", "ff" or None
    transpose: bool = False  # HF nn.Linear stores [out, in]
    is_norm: bool = False  # RMSNorm weights initialise near 1
    heads: int = 0  # attention heads along the "heads" / "kv_heads" axis (0: none)
    stack: tuple[str, ...] = ()  # several HF tensors stacked on a new leading axis (hf_name: the first)
    float32: bool = False  # kept in float32 whatever the model's dtype (DeepSeek-V3's router, as HF keeps it)
    # A fused weight: the specs of the weights it joins (each loaded, placed and checked as its own spec,
    # then joined on the devices by `join`; hf_name: the first part's) and how they join: "qkv" (q, k, v
    # projections as [H, K/V groups, query heads per group + 2, D]: `join`), "kv" (k and v alone as
    # [H, K/V groups, 2, D]) or "stack" (on axis -2).
    parts: tuple[WeightSpec, ...] = ()
    fuse: str = ""

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape the HF checkpoint stores (of each stacked tensor)."""
        shape = self.shape[1:] if self.stack else self.shape
        return shape[::-1] if self.transpose else shape

    def pieces(self) -> list[WeightSpec]:
        """The specs of the stacked HF tensors, in stacking order ([self] when nothing is stacked); of
        a fused weight, its parts' pieces in order."""
        if self.parts:
            return [piece for part in self.parts for piece in part.pieces()]
        if not self.stack:
            return [self]
        one = dataclasses.replace(self, shape=self.shape[1:], axes=self.axes[1:], stack=())
        return [dataclasses.replace(one, hf_name=name) for name in self.stack]


def linear(
    path: Path_,
    hf_name: str,
    d_in: int,
    d_out: int,
    axes: tuple[str | None, str | None],
    heads: int = 0,
) -> WeightSpec:
    """An nn.Linear weight stored [out, in] by HF, kept [in, out] here."""
    return WeightSpec(path, hf_name, (d_in, d_out), axes, transpose=True, heads=heads)


def stacked_linear(
    path: Path_, hf_names: list[str], d_in: int, d_out: int, axes: tuple[str | None, ...]
) -> WeightSpec:
    """nn.Linear weights of several HF tensors (one per expert) stacked as [len(hf_names), in, out]."""
    shape = (len(hf_names), d_in, d_out)
    return WeightSpec(path, hf_names[0], shape, axes, transpose=True, stack=tuple(hf_names))


def fused_weight(
    path: Path_, parts: list[WeightSpec], how: str, shape: tuple[int, ...], axes: tuple
) -> WeightSpec:
    """One weight of our layout `shape` joined from the weights `parts` as `how` says (`join`)."""
    heads = shape[axes.index("kv_groups")] if "kv_groups" in axes else 0
    return WeightSpec(path, parts[0].hf_name, shape, axes, heads=heads, parts=tuple(parts), fuse=how)


def join(how: str, head_dim: int, arrays: list[jax.Array]) -> jax.Array:
    """A fused weight of its parts' arrays (placed: K/V heads already repeated, each device's block its
    own), in a layout whose every device block holds its own heads / columns of every part:

    "qkv":   q [..., H, Hq * D], k and v [..., H, Hkv * D] -> [..., H, Hkv, Hq / Hkv + 2, D]: per K/V head
             its query heads, then k, then v (q heads in HF's order: head h reads K/V head h // (Hq / Hkv))
    "kv":    k and v [..., H, Hkv * D] -> [..., H, Hkv, 2, D] ("qkv" without its query heads)
    "stack": [..., H, F] each -> [..., H, n, F]

    A device's block [..., H, n_local, ...] reshapes to one [H, N] matrix for free: one matmul.
    `head_dim`: D (the fused spec's last dim)."""
    if how == "stack":
        return jnp.stack(arrays, axis=-2)
    if how not in ("qkv", "kv"):
        raise ValueError(f"unknown fusion {how!r}")
    *q, k, v = arrays
    d = head_dim
    groups = k.shape[-1] // d
    lead = k.shape[:-1]
    kv = [k.reshape(*lead, groups, 1, d), v.reshape(*lead, groups, 1, d)]
    if not q:
        return jnp.concatenate(kv, axis=-2)
    return jnp.concatenate([q[0].reshape(*lead, groups, q[0].shape[-1] // (groups * d), d), *kv], axis=-2)


def split(how: str, head_dim: int, array: Any) -> list[Any]:
    """The parts of a fused weight as one device holds it (K/V heads not repeated): `join` undone."""
    if how == "stack":
        return [array[..., i, :] for i in range(array.shape[-2])]
    lead, per = array.shape[:-3], array.shape[-2]
    kv = [array[..., per - 2, :].reshape(*lead, -1), array[..., per - 1, :].reshape(*lead, -1)]
    return kv if how == "kv" else [array[..., : per - 2, :].reshape(*lead, -1), *kv]


def norm(path: Path_, hf_name: str, size: int) -> WeightSpec:
    """An RMSNorm weight."""
    return WeightSpec(path, hf_name, (size,), (None,), is_norm=True)


def stack_layers(specs: Iterable[WeightSpec]) -> list[WeightSpec]:
    """The specs with the per-layer ones (path ("layers", i, *rest)) merged into one spec per `rest`:
    path ("layers", *rest), shape [L, ...], a leading None axis (never split), `stack` naming the L HF
    tensors in layer order: the layout a scan over the layers reads (models/common.scan_stack)."""
    out: list[WeightSpec] = []
    groups: dict[tuple, list[WeightSpec]] = {}
    for spec in specs:
        if len(spec.path) < 3 or spec.path[0] != "layers" or not isinstance(spec.path[1], int):
            out.append(spec)
            continue
        if spec.stack:
            raise ValueError(f"{spec.hf_name}: an already stacked weight does not stack over layers")
        rest = spec.path[2:]
        if rest not in groups:
            groups[rest] = []
            out.append(spec)  # where the merged spec goes (replaced below)
        groups[rest].append(spec)
    merged = []
    for spec in out:
        rest = spec.path[2:] if spec.path[0] == "layers" and len(spec.path) >= 3 else None
        if rest is None or rest not in groups:
            merged.append(spec)
            continue
        merged.append(_merge_layers(groups[rest]))
    return merged


def _merge_layers(layers: list[WeightSpec]) -> WeightSpec:
    """One spec [L, ...] of a weight's per-layer specs (layers 0..L-1; a fused weight's parts merged
    part by part)."""
    spec = layers[0]
    if [s.path[1] for s in layers] != list(range(len(layers))):
        raise ValueError(f"{spec.hf_name}: layers {[s.path[1] for s in layers]} are not 0..L-1 in order")
    if any(
        (s.shape, s.axes, s.transpose, s.heads, s.float32, s.fuse)
        != (spec.shape, spec.axes, spec.transpose, spec.heads, spec.float32, spec.fuse)
        for s in layers
    ):
        raise ValueError(f"{spec.hf_name}: layers differ in shape or layout, cannot be stacked")
    parts = tuple(_merge_layers([s.parts[j] for s in layers]) for j in range(len(spec.parts)))
    return dataclasses.replace(
        spec,
        path=("layers", *spec.path[2:]),
        shape=(len(layers), *spec.shape),
        axes=(None, *spec.axes),
        stack=tuple(s.hf_name for s in layers),
        parts=parts,
    )


def set_path(tree: Params, path: Path_, value: Any) -> None:
    """Insert `value` at `path` in nested dicts/lists, creating containers as needed."""
    node: Any = tree
    for key, nxt in zip(path[:-1], path[1:], strict=True):
        empty: Any = [] if isinstance(nxt, int) else {}
        if isinstance(key, int):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = empty
        else:
            node.setdefault(key, empty)
        node = node[key]
    last = path[-1]
    if isinstance(last, int):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def assemble(specs: Iterable[WeightSpec], make: Callable[[WeightSpec], Any]) -> Params:
    """Build the parameter pytree by calling `make(spec)` for every spec."""
    tree: Params = {}
    for spec in specs:
        set_path(tree, spec.path, make(spec))
    return tree


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_weight(key: jax.Array, shape: tuple[int, ...], is_norm: bool, scale: float, dtype) -> jax.Array:
    """One random weight: normal * scale, or 1 + 0.1 * normal for a norm (one program per shape, kept
    across calls)."""
    # Noise in float32, except for tensors over 2^30 elements (Kimi-K2's stacked experts: 5.6 G), drawn
    # in `dtype` so that a float32 copy does not double the peak memory.
    noise = jax.random.normal(key, shape, jnp.float32 if math.prod(shape) <= 1 << 30 else dtype)
    return (1.0 + 0.1 * noise if is_norm else scale * noise).astype(dtype)


def random_params(
    specs: list[WeightSpec],
    seed: int,
    dtype: jnp.dtype,
    scale: float = 0.02,
    place: Callable[[WeightSpec, jax.Array], jax.Array] | None = None,
) -> Params:
    """Random weights made on the device (normal * scale, norms near 1): for benchmarks of shapes.

    `place` (e.g. `sharding.Placement.place`) puts each weight on a mesh; the values do not depend on it.
    """
    key = jax.random.key(seed)

    def make(spec: WeightSpec) -> jax.Array:
        kind = jnp.float32 if spec.float32 else dtype
        whole = _random_weight(next(keys), spec.shape, spec.is_norm, scale, kind)
        return whole if place is None else place(spec, whole)

    keys = iter(jax.random.split(key, len(specs)))
    return assemble(specs, make)
