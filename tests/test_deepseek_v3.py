"""DeepseekV3ForCausalLM (MLA on a latent cache, grouped sigmoid routing, shared experts) and Kimi-K2.5
wrappers (fixtures from tests/make_fixtures.py): bfloat16 against HF, the absorbed cache path,
config fields, routing, expert tensor parallelism; the yarn drafter against an independent torch
computation. Float32 logits and greedy outputs against HF, speculative methods against ar, meshes and
host-stepped rounds are test_families.py's (every family)."""

import dataclasses
import functools

import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, golden, golden_prompts, load_drafter, load_target

from ddtree_jax import target
from ddtree_jax.config import load_draft_config
from ddtree_jax.errors import DDTreeError
from ddtree_jax.kv_cache import from_prefill
from ddtree_jax.models import deepseek_v3, mla
from ddtree_jax.sharding import make_mesh, param_sharding

TP, DRAFT = "deepseek_v3_tp", "dflash_deepseek_v3_tp"
conftest.DRAFTERS.setdefault(DRAFT, TP)  # load_drafter finds the drafter's target here


def causal(n: int) -> jax.Array:
    return jnp.tril(jnp.ones((n, n), bool))[None]


@functools.partial(jax.jit, static_argnums=1)
def _prefill(params, cfg, tokens):
    n = tokens.shape[1]
    out = target.forward(params, cfg, tokens, jnp.arange(n)[None], causal(n), None)
    return target.logits(params, out.hidden)


def prefill_logits(name: str, ids, dtype: str = "float32") -> np.ndarray:
    cfg, params = load_target(name, dtype)
    return np.asarray(_prefill(params, cfg, jnp.asarray(ids)[None]))[0]


def test_bfloat16_logits_close_to_hf():
    """bf16 rounding flips a routed expert at a few positions (large weights, std 0.3): most positions
    stay within a few percent."""
    _, params = load_target("deepseek_v3_qlora", "bfloat16")
    layer = params["layers"][1]
    assert layer["router"].dtype == layer["router_bias"].dtype == jnp.float32  # as HF keeps them
    assert layer["experts_gate"].dtype == jnp.bfloat16
    g = golden("deepseek_v3_qlora")
    ref, got = g["logits_3"], prefill_logits("deepseek_v3_qlora", g["prompt_3"], "bfloat16")
    assert np.median(np.abs(got - ref).max(-1)) / np.abs(ref).max() < 0.05
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) > 0.75


def test_absorbed_cache_path_equals_expanded_prefill():
    """Prefill a prefix (expanded form), then the rest as one tree-shaped verify over the latent cache
    (absorbed form, causal mask): the same logits as one expanded pass over the whole prompt."""
    cfg, params = load_target("deepseek_v3_qlora")
    ids = golden("deepseek_v3_qlora")["prompt_4"]
    n, k = len(ids), 11
    full = prefill_logits("deepseek_v3_qlora", ids)

    @jax.jit
    def two_passes(params):
        first = target.forward(params, cfg, jnp.asarray(ids[:k])[None], jnp.arange(k)[None], causal(k), None)
        cache = from_prefill(first.kv, 64, jnp.array([k], jnp.int32))
        rest = jnp.asarray(ids[k:])[None]
        out = target.forward(params, cfg, rest, jnp.arange(k, n)[None], causal(n - k), cache)
        return cache, target.logits(params, out.hidden)

    cache, logits = two_passes(params)
    assert isinstance(cache.layers[0], mla.LatentEntry)
    assert cache.layers[0].latent.shape == (1, 64, cfg.mla.kv_lora_rank)
    got = np.asarray(logits)[0]
    np.testing.assert_allclose(got, full[k:], rtol=0, atol=1e-4 * np.abs(full).max())


