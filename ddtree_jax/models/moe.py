"""Routed experts without dropping tokens: a softmax top-k router and the expert dispatches.

Shapes: x [N, H] (N = B x T tokens, flattened); the router [H, E]; experts stacked as gate / up
[E, H, I] and down [E, I, H], each any `quant.Weight` (a plain array, `Fp8Weight`, `Int4Weight`): the
matmuls are `ddtree_jax.quant.arrays`' (or the Pallas kernel of the same contract), which read the
stored bytes, so a quantized family hands its experts over unchanged. On a mesh the experts split over
"model" one of two ways (the family's `moe_sharding`): "ep" gives each device E / tp whole experts
(expert parallelism: a device computes its experts' share of every token it holds; the other experts'
slots count zero), "tp" gives each device I / tp columns of every expert (tensor parallelism inside
experts). Either way each device returns a partial sum that the layer's all-reduce completes, as for a
dense MLP.

Dispatches (each exact; which is fastest depends on N and the backend, see `choose_dispatch`):
  gather   per token and slot, gather the chosen experts' weights and multiply (`slot_matmul`):
           reads k expert matrices per token, the least work for one or a few tokens
  sorted   sort the N x k (token, expert) pairs by expert, then grouped matmuls through
           `jax.lax.ragged_dot` (`ragged_matmul`); any backend
  grouped  the same sort, grouped matmuls by the Pallas Triton kernel of kernels/quant_matmul.py
           (`quant.arrays.pallas_ragged_matmul`; CUDA GPUs; reads only the experts that own
           rows, K split over programs for few rows); `grouped_split` the same with more K splits
           (tile_k 64, up to 8 splits) for one-token decode; with `_interpret` appended they run
           in interpret mode (tests, any backend)
  sorted_mgpu  the sort with JAX's bundled Hopper kernel (Mosaic GPU, H100/H200, plain arrays only)
  fused    tiles of (token, slot) pairs of one chosen expert each, through two Mosaic GPU kernels
           (`kernels.fused_experts`: gate + up + SiLU, then down; Hopper): each program reads one
           64-column block of its tile's expert once, only chosen experts are read, no per-token
           copies; bf16 / f16 activations, experts whose shapes it cannot tile go through `grouped`
           (`fused_experts.supported`); `fused_interpret` runs it in GPU interpret mode (tests)
  few      the distinct chosen experts of a few tokens, each read once for all of them by a split-K
           GEMV spread over every SM (`kernels.few_experts`, Pallas Triton; any CUDA GPU): bf16 / f16
           activations, experts whose shapes it cannot tile go through `grouped`; `few_interpret`
           runs it in interpret mode (tests); `few_mgpu` the same on Mosaic GPU (Hopper; the fused
           kernel's wgmma program with a K split, `kernels.few_experts_mgpu`; `few_mgpu_interpret`)
  dense    every local expert on every token, weighted by the routing weights (zero where not chosen):
           E / k times the FLOPs of the routed work, but plain batched matmuls
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.collectives import Axis
from ddtree_jax.config import positive_field
from ddtree_jax.errors import DDTreeError
from ddtree_jax.kernels.tuning import moe_gpu_dispatch
from ddtree_jax.quant.arrays import (
    Fp8Weight,
    Int4Weight,
    Weight,
    dequantize,
    expert_weight,
    num_experts,
    pallas_ragged_matmul,
    ragged_matmul,
    slot_matmul,
    stored,
)
from ddtree_jax.weights import Params, WeightSpec, stacked_linear

MOE_SHARDINGS = ("ep", "tp")  # experts over "model": whole experts per device, or columns of every expert
DISPATCHES = ("gather", "sorted", "dense")  # any backend
# CUDA (sorted_mgpu, fused: Hopper)
GPU_DISPATCHES = ("grouped", "grouped_split", "sorted_mgpu", "fused", "few", "few_mgpu")
# the Pallas ones in interpret mode, tests only
INTERPRETED_DISPATCHES = (
    "grouped_interpret",
    "grouped_split_interpret",
    "fused_interpret",
    "few_interpret",
    "few_mgpu_interpret",
)
EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")
# Token counts up to GATHER_MAX_TOKENS use `gather`; above it `sorted` (ragged_dot) off the GPU and the
# Pallas `grouped` kernel on a GPU (the GPU's rule by token count and expert format is the table
# kernels.tuning.MOE_GPU_DISPATCH; GPU_GATHER_MAX_TOKENS is its measured gather bound). H200 figures
# (results/notes.md): gather 5.6x / 2.9x the distinct-expert floor at 1 / 8 tokens, sort + ragged_dot
# 18.2x / 3.0x; the grouped kernel 3.5x / 4.1x / 24x faster than ragged_dot at 16 / 64 / 512 tokens
# but 1.7x slower than gather at one token (Kimi expert shape). GPU_GATHER_MAX_TOKENS is the GPU's
# threshold, which the one-token rows (gather, grouped, grouped_split) of
# results/h200/moe-dispatch/run.sh decide for the Qwen3-30B-A3B shape.
GATHER_MAX_TOKENS = 4
GPU_GATHER_MAX_TOKENS = 4
# On a Hopper GPU, token counts up to FUSED_MAX_TOKENS use `fused`, above it the rule above; 0 turns it off.
# Off, as measured: on the H200 (2026-12-02, results/h200/2026-12-02/moe-fused/moe_fused.log) the fused kernel
# is right in every format but never faster than the better of `gather` and `grouped`. Milliseconds per
# Qwen3-30B-A3B expert layer (bf16) at 1 / 4 / 8 / 16 / 32 / 64 / 128 tokens: fused 0.292 / 0.358 / 0.347 /
# 0.434 / 0.460 / 0.539 / 0.622; gather 0.170 / 0.291 / 0.462 / 0.768 (1-16 only); grouped 0.309 / 0.333 /
# 0.322 / 0.421 / 0.458 / 0.509 / 0.523. The forced `fused` dispatch still runs it.
FUSED_MAX_TOKENS = 0
# `few` reads every distinct chosen expert for all N tokens (N x distinct-experts dots): above
# FEW_MAX_TOKENS tokens per device, e.g. a prefill under a forced `--moe-dispatch few`, it runs `grouped`.
FEW_MAX_TOKENS = 64
# What a GPU without Mosaic GPU (not Hopper) runs where the table names a Hopper-only dispatch.
HOPPER_FALLBACK = {"few_mgpu": "few", "fused": "grouped", "sorted_mgpu": "grouped"}
Grouped = Callable[[jax.Array, Weight, jax.Array], jax.Array]  # x [P, in] sorted, W [E, in, out], sizes


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutedExperts:
    """The routed-experts part a MoE family's config shares (Qwen3MoeConfig, DeepseekV3Config inherit
    it beside the target fields): the experts, how many a token takes, their width, and how they split
    over "model"."""

    num_experts: int = 0
    experts_per_token: int = 1  # HF's num_experts_per_tok
    moe_intermediate_size: int = 0  # each expert's width
    norm_topk_prob: bool = False  # renormalise the chosen experts' weights to sum to 1
    moe_sharding: str = "ep"  # experts over "model": "ep" whole experts, "tp" columns of every expert
    moe_dispatch: str | None = None  # run_experts' dispatch; None: by token count and backend
    EXPERTS_FIELD: ClassVar[str] = "num_experts"  # the config.json field that counts the experts

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes to experts (else a dense MLP)."""
        raise NotImplementedError

    def check_experts_divisible(self, tp: int, model: str, extra: dict[str, int] | None = None) -> None:
        """Clear errors when the experts (ep) or each expert's width (tp), and `extra` widths (e.g. the
        shared experts'), do not split `tp` ways."""
        if tp == 1 or self.num_experts == 0:
            return
        counts = dict(extra or {})
        if self.moe_sharding == "ep":
            counts[self.EXPERTS_FIELD] = self.num_experts
        else:
            counts["moe_intermediate_size"] = self.moe_intermediate_size
        for field, n in counts.items():
            if n % tp:
                raise DDTreeError(
                    f"--tp {tp}: the {model}'s {field} ({n}) is not divisible by {tp} "
                    f"(--moe-sharding {self.moe_sharding})"
                )


