"""The DFlash drafter against an independent PyTorch implementation (the golden draft logits of
tests/make_fixtures.py, from compare/torch_reference.py's drafter)."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DRAFTERS, golden, load_drafter, load_target

from ddtree_jax import drafter
from ddtree_jax.compare import oracles
from ddtree_jax.config import default_target_layer_ids
from ddtree_jax.kv_cache import write
from ddtree_jax.models.gqa import empty_cache


def _draft_logits(name, features, bonus, window=None, split=None):
    """Drafter logits after committing `features` [L, F] (in two writes when `split` is set)."""
    cfg, dparams = load_drafter(name)
    _, tparams = load_target(DRAFTERS[name])
    n = features.shape[0]
    d = cfg.dims
    cache = empty_cache(cfg.num_layers, 1, d.num_kv_heads, 64, d.head_dim, jnp.float32)
    for start, stop in ((0, split), (split, n)) if split else ((0, n),):
        feats = jnp.asarray(features[start:stop])[None]
        positions = jnp.arange(start, stop)[None]
        cache = write(cache, drafter.context_kv(dparams, cfg, feats, positions), jnp.array([start]))
    cache.lengths = jnp.array([n], jnp.int32)
    out = drafter.draft_logits(dparams, cfg, tparams, jnp.array([bonus], jnp.int32), cache, window=window)
    return np.asarray(out)[0]


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_draft_logits_match_torch_reference(name):
    g = golden(name)
    for i in range(5):
        ref = g[f"draft_logits_{i}"]
        got = _draft_logits(name, g[f"feat_{i}"], int(g[f"block_{i}"][0]))
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4, (name, i)


def test_context_committed_in_pieces_equals_one_pass():
    """Prefill commits the prompt's context at once, rounds commit a few tokens: same cache."""
    name = "dflash_qwen3_gqa4_tp"
    g = golden(name)
    feats, bonus = g["feat_4"], int(g["block_4"][0])
    np.testing.assert_allclose(
        _draft_logits(name, feats, bonus, split=11),
        g["draft_logits_4"],
        rtol=1e-4,
        atol=1e-4 * np.abs(g["draft_logits_4"]).max(),
    )


def test_draft_window_sees_only_the_last_tokens():
    name = "dflash_qwen3_gqa4_tp"
    g = golden(name)
    feats, bonus = g["feat_4"], int(g["block_4"][0])  # 30 context tokens
    windowed = _draft_logits(name, feats, bonus, window=6)
    # Equivalent: only the last 6 context tokens committed (at their true positions).
    cfg, dparams = load_drafter(name)
    _, tparams = load_target(DRAFTERS[name])
    d = cfg.dims
    cache = empty_cache(cfg.num_layers, 1, d.num_kv_heads, 64, d.head_dim, jnp.float32)
    kv = drafter.context_kv(dparams, cfg, jnp.asarray(feats)[None], jnp.arange(30)[None])
    kv = [(k.at[:, :24].set(0), v.at[:, :24].set(0)) for k, v in kv]  # zeroed: must not matter
    cache = write(cache, kv, jnp.array([0]))
    cache.lengths = jnp.array([30], jnp.int32)
    again = np.asarray(drafter.draft_logits(dparams, cfg, tparams, jnp.array([bonus]), cache, window=6))[0]
    np.testing.assert_allclose(windowed, again, rtol=1e-5, atol=1e-5)
    assert np.abs(windowed - g["draft_logits_4"]).max() > 1e-2  # the window does change the draft


def test_default_target_layer_ids():
    assert default_target_layer_ids(4, 1) == (2,)
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    for layers, draft_layers in [(n, m) for n in range(4, 64) for m in range(1, 9)]:
        assert list(default_target_layer_ids(layers, draft_layers)) == oracles.default_target_layer_ids(
            layers, draft_layers
        ), (layers, draft_layers)
    assert load_drafter("dflash_qwen3_gqa1")[0].target_layer_ids == (2,)  # config gives none


def test_generation_with_draft_window_stays_lossless():
    from conftest import golden_prompts

    from ddtree_jax.engine import Plan
    from ddtree_jax.prompts import Prompt
    from ddtree_jax.scheduler import Generator, Schedule

    cfg, params = load_target("qwen3_gqa4_tp")
    dcfg, dparams = load_drafter("dflash_qwen3_gqa4_tp")
    plan = Plan(cfg, dcfg, "ddtree", max_new_tokens=24, budget=7, branching=7, draft_window=4)
    prompts = [Prompt(i, i + 1, p, {}) for i, p in enumerate(golden_prompts("qwen3_gqa4_tp"))]
    results = list(Generator(params, dparams, plan, (), schedule=Schedule(5, "static")).run(prompts))
    assert [r.output_ids for r in results] == [
        golden("qwen3_gqa4_tp")[f"greedy_{i}"].tolist() for i in range(5)
    ]
