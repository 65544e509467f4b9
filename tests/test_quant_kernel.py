"""The Pallas grouped matmul over quantized experts against its reference, in interpret mode."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ddtree_jax.kernels.quant_matmul import grouped_matmul, grouped_matmul_reference, tile_schedule
from ddtree_jax.quant import arrays, formats


def _weight(fmt: str, e: int, k: int, n: int, seed: int) -> arrays.Weight:
    """A random [E, K, N] weight in `fmt` (fp8 with partial 128-blocks along K when K % 128)."""
    rng = np.random.default_rng(seed)
    if fmt == "int4":
        q = rng.integers(-8, 8, size=(e, n, k)).astype(np.int8)
        scale = (0.01 + 0.05 * rng.random((e, n, k // 32))).astype(ml_dtypes.bfloat16)
        words, s = arrays.int4_host(formats.pack_int4(q), scale, k, 32)
        return arrays.Int4Weight(jnp.asarray(words), jnp.asarray(s), 32)
    if fmt == "fp8":
        w = rng.standard_normal((e, n, k)).astype(ml_dtypes.float8_e4m3fn)
        s = (0.01 + rng.random((e, -(-n // 128), -(-k // 128)))).astype(np.float32)
        wh, sh = arrays.fp8_host(w, s, (128, 128))
        return arrays.Fp8Weight(jnp.asarray(wh), jnp.asarray(sh), (k, n), (128, 128))
    return jnp.asarray(0.1 * rng.standard_normal((e, k, n)).astype(np.float32))


def test_tile_schedule_covers_each_group_in_tiles():
    e, start, end = map(np.asarray, tile_schedule(jnp.array([3, 0, 17, 1]), 25, 16))
    real = [(int(a), int(b), int(c)) for a, b, c in zip(e, start, end, strict=True) if b < c]
    assert real == [(0, 0, 3), (2, 3, 19), (2, 19, 20), (3, 20, 21)]
    assert len(e) == 4 + 25 // 16


@pytest.mark.parametrize("fmt", ["int4", "fp8", "plain"])
@pytest.mark.parametrize("sizes", [[16, 1, 20], [2, 0, 1]])
def test_kernel_equals_reference(fmt, sizes):
    k = 200 if fmt == "fp8" else 512  # fp8: K padded to whole blocks (256)
    w = _weight(fmt, 3, k, 64, seed=len(sizes) + sum(sizes))
    rows = sum(sizes) + (1 if sizes == [2, 0, 1] else 0)  # one row past the groups: zeros
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    experts = arrays.kernel_experts(w)
    want = grouped_matmul_reference(x, experts, group_sizes)
    # the reference against quant.arrays' own dequantisation (an independent jnp path)
    np.testing.assert_allclose(want, arrays.ragged_matmul(x, w, group_sizes), rtol=1e-6, atol=1e-5)
    got = grouped_matmul(x, experts, group_sizes, tile_n=64, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    if sizes == [2, 0, 1]:  # K split into partial sums
        split = grouped_matmul(x, experts, group_sizes, tile_n=64, splits=2, interpret=True)
        np.testing.assert_allclose(np.asarray(split), np.asarray(want), rtol=1e-5, atol=1e-4)


H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_kernel_lowers_for_cuda():
    """Triton shape rules checked on the CPU (no GPU): the Kimi-K2 expert shape, every format."""
    x = jax.ShapeDtypeStruct((8, 7168), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((384,), jnp.int32)
    weights = {
        "int4": arrays.Int4Weight(
            jax.ShapeDtypeStruct((384, 896, 2048), jnp.int32),
            jax.ShapeDtypeStruct((384, 224, 2048), jnp.bfloat16),
            32,
        ),
        "fp8": arrays.Fp8Weight(
            jax.ShapeDtypeStruct((384, 7168, 2048), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((384, 56, 16), jnp.float32),
            (7168, 2048),
            (128, 128),
        ),
        "bf16": jax.ShapeDtypeStruct((384, 7168, 2048), jnp.bfloat16),
    }
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    for w in weights.values():
        with jax.sharding.use_abstract_mesh(mesh):
            fn = jax.jit(arrays.pallas_ragged_matmul)
            text = fn.trace(x, w, sizes).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
