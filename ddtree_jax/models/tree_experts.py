"""The experts a draft tree of each budget touches, counted from the routing of one verify: the MoE term
of a round's cost (issue 40 item 3: a mixture-of-experts target pays for the distinct experts its
tree's tokens choose, not for its node count).

A tree's nodes are in the build's order (tree.py: score descending, parents before children), and a
tree of budget b is the first b + 1 nodes of the budget-B tree drafted from the same block (the top-b
lattice nodes by score; a node of child rank c has c higher-scored siblings, so none past rank b is
among them). So one routing of a budget-B verify ([rows, B + 1, k] per MoE layer, e.g. from
`moe.RoutingLog` with the rows' tokens in node order) gives the distinct experts of every budget up to
B: an expert counts for budget b when its first node is at index <= b.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def first_node(experts: np.ndarray, num_experts: int, valid: np.ndarray | None = None) -> np.ndarray:
    """experts [..., T, k] (global ids; T nodes in build order) -> [..., E] int: the index of the first
    node that chooses each expert, T where none does (`valid` [..., T]: nodes to count; default all)."""
    *lead, nodes, k = experts.shape
    first = np.full((int(np.prod(lead, dtype=np.int64)), num_experts), nodes, np.int64)
    node = np.broadcast_to(np.arange(nodes)[:, None], (nodes, k))
    keep = np.ones(experts.shape, bool) if valid is None else np.broadcast_to(valid[..., None], experts.shape)
    groups = np.broadcast_to(np.arange(first.shape[0]).reshape(*lead, 1, 1), experts.shape)
    np.minimum.at(first, (groups[keep], experts[keep]), np.broadcast_to(node, experts.shape)[keep])
    return first.reshape(*lead, num_experts)


def distinct_experts_by_budget(
    experts: np.ndarray,
    budgets: Sequence[int],
    num_experts: int,
    valid: np.ndarray | None = None,
    devices: int = 1,
) -> np.ndarray:
    """Distinct experts a tree of each budget touches: experts [L, R, T, k] (per MoE layer, per
    verified tree R (rows x rounds), its T >= max(budgets) + 1 nodes' chosen experts in build order)
    -> float [len(budgets), L], the mean over trees; `devices` > 1: the busiest device's count under
    expert parallelism (E / devices whole experts each)."""
    if max(budgets) + 1 > experts.shape[-2]:
        raise ValueError(
            f"budget {max(budgets)} needs {max(budgets) + 1} nodes, the routing has {experts.shape[-2]}"
        )
    if num_experts % devices:
        raise ValueError(f"{num_experts} experts do not split over {devices} devices")
    first = first_node(experts, num_experts, valid)  # [L, R, E]
    split = first.reshape(*first.shape[:-1], devices, num_experts // devices)  # [L, R, D, E / D]
    out = [(split <= b).sum(-1).max(-1).mean(-1) for b in budgets]  # each [L]
    return np.stack(out).astype(np.float64)
