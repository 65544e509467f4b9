"""Pieces every family shares: RMSNorm, RoPE, SwiGLU, the layers' all-reduce, embedding and head,
and the decoder stack that turns per-layer functions into a forward pass with drafter features.

Shapes: x [B, T, H]; positions [B, T] int32; per-head tensors [B, T, heads, D].
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.collectives import Axis, axis_size, psum, vocab_offset
from ddtree_jax.quant import arrays as quant_arrays
from ddtree_jax.weights import Params, WeightSpec, norm

# Checkpoint tensors a model of any family may carry and not use: RoPE's inverse frequencies, a
# buffer older checkpoints saved per layer (HF drops them on load too). Patterns for re.match.
IGNORED_TENSORS = (r".*\brotary_emb\.inv_freq$",)

# layer(i, p, x) -> (x, the layer's new cache entry): one decoder layer, closed over mask and cache.
Layer = Callable[[int, dict, jax.Array], tuple[jax.Array, Any]]


class ForwardOutput(NamedTuple):
    """hidden [B, T, H] after the final norm; per layer the new tokens' cache entry (the family's
    entry type, in-flight layout [B, T, ...]; under `scan_layers` one stacked entry of every layer,
    [B, T, L, ...]); features [B, T, F] (None without feature layers)."""

    hidden: jax.Array
    kv: list[Any]
    features: jax.Array | None


def ignored_tensors(cfg) -> tuple[str, ...]:
    """Checkpoint tensors the family may find and not load (checkpoint_checks): IGNORED_TENSORS."""
    return IGNORED_TENSORS


# Whether programs traced now keep the all-reduce after each layer's row-split projection (read by
# `all_reduce` at trace time; switched off only by `without_layer_all_reduce`).
_LAYER_ALL_REDUCE = contextvars.ContextVar("layer_all_reduce", default=True)


@contextlib.contextmanager
def without_layer_all_reduce(drop: bool = True) -> Iterator[None]:
    """Programs traced inside `with without_layer_all_reduce():` skip every layer's all-reduce: timing
    only, their outputs are wrong (`ddtree-bench rounds --drop-layer-all-reduce`: the all-reduce's cost
    is the difference to a run with it). `drop=False` changes nothing."""
    token = _LAYER_ALL_REDUCE.set(not drop and _LAYER_ALL_REDUCE.get())
    try:
        yield
    finally:
        _LAYER_ALL_REDUCE.reset(token)


def all_reduce(x: jax.Array, model_axis: Axis) -> jax.Array:
    """The all-reduce after a layer's row-split projection (o_proj, down_proj, the experts); every
    family calls it here. Skipped in programs traced inside `without_layer_all_reduce()`."""
    return psum(x, model_axis) if _LAYER_ALL_REDUCE.get() else x


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, scaled in the input dtype (as HF does)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def rope_tables(
    positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, D/2] in float32 for the given absolute positions, times `scale` (yarn's
    attention factor, `RopeConfig.attention_factor`, which HF multiplies cos and sin by)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    if scale == 1.0:
        return jnp.cos(freqs), jnp.sin(freqs)
    return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on [B, T, heads, D], in x's dtype."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def matmul(x: jax.Array, w) -> jax.Array:
    """x [..., in] @ w [in, out]: a plain array as `@` does, a quantized weight (quant.Fp8Weight,
    quant.Int4Weight) dequantised inside the computation (`quant.arrays.matmul`)."""
    return x @ w if isinstance(w, jax.Array) else quant_arrays.matmul(x, w)


def dense_weight(w, dtype: jnp.dtype) -> jax.Array:
    """A weight as an array: plain ones as they are, quantized ones dequantised to `dtype` (for code
    that reshapes the weight, e.g. MLA's kv_b_proj split per head)."""
    return w if isinstance(w, jax.Array) else quant_arrays.dequantize(w, dtype)


def swiglu(x: jax.Array, gate, up, down) -> jax.Array:
    """silu(x @ gate) * (x @ up) @ down, without any all-reduce: x [..., H] -> [..., H] (weights plain
    or quantized)."""
    return matmul(jax.nn.silu(matmul(x, gate)) * matmul(x, up), down)


def head_specs(vocab_size: int, hidden_size: int, tied: bool) -> list[WeightSpec]:
    """The embedding table, the final norm and (untied) lm_head with their HF names."""
    specs = [
        WeightSpec(("embed",), "model.embed_tokens.weight", (vocab_size, hidden_size), ("vocab", None)),
        norm(("norm",), "model.norm.weight", hidden_size),
    ]
    if not tied:
        specs.append(
            WeightSpec(
                ("lm_head",), "lm_head.weight", (hidden_size, vocab_size), (None, "vocab"), transpose=True
            )
        )
    return specs


def embed(params: Params, tokens: jax.Array, model_axis: Axis = None) -> jax.Array:
    """Token embeddings [B, T, H]; a vocabulary-split table: masked local lookup, then all-reduce."""
    table = params["embed"]
    if model_axis is None:
        return table[tokens]
    local = tokens - vocab_offset(table.shape[0], model_axis)
    here = (local >= 0) & (local < table.shape[0])
    rows = table[jnp.where(here, local, 0)]
    return psum(jnp.where(here[..., None], rows, jnp.zeros((), rows.dtype)), model_axis)


# The logit of a padded vocabulary entry: far below any real logit, and finite (also once divided by any
# temperature above 1e-8) so that no consumer meets inf - inf or 0 * inf (an entropy, a KL).
PADDED_LOGIT = -1e30


def logits(
    params: Params, hidden: jax.Array, vocab_size: int | None = None, model_axis: Axis = None
) -> jax.Array:
    """float32 logits [..., V] from final-normed hidden states (tied or untied lm_head).

    With the vocabulary split over devices, this device's slice [..., V_local] (collectives.py).
    A head padded past `vocab_size` (sharding.py pads it to a multiple of the "model" devices) gives
    its padded columns PADDED_LOGIT. Masking here, where logits are made, covers every consumer at
    once: the greedy argmax, the drafter's log-softmax and top-k, tempering, and top-k / top-p /
    Gumbel sampling all see padded entries as tokens of probability exactly 0 (exp underflows) that
    rank below every real one, so none of them needs the real vocabulary size and each stays
    identical to one device while top-k <= `vocab_size`. A top-k larger than that, or top-p keeping
    everything, keeps the padded entries too, but they lose the Gumbel argmax to every real token at
    any temperature below 1e28 (the noise spans less than 20; tempered, they sit below -1e30 / T).
    """
    if "lm_head" in params:
        out = jnp.matmul(hidden, params["lm_head"], preferred_element_type=jnp.float32)
    else:
        out = jnp.einsum("...h,vh->...v", hidden, params["embed"], preferred_element_type=jnp.float32)
    local = out.shape[-1]
    if vocab_size is None or local * axis_size(model_axis) == vocab_size:
        return out
    ids = vocab_offset(local, model_axis) + jnp.arange(local, dtype=jnp.int32)  # global ids of the columns
    return jnp.where(ids < vocab_size, out, PADDED_LOGIT)


def heads_per_device(num_heads: int, tp: int) -> int:
    """Query heads one device holds on `tp` model devices (all of them where they do not split)."""
    return num_heads // tp if num_heads % tp == 0 else num_heads


def unread_embedding_bytes(params: Params, tied: bool, nbytes: Callable[[jax.Array], int]) -> int:
    """Bytes of the embedding table a pass need not read: all of it when lm_head is separate (a pass
    gathers only its tokens' rows); `nbytes(x)`: the bytes of x this device holds."""
    return 0 if tied else nbytes(params["embed"])


def decoder_stack(
    params: Params,
    tokens: jax.Array,
    layer: Layer,
    eps: float,
    feature_layers: tuple[int, ...],
    model_axis: Axis,
    dropout: Callable[[jax.Array], jax.Array] | None,
) -> ForwardOutput:
    """Embed tokens [B, T], run `layer` over params["layers"], final norm; collect drafter features.

    `features` concatenates HF's `hidden_states[i + 1]` for i in `feature_layers` (what DFlash conditions
    on): the output of decoder layer i, except for the last layer, whose entry HF records after the
    final norm (the DDTree reference and z-lab's drafters read it so).
    """
    x = embed(params, tokens, model_axis)
    if dropout is not None:
        x = dropout(x)
    entries, feats = [], {}
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}"):
            x, entry = layer(i, p, x)
        entries.append(entry)
        feats[i] = x
    hidden = rms_norm(x, params["norm"], eps)
    feats[len(params["layers"]) - 1] = hidden  # HF's hidden_states[L] is the final norm's output
    features = jnp.concatenate([feats[i] for i in feature_layers], -1) if feature_layers else None
    return ForwardOutput(hidden, entries, features)


