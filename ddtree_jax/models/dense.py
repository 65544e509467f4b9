"""Dense decoder families: Qwen3ForCausalLM and LlamaForCausalLM (GQA attention, SwiGLU MLP).

A family module provides what models/__init__.py lists; this one serves as the base of the
others (its layer takes another feed-forward through `ffn`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ddtree_jax.collectives import Axis
from ddtree_jax.config import LayerDims, TargetConfig, hf_dims, hf_rope, positive_field
from ddtree_jax.models import common, gqa
from ddtree_jax.models.common import ForwardOutput, all_reduce, rms_norm, rope_tables, swiglu
from ddtree_jax.sharding import check_divisible as check_dims
from ddtree_jax.weights import Params, WeightSpec, linear, norm

Entry = gqa.KVEntry
embed, logits = common.embed, common.logits  # the target's embedding and head (the drafter's too)
ignored_tensors = common.ignored_tensors
PAD_ONE_ROW_AR = True  # a one-row ar step runs as two rows: XLA's two-row matmuls read faster (engine.py)
ROUTED_EXPERTS = False  # dense layers: the default ddtree budgets of budgets.DEFAULT_BUDGETS
# ffn(p, h) -> [B, T, H], all-reduced: the feed-forward branch of one layer on its normed input.
FFN = Callable[[dict, jax.Array], jax.Array]


def config_from_hf(raw: dict[str, Any], path: Path, arch: str, eos: tuple[int, ...], **_) -> TargetConfig:
    """The dense target of an HF config.json (`arch`: "qwen3" or "llama")."""
    dims = hf_dims(raw, path, qk_norm=arch == "qwen3")
    return TargetConfig(
        architecture=arch,
        vocab_size=positive_field(raw, "vocab_size", path),
        num_layers=positive_field(raw, "num_hidden_layers", path),
        dims=dims,
        rope=hf_rope(raw, dims.head_dim, path),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=positive_field(raw, "max_position_embeddings", path),
        eos_token_ids=eos,
    )


def mlp_specs(prefix: str, path: tuple, dims: LayerDims) -> list[WeightSpec]:
    """The SwiGLU MLP of one layer; columns split over "ff"."""
    h, ff, mlp = dims.hidden_size, dims.intermediate_size, prefix + "mlp."
    return [
        linear((*path, "gate_proj"), mlp + "gate_proj.weight", h, ff, (None, "ff")),
        linear((*path, "up_proj"), mlp + "up_proj.weight", h, ff, (None, "ff")),
        linear((*path, "down_proj"), mlp + "down_proj.weight", ff, h, ("ff", None)),
    ]


def norm_specs(prefix: str, path: tuple, dims: LayerDims) -> list[WeightSpec]:
    """The two pre-norms of one layer."""
    h = dims.hidden_size
    return [
        norm((*path, "attn_norm"), prefix + "input_layernorm.weight", h),
        norm((*path, "mlp_norm"), prefix + "post_attention_layernorm.weight", h),
    ]


def layer_specs(prefix: str, path: tuple, dims: LayerDims) -> list[WeightSpec]:
    """The weights of one dense decoder layer; HF names under `prefix` (e.g. 'model.layers.3.')."""
    return (
        norm_specs(prefix, path, dims)
        + gqa.attention_specs(prefix, path, dims)
        + mlp_specs(prefix, path, dims)
    )


def mlp(p: dict, x: jax.Array, model_axis: Axis = None) -> jax.Array:
    """SwiGLU feed-forward (columns split over `model_axis`: partial sums all-reduced)."""
    return all_reduce(swiglu(x, p["gate_proj"], p["up_proj"], p["down_proj"]), model_axis)


def decoder_layer(
    p: dict,
    x: jax.Array,
    dims: LayerDims,
    rope: tuple[jax.Array, jax.Array],
    attend: gqa.Attend,
    model_axis: Axis = None,
    dropout: Callable[[jax.Array], jax.Array] | None = None,
    ffn: FFN | None = None,
) -> tuple[jax.Array, gqa.KVEntry]:
    """One pre-norm decoder layer; returns the new hidden state and this layer's in-flight K/V.

    `ffn` replaces the SwiGLU MLP (a routed-experts block); `dropout` (training only) applies to each
    branch's output before it joins the residual stream.
    """
    branch = dropout or (lambda y: y)
    ffn = ffn or (lambda q, h: mlp(q, h, model_axis))
    with jax.named_scope("attention"):
        out, entry = gqa.attention(
            p, rms_norm(x, p["attn_norm"], dims.rms_norm_eps), dims, rope, attend, model_axis
        )
        x = x + branch(out)
    with jax.named_scope("mlp"):
        x = x + branch(ffn(p, rms_norm(x, p["mlp_norm"], dims.rms_norm_eps)))
    return x, entry


def weight_specs(cfg: TargetConfig) -> list[WeightSpec]:
    """Every target weight with its HF name; lm_head only when embeddings are untied."""
    specs = common.head_specs(cfg.vocab_size, cfg.dims.hidden_size, cfg.tie_word_embeddings)
    for i in range(cfg.num_layers):
        specs += layer_specs(f"model.layers.{i}.", ("layers", i), cfg.dims)
    return specs


def forward(
    params: Params,
    cfg: TargetConfig,
    tokens: jax.Array,
    positions: jax.Array,
    mask: jax.Array,
    cache,
    *,
    feature_layers: tuple[int, ...] = (),
    attention: str = "reference",
    model_axis: Axis = None,
    dropout: Callable[[jax.Array], jax.Array] | None = None,
    ffn: Callable[[int], FFN | None] = lambda i: None,
) -> ForwardOutput:
    """Run T new tokens [B, T] at `positions` over `cache` (None: prefill) under `mask` [B, T, T].

    The cache is only read: the new tokens' entries come back in `kv` for the caller to commit.
    `ffn(i)`: layer i's feed-forward when it is not the SwiGLU MLP (families built on this one).
    """
    rope = rope_tables(positions, cfg.rope.inv_freq(), cfg.rope.attention_factor)

    def layer(i: int, p: dict, x: jax.Array):
        attend = gqa.layer_attend(attention, cache, i, mask)
        return decoder_layer(p, x, cfg.dims, rope, attend, model_axis, dropout, ffn(i))

    return common.decoder_stack(
        params, tokens, layer, cfg.dims.rms_norm_eps, feature_layers, model_axis, dropout
    )


def cache_shapes(cfg: TargetConfig, batch: int, capacity: int, tp: int, dtype: jnp.dtype) -> list[Entry]:
    """Global shapes of the target's cache on a mesh of `tp` model devices."""
    return gqa.cache_shapes(cfg.num_layers, cfg.dims, batch, capacity, tp, dtype)


def unread_weight_bytes(
    params: Params, cfg: TargetConfig, tokens: int, nbytes: Callable[[jax.Array], int]
) -> float:
    """Bytes of the weights one device holds that a pass over `tokens` tokens need not read."""
    return common.unread_embedding_bytes(params, cfg.tie_word_embeddings, nbytes)


def check_divisible(cfg: TargetConfig, tp: int, model: str = "target") -> None:
    """Clear errors when heads or MLP columns do not split `tp` ways (any vocabulary does: padded)."""
    check_dims(cfg.dims, tp, model)
