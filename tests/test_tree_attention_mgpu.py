"""The Mosaic GPU tree-attention kernel against the jnp reference in jax's GPU interpreter on CPU (TMA,
barriers, wgmma and the warpgroups run as threads; P goes through shared memory there), and its CUDA
lowering checked on CPU under an abstract H200 (layouts and the 227 kB shared-memory bound)."""

from __future__ import annotations

import zlib

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from test_tree_attention import H200, check_close, make_inputs

from ddtree_jax import attention
from ddtree_jax.kernels.tree_attention_mgpu import tree_attention_mgpu, tree_attention_reference
from ddtree_jax.kernels.tuning import SMEM_LIMIT, resolve_tree_mgpu_tuning, tree_mgpu_smem_bytes

BF16, F16 = jnp.bfloat16, jnp.float16

# (t, g, hkv, s, lengths, mask kind, dtype, window, tuning): every case runs 10-30 s in the
# interpreter, so four that between them cover: one and two compute warpgroups (with the ping-pong
# barrier), one and two row tiles, one split and several (float32 partials), pipelines longer than the
# stages (slot reuse), a cache length that is not a multiple of the tile (the shifted last tile), a
# window start inside a tile, lengths that differ per sequence, empty caches and rows that see
# nothing, the in-flight tiles, two K/V heads. The third runs under the race detector.
CASES = [
    # Decode: 4 rows of a 64-row tile, 2 splits of one tile, a 3-token row.
    (1, 4, 1, 256, [256, 3], "ones", BF16, None, {"splits": 2}),
    # Verify, 64 rows: 5 tiles of 64 through 2 slots, a shifted last tile (S = 320), an empty cache.
    (16, 4, 1, 320, [300, 0], "tree", BF16, None, {"tile_k": 64, "splits": 1}),
    # 128 rows: two compute warpgroups in ping-pong, two K/V heads, a window, 2 splits, 3 stages.
    (64, 2, 2, 320, [320], "causal", BF16, 100, {"tile_k": 64, "splits": 2, "stages": 3}),
    # 132 rows: two row tiles of 128, rows that see no token at all, float16.
    (33, 4, 1, 192, [190, 64], "sparse", F16, 40, {"tile_k": 64, "splits": 1}),
    # The H200 check's T = 16 window case, small: a window start inside a tile, 2 splits, and a cache
    # of 200 (a multiple of 8, not of the tile: the last tile shifted back to row 136).
    (16, 4, 1, 200, [200, 150], "tree", BF16, 60, {"tile_k": 64, "splits": 2}),
]


@pytest.mark.own_process  # jax's GPU interpreter (conftest)
@pytest.mark.parametrize("t,g,hkv,s,lengths,mask_kind,dtype,window,tuning", CASES)
def test_matches_reference(t, g, hkv, s, lengths, mask_kind, dtype, window, tuning):
    seed = zlib.crc32(repr((t, g, hkv, s, lengths, mask_kind, window)).encode())
    args = make_inputs(
        seed, b=len(lengths), t=t, hkv=hkv, g=g, d=64, s=s, lengths=lengths, mask_kind=mask_kind, dtype=dtype
    )
    races = hkv > 1
    interpret = plgpu.InterpretGPUParams(detect_races=True) if races else True
    out = tree_attention_mgpu(*args, window=window, interpret=interpret, **tuning)
    if races:
        assert not interpret_pallas_call.get_races().races_found
    check_close(out, tree_attention_reference(*args, window=window), BF16)


def test_default_tuning_for_qwen3_8b_shapes():
    """Hq 32, Hkv 8, D 128: one compute warpgroup up to 64 packed rows, two in ping-pong above;
    splits fill 132 SMs; every default fits the shared memory."""

    def tun(b, t, s, **kw):
        return resolve_tree_mgpu_tuning((b, t, 32, 128), (b, 8, s, 128), **kw)

    decode, verify = tun(1, 1, 32768), tun(16, 64, 32768)
    assert (decode.tile_k, decode.stages, decode.mma_form, decode.pingpong) == (128, 2, "registers", False)
    assert (decode.compute_wgs, decode.row_tiles, decode.out_rows, decode.splits) == (1, 1, 8, 16)
    assert (verify.compute_wgs, verify.row_tiles, verify.pingpong, verify.splits) == (2, 2, True, 1)
    assert tun(1, 16, 8192).compute_wgs == 1 and tun(1, 64, 1024).splits == 8  # 128 programs
    assert tun(16, 1, 8192).splits == 1 and tun(4, 1, 8192).splits == 4
    for t in (1, 16, 64):
        for b, s in ((1, 1024), (16, 32768)):
            assert tree_mgpu_smem_bytes(tun(b, t, s), 128) <= SMEM_LIMIT
    assert tun(1, 1, 104).tile_k == 64


