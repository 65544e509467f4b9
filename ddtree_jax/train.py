"""Training: a Qwen3 target LM from scratch, and a DFlash drafter against a frozen target (optax).

Both losses are pure functions of float32 master weights; `Trainer` wraps one in AdamW with linear
warmup and cosine decay and a jitted step. The drafter's training forward (`draft_train_logits`)
runs many anchors of one sequence at once with a dense mask over [context ; blocks]; at inference
(drafter.py) the same computation goes through the K/V cache, and tests check that the two agree.

Needs the `train` extra (optax).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import dflash2, drafter, target
from ddtree_jax.config import DraftConfig, LayerDims, RopeConfig
from ddtree_jax.models.common import rms_norm, rope_tables
from ddtree_jax.models.dense import DenseConfig, decoder_layer
from ddtree_jax.weights import Params, WeightSpec, assemble

# -- configs and initialisation -----------------------------------------------------------------


def make_target_config(
    vocab_size: int,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    ff: int = 768,
    max_positions: int = 4096,
    rope_theta: float = 10000.0,
    eos_token_ids: tuple[int, ...] = (),
) -> DenseConfig:
    """A Qwen3 target with tied embeddings."""
    dims = LayerDims(hidden, ff, heads, kv_heads, head_dim, 1e-6, qk_norm=True)
    return DenseConfig(
        architecture="qwen3",
        vocab_size=vocab_size,
        num_layers=layers,
        dims=dims,
        rope=RopeConfig(rope_theta, head_dim),
        tie_word_embeddings=True,
        max_position_embeddings=max_positions,
        eos_token_ids=eos_token_ids,
    )


def make_draft_config(
    tcfg: DenseConfig,
    mask_token_id: int,
    layers: int = 1,
    block_size: int = 16,
    ff: int | None = None,
    target_layer_ids: tuple[int, ...] | None = None,
) -> DraftConfig:
    """A DFlash drafter shaped like the target's layers, on `target_layer_ids` (default: DFlash's)."""
    from ddtree_jax.config import default_target_layer_ids

    dims = dataclasses.replace(tcfg.dims, intermediate_size=ff or tcfg.dims.intermediate_size)
    return DraftConfig(
        num_layers=layers,
        dims=dims,
        rope=tcfg.rope,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=target_layer_ids or default_target_layer_ids(tcfg.num_layers, layers),
        vocab_size=tcfg.vocab_size,
    )


def init_params(specs: list[WeightSpec], seed: int, num_layers: int, std: float = 0.02) -> Params:
    """float32 training init: norms at 1, linears normal(std), residual outputs scaled by depth (GPT-2)."""
    keys = iter(jax.random.split(jax.random.key(seed), len(specs)))

    def make(spec: WeightSpec) -> jax.Array:
        key = next(keys)
        if spec.is_norm:
            return jnp.ones(spec.shape, jnp.float32)
        scale = std
        if spec.path[-1] in ("o_proj", "down_proj"):
            scale /= math.sqrt(2 * num_layers)
        return scale * jax.random.normal(key, spec.shape, jnp.float32)

    return assemble(specs, make)


def count_params(params: Params) -> int:
    """Number of scalars in a parameter pytree."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


# -- HF config.json ------------------------------------------------------------------------------


def _layer_fields(dims: LayerDims, rope: RopeConfig) -> dict[str, Any]:
    return {
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "head_dim": dims.head_dim,
        "rms_norm_eps": dims.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": rope.theta,
        "rope_scaling": None,
    }


def target_hf_config(cfg: DenseConfig, bos_token_id: int | None = None) -> dict[str, Any]:
    """config.json of a Qwen3ForCausalLM (bfloat16 weights)."""
    eos = list(cfg.eos_token_ids)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        **_layer_fields(cfg.dims, cfg.rope),
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.num_layers,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_token_id if bos_token_id is not None else (eos[0] if eos else None),
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
        "torch_dtype": "bfloat16",
    }


