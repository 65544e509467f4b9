"""kernels.few_experts and few_experts_mgpu: the distinct-expert slots and slot weights against NumPy;
the split-K Triton kernel in interpret mode and the Mosaic GPU one in GPU interpret mode against a
NumPy loop over tokens and slots (bf16, FP8 with 128 x 128 blocks, INT4 words with groups of 32); two
grids in one process (jax#40847); the `few` dispatch of moe.run_experts on 8 fake devices (ep, tp);
the dispatch table; and the CUDA lowering of the Qwen3-30B-A3B layer (both kernels) and a Kimi-K2
INT4 shard on the CPU.

Shapes are the smallest the kernel tiles (hidden and expert width 128; INT4 K tiles of 128 rows)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_moe_kernel import H200, _close, _expert, _experts, _kernel_weights, _numpy_loop, _routing

from ddtree_jax.kernels import few_experts as fx
from ddtree_jax.kernels import few_experts_mgpu as fm
from ddtree_jax.kernels import fused_experts as fe
from ddtree_jax.kernels import tuning
from ddtree_jax.models import moe
from ddtree_jax.quant import arrays
from ddtree_jax.sharding import make_mesh

H = 128


def test_distinct_experts_and_slot_weights_against_numpy():
    """Slots: the sorted distinct held experts, -1 past them; weights: per token the sum of its held
    slots' routing weights on each slot's expert (a token choosing one expert twice counts both)."""
    rng = np.random.default_rng(3)
    num_experts, tokens, k = 10, 3, 4
    experts = rng.integers(0, num_experts, (tokens, k)).astype(np.int32)
    experts[0, 1] = experts[0, 0]
    here = rng.random((tokens, k)) > 0.3
    weights = rng.random((tokens, k)).astype(np.float32)
    slots = np.asarray(fx.distinct_experts(jnp.asarray(experts), jnp.asarray(here), num_experts))
    held = sorted(set(experts[here].tolist()))
    assert slots.shape == (min(num_experts, tokens * k),)
    assert slots[: len(held)].tolist() == held and (slots[len(held) :] == -1).all()
    got = np.asarray(fx.slot_weights(jnp.asarray(experts), jnp.asarray(here), jnp.asarray(weights), slots))
    want = np.zeros((tokens, slots.shape[0]))
    for t in range(tokens):
        for s in range(k):
            if here[t, s]:
                want[t, held.index(experts[t, s])] += weights[t, s]
    np.testing.assert_allclose(got, want, rtol=1e-6)


# one token (its slots all distinct or repeated), 3 (a slot held elsewhere, token 0 choosing one
# expert twice), 20 (32-row dot tiles, every expert chosen); ~2-4 s a case
@pytest.mark.parametrize(
    "fmt,tokens", [("plain", 1), ("plain", 3), ("plain", 20), ("fp8", 3), ("int4", 1), ("int4", 3)]
)
def test_few_kernel_against_numpy_loop(fmt, tokens):
    """The kernel (interpreted) and its jnp per-expert reference both equal the NumPy loop."""
    gate, up, down = _experts(fmt)
    args = _routing(tokens, tokens)
    want = _numpy_loop(*args, gate, up, down)
    _close(fx.few_experts(*args, *_kernel_weights(gate, up, down), interpret=True), want)
    _close(fx.few_experts_reference(*args, *_kernel_weights(gate, up, down)), want)


def test_two_grids_in_one_process():
    """jax#40847: the same weights through two grids (1 and 4 K splits, 128- and 32-column tiles) one
    after the other in this process; each partial sum over splits equals x times the slot's expert."""
    (gate,) = _kernel_weights(_expert("plain", 4 * H, H, 11))
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((16, 4 * H)), jnp.bfloat16)
    slots = jnp.asarray([2, 0, -1], jnp.int32)
    w = np.asarray(gate.w.astype(jnp.float32), np.float64)
    xs = np.asarray(x.astype(jnp.float32), np.float64)
    want = np.stack([xs @ w[2], xs @ w[0], np.zeros((16, H))])
    for tun in (dict(splits=1), dict(splits=4, tile_n=32)):
        (part,) = fx.expert_gemv(x, slots, (gate,), per_slot=False, tuning=tun, interpret=True)
        assert part.shape[0] == tun["splits"]
        _close(jnp.sum(part, axis=0), want)


