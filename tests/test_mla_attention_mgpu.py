"""The Mosaic GPU latent-cache (MLA) kernel against its jnp reference in jax's GPU interpreter on CPU,
and its CUDA lowering checked on CPU under an abstract H200 (layouts and the 227 kB shared-memory
bound, which the default Kimi-K2 tuning fills to 226 kB)."""

from __future__ import annotations

import zlib

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from test_mla_attention import SCALE, make_inputs
from test_tree_attention import H200, check_close

from ddtree_jax.kernels.mla_attention_mgpu import mla_attention_mgpu, mla_attention_reference
from ddtree_jax.kernels.tuning import resolve_mla_mgpu_tuning

BF16 = jnp.bfloat16

# (t, h, c, s, lengths, mask kind, window, tuning): each runs 10-30 s in the interpreter. Between
# them: one row tile and two, one split and several (float32 partials of both value halves), a
# pipeline longer than the slots, a shifted last tile, a window, an empty cache, rows that see
# nothing; Kimi-K2's latent width 512 in the first. The second runs under the race detector.
CASES = [
    # Decode at a TP8 shard's 8 heads, latent 512: 2 splits, a partial last tile, an empty cache.
    (1, 8, 512, 200, [200, 0], "ones", None, {"splits": 2}),
    # Verify, 96 rows (two tiles), 4 tiles of 64 through 2 slots (S = 240: shifted), one split.
    (12, 8, 128, 240, [230], "tree", None, {"splits": 1}),
    # Rows that see nothing, a window inside a tile, 2 splits.
    (16, 4, 256, 192, [150, 40], "sparse", 70, {"splits": 2}),
]


@pytest.mark.own_process  # jax's GPU interpreter (conftest)
@pytest.mark.parametrize("t,h,c,s,lengths,mask_kind,window,tuning", CASES)
def test_matches_reference(t, h, c, s, lengths, mask_kind, window, tuning):
    seed = zlib.crc32(repr((t, h, c, s, lengths, mask_kind, window)).encode())
    args = make_inputs(
        seed, b=len(lengths), t=t, h=h, c=c, r=64, s=s, lengths=lengths, mask_kind=mask_kind, dtype=BF16
    )
    races = t == 12
    interpret = plgpu.InterpretGPUParams(detect_races=True) if races else True
    out = mla_attention_mgpu(*args, softmax_scale=SCALE, window=window, interpret=interpret, **tuning)
    if races:
        assert not interpret_pallas_call.get_races().races_found
    check_close(out, mla_attention_reference(*args, softmax_scale=SCALE, window=window), BF16)


def test_default_tuning_for_kimi_k2_shapes():
    """64 heads (TP1) and 8 (TP8 shard) at 512 + 64: one 64-row tile per program; splits fill 132 SMs."""

    def tun(b, t, h, s):
        return resolve_mla_mgpu_tuning((b, t, h, 512), s, 64)

    decode = tun(1, 1, 64, 32768)
    assert (decode.tile_k, decode.stages, decode.mma_form) == (64, 2, "registers")
    assert (decode.row_tiles, decode.splits) == (1, 128)
    assert (tun(1, 1, 8, 32768).out_rows, tun(1, 64, 8, 32768).row_tiles) == (8, 8)
    assert tun(1, 64, 64, 32768).splits == 2 and tun(16, 64, 64, 32768).splits == 1


@pytest.mark.parametrize(
    "q_shape,s,r,kwargs,match",
    [
        ((1, 1, 64, 576), 1024, 64, {}, "latent dim"),
        ((1, 1, 64, 512), 1024, 32, {}, "rope dim"),
        ((1, 1, 64, 512), 32, 64, {}, "shorter than one tile"),
        ((1, 1, 64, 512), 1024, 64, {"stages": 3}, "shared memory"),
        ((1, 16, 8, 512), 1500, 64, {}, "not a multiple of 8"),
    ],
)
def test_rejects_bad_shapes_and_tunings(q_shape, s, r, kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_mla_mgpu_tuning(q_shape, s, r, **kwargs)


# ---- CUDA lowering on CPU ----


def lower_for_h200(b, t, h, s, c=512, r=64, **kwargs) -> str:
    shapes = (
        jax.ShapeDtypeStruct((b, t, h, c), BF16),
        jax.ShapeDtypeStruct((b, t, h, r), BF16),
        jax.ShapeDtypeStruct((b, s, c), BF16),
        jax.ShapeDtypeStruct((b, s, r), BF16),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b, t, c), BF16),
        jax.ShapeDtypeStruct((b, t, r), BF16),
        jax.ShapeDtypeStruct((b, t, t), jnp.int8),
    )
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        fn = jax.jit(lambda *a: mla_attention_mgpu(*a, softmax_scale=SCALE, **kwargs))
        return fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("t,h,b", [(1, 64, 1), (64, 64, 1), (1, 8, 16), (64, 8, 1)])
def test_lowers_for_cuda_kimi_k2_shapes(t, h, b):
    """Latent 512 + rope 64 at 32k, the default tuning (P from registers, 226 kB of shared memory)."""
    assert "mosaic_gpu" in lower_for_h200(b, t, h, 32768)


@pytest.mark.parametrize(
    "t,h,kwargs",
    [
        (16, 64, {"splits": 1, "window": 1000}),
        (1, 64, {"mma_form": "smem", "splits": 7}),
    ],
)
def test_lowers_for_cuda_other_tunings(t, h, kwargs):
    assert "mosaic_gpu" in lower_for_h200(2, t, h, 4096, **kwargs)


def test_kimi_k2_round_with_mosaic_attention_lowers_for_cuda():
    """`--attention mosaic` wired through the engine: a whole ddtree round at Kimi-K2 width (2 layers)
    lowers for CUDA with the Mosaic MLA kernel in the target and the Mosaic GQA kernel in the drafter."""
    import dataclasses

    from ddtree_jax import drafter, engine, target
    from ddtree_jax.bench.programs import synthetic_state
    from ddtree_jax.bench.shapes import SHAPES, draft_shape
    from ddtree_jax.programs import Shape
    from ddtree_jax.weights import assemble

    cfg = dataclasses.replace(SHAPES["kimi-k2"], num_layers=2)
    plan = engine.Plan(cfg, draft_shape(cfg, 1, 8), "ddtree", 64, 15, 15, "mosaic")

    def abstract(specs):
        return assemble(specs, lambda s: jax.ShapeDtypeStruct(s.shape, BF16))

    state = jax.eval_shape(lambda: synthetic_state(plan, Shape.of(plan, 1, 1024), 1024, 0, BF16))
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=H200
    )
    with jax.sharding.use_abstract_mesh(mesh):
        fn = jax.jit(lambda p, d, s: engine.decode_round(p, d, s, plan))
        args = (abstract(target.weight_specs(cfg)), abstract(drafter.weight_specs(plan.draft)), state)
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mla_attention_mgpu" in text and "tree_attention_mgpu" in text
