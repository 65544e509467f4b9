"""A job that chooses its ddtree budget (`--budget auto`, Schedule.auto_budgets): switching budgets between
the device job's calls changes the speed, never the tokens (float32, greedy, seeded-sampling and own-limit
lines), and the budgets chosen are a function of the job's own counts (the same sequence on a rerun).

Every run is `ddtree-generate --budget auto` on the dense fixture pair's recorded case
(tests/recorded_outputs.py: 8 lines, 2 rows, 12 new tokens), its output ids checked against the record
(tests/fixtures/recorded_outputs.json, made at budget 7 by every mode). The budgets are 3 and 15, so one
choosing job's programs (its first state and a job program per budget: three compilations) serve every
test; the chooser is replaced where a test forces the budgets, and the calls are 2 rounds long (a runtime
argument of the job program: nothing recompiles) so that a run makes about 20 calls."""

import dataclasses
import json
import re
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import FIXTURES
from recorded_outputs import RECORD, argv, outputs, write_prompts

from ddtree_jax import outfile, plan_choice, provenance, scheduler, settings
from ddtree_jax.cli import main
from ddtree_jax.compare import cli as compare_cli
from ddtree_jax.errors import DDTreeError
from ddtree_jax.prompts import sample_key

BUDGETS = (3, 15)
RECORDED = json.loads(RECORD.read_text())["cases"]["dense"]["ddtree"]


class Scripted:
    """A chooser that runs the budgets of `script` in turn, one per call (cycling): forced switches."""

    def __init__(self, script):
        self.script, self.calls, self.used, self.seen = list(script), 0, {}, []

    def next_plan(self, rows, rounds=1):
        plan = plan_choice.plan_name("ddtree", self.script[self.calls % len(self.script)])
        self.calls += 1
        self.used[plan] = self.used.get(plan, 0) + rounds
        return plan

    def observe_counts(self, hits, exposure, plan=None):
        # the ranks the device counted: the branching of the program that ran (exposure [D, 32])
        width = int(np.sum(np.asarray(exposure).sum(axis=0) > 0))
        self.seen.append((plan, width, int(np.sum(exposure))))


class Recording:
    """A chooser's plans as it makes them (`sequence`)."""

    def __init__(self, chooser):
        self.chooser, self.sequence, self.used = chooser, [], chooser.used

    def next_plan(self, rows, rounds=1):
        self.sequence.append(self.chooser.next_plan(rows, rounds))
        return self.sequence[-1]

    def observe_counts(self, hits, exposure, plan=None):
        self.chooser.observe_counts(hits, exposure, plan)


class Compiles:
    """The names of the functions XLA compiles while `active` (jax.monitoring's compile events)."""

    def __init__(self):
        self.names: set[str] = set()
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, fun_name="", **kwargs):
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.names.add(fun_name)


COMPILES = Compiles()


def ids(lines):
    """Output ids and finish reason per id (the acceptance lengths are each budget's own)."""
    return {k: (v["output_ids"], v["finish_reason"]) for k, v in lines.items()}


