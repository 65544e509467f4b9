"""Tree build, ancestor mask and walk against plain-Python references (heap oracle, brute force)."""

import itertools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax.compare import oracles
from ddtree_jax.tree import BUILD_VARIANTS, LOGP_MIN, Tree, ancestor_mask, chain_tree, lattice_tree, walk

# (D, k, budget): few shapes, since each one compiles. Covers budget > lattice size (1,4,10),
# (3,2,20), (6,1,8), (7,2,255); budget < k (2,8,1), (3,8,4); deep and wide (15,8,64), (15,4,256).
CONFIGS = [
    (1, 4, 10),
    (3, 2, 20),
    (2, 8, 1),
    (3, 8, 4),
    (4, 3, 16),
    (6, 1, 8),
    (5, 5, 40),
    (7, 2, 255),
    (15, 8, 64),
    (15, 4, 256),
]
MODES = ["float", "ties", "zeros", "signed_zeros", "huge"]
BATCH = 2
HYP = settings(max_examples=30, deadline=None, database=None)


# ---------------------------------------------------------------- references


def clean(logp):
    """The documented input clamp: [LOGP_MIN, 0], NaN/-inf to LOGP_MIN, float32."""
    logp = np.nan_to_num(np.asarray(logp, np.float32), nan=LOGP_MIN, neginf=LOGP_MIN, posinf=0.0)
    return np.clip(logp, np.float32(LOGP_MIN), np.float32(0.0)).astype(np.float32)


def heap_oracle(logp, budget):
    """DDTree best-first (compare/oracles.py's heap tree) over the clamped input -> rank paths in pop
    order."""
    logp = clean(logp)
    d_max, k = logp.shape
    tree = oracles.heap_tree(0, logp, np.tile(np.arange(k), (d_max, 1)), budget)
    paths = [()]
    for node in range(1, len(tree.tokens)):
        paths.append((*paths[tree.parent[node]], tree.tokens[node]))
    return paths[1:]


def brute_oracle(logp, budget):
    """Enumerate the whole lattice, sort each depth then everything by the spec's order."""
    logp = clean(logp)
    d_max, k = logp.shape
    level = [((), np.float32(0.0))]
    everything = []
    for d in range(1, d_max + 1):
        cands = [
            (-float(s), ppos, c, (*ppath, c), s)
            for ppos, (ppath, ps) in enumerate(level)
            for c in range(k)
            for s in [np.float32(ps + logp[d - 1, c])]
        ]
        cands.sort(key=lambda x: x[:3])
        level = [(x[3], x[4]) for x in cands]
        everything += [(-float(s), d, pos, path) for pos, (path, s) in enumerate(level)]
    everything.sort(key=lambda x: x[:3])
    return [x[3] for x in everything[:budget]]


def expected_tree(paths, bonus, tok, budget):
    """Tree fields (numpy, one sequence) for an ordered list of rank paths."""
    t = budget + 1
    tokens, parent, depth = np.zeros(t, np.int32), np.zeros(t, np.int32), np.zeros(t, np.int32)
    valid = np.zeros(t, bool)
    tokens[0], valid[0] = bonus, True
    index = {(): 0}
    for i, p in enumerate(paths, 1):
        index[p] = i
        tokens[i] = tok[len(p) - 1, p[-1]]
        parent[i] = index[p[:-1]]  # KeyError if a parent does not come first
        depth[i] = len(p)
        valid[i] = True
    full = [(), *paths] + [None] * (budget - len(paths))
    mask = np.eye(t, dtype=bool)
    for i, j in itertools.product(range(len(paths) + 1), repeat=2):
        mask[i, j] = full[i][: len(full[j])] == full[j]
    return tokens, parent, depth, valid, mask


