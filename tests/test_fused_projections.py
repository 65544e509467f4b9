"""Fused projections of the dense family (issue 50): q/k/v as one weight [H, Hkv, Hq/Hkv + 2, D] and
gate/up as one [H, 2, F], one matmul each. References: the unfused model (HF's five weights, as the
checkpoint stores them: `Family.unfused`), and numpy slices of the checkpoint's tensors for the heads
each device of a mesh must hold."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, golden, load_target

from ddtree_jax import models, target
from ddtree_jax.checkpoint import Checkpoint, fingerprint
from ddtree_jax.sharding import make_mesh, param_sharding
from ddtree_jax.weights import stack_layers

TP = "qwen3_gqa4_tp"  # 8 query heads, 2 K/V heads: tp 4 and 8 repeat K/V heads


def unfused_target(name, tp=1):
    """(config, params) of a fixture target with HF's five projection weights per layer."""
    cfg = models.load_target_config(FIXTURES / name)
    placement = param_sharding(make_mesh(tp))
    return target.load(FIXTURES / name, jnp.dtype("float32"), placement, cfg=models.family(cfg).unfused(cfg))


@pytest.mark.parametrize("name", ["qwen3_gqa4_tp", "llama_gqa2", "qwen3_gqa1"])
def test_fused_forward_equals_unfused(name):
    """float32 hidden states, drafter features, new K/V and logits of the fused layout equal the
    unfused model's (bit for bit on the CPU), from a prefill and over the prefill's cache."""
    from ddtree_jax.kv_cache import KVCache

    cfg, params = load_target(name)
    ucfg, uparams = unfused_target(name)
    assert cfg.fused_projections and not ucfg.fused_projections
    assert {"qkv_proj", "gate_up_proj"} <= set(params["layers"][0])
    assert not {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} & set(params["layers"][0])
    assert {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} <= set(uparams["layers"][0])
    ids = golden(name)["prompt_4"]
    n = len(ids)
    args = (jnp.asarray(ids)[None], jnp.arange(n)[None], jnp.tril(jnp.ones((n, n), bool))[None], None)
    layers = (0, cfg.num_layers - 1)
    got = target.forward(params, cfg, *args, feature_layers=layers)
    want = target.forward(uparams, ucfg, *args, feature_layers=layers)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(
        np.asarray(target.logits(params, got.hidden)), np.asarray(target.logits(uparams, want.hidden))
    )
    # two more tokens over the cache the prefill's K/V make
    cache = KVCache(
        [jax.tree.map(lambda x: jnp.swapaxes(x, 1, 2), e) for e in want.kv], jnp.full((1,), n, jnp.int32)
    )
    step = (jnp.asarray([[3, 5]]), jnp.asarray([[n, n + 1]]), jnp.tril(jnp.ones((2, 2), bool))[None], cache)
    np.testing.assert_array_equal(
        np.asarray(target.forward(params, cfg, *step).hidden),
        np.asarray(target.forward(uparams, ucfg, *step).hidden),
    )


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_each_device_holds_its_heads(tp):
    """Device j's block of qkv_proj holds the query heads [j Hq/tp, (j+1) Hq/tp) and the K/V heads they
    read (Hkv = 2 < tp: one, repeated), and its block of gate_up_proj gate's and up's columns
    [j F/tp, (j+1) F/tp): read from the checkpoint's tensors with numpy."""
    cfg, params = load_target(TP, tp=tp)
    ckpt = Checkpoint(FIXTURES / TP)
    dims, attn, mlp = cfg.dims, "model.layers.1.self_attn.", "model.layers.1.mlp."
    hq, hkv, d = dims.num_heads, dims.num_kv_heads, dims.head_dim
    q, k, v = (ckpt.files[0].read(attn + f"{x}_proj.weight").T for x in "qkv")  # [H, heads * D]
    gate, up = (ckpt.files[0].read(mlp + f"{x}_proj.weight").T for x in ("gate", "up"))
    h, ff = gate.shape
    layer = params["layers"][1]
    for s in layer["qkv_proj"].addressable_shards:
        groups, per = s.data.shape[1], s.data.shape[2]
        j = s.index[1].start // groups  # the device's position along "model"
        local = np.asarray(s.data)  # [H, groups, per, D]
        heads = range(j * hq // tp, (j + 1) * hq // tp)
        kv_heads = sorted({i // (hq // hkv) for i in heads})
        assert groups == len(kv_heads) and per == len(heads) // groups + 2
        np.testing.assert_array_equal(
            local[:, :, :-2].reshape(h, -1), q.reshape(h, hq, d)[:, list(heads)].reshape(h, -1)
        )
        np.testing.assert_array_equal(local[:, :, -2], k.reshape(h, hkv, d)[:, kv_heads])
        np.testing.assert_array_equal(local[:, :, -1], v.reshape(h, hkv, d)[:, kv_heads])
    for s in layer["gate_up_proj"].addressable_shards:
        cols = s.index[2]
        np.testing.assert_array_equal(np.asarray(s.data), np.stack([gate[:, cols], up[:, cols]], axis=1))
    assert len({s.index for s in layer["gate_up_proj"].addressable_shards}) == tp
    assert ff % tp == 0


@pytest.mark.parametrize("tp", [2, 4])
def test_mesh_forward_equals_unfused_one_device(tp):
    """The fused target on a tp mesh (K/V heads repeated at tp 4), run under shard_map as the engine
    runs it: logits equal the unfused one-device model's to float32 rounding (the all-reduces sum
    partial products in another order)."""
    from jax.sharding import PartitionSpec as P

    from ddtree_jax.engine import param_specs
    from ddtree_jax.pair import make_plan

    cfg, params = load_target(TP, tp=tp)
    ucfg, uparams = unfused_target(TP)
    ids = golden(TP)["prompt_4"]
    n = len(ids)
    args = (jnp.asarray(ids)[None], jnp.arange(n)[None], jnp.tril(jnp.ones((n, n), bool))[None])
    plan = make_plan(cfg, None, "ar", batch_size=1, max_new_tokens=4, attention="reference", tp=tp)

    def local(p, tokens, positions, mask):
        out = target.forward(p, cfg, tokens, positions, mask, None, model_axis="model")
        return target.logits(p, out.hidden, cfg.vocab_size, model_axis="model")

    specs, _ = param_specs(plan)
    fn = jax.shard_map(
        local, mesh=make_mesh(tp), in_specs=(specs, P(), P(), P()), out_specs=P(None, None, "model")
    )
    got = np.asarray(jax.jit(fn)(params, *args))[..., : cfg.vocab_size]
    want = np.asarray(target.logits(uparams, target.forward(uparams, ucfg, *args, None).hidden))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_specs_opt_out_scan_layers_and_cache_key():
    """The fused specs read every checkpoint tensor the unfused ones do; `--scan-layers` stacks a fused
    weight's parts layer by layer; the params cache's key differs between the two layouts."""
    cfg = models.load_target_config(FIXTURES / TP)
    ucfg = models.family(cfg).unfused(cfg)
    fused, plain = target.weight_specs(cfg), target.weight_specs(ucfg)
    names = sorted(p.hf_name for s in fused for p in s.pieces())
    assert names == sorted(p.hf_name for s in plain for p in s.pieces())
    qkv = next(s for s in fused if s.path[-1] == "qkv_proj")
    assert [p.path[-1] for p in qkv.parts] == ["q_proj", "k_proj", "v_proj"]
    stacked = {s.path[-1]: s for s in stack_layers(fused)}
    assert stacked["qkv_proj"].shape == (cfg.num_layers, *qkv.shape)
    assert stacked["qkv_proj"].parts[1].stack == tuple(
        f"model.layers.{i}.self_attn.k_proj.weight" for i in range(cfg.num_layers)
    )
    placement = param_sharding(make_mesh(1))
    assert fingerprint(FIXTURES / TP, fused, jnp.float32, placement) != fingerprint(
        FIXTURES / TP, plain, jnp.float32, placement
    )
    # a config made in code (training, save_hf) keeps HF's layout unless it asks
    assert not models.family(cfg).unfused(cfg).fused_projections


@pytest.mark.parametrize("name", ["dflash_qwen3_gqa4_tp", "dflash2/qwen3_gqa4_tp"])
def test_fused_drafter_equals_unfused(name):
    """A drafter's context K/V and draft logits (DFlash and DFlash2 layers) from its fused weights equal
    the unfused drafter's, float32, bit for bit on the CPU."""
    import dataclasses

    from ddtree_jax import drafter
    from ddtree_jax.config import load_draft_config
    from ddtree_jax.kv_cache import KVCache

    tcfg, tparams = load_target(TP)
    placement = param_sharding(make_mesh(1))
    cfg, params = drafter.load(FIXTURES / name, tcfg, jnp.float32, placement)
    ucfg = dataclasses.replace(load_draft_config(FIXTURES / name, tcfg), fused_projections=False)
    ucfg, uparams = drafter.load(FIXTURES / name, tcfg, jnp.float32, placement, cfg=ucfg)
    assert {"q_proj", "kv_proj"} <= set(params["layers"][0]) and "k_proj" in uparams["layers"][0]
    assert not {"qkv_proj", "k_proj", "v_proj"} & set(params["layers"][0])
    t = 2 * cfg.block_size
    feats = jax.random.normal(jax.random.key(0), (2, t, len(cfg.target_layer_ids) * tcfg.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(t), (2, t))
    got, want = (
        drafter.context_kv(params, cfg, feats, positions),
        drafter.context_kv(uparams, ucfg, feats, positions),
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cache = KVCache(
        [jax.tree.map(lambda x: jnp.swapaxes(x, 1, 2), e) for e in want], jnp.full((2,), t, jnp.int32)
    )
    bonus = jnp.asarray([3, 7])
    np.testing.assert_array_equal(
        np.asarray(drafter.draft_logits(params, cfg, tparams, bonus, cache)),
        np.asarray(drafter.draft_logits(uparams, ucfg, tparams, bonus, cache)),
    )


def _read_leaves(fn, params) -> set[str]:
    """The paths of the leaves of `params` that fn(params) reads (inputs of its jaxpr's equations)."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    jaxpr = jax.make_jaxpr(fn)(params).jaxpr
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, jax.extend.core.Var)}
    return {jax.tree_util.keystr(path) for (path, _), var in zip(leaves, jaxpr.invars, strict=True)
            if id(var) in used}  # fmt: skip


@pytest.mark.parametrize("name", ["dflash_qwen3_gqa4_tp", "dflash2/qwen3_gqa4_tp"])
def test_fused_drafter_context_reads_no_query_columns(name):
    """The fused drafter's context projection (run every round, root-only rounds too) reads fc, its norm
    and each layer's K/V weight and K norm, never a weight holding query heads; their sizes are what
    plan_choice.projection_share counts."""
    from ddtree_jax import drafter, plan_choice

    tcfg, tparams = load_target(TP)
    cfg, params = drafter.load(FIXTURES / name, tcfg, jnp.float32, param_sharding(make_mesh(1)))
    t = 3
    feats = jnp.ones((1, t, len(cfg.target_layer_ids) * tcfg.hidden_size), jnp.float32)
    positions = jnp.arange(t)[None]
    read = _read_leaves(lambda p: drafter.context_kv(p, cfg, feats, positions), params)
    per_layer = ["kv_proj", "k_norm"] if cfg.dims.qk_norm else ["kv_proj"]
    want = {"['fc']", "['hidden_norm']"} | {
        f"['layers'][{i}]['{w}']" for i in range(cfg.num_layers) for w in per_layer
    }
    assert read == want
    sizes = {jax.tree_util.keystr(k): x.size for k, x in jax.tree_util.tree_leaves_with_path(params)}
    target_size = sum(x.size for x in jax.tree.leaves(tparams))
    share = plan_choice.projection_share(tcfg, cfg, float(target_size))
    assert sum(sizes[k] for k in read) == pytest.approx(share * target_size, rel=1e-12)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_drafter_devices_hold_their_kv_heads(tp):
    """Device j's block of a fused drafter's kv_proj holds the K/V heads its block of q_proj's query
    heads [j Hq/tp, (j+1) Hq/tp) read (Hkv = 2 < tp at 4, 8: one, repeated): numpy slices of the
    checkpoint's tensors."""
    from ddtree_jax import drafter

    tcfg, _ = load_target(TP)
    name = "dflash_qwen3_gqa4_tp"
    cfg, params = drafter.load(FIXTURES / name, tcfg, jnp.float32, param_sharding(make_mesh(tp)))
    ckpt = Checkpoint(FIXTURES / name)
    hq, hkv, d = cfg.dims.num_heads, cfg.dims.num_kv_heads, cfg.dims.head_dim
    attn = "layers.1.self_attn."
    q, k, v = (ckpt.where[attn + f"{x}_proj.weight"].read(attn + f"{x}_proj.weight").T for x in "qkv")
    h = q.shape[0]
    layer = params["layers"][1]
    qs = {s.device: s for s in layer["q_proj"].addressable_shards}
    for s in layer["kv_proj"].addressable_shards:
        groups = s.data.shape[1]
        j = s.index[1].start // groups  # the device's position along "model"
        heads = range(j * hq // tp, (j + 1) * hq // tp)
        kv_heads = sorted({i // (hq // hkv) for i in heads})
        assert s.data.shape[1:] == (len(kv_heads), 2, d)
        local = np.asarray(s.data)
        np.testing.assert_array_equal(local[:, :, 0], k.reshape(h, hkv, d)[:, kv_heads])
        np.testing.assert_array_equal(local[:, :, 1], v.reshape(h, hkv, d)[:, kv_heads])
        np.testing.assert_array_equal(
            np.asarray(qs[s.device].data), q.reshape(h, hq, d)[:, list(heads)].reshape(h, -1)
        )


def test_save_hf_writes_the_fused_drafters_parts(tmp_path):
    """save_hf of a fused drafter (q apart, k/v fused) writes the checkpoint's tensors."""
    from ddtree_jax import drafter
    from ddtree_jax.checkpoint import save_hf

    name = "dflash_qwen3_gqa4_tp"
    tcfg, _ = load_target(TP)
    cfg, params = drafter.load(FIXTURES / name, tcfg, jnp.float32, param_sharding(make_mesh(1)))
    save_hf(params, drafter.weight_specs(cfg), tmp_path, {}, dtype=np.float32)
    _assert_same_tensors(tmp_path, FIXTURES / name)


def test_save_hf_writes_the_parts(tmp_path):
    """save_hf of fused weights writes HF's tensors: equal to the checkpoint's."""
    from ddtree_jax.checkpoint import save_hf

    cfg, params = load_target(TP)
    save_hf(params, target.weight_specs(cfg), tmp_path, {}, dtype=np.float32)
    _assert_same_tensors(tmp_path, FIXTURES / TP)


def _assert_same_tensors(written, original) -> None:
    """The checkpoint directory `written` holds exactly `original`'s tensors, equal to them."""
    mine, theirs = Checkpoint(written), Checkpoint(original)
    assert set(mine.where) == set(theirs.where)
    for name in theirs.where:
        np.testing.assert_array_equal(
            mine.where[name].read(name), theirs.where[name].read(name), err_msg=name
        )