@pytest.fixture
def auto(tmp_path, monkeypatch, capsys):
    """`run(chooser=None, rounds=None)`: ddtree-generate --budget auto over budgets 3 and 15, with
    `chooser` in place of the shipped one and `rounds` rounds a call; -> (outputs, summary, settings).
    COMPILES.names: what XLA compiled inside the device job (its calls, the chooser, the harvests)."""
    monkeypatch.setattr(settings, "AUTO_BUDGETS", BUDGETS)
    # at 2 rows the shipped table prices no budget 3 (pair.priced_auto_budgets would leave it out): the
    # switches tested here are forced, so every budget is kept
    monkeypatch.setattr(plan_choice, "priced_budgets", lambda costs, budgets, rows: tuple(budgets))
    device_job = scheduler.Generator._device_job

    def counted(self, *args):
        COMPILES.active = True
        try:
            yield from device_job(self, *args)
        finally:
            COMPILES.active = False

    monkeypatch.setattr(scheduler.Generator, "_device_job", counted)
    jax.clear_caches()  # (eager operations compiled by earlier tests compile again)
    COMPILES.names = set()
    prompts = write_prompts("dense", tmp_path / "dense.jsonl")
    schedule = settings.Settings.schedule

    def run(chooser=None, rounds=None, resume=False):
        if chooser is not None:
            monkeypatch.setattr(scheduler.Generator, "_chooser", lambda self: chooser)
        if rounds is not None:
            patched = lambda s: dataclasses.replace(schedule(s), choice_rounds=rounds)  # noqa: E731
            monkeypatch.setattr(settings.Settings, "schedule", patched)
        out = tmp_path / "auto.jsonl"
        again = "--resume" if resume else "--overwrite"
        assert main([*argv("dense", "ddtree", prompts, out), "--budget", "auto", again]) == 0
        record = json.loads((tmp_path / "auto.jsonl.settings.json").read_text())
        return ids(outputs(out)), capsys.readouterr().out, record

    return run


def test_budget_auto_reproduces_the_record(auto):
    """The shipped chooser: the recorded ids; the summary names the budgets run and their share."""
    out, summary, record = auto()
    assert out == ids(RECORDED)
    assert "budget: auto (ddtree-" in summary and "% of " in summary, summary
    assert record["auto_budgets"] == list(BUDGETS)


@pytest.mark.parametrize("script", [[3], [15], [3, 15], [15, 15, 3]])
def test_forced_switches_leave_outputs_unchanged(auto, script):
    """Each fixed budget and a switch at every call give the recorded ids (greedy, seeded sampling, own
    limits); each call's counts reach the chooser as its budget's, counted by that budget's program."""
    chooser = Scripted(script)
    out, summary, _ = auto(chooser, rounds=2)
    assert out == ids(RECORDED)
    assert chooser.calls > 8
    ran = {p for p, _, _ in chooser.seen}
    assert ran == {plan_choice.plan_name("ddtree", n) for n in script}, (ran, chooser.seen)
    assert sum(e for _, _, e in chooser.seen) > 0
    assert all(w == plan_choice.branching(p) for p, w, e in chooser.seen if e), chooser.seen
    # nothing but the job's programs compiles on the way (an eager jax operation on the host path would
    # compile a program per shape inside the generation's clock: tests/test_job.py)
    assert COMPILES.names <= {"jit(job_start)", "jit(run_job)"}, COMPILES.names
    for n in set(script):
        assert f"ddtree-{n} " in summary.splitlines()[0], summary


def test_chosen_budgets_follow_the_counts_and_repeat(auto):
    """PlanChooser over a cost table where the prior (the bundled pair's curve) picks budget 15 and the
    fixture drafter's low acceptance, once counted, budget 3: it switches, the same way on a rerun, and
    the ids are the record's."""
    costs = {"ddtree-3": {1: 1.0, 16: 1.0}, "ddtree-15": {1: 1.3, 16: 1.3}}
    plans = tuple(plan_choice.plan_name("ddtree", n) for n in BUDGETS)
    runs = []
    for _ in range(2):
        table = plan_choice.CostTable("test", "tiny", costs)
        chooser = Recording(
            plan_choice.PlanChooser(table, plans, plan_choice.curve_marginals("bundled-pair", 7))
        )
        out, _, _ = auto(chooser, rounds=2)
        assert out == ids(RECORDED)
        runs.append((chooser.sequence, dataclasses.asdict(chooser.chooser.counts)))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) > 8
    assert runs[0][0][0] == "ddtree-15" and runs[0][0][-1] == "ddtree-3", runs[0][0]
    np.testing.assert_array_equal(runs[0][1]["hits"], runs[1][1]["hits"])
    np.testing.assert_array_equal(runs[0][1]["seen"], runs[1][1]["seen"])
    assert runs[0][1]["seen"].sum() > 0