def ref_walk(tokens, parent, valid, choice):
    """Walk from the root: step to the (first) valid child whose token is choice[current]."""
    path = [0]
    while True:
        cur = path[-1]
        kids = [i for i in range(1, len(tokens)) if valid[i] and parent[i] == cur]
        nxt = [i for i in kids if tokens[i] == choice[cur]]
        if not nxt:
            break
        path.append(nxt[0])
    return path, len(path), choice[path[-1]], [choice[p] for p in path]


def ref_mask(parent, valid):
    """Ancestor mask by following parents to the root, one row at a time."""
    t = len(parent)
    mask = np.eye(t, dtype=bool)
    for i in range(1, t):
        if valid[i]:
            j = i
            while j != 0:
                j = parent[j]
                mask[i, j] = True
    return mask


# ---------------------------------------------------------------- inputs


def make_logp(rng, shape, mode, sort=True):
    """Log-prob tables that stress ties, exact zeros (both signs) and clamping."""
    if mode == "float":
        x = -rng.exponential(2.0, shape)
    elif mode == "ties":
        x = -rng.choice([0.0, 0.5, 1.0, 1.5], shape)
    elif mode == "zeros":
        x = np.zeros(shape)
    elif mode == "signed_zeros":
        x = rng.choice([0.0, -0.0, -1.0, 1e-7], shape)  # + rounding noise above zero
    else:  # huge: -inf, NaN and giant negatives collapse onto the clamp value
        x = rng.choice([0.0, -1.0, -np.inf, np.nan, -1e30, -3e20], shape)
    x = x.astype(np.float32)
    if sort:
        x = np.where(np.isnan(x), -np.inf, x)  # a NaN would break np.sort's order
        x = -np.sort(-x, axis=-1)
    return x


def make_tok(rng, b, d, k, vocab):
    """Per-depth distinct tokens, from a small vocabulary so that walks often match."""
    return np.stack(
        [np.stack([rng.choice(vocab, k, replace=False) for _ in range(d)]) for _ in range(b)]
    ).astype(np.int32)


def random_case(seed, cfg, mode, sort=True, b=BATCH):
    d, k, n = cfg
    rng = np.random.default_rng(seed)
    logp = make_logp(rng, (b, d, k), mode, sort)
    tok = make_tok(rng, b, d, k, vocab=max(2 * k, 4))
    bonus = rng.integers(0, 50, b).astype(np.int32)
    return rng, bonus, logp, tok


def row(tree, b):
    return [np.asarray(x)[b] for x in tree]


# ---------------------------------------------------------------- tests: top_k and oracles


@pytest.mark.parametrize("n,k", [(8192, 512), (7680, 511), (64, 16), (100, 7), (12, 12)])
def test_top_k_keeps_lower_index_first_on_ties(n, k):
    rng = np.random.default_rng(n + k)
    x = rng.choice([0.0, -1.0, -2.0, -1e30], (3, n)).astype(np.float32)
    vals, idx = jax.jit(jax.lax.top_k, static_argnums=1)(x, k)
    want = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.asarray(idx), want)
    np.testing.assert_array_equal(np.asarray(vals), np.take_along_axis(x, want, -1))


@given(seed=st.integers(0, 2**32 - 1), cfg=st.sampled_from(CONFIGS[:8]), mode=st.sampled_from(MODES))
@settings(max_examples=40, deadline=None, database=None)
def test_heap_oracle_matches_brute_force(seed, cfg, mode):
    d, k, n = cfg
    logp = make_logp(np.random.default_rng(seed), (d, k), mode, sort=seed % 2 == 0)
    assert heap_oracle(logp, n) == brute_oracle(logp, n)


# ---------------------------------------------------------------- tests: lattice_tree


