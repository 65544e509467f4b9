"""DFlash2 drafters against the public PyTorch reference (z-lab's DFlash2DraftModel; the fixture and its
expected outputs are tests/fixtures/dflash2/make_dflash2.py's): draft logits, the selector's candidates
and edge scores, its greedy chain and its sampling distribution over the candidates; the config rules."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, golden, load_target

from ddtree_jax import collectives, dflash2, drafter
from ddtree_jax.config import load_draft_config
from ddtree_jax.errors import DDTreeError
from ddtree_jax.kv_cache import write
from ddtree_jax.models.gqa import empty_cache
from ddtree_jax.sharding import make_mesh, param_sharding

DRAFT = FIXTURES / "dflash2" / "qwen3_gqa4_tp"
TARGET = "qwen3_gqa4_tp"
CASES = golden("dflash_qwen3_gqa4_tp")  # the context features and bonus of each case (as the recipe)


def load(directory=DRAFT, tp: int = 1):
    """(config, params) of a DFlash2 drafter for the fixture target, on `tp` model devices."""
    cfg, _ = load_target(TARGET, tp=tp)
    return drafter.load(directory, cfg, jnp.float32, param_sharding(make_mesh(tp, 1)))


def propose(i: int):
    """Draft states' logits [D, V], candidates and unary [D, K], edge scores [D, K, K] of case i."""
    cfg, params = load()
    _, tparams = load_target(TARGET)
    feats, bonus = CASES[f"feat_{i}"], int(CASES[f"block_{i}"][0])
    n, d = feats.shape[0], cfg.dims
    cache = empty_cache(cfg.num_layers, 1, d.num_kv_heads, 64, d.head_dim, jnp.float32)
    kv = drafter.context_kv(params, cfg, jnp.asarray(feats)[None], jnp.arange(n)[None])
    cache = write(cache, kv, jnp.array([0]))
    cache.lengths = jnp.array([n], jnp.int32)
    hidden = drafter.draft_hidden(params, cfg, tparams, jnp.array([bonus], jnp.int32), cache)
    logits = drafter.head_logits(cfg, tparams, hidden)
    unary, cand = collectives.sharded_top_k(logits, cfg.dflash2.selector_top_k, None)
    edges = dflash2.edge_scores(params, hidden, unary, cand, jnp.array([bonus], jnp.int32))
    return [np.asarray(x)[0] for x in (logits, unary, cand, edges)]


def test_config_reads_the_dflash2_fields():
    cfg, _ = load()
    c = cfg.dflash2
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (3, 16, 8, 4)
    assert (c.input_embedding_scale, c.output_multiplier, c.final_logit_softcapping) == (1.5, 0.7, 6.0)
    assert c.sliding == (False, True, True) and c.sliding_window == 6
    assert c.causal == (False, True, True)  # no is_causal: the sliding layers are causal (the reference's)
    assert cfg.block_size == 8  # from dflash_config


@pytest.mark.parametrize("i", range(5))
def test_logits_candidates_and_edges_match_reference(i):
    want = np.load(DRAFT / "expected.npz")
    logits, unary, cand, edges = propose(i)
    ref = want[f"logits_{i}"]
    assert np.abs(logits - ref).max() <= 1e-5 * np.abs(ref).max()
    ref_cand = want[f"cand_{i}"]
    # The same candidates (the reference's top-k is unsorted): map its order onto ours.
    order = np.array([[list(cand[d]).index(t) for t in ref_cand[d]] for d in range(len(cand))])
    np.testing.assert_allclose(np.take_along_axis(unary, order, 1), want[f"unary_{i}"], rtol=1e-5, atol=1e-6)
    prev = np.concatenate([np.zeros((1, order.shape[1]), int), order[:-1]])  # depth 1: the anchor's rows
    mine = np.stack([edges[d][prev[d]][:, order[d]] for d in range(len(order))])
    ref_edges = want[f"edges_{i}"]
    assert np.abs(mine - ref_edges).max() <= 1e-5 * np.abs(ref_edges).max()