@pytest.mark.parametrize(
    "q_shape,cache_shape,kwargs,match",
    [
        ((1, 1, 32, 128), (1, 8, 32, 128), {}, "shorter than one tile"),
        ((1, 1, 32, 96), (1, 8, 1024, 96), {}, "head dim"),
        ((1, 1, 30, 128), (1, 8, 1024, 128), {}, "multiple of K/V heads"),
        ((1, 64, 32, 128), (1, 8, 1024, 128), {"stages": 3, "splits": 2}, "shared memory"),
        ((1, 1, 32, 128), (1, 8, 1024, 128), {"mma_form": "tmem"}, "mma_form"),
        ((2, 16, 32, 128), (2, 8, 1500, 128), {}, "not a multiple of 8"),
    ],
)
def test_rejects_bad_shapes_and_tunings(q_shape, cache_shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_tree_mgpu_tuning(q_shape, cache_shape, **kwargs)


def test_rejects_float32():
    args = make_inputs(0, b=1, t=1, hkv=1, g=2, d=64, s=64, lengths=[5], mask_kind="ones", dtype=jnp.float32)
    with pytest.raises(ValueError, match="16-bit"):
        tree_attention_mgpu(*args, interpret=True)


# ---- CUDA lowering on CPU: Mosaic GPU's layout inference and shared-memory check, no GPU. ----


def lower_for_h200(b, t, hkv, g, d, s, dtype=BF16, **kwargs) -> str:
    shapes = (
        jax.ShapeDtypeStruct((b, t, hkv * g, d), dtype),
        jax.ShapeDtypeStruct((b, hkv, s, d), dtype),
        jax.ShapeDtypeStruct((b, hkv, s, d), dtype),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b, t, hkv, d), dtype),
        jax.ShapeDtypeStruct((b, t, hkv, d), dtype),
        jax.ShapeDtypeStruct((b, t, t), jnp.int8),
    )
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        fn = jax.jit(lambda *a: tree_attention_mgpu(*a, **kwargs))
        return fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "b,t,s",
    [(1, 1, 1024), (16, 1, 32768), (4, 16, 8192), (16, 64, 32768)],
)
def test_lowers_for_cuda_qwen3_8b_shapes(b, t, s):
    """Hq 32, Hkv 8, D 128 at the engine's tree sizes: the default tuning (P from registers)."""
    assert "mosaic_gpu" in lower_for_h200(b, t, 8, 4, 128, s)


@pytest.mark.parametrize(
    "t,g,d,dtype,kwargs",
    [
        (64, 4, 128, BF16, {"splits": 1, "window": 500}),
        (64, 4, 128, BF16, {"mma_form": "smem", "splits": 3}),
        (16, 4, 128, BF16, {"tile_k": 64, "stages": 4, "splits": 2}),
        (64, 4, 128, F16, {"pingpong": False, "tile_k": 256, "stages": 1}),
    ],
)
def test_lowers_for_cuda_other_tunings(t, g, d, dtype, kwargs):
    assert "mosaic_gpu" in lower_for_h200(2, t, 8, g, d, 1024, dtype, **kwargs)


@pytest.mark.parametrize("splits", [None, 1])
def test_lowers_for_cuda_bench_window_check(splits):
    """scripts/bench_mosaic_attention.py's T = 16 window check (B 2, Hkv 8, G 4, D 128, window 300) at
    S = 1528: a multiple of 8 whose last tile starts at row 1400 (not a multiple of 128)."""
    assert "mosaic_gpu" in lower_for_h200(2, 16, 8, 4, 128, 1528, window=300, splits=splits)


def test_cache_not_a_multiple_of_8_goes_to_triton():
    """The H200 check's first form of that case, S = 1500: Mosaic GPU cannot read the cache (its TMA
    reads 8-row tiles; the kernel refuses it), so the "mosaic" dispatch lowers the Triton kernel."""
    with pytest.raises(ValueError, match="not a multiple of 8"):
        lower_for_h200(2, 16, 8, 4, 128, 1500, window=300)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in make_inputs(
        0, b=2, t=16, hkv=8, g=4, d=128, s=1500, lengths=[1500, 1100], mask_kind="tree", dtype=BF16
    )]  # fmt: skip
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        fn = jax.jit(lambda *a: attention.kernel("mosaic", "gqa")(*a, window=300))
        text = fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "mosaic_gpu" not in text


def test_dispatch_matches_reference_for_a_cache_not_a_multiple_of_8():
    """The "mosaic" dispatch at S = 100 (the Triton kernel, interpreted) against the jnp reference."""
    args = make_inputs(5, b=2, t=16, hkv=1, g=4, d=64, s=100, lengths=[100, 37], mask_kind="tree", dtype=BF16)
    out = attention.kernel("mosaic", "gqa")(*args, window=30, interpret=True)
    check_close(out, tree_attention_reference(*args, window=30), BF16)
