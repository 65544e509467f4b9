"""moe.run_experts on every expert weight format and dispatch, the Pallas grouped dispatch included
(interpret mode), against a NumPy loop over tokens; the same on 8 fake devices with experts split by
expert (ep) or by column (tp); and the MoE layer with the Pallas dispatch lowered for CUDA on the CPU.

Shapes are small but legal for the kernel's Triton blocks (powers of two, at least 16), so the Pallas
path is the one tested, not its ragged_dot fallback (`moe.grouped_blocks`)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ddtree_jax.models import moe
from ddtree_jax.quant import arrays, formats
from ddtree_jax.sharding import make_mesh

E, H, I, K = 8, 128, 128, 2  # experts, hidden, expert width, top-k


def _expert(fmt: str, rows: int, cols: int, seed: int) -> arrays.Weight:
    """A random [E, rows, cols] expert stack in `fmt` (plain float32, fp8 128-blocks, int4 group 32)."""
    rng = np.random.default_rng(seed)
    if fmt == "int4":
        q = rng.integers(-8, 8, size=(E, cols, rows)).astype(np.int8)
        scale = (0.01 + 0.02 * rng.random((E, cols, rows // 32))).astype(ml_dtypes.bfloat16)
        words, s = arrays.int4_host(formats.pack_int4(q), scale, rows, 32)
        return arrays.Int4Weight(jnp.asarray(words), jnp.asarray(s), 32)
    if fmt == "fp8":
        w = rng.standard_normal((E, cols, rows)).astype(ml_dtypes.float8_e4m3fn)
        s = (0.01 + 0.05 * rng.random((E, cols // 128, rows // 128))).astype(np.float32)
        wh, sh = arrays.fp8_host(w, s, (128, 128))
        return arrays.Fp8Weight(jnp.asarray(wh), jnp.asarray(sh), (rows, cols), (128, 128))
    return jnp.asarray(0.1 * rng.standard_normal((E, rows, cols)).astype(np.float32))


@functools.cache
def _layer(fmt: str) -> dict:
    return {
        "router": jnp.asarray(np.random.default_rng(9).standard_normal((H, E)).astype(np.float32)),
        "experts_gate": _expert(fmt, H, I, 1),
        "experts_up": _expert(fmt, H, I, 2),
        "experts_down": _expert(fmt, I, H, 3),
    }


def _reference(p: dict, x: np.ndarray, routing: moe.Routing) -> np.ndarray:
    """Per token, the routing-weighted SwiGLU of its chosen experts (float64 NumPy)."""
    gate, up, down = (
        np.asarray(arrays.dequantize(p[n], jnp.float32), np.float64) for n in moe.EXPERT_WEIGHTS
    )
    out = np.zeros((x.shape[0], H))
    for t, (chosen, weights) in enumerate(
        zip(np.asarray(routing.experts), np.asarray(routing.weights), strict=True)
    ):
        for e, w in zip(chosen, weights, strict=True):
            g, u = x[t] @ gate[e], x[t] @ up[e]
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


def _inputs(tokens: int, p: dict) -> tuple[jax.Array, moe.Routing]:
    x = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, H)).astype(np.float32))
    return x, moe.route(p["router"], x, K, True)


def _close(got, want) -> None:
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


# 20 tokens: 40 rows, more than one 16-row tile; the split dispatch (decode) at one token only
@pytest.mark.parametrize(
    "fmt,tokens,interpreted",
    [
        ("plain", 1, moe.INTERPRETED_DISPATCHES),
        ("plain", 20, ("grouped_interpret",)),
        ("int4", 3, ("grouped_interpret",)),
        ("fp8", 3, ("grouped_interpret",)),
    ],
)
def test_every_dispatch_on_every_format(fmt, tokens, interpreted):
    """One path: every dispatch reads plain, INT4 and FP8 experts and equals the NumPy loop."""
    p = _layer(fmt)
    x, routing = _inputs(tokens, p)
    want = _reference(p, np.asarray(x, np.float64), routing)
    for dispatch in moe.DISPATCHES + interpreted:
        _close(moe.run_experts(p, x, routing, dispatch=dispatch), want)


def test_blocks_for_qwen3_30b_a3b():
    """Legal Triton blocks for the Qwen3-30B-A3B experts on one device and split over 2, 4, 8 devices."""
    shape = jax.ShapeDtypeStruct
    assert moe.grouped_blocks(shape((128, 2048, 768), jnp.bfloat16)) == (128, 128)
    assert moe.grouped_blocks(shape((128, 768, 2048), jnp.bfloat16)) == (128, 128)
    assert moe.grouped_blocks(shape((16, 2048, 768), jnp.bfloat16)) == (128, 128)  # ep over 8
    widths = {2: 128, 4: 64, 8: 32}
    for tp, block in widths.items():
        assert moe.grouped_blocks(shape((128, 2048, 768 // tp), jnp.bfloat16)) == (128, block)
        assert moe.grouped_blocks(shape((128, 768 // tp, 2048), jnp.bfloat16)) == (block, 128)
    assert moe.grouped_blocks(shape((8, 32, 24), jnp.float32)) is None  # 24 columns: ragged_dot


def test_choose_dispatch_by_backend():
    assert moe.choose_dispatch(1, "cpu") == "gather" and moe.choose_dispatch(5, "cpu") == "sorted"
    assert moe.choose_dispatch(512, "gpu") == "grouped"
    assert moe.choose_dispatch(moe.GPU_GATHER_MAX_TOKENS + 1, "gpu") == "grouped"


@pytest.mark.parametrize("fmt,sharding", [("plain", "ep"), ("plain", "tp"), ("int4", "ep"), ("fp8", "ep")])
def test_grouped_on_eight_devices(fmt, sharding):
    """8 experts over 8 devices (ep: one each, the other slots absent) or their 128 columns (tp: 16
    each): the psum of the devices' partial sums equals the one-device NumPy loop."""
    p = _layer(fmt)
    x, routing = _inputs(5, p)
    want = _reference(p, np.asarray(x, np.float64), routing)
    mesh = make_mesh(8)
    col = P("model", None, None) if sharding == "ep" else P(None, None, "model")
    row = P("model", None, None) if sharding == "ep" else P(None, "model", None)
    experts = {k: p[k] for k in moe.EXPERT_WEIGHTS}
    specs = {
        k: jax.tree.map(lambda _, s=(row if k == "experts_down" else col): s, v) for k, v in experts.items()
    }

    def local(experts, x, routing):
        return jax.lax.psum(
            moe.run_experts(experts, x, routing, sharding, "model", "grouped_interpret"), "model"
        )

    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P()), out_specs=P(), check_vma=False)
    _close(jax.jit(fn)(experts, x, routing), want)


H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "tokens,width,dispatch", [(1, 768, "grouped"), (1, 768, "grouped_split"), (64, 192, "grouped")]
)
def test_moe_layer_lowers_for_cuda(tokens, width, dispatch):
    """The Qwen3-30B-A3B expert layer (128 experts, hidden 2048, top-8) with a Pallas dispatch passes
    Triton's shape rules on the CPU; width 192 is one device's columns under tp 4."""
    spec = jax.ShapeDtypeStruct
    p = {
        "router": spec((2048, 128), jnp.bfloat16),
        "experts_gate": spec((128, 2048, width), jnp.bfloat16),
        "experts_up": spec((128, 2048, width), jnp.bfloat16),
        "experts_down": spec((128, width, 2048), jnp.bfloat16),
    }
    x = spec((tokens, 2048), jnp.bfloat16)
    layer = functools.partial(moe.experts_ffn, experts_per_token=8, normalize=True, dispatch=dispatch)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(layer).trace(p, x).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "ragged_dot" not in text  # the kernel, no fallback
