"""The random-weight targets `ddtree-bench` measures (every family's `Family.SHAPES`), their quantized
forms and the DFlash drafter of each."""

from __future__ import annotations

from ddtree_jax import models
from ddtree_jax.config import DraftConfig, RopeConfig, TargetConfig, default_target_layer_ids
from ddtree_jax.quant.formats import Fp8Block, Int4Group

SHAPES = models.bench_shapes()  # every family's benchmark shapes (Family.SHAPES)


# --quantize: the target's weights as the published checkpoints store them (quant.load.published_form)
QUANTIZE = {"none": None, "fp8": Fp8Block((128, 128)), "int4-experts": Int4Group(32)}


def draft_shape(cfg: TargetConfig, layers: int, block_size: int) -> DraftConfig:
    """A DFlash drafter of the layer shape the target's family gives (`Family.draft_dims`)."""
    d = models.family(cfg).draft_dims(cfg)
    return DraftConfig(
        layers,
        d,
        RopeConfig(cfg.rope.theta, d.head_dim),
        block_size,
        cfg.vocab_size - 1,
        # DFlash's spacing over [1, L - 3] runs below 0 for targets cut to 2 or 3 layers: clamp
        # (the drafter still reads `layers` feature vectors, as the full-depth one does)
        tuple(min(max(i, 0), cfg.num_layers - 1) for i in default_target_layer_ids(cfg.num_layers, layers)),
        cfg.vocab_size,
        cfg.architecture,
        fused_projections=True,
    )
