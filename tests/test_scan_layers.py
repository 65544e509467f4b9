"""`TargetConfig.scan_layers`: the dense decoder stack as one lax.scan over stacked layers gives the
unrolled stack's outputs exactly (float32 fixtures), on one device and a 2x2 mesh, and reads one
layer of the stacked cache per step without copying the whole cache (issue 42)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, golden_prompts, load_target, oracle_draft, run

from ddtree_jax import kv_cache, models, target
from ddtree_jax.bench.shapes import QUANTIZE
from ddtree_jax.errors import DDTreeError
from ddtree_jax.models import gqa

TP = "qwen3_gqa4_tp"  # 8 query heads, 2 K/V heads: tp 2 splits them
DRAFT = "dflash_qwen3_gqa4_tp"


@pytest.mark.parametrize("name", ["qwen3_gqa4_tp", "llama3_scaled"])
def test_loader_stacks_every_layer_weight(name):
    """The stacked checkpoint weights are the unrolled ones, layer by layer, with a leading unsplit
    axis on a 2x2 mesh (K/V heads split, as the unrolled ones)."""
    cfg, params = load_target(name, tp=2, dp=2)
    scfg, sparams = load_target(name, tp=2, dp=2, scan_layers=True)
    assert scfg.scan_layers and not cfg.scan_layers
    assert set(sparams["layers"]) == set(params["layers"][0])
    for name_, w in sparams["layers"].items():
        assert w.shape == (cfg.num_layers, *params["layers"][0][name_].shape)
        assert w.sharding.spec[:1] in ((), (None,))
        assert w.sharding.spec[1:] == params["layers"][0][name_].sharding.spec[: len(w.sharding.spec) - 1]
        for i in range(cfg.num_layers):
            np.testing.assert_array_equal(np.asarray(w[i]), np.asarray(params["layers"][i][name_]))
    specs = target.weight_specs(scfg)
    stacked = {s.path[1]: s for s in specs if s.path[0] == "layers"}
    assert stacked["o_proj"].stack == tuple(
        f"model.layers.{i}.self_attn.o_proj.weight" for i in range(cfg.num_layers)
    )
    assert all(s.axes[0] is None for s in stacked.values())


def causal(b: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "llama3_scaled"])
def test_forward_equals_unrolled(name):
    """Prefill, then a tree-shaped step over the cache: hidden states, drafter features (a middle and
    the last layer) and new K/V are the unrolled stack's exactly."""
    cfg, params = load_target(name)
    scfg, sparams = load_target(name, scan_layers=True)
    rng = np.random.default_rng(0)
    b, p, t = 2, 7, 4
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, p)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    lengths = jnp.asarray([7, 4], jnp.int32)
    step_tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    step_positions = lengths[:, None] + jnp.asarray([0, 1, 1, 2], jnp.int32)[None]
    tree_mask = jnp.asarray([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    step_mask = jnp.broadcast_to(tree_mask, (b, t, t))
    features = (1, cfg.num_layers - 1)

    @jax.jit
    def both(params, sparams):
        outs = []
        for c, w in ((cfg, params), (scfg, sparams)):
            pre = target.forward(w, c, tokens, positions, causal(b, p), None, feature_layers=features)
            cache = kv_cache.from_prefill(pre.kv, 64, lengths)
            step = target.forward(
                w, c, step_tokens, step_positions, step_mask, cache, feature_layers=features
            )
            outs.append((pre, step))
        return outs

    (pre, step), (spre, sstep) = both(params, sparams)
    assert len(spre.kv) == 1 and isinstance(spre.kv[0], gqa.StackedKVEntry)
    for ref, got in ((pre, spre), (step, sstep)):
        np.testing.assert_array_equal(got.hidden, ref.hidden)
        np.testing.assert_array_equal(got.features, ref.features)
        for i, entry in enumerate(ref.kv):  # in flight [B, T, L, Hkv, D]
            np.testing.assert_array_equal(got.kv[0].k[:, :, i], entry.k)
            np.testing.assert_array_equal(got.kv[0].v[:, :, i], entry.v)


def outcome(results):
    return [(r.output_ids, r.acceptance_lengths, r.finish_reason) for r in results]


PROMPTS = golden_prompts(TP)[:4]


def generate(method, tp, dp, scan_layers, draft_stage=None, host_stepped=False):
    draft = None if method == "ar" else DRAFT
    results = run(
        TP, PROMPTS, method=method, draft_name=draft, budget=6 if draft else 0, batch_size=4,
        max_new_tokens=10, tp=tp, dp=dp, scan_layers=scan_layers, draft_stage=draft_stage,
        host_stepped=host_stepped,
    )  # fmt: skip
    return outcome(results)


@pytest.fixture(scope="module")
def unrolled():
    """One device's unrolled outcomes per method (float32 outputs do not depend on the mesh); ddtree
    drafts with an oracle of the ar continuation, so that the verify accepts long paths."""
    ar = generate("ar", 1, 1, scan_layers=False)
    stage = oracle_draft([p + out for p, (out, _, _) in zip(PROMPTS, ar, strict=True)])
    outcomes = {"ar": ar, "ddtree": generate("ddtree", 1, 1, False, stage)}
    return outcomes, stage


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 2)])
@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_generation_equals_unrolled(unrolled, method, tp, dp):
    """The engine's greedy tokens, accepted paths and finish reasons with the scan are the unrolled
    stack's, on one device and with heads and rows split over a 2x2 mesh."""
    outcomes, stage = unrolled
    got = generate(method, tp, dp, True, stage if method == "ddtree" else None)
    assert got == outcomes[method]
    if method == "ddtree":
        assert max(max(acc) for _, acc, _ in got) > 2  # the tree verify really accepted long paths


