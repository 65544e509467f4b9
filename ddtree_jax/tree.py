"""The draft tree: build it from the drafter's top-k log-probs, mask it, walk it.

docs/design.md, "Building the tree without a heap" and step 4 of "One round". Everything here is
static-shape, batched over B (a leading dim on every array) and free of host syncs, so it runs
inside the jitted round.

Node order (the same strict total order everywhere, so a heap oracle reproduces it exactly):
score descending; then depth ascending; then, within a depth, by (the parent's position in the
previous depth's order, child rank c). `jax.lax.top_k` keeps equal values in index order, so
flattening candidates in that order makes every selection below follow the rule.
"""

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Scores at or below INVALID_SCORE mark padding (no such lattice node). Real scores are sums of at
# most D clamped log-probs, >= D * LOGP_MIN, far above it.
NEG_SCORE = -1e30
INVALID_SCORE = -1e29
LOGP_MIN = -1e20


class Tree(NamedTuple):
    """A draft tree per sequence; node 0 is the root (bonus token), parents precede children."""

    tokens: jax.Array  # [B, T] int32; padding nodes hold token 0
    parent: jax.Array  # [B, T] int32; root and padding nodes: 0
    depth: jax.Array  # [B, T] int32; root and padding nodes: 0
    valid: jax.Array  # [B, T] bool; root True, padding False
    mask: jax.Array  # [B, T, T] bool; mask[i, j]: j is i or an ancestor of i (padding: only i)


class Walk(NamedTuple):
    """The accepted root path of each sequence's tree."""

    path: jax.Array  # [B, D + 1] int32 node index at each depth; past length: 0 (don't care)
    length: jax.Array  # [B] int32 acceptance length a = depth[last] + 1, 1 <= a <= D + 1
    bonus: jax.Array  # [B] int32 next round's root token = choice[last]
    emitted: jax.Array  # [B, D + 1] int32 choice[path]: tokens to commit; past length: don't care


def _clean_logp(logp: jax.Array) -> jax.Array:
    """Clamp log-probs to [LOGP_MIN, 0] (no -inf, NaN, or positive rounding) and -0.0 to +0.0."""
    logp = jnp.nan_to_num(logp.astype(jnp.float32), nan=LOGP_MIN, neginf=LOGP_MIN, posinf=0.0)
    # <= 0 keeps a child's score <= its parent's, which makes the top-N ancestor-closed. One zero:
    # XLA's CPU top_k ranks +0.0 above -0.0, its GPU top-k kernel ties them.
    logp = jnp.clip(logp, LOGP_MIN, 0.0)
    return jnp.where(logp == 0.0, 0.0, logp)


def _staircase(budget: int, k: int) -> np.ndarray:
    """Flat candidate ids j * k + c (ascending) of a beam step that can reach its top-`budget`.

    With the beam and the depth's log-probs both sorted descending, the (j + 1)(c + 1) - 1
    candidates (j', c') != (j, c) with j' <= j, c' <= c score at least as high (float rounding is
    monotone) and come earlier in the flattened order, so (j, c) is in the top-`budget` only if
    (j + 1)(c + 1) <= budget: about budget * ln(budget) candidates instead of budget * k
    (266 instead of 2016 at budget 63, k 32). The first column alone holds `budget` of them.
    """
    j, c = np.meshgrid(np.arange(budget), np.arange(k), indexing="ij")
    return np.flatnonzero(((j + 1) * (c + 1) <= budget).reshape(-1)).astype(np.int32)


# Above this many candidates a selection sorts (lax.top_k) instead of ranking every pair: the pairwise
# rank reads M^2 comparisons, which stays one fused kernel on a GPU only while M is small.
RANK_MAX = 512


def _rank_onehot(values: jax.Array, n: int) -> jax.Array:
    """[M, n] bool: entry i is the r-th largest of values [M] (lax.top_k's order: descending, equal values
    in index order), by each value's rank among all pairs: a compare-and-count, no sort."""
    ids = jnp.arange(values.shape[0], dtype=jnp.int32)
    ahead = (values[None, :] > values[:, None]) | (
        (values[None, :] == values[:, None]) & (ids[None, :] < ids[:, None])
    )
    rank = jnp.sum(ahead, axis=1, dtype=jnp.int32)  # [M] a permutation of 0..M-1
    return rank[:, None] == jnp.arange(n, dtype=jnp.int32)[None, :]


