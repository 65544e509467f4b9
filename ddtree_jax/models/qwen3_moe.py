"""Qwen3MoeForCausalLM: Qwen3 attention with routed experts (softmax top-k, no shared expert).

Layer i is sparse iff i is not in `mlp_only_layers`, there are experts, and (i + 1) % decoder_sparse_step
== 0; the other layers keep a dense SwiGLU MLP of `intermediate_size`. Experts are stacked [E, ...]
(models/moe.py) and split over "model" by expert (`moe_sharding` "ep") or by column ("tp"). Built on
the dense family (models/dense.py): its config, layer and forward with the experts as feed-forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from ddtree_jax.collectives import Axis
from ddtree_jax.config import RopeConfig, positive_field
from ddtree_jax.models import common, dense, gqa, moe
from ddtree_jax.models.common import ForwardOutput, all_reduce
from ddtree_jax.models.family import Family
from ddtree_jax.weights import Params, WeightSpec


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(dense.DenseConfig, moe.RoutedExperts):
    """A Qwen3-MoE target: the dense fields (`dims`: attention, the dense layers' MLP) plus the routed
    experts' (models/moe.py) and which layers route."""

    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

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
    base = dense.config_from_hf(raw, path, "qwen3", eos)
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    routed = moe.routed_fields(raw, path, experts, False, moe_sharding, Qwen3MoeConfig.EXPERTS_FIELD)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields |= {"architecture": arch, "fused_projections": False}  # (its specs keep q/k/v apart: not fused)
    return Qwen3MoeConfig(
        **fields,
        **routed,
        decoder_sparse_step=positive_field(raw, "decoder_sparse_step", path)
        if "decoder_sparse_step" in raw
        else 1,
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    )


def weight_specs(cfg: Qwen3MoeConfig) -> list[WeightSpec]:
    """Every target weight with its HF name; each sparse layer's experts stacked [E, ...]."""
    d = cfg.dims
    specs = common.head_specs(cfg.vocab_size, d.hidden_size, cfg.tie_word_embeddings)
    for i in range(cfg.num_layers):
        prefix, path = f"model.layers.{i}.", ("layers", i)
        specs += dense.norm_specs(prefix, path, d.hidden_size) + gqa.attention_specs(prefix, path, d)
        if cfg.is_sparse(i):
            specs += moe.expert_specs(
                prefix, path, d.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.moe_sharding
            )
        else:
            specs += dense.mlp_specs(prefix, path, d.hidden_size, d.intermediate_size)
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
            p, h, cfg.experts_per_token, cfg.norm_topk_prob, cfg.moe_sharding, model_axis, cfg.moe_dispatch
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


def unread_weight_bytes(
    params: Params, cfg: Qwen3MoeConfig, tokens: int, nbytes: Callable[[jax.Array], int]
) -> float:
    """The dense part (the embedding table), plus each sparse layer's experts that `tokens` tokens
    are expected not to select (`moe.unread_expert_bytes`)."""
    return dense.unread_weight_bytes(params, cfg, tokens, nbytes) + moe.unread_expert_bytes(
        params, cfg, tokens, nbytes
    )


def check_divisible(cfg: Qwen3MoeConfig, tp: int, model: str = "target") -> None:
    """The dense rules, plus: experts (ep) or each expert's width (tp) split `tp` ways."""
    dense.check_divisible(cfg, tp, model)
    cfg.check_experts_divisible(tp, model)


def _shape(vocab: int, layers: int, dims, rope: RopeConfig, max_pos: int, **experts) -> Qwen3MoeConfig:
    return Qwen3MoeConfig("qwen3_moe", vocab, layers, rope, False, max_pos, dims=dims, **experts)


FAMILY = Family(
    name="qwen3_moe",
    architectures={"Qwen3MoeForCausalLM": "qwen3_moe"},
    config_from_hf=config_from_hf,
    weight_specs=weight_specs,
    forward=forward,
    embed=common.embed,
    logits=common.logits,
    Entry=gqa.KVEntry,
    cache_shapes=dense.cache_shapes,  # GQA, as for dense targets
    unread_weight_bytes=unread_weight_bytes,
    check_divisible=check_divisible,
    ignored_tensors=common.ignored_tensors,
    heads_per_device=dense.heads_per_device,
    draft_dims=dense.draft_dims,
    # No second, inactive row for one-row ar steps: its token would read up to experts_per_token more
    # experts per layer (at Qwen3-30B-A3B shapes ~3.6 GB a step, against ~0.2 GB of slower one-row
    # reads of the dense part).
    ATTENTION="gqa",
    PAD_ONE_ROW_AR=False,
    ROUTED_EXPERTS=True,  # the default ddtree budgets of budgets.MOE_DEFAULT_BUDGETS
    CUDNN_PREFILL=True,
    SHAPES={
        "qwen3-30b-a3b": _shape(
            151936,
            48,
            dense._dims(2048, 6144, 32, 4, 128, True),
            RopeConfig(1e6, 128),
            40960,
            num_experts=128,
            experts_per_token=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
        ),
        "tiny-moe": _shape(
            512,
            4,
            dense._dims(64, 128, 4, 2, 16, True),
            RopeConfig(1e4, 16),
            4096,
            num_experts=8,
            experts_per_token=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=(0,),
        ),
    },
)
