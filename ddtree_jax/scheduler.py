"""The host loop: prompts into the rows of a decode state, rounds on the device, results out.

Policies: `continuous` (the default) prompts enter shortest first and a row freed by a finished prompt
takes the next one between calls of the round loop, one prompt per "data" device per prefill; `static` runs
B prompts at a time in input order, each batch one program until its slowest row finishes (the
baseline). Either may be `host_stepped`: the rounds driven from the host one timed step at a time
(engine.STAGES). Several processes run the same loop on the same prompts; each gathers every row.

A run's shapes come from the WHOLE list of prompts: the rows, the prompt slots and capacity
(continuous: the longest prompt's; static: each batch's, cut from the whole list), the sampling
program or not, the order prompts enter rows. Prompts in `skip` (--resume: already written) keep their
place: continuous runs leave them out, static runs rerun a batch they share. A row then sees the shapes
of a run of every prompt, and its prefill depends on its prompt alone, so a resumed run reproduces an
uninterrupted one in bfloat16 too: rows never mix (every matmul, attention and sample is per row), but
for a mixture-of-experts target, whose dispatch groups every row's tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import attention, job, models, plan_choice
from ddtree_jax.budgets import ddtree_branching
from ddtree_jax.engine import MAX_STOP_IDS, DecodeState, Plan
from ddtree_jax.host_stepped import HostStepper
from ddtree_jax.programs import EVERY_ROUND, Programs, Shape, rows_to_run
from ddtree_jax.prompts import IGNORE_EOS, INCLUDE_STOP, LIMIT, LOGPROBS, SAMPLES, STOP, Prompt, sample_key
from ddtree_jax.requests import Requests, prompt_slots
from ddtree_jax.results import Result, device_outputs, fetch, row_result
from ddtree_jax.sampling import GREEDY, MAX_SEED, SamplingArrays
from ddtree_jax.stops import Stop, find_stop
from ddtree_jax.text import TextCodec
from ddtree_jax.weights import Params

POLICIES = ("continuous", "static")
QUEUE_BLOCK = 1024  # the most prompts per device one queue block holds (a larger job: several blocks)
FIRST_MOST = 32  # the device job's rounds per call at first; then sized to ~MOST_SECONDS a call
MOST_SECONDS = 0.25  # a call's wall time aimed at: the progress bar moves at least twice a second
OPTIONS = (*GREEDY, SAMPLES, STOP, INCLUDE_STOP, IGNORE_EOS)  # a prompt's own settings over the generator's
STOP_CHECK_ROUNDS = 1  # rounds between returns to the host while a row has stop strings
CHOICE_ROUNDS = 32  # the device job's rounds per call while it chooses its budget (Schedule.choice_rounds)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How prompts are scheduled onto the rows of a decode state."""

    batch_size: int = 8  # rows asked for (`Generator.rows`)
    policy: str = "continuous"
    host_stepped: bool = False  # rounds driven from the host, one timed step at a time
    chunk: int = 256  # C: prefill tokens per row per step (a power of two); the tail runs in C / 4
    refill_at: int = 1  # continuous: refill once this many rows are free (or none runs)
    # R: prompts prefilled together in one pass (at most the rows per device), and the device job's
    # rounds between harvests (a loop of static length on the device); None: by backend (job_defaults)
    prefill_slots: int | None = None
    stride: int | None = None
    device_loop: bool = True  # continuous: the whole job in one device program (job.py)
    batch_invariant: bool = False  # fixed rows and kernel splits: tokens independent of the batch
    # "same": the plan's attention; "cudnn": cuDNN flash attention where it applies (CUDA, bf16/f16,
    # GQA, not batch-invariant), else the plan's; or an implementation name (attention.kernel).
    prefill_attention: str = "same"
    # The ddtree budgets the continuous job on the device chooses among, call by call (--budget auto:
    # plan_choice.PlanChooser over the job's own acceptance counts and the shipped cost table); (): the
    # plan's budget throughout. Every budget gives the same tokens (float32; sampling is seeded by
    # position), so a choice changes the speed only.
    auto_budgets: tuple[int, ...] = ()
    # The rounds of each job call while it chooses (a fixed count, not sized from the time a call took:
    # the calls' boundaries, and with them the budgets chosen, repeat on a rerun)
    choice_rounds: int = CHOICE_ROUNDS

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.chunk < 16 or self.chunk & (self.chunk - 1):
            raise ValueError(f"the prefill chunk must be a power of two >= 16, got {self.chunk}")
        if min(self.batch_size, self.refill_at, self.prefill_slots or 1, self.stride or 1) < 1:
            raise ValueError("batch_size, refill_at, prefill_slots and stride must be >= 1")
        if self.choice_rounds < 1 or any(n < 0 for n in self.auto_budgets):
            raise ValueError("choice_rounds must be >= 1 and the budgets chosen among >= 0 (0: ar)")


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a prompt seeded `seed`: (seed + index * 0x9E3779B9) mod 2^32, so
    sample 0 keeps the prompt's seed (n = 1 is unchanged) and the samples' noise streams differ."""
    return (seed + index * 0x9E3779B9) % MAX_SEED


@dataclasses.dataclass
class Occupancy:
    """Row-rounds of continuous batching: how busy the rows were."""

    rounds: int = 0  # decode rounds run (each over every row of the state)
    row_rounds: int = 0  # rows x rounds
    busy: int = 0  # row-rounds spent on a live prompt
    waiting_row_rounds: int = 0  # row-rounds run while prompts waited for a row
    waiting_busy: int = 0  # of those, busy ones
    refills: int = 0  # prefill passes run (programs on the host loop; passes inside the device job)
    prefilled: int = 0  # prompts prefilled
    prefill_steps: int = 0  # steps of the device job's prefill passes (forwards of [R, C / 4] tokens)
    host_returns: int = 0  # device programs whose results the host waited for (round loops, job calls)

    def waiting_fraction(self) -> float:
        """The busy fraction of the row-rounds run while prompts waited (1 when none waited)."""
        return self.waiting_busy / self.waiting_row_rounds if self.waiting_row_rounds else 1.0


class Generator:
    """The models, the plan and a schedule; `run` generates for a list of prompts."""

    def __init__(
        self,
        params: Params,
        draft_params: Params | None,
        plan: Plan,
        stop_ids: tuple[int, ...],
        codec: TextCodec | None = None,
        defaults: dict | None = None,
        schedule: Schedule | None = None,
    ):
        self.plan, self.stop_ids, self.codec = plan, tuple(stop_ids), codec
        # the run's defaults (sampling settings and n samples); a prompt's own options override them
        base = {SAMPLES: 1, STOP: (), INCLUDE_STOP: False, IGNORE_EOS: False}
        self.defaults = GREEDY | base | (defaults or {})
        self.schedule = schedule or Schedule()
        impl = attention.invariant(plan.attention) if self.schedule.batch_invariant else plan.attention
        self.plan, self.dtype = dataclasses.replace(plan, attention=impl), params["embed"].dtype
        self.programs = Programs(params, draft_params, self.plan, self.schedule.chunk, self._prefill_impl())
        self.generate_seconds = 0.0
        self.warmup_seconds = 0.0  # the device job's warm-up calls, outside the generation (`_warm_up`)
        self.occupancy = Occupancy()
        self.stepper = HostStepper(self.programs, timed=self.schedule.host_stepped)
        self.rows_run = 0  # B of the last run
        self.loop = "device"  # where the last run's loop ran (`_loop`)
        # A job that chooses its budget (Schedule.auto_budgets): the chooser of each run (a test may put
        # another in), the programs of each budget, and the rounds each plan ran in the last run.
        self.make_chooser: Callable[[], plan_choice.PlanChooser] = self._chooser
        self.budget_programs: dict[int, Programs] = {}
        self.plan_rounds: dict[str, int] = {}

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling programs (kept apart from generation; each in `compile_log`), the
        other budgets' of a job that chooses included."""
        return sum(p.compile_seconds for p in self._all_programs())

    @property
    def stage_seconds(self) -> dict[str, float]:
        """Host-stepped runs: seconds per step of the round (and prefill), compilation left out."""
        return self.stepper.stage_seconds

    @property
    def compile_log(self) -> list[tuple[str, float]]:
        return [entry for p in self._all_programs() for entry in p.compile_log]

    @property
    def cache_hits(self) -> int:
        """Programs of `compile_log` read from the compile cache (executables.py)."""
        return sum(p.cache_hits for p in self._all_programs())

    def _all_programs(self) -> list[Programs]:
        """The plan's programs and those of the other budgets a choosing job ran."""
        return [self.programs, *(p for p in self.budget_programs.values() if p is not self.programs)]

    def scheduled(self, **changes) -> Generator:
        """This generator under another schedule (the same models and compiled programs)."""
        return Generator(
            self.programs.params, self.programs.draft_params, self.plan, self.stop_ids, self.codec,
            self.defaults, dataclasses.replace(self.schedule, **changes),
        )  # fmt: skip

    def run_batch(self, prompts: list[Prompt]) -> list[Result]:
        """The prompts as one static batch: their Results in input order."""
        return list(self.scheduled(policy="static", batch_size=len(prompts)).run(prompts))

    def prefill_attention(self) -> str:
        """The attention implementation of the prefill chunks (`_prefill_impl`)."""
        return self.programs.attention

    def _prefill_impl(self) -> str:
        """The attention of the prefill chunks: the plan's ("same"), cuDNN flash attention on CUDA for
        GQA families in bf16/f16 ("cudnn", attention.prefill_implementation; else the plan's), or the
        implementation the schedule names."""
        choice, plan = self.schedule.prefill_attention, self.plan
        if choice == "same":
            return plan.attention
        if choice != "cudnn":
            return choice
        if not models.family(plan.target).CUDNN_PREFILL:
            return plan.attention
        return attention.prefill_implementation(
            plan.attention, self.dtype, plan.target.dims.head_dim, self.schedule.batch_invariant
        )

    def rows(self, num_prompts: int) -> int:
        """B, the rows of a run over `num_prompts` prompts: the batch size (one ar row as two, a
        multiple of the "data" devices), continuous runs never more than the prompts on any device
        (batch-invariant runs keep every row)."""
        plan, sched = self.plan, self.schedule
        batch = sched.batch_size
        if sched.policy == "continuous" and not sched.batch_invariant:
            batch = min(batch, num_prompts)
        per_device = max(-(-batch // plan.dp), 1)
        return rows_to_run(plan.method, per_device, plan.target) * plan.dp

    # -- the loop ------------------------------------------------------------------------------------

    def samples(self, prompts: list[Prompt]) -> list[Prompt]:
        """Each prompt as its n samples (its own `n`, else the default), sample i seeded
        `sample_seed(seed, i)`, each sample a prompt of its own with its `index`."""
        out = []
        for p in prompts:
            settings = self._settings(p)
            for i in range(settings[SAMPLES]):
                seed = {"seed": sample_seed(settings["seed"], i)} if i else {}
                out.append(dataclasses.replace(p, options=p.options | seed, index=i))
        return out

    def run(self, prompts: list[Prompt], skip: frozenset = frozenset()) -> Iterator[Result]:
        """Each prompt's samples' Results as their rows finish (static: each batch's in input order),
        except the samples whose `prompts.sample_key` is in `skip`, which keep their place in the
        schedule only."""
        prompts = self.samples(prompts)
        if not prompts:
            return
        b = self.rows_run = self.rows(len(prompts))
        kept = [sample_key(p.id, p.index) not in skip for p in prompts]
        waiting = collections.deque(self._order(prompts, kept))
        sampled = any(self._settings(p)["temperature"] != 0 for p in prompts)
        longest = max(len(p.input_ids) for p in prompts)
        run = _Run(prompts, b, sampled, Shape.of(self.plan, b, prompt_slots(longest)))
        self.loop = self._loop(prompts)
        if self.loop == "device":
            yield from self._device_job(run, [i for i in waiting])
            return
        step = self._static_step if self.schedule.policy == "static" else self._continuous_step
        while waiting or any(i is not None for i in run.row_of):
            begin, compiled = time.perf_counter(), self.compile_seconds
            ran = step(run, waiting)
            out = fetch(device_outputs(run.state) | ({} if ran is None else {"ran": ran}))
            now = time.perf_counter()
            self.generate_seconds += now - begin - (self.compile_seconds - compiled)
            if "ran" in out:
                self._count(run, out, bool(waiting))
            finished, retire = [], np.zeros((run.rows,), bool)
            for r, i in enumerate(run.row_of):
                stop = None if i is None else self._stop(run, prompts[i], out, r)
                if i is not None and (out["done"][r] or stop is not None):
                    run.row_of[r], retire[r] = None, not out["done"][r]
                    if kept[i]:
                        since, compiled_then = run.admitted[r]
                        latency = now - since - (self.compile_seconds - compiled_then)
                        finished.append(self._result(prompts[i], out, r, latency, stop))
            if retire.any():  # rows cut at a stop string: done, free for the next prompt
                run.state = _retire(run.state, jax.device_put(retire))
            yield from finished

    def _loop(self, prompts: list[Prompt]) -> str:
        """Where the run's loop runs: "device" (the whole continuous job in one program, job.py), else
        "host" and why (the host-stepped and static policies, stop strings checked on the host)."""
        sched = self.schedule
        if sched.policy == "static":
            return "host (static batches)"
        if sched.host_stepped:
            return "host (host-stepped)"
        if any(self._settings(p)[STOP] for p in prompts):
            return "host (stop strings)"
        return "device" if sched.device_loop else "host (--host-loop)"

    # -- the continuous job on the device (job.py) ----------------------------------------------------

    def _device_job(self, run: _Run, order: list[int]) -> Iterator[Result]:
        """The continuous job as calls of one device program: each runs rounds, harvests finished rows
        and refills them from the queue on the device; the host writes what finished while the next
        call runs, and returns only every `most` iterations or when the finished buffer fills."""
        occ, dp = self.occupancy, self.plan.dp
        rows = run.rows // dp  # per device
        slots, stride = job_defaults(self.schedule)
        slots = min(slots, rows)
        size = 4 * rows  # the finished buffer, per device: at least 3 rows' harvests a call
        share = [order[d::dp] for d in range(dp)]  # each device's prompts, in the order they enter
        block = min(prompt_slots(max(len(x) for x in share)), QUEUE_BLOCK)
        begin, compiled, warmed = time.perf_counter(), self.compile_seconds, self.warmup_seconds
        probe = self._requests(run, [], [], dp, run.shape)
        chooser = self.make_chooser() if self._chooses() else None
        start = functools.partial(
            self.programs.job_start, probe, self._stop_array(), run.shape, observe=chooser is not None
        )
        starts: dict[int, float] = {}  # each call's dispatch time
        most, call, base = FIRST_MOST, 0, 0
        queue = self._queue(run, share, base, block)
        plan_of: dict[int, str] = {}  # each call's plan (a job that chooses)
        self.plan_rounds = {}
        if chooser is None:
            self._warm_up(start(), queue, slots, stride, size)
        else:
            most, seen = self.schedule.choice_rounds, _Seen()
            for n in self.schedule.auto_budgets:  # (every budget's program before the clock)
                self._warm_up(start(), queue, slots, stride, size, self._budget_programs(n))
        state = start()
        pending = None
        try:
            while True:
                starts[call], programs = time.perf_counter(), self.programs
                if chooser is not None:  # (from the counts of the calls read so far: all but the last one)
                    plan_of[call] = chooser.next_plan(rows, most)
                    programs = self._budget_programs(plan_choice.parse_plan(plan_of[call])[1])
                state, finished = programs.job(
                    state, queue, most, self.schedule.refill_at, call, slots=slots,
                    stride=stride, finished_size=size,
                )  # fmt: skip
                if pending is None:  # the first call: nothing to read yet
                    pending, call = (call, finished), call + 1
                    continue
                done_call, out = pending[0], fetch(_finished_outputs(pending[1]))
                now = time.perf_counter()
                pending, call = (call, finished), call + 1
                occ.host_returns += 1
                yield from self._harvested(run, share, out, size, starts, now, compiled)
                if chooser is not None:
                    self._observed(chooser, seen, out, plan_of[done_call])
                elif jax.process_count() == 1:  # (several processes must run the same calls: K stays fixed)
                    most = _next_most(most, now - starts[done_call])
                if out["occupied"].sum() == 0 and all(out["next"][d] >= len(share[d]) for d in range(dp)):
                    break  # (the call dispatched last found nothing to do)
                used = all(out["next"][d] >= min(base + block, len(share[d])) for d in range(dp))
                if used and base + block < max(map(len, share)):
                    base += block  # every device used its block: the next one
                    queue = self._queue(run, share, base, block)
        finally:  # a consumer that stops early (an interruption): the call still running ends first,
            # else the process exits under a running computation and XLA's threads abort it
            jax.block_until_ready(pending)
        self._job_counters(out, run.rows)
        self.generate_seconds += time.perf_counter() - begin - (self.compile_seconds - compiled)
        self.generate_seconds -= self.warmup_seconds - warmed

    def _chooses(self) -> bool:
        """Whether the device job chooses its budget: ddtree, budgets to choose among."""
        return self.plan.method == "ddtree" and bool(self.schedule.auto_budgets)

    def _chooser(self) -> plan_choice.PlanChooser:
        """The chooser of a job's budget: PlanChooser over this device kind's shipped cost table (the
        nearest model size), starting from the bundled pair's acceptance curve. Budget 0 runs root-only
        rounds: the table's ar row plus the drafter's context projection."""
        sizes = float(sum(x.size for x in jax.tree.leaves(self.programs.params)))
        kind, budgets = jax.devices()[0].device_kind, self.schedule.auto_budgets
        plans, costs = plan_choice.job_costs(kind, self.plan.target, self.plan.draft, sizes, budgets)
        prior = plan_choice.curve_marginals("bundled-pair", self.plan.depth)
        return plan_choice.PlanChooser(costs, plans, prior)

    def _budget_programs(self, budget: int) -> Programs:
        """The programs of this plan at another ddtree budget (its default branching; budget 0: root-only
        rounds, engine.Plan.root_only): the same state shapes, so a job's calls may switch between them."""
        if budget not in self.budget_programs:
            branching = ddtree_branching(budget, self.plan.target.vocab_size)
            plan = dataclasses.replace(self.plan, budget=budget, branching=branching)
            p = self.programs
            self.budget_programs[budget] = Programs(p.params, p.draft_params, plan, p.chunk, p.attention)
        return self.budget_programs[budget]

    def _observed(self, chooser: plan_choice.PlanChooser, seen: _Seen, out: dict, plan: str) -> None:
        """A job call's acceptance counts and rounds (the job's since its start, less those read
        before) given to the chooser, as the call's plan's."""
        depth = self.plan.depth
        hits = out["ranks"]["hits"].reshape(-1, depth, job.RANK_WIDTH).sum(axis=0)
        exposure = out["ranks"]["exposure"].reshape(-1, depth, job.RANK_WIDTH).sum(axis=0)
        rounds = int(out["counters"]["rounds"][0])
        chooser.observe_counts(hits - seen.hits, exposure - seen.exposure, plan)
        self.plan_rounds[plan] = self.plan_rounds.get(plan, 0) + rounds - seen.rounds
        seen.hits, seen.exposure, seen.rounds = hits, exposure, rounds

    def _warm_up(
        self, state: job.Job, queue: job.Queue, slots: int, stride: int, size: int, programs=None
    ) -> None:
        """One iteration of the job program (harvest, a prefill pass, `stride` rounds) on a state thrown
        away after, its compilation counted as such and the rest as warm-up, outside the generation's
        seconds: a process's first execution of a program costs more than its later ones (on an H100 the
        main job's single run took 0.42 s where later runs of the same program took 0.16 s:
        results/h100/2026-12-07, cli-vs-api), and a call that runs no iteration leaves the loop's body
        (its kernels and CUDA graphs) unexecuted."""
        begin, compiled = time.perf_counter(), self.compile_seconds
        state, finished = (programs or self.programs).job(
            state, queue, stride, self.schedule.refill_at, 0, slots=slots, stride=stride,
            finished_size=size,
        )  # fmt: skip
        jax.block_until_ready((state, finished))
        self.warmup_seconds += time.perf_counter() - begin - (self.compile_seconds - compiled)

    def _queue(self, run: _Run, share: list[list[int]], base: int, block: int) -> job.Queue:
        """Block [base, base + block) of every device's share of prompts, as the device's queue."""
        dp, p = len(share), run.shape.prompt_slots
        tokens = np.zeros((dp, block, p), np.int32)
        lengths = np.ones((dp, block), np.int32)
        limits = np.full((dp, block), self.plan.max_new_tokens, np.int32)
        stops = np.ones((dp, block), bool)
        settings = [[dict(GREEDY)] * block for _ in range(dp)]
        for d, mine in enumerate(share):
            for j, i in enumerate(mine[base : base + block]):
                prompt = run.prompts[i]
                tokens[d, j, : len(prompt.input_ids)] = prompt.input_ids
                lengths[d, j], limits[d, j] = len(prompt.input_ids), self._limit(prompt)
                settings[d][j] = self._settings(prompt)
                stops[d, j] = not settings[d][j][IGNORE_EOS]
        sampling = SamplingArrays.from_rows([x for d in settings for x in d]) if run.sampled else None
        ends = [min(base + block, len(mine)) for mine in share]
        last = all(base + block >= len(mine) for mine in share)
        return job.Queue(
            tokens=jax.device_put(tokens.reshape(dp * block, p)),
            lengths=jax.device_put(lengths.reshape(-1)),
            limits=jax.device_put(limits.reshape(-1)),
            sampling=sampling,
            stops=jax.device_put(stops.reshape(-1)),
            base=jax.device_put(np.full((dp,), base, np.int32)),
            end=jax.device_put(np.array(ends, np.int32)),
            last=jax.device_put(np.full((dp,), last, bool)),
        )

    def _harvested(self, run, share, out: dict, size: int, starts: dict, now: float, compiled: float):
        """The Results of the rows a job call harvested (each device's `count` entries of its buffer)."""
        decode = None if self.codec is None else self.codec.decode
        for d, mine in enumerate(share):
            for f in range(d * size, d * size + int(out["count"][d])):
                prompt = run.prompts[mine[int(out["prompt"][f])]]
                latency = now - starts[int(out["admitted"][f])]
                yield row_result(prompt, out, f, latency, None, decode, self._logprobs(prompt))

    def _job_counters(self, out: dict, rows: int) -> None:
        """The job's device counters after its last call, added to the occupancy (which sums over the
        generator's runs, as the host loop's does)."""
        occ, c = self.occupancy, out["counters"]
        rounds = int(c["rounds"][0])  # (every device runs the same rounds)
        occ.rounds += rounds
        occ.row_rounds += rounds * rows
        occ.busy += int(c["busy"].sum())
        occ.waiting_busy += int(c["waiting_busy"].sum())
        occ.waiting_row_rounds += int(c["waiting_rounds"][0]) * rows
        occ.refills += int(c["passes"].max())
        occ.prefilled += int(c["admitted"].sum())
        occ.prefill_steps += int(c["prefill_steps"].max())

    def _order(self, prompts: list[Prompt], kept: list[bool]) -> list[int]:
        """The order prompts enter rows: static, input order in batches cut from the whole list (a
        batch of skipped prompts only is left out); continuous, shortest first, skipped ones left out."""
        if self.schedule.policy == "continuous":
            by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i].input_ids))
            return [i for i in by_length if kept[i]]
        n = self.schedule.batch_size
        batches = [range(i, min(i + n, len(prompts))) for i in range(0, len(prompts), n)]
        return [i for batch in batches if any(kept[j] for j in batch) for i in batch]

    def _static_step(self, run: _Run, waiting: collections.deque) -> jax.Array | None:
        """The next batch, in its own state from prefill to its slowest row's end (a batch with stop
        strings: a round at a time, its rows still running carried to the next step)."""
        if any(i is not None for i in run.row_of):
            run.state = self._rounds(run, run.rows)[0]
            return None
        take = [waiting.popleft() for _ in range(min(self.schedule.batch_size, len(waiting)))]
        longest = max(len(run.prompts[i].input_ids) for i in take)
        shape = Shape.of(self.plan, run.rows, prompt_slots(longest))
        req = self._requests(run, take, list(range(len(take))), run.rows, shape)
        admitted = (time.perf_counter(), self.compile_seconds)
        for r, i in enumerate(take):
            self._admit(run, r, i, admitted)
        if not self.schedule.host_stepped and not any(run.stopping):
            run.state = self.programs.generate(req, self._stop_array(), shape)
            return None
        run.state = self.stepper.prefill(lambda: self.programs.start(req, self._stop_array(), shape))
        run.state = self._rounds(run, run.rows)[0]
        return None

    def _admit(self, run: _Run, r: int, i: int, admitted: tuple[float, float]) -> None:
        """Sample `i` into row `r` of the run (`admitted`: when its prefill was called)."""
        run.row_of[r], run.seen[r], run.admitted[r], run.checked[r] = i, 0, admitted, 0
        run.stopping[r] = bool(self._settings(run.prompts[i])[STOP])

    def _rounds(self, run: _Run, until: int) -> tuple[DecodeState, jax.Array]:
        """Rounds until `until` rows are done, or all are; one round at a time while a row has stop
        strings (the host checks its text after each); the rounds run ([B])."""
        live = [r for r, i in enumerate(run.row_of) if i is not None]
        most = STOP_CHECK_ROUNDS if any(run.stopping[r] for r in live) else EVERY_ROUND
        if self.schedule.host_stepped:
            state, ran = self.stepper.rounds(run.state, until, most)
            return state, jnp.full((run.rows,), ran)
        return self.programs.rounds(run.state, until, most)

    def _continuous_step(self, run: _Run, waiting: collections.deque) -> jax.Array:
        """Waiting prompts into the free rows, one per "data" device per prefill (each prompt's
        prefill depends on it alone), then rounds until a refill is due."""
        free = [r for r, i in enumerate(run.row_of) if i is None]
        take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
        dp = self.plan.dp
        for g in range(0, len(take), dp):
            group = take[g : g + dp]
            rows = free[g : g + len(group)]  # fewer prompts than "data" devices: padding requests
            req = self._requests(run, group, rows, dp, run.shape)
            admitted = (time.perf_counter(), self.compile_seconds)
            if run.state is None:  # every row done: the refill below fills the first ones
                run.state = self.programs.empty(req, self._stop_array(), run.shape)
            run.state = self.stepper.prefill(lambda req=req: self.programs.refill(run.state, req))
            for r, i in zip(rows, group, strict=True):
                self._admit(run, r, i, admitted)
            self.occupancy.refills += 1
        live = sum(i is not None for i in run.row_of)
        until = (run.rows - live) + self.schedule.refill_at if waiting else run.rows
        run.state, ran = self._rounds(run, until)
        return ran

    def _count(self, run: _Run, out: dict, waiting: bool) -> None:
        """Occupancy of the rounds just run."""
        occ, ran = self.occupancy, int(out["ran"][0])
        busy = sum(int(out["rounds"][r] - run.seen[r]) for r, i in enumerate(run.row_of) if i is not None)
        occ.host_returns += 1
        occ.rounds += ran
        occ.row_rounds += ran * run.rows
        occ.busy += busy
        if waiting:
            occ.waiting_row_rounds += ran * run.rows
            occ.waiting_busy += busy
        for r, i in enumerate(run.row_of):
            if i is not None:
                run.seen[r] = out["rounds"][r]

    # -- requests and results ------------------------------------------------------------------------

    def _stop_array(self) -> jax.Array:
        ids = list(self.stop_ids)[:MAX_STOP_IDS]
        return jax.device_put(np.array(ids + [-1] * (MAX_STOP_IDS - len(ids)), np.int32))

    def _settings(self, prompt: Prompt) -> dict:
        """The prompt's sampling settings and samples: its own over the defaults."""
        return self.defaults | {k: prompt.options[k] for k in OPTIONS if k in prompt.options}

    def _stop(self, run: _Run, prompt: Prompt, out: dict, r: int) -> Stop | None:
        """Where row `r`'s sample stops at a stop string, checked when it has new tokens (None: it
        does not, or has none)."""
        n = int(out["num_output"][r])
        if not run.stopping[r] or n == run.checked[r]:
            return None
        run.checked[r] = n
        settings = self._settings(prompt)
        ids = out["output"][r, :n].tolist()
        return find_stop(ids, self.codec.decode, settings[STOP], settings[INCLUDE_STOP])

    def _requests(self, run: _Run, take: list[int], rows: list[int], count: int, shape: Shape) -> Requests:
        """Requests [count] for prompts `take` bound for `rows` (the rest padding)."""
        tokens = np.zeros((count, shape.prompt_slots), np.int32)
        lengths = np.ones((count,), np.int32)
        where = np.full((count,), run.rows, np.int32)
        limits = np.full((count,), self.plan.max_new_tokens, np.int32)
        stops = np.ones((count,), bool)
        settings = [dict(GREEDY)] * count
        for j, (i, row) in enumerate(zip(take, rows, strict=True)):
            prompt = run.prompts[i]
            tokens[j, : len(prompt.input_ids)] = prompt.input_ids
            lengths[j], where[j], limits[j] = len(prompt.input_ids), row, self._limit(prompt)
            settings[j] = self._settings(prompt)
            stops[j] = not settings[j][IGNORE_EOS]
        sampling = SamplingArrays.from_rows(settings) if run.sampled else None
        tokens, lengths, where, limits, stops = jax.device_put((tokens, lengths, where, limits, stops))
        return Requests(tokens, lengths, where, sampling=sampling, limits=limits, stops=stops)

    def _limit(self, prompt: Prompt) -> int:
        """The prompt's own `max_new_tokens`, else the plan's."""
        most = self.plan.max_new_tokens
        n = prompt.options.get(LIMIT, most)
        if not 1 <= n <= most:
            raise ValueError(f"prompt {prompt.id!r}: max_new_tokens {n} is not in [1, {most}]")
        return n

    def _logprobs(self, prompt: Prompt) -> int:
        """The prompt's own `logprobs` K, else the plan's."""
        most = self.plan.logprobs
        k = prompt.options.get(LOGPROBS, most)
        if not 0 <= k <= most:
            raise ValueError(f"prompt {prompt.id!r}: logprobs {k} is not in [0, {most}]")
        return k

    def _result(self, prompt: Prompt, out: dict, r: int, latency: float, stop: Stop | None) -> Result:
        """Row `r`'s sample as a Result (`stop`: cut at a stop string)."""
        decode = None if self.codec is None else self.codec.decode
        return row_result(prompt, out, r, latency, stop, decode, self._logprobs(prompt))


