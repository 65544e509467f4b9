"""models.tree_experts: the distinct experts per layer a tree of each budget touches, against a NumPy
count of the first b + 1 nodes' experts (set union per tree), with padding nodes, under expert
parallelism; and the prefix rule against tree.build_tree (a smaller budget's tree is the bigger one's
first nodes)."""

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import tree
from ddtree_jax.models.tree_experts import distinct_experts_by_budget


def _count(experts, budgets, valid, devices, num_experts):
    """Plain loops: per budget and layer, the mean over trees of the busiest device's distinct experts."""
    layers, trees = experts.shape[:2]
    out = np.zeros((len(budgets), layers))
    for i, b in enumerate(budgets):
        for layer in range(layers):
            counts = []
            for r in range(trees):
                chosen = set()
                for t in range(b + 1):
                    if valid is None or valid[layer, r, t]:
                        chosen |= set(experts[layer, r, t].tolist())
                per = num_experts // devices
                counts.append(max(sum(1 for e in chosen if e // per == d) for d in range(devices)))
            out[i, layer] = np.mean(counts)
    return out


@pytest.mark.parametrize("padded,devices", [(False, 1), (True, 1), (True, 4)])
def test_distinct_by_budget_against_numpy(padded, devices):
    rng = np.random.default_rng(devices + padded)
    layers, trees, nodes, k, num_experts = 3, 5, 16, 4, 32
    experts = rng.integers(0, num_experts, (layers, trees, nodes, k))
    valid = rng.random((layers, trees, nodes)) > 0.3 if padded else None
    budgets = [0, 1, 3, 7, 15]
    got = distinct_experts_by_budget(experts, budgets, num_experts, valid, devices)
    np.testing.assert_allclose(got, _count(experts, budgets, valid, devices, num_experts))
    assert (np.diff(got, axis=0) >= 0).all()  # a bigger tree never touches fewer experts


def test_one_token_touches_its_k_experts():
    experts = np.asarray([[[[3, 1, 3, 0], [5, 6, 7, 1]]]])  # one layer, one tree, 2 nodes, k 4
    np.testing.assert_array_equal(distinct_experts_by_budget(experts, [0, 1], 8), [[3], [6]])
    with pytest.raises(ValueError):
        distinct_experts_by_budget(experts, [2], 8)


def test_smaller_budget_is_the_first_nodes():
    """The rule the counts rest on: tree.lattice_tree at budget 3 and 7 (branching min(budget, 32), as
    the engine drafts) gives the first 4 / 8 nodes of the budget-15 tree: same tokens, same parents."""
    rng = np.random.default_rng(0)
    logp = -np.sort(rng.exponential(1.0, (2, 6, 15)), axis=-1).astype(np.float32)  # descending per depth
    tok = np.stack([np.stack([rng.permutation(100)[:15] for _ in range(6)]) for _ in range(2)]).astype(
        np.int32
    )
    bonus = jnp.asarray([7, 9], jnp.int32)
    big = tree.lattice_tree(bonus, jnp.asarray(logp), jnp.asarray(tok), 15)
    for b in (3, 7):
        small = tree.lattice_tree(bonus, jnp.asarray(logp[..., :b]), jnp.asarray(tok[..., :b]), b)
        np.testing.assert_array_equal(np.asarray(small.tokens), np.asarray(big.tokens)[:, : b + 1])
        np.testing.assert_array_equal(np.asarray(small.parent), np.asarray(big.parent)[:, : b + 1])