def check_against_oracle(bonus, logp, tok, n, variant="paths"):
    tree = lattice_tree(bonus, logp, tok, n, variant=variant)
    t = n + 1
    assert all(x.shape[:2] == (len(bonus), t) for x in tree)
    assert tree.mask.shape == (len(bonus), t, t)
    assert tree.tokens.dtype == tree.parent.dtype == tree.depth.dtype == np.int32
    for b in range(len(bonus)):
        tokens, parent, depth, valid, mask = row(tree, b)
        want = expected_tree(heap_oracle(logp[b], n), bonus[b], tok[b], n)
        for name, got, exp in zip(Tree._fields, (tokens, parent, depth, valid, mask), want, strict=True):
            np.testing.assert_array_equal(got, exp, err_msg=f"row {b} field {name}")
        inner = np.flatnonzero(valid)[1:]
        assert np.all(parent[inner] < inner)  # every parent precedes its child
        np.testing.assert_array_equal(mask, ref_mask(parent, valid))


@given(
    seed=st.integers(0, 2**32 - 1),
    cfg=st.sampled_from(CONFIGS),
    mode=st.sampled_from(MODES),
    sort=st.booleans(),
)
@HYP
def test_lattice_tree_matches_heap_oracle(seed, cfg, mode, sort):
    """Sorted input (lattice_tree's contract, what the engine passes): every variant equals the oracle.
    Unsorted input: the "climb" build still does; the pruned builds sort each depth first, which
    keeps the top-N but not the oracle's column order where two sums tie only by float rounding
    (e.g. -1e20 + 0 and -1e20 - 1)."""
    _, bonus, logp, tok = random_case(seed, cfg, mode, sort)
    variant = BUILD_VARIANTS[seed % len(BUILD_VARIANTS)] if sort else "climb"
    check_against_oracle(bonus, logp, tok, cfg[2], variant)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("mode", ["ties", "zeros"])
@pytest.mark.parametrize("variant", ["paths", "ranked", "climb"])  # "paths-unrolled": the test above
def test_lattice_tree_ties_every_shape(cfg, mode, variant):
    _, bonus, logp, tok = random_case(7, cfg, mode)
    check_against_oracle(bonus, logp, tok, cfg[2], variant)


def test_all_zero_scores_give_breadth_first_order():
    d, k, n = 3, 2, 20  # 14 lattice nodes, all of score 0: depth by depth, parent then rank
    logp = np.zeros((1, d, k), np.float32)
    tok = np.tile(np.array([5, 6], np.int32), (1, d, 1))
    tree = lattice_tree(np.array([9], np.int32), logp, tok, n)
    np.testing.assert_array_equal(tree.depth[0], [0, 1, 1, 2, 2, 2, 2] + [3] * 8 + [0] * 6)
    np.testing.assert_array_equal(tree.parent[0, :15], [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6])
    np.testing.assert_array_equal(tree.valid[0], [True] * 15 + [False] * 6)
    np.testing.assert_array_equal(tree.tokens[0, :7], [9, 5, 6, 5, 6, 5, 6])


def test_padding_nodes_when_budget_exceeds_lattice():
    logp = np.log(np.array([[[0.5, 0.3, 0.15, 0.05]]], np.float32))  # D = 1, k = 4
    tok = np.array([[[11, 12, 13, 14]]], np.int32)
    tree = lattice_tree(np.array([3], np.int32), logp, tok, 10)
    np.testing.assert_array_equal(tree.tokens[0], [3, 11, 12, 13, 14] + [0] * 6)
    np.testing.assert_array_equal(tree.valid[0], [True] * 5 + [False] * 6)
    np.testing.assert_array_equal(tree.depth[0], [0, 1, 1, 1, 1] + [0] * 6)
    np.testing.assert_array_equal(tree.parent[0], [0] * 11)
    mask = np.asarray(tree.mask[0])
    np.testing.assert_array_equal(mask[5:], np.eye(11, dtype=bool)[5:])  # padding: only itself
    assert not mask[:5, 5:].any()  # nobody valid attends to padding


