"""The target model (Qwen3ForCausalLM / LlamaForCausalLM) as pure functions over a parameter dict."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ddtree_jax.attention import cache_attend, self_attend
from ddtree_jax.collectives import Axis, psum, vocab_offset
from ddtree_jax.config import TargetConfig
from ddtree_jax.kv_cache import KVCache
from ddtree_jax.layers import decoder_layer, layer_specs, rms_norm, rope_tables
from ddtree_jax.weights import Params, WeightSpec, norm


def weight_specs(cfg: TargetConfig) -> list[WeightSpec]:
    """Every target weight with its HF name; lm_head only when embeddings are untied."""
    h, v = cfg.dims.hidden_size, cfg.vocab_size
    specs = [WeightSpec(("embed",), "model.embed_tokens.weight", (v, h), ("vocab", None))]
    for i in range(cfg.num_layers):
        specs += layer_specs(f"model.layers.{i}.", ("layers", i), cfg.dims)
    specs.append(norm(("norm",), "model.norm.weight", h))
    if not cfg.tie_word_embeddings:
        specs.append(WeightSpec(("lm_head",), "lm_head.weight", (h, v), (None, "vocab"), transpose=True))
    return specs


class ForwardOutput(NamedTuple):
    """hidden [B, T, H] after the final norm; kv per layer ([B, T, Hkv, D] x 2); features [B, T, F]."""

    hidden: jax.Array
    kv: list[tuple[jax.Array, jax.Array]]
    features: jax.Array | None


def embed(params: Params, tokens: jax.Array, model_axis: Axis = None) -> jax.Array:
    """Token embeddings [B, T, H]; a vocabulary-split table: masked local lookup, then all-reduce."""
    table = params["embed"]
    if model_axis is None:
        return table[tokens]
    local = tokens - vocab_offset(table.shape[0], model_axis)
    here = (local >= 0) & (local < table.shape[0])
    rows = table[jnp.where(here, local, 0)]
    return psum(jnp.where(here[..., None], rows, jnp.zeros((), rows.dtype)), model_axis)


def logits(params: Params, hidden: jax.Array) -> jax.Array:
    """float32 logits [..., V] from final-normed hidden states (tied or untied lm_head).

    With the vocabulary split over devices, this device's slice [..., V_local] (collectives.py).
    """
    if "lm_head" in params:
        return jnp.matmul(hidden, params["lm_head"], preferred_element_type=jnp.float32)
    return jnp.einsum("...h,vh->...v", hidden, params["embed"], preferred_element_type=jnp.float32)


def forward(
    params: Params,
    cfg: TargetConfig,
    tokens: jax.Array,
    positions: jax.Array,
    mask: jax.Array,
    cache: KVCache | None,
    *,
    feature_layers: tuple[int, ...] = (),
    attention: str = "reference",
    model_axis: Axis = None,
    dropout: Callable[[jax.Array], jax.Array] | None = None,
) -> ForwardOutput:
    """Run T new tokens [B, T] at `positions` over `cache` (None: prefill) under `mask` [B, T, T].

    The cache is only read: the new tokens' K/V come back in `kv` for the caller to commit.
    `features` concatenates HF's `hidden_states[i + 1]` for i in `feature_layers` (what DFlash conditions
    on): the output of decoder layer i, except for the last layer, whose entry HF records after the
    final norm (the DDTree reference and z-lab's drafters read it so).
    `model_axis`: the mesh axis heads, columns and vocabulary are split over (None: unsplit).
    `dropout` (training only): applied to the embeddings and to every residual branch.
    """
    x = embed(params, tokens, model_axis)
    if dropout is not None:
        x = dropout(x)
    rope = rope_tables(positions, cfg.rope.inv_freq())
    kv, feats = [], {}
    for i, p in enumerate(params["layers"]):
        attend = self_attend(mask) if cache is None else cache_attend(attention, cache, i, mask)
        with jax.named_scope(f"layer{i}"):
            x, layer_kv = decoder_layer(p, x, cfg.dims, rope, attend, model_axis, dropout)
        kv.append(layer_kv)
        feats[i] = x
    hidden = rms_norm(x, params["norm"], cfg.dims.rms_norm_eps)
    feats[cfg.num_layers - 1] = hidden  # HF's hidden_states[L] is the final norm's output
    features = jnp.concatenate([feats[i] for i in feature_layers], -1) if feature_layers else None
    return ForwardOutput(hidden, kv, features)


def load(directory, dtype: jnp.dtype, sharding) -> tuple[TargetConfig, Params]:
    """Config and parameters of an HF target directory, converted to `dtype` and placed."""
    from ddtree_jax.checkpoint import load_params
    from ddtree_jax.config import load_target_config

    cfg = load_target_config(directory)
    return cfg, load_params(directory, weight_specs(cfg), dtype, sharding)
