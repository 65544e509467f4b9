"""Tensor and data parallelism on 8 fake CPU devices: weights really split, the collectives we expect in
the compiled program, per-prompt limits and long accepted paths on a mesh, other fixtures' layouts.
The same outcomes on every mesh for each family's pair are test_families.py's.

`qwen3_gqa4_tp` has 8 query heads and 2 K/V heads, so tp 4 and 8 replicate K/V heads (sharding.py).
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    EXTRA_PROMPTS,
    FIXTURES,
    golden,
    golden_prompts,
    load_drafter,
    load_target,
    oracle_draft,
    run,
)
from jax.sharding import PartitionSpec as P

from ddtree_jax import collectives, engine, programs, target
from ddtree_jax import sampling as sampling_lib
from ddtree_jax.cli import main
from ddtree_jax.sampling import SamplingArrays

TP = "qwen3_gqa4_tp"
DRAFT = "dflash_qwen3_gqa4_tp"
PROMPTS = golden_prompts(TP) + EXTRA_PROMPTS  # 8 prompts: one row per device at dp 8
NEW = 16
SAMPLING = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 7}


def outcome(results):
    return [(r.output_ids, r.acceptance_lengths, r.finish_reason) for r in results]


def generate(method, budget=0, tp=1, dp=1, **kw):
    draft = None if method == "ar" else DRAFT
    return outcome(
        run(TP, PROMPTS, method=method, draft_name=draft, budget=budget, batch_size=8, max_new_tokens=NEW,
            tp=tp, dp=dp, **kw)
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    """Outcomes on one device, per (method, budget)."""
    cache = {}

    def get(method, budget=0):
        if (method, budget) not in cache:
            cache[method, budget] = generate(method, budget)
        return cache[method, budget]

    return get


def test_own_max_new_tokens_on_a_mesh_host_stepped(reference):
    """Each prompt's own max_new_tokens on tp 4 x dp 2, host-stepped: the reference's tokens up to it."""
    limits = [3, NEW, 1, 7, NEW, 2, 11, NEW]
    got = generate("ddtree", 7, 4, 2, host_stepped=True, options=[{"max_new_tokens": n} for n in limits])
    for (ids, _, reason), (want, _, _), n in zip(got, reference("ddtree", 7), limits, strict=True):
        assert ids == want[:n] and reason == "length"


@pytest.mark.parametrize(
    "name,draft,method,tp,dp",
    [
        ("qwen3_gqa1", "dflash_qwen3_gqa1", "ddtree", 4, 2),  # K/V heads split, not replicated
        ("qwen3_gqa2_tied", None, "ar", 4, 1),  # tied embeddings: the lm_head is the split table
        ("llama3_scaled", None, "ar", 8, 1),
    ],
)
def test_other_fixtures_match_one_device(name, draft, method, tp, dp):
    prompts = golden_prompts(name)
    kw = dict(method=method, draft_name=draft, budget=5, batch_size=6, max_new_tokens=12)
    one = outcome(run(name, prompts, **kw))
    assert outcome(run(name, prompts, tp=tp, dp=dp, **kw)) == one
    assert [o[0] for o in one] == [golden(name)[f"greedy_{i}"].tolist()[:12] for i in range(5)]


# -- acceptance > 1 on a mesh: an oracle draft stage -------------------------------------------------


def test_long_acceptance_identical_on_meshes(reference):
    """An oracle draft stage proposing the ar continuation (rank 0 wrong at depth 3): long accepted paths."""
    ar = [r[0] for r in reference("ar")]
    stage = oracle_draft([p + o for p, o in zip(PROMPTS, ar, strict=True)], corrupt=3)
    for method, budget, longest in [("dflash", 0, 4), ("ddtree", 32, 8)]:  # the chain stops at depth 3
        one = generate(method, budget, draft_stage=stage)
        assert [o[0] for o in one] == ar
        assert max(a for o in one for a in o[1]) == longest, method
        # heads and rows split at once (tp 8 alone ran the same commit of long paths on one axis)
        assert generate(method, budget, 2, 2, draft_stage=stage) == one, method


# -- placement ---------------------------------------------------------------------------------------


def shard_shapes(array):
    return {tuple(s.data.shape) for s in array.addressable_shards}


@pytest.mark.parametrize("tp,dp", [(4, 1), (8, 1), (2, 2)])
def test_weights_split_over_model_axis(tp, dp):
    cfg, one = load_target(TP)
    _, params = load_target(TP, tp=tp, dp=dp)
    layer = params["layers"][0]
    h, v = cfg.dims.hidden_size, cfg.vocab_size
    hq, ff = cfg.dims.num_heads * cfg.dims.head_dim, cfg.dims.intermediate_size
    # q/k/v and gate/up fused: each device's heads of each (test_fused_projections.py)
    d, hkv = cfg.dims.head_dim, cfg.dims.num_kv_heads
    groups = max(hkv, tp) // tp
    assert shard_shapes(layer["qkv_proj"]) == {(h, groups, hq // tp // d // groups + 2, d)}
    assert shard_shapes(layer["o_proj"]) == {(hq // tp, h)}
    assert shard_shapes(layer["gate_up_proj"]) == {(h, 2, ff // tp)}
    assert shard_shapes(layer["down_proj"]) == {(ff // tp, h)}
    assert shard_shapes(params["lm_head"]) == {(h, v // tp)}
    assert shard_shapes(params["embed"]) == {(v // tp, h)}
    assert shard_shapes(layer["attn_norm"]) == {(h,)}

    # Per device, 1 / tp of the target's matrices besides K/V (norms are replicated, K/V may be).
    def split_bytes(tree, per_device):
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        return sum(
            (x.addressable_shards[0].data.nbytes if per_device else x.nbytes)
            for path, x in leaves
            if x.ndim == 2 and path[-1].key not in ("k_proj", "v_proj")
        )

    assert split_bytes(params, True) * tp == split_bytes(one, False)
    # Each device's K/V heads are the ones its query heads read (Hkv = 2 < tp repeats them):
    # test_fused_projections.py, per device against the unfused weights.


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_place_matches_the_loader(tp):
    """Placing whole weights (random benchmark weights) lays them out as the checkpoint loader does,
    K/V heads repeated included (Hkv = 2 < tp = 4, 8)."""
    from ddtree_jax.sharding import make_mesh, param_sharding

    cfg, one = load_target(TP)
    _, loaded = load_target(TP, tp=tp)
    placement = param_sharding(make_mesh(tp))
    placed = {spec.path: placement.place(spec, _at(one, spec.path)) for spec in target.weight_specs(cfg)}
    for path, x in placed.items():
        want = _at(loaded, path)
        assert x.sharding == want.sharding, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(want), err_msg=str(path))


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def test_drafter_split_like_target():
    _, dparams = load_drafter(DRAFT, tp=4)
    layer = dparams["layers"][0]
    # q apart, k/v fused: 8 query heads, 2 K/V heads of 16: per device 2 query heads and one K/V head
    assert shard_shapes(layer["q_proj"]) == {(64, 8 // 4 * 16)}
    assert shard_shapes(layer["kv_proj"]) == {(64, 1, 2, 16)}
    assert shard_shapes(layer["down_proj"]) == {(128 // 4, 64)}
    assert shard_shapes(dparams["fc"]) == {dparams["fc"].shape}  # replicated


def test_tp_program_all_reduces_and_gathers_no_weight():
    """The compiled TP4 program: all-reduces (o_proj, down_proj, vocab), no all-gather of a weight."""
    tp = 4
    cfg, params = load_target(TP, tp=tp)
    dcfg, dparams = load_drafter(DRAFT, tp=tp)
    plan = engine.Plan(cfg, dcfg, "ddtree", NEW, budget=7, branching=7, tp=tp)
    prompts = jnp.zeros((8, 16), jnp.int32)
    lengths, rows = jnp.full((8,), 3, jnp.int32), jnp.arange(8, dtype=jnp.int32)
    sampling = SamplingArrays.from_rows([SAMPLING] * 8)
    req = programs.Requests(prompts, lengths, rows, sampling, jnp.full((8,), NEW, jnp.int32))
    static = dict(plan=plan, shape=programs.Shape.of(plan, 8, 16), chunk=16, attention="reference")
    stop = jnp.full((engine.MAX_STOP_IDS,), -1, jnp.int32)
    lowered = programs.JITTED["generate"].lower(params, dparams, req, stop, **static)
    # psums after o_proj and down_proj of every target layer (prefill, verify) and draft layer, and
    # the vocabulary-parallel reductions.
    assert len(re.findall(r"stablehlo\.all_reduce", lowered.as_text())) >= 2 * (2 * cfg.num_layers + 2)
    hlo = lowered.compile().as_text()
    assert len(re.findall(r" all-reduce\(", hlo)) >= 2 * (cfg.num_layers + dcfg.num_layers)
    # The only all-gathers are top-k candidates, no weight: the drafter's (values, ids) [B, D, tp * k]
    # and the sampling shortlist's values [B, T, tp * 64] at the prefill (T = 1) and verify (T = 8).
    gathered = re.findall(r"= ([a-z0-9]+)\[([0-9,]*)\]\S* all-gather\(", hlo)
    shortlist = [("f32", f"8,{t},{tp * sampling_lib.SHORTLIST}") for t in (1, 8)]
    drafted = [("f32", f"8,{dcfg.depth},{tp * 7}"), ("s32", f"8,{dcfg.depth},{tp * 7}")]
    assert sorted(gathered) == sorted(drafted + shortlist)
    assert not re.search(r"all-to-all|collective-permute", hlo)


def test_cli_tp_dp(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": i, "input_ids": p}) + "\n" for i, p in enumerate(golden_prompts(TP)))
    )
    out = tmp_path / "o.jsonl"
    argv = ["--target", str(FIXTURES / TP), "--draft", str(FIXTURES / DRAFT), "--prompts", str(prompts),
            "--out", str(out), "--dtype", "float32", "--max-new-tokens", "12", "--batch-size", "3",
            "--budget", "7", "--tp", "4", "--dp", "2"]  # fmt: skip
    assert main(argv) == 0
    rows = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["id"])
    assert [r["output_ids"] for r in rows] == [golden(TP)[f"greedy_{i}"].tolist()[:12] for i in range(5)]


def test_embed_argmax_top_k_vocab_parallel():
    """The split embedding lookup, argmax and top-k (ties: lowest id) against one device, directly."""
    _, one = load_target(TP)
    _, params = load_target(TP, tp=8)
    mesh = params["embed"].sharding.mesh
    vocab, rep = P(None, None, "model"), P()

    def split(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    tokens = jnp.asarray([[0, 31, 32, 255, 128]], jnp.int32)
    embed = split(lambda e, t: target.embed({"embed": e}, t, "model"), (P("model"), rep), rep)
    np.testing.assert_array_equal(embed(params["embed"], tokens), target.embed(one, tokens))

    # Integers in a small range: many ties, within and across devices' vocabulary slices.
    x = jax.random.randint(jax.random.key(0), (4, 3, 256), 0, 6).astype(jnp.float32)
    x = x.at[0, 0].set(0.0).at[0, 0, 40].set(9.0).at[0, 0, 200].set(9.0)
    argmax = split(lambda a: collectives.argmax(a, "model"), (vocab,), rep)
    np.testing.assert_array_equal(argmax(x), jnp.argmax(x, axis=-1))
    assert int(argmax(x)[0, 0]) == 40
    for k in (1, 7, 32, 100):
        top = split(lambda a, k=k: collectives.sharded_top_k(a, k, "model"), (vocab,), (rep, rep))
        want_v, want_i = jax.lax.top_k(x, k)
        got_v, got_i = top(x)
        np.testing.assert_array_equal(got_v, want_v)
        np.testing.assert_array_equal(got_i, want_i)
    logp = split(lambda a: collectives.log_softmax(a, "model"), (vocab,), vocab)
    np.testing.assert_allclose(logp(x), jax.nn.log_softmax(x, axis=-1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("v", [151936, 10000, 50257])
def test_tiled_top_k_is_lax_top_k(v):
    """Values and ids equal `lax.top_k` (lowest id first among ties), with heavy ties and -inf."""
    x = jax.random.randint(jax.random.key(1), (3, 4, v), 0, 8).astype(jnp.float32)
    x = x.at[0, 0].set(1.0).at[0, 1, : v - 5].set(-jnp.inf).at[1, 2, v - 1].set(100.0)
    x = x.at[2].set(jax.random.normal(jax.random.key(2), (4, v)))
    for k in (1, 32, 64):
        want_v, want_i = jax.lax.top_k(x, k)
        got_v, got_i = jax.jit(collectives.tiled_top_k, static_argnums=1)(x, k)
        np.testing.assert_array_equal(got_v, want_v)
        np.testing.assert_array_equal(got_i, want_i)