def test_lattice_tree_batch_rows_are_independent():
    cfg = (4, 3, 16)
    _, bonus, logp, tok = random_case(3, cfg, "ties", b=4)
    logp[1] = 0.0
    logp[2, :, 1:] = -1e30  # row 2: a chain after clamping ties
    batched = lattice_tree(bonus, logp, tok, cfg[2])
    for b in range(4):
        single = lattice_tree(bonus[b : b + 1], logp[b : b + 1], tok[b : b + 1], cfg[2])
        for got, want in zip(row(batched, b), row(single, 0), strict=True):
            np.testing.assert_array_equal(got, want)


def test_lattice_tree_largest_shape_compiles():
    d, k, n, b = 15, 16, 511, 32
    _, bonus, logp, tok = random_case(0, (d, k, n), "float", b=b)
    tree = lattice_tree(bonus, logp, tok, n)
    assert tree.mask.shape == (b, n + 1, n + 1)
    for r in (0, b - 1):
        want = expected_tree(heap_oracle(logp[r], n), bonus[r], tok[r], n)
        np.testing.assert_array_equal(np.asarray(tree.parent[r]), want[1])
        np.testing.assert_array_equal(np.asarray(tree.mask[r]), want[4])


# ---------------------------------------------------------------- tests: chain_tree, mask


def test_chain_tree_is_the_causal_chain():
    rng = np.random.default_rng(0)
    b, d, k = 3, 5, 4
    tok = make_tok(rng, b, d, k, vocab=20)
    bonus = np.array([1, 2, 3], np.int32)
    tree = chain_tree(bonus, tok)
    np.testing.assert_array_equal(tree.tokens, np.concatenate([bonus[:, None], tok[:, :, 0]], 1))
    np.testing.assert_array_equal(tree.parent, np.tile([0, 0, 1, 2, 3, 4], (b, 1)))
    np.testing.assert_array_equal(tree.depth, np.tile(np.arange(d + 1), (b, 1)))
    assert np.asarray(tree.valid).all()
    np.testing.assert_array_equal(tree.mask, np.broadcast_to(np.tri(d + 1, dtype=bool), (b, 6, 6)))


def test_ancestor_mask_on_hand_built_tree():
    #      0
    #    1   2
    #   3 4   5
    #   6
    parent = np.array([[0, 0, 0, 1, 1, 2, 3, 0]], np.int32)
    depth = np.array([[0, 1, 1, 2, 2, 2, 3, 0]], np.int32)
    valid = np.array([[True] * 7 + [False]])
    got = np.asarray(ancestor_mask(parent, depth, valid, max_depth=3))[0]
    np.testing.assert_array_equal(got, ref_mask(parent[0], valid[0]))
    np.testing.assert_array_equal(np.flatnonzero(got[6]), [0, 1, 3, 6])


# ---------------------------------------------------------------- tests: walk


def check_walk(tree, choice, d):
    out = walk(tree, choice, d)
    assert out.path.shape == out.emitted.shape == (choice.shape[0], d + 1)
    for b in range(choice.shape[0]):
        tokens, parent, _, valid, _ = row(tree, b)
        path, a, bonus, emitted = ref_walk(tokens, parent, valid, choice[b])
        assert int(out.length[b]) == a
        np.testing.assert_array_equal(np.asarray(out.path[b, :a]), path)
        assert int(out.bonus[b]) == bonus
        np.testing.assert_array_equal(np.asarray(out.emitted[b, :a]), emitted)
    return out


def steer(rng, tree, b, target, vocab):
    """A choice row that accepts the root path to `target`, with noise elsewhere."""
    tokens, parent, _, _, _ = row(tree, b)
    choice = rng.integers(0, vocab, len(tokens)).astype(np.int32)
    node = target
    while node != 0:
        choice[parent[node]] = tokens[node]
        node = parent[node]
    return choice