def test_config_fields():
    cfg, _ = load_target("deepseek_v3_qlora")
    assert cfg.mla.q_lora_rank == 32 and cfg.mla.rope_interleave and cfg.is_sparse(1) and not cfg.is_sparse(0)
    assert (cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == (4, 2, 1)
    # yarn with mscale 1, mscale_all_dim 0.5: HF's cos/sin factor and softmax scale
    m = 0.1 * 0.5 * np.log(4.0) + 1
    assert cfg.rope.attention_factor == pytest.approx((0.1 * np.log(4.0) + 1) / m)
    assert cfg.mla.softmax_scale == pytest.approx(32**-0.5 * m * m)
    tp, _ = load_target(TP)
    assert tp.mla.q_lora_rank is None and not tp.mla.rope_interleave and tp.rope.yarn is None


def test_kimi_k25_wrapper_loads_text_model_only(capsys, tmp_path):
    cfg, params = target.load(FIXTURES / "kimi_k25_wrapped", jnp.float32, param_sharding(make_mesh()))
    assert cfg.architecture == "kimi_k25" and cfg.weight_prefix == "language_model."
    assert "vision" in capsys.readouterr().err
    assert "vision_tower" not in str(jax.tree_util.tree_structure(params))
    (tmp_path / "config.json").write_text('{"architectures": ["KimiK25ForConditionalGeneration"]}')
    with pytest.raises(DDTreeError, match="text_config"):
        target.load(tmp_path, jnp.float32, param_sharding(make_mesh()))


def test_quantized_checkpoint_is_refused(tmp_path):
    raw = (FIXTURES / TP / "config.json").read_text()
    (tmp_path / "config.json").write_text(
        raw.replace('"vocab_size"', '"quantization_config": {"quant_method": "fp8"}, "vocab_size"')
    )
    with pytest.raises(DDTreeError, match="fp8"):
        target.load(tmp_path, jnp.float32, param_sharding(make_mesh()))


def test_grouped_routing_masks_groups():
    """Only experts of the topk_group best groups (by their two best biased scores) are chosen; the
    weights are the unbiased sigmoid scores, renormalised, times routed_scaling_factor."""
    cfg, params = load_target("deepseek_v3_qlora")
    p = params["layers"][1]
    x = jax.random.normal(jax.random.key(0), (64, cfg.hidden_size))
    r = deepseek_v3.route(p, x, cfg)
    scores = jax.nn.sigmoid(x @ p["router"])
    choice = np.asarray(scores + p["router_bias"])
    groups = np.sort(choice.reshape(64, cfg.n_group, -1), axis=-1)[..., -2:].sum(-1)
    best = np.argsort(-groups, axis=-1)[:, : cfg.topk_group]
    per = cfg.num_experts // cfg.n_group
    for row, chosen in zip(best, np.asarray(r.experts), strict=True):
        assert set(chosen // per) <= set(row)
    w = np.take_along_axis(np.asarray(scores), np.asarray(r.experts), 1)
    np.testing.assert_allclose(np.asarray(r.weights), w / w.sum(-1, keepdims=True) * 2.5, rtol=1e-6)


# -- the drafter's yarn RoPE -------------------------------------------------------------------------


def test_yarn_drafter_matches_torch_with_legacy_scaling():
    """The drafter's own yarn RoPE: frequencies as computed in torch (checked against HF's there), cos
    and sin times 1 + 0.1 ln(factor) (the default, 'legacy'); draft logits as the torch drafter's."""
    from test_drafter import _draft_logits

    g = golden(DRAFT)
    cfg, _ = load_drafter(DRAFT)
    np.testing.assert_allclose(cfg.rope.inv_freq(), g["yarn_inv_freq"], rtol=1e-6)
    assert cfg.rope.attention_factor == pytest.approx(float(g["yarn_legacy_factor"]), rel=1e-6)
    for i in range(5):
        ref = g[f"draft_logits_{i}"]
        got = _draft_logits(DRAFT, g[f"feat_{i}"], int(g[f"block_{i}"][0]))
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4, i


def test_yarn_scaling_switch():
    """'hf' takes today's mscale ratio (1.0 for mscale = mscale_all_dim), which changes the logits."""
    tcfg, _ = load_target(TP)
    hf = load_draft_config(FIXTURES / DRAFT, tcfg, yarn_scaling="hf")
    legacy = load_draft_config(FIXTURES / DRAFT, tcfg)
    assert hf.rope.attention_factor == 1.0 and legacy.rope.attention_factor > 1.2
    np.testing.assert_array_equal(hf.rope.inv_freq(), legacy.rope.inv_freq())
    with pytest.raises(DDTreeError, match="yarn scaling"):
        load_draft_config(FIXTURES / DRAFT, tcfg, yarn_scaling="new")


def test_expert_tensor_parallelism_logits():
    """moe_sharding 'tp' (each expert's columns split) gives the same logits as one device."""
    cfg, params = target.load(FIXTURES / TP, jnp.float32, param_sharding(make_mesh(8)), moe_sharding="tp")
    assert cfg.moe_sharding == "tp"
    ids = golden(TP)["prompt_3"]
    n = len(ids)
    from ddtree_jax.engine import Plan, on_mesh, param_specs

    plan = Plan(cfg, None, "ar", 4, tp=8)
    spec, _ = param_specs(plan)

    def logits(params, tokens, *, plan):
        out = target.forward(params, cfg, tokens, jnp.arange(n)[None], causal(n), None, model_axis="model")
        return jax.lax.all_gather(target.logits(params, out.hidden), "model", axis=-1, tiled=True)

    P = jax.sharding.PartitionSpec
    got = jax.jit(on_mesh(logits, plan, (spec, P()), P()))(params, jnp.asarray(ids)[None])
    ref = golden(TP)["logits_3"]
    assert np.abs(np.asarray(got)[0] - ref).max() / np.abs(ref).max() < 1e-4


def test_latent_cache_is_replicated_over_model():
    cfg, _ = load_target(TP)
    shapes = deepseek_v3.cache_shapes(cfg, 2, 64, 8, jnp.bfloat16)
    from ddtree_jax.kv_cache import bytes_per_token

    per_layer = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 2
    assert bytes_per_token(shapes, 8) == bytes_per_token(shapes, 1) == per_layer * cfg.num_layers
    assert dataclasses.is_dataclass(cfg)


def test_bench_tiny_mla(tmp_path):
    """ddtree-bench on an MLA + grouped-MoE shape (the kimi-k2 shape's code path at tiny sizes), on one
    device and over a tp 4 mesh: every method runs; the floor counts the replicated latent cache."""
    import json

    from ddtree_jax.bench.rounds import main
    from ddtree_jax.bench.shapes import SHAPES

    assert SHAPES["kimi-k2"].num_layers == 4 and SHAPES["kimi-k2"].mla.kv_lora_rank == 512
    base = ["--shape", "tiny-mla", "--draft-layers", "1", "--block-size", "4", "--contexts", "32"]
    base += ["--rounds", "2", "--ceiling-bytes", "1048576", "--budgets", "3", "--batch-sizes", "1"]
    for tp, methods in ((1, ["ar", "dflash", "ddtree"]), (4, ["ddtree"])):
        out = tmp_path / f"bench{tp}.json"
        assert main([*base, "--tp", str(tp), "--methods", ",".join(methods), "--out", str(out)]) == 0
        rows = json.loads(out.read_text())["rows"]
        assert [r["method"] for r in rows] == methods
        for r in rows:
            assert "error" not in r, r.get("error")
            assert r["round_ms"] > 0 and r["target_floor_ms"] > 0


def test_cli_kimi_wrapper_and_yarn_switch(tmp_path):
    """ddtree-generate loads the Kimi-K2.5-style wrapper (HF's greedy tokens), and a yarn drafter under
    --draft-yarn-scaling hf on a tp 2 mesh still emits ar's tokens (lossless whatever the drafter)."""
    import json

    from ddtree_jax.cli import main

    def write_prompts(name):
        path = tmp_path / f"{name}.jsonl"
        lines = [json.dumps({"id": i, "input_ids": p}) + "\n" for i, p in enumerate(golden_prompts(name))]
        path.write_text("".join(lines))
        return path

    def outputs(path):
        rows = sorted(map(json.loads, path.read_text().splitlines()), key=lambda r: r["id"])  # finish order
        return [r["output_ids"] for r in rows]

    common = ["--dtype", "float32", "--max-new-tokens", "8", "--batch-size", "5"]
    kimi = [
        "--target",
        str(FIXTURES / "kimi_k25_wrapped"),
        "--prompts",
        str(write_prompts("kimi_k25_wrapped")),
    ]
    assert main([*common, *kimi, "--out", str(tmp_path / "kimi.jsonl")]) == 0
    want = [golden("kimi_k25_wrapped")[f"greedy_{i}"].tolist()[:8] for i in range(5)]
    assert outputs(tmp_path / "kimi.jsonl") == want
    tree = [
        "--target",
        str(FIXTURES / TP),
        "--prompts",
        str(write_prompts(TP)),
        "--draft",
        str(FIXTURES / DRAFT),
    ]
    tree += ["--budget", "5", "--draft-yarn-scaling", "hf", "--tp", "2"]
    assert main([*common, *tree, "--out", str(tmp_path / "tree.jsonl")]) == 0
    assert outputs(tmp_path / "tree.jsonl") == [golden(TP)[f"greedy_{i}"].tolist()[:8] for i in range(5)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("impl", ["pallas", "pallas-invariant"])
def test_kimi_k2_round_lowers_for_cuda(impl):
    """A whole ddtree round at Kimi-K2 width (a dense and a MoE layer, the MLA Pallas kernel, the
    drafter's GQA kernel) lowers for CUDA under an abstract H200, without a GPU; --batch-invariant's
    implementation too (it once ran the MLA layers through the jnp reference)."""
    from ddtree_jax import drafter, engine
    from ddtree_jax.bench.programs import synthetic_state
    from ddtree_jax.bench.shapes import SHAPES, draft_shape
    from ddtree_jax.engine import Plan
    from ddtree_jax.programs import Shape
    from ddtree_jax.weights import assemble

    cfg = dataclasses.replace(SHAPES["kimi-k2"], num_layers=2)
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
    assert "mla_attention" in text and "tree_attention" in text