def routed_fields(
    raw: dict[str, Any], path: Path, num_experts: Any, norm_topk_prob: bool, moe_sharding: str, field: str
) -> dict[str, Any]:
    """The `RoutedExperts` fields of an HF config with `num_experts` experts (read from its `field`;
    top-k and width required when there are experts); `norm_topk_prob`: the family's default when the
    config leaves it out."""
    if moe_sharding not in MOE_SHARDINGS:
        raise DDTreeError(f"--moe-sharding must be one of {MOE_SHARDINGS}, got {moe_sharding!r}")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 0:
        raise DDTreeError(f"{path}: missing or bad '{field}' ({num_experts!r})")
    routed = num_experts > 0
    return dict(
        num_experts=num_experts,
        experts_per_token=positive_field(raw, "num_experts_per_tok", path) if routed else 1,
        moe_intermediate_size=positive_field(raw, "moe_intermediate_size", path) if routed else 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", norm_topk_prob)),
        moe_sharding=moe_sharding,
    )


def unread_expert_bytes(
    params: Params, cfg: RoutedExperts, tokens: int, nbytes: Callable[[jax.Array], int]
) -> float:
    """Bytes of each sparse layer's experts that `tokens` tokens are expected not to select
    (`expected_distinct`: uniform choice); quantized experts count their stored values and scales."""
    idle = 1.0 - expected_distinct(cfg.num_experts, cfg.experts_per_token, tokens) / max(cfg.num_experts, 1)
    unread = 0.0
    for i, p in enumerate(params["layers"]):
        if cfg.is_sparse(i):
            unread += idle * sum(nbytes(a) for name in EXPERT_WEIGHTS for a in jax.tree.leaves(p[name]))
    return unread