def draft_hf_config(cfg: DraftConfig, tcfg: DenseConfig) -> dict[str, Any]:
    """config.json of a z-lab DFlash drafter (no embedding, no lm_head: the target's are used); a DFlash2
    drafter's in the published layout (`DFlash2DraftModel`, its keys in `dflash_config`, explicit
    `is_causal` when every layer agrees, the sliding layers as HF's Qwen3Config reads them)."""
    out = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        **_layer_fields(cfg.dims, cfg.rope),
        "max_position_embeddings": tcfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "block_size": cfg.block_size,
        "num_target_layers": tcfg.num_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        "torch_dtype": "bfloat16",
    }
    c = cfg.dflash2
    if c is None:
        return out
    if c.causal != tuple(c.sliding) and len(set(c.causal)) > 1:
        raise ValueError("a DFlash2 config.json states is_causal for every layer or follows the layer types")
    out["architectures"] = ["DFlash2DraftModel"]
    out["dflash_config"] |= {
        "block_size": cfg.block_size,
        "conv_kernel_size": c.conv_kernel_size,
        "conv_group_size": c.conv_group_size,
        "selector_rank": c.selector_rank,
        "selector_top_k": c.selector_top_k,
        "input_embedding_scale": c.input_embedding_scale,
        "output_multiplier": c.output_multiplier,
        "final_logit_softcapping": c.final_logit_softcapping,
    }
    out["layer_types"] = ["sliding_attention" if x else "full_attention" for x in c.sliding]
    out["use_sliding_window"] = c.sliding_window is not None
    out["sliding_window"] = c.sliding_window
    if c.causal != tuple(c.sliding):
        out["is_causal"] = c.causal[0]
    return out


# -- target loss -----------------------------------------------------------------------------------


def causal_mask(batch: int, length: int) -> jax.Array:
    """[B, T, T] lower-triangular attention mask."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), jnp.bool_)), (batch, length, length))


def residual_dropout(key: jax.Array, rate: float, calls: int) -> Callable[[jax.Array], jax.Array]:
    """Inverted dropout at `rate` with a fresh key for each of up to `calls` calls (one forward)."""
    keys = list(jax.random.split(key, calls))

    def drop(x: jax.Array) -> jax.Array:
        if not keys:
            raise ValueError(f"residual_dropout: more than the {calls} calls it was made for")
        keep = jax.random.bernoulli(keys.pop(0), 1.0 - rate, x.shape)
        return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype))

    return drop


def target_loss(
    params: Params, cfg: DenseConfig, tokens: jax.Array, key: jax.Array | None = None, dropout: float = 0.0
) -> jax.Array:
    """Mean next-token cross-entropy of tokens [B, T + 1] (inputs tokens[:, :-1]); with `dropout` > 0
    (and a key), inverted dropout on the embeddings and every residual branch."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    b, t = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    drop = residual_dropout(key, dropout, 2 * cfg.num_layers + 1) if dropout > 0 else None
    out = target.forward(params, cfg, inputs, positions, causal_mask(b, t), None, dropout=drop)
    return cross_entropy(target.logits(params, out.hidden), labels).mean()


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-position cross-entropy [...] of float32 logits [..., V] against labels [...]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


# -- drafter training ------------------------------------------------------------------------------


def target_teacher(
    params: Params, cfg: DenseConfig, dcfg: DraftConfig, tokens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One frozen target pass over tokens [B, T]: features [B, T, F] of dcfg.target_layer_ids and
    the target's greedy choice [B, T] at every position (the token it predicts next)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = target.forward(
        params, cfg, tokens, positions, causal_mask(b, t), None, feature_layers=dcfg.target_layer_ids
    )
    greedy = jnp.argmax(target.logits(params, out.hidden), axis=-1).astype(jnp.int32)
    return jax.lax.stop_gradient(out.features), greedy


