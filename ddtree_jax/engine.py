"""One decoding round: draft -> build -> verify -> walk -> commit (docs/design.md, "One round, static
shapes, on the device").

One code path serves three methods:
  ar      the tree is the root alone (T = 1): plain autoregressive decoding
  dflash  the tree is a chain of the drafter's per-depth top-1 tokens (T = block_size)
  ddtree  the tree is the best `budget` nodes of the drafter's top-k lattice (T = budget + 1)
Every shape is static: `Plan` holds what a round compiles for; the batch's own shapes (rows, prompt
slots, cache capacity) live beside it in `programs.Shape`. The device programs that prefill a batch
and loop these rounds are in programs.py, the host loop that drives them in scheduler.py.

On a mesh of tp x dp devices (sharding.py) each program is one `jax.shard_map` over the ("data",
"model") mesh: every device runs the code below on its rows and its heads, columns and vocabulary
slice, with the collectives written out (`model_axis`); on one device there is no shard_map and
`model_axis` is None.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ddtree_jax import collectives, dflash2, drafter, kv_cache, logprobs, models, target, tree, tree_edges
from ddtree_jax.config import DraftConfig, TargetConfig
from ddtree_jax.kv_cache import KVCache, gather_slots
from ddtree_jax.logprobs import Logprobs
from ddtree_jax.sampling import SamplingArrays, choose, tempered
from ddtree_jax.sharding import DATA, MODEL, make_mesh, param_sharding
from ddtree_jax.weights import Params, assemble

METHODS = ("ar", "dflash", "ddtree")
# The round's steps in order: the one name of each in code, named scopes, benchmark and profile JSON,
# the --host-stepped summary, plots and docs.
STAGES = ("draft", "build", "verify", "walk", "commit")
MAX_STOP_IDS = 8  # stop ids a run holds (-1 pads)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a decoding round is compiled for (the batch's shapes are `programs.Shape`)."""

    target: TargetConfig
    draft: DraftConfig | None
    method: str
    max_new_tokens: int  # sizes the output buffer; each row may stop earlier (its own limit)
    budget: int = 0  # ddtree: non-root tree nodes N (0: root-only rounds, `root_only`)
    branching: int = 1  # ddtree: candidates per depth k
    attention: str = "reference"
    draft_window: int | None = None
    tempered_draft: bool = False  # tree scores from the drafter's log-probs at each row's temperature
    tp: int = 1  # devices along "model": heads, MLP columns and vocabulary split
    dp: int = 1  # devices along "data": the rows split
    logprobs: int = 0  # K: top log-probabilities kept per generated token (0: none computed)
    logprobs_mode: str = "raw"  # "raw" | "processed" (logprobs.py)
    # The draft stage in place of `draft` (same signature: -> logp, tok [B, D, k]); None: the drafter.
    # Part of the plan, so a round compiled with one stage is never reused for another (tests' oracle).
    draft_stage: Callable | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.method != "ar" and self.draft is None:
            raise ValueError(f"method {self.method!r} needs a drafter")
        if self.method == "ddtree" and self.budget < 0:
            raise ValueError("ddtree needs budget >= 0")
        if self.logprobs < 0 or self.logprobs_mode not in logprobs.MODES:
            raise ValueError(f"logprobs must be >= 0 and its mode one of {logprobs.MODES}")

    @property
    def root_only(self) -> bool:
        """ddtree at budget 0: no draft, the tree is the root alone (an ar step's verify of 1 token a
        row, its tokens), but the drafter's context K/V still grows from the target's features at the
        root, so the job's state is ddtree's and a later round at a real budget finds its context."""
        return self.method == "ddtree" and self.budget == 0

    @property
    def model_axis(self) -> str | None:
        """The mesh axis the model is split over inside shard_map, None when it is not split."""
        return MODEL if self.tp > 1 else None

    @property
    def depth(self) -> int:
        """D, the deepest tree level (0 for ar)."""
        return 0 if self.method == "ar" else self.draft.depth

    @property
    def tree_size(self) -> int:
        """T, tree tokens verified per round, root included."""
        return {"ar": 1, "dflash": self.depth + 1, "ddtree": self.budget + 1}[self.method]

    @property
    def path_slots(self) -> int:
        """W = D + 1: the most tokens one round can commit."""
        return self.depth + 1

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs feed the drafter."""
        return () if self.method == "ar" else self.draft.target_layer_ids

    def capacity(self, prompt_slots: int) -> int:
        """S, cache slots per row for prompts of `prompt_slots`: prompt, new tokens and W spare slots,
        padded to 64."""
        need = prompt_slots + self.max_new_tokens + self.path_slots
        return -(-need // 64) * 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The decoding state of B rows; finished rows keep theirs frozen."""

    cache: KVCache  # target K/V; lengths [B] = committed tokens L_b, the one length both caches read
    draft_cache: list | None  # drafter context K/V per draft layer at the same slots; None for ar
    bonus: jax.Array  # [B] the target's last choice, not yet in the cache (the next root)
    output: jax.Array  # [B, max_new + W] generated tokens
    num_output: jax.Array  # [B]
    done: jax.Array  # [B] bool
    stopped: jax.Array  # [B] bool: finished on a stop id (else on the length limit)
    acceptance: jax.Array  # [B, max_new] tokens added by each round
    rounds: jax.Array  # [B]
    max_new_tokens: jax.Array  # [B] each row's own limit of new tokens (at most plan.max_new_tokens)
    stop_ids: jax.Array  # [MAX_STOP_IDS] the run's stop ids (-1 pads), the same for every row
    sampling: SamplingArrays | None = None  # None: greedy for every row (the greedy-only program)
    logprobs: Logprobs | None = None  # [B, max_new + W] (top K: [B, max_new + W, K]); None: plan K = 0
    stops: jax.Array | None = None  # [B] bool: the stop ids end the row (ignore_eos: False); None: all do

    @property
    def lengths(self) -> jax.Array:
        """[B] committed tokens L_b."""
        return self.cache.lengths

    @property
    def draft_context(self) -> KVCache:
        """The drafter's context cache, read up to the committed lengths."""
        return KVCache(self.draft_cache, self.cache.lengths)


