"""The edge-score tree (tree_edges.py) against a heap oracle, its walk against exact probabilities on a
tiny vocabulary, and in the round with an oracle drafter whose edge scores follow the reference
continuation."""

import heapq
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import golden, golden_prompts, run

from ddtree_jax import tree
from ddtree_jax.sharding import DATA
from ddtree_jax.tree_edges import edge_tree


def heap_tree(bonus: int, elogp: np.ndarray, tok: np.ndarray, budget: int):
    """Best-first by summed edge log-scores with a heap (float32 sums from the root, as the builder adds
    them); ties: shallower, then the parent's order within its depth, then the lower rank. -> tokens,
    parent, depth, valid [T] (padded as tree.Tree)."""
    d_max, k, _ = elogp.shape
    e = np.clip(elogp.astype(np.float32), -1e20, 0.0)
    heap, count = [], {}
    nodes = [(int(bonus), 0, 0)]  # token, parent, depth
    for c in range(k):
        heapq.heappush(heap, (-float(np.float32(0) + e[0, 0, c]), 1, 0, c, 0, np.float32(0) + e[0, 0, c]))
    while heap and len(nodes) < budget + 1:
        _, depth, _, c, parent, score = heapq.heappop(heap)
        me, order = len(nodes), count.get(depth, 0)
        count[depth] = order + 1
        nodes.append((int(tok[depth - 1, c]), parent, depth))
        if depth < d_max:
            for c2 in range(k):
                s = np.float32(score + e[depth, c, c2])
                heapq.heappush(heap, (-float(s), depth + 1, order, c2, me, s))
    t = budget + 1
    out = np.zeros((3, t), np.int32)
    out[:, : len(nodes)] = np.array(nodes, np.int32).T
    valid = np.arange(t) < len(nodes)
    return out[0], out[1], out[2], valid


def ancestors(parent, depth, valid):
    t = len(parent)
    mask = np.eye(t, dtype=bool)
    for i in range(t):
        j = i
        while valid[i] and depth[j] > 0:
            j = parent[j]
            mask[i, j] = True
    return mask


@pytest.mark.parametrize("ties", [False, True])
def test_edge_tree_matches_heap_oracle(ties):
    rng = np.random.default_rng(7 + ties)
    b, d_max, k = 4, 4, 3
    raw = rng.normal(size=(b, d_max, k, k)).astype(np.float32)
    if ties:
        raw = np.round(raw * 2) / 2
    elogp = np.asarray(jax.nn.log_softmax(jnp.asarray(raw), axis=-1))
    if ties:
        elogp = np.round(elogp * 4) / 4  # many equal sums
        elogp = np.minimum(elogp, 0)
    tok = np.stack([rng.permutation(50)[:k] for _ in range(b * d_max)]).reshape(b, d_max, k).astype(np.int32)
    bonus = np.arange(b, dtype=np.int32) + 60
    for budget in (1, 3, 8, 20, 130):  # the lattice has 3 + 9 + 27 + 81 = 120 nodes
        got = edge_tree(jnp.asarray(bonus), jnp.asarray(elogp), jnp.asarray(tok), budget)
        for r in range(b):
            tokens, parent, depth, valid = heap_tree(bonus[r], elogp[r], tok[r], budget)
            np.testing.assert_array_equal(np.asarray(got.valid[r]), valid)
            for name, want in (("tokens", tokens), ("parent", parent), ("depth", depth)):
                np.testing.assert_array_equal(np.asarray(getattr(got, name)[r]), want, err_msg=(name, budget))
            np.testing.assert_array_equal(np.asarray(got.mask[r]), ancestors(parent, depth, valid))


def test_edge_scores_change_the_tree():
    """The same candidates under two predecessors' rows: the tree follows the edge scores (the marginal
    tree of either row alone would not)."""
    k = 3
    elogp = np.full((1, 2, k, k), np.log(1 / 3), np.float32)
    elogp[0, 0, 0] = np.log([0.6, 0.3, 0.1])  # depth 1 from the anchor
    elogp[0, 1, 0] = np.log([0.05, 0.05, 0.9])  # after rank 0: rank 2 is the likely successor
    elogp[0, 1, 1] = np.log([0.9, 0.05, 0.05])  # after rank 1: rank 0 is
    tok = np.array([[[10, 11, 12], [20, 21, 22]]], np.int32)
    t = edge_tree(jnp.array([1]), jnp.asarray(elogp), jnp.asarray(tok), 3)
    # scores: 10 -> -0.51, 10 -> 22: -0.62, 11: -1.20, 11 -> 20: -1.31
    assert np.asarray(t.tokens[0]).tolist() == [1, 10, 22, 11]
    assert np.asarray(t.parent[0]).tolist() == [0, 0, 1, 0]