def test_host_stepped_equals_unrolled(unrolled):
    """The host-stepped stages (their own programs and shard_map specs of the cache and in-flight
    entries, programs.stage_programs) give the unrolled stack's ddtree outcome too."""
    outcomes, stage = unrolled
    assert generate("ddtree", 1, 1, True, stage, host_stepped=True) == outcomes["ddtree"]


def test_layer_reads_one_slice_of_the_cache():
    """In the optimised CPU program of a cached step, the stacked cache [B, L, Hkv, S, D] is only
    passed along (parameter, loop tuple) and read by one-layer dynamic slices: no instruction
    produces an array of the whole cache's shape (a copy), in the loop or around it."""
    scfg, sparams = load_target("qwen3_gqa2_tied", scan_layers=True)
    b, s, t = 2, 192, 3
    shapes = models.family(scfg).cache_shapes(scfg, b, s, 1, jnp.float32)
    cache = kv_cache.KVCache(
        [jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[0])], jnp.ones((b,), jnp.int32)
    )
    tokens = jnp.zeros((b, t), jnp.int32)

    def step(params, cache):
        return target.forward(
            params, scfg, tokens, cache.lengths[:, None] + jnp.arange(t), causal(b, t), cache
        )

    hlo = jax.jit(step).lower(sparams, cache).compile().as_text()
    whole = "f32[" + ",".join(map(str, cache.layers[0].k.shape)) + "]"
    made = re.findall(r"= " + re.escape(whole) + r"\{[^}]*\} ([\w-]+)\(", hlo)
    assert made and set(made) <= {"parameter", "get-tuple-element"}, made
    one_layer = "f32[" + ",".join(map(str, (b, 1, *cache.layers[0].k.shape[2:]))) + "]"
    assert re.search(re.escape(one_layer) + r"\{[^}]*\} dynamic-slice\(", hlo)
    assert " while(" in hlo


def test_scan_refused_where_it_does_not_apply():
    """Families other than dense, and quantized weights, are refused with a DDTreeError by name."""
    moe_cfg = models.load_target_config(FIXTURES / "qwen3_moe_tp")
    with pytest.raises(DDTreeError, match="qwen3_moe.*unrolled only|unrolled only"):
        models.load_target_config(FIXTURES / "qwen3_moe_tp", scan_layers=True)
    with pytest.raises(DDTreeError, match="unrolled only"):
        models.with_scan_layers(moe_cfg)
    cfg = models.load_target_config(FIXTURES / TP)
    with pytest.raises(DDTreeError, match="quantized weights .*Fp8Block"):
        models.with_scan_layers(dataclasses.replace(cfg, quantization=QUANTIZE["fp8"]))
    assert models.cache_entry(cfg) == (gqa.KVEntry, cfg.num_layers)
    assert models.cache_entry(models.with_scan_layers(cfg)) == (gqa.StackedKVEntry, 1)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("impl", ["pallas", "mosaic"])