def test_tuning_of_model_shapes():
    """Tiles and splits of Qwen3-30B-A3B at one token (8 slots) and of its tp 8 shard (96 columns),
    a Kimi-K2 INT4 expert; shapes no tile fits are refused (the dispatch then takes `grouped`)."""
    gate = tuning.resolve_few_tuning("plain", 2048, 768, 8)
    assert (gate.tile_k, gate.tile_n, gate.splits, gate.steps) == (128, 128, 8, 2)  # 8 x 6 x 8 programs
    down = tuning.resolve_few_tuning("plain", 768, 2048, 8)
    assert (down.tile_k, down.tile_n, down.splits) == (128, 128, 3)  # 8 x 16 x 3 programs
    assert tuning.resolve_few_tuning("plain", 2048, 96, 8).tile_n == 32
    kimi = tuning.resolve_few_tuning("int4", 7168, 2048, 8, block=(32, 1))
    assert kimi.tile_k == 256 and kimi.k_tiles % kimi.splits == 0
    assert tuning.resolve_few_tuning("fp8", 7168, 2048, 8, block=(128, 128)).tile_k == 128
    with pytest.raises(ValueError):
        tuning.resolve_few_tuning("int4", 96, 2048, 8, block=(32, 1))  # K tiles of 128 do not fit
    narrow = arrays.expert_weight(jax.ShapeDtypeStruct((8, 24, 40), jnp.bfloat16))
    assert fx.why_not(narrow, jnp.bfloat16) is not None
    assert "activations" in fx.why_not(arrays.expert_weight(_experts("plain")[0]), jnp.float32)


def test_dispatch_table(monkeypatch):
    """The GPU rule reads the table by format and tokens per device; a measured winner list becomes
    table rows (runs merged, the last open); the table as shipped keeps gather, then grouped."""
    for fmt in ("plain", "fp8", "int4"):
        assert moe.choose_dispatch(1, "gpu", fused=False, fmt=fmt) == "gather"
        assert moe.choose_dispatch(moe.GPU_GATHER_MAX_TOKENS + 1, "gpu", fused=False, fmt=fmt) == "grouped"
    rows = tuning.dispatch_table_rows({1: "few", 8: "few", 16: "grouped", 64: "grouped"})
    assert rows == ((8, "few"), (None, "grouped"))
    monkeypatch.setitem(tuning.MOE_GPU_DISPATCH, "int4", rows)
    assert [moe.choose_dispatch(n, "gpu", fused=False, fmt="int4") for n in (1, 8, 9, 512)] == [
        "few",
        "few",
        "grouped",
        "grouped",
    ]
    assert moe.choose_dispatch(1, "gpu", fused=False, fmt="plain") == "gather"
    monkeypatch.setitem(tuning.MOE_GPU_DISPATCH, "fp8", ((16, "few_mgpu"), (None, "grouped")))
    assert moe.choose_dispatch(16, "gpu", fused=True, fmt="fp8") == "few_mgpu"
    assert moe.choose_dispatch(16, "gpu", fused=False, fmt="fp8") == "few"  # not Hopper: the Triton kernel
    assert moe.choose_dispatch(1, "cpu", fmt="int4") == "gather"
    assert moe.weight_format(_experts("int4")[0]) == "int4" and moe.weight_format(_experts("fp8")[0]) == "fp8"


