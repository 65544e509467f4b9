"""The draft tree over a DFlash2 drafter's edge scores: DDTree's best-first tree where a node's score is
the sum of the selector's edge log-scores along its path, not of independent per-depth marginals.

A node at depth d is a rank path (c_1, ..., c_d) into the per-depth candidates tok[d - 1, :]; its score
is sum_d elogp[d - 1, c_{d-1}, c_d] (c_0 = 0: every depth-1 row is the anchor's), where elogp[d, p, :]
is the selector's edge scores from predecessor p normalised over the K candidates (a log-softmax), so
each term is <= 0 and a child never outscores its parent: the top-N nodes are ancestor-closed, and the
beam construction of tree.py applies unchanged (beam_d = top-N of the N x K expansions of beam_{d-1};
then the global top-N of the D x N beam entries). The pruning of tree.py's "paths" build does not
(each parent has its own row of child scores), so every step ranks all N x K expansions.

The same outputs and order as `tree.lattice_tree` (tree.Tree: tokens, parent, depth, valid, ancestor
mask; T = budget + 1), and the same tie rule: score descending, then depth ascending, then within a depth
by (the parent's position in that depth's order, the child's rank c).

Lossless as any tree the walk verifies: the tree is a function of the drafter's outputs alone, and the
walk accepts a child only where its token is the target's own choice at the parent (tree.walk).
"""

from functools import partial

import jax
import jax.numpy as jnp

from ddtree_jax.tree import INVALID_SCORE, NEG_SCORE, Tree, _clean_logp, _mask_from_paths


def _edge_beams(elogp: jax.Array, budget: int):
    """Per-depth top-`budget` nodes: elogp [D, K, K] -> score, parent slot, rank [D, N], paths [D, N, D]."""
    d_max, k, _ = elogp.shape
    root_beam = jnp.full((budget,), NEG_SCORE, jnp.float32).at[0].set(0.0)
    root_last = jnp.zeros((budget,), jnp.int32)  # the rank a beam entry ends with (the root: row 0)
    root_paths = jnp.full((budget, d_max), -1, jnp.int32)

    def step(carry, xs):
        beam, last, paths = carry
        rows, level = xs  # [K, K], d - 1
        live = beam > INVALID_SCORE
        # Flattened as j * K + c: ties go to the earlier parent slot, then the lower rank.
        cand = jnp.where(live[:, None], beam[:, None] + rows[last], NEG_SCORE).reshape(-1)
        score, idx = jax.lax.top_k(cand, budget)
        slot, rank = idx // k, idx % k
        paths = jnp.where(jnp.arange(d_max)[None, :] == level, rank[:, None], paths[slot])
        return (score, rank.astype(jnp.int32), paths), (score, slot, rank, paths)

    levels = jnp.arange(d_max, dtype=jnp.int32)
    _, (score, slot, rank, paths) = jax.lax.scan(step, (root_beam, root_last, root_paths), (elogp, levels))
    return score, slot.astype(jnp.int32), rank.astype(jnp.int32), paths


def _edge_build_one(bonus: jax.Array, elogp: jax.Array, tok: jax.Array, budget: int):
    """One sequence: bonus [], elogp [D, K, K], tok [D, K] -> tokens, parent, depth, valid [T], mask."""
    d_max = elogp.shape[0]
    score, slot, rank, paths = _edge_beams(_clean_logp(elogp), budget)
    top_score, flat = jax.lax.top_k(score.reshape(-1), budget)  # ties: shallower, then beam order
    d0, j = flat // budget, flat % budget
    valid = top_score > INVALID_SCORE
    node_of = jnp.zeros((d_max, budget), jnp.int32).at[d0, j].set(jnp.arange(1, budget + 1, dtype=jnp.int32))
    parent = jnp.where(d0 == 0, 0, node_of[jnp.maximum(d0 - 1, 0), slot[d0, j]])
    token = tok[d0, rank[d0, j]]
    zero = jnp.zeros((1,), jnp.int32)
    tokens = jnp.concatenate([bonus[None], jnp.where(valid, token, 0)]).astype(jnp.int32)
    parent = jnp.concatenate([zero, jnp.where(valid, parent, 0).astype(jnp.int32)])
    depth = jnp.concatenate([zero, jnp.where(valid, d0 + 1, 0).astype(jnp.int32)])
    valid = jnp.concatenate([jnp.ones((1,), bool), valid])
    node_paths = jnp.concatenate([jnp.full((1, d_max), -1, jnp.int32), paths[d0, j]])  # [T, D]
    return tokens, parent, depth, valid, _mask_from_paths(node_paths, valid)


@partial(jax.jit, static_argnames=("budget",))
def edge_tree(bonus: jax.Array, elogp: jax.Array, tok: jax.Array, budget: int) -> Tree:
    """Tree of the `budget` best nodes by summed edge log-scores under the root `bonus`; T = budget + 1.

    bonus [B] int32; elogp [B, D, K, K] float32: elogp[b, d, p, c] the log-score of candidate c at
    depth d + 1 after candidate p of depth d (depth 1: row 0, the anchor's), each row normalised over
    c; tok [B, D, K] int32 the candidates (distinct within a depth). Padding when there are fewer than
    `budget` nodes.
    """
    tokens, parent, depth, valid, mask = jax.vmap(partial(_edge_build_one, budget=budget))(bonus, elogp, tok)
    return Tree(tokens, parent, depth, valid, mask)