def draft(params: Params, draft_params: Params, state: DecodeState, plan: Plan):
    """The drafter's per-depth top-k: log-probs and tokens [B, D, k], sorted descending (global ids,
    the same on every device of the "model" axis). A DFlash2 drafter's selector: `draft_edges`."""
    if plan.draft.dflash2 is not None and plan.draft.dflash2.selector:
        return draft_edges(params, draft_params, state, plan)
    logits = drafter.draft_logits(
        draft_params,
        plan.draft,
        params,
        state.bonus,
        state.draft_context,
        attention=plan.attention,
        window=plan.draft_window,
        model_axis=plan.model_axis,
    )
    if plan.tempered_draft and state.sampling is not None:
        logits = tempered(logits, state.sampling)
    logp = collectives.log_softmax(logits, plan.model_axis)
    return collectives.sharded_top_k(logp, plan.branching, plan.model_axis)


def draft_edges(params: Params, draft_params: Params, state: DecodeState, plan: Plan):
    """A DFlash2 drafter's proposal through its candidate selector (dflash2.py): for ddtree the edge
    log-scores [B, D, K, K] (each predecessor's row normalised over the K candidates) and the
    candidates [B, D, K]; for dflash the selector's greedy chain as logp, tok [B, D, 1] (its edge
    log-scores, its tokens)."""
    hidden = drafter.draft_hidden(
        draft_params,
        plan.draft,
        params,
        state.bonus,
        state.draft_context,
        attention=plan.attention,
        window=plan.draft_window,
        model_axis=plan.model_axis,
    )
    logits = drafter.head_logits(plan.draft, params, hidden, plan.model_axis)
    unary, cand = collectives.sharded_top_k(logits, plan.draft.dflash2.selector_top_k, plan.model_axis)
    scores = dflash2.edge_scores(draft_params, hidden, unary, cand, state.bonus)  # [B, D, K, K]
    if plan.method == "dflash":
        tok, ranks = dflash2.chain(scores, cand)
        prev = jnp.concatenate([jnp.zeros_like(ranks[:, :1]), ranks[:, :-1]], axis=1)
        rows = jnp.take_along_axis(scores, prev[:, :, None, None], axis=2)[:, :, 0]  # [B, D, K]
        logp = jnp.take_along_axis(jax.nn.log_softmax(rows, axis=-1), ranks[..., None], axis=2)
        return logp, tok[..., None]
    if plan.tempered_draft and state.sampling is not None:
        b, d, k, _ = scores.shape
        scores = tempered(scores.reshape(b, d * k, k), state.sampling).reshape(b, d, k, k)
    return jax.nn.log_softmax(scores, axis=-1), cand


