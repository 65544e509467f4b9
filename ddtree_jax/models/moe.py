"""Routed experts without dropping tokens: a softmax top-k router and three expert dispatches.

Shapes: x [N, H] (N = B x T tokens, flattened); the router [H, E]; experts stacked as gate / up
[E, H, I] and down [E, I, H]. On a mesh the experts split over "model" one of two ways (the family's
`moe_sharding`): "ep" gives each device E / tp whole experts (expert parallelism: a device computes
its experts' share of every token it holds; the other experts' slots count zero), "tp" gives each
device I / tp columns of every expert (tensor parallelism inside experts). Either way each device
returns a partial sum that the layer's all-reduce completes, as for a dense MLP.

Dispatches (each exact; which is fastest depends on N, see `choose_dispatch`):
  gather  per token and slot, gather the chosen experts' weights and multiply ([N, k] small matmuls):
          reads k expert matrices per token, the least work for one or a few tokens
  sorted  sort the N x k (token, expert) pairs by expert, then grouped matmuls (`jax.lax.ragged_dot`);
          `sorted_mgpu` the same with JAX's bundled Hopper kernel (Mosaic GPU, H100/H200 only)
  dense   every local expert on every token, weighted by the routing weights (zero where not chosen):
          E / k times the FLOPs of the routed work, but plain batched matmuls
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ddtree_jax.collectives import Axis
from ddtree_jax.weights import WeightSpec, stacked_linear

DISPATCHES = ("gather", "sorted", "dense")  # any backend
GPU_DISPATCHES = ("sorted_mgpu",)  # Hopper GPUs only
EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")
# Token counts up to this use `gather`, above it `sorted`: a prediction from DESIGN.md's H200 figures
# (gather 4.8x / 3.3x the distinct-expert floor at 1 / 8 tokens, sort + ragged_dot 16.2x / 2.9x);
# scripts/bench_moe.py measures the crossover (results/notes.md).
GATHER_MAX_TOKENS = 4


class Routing(NamedTuple):
    """Per token the chosen experts [N, k] int32 (global ids) and their weights [N, k] (x's dtype)."""

    experts: jax.Array
    weights: jax.Array


def expert_specs(
    prefix: str, path: tuple, hidden: int, width: int, num_experts: int, sharding: str
) -> list[WeightSpec]:
    """The router and the stacked experts of one layer (HF `mlp.gate`, `mlp.experts.{e}.*`)."""
    mlp = prefix + "mlp."
    names = [f"{mlp}experts.{e}." for e in range(num_experts)]
    ep = sharding == "ep"
    col = ("experts", None, None) if ep else (None, None, "ff")
    row = ("experts", None, None) if ep else (None, "ff", None)
    return [
        WeightSpec(
            (*path, "router"), mlp + "gate.weight", (hidden, num_experts), (None, None), transpose=True
        ),
        stacked_linear((*path, "experts_gate"), [n + "gate_proj.weight" for n in names], hidden, width, col),
        stacked_linear((*path, "experts_up"), [n + "up_proj.weight" for n in names], hidden, width, col),
        stacked_linear((*path, "experts_down"), [n + "down_proj.weight" for n in names], width, hidden, row),
    ]


def route(router: jax.Array, x: jax.Array, top_k: int, normalize: bool) -> Routing:
    """Softmax over experts in float32, top-k (ties: the lower expert id first), optional renormalising.

    The router logits are computed in x's dtype and the weights cast back to it, as HF's Qwen3-MoE does.
    """
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), weights.astype(x.dtype))


def _local(routing: Routing, num_local: int, model_axis: Axis, sharding: str) -> tuple[jax.Array, jax.Array]:
    """Expert ids local to this device [N, k] and whether each slot's expert is held here [N, k]."""
    if model_axis is None or sharding != "ep":
        return routing.experts, jnp.ones(routing.experts.shape, jnp.bool_)
    local = routing.experts - jax.lax.axis_index(model_axis) * num_local
    here = (local >= 0) & (local < num_local)
    return jnp.where(here, local, 0), here


def _combine(out: jax.Array, weights: jax.Array, here: jax.Array) -> jax.Array:
    """Per-slot expert outputs [N, k, H] weighted and summed over slots -> [N, H]; absent slots are 0."""
    weighted = out * weights[..., None]
    return jnp.sum(jnp.where(here[..., None], weighted, jnp.zeros((), out.dtype)), axis=1)