class RoutingLog:
    """The routing of every `run_experts` call traced while the log is active (`with RoutingLog() as
    log:` around tracing a program; read after running it): per call site in trace order (one per MoE
    layer of a traced forward) the chosen experts [N, k] (global ids) of each execution, as device 0 of
    the model axis sees them (its tokens are every device's). A host callback per call: for a program
    run once to count experts (`ddtree_jax.bench.floor.chosen_expert_floor`), never for one that is timed."""

    active: RoutingLog | None = None  # the log that `run_experts` feeds at trace time

    def __init__(self) -> None:
        self.calls: dict[int, list[np.ndarray]] = collections.defaultdict(list)
        self._sites = 0

    def __enter__(self) -> RoutingLog:
        RoutingLog.active = self
        return self

    def __exit__(self, *exc) -> None:
        RoutingLog.active = None

    def record(self, experts: jax.Array, model_axis: Axis) -> None:
        """At trace time: a callback that stores this call site's experts [N, k] at every execution."""
        site, self._sites = self._sites, self._sites + 1
        device = jnp.int32(0) if model_axis is None else jax.lax.axis_index(model_axis)
        jax.debug.callback(functools.partial(self._store, site), experts, device)

    def _store(self, site: int, experts, device) -> None:
        if int(device) == 0:
            self.calls[site].append(np.asarray(experts))


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


