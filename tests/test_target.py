"""The target forward against HF transformers (fixtures from tests/make_fixtures.py): bfloat16 logits and
drafter features; float32 logits of every family are test_families.py's."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import golden, load_target

from ddtree_jax import target


def _logits(name, ids, dtype="float32"):
    cfg, params = load_target(name, dtype)
    n = len(ids)
    out = target.forward(
        params, cfg, jnp.asarray(ids)[None], jnp.arange(n)[None], jnp.tril(jnp.ones((n, n), bool))[None], None
    )
    return np.asarray(target.logits(params, out.hidden))[0]


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "llama3_scaled"])
def test_bfloat16_logits_close_to_hf(name):
    g = golden(name)
    ref = g["logits_4"]
    got = _logits(name, g["prompt_4"], "bfloat16")
    # Fixture weights are large (std ~0.3), so bf16 rounding moves logits by a few percent.
    assert np.abs(got - ref).max() / np.abs(ref).max() < 0.1
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) > 0.75


@pytest.mark.parametrize("name", ["qwen3_gqa4_tp", "llama_gqa2"])
def test_feature_layers_are_hf_hidden_states(name):
    """features = HF hidden_states[i + 1] of the chosen layers, the last one included (after the
    final norm in HF's definition)."""
    cfg, params = load_target(name)
    g = golden(name)
    ids = g["prompt_3"]
    n = len(ids)
    layers = (0, 2, cfg.num_layers - 1)
    out = target.forward(
        params,
        cfg,
        jnp.asarray(ids)[None],
        jnp.arange(n)[None],
        jnp.tril(jnp.ones((n, n), bool))[None],
        None,
        feature_layers=layers,
    )
    ref = np.concatenate([g["hidden_3"][i + 1] for i in layers], -1)
    np.testing.assert_allclose(np.asarray(out.features)[0], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
