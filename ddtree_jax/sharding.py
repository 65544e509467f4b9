"""Device mesh and parameter placement: logical axes of each weight mapped onto mesh axes.

The mesh has axes ("data", "model"). The batch is split over "data"; over "model" (Megatron):

  "heads"     q_proj columns, o_proj rows: each device holds Hq / tp whole query heads
  "kv_heads"  k_proj, v_proj columns and the K/V cache heads: Hkv / tp heads per device, or, when
              there are fewer K/V heads than devices (tp % Hkv == 0), ONE head per device: device j
              holds K/V head j * Hkv // tp, the one its query heads [j * Hq/tp, (j+1) * Hq/tp) read.
              The placed k_proj / v_proj are then [H, tp * D]: each head repeated tp / Hkv times
              (`placed_shape`, `host_block`), a layout that is also correct GQA on one device.
  "kv_groups" a fused q/k/v projection [H, Hkv, Hq/Hkv + 2, D] (weights.join): Hkv / tp groups of a
              K/V head and its query heads per device; when fewer K/V heads than devices, tp groups of
              one K/V head and Hq / tp query heads, [H, tp, Hq/tp + 2, D] (each K/V head repeated,
              its query heads dealt out: the same heads the unfused k_proj, v_proj, q_proj give a device)
  "ff"        gate/up columns, down rows
  "vocab"     the embedding's rows and lm_head's columns (contiguous slices, in device order), padded
              with zero rows / columns to a multiple of tp (`placed_shape`, `host_block`), as vLLM and
              SGLang pad theirs: any vocabulary splits. `models.common.logits` gives the padded
              columns a logit no real token has, so nothing downstream ever picks a padded id.
  "experts"   stacked expert weights [E, ...] under expert parallelism: E / tp whole experts per device
              (under tensor parallelism inside experts their columns are "ff" instead: models/moe.py)

Per-device work runs inside `jax.shard_map` (engine.py) on local shapes, with explicit collectives
(collectives.py): an all-reduce after o_proj and down_proj, vocabulary-parallel argmax, top-k and
sampling. Everything else (norms, the drafter's fc) is replicated.

Beyond one host: call `jax.distributed.initialize()` first in every process (one process per host,
each seeing its local GPUs; `ddtree-generate --coordinator --num-processes --process-id` does, and
tests/test_multiprocess.py runs it); `jax.devices()` then lists the devices of all hosts, and `make_mesh`,
the placement and the shard_mapped programs below apply unchanged (keep "model" within a host, where
the all-reduces are fast: devices are ordered host by host, so a tp that divides the per-host count
does that). The loader's callbacks only read the shards of addressable devices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ddtree_jax.errors import DDTreeError
from ddtree_jax.weights import WeightSpec

DATA, MODEL = "data", "model"
SPLIT_AXES = ("heads", "kv_heads", "kv_groups", "ff", "vocab", "experts")  # logical axes split over "model"


def make_mesh(tp: int = 1, dp: int = 1) -> Mesh:
    """A ("data", "model") mesh over the first dp * tp devices."""
    devices = jax.devices()
    if tp * dp > len(devices):
        raise DDTreeError(f"--tp {tp} x --dp {dp} needs {tp * dp} devices, {len(devices)} available")
    return Mesh(np.array(devices[: tp * dp]).reshape(dp, tp), (DATA, MODEL))


def check_divisible(dims, tp: int, model: str) -> None:
    """Clear errors for a model that cannot be split `tp` ways (dims: config.LayerDims). Any
    vocabulary splits: the placement pads it to a multiple of tp (`Placement`)."""
    if tp == 1:
        return
    counts = {"num_attention_heads": dims.num_heads, "intermediate_size": dims.intermediate_size}
    for field, n in counts.items():
        if n % tp:
            raise DDTreeError(f"--tp {tp}: the {model}'s {field} ({n}) is not divisible by {tp}")
    hkv = dims.num_kv_heads
    if hkv % tp and tp % hkv:
        raise DDTreeError(
            f"--tp {tp}: the {model}'s num_key_value_heads ({hkv}) must divide or be a multiple of {tp}"
        )


@dataclasses.dataclass(frozen=True)
class Placement:
    """How each weight lies on the mesh; called as spec -> NamedSharding."""

    mesh: Mesh

    @property
    def tp(self) -> int:
        """Devices along "model"."""
        return self.mesh.shape[MODEL]

    def _kv_repeat(self, spec: WeightSpec) -> int:
        """How many times each K/V head is repeated in the placed weight (1 unless Hkv < tp)."""
        if "kv_heads" not in spec.axes or spec.heads >= self.tp:
            return 1
        return self.tp // spec.heads

    def partition_spec(self, spec: WeightSpec) -> PartitionSpec:
        """Logical axes -> mesh axes: the split axes on "model" (when it has more than one device)."""
        if self.tp == 1:
            return PartitionSpec()
        return PartitionSpec(*(MODEL if a in SPLIT_AXES else None for a in spec.axes))

    def _vocab_padding(self, spec: WeightSpec, shape: tuple[int, ...], rows: int) -> list | None:
        """Pad widths growing an array of `shape` to `rows` entries along "vocab" (None: no padding)."""
        dim = spec.axes.index("vocab")
        return None if shape[dim] == rows else [(0, rows - n if i == dim else 0) for i, n in enumerate(shape)]

    def placed_shape(self, spec: WeightSpec) -> tuple[int, ...]:
        """The global shape of the placed array (K/V heads repeated when fewer than devices, the
        vocabulary padded to a multiple of tp)."""
        r, tp = self._kv_repeat(spec), self.tp

        def placed(n: int, axis: str | None) -> int:
            if axis == "kv_heads":
                return n * r
            return -(-n // tp) * tp if axis == "vocab" else n

        shape = tuple(placed(n, a) for n, a in zip(spec.shape, spec.axes, strict=True))
        if "kv_groups" in spec.axes and tp > spec.heads and tp % spec.heads == 0:
            dim = spec.axes.index("kv_groups")  # [..., groups, Hq / groups + 2, D]
            per_group = (shape[dim + 1] - 2) * spec.heads // tp + 2
            shape = (*shape[:dim], tp, per_group, *shape[dim + 2 :])
        return shape

    def host_block(self, spec: WeightSpec, host: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
        """The block `index` of the placed array, read from the checkpoint's array `host` (only the
        block's own rows: padded vocabulary entries past the checkpoint's are zeros)."""
        r = self._kv_repeat(spec)
        if spec.parts:
            raise ValueError(f"{spec.hf_name}: a fused weight is read as its parts (checkpoint.start_tensor)")
        if "vocab" in spec.axes:
            dim = spec.axes.index("vocab")
            rows = range(self.placed_shape(spec)[dim])[index[dim]]  # the block's entries, padding included
            real = range(spec.shape[dim])[index[dim]]  # those in the checkpoint: a lazy read stops there
            block = host[index[:dim] + (slice(real.start, real.stop),) + index[dim + 1 :]]
            pad = self._vocab_padding(spec, block.shape, len(rows))
            return block if pad is None else np.pad(block, pad)
        if r == 1:
            return host[index]
        dim = spec.axes.index("kv_heads")
        head_dim = spec.shape[dim] // spec.heads
        cols = np.arange(self.placed_shape(spec)[dim])[index[dim]]
        src = (cols // head_dim) // r * head_dim + cols % head_dim  # placed column -> checkpoint column
        block = host[tuple(slice(None) if i == dim else s for i, s in enumerate(index))]
        return np.take(block, src, axis=dim)

    def place(self, spec: WeightSpec, whole: jax.Array) -> jax.Array:
        """A weight held whole (checkpoint layout, our [in, out]) -> the placed array on the mesh, with
        K/V heads repeated and the vocabulary padded as `host_block` does."""
        r = self._kv_repeat(spec)
        if "vocab" in spec.axes:
            pad = self._vocab_padding(spec, whole.shape, self.placed_shape(spec)[spec.axes.index("vocab")])
            whole = whole if pad is None else jnp.pad(whole, pad)
        if r > 1:
            dim = spec.axes.index("kv_heads")
            split = whole.shape[:dim] + (spec.heads, spec.shape[dim] // spec.heads) + whole.shape[dim + 1 :]
            whole = jnp.repeat(whole.reshape(split), r, axis=dim).reshape(self.placed_shape(spec))
        groups = self.placed_shape(spec)[spec.axes.index("kv_groups")] if "kv_groups" in spec.axes else 0
        if groups > spec.heads:  # K/V heads repeated, each group's query heads dealt out over its repeats
            dim, per, g = spec.axes.index("kv_groups"), groups // spec.heads, whole.shape[-2] - 2
            lead = whole.shape[:dim]
            q = whole[..., :g, :].reshape(*lead, groups, g // per, whole.shape[-1])
            kv = jnp.repeat(whole[..., g:, :], per, axis=dim)
            whole = jnp.concatenate([q, kv], axis=-2)
        return jax.device_put(whole, self(spec))

    def __call__(self, spec: WeightSpec) -> NamedSharding:
        for n, a in zip(self.placed_shape(spec), spec.axes, strict=True):
            heads = spec.heads * self._kv_repeat(spec) if a in ("heads", "kv_heads") else n
            if a in SPLIT_AXES and (n % self.tp or heads % self.tp):
                raise DDTreeError(f"{spec.hf_name}: its {a} dim ({n}) does not split over --tp {self.tp}")
        return NamedSharding(self.mesh, self.partition_spec(spec))


def param_sharding(mesh: Mesh) -> Placement:
    """spec -> NamedSharding (with the placed shape and host reads for the loader)."""
    return Placement(mesh)