def test_resumed_auto_run_writes_the_record(auto, tmp_path):
    """--resume after 3 of the 8 lines: the job runs the other 5 (other calls, other budgets: the
    chooser switches every call) and the file holds the recorded ids."""
    auto(Scripted([3, 15]), rounds=2)
    out = tmp_path / "auto.jsonl"
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:3]))
    chooser = Scripted([15, 3])
    lines, _, _ = auto(chooser, rounds=2, resume=True)
    assert lines == ids(RECORDED) and chooser.calls > 2


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--budget", "auto", "--branching", "4"], "--branching applies to a fixed --budget"),
        (["--method", "dflash", "--budget", "auto"], "apply to --method ddtree only"),
        (["--budget", "0"], "--budget must be >= 1"),
        (["--budget", "x"], "argument --budget: invalid int value: 'x'"),
    ],
)
def test_budget_auto_flags(tmp_path, capsys, flags, words):
    assert main(["--out", str(tmp_path / "x.jsonl"), *flags]) != 0
    assert words in capsys.readouterr().err


def test_stand_ins_scale_the_reference_budgets_by_the_anchor():
    """The bundled pair's table measures ar and ddtree 7 only: budgets 3 and 15 stand in as the H200
    Qwen3-8B table's ms times the pair's ddtree-7 ms over the Qwen3-8B ddtree-7 ms, row by row."""
    raw = json.loads((RECORD.parents[2] / "ddtree_jax" / "assets" / "plan_costs.json").read_text())
    pair, ref = (raw["devices"]["NVIDIA H200"][s]["ms_per_round"] for s in ("default-pair", "qwen3-8b"))
    costs = plan_choice.with_stand_ins(plan_choice.load_costs("NVIDIA H200", 7e6), ("ddtree-3", "ddtree-15"))
    assert costs.shape == "default-pair" and costs.ms_per_round["ddtree-7"] == {1: 0.437, 16: 0.584}
    want = ref["ddtree-15"]["16"] * pair["ddtree-7"]["16"] / ref["ddtree-7"]["16"]
    assert costs.ms("ddtree-15", 16) == pytest.approx(want)
    assert costs.ms("ddtree-3", 4) is None  # (the reference measured budget 3 from 16 rows only)
    assert plan_choice.with_stand_ins(costs, ("ddtree-7",)) is costs


@pytest.mark.parametrize("dtype,refused", [("bfloat16", True), ("float32", False)])
@pytest.mark.parametrize("before,now", [((), BUDGETS), (BUDGETS, ()), (None, BUDGETS)])
def test_resume_holds_budget_auto_in_bfloat16(tmp_path, dtype, refused, before, now):
    """--resume between --budget auto and a fixed budget (before: None, a sidecar from before
    auto_budgets was recorded): refused in bfloat16, naming --budget, as the other schedule settings;
    continued in float32, where every budget gives the same tokens, whatever fixed budget the file was
    made with (an auto run records its batch size's default budget)."""
    base = settings.Settings(target="t", draft="d", method="ddtree", budget=7, branching=7, dtype=dtype)
    fixed = 3 if dtype == "float32" else 7  # (in float32 the fixed run's budget differs from auto's)
    stored = dataclasses.replace(
        base, auto_budgets=before or (), **({} if before else {"budget": fixed, "branching": fixed})
    ).record()
    if before is None:
        del stored["auto_budgets"]
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps({"id": "a", "output_ids": [1]}) + "\n")
    outfile.settings_path(out).write_text(json.dumps(stored))
    resumed = dataclasses.replace(base, auto_budgets=now).record()
    if not refused:
        assert outfile.finished_ids(str(out), resumed) == {sample_key("a", 0)}
        return
    said = {(): "fixed", None: "fixed", BUDGETS: "auto (3, 15)"}
    with pytest.raises(DDTreeError, match=re.escape(f"--budget {said[before]} (now {said[now]})")):
        outfile.finished_ids(str(out), resumed)
    assert provenance.numerics_differences({}, {}, stored, resumed) == (
        [] if before is None else [f"auto_budgets {list(before)!r} -> {list(now)!r}"]
    )


