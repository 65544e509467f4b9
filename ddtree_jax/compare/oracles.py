"""The project's independent plain-Python references, numpy only: DFlash's default target layer ids and
the DDTree draft tree as the DDTree reference builds it (a best-first heap over the drafter's top-k
lattice), its ancestor mask and its walk.

Written from the papers, sharing no code with the engine (tree.py builds the same tree by per-depth
beams without a heap; config.py spaces the layer ids), so that a test or a comparison of the two is a
comparison of two implementations. Used by `ddtree-compare reference` (torch_reference.py), the tests
(test_tree.py, test_torch_reference.py, test_tree_attention.py, test_drafter.py) and the fixture
makers (tests/make_fixtures.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's spacing when a drafter names no layers: the middle one, else evenly over [1, L - 3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


class DraftTree(NamedTuple):
    """Node 0 is the root (the bonus); every parent precedes its children."""

    tokens: list[int]
    parent: list[int]  # root: -1
    depth: list[int]


def chain_tree(bonus: int, tokens: list[int]) -> DraftTree:
    """The DFlash chain: the bonus, then one token per depth."""
    n = len(tokens) + 1
    return DraftTree([bonus, *tokens], [-1, *range(n - 1)], list(range(n)))


def heap_tree(bonus: int, logp: np.ndarray, tok: np.ndarray, budget: int) -> DraftTree:
    """The `budget` best nodes of the top-k lattice, popped best-first from a heap.

    logp, tok [D, k]: per-depth log-probs (sorted descending) and their tokens. A node's score is the
    float32 sum of its path's log-probs. Equal scores pop shallower first, then (same depth) by the
    parent's pop order, then by lower rank: the order tree.py documents for the engine. Every node
    sorts after its parent, so the pops come out in that total order and stay ancestor-closed.
    """
    d_max, k = logp.shape
    logp = logp.astype(np.float32)
    tree = DraftTree([bonus], [-1], [0])
    heap: list[tuple] = []

    def push_children(node: int, score: np.float32) -> None:
        d = tree.depth[node]
        if d < d_max:
            for rank in range(k):
                child = np.float32(score + logp[d, rank])
                heapq.heappush(heap, (-float(child), d + 1, node, rank, child))

    push_children(0, np.float32(0.0))
    while heap and len(tree.tokens) <= budget:
        _, d, parent, rank, score = heapq.heappop(heap)
        tree.tokens.append(int(tok[d - 1, rank]))
        tree.parent.append(parent)
        tree.depth.append(d)
        push_children(len(tree.tokens) - 1, score)
    return tree


def ancestor_mask(parent: Sequence[int]) -> np.ndarray:
    """[T, T] bool from each node's parent (the root's: -1): mask[i, j] is true when j is i or one of
    i's ancestors."""
    t = len(parent)
    mask = np.zeros((t, t), bool)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


def walk(tree: DraftTree, choice: list[int]) -> list[int]:
    """The accepted path: from the root, step to the child whose token is the target's choice."""
    path = [0]
    while True:
        node = path[-1]
        children = [c for c in range(len(tree.tokens)) if tree.parent[c] == node]
        accepted = [c for c in children if tree.tokens[c] == choice[node]]
        if not accepted:
            return path
        path.append(accepted[0])
