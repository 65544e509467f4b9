"""Which plan a job runs next: the expected tokens per millisecond of each compiled plan (ar, ddtree at a
few budgets), from a cost table measured per device and the acceptance the job observes (issue 39).

No jax import: plain numpy over counts, so the choice is a deterministic function of the job's own tokens,
the rows it runs and the shipped table, never of a clock read during the job.

The acceptance model. A DFlash drafter gives one distribution per depth, the same whatever the path, so the
tree's nodes at depth d are ranks of the drafter's top-k at d. Let accept[d, c] be the probability that the
target's token at depth d + 1 is the drafter's rank-c candidate there, given that the walk reached depth d
(its rows sum to at most 1: the rest is "not among the top-k"). Siblings hold distinct tokens, so at most one
node per depth is accepted, and a node (c_1, ..., c_d) is on the accepted path with probability
prod_i accept[i - 1, c_i] (the depths taken as independent given the path: the model, not a fact). The
expected tokens a round commits (accepted nodes plus the bonus) are then 1 + the sum of that product over
the tree's nodes (`expected_length`), and the best-first tree of budget N is the N nodes of highest
product when the drafter's scores rank paths as the acceptance does.

The online estimate. After each round, for each row, the target's tokens at depths 1 .. min(a, D) are
known (a - 1 accepted and the bonus, a the acceptance length): their ranks among the drafter's top-k at
those depths are unbiased draws of accept[d, :] (the bonus's rank even when that node was not in the
tree). `AcceptanceCounts` keeps how often each rank was hit and how often it could have been seen (a plan
of branching k sees ranks < k), and `AcceptanceCounts.marginals` mixes them with a prior (the shipped
curve's fit) by a fixed weight.

What a job loop calls (`PlanChooser`; the plans are compiled programs, switched between rounds):
    chooser = PlanChooser(load_costs(device_kind, target_params), ("ar", "ddtree-3", "ddtree-7", "ddtree-15"),
                          curve_marginals("bundled-pair"))
    each round, or at each host sync (the plan stays fixed between syncs):
        plan = chooser.next_plan(rows, rounds)   # rows: active rows per device; rounds: until the next call
        ... run `plan`; after its walk, on the device:
        ranks, seen = tree.target_ranks(tok, walk.emitted, walk.length)   # tok: the draft's [B, D, k]
        hits, exposure = tree.rank_counts(ranks, seen, active, width=branching(plan))  # summed over rounds
        chooser.observe_counts(hits, exposure)   # or chooser.observe(ranks[active], seen[active]) per round
    chooser.used: rounds per plan (the summary's share of each). --budget / --method: no chooser.
Every input is a token count or a row count, so the plans chosen, and with them the tokens, repeat
exactly on a rerun and on --resume (given the same counts: keep `counts` with the job's state).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
from functools import lru_cache
from importlib import resources

import numpy as np

MAX_BRANCHING = 32  # ddtree's candidates per depth: min(budget, MAX_BRANCHING) (budgets.default_branching)
COSTS_FILE = "assets/plan_costs.json"
REFERENCE_DEVICE = "NVIDIA H200"  # the table a device without its own falls back to
REFERENCE_SHAPE = "qwen3-8b"  # the table a job of unknown size falls back to
# The bundled pair's greedy tokens per round by budget (mean_acceptance, 64 new tokens, batch 16, float32:
# results/default-pair-eval-greedy.json), and its 15-deep chain's (dflash).
BUNDLED_CURVE = {3: 2.533, 5: 2.888, 7: 3.083, 15: 3.440, 31: 3.733, 63: 3.969, 127: 4.235, 255: 4.383}
BUNDLED_CHAIN = 2.702
DEPTH = 15  # the bundled drafter's depths (block 16 - 1), also the Qwen3-8B DFlash drafter's


# ---------------------------------------------------------------- plans


ROOT_ONLY = "root-only"  # ddtree at budget 0 (engine.Plan.root_only), a choosing job's plan without a draft


def plan_name(method: str, budget: int = 0) -> str:
    """'ar', 'dflash', 'ddtree-N' or 'root-only': one name per compiled plan (the cost table's keys, the
    summary's). ddtree at budget 0 (engine.Plan.root_only: an ar step that keeps the drafter's context)
    is 'root-only': its tokens are ar's, its cost the table's ar row plus the context projection
    (`with_projection`)."""
    if method != "ddtree":
        return method
    return f"ddtree-{budget}" if budget else ROOT_ONLY


def parse_plan(name: str) -> tuple[str, int]:
    """plan_name's inverse: 'ddtree-7' -> ('ddtree', 7), 'root-only' -> ('ddtree', 0), 'ar' -> ('ar', 0)."""
    if name == ROOT_ONLY:
        return "ddtree", 0
    method, _, budget = name.partition("-")
    return method, int(budget or 0)