@pytest.mark.parametrize("name,flags", [("external", ["--theirs", "x.jsonl"]), ("distribution", [])])
def test_compare_refuses_budget_auto(tmp_path, capsys, name, flags):
    """ddtree-compare runs one fixed budget: --budget auto is refused by name, before anything loads."""
    argv = [name, "--report", str(tmp_path / "r"), *flags, "--budget", "auto"]
    assert compare_cli.main(argv) == 1
    assert "--budget auto: the comparisons run one fixed budget" in capsys.readouterr().err


def test_root_only_rounds_are_ar_and_keep_the_drafters_context(auto, monkeypatch):
    """Budget 0 (engine.Plan.root_only: no draft, the root verified alone, the drafter's context still
    extended) runs as 'root-only' (its own name in the summary, not ar's) among budget 7's rounds: held
    throughout, and switched with budget 7 at every call or every other, every run writes the ids
    recorded at budget 7 (greedy, seeded sampling, own limits), the root-only calls count no ranks, and
    budget 7's calls after them count as budget 7's."""
    monkeypatch.setattr(settings, "AUTO_BUDGETS", (0, 7))
    for script in ([0], [0, 7], [7, 0, 0]):
        chooser = Scripted(script)
        out, summary, record = auto(chooser, rounds=2)
        assert out == ids(RECORDED), script
        assert record["auto_budgets"] == [0, 7] and chooser.calls > 8
        assert {p for p, _, _ in chooser.seen} == {plan_choice.plan_name("ddtree", n) for n in script}
        assert all(e == 0 for p, _, e in chooser.seen if p == "root-only"), chooser.seen
        if 7 in script:
            assert any(p == "ddtree-7" and w == 7 and e for p, w, e in chooser.seen), chooser.seen
        first = summary.splitlines()[0]
        assert "budget: auto (root-only " in first and " ar " not in first, summary
    assert COMPILES.names <= {"jit(job_start)", "jit(run_job)"}, COMPILES.names


def test_root_only_cost_is_ar_plus_the_context_projection():
    """The 'root-only' plan of a choosing job costs the table's ar row times 1 + the projection's share of the
    target's weights: fc [F, H] and its norm, each draft layer's K and V projections and K norm (what
    `drafter.context_kv` reads: test_fused_projections.py checks it against a fixture drafter)."""
    dims = SimpleNamespace(hidden_size=64, num_kv_heads=2, head_dim=16, qk_norm=True)
    draft = SimpleNamespace(dims=dims, target_layer_ids=(1, 3, 5), num_layers=2)
    target = SimpleNamespace(hidden_size=128)
    share = plan_choice.projection_share(target, draft, 1e6)
    assert share == pytest.approx((3 * 128 * 64 + 64 + 2 * (2 * 64 * 32 + 16)) / 1e6)
    costs = plan_choice.CostTable("d", "s", {"ar": {1: 1.0, 16: 2.0}, "ddtree-7": {1: 3.0}})
    scaled = plan_choice.with_projection(costs, 0.25)
    want = {"ar": {1: 1.0, 16: 2.0}, "ddtree-7": {1: 3.0}, "root-only": {1: 1.25, 16: 2.5}}
    assert scaled.ms_per_round == want
    assert scaled.ms(plan_choice.plan_name("ddtree", 0), 4) == pytest.approx(1.25 * 1.5)
    for name in ("ar", "dflash", "ddtree-7", "root-only"):
        assert plan_choice.plan_name(*plan_choice.parse_plan(name)) == name
    assert plan_choice.parse_plan("root-only") == ("ddtree", 0) and plan_choice.parse_plan("ar") == ("ar", 0)