@pytest.mark.parametrize("i", range(5))
def test_chain_and_sampling_distribution_match_reference(i):
    want = np.load(DRAFT / "expected.npz")
    _, _, cand, edges = propose(i)
    tok, _ = dflash2.chain(jnp.asarray(edges)[None], jnp.asarray(cand)[None])
    assert np.asarray(tok)[0].tolist() == want[f"path_{i}"].tolist()
    # Sampling at temperature 1: q over the K candidates from the sampled predecessor, in the
    # reference's candidate order.
    spath, ref_cand = want[f"spath_{i}"], want[f"cand_{i}"]
    pred_rank = 0
    for d in range(len(cand)):
        q = jax.nn.softmax(edges[d][pred_rank])
        order = [list(cand[d]).index(t) for t in ref_cand[d]]
        np.testing.assert_allclose(np.asarray(q)[order], want[f"q_{i}"][d], rtol=0, atol=1e-5)
        pred_rank = list(cand[d]).index(int(spath[d]))


def test_missing_config_key_and_tensor_are_named(tmp_path):
    cfg, _ = load_target(TARGET)
    raw = json.loads((DRAFT / "config.json").read_text())
    del raw["dflash_config"]["selector_rank"]
    bad = tmp_path / "no_rank"
    shutil.copytree(DRAFT, bad)
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DDTreeError, match="selector_rank"):
        load_draft_config(bad, cfg)
    from safetensors.numpy import load_file, save_file

    short = tmp_path / "no_codebook"
    shutil.copytree(DRAFT, short)
    tensors = load_file(str(DRAFT / "model.safetensors"))
    del tensors["candidate_selector.successor_codebook"]
    save_file(tensors, str(short / "model.safetensors"))
    with pytest.raises(DDTreeError, match="candidate_selector.successor_codebook"):
        load(short)


def test_is_causal_and_window_rules(tmp_path):
    cfg, _ = load_target(TARGET)
    raw = json.loads((DRAFT / "config.json").read_text())
    for change, causal, sliding in [
        ({"is_causal": False}, (False,) * 3, (False, True, True)),
        ({"is_causal": True}, (True,) * 3, (False, True, True)),
        ({"use_sliding_window": False}, (False, True, True), (False,) * 3),  # HF: no window at all
    ]:
        (tmp_path / "config.json").write_text(json.dumps(raw | change))
        c = load_draft_config(tmp_path, cfg).dflash2
        assert (c.causal, c.sliding) == (causal, sliding), change


def test_published_27b_config():
    """The fields of the published Qwen3.8-27B-style DFlash2 config (block size inside dflash_config,
    every layer sliding, `is_causal: false` at the top level) as this loader reads them."""
    from pathlib import Path

    from ddtree_jax.config import dflash2_config

    raw = {
        "architectures": ["DFlash2DraftModel"],
        "hidden_size": 6656,
        "is_causal": False,
        "use_sliding_window": True,
        "sliding_window": 2048,
        "layer_types": ["sliding_attention"] * 5,
        "dflash_config": {
            "block_size": 16,
            "conv_group_size": 16,
            "conv_kernel_size": 2,
            "final_logit_softcapping": 20.0,
            "mask_token_id": 201818,
            "output_multiplier": 0.19611613513818404,
            "selector_rank": 256,
            "selector_top_k": 16,
            "target_layer_ids": [1, 13, 25, 37, 49],
        },
    }
    c = dflash2_config(raw, Path("config.json"), 5)
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (2, 16, 256, 16)
    assert c.sliding == (True,) * 5 and c.sliding_window == 2048 and c.causal == (False,) * 5
    assert c.final_logit_softcapping == 20.0 and c.output_multiplier == 0.19611613513818404
    assert c.input_embedding_scale == 1.0 and c.selector