def _pick(onehot: jax.Array, x: jax.Array) -> jax.Array:
    """x [M, ...] at the one-hot rows of onehot [M, n] -> [n, ...], as reductions (no gather): a sum for
    integers, a max for floats (exact, -0.0 kept)."""
    mask = onehot.reshape(onehot.shape + (1,) * (x.ndim - 1))
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.max(jnp.where(mask, x[:, None], -jnp.inf), axis=0)
    return jnp.sum(jnp.where(mask, x[:, None], 0), axis=0, dtype=x.dtype)


def _top(values: jax.Array, n: int, select: str) -> tuple[jax.Array, jax.Array]:
    """The `n` largest of values [M] and their indices [n], exactly as `jax.lax.top_k` orders them
    (descending, equal values in index order). select "rank": `_rank_onehot` and `_pick` (no sort
    kernel, reductions that XLA fuses), up to RANK_MAX values; "sort": jax.lax.top_k's sort."""
    m = values.shape[0]
    if select == "sort" or m > RANK_MAX:
        return jax.lax.top_k(values, n)
    onehot = _rank_onehot(values, n)
    return _pick(onehot, values), _pick(onehot, jnp.arange(m, dtype=jnp.int32))


def _beams(logp: jax.Array, budget: int, *, prune: bool = True, unroll: bool = False, select: str = "sort"):
    """Per-depth top-`budget` lattice nodes of one sequence, each in its depth's order.

    logp [D, k], each depth sorted descending -> score [D, N], parent beam slot [D, N], child
    rank [D, N] and rank path [D, N, D] (the child rank at depths 1..d of each beam entry, -1
    below it; N = budget). `prune` searches only the staircase candidates (`_staircase`): the
    same top-N in the same order; without it the paths stay -1 (not carried). `unroll`: the scan's
    unroll; `select` "rank" picks each step's top-N by `_top`'s pairwise rank and writes the D steps
    out as straight-line code (no scan, no loop carry, no stacked outputs to update).
    """
    d_max, k = logp.shape
    flat = _staircase(budget, k) if prune else np.arange(budget * k, dtype=np.int32)
    # beam_0 is the root alone (score 0); its expansions are depth 1.
    root_beam = jnp.full((budget,), NEG_SCORE, jnp.float32).at[0].set(0.0)
    root_paths = jnp.full((budget, d_max), -1, jnp.int32)

    def step(carry, xs):  # beam [N], paths [N, D]; logp_d [k], level d - 1
        beam, paths = carry
        logp_d, level = xs
        live = beam > INVALID_SCORE
        # Flattened as j * k + c: ties go to the earlier parent slot, then the lower rank.
        cand = jnp.where(live[:, None], beam[:, None] + logp_d[None, :], NEG_SCORE).reshape(-1)
        if select == "rank" and len(flat) <= RANK_MAX:  # the index math as one-hot reductions too
            onehot = _rank_onehot(cand[flat], budget)  # [M, N]
            score, idx = _pick(onehot, cand[flat]), _pick(onehot, jnp.asarray(flat))
        else:
            score, pick = _top(cand[flat], budget, select)  # [N]
            idx = jnp.asarray(flat)[pick]
        slot, rank = idx // k, idx % k
        if prune:  # (the "climb" build before issue 22 carried no paths)
            if select == "rank":
                above = _pick(slot[None, :] == jnp.arange(budget)[:, None], paths)  # paths[slot]
            else:
                above = paths[slot]
            paths = jnp.where(jnp.arange(d_max)[None, :] == level, rank[:, None], above)
        return (score, paths), (score, slot, rank, paths)

    levels = jnp.arange(d_max, dtype=jnp.int32)
    if select == "rank":  # a Python loop: XLA sees D straight-line steps and no scan carry to copy
        carry, outs = (root_beam, root_paths), []
        for d in range(d_max):
            carry, out = step(carry, (logp[d], d))
            outs.append(out)
        score, slot, rank, paths = (jnp.stack(x) for x in zip(*outs, strict=True))
    else:
        _, (score, slot, rank, paths) = jax.lax.scan(
            step, (root_beam, root_paths), (logp, levels), unroll=unroll
        )
    return score, slot.astype(jnp.int32), rank.astype(jnp.int32), paths


