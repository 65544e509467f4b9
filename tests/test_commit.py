"""The walk and commit steps on a synthetic tree and synthetic target choices: which slots they write."""

import jax.numpy as jnp
import numpy as np
from conftest import load_drafter, load_target

from ddtree_jax import engine, prefill, programs, tree
from ddtree_jax.engine import MAX_STOP_IDS, Plan
from ddtree_jax.models.gqa import KVEntry


def prefilled(params, dparams, plan, prompts, lengths, rows):
    """The state of prompts [B, P] prefilled in one chunk, a request bound for row B or more inactive."""
    b = prompts.shape[0]
    req = programs.Requests(prompts, lengths, rows, None, jnp.full((b,), plan.max_new_tokens, jnp.int32))
    stop = jnp.full((MAX_STOP_IDS,), -1, jnp.int32)
    return prefill.prefill(
        params,
        dparams,
        req,
        stop,
        plan=plan,
        rows=b,
        capacity=plan.capacity(16),
        chunk=16,
        attention="reference",
    )


def test_commit_writes_the_accepted_path_and_nothing_before_it():
    cfg, params = load_target("qwen3_gqa4_tp")
    dcfg, dparams = load_drafter("dflash_qwen3_gqa4_tp")  # block 8: depth 7
    plan = Plan(cfg, dcfg, "dflash", max_new_tokens=20)
    prompts = jnp.asarray(np.arange(32, dtype=np.int32).reshape(2, 16) + 3)
    lengths = jnp.array([9, 14], jnp.int32)
    state = prefilled(params, dparams, plan, prompts, lengths, jnp.arange(2))

    drafted = jnp.asarray(np.array([[11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24, 25, 26, 27]], np.int32))
    t = tree.chain_tree(state.bonus, drafted[:, :, None])  # T = 8
    accept = [3, 0]  # drafted tokens the target agrees with, per row
    choice = np.full((2, 8), 99, np.int32)
    for b, m in enumerate(accept):
        choice[b, :m] = np.asarray(drafted[b, :m])
        choice[b, m] = 200 + b  # the bonus after the accepted path
    # Recognisable tree K/V: value = 1000 * layer + node index.
    hkv, d = cfg.dims.num_kv_heads, cfg.dims.head_dim
    node = jnp.arange(8, dtype=jnp.float32)[None, :, None, None]
    kv = [KVEntry(*(jnp.broadcast_to(1000.0 * i + node, (2, 8, hkv, d)),) * 2) for i in range(cfg.num_layers)]
    features = jnp.zeros((2, 8, 2 * cfg.dims.hidden_size), jnp.float32)

    w = engine.walk(t, jnp.asarray(choice), plan=plan)
    np.testing.assert_array_equal(w.length, [a + 1 for a in accept])
    new = engine.commit(dparams, state, w, kv, features, plan=plan)

    for b, m in enumerate(accept):
        old_len, a = int(lengths[b]), m + 1
        assert int(new.cache.lengths[b]) == old_len + a  # the one length, which the drafter reads too
        for i in (0, cfg.num_layers - 1):
            k = np.asarray(new.cache.layers[i].k[b, 0, :, 0])
            np.testing.assert_array_equal(k[old_len : old_len + a], 1000.0 * i + np.arange(a))
            np.testing.assert_array_equal(k[:old_len], np.asarray(state.cache.layers[i].k[b, 0, :old_len, 0]))
        emitted = np.asarray(new.output[b, 1 : 1 + a])
        np.testing.assert_array_equal(emitted, list(np.asarray(drafted[b, :m])) + [200 + b])
        assert int(new.num_output[b]) == 1 + a and int(new.acceptance[b, 0]) == a
        assert int(new.bonus[b]) == 200 + b and int(new.rounds[b]) == 1


def test_finished_sequence_stays_frozen():
    cfg, params = load_target("qwen3_gqa4_tp")
    plan = Plan(cfg, None, "ar", max_new_tokens=5)
    prompts = jnp.ones((2, 16), jnp.int32)
    state = prefilled(params, None, plan, prompts, jnp.array([4, 6]), jnp.array([0, 2]))  # row 2: inactive
    assert bool(state.done[1]) and int(state.num_output[1]) == 0
    t = tree.chain_tree(state.bonus, jnp.zeros((2, 0, 1), jnp.int32))
    choice, kv, feats = engine.verify(params, state, t, plan=plan)
    new = engine.commit(None, state, engine.walk(t, choice, plan=plan), kv, feats, plan=plan)
    assert int(new.cache.lengths[1]) == 6 and int(new.num_output[1]) == 0 and int(new.rounds[1]) == 0
    assert int(new.cache.lengths[0]) == 5 and int(new.num_output[0]) == 2