@pytest.mark.parametrize("fmt,sharding", [("plain", "ep"), ("plain", "tp"), ("int4", "ep")])
def test_few_dispatch_on_eight_devices(fmt, sharding):
    """8 experts over 8 devices (ep: one each, the other slots absent; tp: 16 of 128 columns each)
    through moe.run_experts' `few_interpret`: the psum of the partial sums equals the NumPy loop."""
    p = {
        "experts_gate": _expert(fmt, H, H, 4, 8),
        "experts_up": _expert(fmt, H, H, 5, 8),
        "experts_down": _expert(fmt, H, H, 6, 8),
    }
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((3, H)), jnp.bfloat16)
    experts = jnp.asarray(rng.integers(0, 8, (3, 2)), jnp.int32)
    weights = jnp.asarray(rng.random((3, 2)), jnp.bfloat16)
    want = _numpy_loop(x, experts, np.ones((3, 2), bool), weights, *p.values())
    col = P("model", None, None) if sharding == "ep" else P(None, None, "model")
    row = P("model", None, None) if sharding == "ep" else P(None, "model", None)
    specs = {k: jax.tree.map(lambda _, s=(row if k == "experts_down" else col): s, v) for k, v in p.items()}

    def local(p, x, routing):
        out = moe.run_experts(p, x, routing, sharding, "model", "few_interpret")
        return jax.lax.psum(out.astype(jnp.float32), "model")

    fn = jax.shard_map(local, mesh=make_mesh(8), in_specs=(specs, P(), P()), out_specs=P(), check_vma=False)
    _close(jax.jit(fn)(p, x, moe.Routing(experts, weights)), want)