def _gather(p: dict, x: jax.Array, experts: jax.Array) -> jax.Array:
    """[N, k, H] expert outputs, each token multiplying its own gathered expert matrices."""
    gate, up, down = p["experts_gate"][experts], p["experts_up"][experts], p["experts_down"][experts]
    act = jax.nn.silu(jnp.einsum("nh,nkhi->nki", x, gate)) * jnp.einsum("nh,nkhi->nki", x, up)
    return jnp.einsum("nki,nkih->nkh", act, down)


def _mgpu_ragged_dot(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot` by JAX's bundled Hopper kernel (blocks as DESIGN.md measured them best)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot(
        lhs,
        rhs,
        group_sizes=sizes,
        block_m=64,
        block_n=128,
        block_k=64,
        max_concurrent_steps=4,
        grid_block_n=1,
    )


def _sorted(p: dict, x: jax.Array, experts: jax.Array, here: jax.Array, ragged_dot=jax.lax.ragged_dot):
    """[N, k, H] expert outputs from grouped matmuls over the (token, slot) pairs sorted by expert."""
    n, k = experts.shape
    num_local = p["experts_gate"].shape[0]
    key = jnp.where(here, experts, num_local).reshape(-1)  # absent experts sort last, in no group
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    rows = x[order // k]  # [N k, H]
    act = jax.nn.silu(ragged_dot(rows, p["experts_gate"], sizes)) * ragged_dot(rows, p["experts_up"], sizes)
    out = ragged_dot(act, p["experts_down"], sizes)
    out = jnp.where((key[order] < num_local)[:, None], out, jnp.zeros((), out.dtype))
    return jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)


def _dense(p: dict, x: jax.Array, experts: jax.Array, weights: jax.Array, here: jax.Array) -> jax.Array:
    """[N, H] from every local expert on every token, weighted by the routing (0 where not chosen)."""
    num_local = p["experts_gate"].shape[0]
    chosen = (experts[..., None] == jnp.arange(num_local)) & here[..., None]  # [N, k, E_local]
    per_expert = jnp.sum(jnp.where(chosen, weights[..., None], jnp.zeros((), weights.dtype)), axis=1)
    act = jax.nn.silu(jnp.einsum("nh,ehi->nei", x, p["experts_gate"])) * jnp.einsum(
        "nh,ehi->nei", x, p["experts_up"]
    )
    out = jnp.einsum("nei,eih->neh", act, p["experts_down"])
    return jnp.einsum("neh,ne->nh", out, per_expert)


def expected_distinct(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens select when each picks top_k of num_experts uniformly and
    independently: E (1 - (1 - k/E)^N); exactly k for one token. (Qwen3-30B-A3B shapes on the H200,
    DESIGN.md: 8 / 51 / 127 / 128 measured at 1 / 8 / 64 / 512 tokens; this gives 8 / 51.6 / 125.9 /
    128.)"""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def choose_dispatch(num_tokens: int) -> str:
    """The dispatch for a static token count N (GATHER_MAX_TOKENS)."""
    return "gather" if num_tokens <= GATHER_MAX_TOKENS else "sorted"


def run_experts(
    p: dict,
    x: jax.Array,
    routing: Routing,
    sharding: str = "ep",
    model_axis: Axis = None,
    dispatch: str | None = None,
) -> jax.Array:
    """The experts' weighted mix for x [N, H] routed by `routing` -> this device's partial sum [N, H].

    Any router can feed it (a family's own scores, groups or bias); no all-reduce here: the caller adds
    the layer's. `dispatch` None picks one by token count.
    """
    experts, here = _local(routing, p["experts_gate"].shape[0], model_axis, sharding)
    dispatch = dispatch or choose_dispatch(x.shape[0])
    if dispatch == "dense":
        return _dense(p, x, experts, routing.weights, here)
    if dispatch == "gather":
        return _combine(_gather(p, x, experts), routing.weights, here)
    ragged = _mgpu_ragged_dot if dispatch == "sorted_mgpu" else jax.lax.ragged_dot
    return _combine(_sorted(p, x, experts, here, ragged), routing.weights, here)


def experts_ffn(
    p: dict,
    x: jax.Array,
    top_k: int,
    normalize: bool,
    sharding: str = "ep",
    model_axis: Axis = None,
    dispatch: str | None = None,
) -> jax.Array:
    """Qwen3-MoE's routed experts of one layer on x [..., H] (`route`, then `run_experts`) -> this
    device's partial sum [..., H]."""
    flat = x.reshape(-1, x.shape[-1])
    routing = route(p["router"], flat, top_k, normalize)
    return run_experts(p, flat, routing, sharding, model_axis, dispatch).reshape(x.shape)
