"""kernels.fused_experts: its tile schedule and INT4 step order against NumPy; the Mosaic GPU kernels in
GPU interpret mode against a NumPy loop over tokens and slots (bf16, FP8, INT4; 1 to 64 tokens; an
expert chosen twice by one token, by many tokens, slots held elsewhere); the `fused` dispatch of
moe.run_experts on 8 fake devices (ep, tp); and the CUDA lowering of the Qwen3-30B-A3B and Kimi-K2
shard shapes on the CPU.

Interpret mode costs ~10 s a call (mostly XLA compiling the interpreter), so shapes are the smallest
the kernel tiles: hidden and expert width 128 (INT4: one 512-row step of which 384 rows lie past K and
read zeros, as Qwen3-30B-A3B's width 768 does)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ddtree_jax.kernels import fused_experts as fe
from ddtree_jax.models import moe
from ddtree_jax.quant import arrays, formats
from ddtree_jax.sharding import make_mesh

E, H, I, K = 4, 128, 128, 2  # experts, hidden, expert width, slots per token


def _expert(fmt: str, rows: int, cols: int, seed: int, experts: int = E) -> arrays.Weight:
    """A random [experts, rows, cols] stack: bf16, FP8 with 128-blocks, or INT4 words with groups of 32."""
    rng = np.random.default_rng(seed)
    if fmt == "int4":
        q = rng.integers(-8, 8, size=(experts, cols, rows)).astype(np.int8)
        scale = (0.01 + 0.02 * rng.random((experts, cols, rows // 32))).astype(ml_dtypes.bfloat16)
        words, s = arrays.int4_host(formats.pack_int4(q), scale, rows, 32)
        return arrays.Int4Weight(jnp.asarray(words), jnp.asarray(s), 32)
    if fmt == "fp8":
        w = rng.standard_normal((experts, cols, rows)).astype(ml_dtypes.float8_e4m3fn)
        s = (0.005 + 0.02 * rng.random((experts, cols // 128, rows // 128))).astype(np.float32)
        wh, sh = arrays.fp8_host(w, s, (128, 128))
        return arrays.Fp8Weight(jnp.asarray(wh), jnp.asarray(sh), (rows, cols), (128, 128))
    return jnp.asarray(0.1 * rng.standard_normal((experts, rows, cols)), jnp.bfloat16)


@functools.cache
def _experts(fmt: str) -> tuple:
    return _expert(fmt, H, I, 1), _expert(fmt, H, I, 2), _expert(fmt, I, H, 3)


def _kernel_weights(*ws) -> list:
    """The package's weights as the kernel takes them (quant.arrays.expert_weight)."""
    return [arrays.expert_weight(w) for w in ws]


def _routing(tokens: int, seed: int) -> tuple[jax.Array, ...]:
    """x [N, H] bf16, experts [N, K] (repeats allowed: a token may choose one expert twice), held
    slots (about one in six elsewhere), routing weights."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, H)), jnp.bfloat16)
    experts = rng.integers(0, E, (tokens, K)).astype(np.int32)
    experts[0] = experts[0, 0]  # token 0 chooses one expert twice
    here = rng.random((tokens, K)) > 1 / 6
    here[0] = True
    weights = jnp.asarray(rng.random((tokens, K)), jnp.bfloat16)
    return x, jnp.asarray(experts), jnp.asarray(here), weights


def _numpy_loop(x, experts, here, weights, gate, up, down) -> np.ndarray:
    """Per token and held slot: weight * down(silu(x gate) * (x up)), float64 over the dequantised weights."""
    g, u, d = (np.asarray(arrays.dequantize(w, jnp.float32), np.float64) for w in (gate, up, down))
    xs = np.asarray(x.astype(jnp.float32), np.float64)
    out = np.zeros((xs.shape[0], d.shape[-1]))
    for t in range(xs.shape[0]):
        for e, held, w in zip(
            np.asarray(experts[t]), np.asarray(here[t]), np.asarray(weights[t], np.float64), strict=True
        ):
            if held:
                a, b = xs[t] @ g[e], xs[t] @ u[e]
                out[t] += w * ((a / (1 + np.exp(-a)) * b) @ d[e])
    return out


def _close(got, want) -> None:
    """bf16 activations and outputs (and bf16-rounded FP8 weights): within 1.5% of the largest output."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    np.testing.assert_allclose(got, want, rtol=1.5e-2, atol=1.5e-2 * np.abs(want).max())


