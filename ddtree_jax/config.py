"""Model configurations from HF `config.json` files: the fields every target shares, the layer shape of
GQA layers, RoPE, the DFlash drafter; each family (models/) parses its own target fields with the
helpers here, and `models.load_target_config` picks the family of a checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ddtree_jax.errors import DDTreeError

if TYPE_CHECKING:
    from ddtree_jax.quant.formats import Scheme

YARN_SCALINGS = ("hf", "legacy")  # how yarn's cos/sin factor is derived when a config leaves it unset
# Drafters default to "legacy": the published Kimi-K2.5 DFlash drafter (yarn factor 64, mscale =
# mscale_all_dim = 1) was trained with cos/sin scaled by 1 + 0.1 ln 64 = 1.416 (older transformers);
# today's mscale ratio gives 1.0 and lowers its acceptance. A drafter config may say otherwise with
# `dflash_config.yarn_scaling` ("hf" or "legacy"); `load_draft_config(yarn_scaling=...)` overrides both.
DRAFT_YARN_SCALING = "legacy"


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN frequency interpolation (HF `rope_type: yarn`)."""

    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int
    truncate: bool = True

    def blend(self, inv: np.ndarray, theta: float, dim: int) -> np.ndarray:
        """HF's `_compute_yarn_parameters` frequencies from the plain ones `inv` [dim // 2], in float32."""

        def correction_dim(rotations: float) -> float:
            old = self.original_max_position_embeddings
            return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip(
            (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1
        )
        extrapolation = (1 - ramp).astype(np.float32)
        exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
        pos = np.float32(theta) ** exponents  # as HF forms it (inv = 1 / pos)
        interpolated = (1.0 / (np.float32(self.factor) * pos)).astype(np.float32)
        return (interpolated * (1 - extrapolation) + inv * extrapolation).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base theta, optional `llama3` or `yarn` frequency scaling, and the factor
    HF multiplies cos and sin by (`attention_factor`: 1 except under yarn)."""

    theta: float
    head_dim: int
    llama3: tuple[float, float, float, int] | None = None  # factor, low, high, original max positions
    yarn: Yarn | None = None
    attention_factor: float = 1.0

    def inv_freq(self) -> np.ndarray:
        """[head_dim // 2] float32 inverse frequencies, computed as HF does (float32)."""
        exponents = np.arange(0, self.head_dim, 2, dtype=np.int64).astype(np.float32) / self.head_dim
        inv = (1.0 / (np.float32(self.theta) ** exponents)).astype(np.float32)
        if self.yarn is not None:
            return self.yarn.blend(inv, self.theta, self.head_dim)
        if self.llama3 is None:
            return inv
        factor, low, high, old_len = self.llama3
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class LayerDims:
    """The shape of one decoder layer, shared by target and drafter layers."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qk_norm: bool  # Qwen3 normalises q and k per head before RoPE; Llama does not

    @property
    def group(self) -> int:
        """Query heads per K/V head (G)."""
        return self.num_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """The fields every target has, whatever its family; each family's config extends it (models/)
    with its layer shapes (GQA `dims`, MLA's latent dims, routed experts)."""

    architecture: str  # "qwen3" | "llama" | ...: picks the family (models.family_of)
    vocab_size: int
    num_layers: int
    rope: RopeConfig
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    quantization: Scheme | None = None  # how the checkpoint stores its weights (None: plain)
    # The decoder stack as one lax.scan over stacked per-layer weights and a stacked cache (compile time
    # independent of depth); dense family only (models.with_scan_layers). False: every layer unrolled.
    scan_layers: bool = False

    @property
    def hidden_size(self) -> int:
        """The width of the residual stream (what a drafter's features and embeddings have)."""
        raise NotImplementedError(f"{type(self).__name__} does not say its hidden size")


@dataclasses.dataclass(frozen=True)
class DFlash2Config:
    """What a DFlash2 drafter adds to v1 (`architectures: ["DFlash2DraftModel"]`): grouped dynamic
    causal convolutions around each sublayer, the candidate selector, per-layer sliding windows and
    causality, and the logit transforms (ddtree_jax/dflash2.py)."""

    conv_kernel_size: int  # taps K of both convolutions of a layer
    conv_group_size: int  # channels sharing one dynamic tap (H / conv_group_size groups)
    selector_rank: int  # r of the codebooks [V, r] and the hidden projection [H, r]
    selector_top_k: int  # candidates per draft position
    input_embedding_scale: float = 1.0  # the block's embeddings are multiplied by it
    output_multiplier: float = 1.0  # the draft logits are multiplied by it ...
    final_logit_softcapping: float | None = None  # ... then capped: tanh(x / cap) * cap
    sliding_window: int | None = None  # the window of the sliding layers
    sliding: tuple[bool, ...] = ()  # per draft layer: attends within `sliding_window`
    causal: tuple[bool, ...] = ()  # per draft layer: causal within the block (sliding_attention layers
    # are, unless the top-level `is_causal` says otherwise, window or not)
    selector: bool = True  # False: propose from the marginals alone, as v1 (the comparison's baseline)


DFLASH2_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A DFlash block-diffusion drafter (z-lab layout): Qwen3 layers conditioned on target features;
    `dflash2` set for a DFlash2 drafter."""

    num_layers: int
    dims: LayerDims
    rope: RopeConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    vocab_size: int
    target_architecture: str = "qwen3"  # the target's family gives the embedding and lm_head
    dflash2: DFlash2Config | None = None
    # k/v and gate/up each one weight, one matmul, q its own (drafter.weight_specs: the context K/V read
    # no query columns); False: HF's five weights. A drafter's config.json read gives True
    # (load_draft_config), a config made in code False.
    fused_projections: bool = False

    @property
    def depth(self) -> int:
        """D = block_size - 1: the deepest tree level the drafter proposes."""
        return self.block_size - 1


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object, naming the file in the error when it is missing or malformed."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise DDTreeError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise DDTreeError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise DDTreeError(f"{path}: expected a JSON object")
    return data


def positive_field(raw: dict[str, Any], name: str, path: Path, kind: type = int) -> Any:
    """raw[name], which must be a positive integer (an error names the file and field)."""
    if name not in raw:
        raise DDTreeError(f"{path}: missing field '{name}'")
    value = raw[name]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise DDTreeError(f"{path}: field '{name}' must be a positive integer, got {value!r}")
    return value


def rope_scaling(raw: dict[str, Any]) -> tuple[float, dict[str, Any], str]:
    """(theta, the scaling dict, its rope type) of an HF config, old (`rope_scaling`) or new layout."""
    # transformers >= 5 writes `rope_parameters`; older files have `rope_theta` / `rope_scaling`.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return float(theta), scaling, kind


def yarn_attention_factor(raw: dict[str, Any], scaling: dict[str, Any], yarn_scaling: str) -> float:
    """The factor yarn multiplies cos and sin by, when `attention_factor` is not given.

    "hf" (transformers >= 4.50, what HF's DeepSeek-V3 and Qwen3 code compute today): the mscale ratio
    mscale(f, mscale) / mscale(f, mscale_all_dim) when both are set (1.0 for DeepSeek-V3 and Kimi
    configs), else 0.1 ln f + 1. "legacy" (older transformers): 0.1 ln f + 1 whatever mscale says;
    the published Kimi-K2.5 DFlash drafter was trained so (config.DRAFT_YARN_SCALING).
    """
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = yarn_factor(raw, scaling)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if yarn_scaling == "hf" and mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_factor(raw: dict[str, Any], scaling: dict[str, Any]) -> float:
    """yarn's factor; when null, max_position_embeddings over the original (as HF does)."""
    if scaling.get("factor") is not None:
        return float(scaling["factor"])
    return raw["max_position_embeddings"] / scaling["original_max_position_embeddings"]


def hf_rope(raw: dict[str, Any], head_dim: int, path: Path, yarn_scaling: str = "hf") -> RopeConfig:
    """The rotary embedding of an HF config (default, llama3 or yarn scaling; `yarn_scaling`: how yarn's
    cos/sin factor is derived when the config does not give it, see `yarn_attention_factor`)."""
    theta, scaling, kind = rope_scaling(raw)
    if kind == "default":
        return RopeConfig(theta, head_dim)
    if kind == "yarn":
        if yarn_scaling not in YARN_SCALINGS:
            raise DDTreeError(f"yarn scaling must be one of {YARN_SCALINGS}, got {yarn_scaling!r}")
        yarn = Yarn(
            factor=yarn_factor(raw, scaling),
            beta_fast=float(scaling.get("beta_fast") or 32),
            beta_slow=float(scaling.get("beta_slow") or 1),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            truncate=bool(scaling.get("truncate", True)),
        )
        return RopeConfig(
            theta, head_dim, yarn=yarn, attention_factor=yarn_attention_factor(raw, scaling, yarn_scaling)
        )
    if kind != "llama3":
        raise DDTreeError(f"{path}: rope type '{kind}' is not supported (default, llama3 and yarn are)")
    llama3 = (
        float(scaling["factor"]),
        float(scaling["low_freq_factor"]),
        float(scaling["high_freq_factor"]),
        int(scaling["original_max_position_embeddings"]),
    )
    return RopeConfig(theta, head_dim, llama3)


def hf_dims(raw: dict[str, Any], path: Path, qk_norm: bool) -> LayerDims:
    """The attention and MLP shape of one layer of an HF config."""
    hidden = positive_field(raw, "hidden_size", path)
    heads = positive_field(raw, "num_attention_heads", path)
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    if heads % kv_heads:
        raise DDTreeError(
            f"{path}: num_attention_heads {heads} not a multiple of num_key_value_heads {kv_heads}"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise DDTreeError(f"{path}: '{flag}: true' is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise DDTreeError(f"{path}: hidden_act '{raw['hidden_act']}' is not supported (silu is)")
    return LayerDims(
        hidden_size=hidden,
        intermediate_size=positive_field(raw, "intermediate_size", path),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        qk_norm=qk_norm,
    )


def token_ids(value: Any) -> tuple[int, ...]:
    """An HF config's token id field (one id, a list of them, or null) as a tuple."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default: the middle layer for one draft layer, else evenly spaced over [1, L - 3]."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def load_draft_config(
    directory: str | Path, target: TargetConfig, yarn_scaling: str | None = None
) -> DraftConfig:
    """Parse a z-lab DFlash drafter `config.json` and check it fits the target.

    `yarn_scaling` ("hf" or "legacy"): how a yarn RoPE's cos/sin factor is derived when the config does
    not give `attention_factor`; None takes `dflash_config.yarn_scaling`, else DRAFT_YARN_SCALING.
    """
    path = Path(directory) / "config.json"
    raw = read_json(path)
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict) or "mask_token_id" not in dflash:
        raise DDTreeError(f"{path}: missing 'dflash_config.mask_token_id' (not a DFlash drafter?)")
    yarn_scaling = yarn_scaling or dflash.get("yarn_scaling") or DRAFT_YARN_SCALING
    dims = hf_dims(raw, path, qk_norm=True)
    num_layers = positive_field(raw, "num_hidden_layers", path)
    num_target_layers = int(raw.get("num_target_layers", target.num_layers))
    layer_ids = dflash.get("target_layer_ids") or default_target_layer_ids(num_target_layers, num_layers)
    block_size = dflash.get("block_size", raw.get("block_size"))  # the reference reads dflash_config first
    cfg = DraftConfig(
        num_layers=num_layers,
        dims=dims,
        rope=hf_rope(raw, dims.head_dim, path, yarn_scaling),
        block_size=positive_field(
            {} if block_size is None else {"block_size": block_size}, "block_size", path
        ),
        mask_token_id=int(dflash["mask_token_id"]),
        target_layer_ids=tuple(int(i) for i in layer_ids),
        vocab_size=target.vocab_size,
        target_architecture=target.architecture,
        dflash2=dflash2_config(raw, path, num_layers)
        if "DFlash2DraftModel" in raw.get("architectures", [])
        else None,
        fused_projections=True,
    )
    if dims.hidden_size != target.hidden_size:
        raise DDTreeError(
            f"{path}: hidden_size {dims.hidden_size} differs from the target's {target.hidden_size}"
        )
    if num_target_layers != target.num_layers:
        raise DDTreeError(
            f"{path}: num_target_layers {num_target_layers} but the target has {target.num_layers} layers"
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise DDTreeError(f"{path}: target_layer_ids {bad} outside the target's {target.num_layers} layers")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise DDTreeError(f"{path}: mask_token_id {cfg.mask_token_id} outside the vocabulary")
    if cfg.block_size < 2:
        raise DDTreeError(f"{path}: block_size must be at least 2")
    return cfg


def dflash2_config(raw: dict[str, Any], path: Path, num_layers: int) -> DFlash2Config:
    """The DFlash2 part of a drafter config.json: each key from `dflash_config`, else the top level (as
    the public reference reads them); the four DFLASH2_REQUIRED keys must be there.

    A "sliding_attention" layer (`layer_types`) attends within `sliding_window` when the config has
    `use_sliding_window`; every layer is causal within the block as the top-level `is_causal` says, and
    when that is absent exactly the "sliding_attention" layers are (the reference's rule)."""
    dflash = raw.get("dflash_config") or {}

    def value(name: str, default: Any = None) -> Any:
        return dflash.get(name, raw.get(name, default))

    missing = [name for name in DFLASH2_REQUIRED if value(name) is None]
    if missing:
        raise DDTreeError(f"{path}: a DFlash2 drafter needs 'dflash_config.{missing[0]}'")
    fields = {name: positive_field({name: value(name)}, name, path) for name in DFLASH2_REQUIRED}
    group, hidden = fields["conv_group_size"], raw["hidden_size"]
    if hidden % group:
        raise DDTreeError(f"{path}: conv_group_size {group} does not divide hidden_size {hidden}")
    # As HF's Qwen3Config (which the reference reads): a window only under use_sliding_window, and
    # without layer_types the layers from max_window_layers on slide.
    window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
    first_sliding = raw.get("max_window_layers", 28) if window is not None else num_layers
    types = raw.get("layer_types") or [
        "sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)
    ]
    if len(types) != num_layers:
        raise DDTreeError(f"{path}: {len(types)} layer_types for {num_layers} layers")
    sliding = tuple(t == "sliding_attention" for t in types)
    if window is not None and not (isinstance(window, int) and window > 0):
        raise DDTreeError(f"{path}: 'sliding_window' must be a positive integer, got {window!r}")
    is_causal = raw.get("is_causal")
    causal = sliding if is_causal is None else (bool(is_causal),) * num_layers
    softcap = value("final_logit_softcapping")
    return DFlash2Config(
        **fields,
        input_embedding_scale=float(value("input_embedding_scale", 1.0)),
        output_multiplier=float(value("output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap and float(softcap) > 0 else None,
        sliding_window=window,
        sliding=tuple(x and window is not None for x in sliding),
        causal=causal,
    )
