"""The HBM floor of a round: the weight bytes one device must read (all it holds, less what the family
says a pass need not read), and for a MoE target the floor of the experts the router chose."""

from __future__ import annotations

import jax
import numpy as np

from ddtree_jax import models
from ddtree_jax.bench.programs import round_program
from ddtree_jax.config import TargetConfig
from ddtree_jax.engine import DecodeState, Plan
from ddtree_jax.models import moe
from ddtree_jax.programs import Shape


def weight_bytes(params) -> int:
    """Bytes of all parameters at their global (placed) shapes, each counted once."""
    return sum(x.nbytes for x in jax.tree.leaves(params))


def _device_bytes(x: jax.Array) -> int:
    return x.addressable_shards[0].data.nbytes


def step_weight_bytes(params, cfg: TargetConfig, tokens: int = 1) -> float:
    """Weight bytes a pass over `tokens` tokens (per device) must read on one device: all it holds,
    less what the family says such a pass need not read (the embedding table when lm_head is
    separate; a MoE target's experts its tokens are not expected to select)."""
    held = sum(_device_bytes(x) for x in jax.tree.leaves(params))
    return held - models.family(cfg).unread_weight_bytes(params, cfg, tokens, _device_bytes)


def distinct_per_device(experts: np.ndarray, num_experts: int, tp: int, sharding: str) -> int:
    """The most distinct experts one device must read for the chosen experts [..., k] (global ids):
    under expert parallelism ("ep", tp > 1) each device reads its own E / tp experts' share, else every
    device reads (its columns of) all of them."""
    chosen = np.unique(experts)
    if sharding != "ep" or tp == 1:
        return int(chosen.size)
    return int(np.bincount(chosen // (num_experts // tp), minlength=tp).max())


def chosen_expert_floor(
    log: dict[int, list[np.ndarray]], params, cfg: TargetConfig, plan: Plan, shape: Shape, batch: int
) -> dict:
    """Weight bytes one device must read per round given the experts the router chose (`log`:
    moe.RoutingLog.calls of `rounds` rounds: per MoE layer in order, the experts [rows x T, k] of each
    round), counting the live rows' tokens only: all it holds, less the embedding table, less each
    sparse layer's held experts that no live token chose (the busiest device under "ep"). Returns
    {"weight_bytes": mean over rounds, "distinct_experts": mean distinct a layer and round}."""
    sparse = [p for i, p in enumerate(params["layers"]) if cfg.is_sparse(i)]
    if len(log) != len(sparse):
        raise ValueError(
            f"the routing log has {len(log)} MoE call sites, the target {len(sparse)} sparse layers"
        )
    held = sum(_device_bytes(x) for x in jax.tree.leaves(params))
    # every expert expected (a huge token count): what is left unread is the embedding table alone
    static = held - models.family(cfg).unread_weight_bytes(params, cfg, 1 << 40, _device_bytes)
    rows, live = shape.rows // plan.dp, -(-batch // plan.dp)
    sharding = getattr(cfg, "moe_sharding", "ep")
    per_round, distinct = [], []
    for site, p in enumerate(sparse):
        local = moe.num_experts(p["experts_gate"])  # experts a device holds (all of them under "tp")
        if sharding == "ep" and plan.tp > 1:
            local //= plan.tp
        expert_bytes = (
            sum(_device_bytes(a) for n in moe.EXPERT_WEIGHTS for a in jax.tree.leaves(p[n])) / local
        )
        for r, experts in enumerate(log[site]):
            tokens = experts.reshape(rows, -1, experts.shape[-1])[:live]
            count = distinct_per_device(tokens, cfg.num_experts, plan.tp, sharding)
            distinct.append(count)
            if r == len(per_round):
                per_round.append(static)
            per_round[r] -= (local - count) * expert_bytes
    return {"weight_bytes": float(np.mean(per_round)), "distinct_experts": float(np.mean(distinct))}


def record_routing(params, dparams, state: DecodeState, plan: Plan, rounds: int) -> dict:
    """`rounds` rounds of a separately compiled program that logs every MoE layer's routing (one
    host callback a layer and round: never the timed program) -> moe.RoutingLog.calls."""
    with moe.RoutingLog() as log:
        compiled = round_program(plan, rounds).lower(params, dparams, state).compile()
    jax.block_until_ready(compiled(params, dparams, state))
    jax.effects_barrier()  # every callback has run
    return log.calls
