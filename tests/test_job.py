"""The continuous job on the device (job.py): the tokens of the host loop and of static batches, the
same programs whatever the number of prompts, few returns to the host, and a prompt's tokens
independent of the prompts prefilled beside it."""

import collections

import jax
import jax.numpy as jnp
import pytest
from conftest import load_drafter, load_target
from test_scheduling import PROMPTS, generator

from ddtree_jax import scheduler
from ddtree_jax.engine import Plan
from ddtree_jax.prompts import Prompt
from ddtree_jax.scheduler import Generator, Schedule


def results(gen, prompts, options=None):
    options = options or [{}] * len(prompts)
    items = [Prompt(i, i + 1, p, dict(o)) for i, (p, o) in enumerate(zip(prompts, options, strict=True))]
    by_id = {r.id: r for r in gen.run(items)}
    return [by_id[i] for i in range(len(prompts))]


def fields(rs):
    return [(r.output_ids, r.acceptance_lengths, r.finish_reason) for r in rs]


SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 3}


@pytest.mark.parametrize(
    "method,sampling,job",
    [
        ("ddtree", None, {}),  # the CPU's defaults: one prompt a pass, a harvest every round
        ("ddtree", SEEDED, {"prefill_slots": 3, "stride": 4}),  # the GPU's kind: passes of several
        ("ar", SEEDED, {}),
    ],
)
def test_device_job_equals_host_loop(method, sampling, job, monkeypatch):
    """The device job and the host loop give the same tokens and acceptance, greedy and sampled, with
    more prompts than rows (refills) and one iteration per call (tokens do not depend on where a call
    ends)."""
    budget = 7 if method == "ddtree" else 0
    kw = dict(method=method, budget=budget, batch_size=3, chunk=16, sampling=sampling, stop_ids=(17,))
    host = results(generator(device_loop=False, **kw), PROMPTS)
    monkeypatch.setattr(scheduler, "FIRST_MOST", 1)
    monkeypatch.setattr(scheduler, "_next_most", lambda most, seconds: 1)
    gen = generator(**kw, **job)
    device = results(gen, PROMPTS)
    assert gen.loop == "device" and fields(device) == fields(host)
    occ = gen.occupancy  # one iteration (harvest, admission, `stride` rounds) a call
    assert occ.host_returns * scheduler.job_defaults(gen.schedule)[1] >= occ.rounds
    # the passes' steps: each runs R pieces of g = 16 tokens (chunk 16), a pass's pieces
    # rounded up to whole steps, so every prompt's pieces plus less than one step a pass
    per_step, pieces = job.get("prefill_slots", 1), sum(-(-len(p) // 16) for p in PROMPTS)
    assert occ.prefilled == len(PROMPTS)
    assert pieces <= per_step * occ.prefill_steps < pieces + per_step * occ.refills


class Compiles:
    """Counts XLA compilations and jaxpr traces (jax.monitoring duration events) while active."""

    EVENTS = {"/jax/core/compile/backend_compile_duration": "compiles",
              "/jax/core/compile/jaxpr_trace_duration": "traces"}  # fmt: skip

    def __init__(self):
        self.counts = {"compiles": 0, "traces": 0}
        self.compiled: set[str] = set()  # the names of the functions XLA compiled
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, fun_name="", **kwargs):
        if self.active and event in self.EVENTS:
            self.counts[self.EVENTS[event]] += 1
            if self.EVENTS[event] == "compiles":
                self.compiled.add(fun_name)


_COUNTER = Compiles()


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_job_compiles_once_whatever_the_prompts(method, monkeypatch):
    """The main job's path traces and compiles the same programs for 4 prompts as for 12 (nothing is
    compiled per prompt or per refill inside the generation), and returns to the host at most
    ceil(rounds / K) + flushes times (K fixed here: the host sizes it by wall time otherwise)."""
    monkeypatch.setattr(scheduler, "_next_most", lambda most, seconds: most)
    budget = 7 if method == "ddtree" else 0
    seen = []
    longest_first = sorted(PROMPTS * 2, key=len, reverse=True)  # every list holds the longest prompt
    jax.clear_caches()  # (so that eager operations compiled by earlier tests compile again here)
    _COUNTER.compiled = set()
    for n in (4, 12, 14):
        gen = generator(method=method, budget=budget, batch_size=3, chunk=16)
        _COUNTER.counts = {"compiles": 0, "traces": 0}
        _COUNTER.active = True
        try:
            out = results(gen, longest_first[:n])
        finally:
            _COUNTER.active = False
        seen.append((dict(_COUNTER.counts), len(gen.compile_log)))
        assert len(out) == n
        occ = gen.occupancy
        flushes = -(-n // (4 * gen.rows_run - gen.rows_run))  # the finished buffer: 4 B, a harvest <= B
        assert occ.host_returns <= -(-occ.rounds // scheduler.FIRST_MOST) + flushes + 1
        assert gen.warmup_seconds > 0  # the warm-up call ran, on the job's own program (no compile)
    # the first run (4 prompts) compiles the job's programs; 12 and 14 prompts compile nothing new (the
    # same prompt slots: the longest prompt is in every list; the same queue block: 16 prompts)
    assert seen[1][0]["compiles"] == 0 and seen[2][0]["compiles"] == 0, seen
    assert seen[1][1] == 0 and seen[2][1] == 0
    # and nothing but the job's programs, in any run: an eager jnp operation on the host path (jnp.asarray
    # of a NumPy array, a jnp.int32 scalar, dataclasses.asdict of arrays) compiles a program per shape in
    # each process, inside the generation's clock (on an H100 ~0.4 s of a 0.57 s main job)
    assert _COUNTER.compiled <= {"jit(job_start)", "jit(run_job)"}, _COUNTER.compiled


def test_prefill_together_is_order_and_slot_invariant_in_bfloat16():
    """A prompt's tokens and acceptance are the same whichever prompts share its prefill pass and
    whichever slot and row it lands in, in bfloat16 (fixed shapes: [R, C] chunks, each prompt on its
    own chunk schedule)."""
    cfg, params = load_target("qwen3_gqa4_tp")
    dcfg, dparams = load_drafter("dflash_qwen3_gqa4_tp")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, params)
    dparams = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, dparams)
    plan = Plan(cfg, dcfg, "ddtree", 16, budget=7, branching=7)

    def job(prompts, slots):
        gen = Generator(params, dparams, plan, (), schedule=Schedule(4, chunk=16, prefill_slots=slots))
        return {tuple(p): r for p, r in zip(prompts, results(gen, prompts), strict=True)}

    forward = job(PROMPTS, 4)
    backward = job(PROMPTS[::-1], 4)
    for p in PROMPTS:
        assert fields([forward[tuple(p)]]) == fields([backward[tuple(p)]]), p


def test_ignore_eos_runs_a_row_on_past_the_stop_ids():
    """A prompt with ignore_eos (vLLM's name) runs past the run's stop ids to its limit, with the tokens
    of a run without stop ids; the others stop at the stop id; the device job and the host loop alike."""
    free = results(generator(method="ddtree", batch_size=3, chunk=16), PROMPTS)
    # the token most prompts emit before their last: rows that ignore it and rows that stop at it
    seen = collections.Counter(t for f in free for t in set(f.output_ids[:-1]))
    stop = seen.most_common(1)[0][0]
    options = [{"ignore_eos": i % 2 == 0} for i in range(len(PROMPTS))]
    hits = {o["ignore_eos"] for f, o in zip(free, options, strict=True) if stop in f.output_ids[:-1]}
    assert hits == {True, False}, hits
    for device_loop in (True, False):
        gen = generator(method="ddtree", batch_size=3, chunk=16, stop_ids=(stop,), device_loop=device_loop)
        got = results(gen, PROMPTS, options)
        for i, (r, f) in enumerate(zip(got, free, strict=True)):
            if options[i]["ignore_eos"] or stop not in f.output_ids:
                assert r.output_ids == f.output_ids and r.finish_reason == "length", (device_loop, i)
            else:
                cut = f.output_ids.index(stop) + 1
                assert r.output_ids == f.output_ids[:cut] and r.finish_reason == "stop", (device_loop, i)