def scan_stack(
    params: Params,
    tokens: jax.Array,
    layer: Layer,
    eps: float,
    feature_layers: tuple[int, ...],
    model_axis: Axis,
) -> ForwardOutput:
    """`decoder_stack` as one `lax.scan` over stacked layers (params["layers"]: a dict of [L, ...]
    weights, `weights.stack_layers`): one layer traced and compiled whatever the depth.

    `layer(i, p, x)` gets a traced layer index i and layer i's weights. `kv` holds ONE entry: the
    layers' entries stacked on axis 2 (in flight [B, T, L, ...]); the family wraps it in its stacked
    entry type. The drafter features are written into a carried [B, T, F + 1, H] buffer at each
    feature layer's slot (other layers write the spare slot F), so no per-layer output is kept.
    """
    x = embed(params, tokens, model_axis)
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    spare = len(feature_layers)
    slots = np.full((num_layers,), spare, np.int32)
    for j, i in enumerate(feature_layers):
        slots[i] = j
    slots = jnp.asarray(slots)
    feats = jnp.zeros((*x.shape[:2], spare + 1, x.shape[-1]), x.dtype) if feature_layers else None

    def body(carry, xs):
        x, feats = carry
        i, p = xs
        x, entry = layer(i, p, x)
        if feats is not None:
            feats = jax.lax.dynamic_update_index_in_dim(feats, x, slots[i], 2)
        return (x, feats), entry

    (x, feats), entries = jax.lax.scan(body, (x, feats), (jnp.arange(num_layers, dtype=jnp.int32), stacked))
    hidden = rms_norm(x, params["norm"], eps)
    entries = jax.tree.map(lambda y: jnp.moveaxis(y, 0, 2), entries)  # [L, B, T, ...] -> [B, T, L, ...]
    features = None
    if feature_layers:
        # HF's hidden_states[L] is the final norm's output
        parts = [hidden if i == num_layers - 1 else feats[:, :, j] for j, i in enumerate(feature_layers)]
        features = jnp.concatenate(parts, -1)
    return ForwardOutput(hidden, [entries], features)
