"""DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2 and the text model of Kimi-K2.5): MLA attention on a
latent cache (models/mla.py), dense SwiGLU layers below `first_k_dense_replace`, routed experts above.

The routed experts of a layer: sigmoid scores of a float32 router; experts are CHOSEN by score +
`e_score_correction_bias`, within the `topk_group` best of `n_group` groups (a group's score: the sum
of its two best biased scores), but WEIGHTED by the unbiased score, renormalised when `norm_topk_prob`
(+1e-20), times `routed_scaling_factor`; plus `n_shared_experts` shared experts (one SwiGLU of width
n_shared x moe_intermediate_size) on every token. The dispatch, expert stacking and expert parallelism
are models/moe.py's. The multi-token-prediction layer (model.layers.{num_hidden_layers}.*) is not read.

Kimi-K2.5-style wrappers (a top-level class with `text_config`, weights under `language_model.`) load
their text model; the vision tower is not loaded (a notice says so) and no input can reach it.

Quantized checkpoints as published (config `quantization_config`, ddtree_jax/quant): FP8 block-scaled
(DeepSeek-V3, Kimi-K2) and compressed-tensors INT4 routed experts (Kimi-K2.5/K2.6). Their weights stay
quantized on the device (quant.Fp8Weight / quant.Int4Weight, split like their bf16 counterparts); the
projections and the shared experts compute through `common.matmul`, the routed experts through
`moe.run_experts`, each dequantising inside the computation (`QUANTIZED_FORMATS` of its record; the
loader, models.load_target_config, refuses any other method by name).
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from ddtree_jax.collectives import Axis
from ddtree_jax.config import (
    LayerDims,
    RopeConfig,
    TargetConfig,
    Yarn,
    hf_rope,
    positive_field,
    rope_scaling,
    token_ids,
    yarn_factor,
    yarn_mscale,
)
from ddtree_jax.errors import DDTreeError
from ddtree_jax.models import common, dense, mla, moe
from ddtree_jax.models.common import ForwardOutput, all_reduce, rms_norm, rope_tables, swiglu
from ddtree_jax.models.family import Family
from ddtree_jax.quant import formats
from ddtree_jax.weights import Params, WeightSpec, linear


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(TargetConfig, moe.RoutedExperts):
    """A DeepSeek-V3 / Kimi-K2 target: the shared fields plus MLA's (`mla`), the dense layers' MLP width
    and the routed experts' (models/moe.py: grouped sigmoid routing, shared experts)."""

    mla: mla.MLADims = dataclasses.field(kw_only=True)
    intermediate_size: int = dataclasses.field(kw_only=True)  # the dense layers' MLP width
    norm_topk_prob: bool = dataclasses.field(default=True, kw_only=True)  # HF's default here
    first_k_dense_replace: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    weight_prefix: str = ""  # "language_model." for wrapped (Kimi-K2.5-style) checkpoints
    mtp_layers: int = 0  # num_nextn_predict_layers: layers after the decoder's, not read
    EXPERTS_FIELD: ClassVar[str] = "n_routed_experts"

    @property
    def hidden_size(self) -> int:
        """The width of the residual stream."""
        return self.mla.hidden_size

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes to experts (else a dense MLP)."""
        return layer >= self.first_k_dense_replace and self.num_experts > 0


def _text_config(raw: dict[str, Any], path: Path, arch: str) -> tuple[dict[str, Any], str]:
    """The DeepSeek-V3 text config of an HF config and the prefix of its weights."""
    if arch != "kimi_k25":
        return raw, ""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise DDTreeError(f"{path}: {raw.get('architectures')} without a 'text_config' (no text model?)")
    parts = [k for k in ("vision_config", "mm_projector_config") if k in raw]
    print(
        f"{path}: {raw['architectures'][0]}: loading the text model (weights 'language_model.*') only; "
        f"the vision parts ({', '.join(parts) or 'vision tower'}) are not supported and not loaded",
        file=sys.stderr,
    )
    return text, "language_model."


def _softmax_scale(raw: dict[str, Any], qk_head_dim: int) -> float:
    """(N + R) ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under yarn with mscale_all_dim set
    (HF's `yarn_apply_mscale`)."""
    scale = qk_head_dim**-0.5
    _, scaling, kind = rope_scaling(raw)
    if kind != "default" and scaling.get("mscale_all_dim"):
        m = yarn_mscale(yarn_factor(raw, scaling), float(scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


def _check_supported(raw: dict[str, Any], path: Path) -> None:
    """Clear errors for what this family does not implement."""
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise DDTreeError(f"{path}: scoring_func '{raw['scoring_func']}' is not supported (sigmoid is)")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise DDTreeError(f"{path}: '{flag}: true' is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise DDTreeError(f"{path}: hidden_act '{raw['hidden_act']}' is not supported (silu is)")


def config_from_hf(
    raw: dict[str, Any], path: Path, arch: str, eos: tuple[int, ...], moe_sharding: str = "ep", **_
) -> DeepseekV3Config:
    """The DeepSeek-V3 target of an HF config.json (`arch` "deepseek_v3" or the wrapper "kimi_k25")."""
    text, prefix = _text_config(raw, path, arch)
    _check_supported(text, path)
    heads = positive_field(text, "num_attention_heads", path)
    nope = positive_field(text, "qk_nope_head_dim", path)
    rope_dim = positive_field(text, "qk_rope_head_dim", path)
    dims = mla.MLADims(
        hidden_size=positive_field(text, "hidden_size", path),
        num_heads=heads,
        q_lora_rank=text.get("q_lora_rank"),
        kv_lora_rank=positive_field(text, "kv_lora_rank", path),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=positive_field(text, "v_head_dim", path),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_interleave=bool(text.get("rope_interleave", True)),
        softmax_scale=_softmax_scale(text, nope + rope_dim),
    )
    experts = text.get("n_routed_experts") or 0
    routed = moe.routed_fields(text, path, experts, True, moe_sharding, DeepseekV3Config.EXPERTS_FIELD)
    n_group = int(text.get("n_group") or 1)
    return DeepseekV3Config(
        architecture=arch,
        vocab_size=positive_field(text, "vocab_size", path),
        num_layers=positive_field(text, "num_hidden_layers", path),
        rope=hf_rope(text, rope_dim, path),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        max_position_embeddings=positive_field(text, "max_position_embeddings", path),
        eos_token_ids=eos or token_ids(text.get("eos_token_id")),  # a wrapper's top level may lack them
        mla=dims,
        intermediate_size=positive_field(text, "intermediate_size", path),
        **routed,
        first_k_dense_replace=int(text.get("first_k_dense_replace", 0)),
        n_shared_experts=int(text.get("n_shared_experts") or 0),
        n_group=n_group,
        topk_group=int(text.get("topk_group") or n_group),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        weight_prefix=prefix,
        mtp_layers=int(text.get("num_nextn_predict_layers") or 0),
    )


def ignored_tensors(cfg: DeepseekV3Config) -> tuple[str, ...]:
    """Checkpoint tensors left unread by design: the multi-token-prediction layers (model.layers.{L}..,
    which HF ignores too), a wrapper's parts outside its text model (Kimi-K2.5's vision tower and
    projector), and common.IGNORED_TENSORS."""
    pre = re.escape(cfg.weight_prefix)
    mtp = [rf"{pre}model\.layers\.{cfg.num_layers + i}\." for i in range(cfg.mtp_layers)]
    outside = [rf"(?!{pre})"] if cfg.weight_prefix else []
    return (*mtp, *outside, *common.IGNORED_TENSORS)


def moe_specs(prefix: str, path: tuple, cfg: DeepseekV3Config) -> list[WeightSpec]:
    """Router (+ its choice bias), stacked routed experts and the shared experts of one sparse layer."""
    h, mlp = cfg.hidden_size, prefix + "mlp."
    specs = moe.expert_specs(prefix, path, h, cfg.moe_intermediate_size, cfg.num_experts, cfg.moe_sharding)
    # HF keeps the router and its choice bias in float32 (`_keep_in_fp32_modules_strict`): a bf16 bias
    # (DeepSeek-V3's are of order 1 with small differences) would change which experts are chosen.
    specs = [dataclasses.replace(s, float32=True) if s.path[-1] == "router" else s for s in specs]
    bias = mlp + "gate.e_score_correction_bias"
    specs.append(WeightSpec((*path, "router_bias"), bias, (cfg.num_experts,), (None,), float32=True))
    if cfg.n_shared_experts:
        width, shared = cfg.n_shared_experts * cfg.moe_intermediate_size, mlp + "shared_experts."
        specs += [
            linear((*path, "shared_gate"), shared + "gate_proj.weight", h, width, (None, "ff")),
            linear((*path, "shared_up"), shared + "up_proj.weight", h, width, (None, "ff")),
            linear((*path, "shared_down"), shared + "down_proj.weight", width, h, ("ff", None)),
        ]
    return specs


def weight_specs(cfg: DeepseekV3Config) -> list[WeightSpec]:
    """Every target weight with its HF name (under `weight_prefix`); the MTP layer is left out."""
    pre = cfg.weight_prefix
    specs = [
        dataclasses.replace(s, hf_name=pre + s.hf_name)
        for s in common.head_specs(cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings)
    ]
    for i in range(cfg.num_layers):
        prefix, path = f"{pre}model.layers.{i}.", ("layers", i)
        specs += dense.norm_specs(prefix, path, cfg.hidden_size) + mla.attention_specs(prefix, path, cfg.mla)
        if cfg.is_sparse(i):
            specs += moe_specs(prefix, path, cfg)
        else:
            specs += dense.mlp_specs(prefix, path, cfg.hidden_size, cfg.intermediate_size)
    return specs


def route(p: dict, x: jax.Array, cfg: DeepseekV3Config) -> moe.Routing:
    """Grouped sigmoid routing of tokens x [N, H]: chosen experts [N, k] and their weights [N, k].

    Scores in float32 from the float32 router and bias (WeightSpec.float32). Ties: lower id first.
    """
    f32 = jnp.float32
    scores = jax.nn.sigmoid(jnp.matmul(x.astype(f32), p["router"].astype(f32), precision="highest"))
    choice = scores + p["router_bias"].astype(f32)
    if cfg.topk_group < cfg.n_group:
        n, per_group = choice.shape[0], cfg.num_experts // cfg.n_group
        grouped = choice.reshape(n, cfg.n_group, per_group)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, n_group]
        kept = jax.lax.top_k(group_score, cfg.topk_group)[1]  # [N, topk_group]
        keep = jnp.any(kept[:, :, None] == jnp.arange(cfg.n_group)[None, None, :], axis=1)
        choice = jnp.where(jnp.repeat(keep, per_group, axis=1), choice, -jnp.inf)
    experts = jax.lax.top_k(choice, cfg.experts_per_token)[1]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    return moe.Routing(experts.astype(jnp.int32), weights.astype(x.dtype))


def moe_ffn(p: dict, x: jax.Array, cfg: DeepseekV3Config, model_axis: Axis = None) -> jax.Array:
    """Routed plus shared experts of one sparse layer on normed x [B, T, H] -> [B, T, H], all-reduced."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    out = moe.run_experts(p, flat, route(p, flat, cfg), cfg.moe_sharding, model_axis, cfg.moe_dispatch)
    if cfg.n_shared_experts:
        out = out + swiglu(flat, p["shared_gate"], p["shared_up"], p["shared_down"])
    return all_reduce(out.reshape(shape), model_axis)


def decoder_layer(
    p: dict,
    x: jax.Array,
    cfg: DeepseekV3Config,
    rope: mla.Rope,
    attend: mla.Attend,
    ffn: Callable[[dict, jax.Array], jax.Array],
    model_axis: Axis = None,
    dropout: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, mla.LatentEntry]:
    """One pre-norm layer: MLA, then the dense MLP or the experts (`ffn`); the new latent entry."""
    branch = dropout or (lambda y: y)
    eps = cfg.mla.rms_norm_eps
    with jax.named_scope("attention"):
        out, entry = mla.attention(p, rms_norm(x, p["attn_norm"], eps), cfg.mla, rope, attend, model_axis)
        x = x + branch(out)
    with jax.named_scope("mlp"):
        x = x + branch(ffn(p, rms_norm(x, p["mlp_norm"], eps)))
    return x, entry


def forward(
    params: Params,
    cfg: DeepseekV3Config,
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
    """Run T new tokens [B, T] at `positions` over the latent `cache` (None: prefill, expanded form)
    under `mask` [B, T, T]; the new tokens' latent entries come back in `kv`."""
    rope = rope_tables(positions, cfg.rope.inv_freq(), cfg.rope.attention_factor)

    def dense_mlp(p: dict, h: jax.Array) -> jax.Array:
        return dense.mlp(p, h, model_axis)

    def experts(p: dict, h: jax.Array) -> jax.Array:
        return moe_ffn(p, h, cfg, model_axis)

    def layer(i: int, p: dict, x: jax.Array):
        attend = mla.layer_attend(attention, cache, i, mask, cfg.mla)
        ffn = experts if cfg.is_sparse(i) else dense_mlp
        return decoder_layer(p, x, cfg, rope, attend, ffn, model_axis, dropout)

    return common.decoder_stack(
        params, tokens, layer, cfg.mla.rms_norm_eps, feature_layers, model_axis, dropout
    )


def cache_shapes(
    cfg: DeepseekV3Config, batch: int, capacity: int, tp: int, dtype: jnp.dtype
) -> list[mla.LatentEntry]:
    """Global shapes of the latent cache (replicated over "model", whatever `tp`)."""
    return mla.cache_shapes(cfg.num_layers, cfg.mla, batch, capacity, dtype)


def unread_weight_bytes(
    params: Params, cfg: DeepseekV3Config, tokens: int, nbytes: Callable[[jax.Array], int]
) -> float:
    """The embedding table, plus each sparse layer's experts that `tokens` tokens are expected not to
    select (`moe.unread_expert_bytes`: uniform choice, which grouped routing only approximates)."""
    return common.unread_embedding_bytes(params, cfg.tie_word_embeddings, nbytes) + moe.unread_expert_bytes(
        params, cfg, tokens, nbytes
    )


def check_divisible(cfg: DeepseekV3Config, tp: int, model: str = "target") -> None:
    """Clear errors when heads, MLP columns, experts (ep) or expert widths (tp) do not split `tp` ways."""
    if tp == 1:
        return
    for field, n in {
        "num_attention_heads": cfg.mla.num_heads,
        "intermediate_size": cfg.intermediate_size,
    }.items():
        if n % tp:
            raise DDTreeError(f"--tp {tp}: the {model}'s {field} ({n}) is not divisible by {tp}")
    shared = {"shared experts' width": cfg.moe_intermediate_size * cfg.n_shared_experts}
    cfg.check_experts_divisible(tp, model, shared)


def heads_per_device(cfg: DeepseekV3Config, tp: int) -> int:
    """Query heads one device holds (the latent cache itself is whole on every device)."""
    return common.heads_per_device(cfg.mla.num_heads, tp)


def draft_dims(cfg: DeepseekV3Config) -> LayerDims:
    """A DFlash drafter's layer for this target where none is published (benchmarks): the target's
    width and dense MLP, its query heads of v_head_dim with at most 8 K/V heads (the Kimi-K2.5
    drafter's head counts are not published: assumed 64 query and 8 K/V heads of 128)."""
    heads = cfg.mla.num_heads
    return LayerDims(
        cfg.hidden_size,
        cfg.intermediate_size,
        heads,
        min(heads, 8),
        cfg.mla.v_head_dim,
        cfg.mla.rms_norm_eps,
        True,
    )


def _kimi_k2(num_layers: int) -> DeepseekV3Config:
    """Kimi-K2-Instruct's shape (MODELS.md) cut to `num_layers` layers: the first dense, the rest MoE."""
    yarn = Yarn(32.0, 1.0, 1.0, 4096)
    mscale = 0.1 * math.log(32.0) + 1  # mscale_all_dim 1: the softmax scale's factor (squared)
    return DeepseekV3Config(
        "deepseek_v3",
        163840,
        num_layers,
        RopeConfig(50000.0, 64, yarn=yarn),
        False,
        131072,
        mla=mla.MLADims(7168, 64, 1536, 512, 128, 64, 128, 1e-6, True, 192**-0.5 * mscale * mscale),
        intermediate_size=18432,
        first_k_dense_replace=1,
        num_experts=384,
        experts_per_token=8,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        routed_scaling_factor=2.827,
    )


FAMILY = Family(
    name="deepseek_v3",
    # Kimi-K2.5-style multimodal wrappers: their text model is loaded (`_text_config`)
    architectures={"DeepseekV3ForCausalLM": "deepseek_v3", "KimiK25ForConditionalGeneration": "kimi_k25"},
    config_from_hf=config_from_hf,
    weight_specs=weight_specs,
    forward=forward,
    embed=common.embed,
    logits=common.logits,
    Entry=mla.LatentEntry,
    cache_shapes=cache_shapes,
    unread_weight_bytes=unread_weight_bytes,
    check_divisible=check_divisible,
    ignored_tensors=ignored_tensors,
    heads_per_device=heads_per_device,
    draft_dims=draft_dims,
    ATTENTION="mla",
    # as for Qwen3-MoE: a second ar row would read up to experts_per_token more experts per layer
    PAD_ONE_ROW_AR=False,
    ROUTED_EXPERTS=True,  # the default ddtree budgets of budgets.MOE_DEFAULT_BUDGETS
    CUDNN_PREFILL=False,  # MLA: its prefill is the expanded form (models/mla.py)
    QUANTIZED_FORMATS=(formats.Fp8Block, formats.Int4Group),  # DeepSeek-V3/Kimi-K2 FP8, Kimi-K2.5 INT4
    SHAPES={
        # Kimi-K2 at 4 of its 61 layers (1 dense + 3 MoE) is the most that fits one H200 in bf16: 4.7 GB
        # of embedding and lm_head, 1.0 GB for the dense layer, 34.1 GB per MoE layer (384 experts of
        # 88 MB), 6.9 GB for a 6-layer drafter: 115 GB, against 139 GiB (149 GB); a fifth layer would
        # need 149 GB.
        "kimi-k2": _kimi_k2(4),
        "tiny-mla": dataclasses.replace(
            _kimi_k2(3),
            vocab_size=512,
            rope=RopeConfig(1e4, 16),
            mla=mla.MLADims(64, 4, 32, 32, 16, 16, 16, 1e-6, True, 32**-0.5),
            intermediate_size=128,
            num_experts=8,
            experts_per_token=2,
            moe_intermediate_size=16,
        ),
    },
)
