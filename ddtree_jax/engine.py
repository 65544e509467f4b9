"""The decoding engine: prefill, then rounds of draft -> tree build -> verify -> walk + commit.

One code path serves three methods (DESIGN.md, "One decoding round"):
  ar      the tree is the root alone (T = 1): plain autoregressive decoding
  dflash  the tree is a chain of the drafter's per-depth top-1 tokens (T = block_size)
  ddtree  the tree is the best `budget` nodes of the drafter's top-k lattice (T = budget + 1)
Every shape is static: one compiled program per `Plan`. `generate` runs the whole generation
(prefill and a `lax.while_loop` of rounds) as one jitted program; `HostStepper` calls the jitted
stages from Python and times each of them.

On a mesh of tp x dp devices (sharding.py) each program and stage is one `jax.shard_map` over the
("data", "model") mesh: every device runs the code below on its rows and its heads, columns and
vocabulary slice, with the collectives written out (`model_axis`); on one device there is no
shard_map and `model_axis` is None.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ddtree_jax import collectives, drafter, kv_cache, models, target, tree
from ddtree_jax.config import DraftConfig, TargetConfig
from ddtree_jax.kv_cache import KVCache, gather_slots
from ddtree_jax.sampling import SamplingParams, choose, tempered
from ddtree_jax.sharding import DATA, MODEL, make_mesh, param_sharding
from ddtree_jax.weights import Params, assemble

METHODS = ("ar", "dflash", "ddtree")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one compiled generation program."""

    target: TargetConfig
    draft: DraftConfig | None
    method: str
    batch_size: int  # the whole batch; each "data" device runs batch_size / dp rows
    prompt_len: int  # padded prompt length (bucket)
    max_new_tokens: int
    budget: int = 0  # ddtree: non-root tree nodes N
    branching: int = 1  # ddtree: candidates per depth k
    attention: str = "reference"
    draft_window: int | None = None
    tempered_draft: bool = False  # tree scores from the drafter's log-probs at each row's temperature
    tp: int = 1  # devices along "model": heads, MLP columns and vocabulary split
    dp: int = 1  # devices along "data": the batch split

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.method != "ar" and self.draft is None:
            raise ValueError(f"method {self.method!r} needs a drafter")
        if self.method == "ddtree" and self.budget < 1:
            raise ValueError("ddtree needs budget >= 1")
        if self.batch_size % self.dp:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by dp {self.dp}")

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
    def capacity(self) -> int:
        """S, cache slots per sequence: prompt, generated tokens and W spare slots, padded to 64."""
        need = self.prompt_len + self.max_new_tokens + self.path_slots
        return -(-need // 64) * 64

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs feed the drafter."""
        return () if self.method == "ar" else self.draft.target_layer_ids


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The whole decoding state of a batch; finished sequences keep theirs frozen."""

    cache: KVCache  # target K/V, lengths = committed tokens L_b
    draft_cache: KVCache | None  # drafter context K/V (same lengths), None for ar
    bonus: jax.Array  # [B] the target's last choice, not yet in the cache (the next root)
    output: jax.Array  # [B, max_new + W] generated tokens
    num_output: jax.Array  # [B]
    done: jax.Array  # [B] bool
    stopped: jax.Array  # [B] bool: finished on a stop id (else on the length limit)
    acceptance: jax.Array  # [B, max_new] tokens added by each round
    rounds: jax.Array  # [B]
    max_new_tokens: jax.Array  # [B] each row's own limit of new tokens (at most plan.max_new_tokens)
    sampling: SamplingParams | None = None  # None: greedy for every row (the greedy-only program)


def rows_to_run(method: str, rows: int, cfg: TargetConfig | None = None) -> int:
    """Rows per device a program runs for `rows` requested: one ar row runs as two (the second
    inactive), because XLA's one-row matmuls read the weights slower than its two-row ones (H200,
    Qwen3-8B shapes: 6.2-6.5 ms a step at one row, 5.0 ms at two; results/h200/README.md), unless
    the target's family says a second row costs more (`PAD_ONE_ROW_AR`: a MoE row reads its own experts)."""
    pad = cfg is None or models.family(cfg).PAD_ONE_ROW_AR
    return 2 if pad and method == "ar" and rows == 1 else rows


def _write_tokens(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    return jax.vmap(lambda row, n, s: jax.lax.dynamic_update_slice(row, n, (s,)))(buf, new, start)


def first_token(
    params: Params, last: jax.Array, prompt_lengths: jax.Array, sampling: SamplingParams | None, plan: Plan
) -> jax.Array:
    """The target's choice [B] after each prompt from its last hidden state [B, H]: the token at
    position L (the prompt's length), which is also its noise position (sampling.py)."""
    head = target.logits(params, last[:, None], plan.target.vocab_size, plan.model_axis)
    return choose(head, sampling, prompt_lengths[:, None], plan.model_axis)[:, 0]


def prefill(
    params: Params,
    draft_params: Params | None,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    active: jax.Array,
    stop_ids: jax.Array,
    sampling: SamplingParams | None = None,
    max_new_tokens: jax.Array | None = None,
    *,
    plan: Plan,
) -> DecodeState:
    """Run the right-padded prompts [B, P] (lengths [B]), fill both caches, choose the first token.

    The first token is the one at position L (the prompt's length): its noise position (sampling.py).
    `max_new_tokens` [B]: each row's own limit (None: plan.max_new_tokens for every row).
    """
    cfg, (b, p) = plan.target, prompts.shape  # b: this device's rows
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    causal = jnp.tril(jnp.ones((p, p), jnp.bool_))[None]
    mask = causal & (positions[:, None, :] < prompt_lengths[:, None, None])
    axis = plan.model_axis
    out = target.forward(
        params, cfg, prompts, positions, mask, None, feature_layers=plan.feature_layers, model_axis=axis
    )
    dtype = params["embed"].dtype
    cache = kv_cache.from_prefill(out.kv, plan.capacity, prompt_lengths)
    first = first_token(params, out.hidden[jnp.arange(b), prompt_lengths - 1], prompt_lengths, sampling, plan)

    draft_cache = None
    if plan.method != "ar":
        kv = drafter.context_kv(draft_params, plan.draft, out.features.astype(dtype), positions)
        draft_cache = kv_cache.from_prefill(kv, plan.capacity, prompt_lengths)

    return initial_state(cache, draft_cache, first, active, stop_ids, sampling, plan, max_new_tokens)


def row_limits(max_new_tokens: jax.Array | None, rows: int, plan: Plan) -> jax.Array:
    """Each row's limit of new tokens [rows]: the given ones, capped at the plan's (which sizes the
    cache and the output buffer), or the plan's for every row."""
    if max_new_tokens is None:
        return jnp.full((rows,), plan.max_new_tokens, jnp.int32)
    return jnp.minimum(max_new_tokens.astype(jnp.int32), plan.max_new_tokens)


def initial_state(
    cache: KVCache,
    draft_cache: KVCache | None,
    first: jax.Array,
    active: jax.Array,
    stop_ids: jax.Array,
    sampling: SamplingParams | None,
    plan: Plan,
    max_new_tokens: jax.Array | None = None,
) -> DecodeState:
    """The state after a prefill: caches filled, the first token [B] chosen (it is the next root);
    each row finishes at its own `max_new_tokens` [B] (None: the plan's)."""
    b = first.shape[0]
    stopped = active & jnp.isin(first, stop_ids)
    slots = plan.max_new_tokens + plan.path_slots
    limits = row_limits(max_new_tokens, b, plan)
    return DecodeState(
        cache=cache,
        draft_cache=draft_cache,
        bonus=first,
        output=jnp.zeros((b, slots), jnp.int32).at[:, 0].set(first),
        num_output=active.astype(jnp.int32),
        done=~active | stopped | (limits <= 1),
        stopped=stopped,
        acceptance=jnp.zeros((b, plan.max_new_tokens), jnp.int32),
        rounds=jnp.zeros((b,), jnp.int32),
        max_new_tokens=limits,
        sampling=sampling,
    )


def draft(params: Params, draft_params: Params, state: DecodeState, plan: Plan):
    """The drafter's per-depth top-k: log-probs and tokens [B, D, k], sorted descending (global ids,
    the same on every device of the "model" axis)."""
    logits = drafter.draft_logits(
        draft_params,
        plan.draft,
        params,
        state.bonus,
        state.draft_cache,
        attention=plan.attention,
        window=plan.draft_window,
        model_axis=plan.model_axis,
    )
    if plan.tempered_draft and state.sampling is not None:
        logits = tempered(logits, state.sampling)
    logp = collectives.log_softmax(logits, plan.model_axis)
    return collectives.top_k(logp, plan.branching, plan.model_axis)


def build(state: DecodeState, logp: jax.Array | None, tok: jax.Array | None, plan: Plan) -> tree.Tree:
    """The round's tree: the root alone (ar), a chain (dflash) or the lattice top-N (ddtree)."""
    if plan.method == "ar":
        return tree.chain_tree(state.bonus, jnp.zeros((state.bonus.shape[0], 0, 1), jnp.int32))
    if plan.method == "dflash":
        return tree.chain_tree(state.bonus, tok)
    return tree.lattice_tree(state.bonus, logp, tok, plan.budget)


def verify(params: Params, state: DecodeState, t: tree.Tree, plan: Plan):
    """One target pass over the tree: the target's choice at every node, the tree K/V and features.

    Node i sits at position L + depth[i] and chooses the token at L + depth[i] + 1.
    """
    positions = state.cache.lengths[:, None] + t.depth
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
    return choice, out.kv, out.features


def commit(
    draft_params: Params | None,
    state: DecodeState,
    t: tree.Tree,
    choice: jax.Array,
    kv: list,
    features: jax.Array | None,
    stop_ids: jax.Array,
    plan: Plan,
) -> DecodeState:
    """Walk the tree with the target's choices, then commit the accepted path of every live sequence."""
    w = tree.walk(t, choice, plan.depth)
    b, slots = state.bonus.shape[0], plan.path_slots
    live = ~state.done
    in_path = jnp.arange(slots)[None, :] < w.length[:, None]
    is_stop = jnp.isin(w.emitted, stop_ids) & in_path
    has_stop = jnp.any(is_stop, axis=-1)
    first_stop = jnp.argmax(is_stop, axis=-1)
    room = state.max_new_tokens - state.num_output
    n_emit = jnp.where(has_stop, first_stop + 1, w.length)
    n_emit = jnp.where(live, jnp.minimum(n_emit, room), 0)
    stopped_now = live & has_stop & (first_stop + 1 <= room)
    num_output = state.num_output + n_emit
    round_idx = jnp.minimum(state.rounds, plan.max_new_tokens - 1)
    old = state.acceptance[jnp.arange(b), round_idx]
    committed = jnp.where(live, w.length, 0)

    cache = kv_cache.write(state.cache, kv_cache.gather(kv, w.path), state.cache.lengths)
    cache.lengths = state.cache.lengths + committed
    draft_cache = None
    if state.draft_cache is not None:
        positions = state.cache.lengths[:, None] + jnp.arange(slots, dtype=jnp.int32)[None, :]
        path_features = gather_slots(features, w.path).astype(jax.tree.leaves(cache.layers)[0].dtype)
        ctx = drafter.context_kv(draft_params, plan.draft, path_features, positions)
        draft_cache = kv_cache.write(state.draft_cache, ctx, state.cache.lengths)
        draft_cache.lengths = cache.lengths
    return DecodeState(
        cache=cache,
        draft_cache=draft_cache,
        bonus=jnp.where(live, w.bonus, state.bonus),
        output=_write_tokens(state.output, w.emitted, state.num_output),
        num_output=num_output,
        done=state.done | stopped_now | (num_output >= state.max_new_tokens),
        stopped=state.stopped | stopped_now,
        acceptance=state.acceptance.at[jnp.arange(b), round_idx].set(jnp.where(live, n_emit, old)),
        rounds=state.rounds + live.astype(jnp.int32),
        max_new_tokens=state.max_new_tokens,
        sampling=state.sampling,
    )


def decode_round(
    params: Params, draft_params: Params | None, state: DecodeState, stop_ids: jax.Array, plan: Plan
) -> DecodeState:
    """One round: draft, build, verify, walk and commit."""
    logp = tok = None
    if plan.method != "ar":
        with jax.named_scope("draft"):
            logp, tok = draft(params, draft_params, state, plan)
    with jax.named_scope("tree_build"):
        t = build(state, logp, tok, plan)
    with jax.named_scope("verify"):
        choice, kv, features = verify(params, state, t, plan)
    with jax.named_scope("commit"):
        return commit(draft_params, state, t, choice, kv, features, stop_ids, plan)


def generate(
    params: Params,
    draft_params: Params | None,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    active: jax.Array,
    stop_ids: jax.Array,
    sampling: SamplingParams | None = None,
    max_new_tokens: jax.Array | None = None,
    *,
    plan: Plan,
) -> DecodeState:
    """The whole generation, prefill and every round, as one program (jit it with plan static).

    sampling None compiles the greedy-only program; otherwise each row samples with its own settings.
    max_new_tokens [B]: each row's own limit (None: the plan's).
    """
    state = prefill(
        params, draft_params, prompts, prompt_lengths, active, stop_ids, sampling, max_new_tokens, plan=plan
    )
    return jax.lax.while_loop(
        lambda s: jnp.any(~s.done),
        lambda s: decode_round(params, draft_params, s, stop_ids, plan),
        state,
    )


# -- on a mesh: shard_map specs of every argument and result -----------------------------------------

ROW = P(DATA)  # [B, ...]: rows split over "data", replicated over "model"
ALL = P()  # replicated (stop ids)


def param_specs(plan: Plan) -> tuple[Params, Params | P]:
    """PartitionSpec trees of the target's and the drafter's parameters (from their WeightSpecs)."""
    rules = param_sharding(make_mesh(plan.tp, plan.dp)).partition_spec
    target_specs = assemble(target.weight_specs(plan.target), rules)
    draft_specs = ALL if plan.draft is None else assemble(drafter.weight_specs(plan.draft), rules)
    return target_specs, draft_specs


def state_specs(plan: Plan) -> DecodeState:
    """PartitionSpecs of a DecodeState: everything by rows, cache entries as their type lays them out."""

    def cache(entry_type, num_layers: int) -> KVCache:
        return KVCache(layers=[entry_type.cache_spec()] * num_layers, lengths=ROW)

    return DecodeState(
        cache=cache(models.family(plan.target).Entry, plan.target.num_layers),
        draft_cache=None if plan.method == "ar" else cache(drafter.Entry, plan.draft.num_layers),
        bonus=ROW,
        output=ROW,
        num_output=ROW,
        done=ROW,
        stopped=ROW,
        acceptance=ROW,
        rounds=ROW,
        max_new_tokens=ROW,
        sampling=ROW,
    )


def on_mesh(fn, plan: Plan, in_specs, out_specs):
    """`fn(*args, plan=plan)`, run per device under shard_map when the plan spans several devices."""
    fn = functools.partial(fn, plan=plan)
    if plan.tp * plan.dp == 1:
        return fn
    mesh = make_mesh(plan.tp, plan.dp)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def generate_on_mesh(
    params: Params,
    draft_params: Params | None,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    active: jax.Array,
    stop_ids: jax.Array,
    sampling: SamplingParams | None = None,
    max_new_tokens: jax.Array | None = None,
    *,
    plan: Plan,
) -> DecodeState:
    """`generate` over the plan's mesh: params as placed, the batch split over "data"."""
    target_specs, draft_specs = param_specs(plan)
    in_specs = (target_specs, draft_specs, ROW, ROW, ROW, ALL, ROW, ROW)
    fn = on_mesh(generate, plan, in_specs, state_specs(plan))
    return fn(params, draft_params, prompts, prompt_lengths, active, stop_ids, sampling, max_new_tokens)


generate_jit = jax.jit(generate_on_mesh, static_argnames=("plan",))


class HostStepper:
    """The same round driven from Python, one jitted stage at a time, with per-stage wall times."""

    def __init__(self, plan: Plan):
        self.plan = plan
        params, dparams = param_specs(plan)
        state = state_specs(plan)
        kv = [models.family(plan.target).Entry.new_spec()] * plan.target.num_layers

        def stage(fn, in_specs, out_specs, donate=()):
            return jax.jit(on_mesh(fn, plan, in_specs, out_specs), donate_argnums=donate)

        self._prefill = stage(prefill, (params, dparams, ROW, ROW, ROW, ALL, ROW, ROW), state)
        self._draft = stage(draft, (params, dparams, state), (ROW, ROW))
        self._build = stage(build, (state, ROW, ROW), ROW)
        self._verify = stage(verify, (params, state, ROW), (ROW, kv, ROW))
        self._commit = stage(commit, (dparams, state, ROW, ROW, kv, ROW, ALL), state, donate=(1,))
        self.times: dict[str, list[float]] = defaultdict(list)
        self.compile_seconds = 0.0  # first call of each stage: compilation plus one run
        self._compiled: set[str] = set()

    def _timed(self, stage: str, fn, *args):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        elapsed = time.perf_counter() - start
        if stage in self._compiled:
            self.times[stage].append(elapsed)
        else:
            self._compiled.add(stage)
            self.compile_seconds += elapsed
        return out

    def round(self, params, draft_params, state: DecodeState, stop_ids) -> DecodeState:
        """One round, stage by stage, each stage's wall time appended to `times`."""
        logp = tok = None
        if self.plan.method != "ar":
            logp, tok = self._timed("draft", self._draft, params, draft_params, state)
        t = self._timed("tree_build", self._build, state, logp, tok)
        choice, kv, features = self._timed("verify", self._verify, params, state, t)
        return self._timed(
            "walk_commit", self._commit, draft_params, state, t, choice, kv, features, stop_ids
        )

    def run(
        self,
        params,
        draft_params,
        prompts,
        prompt_lengths,
        active,
        stop_ids,
        sampling=None,
        max_new_tokens=None,
    ):
        """Generate like `generate`, returning the same final state."""
        state = self._timed(
            "prefill",
            self._prefill,
            params,
            draft_params,
            prompts,
            prompt_lengths,
            active,
            stop_ids,
            sampling,
            max_new_tokens,
        )
        while not bool(np.all(jax.device_get(state.done))):
            state = self.round(params, draft_params, state, stop_ids)
        return state