def branching(name: str) -> int:
    """The drafter candidates per depth of a plan: min(budget, 32) for ddtree, 1 for dflash, 0 for ar."""
    method, budget = parse_plan(name)
    return min(budget, MAX_BRANCHING) if method == "ddtree" else int(method == "dflash")


# ---------------------------------------------------------------- the acceptance model


def best_first_nodes(scores: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """The `budget` lattice nodes (rank paths) of highest summed score, best first: scores [D, k] per-depth
    log-scores, each depth's ranks sorted descending. Ties: the shallower node, then the earlier pushed."""
    d_max, k = scores.shape
    heap: list[tuple[float, int, int, tuple[int, ...]]] = []
    pushed = 0
    for c in range(k):
        heapq.heappush(heap, (-float(scores[0, c]), 1, pushed, (c,)))
        pushed += 1
    nodes = []
    while heap and len(nodes) < budget:
        neg, depth, _, path = heapq.heappop(heap)
        nodes.append(path)
        if depth < d_max:
            for c in range(k):
                heapq.heappush(heap, (neg - float(scores[depth, c]), depth + 1, pushed, (*path, c)))
                pushed += 1
    return nodes


def expected_length(accept: np.ndarray, budget: int, scores: np.ndarray | None = None) -> float:
    """Expected tokens a round commits (accepted nodes + the bonus) with the best-first tree of `budget`
    nodes over accept [D, k] (module docstring); the tree ranked by `scores` [D, k] (default: log accept,
    a drafter whose scores rank paths as the acceptance does). Budget 0: ar, 1 token."""
    accept = np.asarray(accept, np.float64)
    if budget == 0:
        return 1.0
    with np.errstate(divide="ignore"):
        scores = np.log(accept) if scores is None else np.asarray(scores, np.float64)
    total = 1.0
    for path in best_first_nodes(scores, budget):
        total += float(np.prod(accept[np.arange(len(path)), list(path)]))
    return total


def chain_length(accept: np.ndarray) -> float:
    """Expected tokens a round of the DFlash chain (rank 0 at every depth) commits."""
    return 1.0 + float(np.sum(np.cumprod(np.asarray(accept, np.float64)[:, 0])))


def plan_tokens(name: str, accept: np.ndarray) -> float:
    """Expected tokens a round of plan `name` commits under accept [D, K] (K >= the plan's branching)."""
    method, budget = parse_plan(name)
    if method == "ar":
        return 1.0
    if method == "dflash":
        return chain_length(accept)
    return expected_length(np.asarray(accept)[:, : branching(name)], budget)


def geometric_marginals(top_mass: float, decay: float, ratio: float, depth: int = DEPTH) -> np.ndarray:
    """accept [depth, 32]: at depth d the target's token is among the top-32 with probability
    top_mass * decay^d, spread over the ranks geometrically (rank c gets a share ratio^c)."""
    share = ratio ** np.arange(MAX_BRANCHING)
    inside = top_mass * decay ** np.arange(depth)
    return inside[:, None] * (share / share.sum())[None, :]


def fit_geometric(curve: dict[int, float], chain: float | None = None, depth: int = DEPTH) -> tuple:
    """(top_mass, decay, ratio) of the geometric_marginals whose expected lengths come nearest (squared
    relative error) to `curve` {budget: tokens per round} and the chain's `chain`: a deterministic
    coarse-to-fine grid search (tens of seconds: the shipped fits are in plan_costs.json)."""

    def loss(p):
        a = geometric_marginals(*p, depth=depth)
        err = sum((plan_tokens(plan_name("ddtree", n), a) / t - 1) ** 2 for n, t in curve.items())
        return err + ((chain_length(a) / chain - 1) ** 2 if chain else 0.0)

    lo, hi = np.array([0.3, 0.5, 0.02]), np.array([0.999, 1.0, 0.95])
    best = (lo + hi) / 2
    for _ in range(5):
        grid = [np.linspace(lo[i], hi[i], 7) for i in range(3)]
        cands = [np.array(p) for p in np.stack(np.meshgrid(*grid, indexing="ij"), -1).reshape(-1, 3)]
        best = min(cands, key=loss)
        step = (hi - lo) / 6
        lo, hi = np.maximum(best - step, [0.01, 0.3, 0.01]), np.minimum(best + step, [0.9999, 1.0, 0.99])
    return tuple(round(float(x), 6) for x in best)


def curve_marginals(name: str, depth: int = DEPTH) -> np.ndarray:
    """accept [depth, 32] of a shipped acceptance curve (plan_costs.json "acceptance": its geometric fit)."""
    return geometric_marginals(*_cost_file()["acceptance"][name]["fit"], depth=depth)


# ---------------------------------------------------------------- costs


@dataclasses.dataclass(frozen=True)
class CostTable:
    """ms per round by plan and rows per device, for one device kind and model shape (plan_costs.json)."""

    device: str
    shape: str
    ms_per_round: dict[str, dict[int, float]]  # plan -> {rows: ms}

    def plans(self) -> tuple[str, ...]:
        """The plans this table has costs for."""
        return tuple(self.ms_per_round)

    def ms(self, plan: str, rows: int) -> float | None:
        """ms per round of `plan` at `rows` rows: piecewise linear in log2(rows) between measured rows,
        linear in rows past the last; None below the first measured rows or for an unmeasured plan."""
        points = sorted(self.ms_per_round.get(plan, {}).items())
        if not points or rows < points[0][0]:
            return None
        for (r0, m0), (r1, m1) in zip(points, points[1:], strict=False):
            if r0 <= rows <= r1:
                t = (math.log2(rows) - math.log2(r0)) / (math.log2(r1) - math.log2(r0))
                return m0 + t * (m1 - m0)
        if len(points) == 1:
            return points[0][1] if rows == points[0][0] else None
        (r0, m0), (r1, m1) = points[-2:]
        return m1 + (rows - r1) * (m1 - m0) / (r1 - r0)


@lru_cache(maxsize=1)
def _cost_file() -> dict:
    return json.loads(resources.files("ddtree_jax").joinpath(COSTS_FILE).read_text())


def load_costs(device_kind: str | None = None, target_params: float | None = None) -> CostTable:
    """The shipped cost table of `device_kind` (jax's device_kind, e.g. 'NVIDIA H200'; another device: the
    H200's, whose ratios between plans stand in) for the shape nearest `target_params` in log scale
    (None: Qwen3-8B's)."""
    devices = _cost_file()["devices"]
    device = device_kind if device_kind in devices else REFERENCE_DEVICE
    shapes = devices[device]
    if target_params is None:
        shape = REFERENCE_SHAPE if REFERENCE_SHAPE in shapes else next(iter(shapes))
    else:
        shape = min(shapes, key=lambda s: abs(math.log(shapes[s]["target_params"] / target_params)))
    table = {p: {int(r): float(m) for r, m in v.items()} for p, v in shapes[shape]["ms_per_round"].items()}
    return CostTable(device, shape, table)


def projection_share(target_cfg, draft_cfg, target_params: float) -> float:
    """What a root-only round (engine.Plan.root_only) reads beyond an ar step, as a share of the
    target's weights: the weights of the drafter's context projection of the root's features
    (drafter.context_kv), fc [F, H] (F = the feature layers x the target's hidden size) and its norm
    [H], then each draft layer's K and V projections [H, 2 x Hkv x Dh] (fused: "kv_proj", no query
    columns) and its K norm [Dh] where it has one (RoPE reads no weights). Decode steps at small rows are
    weight-bound, so an ar step's ms times (1 + this share) stands in for the round's cost."""
    d = draft_cfg.dims
    fc = len(draft_cfg.target_layer_ids) * target_cfg.hidden_size * d.hidden_size + d.hidden_size
    kv = 2 * d.hidden_size * d.num_kv_heads * d.head_dim + (d.head_dim if d.qk_norm else 0)
    return (fc + draft_cfg.num_layers * kv) / target_params


def with_projection(costs: CostTable, share: float) -> CostTable:
    """`costs` with a 'root-only' row: the 'ar' row scaled by 1 + `share` (projection_share), the cost
    of a choosing job's root-only rounds (an ar step and the drafter's context projection)."""
    if "ar" not in costs.ms_per_round:
        return costs
    table = dict(costs.ms_per_round)
    table[ROOT_ONLY] = {rows: ms * (1 + share) for rows, ms in table["ar"].items()}
    return CostTable(costs.device, costs.shape, table)


def with_stand_ins(costs: CostTable, plans: tuple[str, ...], anchor: str = "ddtree-7") -> CostTable:
    """`costs` with each plan of `plans` it lacks stood in for by the reference shape's (the H200's
    Qwen3-8B table) times this table's ratio to it on `anchor`, a plan both measured: at each row count
    of the reference's plan where both have the anchor, ms = ref[plan] * costs[anchor] / ref[anchor]. The
    bundled pair's table measures ar and ddtree 7 only; a tree's cost relative to another's is taken as
    the larger model's."""
    missing = [p for p in plans if p not in costs.ms_per_round]
    if not missing or anchor not in costs.ms_per_round:
        return costs
    ref = load_costs(REFERENCE_DEVICE)
    table = dict(costs.ms_per_round)
    for plan in missing:
        points = {}
        for rows in ref.ms_per_round.get(plan, {}):
            own, theirs = costs.ms(anchor, rows), ref.ms(anchor, rows)
            if own is not None and theirs:
                points[rows] = ref.ms_per_round[plan][rows] * own / theirs
        if points:
            table[plan] = points
    return CostTable(costs.device, costs.shape, table)


def job_costs(
    device_kind: str | None, target_cfg, draft_cfg, target_params: float, budgets: tuple[int, ...]
) -> tuple[tuple[str, ...], CostTable]:
    """The plans of a choosing job's `budgets` (0: root-only) and the table it prices them by: the device
    kind's shipped table of the nearest model size (load_costs), the plans it lacks stood in for
    (with_stand_ins), root-only rounds at the ar row times 1 + the drafter's context projection
    (with_projection, projection_share)."""
    plans = tuple(plan_name("ddtree", n) for n in budgets)
    share = projection_share(target_cfg, draft_cfg, target_params)
    return plans, with_projection(with_stand_ins(load_costs(device_kind, target_params), plans), share)


def priced_budgets(costs: CostTable, budgets: tuple[int, ...], rows: int) -> tuple[int, ...]:
    """The ddtree budgets of `budgets` (0: root-only) whose plan `costs` prices at some row count up to
    `rows`, the rows per device of a job (its active rows only fall below them): the budgets its chooser
    can ever choose. The table prices no plan below the plan's first measured rows (CostTable.ms): the
    H200 table's budget 3 from 16 rows."""
    first = {n: min(costs.ms_per_round.get(plan_name("ddtree", n), {}), default=rows + 1) for n in budgets}
    return tuple(n for n in budgets if first[n] <= rows)


# ---------------------------------------------------------------- the choice


def tokens_per_ms(costs: CostTable, rows: int, tokens: dict[str, float]) -> dict[str, float]:
    """Projected tokens per ms per row of each plan of `tokens` {plan: expected tokens a round} that has a
    cost at `rows` (a row commits tokens[plan] a round; the round serves all rows at once)."""
    out = {}
    for plan, t in tokens.items():
        ms = costs.ms(plan, rows)
        if ms is not None and ms > 0:
            out[plan] = t / ms
    return out


def best_plan(values: dict[str, float]) -> str:
    """The plan of highest value; ties: the first in the dict's order (the caller's plan order)."""
    return max(values, key=lambda p: (values[p], -list(values).index(p)))


def default_budget_table(
    costs: CostTable,
    curve: dict[int, float],
    budgets: tuple[int, ...] = (3, 7, 15),
    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
) -> dict[int, int]:
    """{rows: the ddtree budget of highest projected tokens/ms} at each of `rows`, from measured tokens
    per round `curve` {budget: tokens}, kept only where the budget changes (the budgets.py table form)."""
    table: dict[int, int] = {}
    for r in rows:
        values = tokens_per_ms(costs, r, {plan_name("ddtree", n): curve[n] for n in budgets if n in curve})
        if values:
            budget = parse_plan(best_plan(values))[1]
            if not table or table[max(table)] != budget:
                table[r] = budget
    return table


@dataclasses.dataclass
class AcceptanceCounts:
    """How often the target's token at each depth was the drafter's rank c (`hits` [D, K]) and how often
    rank c could have been seen there (`seen` [D, K]: observations by a plan of branching > c)."""

    hits: np.ndarray
    seen: np.ndarray

    @classmethod
    def empty(cls, depth: int = DEPTH, width: int = MAX_BRANCHING) -> AcceptanceCounts:
        """No observations yet."""
        return cls(np.zeros((depth, width), np.int64), np.zeros((depth, width), np.int64))

    def observe(self, ranks: np.ndarray, lengths: np.ndarray, width: int) -> None:
        """Add one round: ranks [R, D] the rank of the target's token at depth d + 1 among the drafter's
        top-`width` there (>= width: not among them), valid for d < lengths[r] (lengths [R]: min(a, D) with
        a the row's acceptance length; 0 for a row that ran no draft)."""
        ranks, lengths = np.asarray(ranks, np.int64), np.asarray(lengths, np.int64)
        d_max, k = self.hits.shape
        width = min(width, k)
        valid = np.arange(d_max)[None, :] < np.minimum(lengths, d_max)[:, None]  # [R, D]
        self.seen[:, :width] += valid.sum(axis=0)[:, None]
        hit = valid & (ranks[:, :d_max] < width)
        depth_idx = np.broadcast_to(np.arange(d_max), hit.shape)
        np.add.at(self.hits, (depth_idx[hit], ranks[:, :d_max][hit]), 1)

    def marginals(self, prior: np.ndarray, weight: float) -> np.ndarray:
        """accept [D, K]: each depth's observed rates shrunk by `weight` pseudo-observations towards a base.
        At the first depth the base is `prior`'s [D, K]; below, it continues the depth above: its estimate
        as it is, as far as that depth was observed (t = its observations / (them + weight)), else scaled by
        the prior's change between the two depths. So a depth the trees rarely reach takes the rates of the
        deepest well-observed one (a drafter's acceptance falls slowly with depth, or not at all, where the
        prior's would fall faster), and with no observations the estimate is the prior. A depth whose rates
        sum past 1 is scaled down to 1."""
        accept = np.zeros(self.hits.shape, np.float64)
        for d in range(self.hits.shape[0]):
            if d == 0:
                base = prior[0]
            else:
                t = self.seen[d - 1, 0] / (self.seen[d - 1, 0] + weight)
                scaled = prior[d] * accept[d - 1] / np.maximum(prior[d - 1], 1e-12)
                base = t * accept[d - 1] + (1 - t) * np.minimum(scaled, 1.0)
            rates = (self.hits[d] + weight * base) / (self.seen[d] + weight)
            accept[d] = rates / max(rates.sum(), 1.0)
        return accept


@dataclasses.dataclass
class PlanChooser:
    """The plan of each round: the one of highest projected tokens per ms (`tokens_per_ms` over
    `plan_tokens` of the estimated acceptance), with hysteresis: a switch needs `margin` better and
    `min_rounds` rounds in the current plan. The first `calibrate_rounds` rounds run the best plan that
    drafts (the start's calibration: acceptance is observed only where a draft runs); in ar or root-only,
    every `probe_every` rounds one round of the best drafting plan refreshes the counts. A deterministic
    function of the calls made on it (their rows and observations)."""

    costs: CostTable
    plans: tuple[str, ...]
    prior: np.ndarray  # [D, K] accept before any observation (fit_marginals of the shipped curve)
    prior_weight: float = 64.0
    margin: float = 0.03
    min_rounds: int = 16
    probe_every: int = 256
    calibrate_rounds: int = 4
    counts: AcceptanceCounts = None  # type: ignore[assignment]
    current: str | None = None
    rounds_in_plan: int = 0
    probing: bool = False
    used: dict[str, int] = dataclasses.field(default_factory=dict)  # rounds run per plan

    def __post_init__(self):
        if self.counts is None:
            self.counts = AcceptanceCounts.empty(*self.prior.shape)

    def projected(self, rows: int) -> dict[str, float]:
        """Projected tokens per ms per row of every plan with a cost at `rows`, from the current estimate."""
        accept = self.counts.marginals(self.prior, self.prior_weight)
        return tokens_per_ms(self.costs, rows, {p: plan_tokens(p, accept) for p in self.plans})

    def observe(self, ranks: np.ndarray, lengths: np.ndarray) -> None:
        """The round just run (by `current`): each row's target-token ranks and observed depths
        (AcceptanceCounts.observe); ar rounds observe nothing."""
        if self.current is not None and branching(self.current) > 0:
            self.counts.observe(ranks, lengths, branching(self.current))

    def observe_counts(self, hits: np.ndarray, exposure: np.ndarray, plan: str | None = None) -> None:
        """Rounds run by `plan` (default: `current`) since the last call, summed on the device
        (tree.rank_counts over those rounds: hits and exposure [D, K]); ar rounds observe nothing."""
        plan = self.current if plan is None else plan
        if plan is not None and branching(plan) > 0:
            self.counts.hits += np.asarray(hits, np.int64)
            self.counts.seen += np.asarray(exposure, np.int64)

    def next_plan(self, rows: int, rounds: int = 1) -> str:
        """The plan of the next `rounds` rounds (1: chosen every round; more: at a host sync) at `rows`
        active rows."""
        values = self.projected(rows)
        if not values:
            raise ValueError(f"no plan of {self.plans} has a cost at {rows} rows ({self.costs.shape})")
        best = best_plan(values)
        drafts = {p: v for p, v in values.items() if branching(p) > 0}
        current = self.current
        drafting = current is None or branching(current) > 0  # ar and root-only rounds draft nothing
        calibrating = sum(self.used.values()) < self.calibrate_rounds and bool(drafts)
        if calibrating:
            chosen = best_plan(drafts)
        elif current is None or current not in values or self.probing:
            chosen = best  # the first round, a plan without a cost here, or back from a probe: no hysteresis
        elif self.rounds_in_plan >= self.min_rounds and values[best] > values[current] * (1 + self.margin):
            chosen = best
        elif not drafting and self.rounds_in_plan >= self.probe_every and drafts:
            chosen = best_plan(drafts)
        else:
            chosen = current
        # after a probe or the calibration the next round chooses freely (no hysteresis)
        self.probing = calibrating or (not drafting and chosen != current and chosen != best)
        self.rounds_in_plan = self.rounds_in_plan + rounds if chosen == current else rounds
        self.current = chosen
        self.used[chosen] = self.used.get(chosen, 0) + rounds
        return chosen


# ---------------------------------------------------------------- a job simulated on the model


def tree_paths(name: str, accept: np.ndarray) -> set[tuple[int, ...]]:
    """The rank paths of plan `name`'s tree under accept [D, K] (the chain for dflash, none for ar)."""
    method, budget = parse_plan(name)
    if method == "ar":
        return set()
    if method == "dflash":
        return {(0,) * d for d in range(1, accept.shape[0] + 1)}
    with np.errstate(divide="ignore"):
        return set(best_first_nodes(np.log(accept[:, : branching(name)]), budget))


def sample_round(accept: np.ndarray, tree: set, rows: int, rng: np.random.Generator):
    """One round of `rows` rows on the model: the target's ranks [rows, D] drawn from accept [D, K]
    (K: not among the top-K) and each row's observed depths min(accepted depth + 1, D) [rows]."""
    d_max, k = accept.shape
    cdf = np.cumsum(np.concatenate([accept, 1 - accept.sum(axis=1, keepdims=True)], axis=1), axis=1)
    ranks = np.array(
        [[int(np.searchsorted(cdf[d], u)) for d, u in enumerate(rng.random(d_max))] for _ in range(rows)]
    )
    ranks = np.minimum(ranks, k)
    lengths = np.zeros(rows, np.int64)
    for r in range(rows):
        depth = 0
        while depth < d_max and tuple(ranks[r, : depth + 1]) in tree:
            depth += 1
        lengths[r] = min(depth + 1, d_max) if tree else 0
    return ranks, lengths


def simulate(
    costs: CostTable,
    plans: tuple[str, ...],
    accept: np.ndarray,
    prior: np.ndarray,
    rows: int,
    rounds: int = 300,
    seed: int = 0,
    observed_rows: int = 256,
) -> dict:
    """A job of `rows` rows for `rounds` rounds whose target accepts as accept [D, K] says, each round's
    plan chosen by a PlanChooser starting from `prior`, observing min(rows, observed_rows) rows a round
    (sampled with `seed`): its tokens per ms (the chosen plans' expected tokens over their costs) against
    the best fixed plan's, and the rounds each plan ran."""
    chooser = PlanChooser(costs, plans, prior)
    trees = {p: tree_paths(p, accept) for p in plans}
    truth = {p: plan_tokens(p, accept) for p in plans}
    fixed = tokens_per_ms(costs, rows, truth)
    rng = np.random.default_rng(seed)
    tokens = ms = 0.0
    for _ in range(rounds):
        plan = chooser.next_plan(rows)
        tokens, ms = tokens + truth[plan], ms + costs.ms(plan, rows)
        if branching(plan) > 0:  # ar observes nothing
            chooser.observe(*sample_round(accept, trees[plan], min(rows, observed_rows), rng))
    best = best_plan(fixed)
    return {
        "rows": rows,
        "chosen_tokens_per_ms": tokens / ms,
        "best_fixed_plan": best,
        "best_fixed_tokens_per_ms": fixed[best],
        "ratio": tokens / ms / fixed[best],
        "rounds_per_plan": dict(sorted(chooser.used.items())),
        "final_plan": chooser.current,
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m ddtree_jax.plan_choice`: the simulated choice against every fixed plan per rows and
    acceptance curve, as a markdown table on stdout and a JSON (--out)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--device", default=REFERENCE_DEVICE)
    ap.add_argument("--shape", default=REFERENCE_SHAPE, help="a shape of the device's cost table")
    ap.add_argument("--plans", default="ar,ddtree-3,ddtree-7,ddtree-15")
    ap.add_argument("--curves", default="bundled-pair,strong-synthetic", help="plan_costs.json acceptance")
    ap.add_argument("--prior", default="bundled-pair", help="the curve the chooser starts from")
    ap.add_argument("--rows", default="1,2,4,8,12,16,24,32,48,64,96,128,192,256")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--out", help="the JSON written")
    args = ap.parse_args(argv)
    shapes = _cost_file()["devices"][args.device]
    table = {
        p: {int(r): float(m) for r, m in v.items()} for p, v in shapes[args.shape]["ms_per_round"].items()
    }
    costs = CostTable(args.device, args.shape, table)
    plans = tuple(args.plans.split(","))
    prior = curve_marginals(args.prior)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    print(
        "| curve | rows | tokens/round of "
        + " / ".join(plans)
        + " | best fixed plan | chosen plans (rounds) "
        "| chosen / best tokens per ms |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for curve in args.curves.split(","):
        accept = curve_marginals(curve)
        tokens = {p: plan_tokens(p, accept) for p in plans}
        for rows in rows_list:
            out = simulate(costs, plans, accept, prior, rows, rounds=args.rounds) | {"curve": curve}
            out["tokens_per_round"] = tokens
            results.append(out)
            mix = ", ".join(f"{p} {n}" for p, n in out["rounds_per_plan"].items())
            print(
                f"| {curve} | {rows} | {' / '.join(f'{tokens[p]:.2f}' for p in plans)} | "
                f"{out['best_fixed_plan']} | {mix} | {out['ratio']:.3f} |"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": results}, f, indent=1)
    return 0 if all(r["ratio"] >= 0.95 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