def route(router: jax.Array, x: jax.Array, experts_per_token: int, normalize: bool) -> Routing:
    """Softmax over experts in float32, top-k (ties: the lower expert id first), optional renormalising.

    The router logits are computed in x's dtype and the weights cast back to it, as HF's Qwen3-MoE does.
    """
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, experts_per_token)
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
    """[N, k, H] expert outputs, each (token, slot) multiplying its own gathered expert matrices."""
    act = jax.nn.silu(slot_matmul(x, p["experts_gate"], experts)) * slot_matmul(x, p["experts_up"], experts)
    return slot_matmul(act, p["experts_down"], experts)


def _mgpu_ragged_dot(lhs: jax.Array, rhs: Weight, sizes: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot` by JAX's bundled Hopper kernel (blocks as docs/design.md records them best)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    if not isinstance(rhs, jax.Array):
        raise DDTreeError("the sorted_mgpu dispatch reads plain expert arrays only; use grouped")
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


def _power_of_two_tile(size: int, largest: int) -> int | None:
    """The largest power of two in [16, largest] dividing `size` (Triton: loads of 2^n elements, dots
    of at least 16), or None."""
    block = largest
    while block >= 16:
        if size % block == 0:
            return block
        block //= 2
    return None


def _stored_rows(w: Weight) -> int:
    """Rows per expert as stored (fp8: padded to whole blocks; int4: 8 per int32 word)."""
    rows = stored(w).shape[-2]
    return rows * 8 if isinstance(w, Int4Weight) and w.q.dtype == jnp.int32 else rows


def grouped_blocks(w: Weight, largest_k: int = 128) -> tuple[int, int] | None:
    """(tile_k, tile_n) of the Pallas grouped kernel for this expert weight [E, in, out] (local
    shapes under shard_map), or None where no legal pair exists (the dispatch then uses ragged_dot).
    Qwen3-30B-A3B: (128, 128) for gate / up [128, 2048, 768] and down [128, 768, 2048]; 768 / tp columns
    under "tp" experts give block 128 / 64 / 32 at tp 2 / 4 / 8."""
    rows, n = _stored_rows(w), stored(w).shape[-1]
    if isinstance(w, Int4Weight):  # the kernel reads int32 words, 8 dots of tile_k / 8 >= 16 rows
        ok = w.q.dtype == jnp.int32
        tile_k = (256 if rows % 256 == 0 else 128 if rows % 128 == 0 else None) if ok else None
    elif isinstance(w, Fp8Weight):
        tile_k = _power_of_two_tile(rows, min(largest_k, w.block[0]))  # nests in the scale block
    else:
        tile_k = _power_of_two_tile(rows, largest_k)
    tile_n = _power_of_two_tile(n, 128)
    return None if tile_k is None or tile_n is None else (tile_k, tile_n)


def pallas_grouped(dispatch: str) -> Grouped:
    """The grouped matmul (the contract of `quant.arrays.ragged_matmul`) of a Pallas dispatch: the
    Triton kernel, with more K splits for `grouped_split`, interpreted for `grouped_interpret`; weights
    whose shapes the kernel's blocks cannot tile go through `ragged_matmul`."""

    def grouped(x: jax.Array, w: Weight, sizes: jax.Array) -> jax.Array:
        split = dispatch.startswith("grouped_split")
        blocks = grouped_blocks(w, 64 if split else 128)
        if blocks is None:
            return ragged_matmul(x, w, sizes)
        tile_k, tile_n = blocks
        splits = None
        if split:  # up to 8 splits of K: more programs for a few rows
            k_tiles = _stored_rows(w) // tile_k
            splits = max(s for s in range(1, 9) if k_tiles % s == 0)
        return pallas_ragged_matmul(
            x,
            w,
            sizes,
            tile_k=tile_k,
            tile_n=tile_n,
            splits=splits,
            interpret=dispatch.endswith("_interpret"),
        )

    return grouped


def _grouped_fn(dispatch: str) -> Grouped:
    """The grouped matmul a sorted dispatch runs."""
    if dispatch == "sorted":
        return ragged_matmul
    if dispatch == "sorted_mgpu":
        return _mgpu_ragged_dot
    return pallas_grouped(dispatch)


def _sorted(p: dict, x: jax.Array, experts: jax.Array, here: jax.Array, grouped: Grouped) -> jax.Array:
    """[N, k, H] expert outputs from grouped matmuls over the (token, slot) pairs sorted by expert.
    Slots whose expert is not held here sort last, past every group: the grouped matmul gives them 0."""
    n, k = experts.shape
    num_local = num_experts(p["experts_gate"])
    key = jnp.where(here, experts, num_local).reshape(-1)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    rows = x[order // k]  # [N k, H]
    act = jax.nn.silu(grouped(rows, p["experts_gate"], sizes)) * grouped(rows, p["experts_up"], sizes)
    out = grouped(act, p["experts_down"], sizes)
    return jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)


def _dense(p: dict, x: jax.Array, experts: jax.Array, weights: jax.Array, here: jax.Array) -> jax.Array:
    """[N, H] from every local expert on every token, weighted by the routing (0 where not chosen)."""
    gate, up, down = (dequantize(p[name], x.dtype) for name in EXPERT_WEIGHTS)
    num_local = gate.shape[0]
    chosen = (experts[..., None] == jnp.arange(num_local)) & here[..., None]  # [N, k, E_local]
    per_expert = jnp.sum(jnp.where(chosen, weights[..., None], jnp.zeros((), weights.dtype)), axis=1)
    act = jax.nn.silu(jnp.einsum("nh,ehi->nei", x, gate)) * jnp.einsum("nh,ehi->nei", x, up)
    out = jnp.einsum("nei,eih->neh", act, down)
    return jnp.einsum("neh,ne->nh", out, per_expert)


def expected_distinct(num_experts: int, experts_per_token: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens select when each picks experts_per_token of num_experts uniformly and
    independently: E (1 - (1 - k/E)^N); exactly k for one token. (Qwen3-30B-A3B shapes on the H200,
    docs/design.md: 8 / 51 / 127 / 128 measured at 1 / 8 / 64 / 512 tokens; this gives 8 / 51.6 / 125.9 /
    128.)"""
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** tokens)


def hopper() -> bool:
    """Whether the default device is a CUDA GPU of compute capability 9 (H100 / H200: wgmma, TMA)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "0")).startswith("9")


def weight_format(w: Weight) -> str:
    """The format of an expert weight as the dispatch table names it: "plain", "fp8" or "int4"."""
    return "fp8" if isinstance(w, Fp8Weight) else "int4" if isinstance(w, Int4Weight) else "plain"


def choose_dispatch(
    num_tokens: int, backend: str | None = None, fused: bool | None = None, fmt: str = "plain"
) -> str:
    """The dispatch for a static token count N (per device) of experts in format `fmt` on `backend`
    (default: jax.default_backend() at trace time): on a GPU `fused` up to FUSED_MAX_TOKENS where `fused`
    (default: `hopper()`; it also says whether Mosaic GPU runs), else the table
    kernels.tuning.MOE_GPU_DISPATCH by format and N (off Hopper its Mosaic GPU dispatches become
    HOPPER_FALLBACK's); elsewhere `gather` up to GATHER_MAX_TOKENS, `sorted` above."""
    if (backend or jax.default_backend()) == "gpu":
        mosaic = hopper() if fused is None else fused
        if num_tokens <= FUSED_MAX_TOKENS and mosaic:
            return "fused"
        dispatch = moe_gpu_dispatch(fmt, num_tokens)
        return dispatch if mosaic else HOPPER_FALLBACK.get(dispatch, dispatch)
    return "gather" if num_tokens <= GATHER_MAX_TOKENS else "sorted"


def _fused(p: dict, x: jax.Array, experts: jax.Array, weights: jax.Array, here: jax.Array, dispatch: str):
    """[N, H] through `kernels.fused_experts`, or through the grouped kernel where it cannot take the
    experts (e.g. 96 columns a device) or activations (float32)."""
    from ddtree_jax.kernels import fused_experts

    interpret = dispatch.endswith("_interpret")
    gate, up, down = (expert_weight(p[name]) for name in EXPERT_WEIGHTS)  # plain arrays + scales
    if not fused_experts.supported(gate, up, down, x.dtype):
        grouped = _grouped_fn("grouped_interpret" if interpret else "grouped")
        return _combine(_sorted(p, x, experts, here, grouped), weights, here)
    return fused_experts.fused_experts(x, experts, here, weights, gate, up, down, interpret=interpret)


def _few(p: dict, x: jax.Array, experts: jax.Array, weights: jax.Array, here: jax.Array, dispatch: str):
    """[N, H] through `kernels.few_experts` (`few_experts_mgpu` for `few_mgpu`), or through the grouped
    kernel above FEW_MAX_TOKENS tokens or where it cannot take the experts (e.g. INT4 unpacked to
    jnp.int4) or activations (float32)."""
    from ddtree_jax.kernels import few_experts, few_experts_mgpu

    interpret = dispatch.endswith("_interpret")
    kernel = few_experts_mgpu if dispatch.startswith("few_mgpu") else few_experts
    gate, up, down = (expert_weight(p[name]) for name in EXPERT_WEIGHTS)
    if x.shape[0] > FEW_MAX_TOKENS or not kernel.supported(gate, up, down, x.dtype):
        grouped = _grouped_fn("grouped_interpret" if interpret else "grouped")
        return _combine(_sorted(p, x, experts, here, grouped), weights, here)
    run = few_experts_mgpu.few_experts_mgpu if kernel is few_experts_mgpu else few_experts.few_experts
    return run(x, experts, here, weights, gate, up, down, interpret=interpret)


def run_experts(
    p: dict,
    x: jax.Array,
    routing: Routing,
    sharding: str = "ep",
    model_axis: Axis = None,
    dispatch: str | None = None,
) -> jax.Array:
    """The experts' weighted mix for x [N, H] routed by `routing` -> this device's partial sum [N, H].

    Expert weights are any `quant.Weight`. Any router can feed it (a family's own scores, groups or
    bias); no all-reduce here: the caller adds the layer's. `dispatch` None picks one by token count.
    """
    if RoutingLog.active is not None:
        RoutingLog.active.record(routing.experts, model_axis)
    experts, here = _local(routing, num_experts(p["experts_gate"]), model_axis, sharding)
    dispatch = dispatch or choose_dispatch(x.shape[0], fmt=weight_format(p["experts_gate"]))
    names = DISPATCHES + GPU_DISPATCHES + INTERPRETED_DISPATCHES
    if dispatch not in names:
        raise DDTreeError(f"MoE dispatch must be one of {names}, got {dispatch!r}")
    if dispatch == "dense":
        return _dense(p, x, experts, routing.weights, here)
    if dispatch == "gather":
        return _combine(_gather(p, x, experts), routing.weights, here)
    if dispatch.startswith("fused"):
        return _fused(p, x, experts, routing.weights, here, dispatch)
    if dispatch.startswith("few"):
        return _few(p, x, experts, routing.weights, here, dispatch)
    return _combine(_sorted(p, x, experts, here, _grouped_fn(dispatch)), routing.weights, here)


def experts_ffn(
    p: dict,
    x: jax.Array,
    experts_per_token: int,
    normalize: bool,
    sharding: str = "ep",
    model_axis: Axis = None,
    dispatch: str | None = None,
) -> jax.Array:
    """Qwen3-MoE's routed experts of one layer on x [..., H] (`route`, then `run_experts`) -> this
    device's partial sum [..., H]."""
    flat = x.reshape(-1, x.shape[-1])
    routing = route(p["router"], flat, experts_per_token, normalize)
    return run_experts(p, flat, routing, sharding, model_axis, dispatch).reshape(x.shape)