def test_root_only_rounds_extend_the_drafters_context():
    """From one prefilled prompt, root-only rounds and budget 7's rounds to 6 tokens commit the same
    tokens and the same drafter context K/V at every committed slot (float32): a switch to a real budget
    finds the context a budget-7 job would have. (The fixture drafter's trees accept no node, so budget
    7 also takes a round a token.)"""
    import jax.numpy as jnp

    from ddtree_jax import engine, programs
    from ddtree_jax.pair import load_pair
    from ddtree_jax.requests import Requests

    pair = load_pair(FIXTURES / "qwen3_gqa4_tp", FIXTURES / "dflash_qwen3_gqa4_tp", "float32")
    prompt = np.load(FIXTURES / "qwen3_gqa4_tp" / "golden.npz")["prompt_3"].astype(np.int32)[:12]
    plan = engine.Plan(pair.target, pair.draft, "ddtree", 16, budget=7, branching=7)
    root = dataclasses.replace(plan, budget=0, branching=1)
    shape = programs.Shape.of(plan, 1, 16)
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, : len(prompt)] = prompt
    req = Requests(
        jnp.asarray(tokens), jnp.asarray([len(prompt)]), jnp.zeros(1, jnp.int32), None, jnp.full(1, 16)
    )
    stop_ids = jnp.full((engine.MAX_STOP_IDS,), -1, jnp.int32)
    start = programs.start(
        pair.params, pair.draft_params, req, stop_ids, plan=plan, shape=shape, chunk=16, attention="reference"
    )
    states = {}
    for p in (root, plan):
        step = jax.jit(lambda s, p=p: engine.decode_round(pair.params, pair.draft_params, s, p))
        state = start
        while int(state.num_output[0]) < 6:
            state = step(state)
        states[p.budget] = state
    rounds = 6 - int(start.num_output[0])  # (the prefill emits the first token)
    assert int(states[0].rounds[0]) == rounds
    np.testing.assert_array_equal(states[0].output[0, :6], states[7].output[0, :6])
    end = int(states[0].lengths[0])  # the committed slots (the last token is the next root)
    assert end == len(prompt) + 5 == int(states[7].lengths[0])
    for a, b in zip(
        jax.tree.leaves(states[0].draft_cache), jax.tree.leaves(states[7].draft_cache), strict=True
    ):
        axis = a.shape.index(shape.capacity)  # (the slots' axis of the cache's layout)
        a, b = (np.take(np.asarray(x), np.arange(end), axis=axis) for x in (a, b))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_budgets_the_table_cannot_price_are_left_out():
    """A choosing job's Generator keeps the budgets its cost table prices at the run's rows per device
    (the fixture pair: the bundled pair's table, budgets 3 and 15 stood in from the H200 Qwen3-8B one,
    where budget 3 starts at 16 rows): below 16 rows per device (batch 2, 8; 16 over 2 data devices) no
    budget 3, so its program is neither compiled nor warmed up; from 16 rows per device, every budget."""
    from ddtree_jax.pair import generator, load_pair, make_plan

    pair = load_pair(FIXTURES / "qwen3_gqa4_tp", FIXTURES / "dflash_qwen3_gqa4_tp", "float32")
    plan = make_plan(pair.target, pair.draft, "ddtree", max_new_tokens=4, budget=7)
    every, no_3 = (0, 3, 7, 15), (0, 7, 15)
    for batch, dp, want in ((2, 1, no_3), (8, 1, no_3), (16, 1, every), (16, 2, no_3), (32, 2, every)):
        schedule = scheduler.Schedule(batch_size=batch, auto_budgets=every)
        gen = generator(pair, dataclasses.replace(plan, dp=dp), schedule=schedule)
        assert gen.schedule.auto_budgets == want, (batch, dp)
    fixed = generator(pair, plan, schedule=scheduler.Schedule(batch_size=2))
    assert fixed.schedule.auto_budgets == ()