def block_inputs(tokens: jax.Array, anchors: jax.Array, dcfg: DraftConfig) -> tuple[jax.Array, jax.Array]:
    """Block tokens and positions [B, N * K]: per anchor a, [token at a, mask x (K-1)] at a..a+K-1."""
    b, n = anchors.shape
    k = dcfg.block_size
    first = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, N]
    block = jnp.full((b, n, k), dcfg.mask_token_id, jnp.int32).at[:, :, 0].set(first)
    positions = anchors[:, :, None] + jnp.arange(k, dtype=jnp.int32)[None, None, :]
    return block.reshape(b, n * k), positions.reshape(b, n * k)


def block_mask(context_len: int, anchors: jax.Array, block_size: int) -> jax.Array:
    """[B, N*K, L + N*K]: block n sees context positions < its anchor, and itself bidirectionally."""
    b, n = anchors.shape
    k = block_size
    ctx = jnp.arange(context_len)[None, None, :] < anchors[:, :, None]  # [B, N, L]
    ctx = jnp.repeat(ctx, k, axis=1)  # [B, N*K, L]
    which = jnp.repeat(jnp.arange(n), k)  # block of each slot
    own = which[:, None] == which[None, :]  # [N*K, N*K]
    return jnp.concatenate([ctx, jnp.broadcast_to(own, (b, n * k, n * k))], axis=-1)


def dense_attend(ctx_k: jax.Array, ctx_v: jax.Array, mask: jax.Array) -> Callable:
    """attend(q, k, v) over [context K/V ; the block's own K/V] under a dense mask [B, T, L + T]."""

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        b, t, hq, d = q.shape
        hkv = k.shape[2]
        keys = jnp.concatenate([ctx_k, k], axis=1).astype(jnp.float32)  # [B, L + T, Hkv, D]
        values = jnp.concatenate([ctx_v, v], axis=1).astype(jnp.float32)
        qg = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32) * d**-0.5
        scores = jnp.einsum("bthgd,bshd->bhgts", qg, keys)
        scores = jnp.where(mask[:, None, None], scores, -1e30)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhgts,bshd->bthgd", probs, values)
        return out.reshape(b, t, hq, d).astype(q.dtype)

    return attend


def draft_train_logits(
    params: Params,
    dcfg: DraftConfig,
    target_params: Params,
    features: jax.Array,
    tokens: jax.Array,
    anchors: jax.Array,
) -> jax.Array:
    """float32 logits [B, N, K - 1, V] of block slots 1..K-1 for N anchors [B, N] per sequence.

    features [B, L, F]: the target's features of tokens [B, L]; position p of the context is visible
    to an anchor a iff p < a, as at inference where the anchor is the bonus after a committed prefix.
    A DFlash2 drafter's logits come transformed as at inference (drafter.head_logits).
    """
    hidden = draft_train_hidden(params, dcfg, target_params, features, tokens, anchors)
    return drafter.head_logits(dcfg, target_params, hidden)


def draft_train_hidden(
    params: Params,
    dcfg: DraftConfig,
    target_params: Params,
    features: jax.Array,
    tokens: jax.Array,
    anchors: jax.Array,
) -> jax.Array:
    """The final-normed draft states [B, N, K - 1, H] of `draft_train_logits`."""
    b, n = anchors.shape
    k = dcfg.block_size
    ctx_positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    ctx_kv = drafter.context_kv(params, dcfg, features, ctx_positions)
    block, positions = block_inputs(tokens, anchors, dcfg)
    mask = block_mask(tokens.shape[1], anchors, k)
    rope = rope_tables(positions, dcfg.rope.inv_freq(), dcfg.rope.attention_factor)
    x = target.embed(target_params, block)
    c = dcfg.dflash2
    if c is not None and c.input_embedding_scale != 1.0:
        x = x * jnp.asarray(c.input_embedding_scale, x.dtype)
    for i, (p, (ck, cv)) in enumerate(zip(params["layers"], ctx_kv, strict=True)):
        if c is None:
            x, _ = decoder_layer(p, x, dcfg.dims, rope, dense_attend(ck, cv, mask))
        else:
            layer_mask = dflash2_mask(
                mask, positions, k, c.causal[i], c.sliding_window if c.sliding[i] else None
            )
            x = dflash2.decoder_layer(p, x, dcfg, rope, dense_attend(ck, cv, layer_mask))
    x = x.reshape(b, n, k, -1)[:, :, 1:]
    return rms_norm(x, params["norm"], dcfg.dims.rms_norm_eps)


