"""Qwen3MoeForCausalLM: Qwen3 attention with routed experts (softmax top-k, no shared expert).

Layer i is sparse iff i is not in `mlp_only_layers`, there are experts, and (i + 1) % decoder_sparse_step
== 0; the other layers keep a dense SwiGLU MLP of `intermediate_size`. Experts are stacked [E, ...]
(models/moe.py) and split over "model" by expert (`moe_sharding` "ep") or by column ("tp").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ddtree_jax.collectives import Axis
from ddtree_jax.config import TargetConfig, positive_field
from ddtree_jax.errors import DDTreeError
from ddtree_jax.models import common, dense, gqa, moe
from ddtree_jax.models.common import ForwardOutput, all_reduce
from ddtree_jax.weights import Params, WeightSpec

Entry = gqa.KVEntry
embed, logits = common.embed, common.logits
ignored_tensors = common.ignored_tensors
MOE_SHARDINGS = ("ep", "tp")
# No second, inactive row for one-row ar steps: its token would read up to top_k more experts per layer
# (at Qwen3-30B-A3B shapes ~3.6 GB a step, against ~0.2 GB of slower one-row reads of the dense part).
PAD_ONE_ROW_AR = False
ROUTED_EXPERTS = True  # tokens routed to experts: the default ddtree budgets of budgets.MOE_DEFAULT_BUDGETS


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(TargetConfig):
    """A Qwen3-MoE target: the dense fields plus the routed experts'."""

    num_experts: int = 0
    top_k: int = 1  # num_experts_per_tok
    moe_intermediate_size: int = 0  # each expert's width
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    moe_sharding: str = "ep"  # experts over "model": "ep" whole experts, "tp" columns of every expert
    moe_dispatch: str | None = None  # moe.run_experts' dispatch; None: by token count and backend

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes to experts (else a dense MLP)."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )


def config_from_hf(
    raw: dict[str, Any], path: Path, arch: str, eos: tuple[int, ...], moe_sharding: str = "ep", **_
) -> Qwen3MoeConfig:
    """The Qwen3-MoE target of an HF config.json (`num_experts`, or `num_local_experts` as written by
    transformers 5)."""
    if moe_sharding not in MOE_SHARDINGS:
        raise DDTreeError(f"--moe-sharding must be one of {MOE_SHARDINGS}, got {moe_sharding!r}")
    base = dense.config_from_hf(raw, path, "qwen3", eos)
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if not isinstance(experts, int) or experts < 0:
        raise DDTreeError(f"{path}: missing or bad 'num_experts' ({experts!r})")
    fields = dataclasses.asdict(base) | {"architecture": arch}
    fields["dims"], fields["rope"] = base.dims, base.rope
    return Qwen3MoeConfig(
        **fields,
        num_experts=experts,
        top_k=positive_field(raw, "num_experts_per_tok", path),
        moe_intermediate_size=positive_field(raw, "moe_intermediate_size", path),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=positive_field(raw, "decoder_sparse_step", path)
        if "decoder_sparse_step" in raw
        else 1,
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        moe_sharding=moe_sharding,
    )


def weight_specs(cfg: Qwen3MoeConfig) -> list[WeightSpec]:
    """Every target weight with its HF name; each sparse layer's experts stacked [E, ...]."""
    d = cfg.dims
    specs = common.head_specs(cfg.vocab_size, d.hidden_size, cfg.tie_word_embeddings)
    for i in range(cfg.num_layers):
        prefix, path = f"model.layers.{i}.", ("layers", i)
        specs += dense.norm_specs(prefix, path, d) + gqa.attention_specs(prefix, path, d)
        if cfg.is_sparse(i):
            specs += moe.expert_specs(
                prefix, path, d.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.moe_sharding
            )
        else:
            specs += dense.mlp_specs(prefix, path, d)
    return specs


def forward(
    params: Params,
    cfg: Qwen3MoeConfig,
    tokens: jax.Array,
    positions: jax.Array,
    mask: jax.Array,
    cache,
    *,
    feature_layers: tuple[int, ...] = (),
    attention: str = "reference",
    model_axis: Axis = None,
    dropout: Callable[[jax.Array], jax.Array] | None = None,
) -> ForwardOutput:
    """The dense forward (models/dense.py) with the routed experts in the sparse layers."""

    def experts(p: dict, h: jax.Array) -> jax.Array:
        out = moe.experts_ffn(
            p, h, cfg.top_k, cfg.norm_topk_prob, cfg.moe_sharding, model_axis, cfg.moe_dispatch
        )
        return all_reduce(out, model_axis)

    return dense.forward(
        params,
        cfg,
        tokens,
        positions,
        mask,
        cache,
        feature_layers=feature_layers,
        attention=attention,
        model_axis=model_axis,
        dropout=dropout,
        ffn=lambda i: experts if cfg.is_sparse(i) else None,
    )


def cache_shapes(cfg: Qwen3MoeConfig, batch: int, capacity: int, tp: int, dtype: jnp.dtype) -> list[Entry]:
    """Global shapes of the target's cache (GQA, as for dense targets)."""
    return dense.cache_shapes(cfg, batch, capacity, tp, dtype)


def unread_weight_bytes(
    params: Params, cfg: Qwen3MoeConfig, tokens: int, nbytes: Callable[[jax.Array], int]
) -> float:
    """The dense part (the embedding table), plus each sparse layer's experts that `tokens` tokens
    are expected not to select (`moe.expected_distinct`)."""
    unread = dense.unread_weight_bytes(params, cfg, tokens, nbytes)
    idle = 1.0 - moe.expected_distinct(cfg.num_experts, cfg.top_k, tokens) / cfg.num_experts
    for i, p in enumerate(params["layers"]):
        if cfg.is_sparse(i):
            unread += idle * sum(nbytes(p[name]) for name in moe.EXPERT_WEIGHTS)
    return unread


def check_divisible(cfg: Qwen3MoeConfig, tp: int, model: str = "target") -> None:
    """The dense rules, plus: experts (ep) or each expert's width (tp) split `tp` ways."""
    dense.check_divisible(cfg, tp, model)
    if tp == 1 or cfg.num_experts == 0:
        return
    field, n = (
        ("num_experts", cfg.num_experts)
        if cfg.moe_sharding == "ep"
        else (
            "moe_intermediate_size",
            cfg.moe_intermediate_size,
        )
    )
    if n % tp:
        raise DDTreeError(
            f"--tp {tp}: the {model}'s {field} ({n}) is not divisible by {tp} "
            f"(--moe-sharding {cfg.moe_sharding})"
        )