@dataclasses.dataclass
class _Seen:
    """A choosing job's counts as last read (job.RankCounts summed over devices, and its rounds)."""

    hits: np.ndarray | int = 0
    exposure: np.ndarray | int = 0
    rounds: int = 0


@dataclasses.dataclass
class _Run:
    """The host's view of one run: its prompts, the rows' occupants and the device state."""

    prompts: list[Prompt]
    rows: int  # B
    sampled: bool  # the sampling program (some prompt samples), else the greedy-only one
    shape: Shape  # continuous: the whole run's
    state: DecodeState | None = None
    row_of: list[int | None] = dataclasses.field(default_factory=list)  # the prompt in each row
    seen: np.ndarray | None = None  # each row's rounds at the last return to the host
    # each row's admission: (host time, compile seconds so far) when its prompt's prefill was called
    admitted: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    stopping: list[bool] = dataclasses.field(default_factory=list)  # each row's sample has stop strings
    checked: list[int] = dataclasses.field(default_factory=list)  # its tokens when its text was checked

    def __post_init__(self):
        self.row_of = [None] * self.rows
        self.admitted = [(0.0, 0.0)] * self.rows
        self.stopping, self.checked = [False] * self.rows, [0] * self.rows
        self.seen = np.zeros((self.rows,), np.int64)