def _mask_from_paths(paths: jax.Array, valid: jax.Array) -> jax.Array:
    """Ancestor mask of one tree from its nodes' rank paths [T, D] (-1 below a node's depth).

    j is i or an ancestor of i iff j's path is a prefix of i's: every rank j has is i's rank at
    that depth. A lattice node is its rank path, so no climb over parents is needed.
    """
    t = paths.shape[0]
    prefix = jnp.all((paths[None, :, :] < 0) | (paths[None, :, :] == paths[:, None, :]), axis=-1)
    nodes = jnp.arange(t, dtype=jnp.int32)
    both = valid[:, None] & valid[None, :]
    return (prefix & both) | (nodes[:, None] == nodes[None, :])


def _ancestor_mask_one(parent: jax.Array, depth: jax.Array, valid: jax.Array, max_depth: int):
    """Ancestor mask of one tree: parent, depth, valid [T] -> [T, T] bool."""
    t = parent.shape[0]
    levels = jnp.arange(max_depth + 1, dtype=jnp.int32)

    # anc_at[i, d] = the ancestor of i at depth d (i itself at depth[i]); -1 below i.
    def climb(_, state):
        anc_at, cur = state  # [T, D + 1], [T]
        anc_at = jnp.where(levels[None, :] == depth[cur][:, None], cur[:, None], anc_at)
        return anc_at, parent[cur]

    init = (jnp.full((t, max_depth + 1), -1, jnp.int32), jnp.arange(t, dtype=jnp.int32))
    anc_at, _ = jax.lax.fori_loop(0, max_depth + 1, climb, init)
    nodes = jnp.arange(t, dtype=jnp.int32)
    mask = anc_at[:, depth] == nodes[None, :]  # [T, T]: i's ancestor at depth[j] is j
    both = valid[:, None] & valid[None, :]
    return (mask & both) | (nodes[:, None] == nodes[None, :])


@partial(jax.jit, static_argnames=("max_depth",))
def ancestor_mask(parent: jax.Array, depth: jax.Array, valid: jax.Array, max_depth: int):
    """[B, T, T] bool mask[i, j] = j is i or an ancestor of i, from parent/depth/valid [B, T]."""
    return jax.vmap(partial(_ancestor_mask_one, max_depth=max_depth))(parent, depth, valid)


def _build_one(bonus: jax.Array, logp: jax.Array, tok: jax.Array, budget: int, variant: str):
    """One sequence: bonus [], logp/tok [D, k] -> tokens, parent, depth, valid [T], mask [T, T]."""
    d_max = logp.shape[0]
    logp = _clean_logp(logp)
    select = "rank" if variant == "ranked" else "sort"
    if variant != "climb":
        # Sort each depth (descending; equal values keep their rank order, as the flattened
        # tie rule needs) so that the staircase holds; the engine's input is sorted already.
        logp, order = jax.vmap(partial(_top, n=logp.shape[1], select=select))(logp)
        tok = jnp.take_along_axis(tok, order, axis=1)
    score, slot, rank, paths = _beams(
        logp, budget, prune=variant != "climb", unroll=variant == "paths-unrolled", select=select
    )  # [D, N] each; paths [D, N, D]
    # Global top-N flattened as d * N + j: ties go to the shallower depth, then the beam order.
    # A parent strictly precedes its child in this order, so parents get smaller node indices.
    top_score, flat = _top(score.reshape(-1), budget, select)  # [N]
    d0, j = flat // budget, flat % budget  # beam depth index (node depth - 1), slot
    valid = top_score > INVALID_SCORE
    parent_key = (d0 - 1) * budget + slot[d0, j]  # the parent's beam entry, flattened as `flat` is
    if variant == "ranked":  # the parent's node: where its entry sits in the selection (no scatter)
        parent = 1 + jnp.argmax(flat[None, :] == parent_key[:, None], axis=1).astype(jnp.int32)
    else:
        node_of = (
            jnp.zeros((d_max, budget), jnp.int32).at[d0, j].set(jnp.arange(1, budget + 1, dtype=jnp.int32))
        )  # [D, N] node index of each selected beam entry
        parent = node_of[jnp.maximum(d0 - 1, 0), slot[d0, j]]
    parent = jnp.where(d0 == 0, 0, parent)
    token = tok[d0, rank[d0, j]]
    zero = jnp.zeros((1,), jnp.int32)  # the root's parent and depth
    tokens = jnp.concatenate([bonus[None], jnp.where(valid, token, 0)]).astype(jnp.int32)
    parent = jnp.concatenate([zero, jnp.where(valid, parent, 0).astype(jnp.int32)])
    depth = jnp.concatenate([zero, jnp.where(valid, d0 + 1, 0).astype(jnp.int32)])
    valid = jnp.concatenate([jnp.ones((1,), bool), valid])
    if variant == "climb":
        mask = _ancestor_mask_one(parent, depth, valid, d_max)
    else:
        node_paths = jnp.concatenate([jnp.full((1, d_max), -1, jnp.int32), paths[d0, j]])  # [T, D]
        mask = _mask_from_paths(node_paths, valid)
    return tokens, parent, depth, valid, mask