def build(state: DecodeState, logp: jax.Array | None, tok: jax.Array | None, plan: Plan) -> tree.Tree:
    """The round's tree: the root alone (ar, ddtree's root-only rounds), a chain (dflash) or the lattice
    top-N (ddtree); over a DFlash2 selector's edge log-scores (logp [B, D, K, K]) the best-first
    edge-score tree."""
    if plan.method == "ar" or plan.root_only:
        return tree.chain_tree(state.bonus, jnp.zeros((state.bonus.shape[0], 0, 1), jnp.int32))
    if plan.method == "dflash":
        return tree.chain_tree(state.bonus, tok)
    if logp.ndim == 4:
        return tree_edges.edge_tree(state.bonus, logp, tok, plan.budget)
    return tree.lattice_tree(state.bonus, logp, tok, plan.budget)


def verify(params: Params, state: DecodeState, t: tree.Tree, plan: Plan):
    """One target pass over the tree: the target's choice at every node [B, T], the tree's cache
    entries and its target features [B, T, F].

    Node i sits at position L + depth[i] and chooses the token at L + depth[i] + 1.
    """
    return verify_scored(params, state, t, plan)[:3]


def verify_scored(params: Params, state: DecodeState, t: tree.Tree, plan: Plan):
    """`verify`, and the Logprobs of every node's choice [B, T] (None when the plan keeps none)."""
    positions = state.lengths[:, None] + t.depth
    out = target.forward(
        params,
        plan.target,
        t.tokens,
        positions,
        t.mask,
        state.cache,
        feature_layers=plan.feature_layers,
        attention=plan.attention,
        model_axis=plan.model_axis,
    )
    head = target.logits(params, out.hidden, plan.target.vocab_size, plan.model_axis)
    choice = choose(head, state.sampling, positions + 1, plan.model_axis)
    scores = None
    if plan.logprobs:
        scores = logprobs.node_logprobs(
            head, choice, state.sampling, plan.logprobs, plan.logprobs_mode, plan.model_axis
        )
    return choice, out.kv, out.features, scores


def walk(t: tree.Tree, choice: jax.Array, plan: Plan) -> tree.Walk:
    """The accepted path of every row: from the root, the child whose token is the target's choice
    at its parent (tree.walk)."""
    return tree.walk(t, choice, plan.depth)


def project_context(
    draft_params: Params, state: DecodeState, w: tree.Walk, features: jax.Array, plan: Plan
) -> list:
    """The drafter's context cache with the accepted path's entries: its target features [B, W, F]
    projected by every draft layer, written at the path's slots L_b.. (those past the path are never
    read: the lengths stop before them). A root-only round's path is its root: one slot projected."""
    slots = 1 if plan.root_only else plan.path_slots
    positions = state.lengths[:, None] + jnp.arange(slots, dtype=jnp.int32)[None, :]
    dtype = jax.tree.leaves(state.draft_cache)[0].dtype
    path_features = gather_slots(features, w.path[:, :slots]).astype(dtype)
    ctx = drafter.context_kv(draft_params, plan.draft, path_features, positions)
    return kv_cache.write(state.draft_context, ctx, state.lengths).layers


def commit(
    draft_params: Params | None,
    state: DecodeState,
    w: tree.Walk,
    kv: list,
    features: jax.Array | None,
    plan: Plan,
    scores: Logprobs | None = None,
) -> DecodeState:
    """Commit every live row's accepted path: its tokens up to a stop id or the row's limit, its cache
    entries (target and drafter), its acceptance length, the Logprobs of its tokens (`scores` [B, T],
    the nodes'); the next root is the walk's bonus."""
    b, slots = state.bonus.shape[0], plan.path_slots
    live = ~state.done
    in_path = jnp.arange(slots)[None, :] < w.length[:, None]
    is_stop = jnp.isin(w.emitted, state.stop_ids) & in_path
    if state.stops is not None:  # rows that ignore the stop ids run on to their limit
        is_stop = is_stop & state.stops[:, None]
    has_stop = jnp.any(is_stop, axis=-1)
    first_stop = jnp.argmax(is_stop, axis=-1)
    room = state.max_new_tokens - state.num_output
    n_emit = jnp.where(has_stop, first_stop + 1, w.length)
    n_emit = jnp.where(live, jnp.minimum(n_emit, room), 0)
    stopped_now = live & has_stop & (first_stop + 1 <= room)
    num_output = state.num_output + n_emit
    round_idx = jnp.minimum(state.rounds, plan.max_new_tokens - 1)
    old = state.acceptance[jnp.arange(b), round_idx]

    path = w.path[:, :1] if plan.root_only else w.path  # (a root-only round writes its root alone)
    cache = kv_cache.write(state.cache, kv_cache.gather(kv, path), state.lengths)
    cache.lengths = state.lengths + jnp.where(live, w.length, 0)
    draft_cache = None
    if state.draft_cache is not None:
        draft_cache = project_context(draft_params, state, w, features, plan)
    kept = state.logprobs
    if scores is not None:
        kept = logprobs.write(kept, logprobs.at_path(scores, w.path), state.num_output)
    return dataclasses.replace(
        state,
        cache=cache,
        draft_cache=draft_cache,
        bonus=jnp.where(live, w.bonus, state.bonus),
        output=_write_tokens(state.output, w.emitted, state.num_output),
        num_output=num_output,
        done=state.done | stopped_now | (num_output >= state.max_new_tokens),
        stopped=state.stopped | stopped_now,
        acceptance=state.acceptance.at[jnp.arange(b), round_idx].set(jnp.where(live, n_emit, old)),
        rounds=state.rounds + live.astype(jnp.int32),
        logprobs=kept,
    )


