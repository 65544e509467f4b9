"""A model family defined in the tests only, to show what a new family takes: this one file, and one
`models.register(FAMILY)` line (tests/test_families.py), with no edit anywhere in ddtree_jax.

Qwen3 layers whose SwiGLU gate and up projections are one stacked weight [2, H, F] (two HF tensors per
layer, `WeightSpec.stack`, columns split over "ff" like any MLP's) applied by one einsum. The math is
HF's Qwen3, so the Qwen3 golden fixtures check it, read under this family's own architecture name
(`fixture` writes such a checkpoint directory: the fixture's config naming `ARCHITECTURE`, its
tensors linked).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ddtree_jax.collectives import Axis
from ddtree_jax.models import common, dense, gqa
from ddtree_jax.models.common import ForwardOutput, all_reduce
from ddtree_jax.weights import Params, WeightSpec, linear, stacked_linear

ARCHITECTURE = "Qwen3FusedMlpForCausalLM"  # made up: a config.json naming it belongs to this family


def config_from_hf(
    raw: dict[str, Any], path: Path, arch: str, eos: tuple[int, ...], **_
) -> dense.DenseConfig:
    """A Qwen3 config.json read as the dense family reads it, under this family's architecture."""
    return dataclasses.replace(dense.config_from_hf(raw, path, "qwen3", eos), architecture=arch)


def weight_specs(cfg: dense.DenseConfig) -> list[WeightSpec]:
    """Dense Qwen3 weights with each layer's gate and up projections stacked as "gate_up" [2, H, F]."""
    h, ff = cfg.dims.hidden_size, cfg.dims.intermediate_size
    specs = common.head_specs(cfg.vocab_size, h, cfg.tie_word_embeddings)
    for i in range(cfg.num_layers):
        prefix, path = f"model.layers.{i}.", ("layers", i)
        mlp = prefix + "mlp."
        specs += dense.norm_specs(prefix, path, h) + gqa.attention_specs(prefix, path, cfg.dims)
        names = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
        specs.append(stacked_linear((*path, "gate_up"), names, h, ff, (None, None, "ff")))
        specs.append(linear((*path, "down_proj"), mlp + "down_proj.weight", ff, h, ("ff", None)))
    return specs


def fused_mlp(p: dict, x: jax.Array, model_axis: Axis) -> jax.Array:
    """silu(x W_gate) * (x W_up) W_down with both input projections in one einsum: [B, T, H] -> [B, T, H]."""
    gate, up = jnp.einsum("bth,khf->kbtf", x, p["gate_up"])
    return all_reduce((jax.nn.silu(gate) * up) @ p["down_proj"], model_axis)


def forward(
    params: Params,
    cfg: dense.DenseConfig,
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
    """The dense forward with the fused MLP in every layer."""

    def ffn(p: dict, h: jax.Array) -> jax.Array:
        return fused_mlp(p, h, model_axis)

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
        ffn=lambda i: ffn,
    )


FAMILY = dataclasses.replace(
    dense.FAMILY,
    name="fused_mlp",
    architectures={ARCHITECTURE: "qwen3_fused_mlp"},
    config_from_hf=config_from_hf,
    weight_specs=weight_specs,
    forward=forward,
    SHAPES={},
)

_ROOT = Path(tempfile.mkdtemp(prefix="ddtree-fused-mlp-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


def fixture(directory: Path, architecture: str | None = None) -> str:
    """A copy of a fixture checkpoint directory (tensors and golden outputs linked, not copied) whose
    config.json names `architecture` (default: this family's, unless the fixture is a drafter); its path."""
    out = _ROOT / directory.name
    out.mkdir(exist_ok=True)
    for f in directory.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    config = json.loads((directory / "config.json").read_text())
    if architecture or "dflash_config" not in config:
        config["architectures"] = [architecture or ARCHITECTURE]
    (out / "config.json").write_text(json.dumps(config))
    return str(out)