def test_scanned_round_lowers_for_cuda(impl):
    """A ddtree round of the scanned Qwen3-8B-width stack (2 layers) with the GPU attention kernels
    lowers for CUDA on an abstract H200 (DESIGN.md): the kernels take one layer's cache slice."""
    from ddtree_jax import drafter, engine
    from ddtree_jax.bench.programs import synthetic_state
    from ddtree_jax.bench.shapes import SHAPES, draft_shape
    from ddtree_jax.engine import Plan
    from ddtree_jax.programs import Shape
    from ddtree_jax.weights import assemble

    cfg = models.with_scan_layers(dataclasses.replace(SHAPES["qwen3-8b"], num_layers=2))
    dcfg = draft_shape(cfg, 1, 8)
    plan = Plan(cfg, dcfg, "ddtree", 64, 15, 15, impl)

    def abstract(specs):
        return assemble(specs, lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16))

    state = jax.eval_shape(lambda: synthetic_state(plan, Shape.of(plan, 1, 1024), 1024, 0, jnp.bfloat16))
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=h200
    )
    with jax.sharding.use_abstract_mesh(mesh):
        fn = jax.jit(lambda p, d, s: engine.decode_round(p, d, s, plan))
        args = (abstract(target.weight_specs(cfg)), abstract(drafter.weight_specs(dcfg)), state)
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "tree_attention" in text and "stablehlo.while" in text


def test_params_cache_keeps_stacked_weights_apart(tmp_path, capsys):
    """`--params-cache` converts the stacked layout into an entry of its own (beside the unrolled
    one) and restores it equal to the safetensors load, shardings included (tp 2 x dp 2)."""
    from ddtree_jax.checkpoint import params_cache
    from ddtree_jax.sharding import make_mesh, param_sharding

    placement = param_sharding(make_mesh(2, 2))

    def load(scan):
        with params_cache(tmp_path):
            options = {"scan_layers": True} if scan else {}
            return target.load(FIXTURES / TP, jnp.float32, placement, **options)[1]

    load(False)
    converted = load(True)
    assert capsys.readouterr().err.count("params cache: converted") == 2
    restored = load(True)
    assert "params cache: restored" in capsys.readouterr().err
    assert len(list(tmp_path.iterdir())) == 2
    fresh = load_target(TP, tp=2, dp=2, scan_layers=True)[1]
    for got in (converted, restored):
        assert jax.tree.structure(got) == jax.tree.structure(fresh)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(fresh), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def test_bench_rounds_scan_layers(tmp_path):
    """`ddtree-bench rounds --scan-layers` times the scanned stack (its JSON says so, rows without
    errors, compile_s recorded) and refuses a family that does not scan before any work."""
    import json

    from ddtree_jax.bench.cli import main

    out = tmp_path / "rounds.json"
    argv = ["rounds", "--shape", "tiny", "--num-layers", "2", "--draft-layers", "1", "--block-size", "4"]
    argv += ["--contexts", "32", "--rounds", "1", "--ceiling-bytes", "1048576", "--methods", "ar,ddtree"]
    assert main([*argv, "--budgets", "3", "--scan-layers", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["scan_layers"] is True and data["meta"]["num_layers"] == 2
    assert [r["method"] for r in data["rows"]] == ["ar", "ddtree"]
    assert all("error" not in r and r["compile_s"] > 0 for r in data["rows"])
    moe = ["rounds", "--shape", "tiny-moe", "--scan-layers", "--out", str(tmp_path / "moe.json")]
    assert main(moe) == 1 and not (tmp_path / "moe.json").exists()
