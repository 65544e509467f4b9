"""What a DFlash2 drafter adds to the DFlash block drafter (drafter.py): its weights, the grouped
dynamic causal convolutions, the sliding-window attention of its sliding layers, the logit transforms
and the candidate selector with its edge scores.

Written from the published descriptions (the checkpoint layout that vLLM and z-lab's reference load):

- Convolutions. Around each sublayer of a draft layer, `conv.prepare` convolves the sublayer's normed
  input and keeps a second dynamic kernel that `conv.finish` applies to the sublayer's output. Each is
  depthwise and causal within the block (the block's tokens only: the context never passes through
  them), with K taps whose weight per channel is a static `base_kernel[side, tap, channel]` plus a
  dynamic term shared by the channels of a group, projected from the token's own sublayer input:
  `kernel_projection(h)` viewed [2 (side), K (tap), H / group_size (group)].
- Selector. Per draft position d the top-K candidates of the draft logits (after `output_multiplier`
  and the soft cap) and, for every predecessor p of depth d - 1 (the bonus at depth 1) and candidate c,
  the edge score `unary[d, c] + <A[p] * (P h_d), B[c]>` with the predecessor and successor codebooks
  A, B [V, r] and the hidden projection P [H, r].

On a mesh everything this module adds is replicated (small: the codebooks are V x r); the candidates
come from the vocabulary-parallel top-k (global ids, the same on every device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.collectives import Axis
from ddtree_jax.config import DraftConfig
from ddtree_jax.models import gqa
from ddtree_jax.models.common import PADDED_LOGIT, rms_norm
from ddtree_jax.models.dense import mlp
from ddtree_jax.weights import Params, WeightSpec, linear

CONVS = ("attention_conv", "mlp_conv")


def weight_specs(cfg: DraftConfig) -> list[WeightSpec]:
    """The tensors a DFlash2 drafter adds to v1's, with their checkpoint names (the codebooks are stored
    without `.weight`); all replicated."""
    c, h = cfg.dflash2, cfg.dims.hidden_size
    groups = h // c.conv_group_size
    specs = []
    for i in range(cfg.num_layers):
        for conv in CONVS:
            name = f"layers.{i}.{conv}."
            specs.append(
                WeightSpec(
                    ("layers", i, conv, "base_kernel"),
                    name + "base_kernel",
                    (2, c.conv_kernel_size, h),
                    (None,) * 3,
                )
            )
            specs.append(
                linear(
                    ("layers", i, conv, "kernel_projection"),
                    name + "kernel_projection.weight",
                    h,
                    2 * c.conv_kernel_size * groups,
                    (None, None),
                )
            )
    sel = "candidate_selector."
    specs.append(
        linear(
            ("selector", "hidden_projection"),
            sel + "hidden_projection.weight",
            h,
            c.selector_rank,
            (None, None),
        )
    )
    for book in ("predecessor_codebook", "successor_codebook"):
        specs.append(
            WeightSpec(("selector", book), sel + book, (cfg.vocab_size, c.selector_rank), (None, None))
        )
    return specs


def convolve(x: jax.Array, dynamic: jax.Array, base: jax.Array, group_size: int) -> jax.Array:
    """Grouped dynamic causal convolution within the block: x [B, T, H], dynamic [B, T, K, G], base
    [K, H] -> [B, T, H], out[t] = sum_o (base[o] + dynamic[t, o, group]) * x[t - o] (zero before 0)."""
    b, t, h = x.shape
    taps, groups = base.shape[0], h // group_size
    blocks = x.reshape(b, t, groups, group_size)
    out = jnp.zeros_like(blocks)
    for o in range(taps):
        shifted = blocks if o == 0 else jnp.pad(blocks[:, : t - o], ((0, 0), (min(o, t), 0), (0, 0), (0, 0)))
        out = out + base[o].reshape(groups, group_size).astype(x.dtype) * shifted
        out = out + dynamic[:, :, o, :, None] * shifted
    return out.reshape(b, t, h)


def conv_prepare(p: Params, h: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    """The sublayer input h [B, T, H] convolved (side 0), and the dynamic kernel [B, T, K, G] that
    `conv_finish` applies to the sublayer's output (side 1)."""
    b, t, hidden = h.shape
    taps = p["base_kernel"].shape[1]
    dynamic = (h @ p["kernel_projection"]).reshape(b, t, 2, taps, hidden // group_size)
    return convolve(h, dynamic[:, :, 0], p["base_kernel"][0], group_size), dynamic[:, :, 1]


def conv_finish(p: Params, out: jax.Array, dynamic: jax.Array, group_size: int) -> jax.Array:
    """The sublayer output [B, T, H] convolved with `conv_prepare`'s second kernel (side 1)."""
    return convolve(out, dynamic, p["base_kernel"][1], group_size)


def decoder_layer(
    p: Params,
    x: jax.Array,
    cfg: DraftConfig,
    rope: tuple[jax.Array, jax.Array],
    attend: gqa.Attend,
    model_axis: Axis = None,
) -> jax.Array:
    """One DFlash2 draft layer over x [B, T, H], T a whole number of blocks of cfg.block_size (the
    convolutions run within each block): a v1 layer with `conv_prepare` / `conv_finish` around each
    sublayer. `attend` carries the layer's mask (causal, window)."""
    c, dims = cfg.dflash2, cfg.dims
    b, t, h = x.shape
    g = c.conv_group_size

    def blocks(y):  # [B, T, ...] -> [B * T / K, K, ...]
        return y.reshape(b * t // cfg.block_size, cfg.block_size, *y.shape[2:])

    def prepare(conv, y):
        y, dyn = conv_prepare(p[conv], blocks(y), g)
        return y.reshape(b, t, h), dyn

    def finish(conv, y, dyn):
        return conv_finish(p[conv], blocks(y), dyn, g).reshape(b, t, h)

    y, dyn = prepare("attention_conv", rms_norm(x, p["attn_norm"], dims.rms_norm_eps))
    out, _ = gqa.attention(p, y, dims, rope, attend, model_axis)
    x = x + finish("attention_conv", out, dyn)
    y, dyn = prepare("mlp_conv", rms_norm(x, p["mlp_norm"], dims.rms_norm_eps))
    return x + finish("mlp_conv", mlp(p, y, model_axis), dyn)


def sliding_attend(entry, lengths: jax.Array, mask: jax.Array, window: int):
    """attend(q, k_new, v_new) of a sliding layer: block token i at position L + i sees the keys at
    positions > L + i - window, cached (those of [0, L)) and in-flight (under `mask` [B, T, T]).

    Plain jnp over the last `window` cache slots of each row (gathered), float32 softmax.
    """

    def attend(q: jax.Array, k_new: jax.Array, v_new: jax.Array) -> jax.Array:
        b, t, hq, d = q.shape
        hkv = k_new.shape[2]
        g = hq // hkv
        span = min(window, entry.k.shape[2])
        slots = lengths[:, None] - span + jnp.arange(span, dtype=jnp.int32)[None, :]  # [B, W] positions
        safe = jnp.clip(slots, 0, entry.k.shape[2] - 1)
        k_c = jnp.take_along_axis(entry.k, safe[:, None, :, None], axis=2).astype(jnp.float32)
        v_c = jnp.take_along_axis(entry.v, safe[:, None, :, None], axis=2).astype(jnp.float32)
        qpos = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
        seen = (slots[:, None, :] >= 0) & (qpos[:, :, None] - slots[:, None, :] < window)  # [B, T, W]
        rel = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
        near = (rel < window) & (-rel < window)  # the block's own keys within the window both ways
        seen_new = mask.astype(bool) & near[None]
        qg = q.reshape(b, t, hkv, g, d).astype(jnp.float32) * d**-0.5
        s_c = jnp.einsum("bthgd,bhsd->bhgts", qg, k_c)
        s_n = jnp.einsum("bthgd,bjhd->bhgtj", qg, k_new.astype(jnp.float32))
        s_c = jnp.where(seen[:, None, None], s_c, -jnp.inf)
        s_n = jnp.where(seen_new[:, None, None], s_n, -jnp.inf)
        w = jax.nn.softmax(jnp.concatenate([s_c, s_n], axis=-1), axis=-1)
        out = jnp.einsum("bhgts,bhsd->bthgd", w[..., :span], v_c)
        out += jnp.einsum("bhgtj,bjhd->bthgd", w[..., span:], v_new.astype(jnp.float32))
        return out.reshape(b, t, hq, d).astype(q.dtype)

    return attend


def transform_logits(cfg: DraftConfig, logits: jax.Array) -> jax.Array:
    """The draft logits as the selector and proposals see them: times `output_multiplier`, then soft
    capped; padded vocabulary entries stay PADDED_LOGIT."""
    c = cfg.dflash2
    out = logits * c.output_multiplier if c.output_multiplier != 1.0 else logits
    if c.final_logit_softcapping is not None:
        cap = c.final_logit_softcapping
        out = jnp.where(logits <= PADDED_LOGIT / 2, PADDED_LOGIT, jnp.tanh(out / cap) * cap)
    return out


def edge_scores(
    params: Params, hidden: jax.Array, unary: jax.Array, cand: jax.Array, anchor: jax.Array
) -> jax.Array:
    """Selector scores of every edge [B, D, K (predecessor rank), K (candidate rank)] (float32).

    hidden [B, D, H] the final-normed draft states of depths 1..D; unary, cand [B, D, K] the top-K
    transformed logits and their token ids; anchor [B] the bonus token (every predecessor row of depth
    1 is the anchor's).
    """
    sel = params["selector"]
    k = cand.shape[-1]
    proj = jnp.matmul(hidden, sel["hidden_projection"], preferred_element_type=jnp.float32)  # [B, D, r]
    prev = jnp.concatenate(
        [jnp.broadcast_to(anchor[:, None, None], (anchor.shape[0], 1, k)), cand[:, :-1]], axis=1
    )
    a = sel["predecessor_codebook"][prev].astype(jnp.float32) * proj[:, :, None, :]  # [B, D, K, r]
    s = sel["successor_codebook"][cand].astype(jnp.float32)  # [B, D, K, r]
    return unary[:, :, None, :].astype(jnp.float32) + jnp.einsum("bdpr,bdcr->bdpc", a, s)


def chain(scores: jax.Array, cand: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The selector's greedy chain from the anchor: per depth the candidate of highest edge score from
    the previous pick (lowest rank on ties) -> tokens [B, D] and the chosen ranks [B, D]."""
    b, d_max, k = cand.shape
    rank = jnp.zeros((b,), jnp.int32)  # depth 1: every predecessor row is the anchor's
    ranks = []
    for d in range(d_max):
        row = jnp.take_along_axis(scores[:, d], rank[:, None, None], axis=1)[:, 0]  # [B, K]
        rank = jnp.argmax(row, axis=-1).astype(jnp.int32)
        ranks.append(rank)
    ranks = jnp.stack(ranks, axis=1)
    return jnp.take_along_axis(cand, ranks[..., None], axis=2)[..., 0], ranks