def test_walk_emits_exact_target_probabilities():
    """Every emitted sequence has exactly the target's probability: the walk over an edge tree, with
    each node's choice an independent draw from the target's conditional at that node, enumerated over
    every assignment of choices (vocabulary 3, depth 2, budget 5: 3^6 assignments)."""
    rng = np.random.default_rng(3)
    v, d_max, k, budget = 3, 2, 3, 5
    elogp = np.asarray(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(1, d_max, k, k)), jnp.float32), -1))
    tok = np.stack([rng.permutation(v) for _ in range(d_max)])[None].astype(np.int32)
    t = edge_tree(jnp.array([0]), jnp.asarray(elogp), jnp.asarray(tok), budget)
    tokens, parent = np.asarray(t.tokens[0]), np.asarray(t.parent[0])
    n = budget + 1
    table = {}  # the target's conditional p(. | prefix) for every prefix of up to 3 tokens

    def p(prefix):
        if prefix not in table:
            table[prefix] = rng.dirichlet(np.ones(v))
        return table[prefix]

    def prefix_of(i):  # the tokens after the root on node i's path
        path = []
        while i:
            path.append(int(tokens[i]))
            i = parent[i]
        return tuple(path[::-1])

    combos = np.array(list(itertools.product(range(v), repeat=n)), np.int32)  # [V^T, T]
    weight = np.prod([[p(prefix_of(i))[c[i]] for i in range(n)] for c in combos], axis=1)
    batch = len(combos)
    tb = tree.Tree(*(jnp.broadcast_to(x, (batch, *x.shape[1:])) for x in t))
    w = tree.walk(tb, jnp.asarray(combos), d_max)
    got = {}
    for row in range(batch):
        seq = tuple(np.asarray(w.emitted[row])[: int(w.length[row])].tolist())
        got[seq] = got.get(seq, 0.0) + weight[row]
    assert abs(sum(got.values()) - 1) < 1e-9
    for seq, prob in got.items():
        want = np.prod([p(seq[:j])[seq[j]] for j in range(len(seq))])
        assert abs(prob - want) < 1e-9, seq
    assert any(len(s) == 3 for s in got)  # depth-2 paths were accepted


TP = "qwen3_gqa4_tp"
DRAFT = "dflash_qwen3_gqa4_tp"  # any drafter: the oracle stage below replaces it


def oracle_edges(reference: list[list[int]], k: int = 4):
    """A draft stage proposing edge log-scores [B, D, K, K]: candidate rank 0 at every depth is the
    reference's next token and the edge from rank 0 to rank 0 is the likely one; other predecessors'
    rows are flat. (On a mesh each device reads its own rows.)"""
    width = max(len(r) for r in reference) + 16
    table = np.zeros((len(reference), width), np.int32)
    for i, r in enumerate(reference):
        table[i, : len(r)] = r

    def stage(params, draft_params, state, plan):
        b = state.bonus.shape[0]
        first = jax.lax.axis_index(DATA) * b if plan.tp * plan.dp > 1 else 0
        rows = jax.lax.dynamic_slice_in_dim(jnp.asarray(np.pad(table, ((0, b), (0, 0)))), first, b)
        d, v = plan.depth, plan.target.vocab_size
        pos = state.cache.lengths[:, None] + 1 + jnp.arange(d)[None, :]
        right = jnp.take_along_axis(rows, jnp.minimum(pos, width - 1), axis=1)
        tok = (right[:, :, None] + jnp.arange(k)[None, None, :]) % v
        raw = jnp.zeros((k, k)).at[0, 0].set(4.0).at[0, 1].set(1.0)
        elogp = jnp.broadcast_to(jax.nn.log_softmax(raw, axis=-1), (b, d, k, k))
        return elogp, tok.astype(jnp.int32)

    return stage


@pytest.mark.parametrize("sampled", [False, True])
def test_round_with_oracle_edges_accepts_long_paths(sampled):
    prompts = golden_prompts(TP)
    options = [{"temperature": 0.8, "seed": 11 + i} for i in range(5)] if sampled else None
    ar = [r.output_ids for r in run(TP, prompts, options=options)]
    if not sampled:
        assert ar == [golden(TP)[f"greedy_{i}"].tolist() for i in range(5)]
    stage = oracle_edges([p + o for p, o in zip(prompts, ar, strict=True)])
    results = run(
        TP, prompts, method="ddtree", draft_name=DRAFT, budget=9, options=options, draft_stage=stage
    )
    assert [r.output_ids for r in results] == ar
    rounds = sum(len(r.acceptance_lengths) for r in results)
    assert rounds <= 5 * 4  # 24 tokens in at most 4 rounds of up to 8 (D = 7)