@given(
    seed=st.integers(0, 2**32 - 1),
    cfg=st.sampled_from(CONFIGS),
    mode=st.sampled_from(["float", "ties"]),
    steered=st.booleans(),
)
@HYP
def test_walk_matches_reference(seed, cfg, mode, steered):
    d, k, n = cfg
    rng, bonus, logp, tok = random_case(seed, cfg, mode)
    tree = lattice_tree(bonus, logp, tok, n)
    vocab = max(2 * k, 4)
    choice = rng.integers(0, vocab, (BATCH, n + 1)).astype(np.int32)
    targets = np.zeros(BATCH, np.int64)
    if steered:
        for b in range(BATCH):
            targets[b] = rng.choice(np.flatnonzero(np.asarray(tree.valid[b])))
            choice[b] = steer(rng, tree, b, targets[b], vocab)
    out = check_walk(tree, choice, d)
    reached = np.asarray(tree.depth)[np.arange(BATCH), targets] + 1
    assert (np.asarray(out.length) >= reached).all()


def test_walk_full_depth_on_chain():
    tok = np.array([[[4, 0], [5, 0], [6, 0]]], np.int32)
    tree = chain_tree(np.array([3], np.int32), tok)
    out = check_walk(tree, np.array([[4, 5, 6, 42]], np.int32), 3)
    assert int(out.length[0]) == 4 and int(out.bonus[0]) == 42
    np.testing.assert_array_equal(out.path[0], [0, 1, 2, 3])
    np.testing.assert_array_equal(out.emitted[0], [4, 5, 6, 42])


def test_walk_root_only():
    tok = np.array([[[4, 0], [5, 0], [6, 0]]], np.int32)
    tree = chain_tree(np.array([3], np.int32), tok)
    out = check_walk(tree, np.array([[9, 5, 6, 7]], np.int32), 3)
    assert int(out.length[0]) == 1 and int(out.bonus[0]) == 9
    assert int(out.path[0, 0]) == 0 and int(out.emitted[0, 0]) == 9


def hand_tree():
    #        0 (tok 1)
    #    1 (10)     2 (20)
    #  3 (11) 4 (12)   5 (21)
    #  6 (13)                    7: padding (tok 0, parent 0)
    tokens = np.array([[1, 10, 20, 11, 12, 21, 13, 0]], np.int32)
    parent = np.array([[0, 0, 0, 1, 1, 2, 3, 0]], np.int32)
    depth = np.array([[0, 1, 1, 2, 2, 2, 3, 0]], np.int32)
    valid = np.array([[True] * 7 + [False]])
    return Tree(tokens, parent, depth, valid, ancestor_mask(parent, depth, valid, max_depth=3))


def test_walk_branch_in_the_middle():
    tree = hand_tree()
    # root -> 1 (10) -> 4 (12), then choice at 4 is new bonus 77; node 3/6 rejected.
    choice = np.array([[10, 12, 0, 13, 77, 0, 0, 0]], np.int32)
    out = check_walk(tree, choice, 3)
    assert int(out.length[0]) == 3 and int(out.bonus[0]) == 77
    np.testing.assert_array_equal(out.path[0, :3], [0, 1, 4])
    np.testing.assert_array_equal(out.emitted[0, :3], [10, 12, 77])


def test_walk_never_accepts_padding():
    tree = hand_tree()
    choice = np.array([[0, 0, 0, 0, 0, 0, 0, 0]], np.int32)  # padding node 7 has token 0
    out = check_walk(tree, choice, 3)
    assert int(out.length[0]) == 1 and int(out.path[0, 0]) == 0
    # The same through lattice_tree's padding (D = 1, k = 2, budget 5: nodes 3..5 are padding).
    logp = np.array([[[-0.1, -2.0]]], np.float32)
    tok = np.array([[[10, 11]]], np.int32)
    built = lattice_tree(np.array([1], np.int32), logp, tok, 5)
    assert not np.asarray(built.valid[0, 3:]).any() and (np.asarray(built.tokens[0, 3:]) == 0).all()
    out = check_walk(built, np.zeros((1, 6), np.int32), 1)
    assert int(out.length[0]) == 1
    # Padding that looks like a real child of an accepted node (depth 3 under node 3, token 99).
    t = hand_tree()
    tokens, parent, depth = (np.array(x).copy() for x in (t.tokens, t.parent, t.depth))
    tokens[0, 7], parent[0, 7], depth[0, 7] = 99, 3, 3
    fake = Tree(tokens, parent, depth, t.valid, ancestor_mask(parent, depth, t.valid, max_depth=3))
    out = check_walk(fake, np.array([[10, 11, 0, 99, 0, 0, 0, 0]], np.int32), 3)
    assert int(out.length[0]) == 3 and int(out.bonus[0]) == 99
    np.testing.assert_array_equal(out.path[0, :3], [0, 1, 3])


