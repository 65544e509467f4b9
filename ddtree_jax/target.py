"""The target model, whatever its family: each call goes to `models.family(cfg)`.

Pure functions over a parameter dict; the family modules (models/) hold the layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ddtree_jax import models
from ddtree_jax.collectives import Axis
from ddtree_jax.config import TargetConfig
from ddtree_jax.kv_cache import KVCache
from ddtree_jax.models.common import ForwardOutput, embed, logits
from ddtree_jax.weights import Params, WeightSpec

__all__ = ["ForwardOutput", "embed", "forward", "load", "logits", "weight_specs"]


def weight_specs(cfg: TargetConfig) -> list[WeightSpec]:
    """Every target weight with its HF name (the family's specs)."""
    return models.family(cfg).weight_specs(cfg)


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

    The cache is only read: the new tokens' cache entries come back in `kv` for the caller to commit.
    `features` concatenates HF's `hidden_states[i + 1]` for i in `feature_layers` (what DFlash conditions
    on; the last layer's entry is the final norm's output). `model_axis`: the mesh axis heads, columns,
    experts and vocabulary are split over (None: unsplit). `dropout` (training only): applied to the
    embeddings and to every residual branch.
    """
    return models.family(cfg).forward(
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
    )


def load(
    directory,
    dtype: jnp.dtype,
    sharding,
    dequantize: bool = False,
    cfg: TargetConfig | None = None,
    **options,
) -> tuple[TargetConfig, Params]:
    """Config and parameters of an HF target directory, converted to `dtype` and placed (`options`:
    family settings, e.g. `moe_sharding`; `cfg`: its config already read). A quantized checkpoint
    keeps its quantized weights as stored (ddtree_jax.quant), or expands them to `dtype` with
    `dequantize`."""
    from ddtree_jax.checkpoint import load_params
    from ddtree_jax.checkpoint_checks import check_against_config, check_finite
    from ddtree_jax.quant import load as quant_load

    cfg = cfg or models.load_target_config(directory, **options)
    specs = weight_specs(cfg)
    check_against_config(directory, specs, models.family(cfg).ignored_tensors(cfg), cfg.quantization)
    if cfg.quantization is None:
        params = load_params(directory, specs, dtype, sharding)
        check_finite(directory, params, specs)
        return cfg, params
    params = quant_load.load_params(directory, specs, cfg.quantization, dtype, sharding, dequantize)
    check_finite(directory, params, specs)
    # expanded: the config says so (plans compiled for quantized params are keyed by it); their
    # weights as stored, unfused (`Family.unfused`)
    expanded = models.family(cfg).unfused(dataclasses.replace(cfg, quantization=None))
    return (expanded if dequantize else cfg), params