def dflash2_mask(
    mask: jax.Array, positions: jax.Array, block_size: int, causal: bool, window: int | None
) -> jax.Array:
    """`block_mask` [B, N*K, L + N*K] for one DFlash2 layer: causal within each block, and with a
    window: the query at position q sees context positions > q - window and block slots within window."""
    b, t = positions.shape
    length = mask.shape[-1] - t
    slot = jnp.arange(t) % block_size
    rel = slot[:, None] - slot[None, :]  # [T, T] query slot - key slot (within one block where it counts)
    own = jnp.ones((t, t), jnp.bool_)
    if causal:
        own &= rel >= 0
    ctx = jnp.ones((b, t, length), jnp.bool_)
    if window is not None:
        own &= (rel < window) & (-rel < window)
        ctx = jnp.arange(length)[None, None, :] > positions[:, :, None] - window
    return mask & jnp.concatenate([ctx, jnp.broadcast_to(own, (b, t, t))], axis=-1)


def slot_weights(block_size: int, gamma: float | None) -> jax.Array:
    """[K-1] loss weights of slots 1..K-1: exp(-(j-1)/gamma) (DFlash's decay), normalised to mean 1."""
    j = jnp.arange(block_size - 1, dtype=jnp.float32)
    w = jnp.ones_like(j) if gamma is None else jnp.exp(-j / gamma)
    return w / w.mean()


def sample_anchors(key: jax.Array, batch: int, length: int, num_anchors: int, block_size: int) -> jax.Array:
    """[B, N] sorted distinct anchors in [1, L - K + 1]: each has context, its labels stay in range."""
    span = length - block_size + 1  # anchors 1..span
    scores = jax.random.uniform(key, (batch, span))
    _, idx = jax.lax.top_k(scores, num_anchors)
    return jnp.sort(idx, axis=-1).astype(jnp.int32) + 1


def label_mask(
    tokens: jax.Array,
    greedy: jax.Array,
    anchors: jax.Array,
    block_size: int,
    consistent: bool,
    greedy_anchors: bool,
) -> jax.Array:
    """[B, N, K-1] bool: which slots keep their label (slot j of anchor a: greedy[a + j - 1]).

    `consistent`: only if the target's greedy path from a reproduces tokens[a + 1 .. a + j - 1] (then
    the label is what the target would say at inference, where the committed tokens are its own).
    `greedy_anchors`: only if tokens[a] is the target's greedy choice (as the bonus is at inference).
    tokens, greedy [B, L]; anchors [B, N].
    """
    b, n = anchors.shape
    match = tokens[:, 1:] == greedy[:, :-1]  # [B, L-1]: position p's greedy choice is token p + 1
    match = jnp.pad(match, ((0, 0), (0, 1)))
    where = anchors[:, :, None] + jnp.arange(block_size - 1, dtype=jnp.int32)[None, None, :]  # a + j - 1
    keep = jnp.ones(where.shape, jnp.bool_)
    if consistent:
        m = jnp.take_along_axis(match, where.reshape(b, -1), axis=1).reshape(where.shape)
        keep = jnp.cumprod(jnp.concatenate([jnp.ones_like(m[..., :1]), m[..., :-1]], axis=-1), axis=-1)
    if greedy_anchors:
        keep = keep & jnp.take_along_axis(match, anchors - 1, axis=1)[..., None]
    return keep.astype(jnp.bool_)