def test_walk_batch_rows_are_independent():
    cfg = (4, 3, 16)
    rng, bonus, logp, tok = random_case(11, cfg, "float", b=4)
    tree = lattice_tree(bonus, logp, tok, cfg[2])
    choice = np.stack([steer(rng, tree, b, min(3 * b + 2, 16), 6) for b in range(4)])
    batched = walk(tree, choice, cfg[0])
    for b in range(4):
        single_tree = Tree(*(x[b : b + 1] for x in tree))
        single = walk(single_tree, choice[b : b + 1], cfg[0])
        for got, want in zip(batched, single, strict=True):
            np.testing.assert_array_equal(np.asarray(got)[b], np.asarray(want)[0])
    assert len(set(np.asarray(batched.length).tolist())) > 1  # rows really differ


def test_root_only_tree_is_autoregressive_decoding():
    # D = 0 (the engine's "ar" mode): T = 1, the walk emits the target's choice at the root.
    tree = chain_tree(np.array([5, 6], np.int32), np.zeros((2, 0, 1), np.int32))
    assert tree.mask.shape == (2, 1, 1) and np.asarray(tree.mask).all()
    out = check_walk(tree, np.array([[7], [8]], np.int32), 0)
    np.testing.assert_array_equal(out.length, [1, 1])
    np.testing.assert_array_equal(out.emitted, [[7], [8]])


def test_heap_tree_equals_engine_tree_with_ties():
    """The best-first heap and the engine's beams pick the same nodes in the same order, ties included."""
    rng = np.random.default_rng(0)
    shapes = [(3, 3, 1), (3, 3, 6), (3, 3, 20), (3, 3, 40), (2, 4, 9)]  # (D, k, budget); 40: padding
    for trial, (d, k, budget) in enumerate(shapes * 6):
        logp = -np.sort(rng.choice([0.0, 0.5, 1.0, 1.5], size=(d, k)), axis=1).astype(np.float32)
        tok = np.stack([rng.permutation(50)[:k] for _ in range(d)]).astype(np.int32)
        heap = oracles.heap_tree(7, logp, tok, budget)
        ours = lattice_tree(np.array([7]), logp[None], tok[None], budget)
        valid = np.asarray(ours.valid[0])
        assert heap.tokens == np.asarray(ours.tokens[0])[valid].tolist(), trial
        assert heap.depth == np.asarray(ours.depth[0])[valid].tolist(), trial
        assert heap.parent[1:] == np.asarray(ours.parent[0])[valid][1:].tolist(), trial
        mask = np.asarray(ours.mask[0])[np.ix_(valid, valid)]
        np.testing.assert_array_equal(oracles.ancestor_mask(heap.parent), mask)


def test_reference_walk_follows_the_targets_choices():
    t = oracles.DraftTree([5, 1, 2, 3, 4], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2])
    assert oracles.walk(t, [2, 9, 4, 9, 8]) == [0, 2, 4]
    assert oracles.walk(t, [6, 9, 9, 9, 9]) == [0]


# ---------------------------------------------------------------- tests: build variants, the engine's default