BUILD_VARIANTS = ("paths", "paths-unrolled", "ranked", "climb")
# The build the engine runs (`lattice_tree` with no variant), per backend: on a GPU the unrolled beams,
# 26-39% faster than the scan alone at the bundled pair's build shape on one H200 and 25% at Qwen3-8B's
# budget 63 (results/h200/2026-12-03/round-profile/README.md, "Build variants alone"; results/notes.md),
# for 1.6-3.1 s more compile per shape; elsewhere (CPU: the test suite's compile time) the scan.
DEFAULT_BUILD = {"gpu": "paths-unrolled", "cuda": "paths-unrolled", "rocm": "paths-unrolled"}
_default_override: str | None = None


def set_default_build(variant: str | None) -> None:
    """Make `variant` the build of every `lattice_tree` call that names none and is traced after this
    (None: back to `DEFAULT_BUILD`'s choice per backend); for benchmarks comparing builds in a round."""
    global _default_override
    if variant is not None and variant not in BUILD_VARIANTS:
        raise ValueError(f"variant must be one of {BUILD_VARIANTS}, got {variant!r}")
    _default_override = variant


def default_build() -> str:
    """The build variant `lattice_tree` runs when given none: `set_default_build`'s, else the backend's."""
    return _default_override or DEFAULT_BUILD.get(jax.default_backend(), "paths")


def lattice_tree(
    bonus: jax.Array, logp: jax.Array, tok: jax.Array, budget: int, variant: str | None = None
) -> Tree:
    """Tree of the `budget` best lattice nodes under the root `bonus`; T = budget + 1.

    bonus [B] int32; logp [B, D, k] float32 per-depth top-k log-probs (sorted descending);
    tok [B, D, k] int32 their tokens (distinct within a depth). Padding when the lattice has
    fewer than `budget` nodes. `variant` (the same tree from each; None: `default_build()`):
    "paths" beam steps over the staircase candidates, carrying each entry's rank path, which gives
    the ancestor mask with no loop; "paths-unrolled" the same with the D beam steps unrolled;
    "ranked" the same as straight-line code with every selection a pairwise rank (no sort kernel
    up to `RANK_MAX` candidates) and the parents found without a scatter; "climb" every N x k
    candidate and the mask by a loop of D + 1 climbs over parents (the build before issue 22,
    kept to measure against and as a cross-check). Input sorted as stated, every variant gives the
    same tree, ties included; the pruned variants sort unsorted input first, which keeps the top-N
    but may order two nodes differently where their sums tie only by float rounding.
    """
    variant = default_build() if variant is None else variant
    if variant not in BUILD_VARIANTS:
        raise ValueError(f"variant must be one of {BUILD_VARIANTS}, got {variant!r}")
    return _lattice_tree(bonus, logp, tok, budget, variant)


@partial(jax.jit, static_argnames=("budget", "variant"))
def _lattice_tree(bonus: jax.Array, logp: jax.Array, tok: jax.Array, budget: int, variant: str) -> Tree:
    """`lattice_tree` with its variant resolved (jitted per budget and variant)."""
    tokens, parent, depth, valid, mask = jax.vmap(partial(_build_one, budget=budget, variant=variant))(
        bonus, logp, tok
    )
    return Tree(tokens, parent, depth, valid, mask)


def _lower_lattice_tree(bonus, logp, tok, budget: int, variant: str | None = None):
    """`lattice_tree.lower`: the jitted build lowered for these inputs (scripts/bench_tree.py compiles it)."""
    return _lattice_tree.lower(bonus, logp, tok, budget=budget, variant=variant or default_build())


lattice_tree.lower = _lower_lattice_tree