def draft_loss(
    params: Params,
    dcfg: DraftConfig,
    target_params: Params,
    tcfg: DenseConfig,
    tokens: jax.Array,
    key: jax.Array,
    num_anchors: int,
    gamma: float | None,
    consistent: bool = False,
    greedy_anchors: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Weighted cross-entropy of the drafter against the target's greedy choices, and the top-1
    agreement per slot [K-1]. tokens [B, L]; labels of slot j of anchor a: greedy[a + j - 1], all of
    them, or with `consistent` / `greedy_anchors` those `label_mask` keeps: the loss is then the sum
    over kept labels over their count (deep slots, kept less often, weigh less)."""
    b, length = tokens.shape
    k = dcfg.block_size
    features, greedy = target_teacher(target_params, tcfg, dcfg, tokens)
    anchors = sample_anchors(key, b, length, num_anchors, k)
    hidden = draft_train_hidden(params, dcfg, target_params, features, tokens, anchors)
    logits = drafter.head_logits(dcfg, target_params, hidden)
    where = anchors[:, :, None] + jnp.arange(k - 1, dtype=jnp.int32)[None, None, :]  # [B, N, K-1]
    labels = jnp.take_along_axis(greedy, where.reshape(b, -1), axis=1).reshape(where.shape)
    keep = label_mask(tokens, greedy, anchors, k, consistent, greedy_anchors).astype(jnp.float32)
    weighted = cross_entropy(logits, labels) * slot_weights(k, gamma) * keep
    loss = weighted.sum() / jnp.maximum(keep.sum(), 1.0)
    if dcfg.dflash2 is not None and dcfg.dflash2.selector:
        first = jnp.take_along_axis(tokens, anchors, axis=1)  # the bonus of each block
        loss += selector_loss(params, dcfg, hidden, logits, first, labels, keep)
    hits = (jnp.argmax(logits, -1) == labels).astype(jnp.float32) * keep
    agree = hits.sum(axis=(0, 1)) / jnp.maximum(keep.sum(axis=(0, 1)), 1.0)
    return loss, agree


def selector_loss(
    params: Params,
    dcfg: DraftConfig,
    hidden: jax.Array,
    logits: jax.Array,
    first: jax.Array,
    labels: jax.Array,
    keep: jax.Array,
) -> jax.Array:
    """A DFlash2 selector's cross-entropy over the K candidates (this project's objective; no public
    training recipe states one): at slot j, the edge scores from the true predecessor (the label of slot
    j - 1; the block's bonus `first` [B, N] at slot 1) to the top-K candidates of the draft logits, and
    the label as the target class where it is among them. hidden [B, N, K-1, H], logits [B, N, K-1, V],
    labels, keep [B, N, K-1]; the mean over the kept slots whose label is a candidate."""
    unary, cand = jax.lax.top_k(logits, dcfg.dflash2.selector_top_k)  # [B, N, K-1, K]
    cand = jax.lax.stop_gradient(cand)
    prev = jnp.concatenate([first[:, :, None], labels[:, :, :-1]], axis=-1)  # [B, N, K-1]
    sel = params["selector"]
    proj = hidden @ sel["hidden_projection"]  # [B, N, K-1, r]
    pair = (sel["predecessor_codebook"][prev] * proj)[..., None, :] * sel["successor_codebook"][cand]
    scores = unary + pair.sum(-1)  # [B, N, K-1, K]
    hit = cand == labels[..., None]
    found = jnp.any(hit, axis=-1).astype(jnp.float32) * keep
    nll = -jnp.sum(jax.nn.log_softmax(scores, axis=-1) * hit, axis=-1)
    return jnp.sum(nll * found) / jnp.maximum(found.sum(), 1.0)


# -- the optimiser loop ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to `final_fraction` of the peak rate."""

    steps: int
    lr: float = 3e-3
    warmup: int = 100
    final_fraction: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    b2: float = 0.95


def make_optimizer(oc: OptimConfig):
    """optax AdamW (no decay on norms), global-norm clipping, warmup + cosine schedule."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, oc.lr, min(oc.warmup, max(oc.steps - 1, 1)), max(oc.steps, 2), oc.lr * oc.final_fraction
    )
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(oc.clip),
        optax.adamw(schedule, b2=oc.b2, weight_decay=oc.weight_decay, mask=decay_mask),
    ), schedule


class Trainer:
    """A jitted AdamW step over `loss_fn(params, batch, key) -> (loss, aux)` with float32 weights."""

    def __init__(self, loss_fn: Callable, params: Params, oc: OptimConfig):
        self.optimizer, self.schedule = make_optimizer(oc)
        self.params = jax.tree.map(jnp.copy, params)  # the step donates them: never the caller's arrays
        self.opt_state = self.optimizer.init(params)
        self.step_count = 0

        def step(params, opt_state, batch, key):
            import optax

            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, key)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, aux

        self._step = jax.jit(step, donate_argnums=(0, 1))

    def step(self, batch: jax.Array, key: jax.Array) -> tuple[float, Any]:
        """One update; returns the loss (a device scalar) and the aux output."""
        self.params, self.opt_state, loss, aux = self._step(self.params, self.opt_state, batch, key)
        self.step_count += 1
        return loss, aux


def target_trainer(cfg: DenseConfig, params: Params, oc: OptimConfig, dropout: float = 0.0) -> Trainer:
    """A Trainer of the target's next-token loss, with residual dropout at `dropout` (aux: nothing)."""
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"target dropout must be in [0, 1), got {dropout}")
    return Trainer(lambda p, tokens, key: (target_loss(p, cfg, tokens, key, dropout), ()), params, oc)


