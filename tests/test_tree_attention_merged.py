"""Tree attention as prefix + in-flight parts merged by log-sum-exp, against the jnp reference, with
the jnp prefix standing in for the cuDNN one (which runs on the GPU only: scripts/h200_perf.sh)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.kernels.tree_attention import (
    merge_by_lse,
    prefix_attention_reference,
    tree_attention_merged,
    tree_attention_reference,
)


def inputs(seed, b, t, hkv, g, d, s, lengths, dtype):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (b, t, hkv * g, d), jnp.float32).astype(dtype)
    k_cache = jax.random.normal(keys[1], (b, hkv, s, d), jnp.float32).astype(dtype)
    v_cache = jax.random.normal(keys[2], (b, hkv, s, d), jnp.float32).astype(dtype)
    k_new = jax.random.normal(keys[3], (b, t, hkv, d), jnp.float32).astype(dtype)
    v_new = jax.random.normal(keys[4], (b, t, hkv, d), jnp.float32).astype(dtype)
    rng = np.random.default_rng(seed)
    parent = [rng.integers(0, max(i, 1)) for i in range(t)]
    mask = np.eye(t, dtype=bool)
    for i in range(1, t):  # ancestor-or-self of a random tree (parent[i] < i)
        mask[i] = mask[parent[i]]
        mask[i, i] = True
    mask = np.broadcast_to(mask, (b, t, t)).copy()
    return q, k_cache, v_cache, jnp.asarray(lengths, jnp.int32), k_new, v_new, mask


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_merged_matches_reference(dtype, tol):
    args = inputs(0, b=3, t=9, hkv=2, g=4, d=32, s=40, lengths=[40, 0, 17], dtype=dtype)
    want = tree_attention_reference(*args)
    got = tree_attention_merged(*args, prefix="reference")
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


def test_merge_of_a_split_equals_the_whole():
    # Cutting one key set in two disjoint halves and merging the halves gives the whole.
    q, k, v, _, *_ = inputs(1, b=2, t=3, hkv=1, g=2, d=16, s=24, lengths=[24, 24], dtype=jnp.float32)
    qp = q.reshape(2, 3, 1, 2, 16).transpose(0, 2, 1, 3, 4).reshape(2, 1, 6, 16)
    whole = prefix_attention_reference(qp, k, v, jnp.array([24, 10], jnp.int32))
    lo = prefix_attention_reference(qp, k[:, :, :7], v[:, :, :7], jnp.array([7, 7], jnp.int32))
    hi = prefix_attention_reference(qp, k[:, :, 7:], v[:, :, 7:], jnp.array([17, 3], jnp.int32))
    np.testing.assert_allclose(merge_by_lse([lo, hi]), whole[0], atol=1e-5, rtol=1e-5)


def test_rows_that_see_nothing_give_zeros():
    out = jnp.ones((2, 3))
    lse = jnp.array([-jnp.inf, 0.5])
    got = merge_by_lse([(out, lse), (2 * out, jnp.array([-jnp.inf, -jnp.inf]))])
    np.testing.assert_array_equal(got, [[0, 0, 0], [1, 1, 1]])
