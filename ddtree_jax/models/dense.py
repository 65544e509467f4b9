"""The dense family: Qwen3ForCausalLM and LlamaForCausalLM (GQA attention, SwiGLU MLP).

Its config (`DenseConfig`: the shared target fields plus the GQA layer shape `dims`) and its layer
serve as the base of Qwen3-MoE (the layer takes another feed-forward through `ffn`); the module ends
with its `FAMILY` record (models/family.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ddtree_jax.collectives import Axis
from ddtree_jax.config import LayerDims, RopeConfig, TargetConfig, hf_dims, hf_rope, positive_field
from ddtree_jax.models import common, gqa
from ddtree_jax.models.common import ForwardOutput, all_reduce, matmul, rms_norm, rope_tables, swiglu
from ddtree_jax.models.family import Family
from ddtree_jax.sharding import check_divisible as check_dims
from ddtree_jax.weights import Params, WeightSpec, fused_weight, linear, norm, stack_layers

# ffn(p, h) -> [B, T, H], all-reduced: the feed-forward branch of one layer on its normed input.
FFN = Callable[[dict, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class DenseConfig(TargetConfig):
    """A target of GQA layers (Qwen3ForCausalLM, LlamaForCausalLM; Qwen3-MoE extends it)."""

    dims: LayerDims = dataclasses.field(kw_only=True)  # every layer's attention and MLP shape
    # q/k/v and gate/up projections each as one weight, one matmul (`fused`); False: five matmuls, as
    # HF stores them. A checkpoint's config has True (config_from_hf), a config made in code False.
    fused_projections: bool = dataclasses.field(default=False, kw_only=True)

    @property
    def hidden_size(self) -> int:
        """The width of the residual stream."""
        return self.dims.hidden_size


def config_from_hf(raw: dict[str, Any], path: Path, arch: str, eos: tuple[int, ...], **_) -> DenseConfig:
    """The dense target of an HF config.json (`arch`: "qwen3" or "llama")."""
    dims = hf_dims(raw, path, qk_norm=arch == "qwen3")
    return DenseConfig(
        architecture=arch,
        vocab_size=positive_field(raw, "vocab_size", path),
        num_layers=positive_field(raw, "num_hidden_layers", path),
        dims=dims,
        rope=hf_rope(raw, dims.head_dim, path),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=positive_field(raw, "max_position_embeddings", path),
        eos_token_ids=eos,
        fused_projections=True,
    )


def fused(cfg: DenseConfig) -> bool:
    """Whether the layers' q/k/v and gate/up weights are fused (`DenseConfig.fused_projections`):
    unquantized weights only (FP8 and INT4 ones stay as stored, one matmul each)."""
    return cfg.fused_projections and cfg.quantization is None


def unfused(cfg: DenseConfig) -> DenseConfig:
    """The config with q/k/v and gate/up as five weights (HF's layout): the opt-out."""
    return dataclasses.replace(cfg, fused_projections=False)


def mlp_specs(prefix: str, path: tuple, hidden: int, ff: int, fuse: bool = False) -> list[WeightSpec]:
    """The SwiGLU MLP of one layer (hidden -> ff -> hidden); columns split over "ff". `fuse`: gate and up
    as one weight "gate_up_proj" [H, 2, F] (`weights.join`), one matmul."""
    h, mlp = hidden, prefix + "mlp."
    gate = linear((*path, "gate_proj"), mlp + "gate_proj.weight", h, ff, (None, "ff"))
    up = linear((*path, "up_proj"), mlp + "up_proj.weight", h, ff, (None, "ff"))
    down = linear((*path, "down_proj"), mlp + "down_proj.weight", ff, h, ("ff", None))
    if fuse:
        return [
            fused_weight((*path, "gate_up_proj"), [gate, up], "stack", (h, 2, ff), (None, None, "ff")),
            down,
        ]
    return [gate, up, down]


def norm_specs(prefix: str, path: tuple, h: int) -> list[WeightSpec]:
    """The two pre-norms of one layer of width h."""
    return [
        norm((*path, "attn_norm"), prefix + "input_layernorm.weight", h),
        norm((*path, "mlp_norm"), prefix + "post_attention_layernorm.weight", h),
    ]


def layer_specs(
    prefix: str, path: tuple, dims: LayerDims, fuse: bool = False, q_apart: bool = False
) -> list[WeightSpec]:
    """The weights of one dense decoder layer; HF names under `prefix` (e.g. 'model.layers.3.');
    `fuse`: q/k/v and gate/up fused (`fused`); `q_apart`: q kept apart from the fused k/v
    (`gqa.attention_specs`)."""
    return (
        norm_specs(prefix, path, dims.hidden_size)
        + gqa.attention_specs(prefix, path, dims, fuse, q_apart)
        + mlp_specs(prefix, path, dims.hidden_size, dims.intermediate_size, fuse)
    )


def mlp(p: dict, x: jax.Array, model_axis: Axis = None) -> jax.Array:
    """SwiGLU feed-forward (columns split over `model_axis`: partial sums all-reduced); a fused
    "gate_up_proj" [H, 2, F_local] is one matmul."""
    if "gate_up_proj" not in p:
        return all_reduce(swiglu(x, p["gate_proj"], p["up_proj"], p["down_proj"]), model_axis)
    w = p["gate_up_proj"]
    gate_up = (x @ w.reshape(w.shape[0], -1)).reshape(*x.shape[:-1], 2, w.shape[-1])
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    return all_reduce(matmul(jax.nn.silu(gate) * up, p["down_proj"]), model_axis)


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


def weight_specs(cfg: DenseConfig) -> list[WeightSpec]:
    """Every target weight with its HF name; lm_head only when embeddings are untied."""
    specs = common.head_specs(cfg.vocab_size, cfg.dims.hidden_size, cfg.tie_word_embeddings)
    for i in range(cfg.num_layers):
        specs += layer_specs(f"model.layers.{i}.", ("layers", i), cfg.dims, fused(cfg))
    return stack_layers(specs) if cfg.scan_layers else specs


def forward(
    params: Params,
    cfg: DenseConfig,
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

    if cfg.scan_layers:  # one traced layer: params["layers"] stacked [L, ...], the cache one StackedKVEntry
        if dropout is not None or ffn(0) is not None:
            raise ValueError("scan_layers: dense SwiGLU layers without dropout only (training unrolls)")

        def scanned(i: jax.Array, p: dict, x: jax.Array):
            attend = gqa.layer_attend(attention, cache, i, mask)
            return decoder_layer(p, x, cfg.dims, rope, attend, model_axis)

        out = common.scan_stack(params, tokens, scanned, cfg.dims.rms_norm_eps, feature_layers, model_axis)
        return out._replace(kv=[gqa.StackedKVEntry(*out.kv[0])])

    return common.decoder_stack(
        params, tokens, layer, cfg.dims.rms_norm_eps, feature_layers, model_axis, dropout
    )


def cache_shapes(cfg: DenseConfig, batch: int, capacity: int, tp: int, dtype: jnp.dtype) -> list:
    """Global shapes of the target's cache on a mesh of `tp` model devices (one stacked entry when
    `cfg.scan_layers`)."""
    shapes = gqa.stacked_cache_shapes if cfg.scan_layers else gqa.cache_shapes
    return shapes(cfg.num_layers, cfg.dims, batch, capacity, tp, dtype)


def unread_weight_bytes(
    params: Params, cfg: DenseConfig, tokens: int, nbytes: Callable[[jax.Array], int]
) -> float:
    """Bytes of the weights one device holds that a pass over `tokens` tokens need not read."""
    return common.unread_embedding_bytes(params, cfg.tie_word_embeddings, nbytes)


def check_divisible(cfg: DenseConfig, tp: int, model: str = "target") -> None:
    """Clear errors when heads or MLP columns do not split `tp` ways (any vocabulary does: padded)."""
    check_dims(cfg.dims, tp, model)


def heads_per_device(cfg: DenseConfig, tp: int) -> int:
    """Query heads one device holds."""
    return common.heads_per_device(cfg.dims.num_heads, tp)


def draft_dims(cfg: DenseConfig) -> LayerDims:
    """A DFlash drafter's layer for this target: its own layer shape, with q/k norms and at most 8 K/V
    heads (the published Qwen3 and Llama drafters')."""
    return dataclasses.replace(cfg.dims, qk_norm=True, num_kv_heads=min(cfg.dims.num_kv_heads, 8))


def _dims(hidden, ff, heads, kv_heads, head_dim, qk_norm) -> LayerDims:
    return LayerDims(hidden, ff, heads, kv_heads, head_dim, 1e-6, qk_norm)


def _shape(
    arch: str, vocab: int, layers: int, dims: LayerDims, rope: RopeConfig, max_pos: int, tied: bool = False
) -> DenseConfig:
    return DenseConfig(arch, vocab, layers, rope, tied, max_pos, dims=dims, fused_projections=True)


FAMILY = Family(
    name="dense",
    architectures={"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"},
    config_from_hf=config_from_hf,
    weight_specs=weight_specs,
    forward=forward,
    embed=common.embed,
    logits=common.logits,
    Entry=gqa.KVEntry,
    cache_shapes=cache_shapes,
    unread_weight_bytes=unread_weight_bytes,
    check_divisible=check_divisible,
    ignored_tensors=common.ignored_tensors,
    heads_per_device=heads_per_device,
    draft_dims=draft_dims,
    unfused=unfused,
    ATTENTION="gqa",
    PAD_ONE_ROW_AR=True,  # a one-row ar step runs as two rows: XLA's two-row matmuls read faster
    ROUTED_EXPERTS=False,  # dense layers: the default ddtree budgets of budgets.DEFAULT_BUDGETS
    CUDNN_PREFILL=True,
    SHAPES={
        "qwen3-8b": _shape(
            "qwen3", 151936, 36, _dims(4096, 12288, 32, 8, 128, True), RopeConfig(1e6, 128), 40960
        ),
        "llama-3.1-8b": _shape(
            "llama",
            128256,
            32,
            _dims(4096, 14336, 32, 8, 128, False),
            RopeConfig(5e5, 128, (8.0, 1.0, 4.0, 8192)),
            131072,
        ),
        "tiny": _shape("qwen3", 512, 4, _dims(64, 128, 4, 2, 16, True), RopeConfig(1e4, 16), 4096),
        # the bundled pair's target (assets/default_pair/target/config.json; its drafter: --draft-layers 2)
        "default-pair": _shape(
            "qwen3", 4096, 6, _dims(256, 1024, 4, 2, 64, True), RopeConfig(1e4, 64), 4096, tied=True
        ),
    },
)
