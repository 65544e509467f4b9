"""The DFlash block-diffusion drafter: one forward proposes a whole block of tokens.

Its context K/V come only from target features (`context_kv`), so they are committed like target K/V.
The block `[bonus, mask x D]` attends to the context and to itself bidirectionally; its outputs go
through the target's lm_head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax import dflash2, models
from ddtree_jax.collectives import Axis
from ddtree_jax.config import DraftConfig
from ddtree_jax.kv_cache import KVCache
from ddtree_jax.models import gqa
from ddtree_jax.models.common import rms_norm, rope_tables
from ddtree_jax.models.dense import decoder_layer, layer_specs
from ddtree_jax.sharding import check_divisible as check_dims
from ddtree_jax.weights import Params, WeightSpec, linear, norm

Entry = gqa.KVEntry  # the drafter is a dense Qwen3 stack whatever the target


def weight_specs(cfg: DraftConfig) -> list[WeightSpec]:
    """Every drafter weight with its z-lab name (no embedding, no lm_head: the target's are used)."""
    h = cfg.dims.hidden_size
    specs = [
        linear(("fc",), "fc.weight", len(cfg.target_layer_ids) * h, h, (None, None)),
        norm(("hidden_norm",), "hidden_norm.weight", h),
    ]
    for i in range(cfg.num_layers):
        # fused: q apart from a fused k/v ("kv_proj"), so that `context_kv`, run every round, reads
        # the K/V columns alone
        specs += layer_specs(f"layers.{i}.", ("layers", i), cfg.dims, cfg.fused_projections, q_apart=True)
    specs.append(norm(("norm",), "norm.weight", h))
    if cfg.dflash2 is not None:
        specs += dflash2.weight_specs(cfg)
    return specs


def context_kv(
    params: Params, cfg: DraftConfig, features: jax.Array, positions: jax.Array
) -> list[gqa.KVEntry]:
    """Per draft layer, K/V [B, T, Hkv, D] of committed tokens from their target features [B, T, F].

    No collective: fc is replicated and each device projects the K/V heads it holds (fused
    projections: one matmul of its "kv_proj", no query columns read).
    """
    ctx = rms_norm(features @ params["fc"], params["hidden_norm"], cfg.dims.rms_norm_eps)
    rope = rope_tables(positions, cfg.rope.inv_freq(), cfg.rope.attention_factor)
    return [gqa.project_kv(p, ctx, cfg.dims, rope) for p in params["layers"]]


def draft_logits(
    params: Params,
    cfg: DraftConfig,
    target_params: Params,
    bonus: jax.Array,
    cache: KVCache,
    *,
    attention: str = "reference",
    window: int | None = None,
    model_axis: Axis = None,
) -> jax.Array:
    """float32 logits [B, D, V] for depths 1..D after the bonus [B] at position cache.lengths.

    With the vocabulary split over `model_axis`, this device's slice [B, D, V_local] (padded entries
    masked: `models.common.logits`). The embedding and lm_head are the target's, as its family reads them.
    A DFlash2 drafter's logits come multiplied and soft capped as its config says (dflash2.transform_logits).
    """
    hidden = draft_hidden(
        params, cfg, target_params, bonus, cache, attention=attention, window=window, model_axis=model_axis
    )
    return head_logits(cfg, target_params, hidden, model_axis)


def head_logits(
    cfg: DraftConfig, target_params: Params, hidden: jax.Array, model_axis: Axis = None
) -> jax.Array:
    """The draft logits [B, D, V(_local)] of final-normed draft states [B, D, H] (the target's head)."""
    logits = models.family_of(cfg.target_architecture).logits(
        target_params, hidden, cfg.vocab_size, model_axis
    )
    return logits if cfg.dflash2 is None else dflash2.transform_logits(cfg, logits)


def draft_hidden(
    params: Params,
    cfg: DraftConfig,
    target_params: Params,
    bonus: jax.Array,
    cache: KVCache,
    *,
    attention: str = "reference",
    window: int | None = None,
    model_axis: Axis = None,
) -> jax.Array:
    """The final-normed draft states [B, D, H] of depths 1..D (`draft_logits` before the head)."""
    family = models.family_of(cfg.target_architecture)
    b, k = bonus.shape[0], cfg.block_size
    block = jnp.full((b, k), cfg.mask_token_id, jnp.int32).at[:, 0].set(bonus)
    positions = cache.lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    rope = rope_tables(positions, cfg.rope.inv_freq(), cfg.rope.attention_factor)
    full = jnp.ones((b, k, k), jnp.bool_)  # the block is bidirectional
    x = family.embed(target_params, block, model_axis)
    c = cfg.dflash2
    if c is not None and c.input_embedding_scale != 1.0:
        x = x * jnp.asarray(c.input_embedding_scale, x.dtype)
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"draft_layer{i}"):
            if c is None:
                x, _ = decoder_layer(
                    p, x, cfg.dims, rope, gqa.layer_attend(attention, cache, i, full, window), model_axis
                )
            else:
                x = _dflash2_layer(p, x, cfg, i, rope, cache, attention, window, model_axis)
    return rms_norm(x[:, 1:], params["norm"], cfg.dims.rms_norm_eps)


def _dflash2_layer(p, x, cfg: DraftConfig, i: int, rope, cache: KVCache, attention, window, model_axis):
    """Draft layer i of a DFlash2 drafter over one block: causal within it and windowed as the layer's
    type says (config.DFlash2Config); sliding layers ignore `window` (their own governs)."""
    c = cfg.dflash2
    b, k = x.shape[:2]
    mask = jnp.tril(jnp.ones((k, k), jnp.bool_)) if c.causal[i] else jnp.ones((k, k), jnp.bool_)
    mask = jnp.broadcast_to(mask, (b, k, k))
    if c.sliding[i]:
        attend = dflash2.sliding_attend(cache.layers[i], cache.lengths, mask, c.sliding_window)
    else:
        attend = gqa.layer_attend(attention, cache, i, mask, window)
    return dflash2.decoder_layer(p, x, cfg, rope, attend, model_axis)


def cache_shapes(cfg: DraftConfig, batch: int, capacity: int, tp: int, dtype: jnp.dtype) -> list[Entry]:
    """Global shapes of the drafter's context cache on a mesh of `tp` model devices."""
    return gqa.cache_shapes(cfg.num_layers, cfg.dims, batch, capacity, tp, dtype)


def check_divisible(cfg: DraftConfig, tp: int) -> None:
    """Clear errors when the drafter's heads, MLP columns or vocabulary do not split `tp` ways."""
    check_dims(cfg.dims, tp, "drafter")


def load(
    directory, target_cfg, dtype: jnp.dtype, sharding, yarn_scaling: str | None = None, cfg=None
) -> tuple[DraftConfig, Params]:
    """Config and parameters of a z-lab DFlash drafter directory, converted and placed
    (`yarn_scaling`: config.load_draft_config; `cfg`: its config already read)."""
    from ddtree_jax.checkpoint import load_params
    from ddtree_jax.checkpoint_checks import check_against_config, check_finite
    from ddtree_jax.config import load_draft_config
    from ddtree_jax.models.common import IGNORED_TENSORS

    cfg = cfg or load_draft_config(directory, target_cfg, yarn_scaling)
    specs = weight_specs(cfg)
    check_against_config(directory, specs, IGNORED_TENSORS)
    params = load_params(directory, specs, dtype, sharding)
    check_finite(directory, params, specs)
    return cfg, params