def _write_tokens(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    return jax.vmap(lambda row, n, s: jax.lax.dynamic_update_slice(row, n, (s,)))(buf, new, start)


def decode_round(params: Params, draft_params: Params | None, state: DecodeState, plan: Plan) -> DecodeState:
    """One round: draft, build, verify, walk and commit, each under its named scope."""
    return walked_round(params, draft_params, state, plan)[0]


def walked_round(
    params: Params, draft_params: Params | None, state: DecodeState, plan: Plan
) -> tuple[DecodeState, jax.Array | None, tree.Walk]:
    """`decode_round`, and what its rows drafted (tok [B, D, k]; None for ar and root-only rounds) and
    walked: what a job that chooses its budget counts (tree.target_ranks)."""
    logp = tok = None
    if plan.method != "ar" and not plan.root_only:
        with jax.named_scope("draft"):
            logp, tok = (plan.draft_stage or draft)(params, draft_params, state, plan)
    with jax.named_scope("build"):
        t = build(state, logp, tok, plan)
    with jax.named_scope("verify"):
        choice, kv, features, scores = verify_scored(params, state, t, plan)
    with jax.named_scope("walk"):
        w = walk(t, choice, plan)
    with jax.named_scope("commit"):
        return commit(draft_params, state, w, kv, features, plan, scores), tok, w


# -- on a mesh: shard_map specs of every argument and result -----------------------------------------

ROW = P(DATA)  # [B, ...]: rows split over "data", replicated over "model"
ALL = P()  # replicated (stop ids, scalars)


def param_specs(plan: Plan) -> tuple[Params, Params | P]:
    """PartitionSpec trees of the target's and the drafter's parameters (from their WeightSpecs)."""
    rules = param_sharding(make_mesh(plan.tp, plan.dp)).partition_spec
    target_specs = assemble(target.weight_specs(plan.target), rules)
    draft_specs = ALL if plan.draft is None else assemble(drafter.weight_specs(plan.draft), rules)
    return target_specs, draft_specs


def state_specs(plan: Plan) -> DecodeState:
    """PartitionSpecs of a DecodeState: everything by rows (cache entries as their type lays them
    out), the stop ids replicated."""
    draft_cache = None
    if plan.method != "ar":
        draft_cache = [drafter.Entry.cache_spec()] * plan.draft.num_layers
    entry, count = models.cache_entry(plan.target)
    return DecodeState(
        cache=KVCache(layers=[entry.cache_spec()] * count, lengths=ROW),
        draft_cache=draft_cache,
        bonus=ROW,
        output=ROW,
        num_output=ROW,
        done=ROW,
        stopped=ROW,
        acceptance=ROW,
        rounds=ROW,
        max_new_tokens=ROW,
        stop_ids=ALL,
        sampling=ROW,
        logprobs=Logprobs(ROW, ROW, ROW) if plan.logprobs else None,
        stops=ROW,
    )


def walk_specs() -> tree.Walk:
    """PartitionSpecs of a Walk: by rows."""
    return tree.Walk(ROW, ROW, ROW, ROW)


def on_mesh(fn, plan: Plan, in_specs, out_specs):
    """`fn(*args, plan=plan)`, run per device under shard_map when the plan spans several devices."""
    fn = functools.partial(fn, plan=plan)
    if plan.tp * plan.dp == 1:
        return fn
    mesh = make_mesh(plan.tp, plan.dp)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