@jax.jit
def chain_tree(bonus: jax.Array, tok: jax.Array) -> Tree:
    """The DFlash chain: bonus [B], tok [B, D, k] -> depth d keeps tok[:, d-1, 0]; T = D + 1."""
    b, d_max = tok.shape[:2]
    t = d_max + 1
    tokens = jnp.concatenate([bonus[:, None], tok[:, :, 0]], axis=1).astype(jnp.int32)  # [B, T]
    depth = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    parent = jnp.maximum(depth - 1, 0)
    valid = jnp.ones((b, t), bool)
    causal = jnp.tril(jnp.ones((t, t), bool))
    return Tree(tokens, parent, depth, valid, jnp.broadcast_to(causal, (b, t, t)))


def _walk_one(tree: Tree, choice: jax.Array, max_depth: int):
    """One sequence: tree fields [T] or [T, T], choice [T] -> path [D + 1], a, bonus, emitted."""
    t = tree.tokens.shape[0]
    nodes = jnp.arange(t, dtype=jnp.int32)
    ok = tree.valid & (tree.tokens == choice[tree.parent])
    ok = ok.at[0].set(True)
    accepted = ~jnp.any(tree.mask & ~ok[None, :], axis=1)  # [T]: whole ancestor row ok
    # Deepest accepted node (lowest index among equals, so duplicate sibling tokens still give
    # one consistent root path); the root is always accepted.
    key = jnp.where(accepted, tree.depth * t + (t - 1 - nodes), -1)
    last = jnp.argmax(key).astype(jnp.int32)
    on_path = tree.mask[last]  # [T]: last and its ancestors
    levels = jnp.arange(max_depth + 1, dtype=jnp.int32)
    at_level = on_path[:, None] & (tree.depth[:, None] == levels[None, :])  # [T, D + 1]
    path = jnp.argmax(at_level, axis=0).astype(jnp.int32)  # 0 past the path's end
    return path, tree.depth[last] + 1, choice[last], choice[path]


@partial(jax.jit, static_argnames=("max_depth",))
def walk(tree: Tree, choice: jax.Array, max_depth: int) -> Walk:
    """Accepted path where each node's token equals `choice` [B, T] at its parent; D = max_depth."""
    path, length, bonus, emitted = jax.vmap(partial(_walk_one, max_depth=max_depth))(
        tree, choice.astype(jnp.int32)
    )
    return Walk(path, length.astype(jnp.int32), bonus.astype(jnp.int32), emitted)


@jax.jit
def target_ranks(tok: jax.Array, emitted: jax.Array, length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """What a round tells about the drafter's acceptance (plan_choice.AcceptanceCounts.observe): the rank
    of the target's token at each depth among the drafter's top-k there, and how many depths were seen.

    tok [B, D, k] the drafter's candidates per depth; emitted [B, D + 1] the walk's committed tokens (the
    target's token at depths 1 .. a: the accepted ones, then the bonus); length [B] the acceptance length
    a -> ranks [B, D] int32 (k where the token is not among the candidates; past the seen depths: don't
    care) and seen [B] int32 = min(a, D), the depths whose target token is known.
    """
    d_max, k = tok.shape[1], tok.shape[2]
    match = tok == emitted[:, :d_max, None]  # [B, D, k]; candidates within a depth are distinct
    ranks = jnp.where(jnp.any(match, axis=-1), jnp.argmax(match, axis=-1), k).astype(jnp.int32)
    return ranks, jnp.minimum(length, d_max).astype(jnp.int32)


@partial(jax.jit, static_argnames=("width", "max_width"))
def rank_counts(
    ranks: jax.Array, seen: jax.Array, active: jax.Array, width: int, max_width: int = 32
) -> tuple[jax.Array, jax.Array]:
    """`target_ranks`' output summed over the active rows, for a loop that keeps the counts on the device:
    ranks [B, D], seen [B], active [B] bool -> hits [D, max_width] (how often the target's token at depth
    d + 1 was rank c) and exposure [D, max_width] (how often rank c could be seen there: a plan of
    branching `width` sees ranks < width), int32, to add to plan_choice.AcceptanceCounts."""
    d_max = ranks.shape[1]
    valid = (jnp.arange(d_max)[None, :] < seen[:, None]) & active[:, None]  # [B, D]
    c = jnp.arange(max_width, dtype=jnp.int32)
    hit = valid[:, :, None] & (ranks[:, :, None] == c) & (c < width)  # [B, D, max_width]
    exposure = jnp.sum(valid, axis=0, dtype=jnp.int32)[:, None] * (c < width)[None, :]
    return jnp.sum(hit, axis=0, dtype=jnp.int32), exposure.astype(jnp.int32)