@pytest.mark.parametrize(
    "tile_t,tokens", [(8, 1), (8, 5), (16, 40), (8, 64)], ids=["decode", "few", "wide", "many"]
)
def test_schedule_against_numpy(tile_t, tokens):
    """Every held pair in a tile of its expert, in token order, tiles of one expert consecutive and full
    but the last; padding rows point nowhere; the tile count within `max_tiles`."""
    num_experts, k = 6, 3
    rng = np.random.default_rng(tokens)
    experts = rng.integers(0, num_experts, (tokens, k))
    here = rng.random((tokens, k)) > 0.25
    plan = fe.schedule(jnp.asarray(experts, jnp.int32), jnp.asarray(here), num_experts, tile_t)
    tile_expert, row, source = (np.asarray(a) for a in plan)
    assert tile_expert.shape == (fe.max_tiles(tokens * k, num_experts, tile_t),)
    want_rows = []  # NumPy: per expert, its held pairs in (token, slot) order packed into fresh tiles
    tile = 0
    for e in range(num_experts):
        pairs = [(t, s) for t in range(tokens) for s in range(k) if here[t, s] and experts[t, s] == e]
        for i, (t, s) in enumerate(pairs):
            want_rows.append((t, s, (tile + i // tile_t) * tile_t + i % tile_t))
        tiles = -(-len(pairs) // tile_t)
        assert list(tile_expert[tile : tile + tiles]) == [e] * tiles
        tile += tiles
    assert (tile_expert[tile:] == -1).all()
    for t, s, r in want_rows:
        assert row[t, s] == r and source[r] == t
    assert (source >= 0).sum() == len(want_rows)


def test_int4_step_order_against_numpy():
    """The four stacked boxes of word rows 4g + i and nibble b of each give, at tile row b 64 + i 16 + g,
    weight row `int4_permutation` says: modelled in NumPy on packed words of a 1024-row matrix."""
    rows, cols = 1024, 8
    q = np.random.default_rng(0).integers(-8, 8, (cols, rows)).astype(np.int8)
    words = np.asarray(arrays.int4_host(formats.pack_int4(q), np.ones((cols, rows // 32)), rows, 32)[0])
    view = words.reshape(rows // 32, 4 * cols)  # the kernel's [K/32, 4 N] view of [K/8, N] words
    perm = fe.int4_permutation(rows)
    for step in range(rows // fe.INT4_STEP):
        boxes = view[step * 16 : (step + 1) * 16]
        stack = np.concatenate([boxes[:, i * cols : (i + 1) * cols] for i in range(4)])  # [64, N]
        tile = np.concatenate(
            [((stack.view(np.uint32) >> (4 * b)) & 0xF).astype(np.int32) - 8 for b in range(8)]
        )
        np.testing.assert_array_equal(tile, q.T[perm[step * fe.INT4_STEP : (step + 1) * fe.INT4_STEP]])


# bf16 at 1, 3, 8 and 64 tokens (8-row tiles of one pair; tiles of 32, several per expert); FP8 and
# INT4 at 3 (an expert chosen twice by token 0, a slot held elsewhere) and INT4 at 64 (~10 s a case)
@pytest.mark.own_process  # jax's GPU interpreter (conftest)
@pytest.mark.parametrize(
    "fmt,tokens",
    [("plain", 1), ("plain", 3), ("plain", 8), ("plain", 64), ("fp8", 3), ("int4", 3), ("int4", 64)],
)
def test_fused_kernel_against_numpy_loop(fmt, tokens):
    """The two kernels (interpreted) and the jnp reference both equal the NumPy loop."""
    gate, up, down = _experts(fmt)
    args = _routing(tokens, tokens)
    want = _numpy_loop(*args, gate, up, down)
    _close(fe.fused_experts(*args, *_kernel_weights(gate, up, down), interpret=True), want)
    _close(fe.fused_experts_reference(*args, *_kernel_weights(gate, up, down)), want)


def test_supported_shapes():
    """The kernel takes bf16 activations and 64-multiple weights; float32, or Qwen3-30B-A3B's 96
    columns a device under tp 8, go elsewhere (moe's fallback)."""
    bf16 = jnp.bfloat16

    def shape(dims, dtype):
        return arrays.expert_weight(jax.ShapeDtypeStruct(dims, dtype))

    assert fe.supported(
        shape((128, 2048, 768), bf16), shape((128, 2048, 768), bf16), shape((128, 768, 2048), bf16), bf16
    )
    narrow = shape((128, 2048, 96), bf16)
    assert not fe.supported(narrow, narrow, shape((128, 96, 2048), bf16), bf16)
    assert fe.why_not(shape((4, 128, 128), jnp.float32), jnp.float32) is not None
    assert not fe.supported(*_kernel_weights(*_experts("fp8")[:2], _experts("int4")[2]), bf16)  # mixed
    as_int4 = arrays.as_int4(_experts("int4")[0])
    assert "int32 words" in fe.why_not(arrays.expert_weight(as_int4), bf16)
    assert moe.FUSED_MAX_TOKENS == 0  # off as measured on the H200 (moe.py): gather, then grouped
    assert moe.choose_dispatch(1, "gpu", fused=True) == "gather"
    assert moe.choose_dispatch(moe.GPU_GATHER_MAX_TOKENS + 1, "gpu", fused=True) == "grouped"


def test_fused_window_when_turned_on(monkeypatch):
    """With a fused window, Hopper takes `fused` up to it and the gather/grouped rule above it."""
    monkeypatch.setattr(moe, "FUSED_MAX_TOKENS", 16)
    assert moe.choose_dispatch(1, "gpu", fused=True) == "fused"
    assert moe.choose_dispatch(16, "gpu", fused=True) == "fused"
    assert moe.choose_dispatch(17, "gpu", fused=True) == "grouped"
    assert moe.choose_dispatch(1, "gpu", fused=False) == "gather"
    assert moe.choose_dispatch(1, "cpu", fused=True) == "gather"


H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


def _lowered(fn, *args, mesh=None) -> str:
    """fn(*args) traced under an abstract H200 mesh and lowered for CUDA: its StableHLO text."""
    mesh = mesh or jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _eight_way(sharding: str) -> tuple[dict, dict]:
    """8 bf16 experts of width 512 and their split over 8 devices: ep, one expert each; tp, 64 columns."""
    experts = 8
    p = {
        "experts_gate": _expert("plain", H, 512, 4, experts),
        "experts_up": _expert("plain", H, 512, 5, experts),
        "experts_down": _expert("plain", 512, H, 6, experts),
    }
    col = P("model", None, None) if sharding == "ep" else P(None, None, "model")
    row = P("model", None, None) if sharding == "ep" else P(None, "model", None)
    return p, {name: row if name == "experts_down" else col for name in p}


@pytest.mark.own_process  # jax's GPU interpreter (conftest)
@pytest.mark.parametrize("sharding", ["ep", "tp"])
def test_fused_dispatch_per_device(sharding):
    """moe.run_experts' `fused_interpret` on each of 8 devices' shards (ep: one expert each, the other
    slots absent; tp: 64 of 512 columns): the sum of the partial sums equals the NumPy loop.

    The devices run one after another, each as device `d` of a one-device mesh with the routing's
    expert ids shifted by d's first expert (what `_local` subtracts on device d): jax 0.11.2's GPU
    interpreter cannot run a kernel on 8 devices at once (`cluster_finished` resets state shared by all
    devices; results/notes.md). The real 8-device program is lowered for CUDA below."""
    p, specs = _eight_way(sharding)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((5, H)), jnp.bfloat16)
    experts = jnp.asarray(rng.integers(0, 8, (5, K)), jnp.int32)
    weights = jnp.asarray(rng.random((5, K)), jnp.bfloat16)
    want = _numpy_loop(x, experts, np.ones((5, K), bool), weights, *p.values())

    def local(p, x, routing):
        return moe.run_experts(p, x, routing, sharding, "model", "fused_interpret").astype(jnp.float32)

    one = jax.jit(jax.shard_map(local, mesh=make_mesh(1), in_specs=P(), out_specs=P(), check_vma=False))
    total = np.zeros(want.shape)
    for d in range(8):
        shard = {k: v[d : d + 1] if sharding == "ep" else v[..., d * 64 : (d + 1) * 64] for k, v in p.items()}
        if sharding == "tp":
            shard["experts_down"] = p["experts_down"][:, d * 64 : (d + 1) * 64]
        shifted = experts - d if sharding == "ep" else experts
        total += np.asarray(one(shard, x, moe.Routing(shifted, weights)), np.float64)
    _close(total, want)


@pytest.mark.parametrize("sharding", ["ep", "tp"])
def test_fused_dispatch_on_eight_devices_lowers_for_cuda(sharding):
    """The Qwen3-30B-A3B experts split over 8 H200s (ep: 16 experts a device; tp: 768 / 8 = 96 columns,
    which the kernel cannot tile, so the grouped kernel takes them) inside shard_map lower for CUDA."""
    spec, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    p = {
        "experts_gate": spec((128, 2048, 768), bf16),
        "experts_up": spec((128, 2048, 768), bf16),
        "experts_down": spec((128, 768, 2048), bf16),
    }
    _, specs = _eight_way(sharding)

    def local(p, x, routing):
        return jax.lax.psum(moe.run_experts(p, x, routing, sharding, "model", "fused"), "model")

    auto = (jax.sharding.AxisType.Auto,) * 2  # unsharded abstract inputs, resharded by shard_map
    mesh = jax.sharding.AbstractMesh((1, 8), ("data", "model"), axis_types=auto, abstract_device=H200)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P()), out_specs=P(), check_vma=False)
    routing = moe.Routing(spec((4, 8), jnp.int32), spec((4, 8), bf16))
    text = _lowered(fn, p, spec((4, 2048), bf16), routing, mesh=mesh)
    kernel = "mosaic_gpu" if sharding == "ep" else "triton"
    assert kernel in text and "ragged_dot" not in text


@pytest.mark.parametrize("tokens", [1, 64])
def test_qwen3_30b_a3b_layer_lowers_for_cuda(tokens):
    """The Qwen3-30B-A3B expert layer (128 experts, hidden 2048, width 768, top-8) through the `fused`
    dispatch passes Mosaic GPU's layout inference and TMA rules on the CPU: the kernels, no fallback."""
    spec, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    p = {
        "router": spec((2048, 128), bf16),
        "experts_gate": spec((128, 2048, 768), bf16),
        "experts_up": spec((128, 2048, 768), bf16),
        "experts_down": spec((128, 768, 2048), bf16),
    }
    layer = functools.partial(moe.experts_ffn, experts_per_token=8, normalize=True, dispatch="fused")
    text = _lowered(layer, p, spec((tokens, 2048), bf16))
    assert text.count("mosaic_gpu") >= 2 and "triton" not in text and "ragged_dot" not in text


@pytest.mark.parametrize(
    "fmt,experts,width", [("int4", 48, 2048), ("fp8", 384, 256)], ids=["int4-ep8", "fp8-tp8"]
)
def test_kimi_k2_shard_lowers_for_cuda(fmt, experts, width):
    """One device's share of a Kimi-K2 MoE layer (hidden 7168, top-8) under 8-way ep (48 whole experts,
    INT4 as Kimi-K2.5 publishes them) and 8-way tp (384 experts of 256 columns, FP8 as Kimi-K2)."""
    spec = jax.ShapeDtypeStruct

    def weight(rows, cols):
        if fmt == "int4":
            return arrays.Int4Weight(
                spec((experts, rows // 8, cols), jnp.int32),
                spec((experts, rows // 32, cols), jnp.bfloat16),
                32,
            )
        scale = spec((experts, rows // 128, cols // 128), jnp.float32)
        return arrays.Fp8Weight(
            spec((experts, rows, cols), jnp.float8_e4m3fn), scale, (rows, cols), (128, 128)
        )

    tokens = 8
    args = (
        spec((tokens, 7168), jnp.bfloat16),
        spec((tokens, 8), jnp.int32),
        spec((tokens, 8), jnp.bool_),
        spec((tokens, 8), jnp.bfloat16),
        *_kernel_weights(weight(7168, width), weight(7168, width), weight(width, 7168)),
    )
    assert _lowered(fe.fused_experts, *args).count("mosaic_gpu") >= 2