@pytest.mark.parametrize("mode", ["float", "ties", "huge", "signed_zeros"])
def test_pairwise_rank_selection_equals_top_k(mode):
    """`_top`'s rank selection returns lax.top_k's values and indices, equal values in index order."""
    from ddtree_jax.tree import _clean_logp, _top

    rng = np.random.default_rng(3)
    for m, n in [(1, 1), (16, 7), (40, 40), (200, 15)]:
        values = _clean_logp(make_logp(rng, (m,), mode, sort=False))
        want = jax.lax.top_k(values, n)
        got = _top(values, n, "rank")
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("d,k,n", [(15, 7, 7), (15, 15, 15), (15, 32, 63)])
def test_every_variant_builds_the_same_tree_at_engine_shapes(d, k, n):
    """The engine's build shapes (depth 15, branching min(budget, 32)): every variant equals the heap
    oracle on each row, so switching the default changes no token."""
    _, bonus, logp, tok = random_case(11, (d, k, n), "float", sort=True, b=3)
    for variant in BUILD_VARIANTS:
        check_against_oracle(bonus, logp, tok, n, variant)


def test_default_build_per_backend_and_override():
    """No variant: the backend's default (the scan on CPU, unrolled on GPU); set_default_build overrides."""
    from ddtree_jax import tree as tree_mod

    assert tree_mod.default_build() == ("paths-unrolled" if jax.default_backend() == "gpu" else "paths")
    try:
        tree_mod.set_default_build("ranked")
        assert tree_mod.default_build() == "ranked"
        with pytest.raises(ValueError):
            tree_mod.set_default_build("heap")
    finally:
        tree_mod.set_default_build(None)
    assert tree_mod.default_build() != "ranked"


def test_target_ranks_read_the_walk():
    """The ranks of the committed tokens among each depth's candidates (k: none), seen up to min(a, D);
    through a real walk: an accepted node's rank is its own, the bonus's is looked up at the next depth."""
    from ddtree_jax.tree import target_ranks

    d = 3
    logp = np.log(np.array([[[0.5, 0.3, 0.1]] * d], np.float32))
    tok = np.array([[[10, 11, 12], [20, 21, 22], [30, 31, 32]]], np.int32)
    tree = lattice_tree(np.array([1], np.int32), logp, tok, 6)
    # the target: depth 1 token 11 (rank 1), depth 2 token 20 (rank 0), depth 3 token 99 (none)
    by_depth = {0: 11, 1: 20, 2: 99, 3: 0}
    choice = np.array([[by_depth[int(x)] for x in np.asarray(tree.depth[0])]], np.int32)
    out = walk(tree, choice, d)
    ranks, seen = target_ranks(tok, out.emitted, out.length)
    # the tree holds (rank 1) and (rank 1, rank 0) (path scores 0.3, 0.15 of the top 6), not 99 at depth 3
    assert int(out.length[0]) == 3 and list(np.asarray(out.emitted[0, :3])) == [11, 20, 99]
    assert list(np.asarray(ranks[0])) == [1, 0, 3] and int(seen[0]) == 3


def test_rank_counts_on_device_equal_the_host_counts():
    """tree.rank_counts (the device-side sum) adds what plan_choice.AcceptanceCounts.observe adds."""
    from ddtree_jax import plan_choice
    from ddtree_jax.tree import rank_counts

    rng = np.random.default_rng(9)
    ranks = rng.integers(0, 9, (6, 5)).astype(np.int32)  # width 7: ranks 7, 8 are "not among them"
    seen = rng.integers(0, 6, 6).astype(np.int32)
    active = np.array([True, True, False, True, True, True])
    hits, exposure = rank_counts(ranks, seen, active, width=7, max_width=8)
    host = plan_choice.AcceptanceCounts.empty(depth=5, width=8)
    host.observe(ranks[active], seen[active], width=7)
    np.testing.assert_array_equal(np.asarray(hits), host.hits)
    np.testing.assert_array_equal(np.asarray(exposure), host.seen)
