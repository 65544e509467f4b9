"""Device mesh and parameter placement: logical axes of each weight mapped onto mesh axes."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ddtree_jax.errors import DDTreeError
from ddtree_jax.weights import WeightSpec


def make_mesh(tp: int = 1, dp: int = 1) -> Mesh:
    """A ("data", "model") mesh over the first dp * tp devices."""
    devices = jax.devices()
    if tp * dp > len(devices):
        raise DDTreeError(f"--tp {tp} x --dp {dp} needs {tp * dp} devices, {len(devices)} available")
    return Mesh(np.array(devices[: tp * dp]).reshape(dp, tp), ("data", "model"))


def param_sharding(mesh: Mesh):
    """spec -> NamedSharding. On a one-device model axis every weight is replicated."""

    def sharding(spec: WeightSpec) -> NamedSharding:
        del spec  # tensor parallelism (splitting "heads", "ff", "vocab" over "model") is its own issue
        return NamedSharding(mesh, PartitionSpec())

    return sharding