@functools.partial(jax.jit, donate_argnums=0)
def _retire(state: DecodeState, rows: jax.Array) -> DecodeState:
    """The state with rows [B] bool done (cut at a stop string on the host)."""
    return dataclasses.replace(state, done=state.done | rows)


def job_defaults(schedule: Schedule) -> tuple[int, int]:
    """(prefill slots R, stride) of the device job: the schedule's, else by backend. A GPU launches
    each of a round's kernels from the host (XLA's loop returns to its thread every iteration of a loop
    whose test is on the device), so it runs 8 rounds between harvests and prefills 8 prompts a pass
    (results/h200/2026-12-07); a CPU has no launch cost but computes every slot of a pass, a prompt's
    or padding, so it prefills one prompt a pass and harvests every round."""
    cpu = jax.default_backend() == "cpu"
    slots = schedule.prefill_slots or (1 if cpu else 8)
    return slots, schedule.stride or (1 if cpu else 8)


def _finished_outputs(f: job.Finished) -> dict:
    """A job call's Finished buffer as the arrays `results.row_result` reads (and the job's status)."""
    out = {
        "output": f.output, "num_output": f.num_output, "stopped": f.stopped, "rounds": f.rounds,
        "acceptance": f.acceptance, "prompt": f.prompt, "admitted": f.admitted, "count": f.count,
        "next": f.next, "occupied": f.occupied, "counters": _fields(f.counters),
    }  # fmt: skip
    if f.ranks is not None:
        out["ranks"] = _fields(f.ranks)
    if f.logprobs is not None:
        lp = f.logprobs
        out |= {"logprobs": lp.chosen, "top_logprobs": lp.top, "top_ids": lp.top_ids}
    return out


def _fields(x) -> dict:
    """A dataclass's fields as a dict, the values themselves (`dataclasses.asdict` deep-copies them: for
    jax arrays that is a compiled copy program per shape, inside the generation's clock)."""
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}


def _next_most(most: int, seconds: float) -> int:
    """The next call's rounds: sized so that a call takes about MOST_SECONDS (tokens do not depend on
    it), between 8 and 4096."""
    if seconds <= 0:
        return most
    return int(min(max(most * MOST_SECONDS / seconds, 8), 4096))