def draft_trainer(
    dcfg: DraftConfig,
    params: Params,
    target_params: Params,
    tcfg: DenseConfig,
    oc: OptimConfig,
    num_anchors: int,
    gamma: float | None,
    consistent: bool = False,
    greedy_anchors: bool = False,
    only: tuple[str, ...] = (),
) -> Trainer:
    """A Trainer of the drafter against the frozen target (aux: per-slot top-1 agreement); `only`: the
    top-level parameter groups that learn (e.g. ("selector",)), the rest held (no gradient; give the
    optimiser no weight decay to keep them exactly)."""

    def loss_fn(p, tokens, key):
        if only:
            p = {k: v if k in only else jax.lax.stop_gradient(v) for k, v in p.items()}
        return draft_loss(
            p, dcfg, target_params, tcfg, tokens, key, num_anchors, gamma, consistent, greedy_anchors
        )

    return Trainer(loss_fn, params, oc)


# -- data ------------------------------------------------------------------------------------------


def random_windows(stream: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """[batch, length] int32 windows at uniform random offsets of a token stream."""
    starts = rng.integers(0, len(stream) - length, size=batch)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int32)


_jit_target_loss = jax.jit(lambda p, t, cfg: target_loss(p, cfg, t), static_argnames="cfg")


def eval_target_loss(params: Params, cfg: DenseConfig, stream: np.ndarray, length: int, batch: int) -> float:
    """Mean next-token loss over the consecutive non-overlapping windows of `stream` that fit, in
    batches of at most `batch` windows (the last batch may be smaller)."""
    n = (len(stream) - 1) // length
    if n == 0:
        raise ValueError(f"eval_target_loss: {len(stream)} tokens hold no window of {length} + 1")
    windows = np.stack([stream[i * length : i * length + length + 1] for i in range(n)]).astype(np.int32)
    loss = functools.partial(_jit_target_loss, cfg=cfg)
    total = 0.0
    for i in range(0, n, batch):
        part = windows[i : i + batch]
        total += float(loss(params, jnp.asarray(part))) * len(part)
    return total / n