def _spec_weight(fmt: str, experts: int, rows: int, cols: int) -> arrays.Weight:
    spec = jax.ShapeDtypeStruct
    if fmt == "int4":
        return arrays.Int4Weight(
            spec((experts, rows // 8, cols), jnp.int32), spec((experts, rows // 32, cols), jnp.bfloat16), 32
        )
    if fmt == "fp8":
        scale = spec((experts, rows // 128, cols // 128), jnp.float32)
        values = spec((experts, rows, cols), jnp.float8_e4m3fn)
        return arrays.Fp8Weight(values, scale, (rows, cols), (128, 128))
    return spec((experts, rows, cols), jnp.bfloat16)


def _lowered(fn, *args) -> str:
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("fmt", ["plain", "fp8", "int4"])
@pytest.mark.parametrize("tokens", [1, 16])
def test_qwen3_30b_a3b_layer_lowers_for_cuda(fmt, tokens):
    """The Qwen3-30B-A3B expert layer (128 experts, hidden 2048, width 768, top-8) through `few`
    passes Triton's shape rules on the CPU in every format: the kernel, no fallback."""
    p = {
        "router": jax.ShapeDtypeStruct((2048, 128), jnp.bfloat16),
        "experts_gate": _spec_weight(fmt, 128, 2048, 768),
        "experts_up": _spec_weight(fmt, 128, 2048, 768),
        "experts_down": _spec_weight(fmt, 128, 768, 2048),
    }
    layer = functools.partial(moe.experts_ffn, experts_per_token=8, normalize=True, dispatch="few")
    text = _lowered(layer, p, jax.ShapeDtypeStruct((tokens, 2048), jnp.bfloat16))
    assert text.count("few_experts_") >= 2 and "ragged_dot" not in text and "mosaic_gpu" not in text


@pytest.mark.parametrize("kernel", ["triton", "mosaic"])
def test_kimi_k2_int4_shard_lowers_for_cuda(kernel):
    """One device's share of a Kimi-K2 MoE layer under 8-way ep (48 whole experts, hidden 7168, width
    2048, INT4 as Kimi-K2.5 publishes them) at one token, through either kernel."""
    spec = jax.ShapeDtypeStruct
    args = (
        spec((1, 7168), jnp.bfloat16),
        spec((1, 8), jnp.int32),
        spec((1, 8), jnp.bool_),
        spec((1, 8), jnp.bfloat16),
        *_kernel_weights(
            _spec_weight("int4", 48, 7168, 2048),
            _spec_weight("int4", 48, 7168, 2048),
            _spec_weight("int4", 48, 2048, 7168),
        ),
    )
    if kernel == "mosaic":
        assert _lowered(fm.few_experts_mgpu, *args).count("mosaic_gpu") >= 2
    else:
        assert _lowered(fx.few_experts, *args).count("few_experts_int4") >= 2


def test_few_above_its_token_bound_runs_grouped(monkeypatch):
    """Above moe.FEW_MAX_TOKENS tokens (e.g. a prefill under a forced `few`) the layer lowers to the
    grouped kernel, not the few-token one."""
    p = {
        "router": jax.ShapeDtypeStruct((2048, 128), jnp.bfloat16),
        "experts_gate": _spec_weight("plain", 128, 2048, 768),
        "experts_up": _spec_weight("plain", 128, 2048, 768),
        "experts_down": _spec_weight("plain", 128, 768, 2048),
    }
    layer = functools.partial(moe.experts_ffn, experts_per_token=8, normalize=True, dispatch="few")
    x = jax.ShapeDtypeStruct((4, 2048), jnp.bfloat16)
    assert "few_experts_plain" in _lowered(layer, p, x)
    monkeypatch.setattr(moe, "FEW_MAX_TOKENS", 3)
    text = _lowered(functools.partial(layer), p, x)  # a new function: jit's cache holds the first trace
    assert "few_experts_plain" not in text and "grouped_matmul_plain" in text


# Mosaic GPU interpret mode (~2-5 s a call): one token, FP8 at 3, INT4 at 20 (3 tiles of 8 tokens)
@pytest.mark.own_process  # jax's GPU interpreter (conftest)
def test_few_mgpu_kernel_against_numpy_loop():
    """The Mosaic GPU kernels (interpreted) equal the NumPy loop in every format."""
    for fmt, tokens in (("plain", 1), ("fp8", 3), ("int4", 20)):
        gate, up, down = _experts(fmt)
        args = _routing(tokens, tokens)
        want = _numpy_loop(*args, gate, up, down)
        _close(fm.few_experts_mgpu(*args, *_kernel_weights(gate, up, down), interpret=True), want)


@pytest.mark.own_process  # jax's GPU interpreter (conftest)
def test_few_mgpu_splits_and_two_grids():
    """K split 4 ways (bf16, 8 steps of 128 rows) and 2 ways (INT4, 2 steps of 512), one grid after the
    other in this process (jax#40847): the summed partials equal x times each slot's expert."""
    rng = np.random.default_rng(6)
    slots = jnp.asarray([3, 1], jnp.int32)
    for fmt, splits in (("plain", 4), ("int4", 2)):
        w = _expert(fmt, 8 * H, H, 12)
        op = fe.operand(arrays.expert_weight(w), jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((8, 8 * H)), jnp.bfloat16)
        part = fm.expert_gemv_mgpu(
            fe.kernel_columns(x, op), slots, (op,), tile_t=8, per_slot=False, splits=splits, interpret=True
        )
        assert part.shape == (splits, 2, 1, H, 8)
        dense = np.asarray(arrays.dequantize(w, jnp.float32), np.float64)
        xs = np.asarray(x.astype(jnp.float32), np.float64)
        want = np.stack([(xs @ dense[3]).T, (xs @ dense[1]).T])
        _close(jnp.sum(part, axis=0)[:, 0], want)


@pytest.mark.parametrize("fmt", ["plain", "fp8", "int4"])
def test_qwen3_30b_a3b_layer_lowers_for_cuda_on_mosaic(fmt):
    """The Qwen3-30B-A3B expert layer through `few_mgpu` at one token passes Mosaic GPU's layout
    inference and TMA rules on the CPU in every format."""
    p = {
        "router": jax.ShapeDtypeStruct((2048, 128), jnp.bfloat16),
        "experts_gate": _spec_weight(fmt, 128, 2048, 768),
        "experts_up": _spec_weight(fmt, 128, 2048, 768),
        "experts_down": _spec_weight(fmt, 128, 768, 2048),
    }
    layer = functools.partial(moe.experts_ffn, experts_per_token=8, normalize=True, dispatch="few_mgpu")
    text = _lowered(layer, p, jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16))
    assert text.count("mosaic_gpu") >= 2 and "triton" not in text and "ragged_dot" not in text
