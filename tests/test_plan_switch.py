"""A job that chooses its ddtree budget (Schedule.auto_budgets, --budget auto): switching budgets between the
device job's calls changes the speed, never the tokens (float32, greedy and seeded sampling), and the
budgets chosen are a function of the job's own counts (the same sequence on a rerun).

Cheap: the fixture pair, one job program per budget (the chooser's, which counts the acceptance) shared by
every run here; "a fixed budget" is that program chosen at every call, and one run of today's program (no
counting) at budget 7 stands for the plain fixed plan."""

import dataclasses

import numpy as np
import pytest
from conftest import golden, golden_prompts, load_drafter, load_target

from ddtree_jax import plan_choice
from ddtree_jax.engine import Plan
from ddtree_jax.prompts import Prompt
from ddtree_jax.scheduler import Generator, Schedule

TP = "qwen3_gqa4_tp"
DRAFT = "dflash_qwen3_gqa4_tp"
PROMPTS = golden_prompts(TP) + [[7, 9, 11], list(range(200, 240)), [42] * 9, [5, 6]]
BUDGETS = (3, 7)
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 5}


class Scripted:
    """A chooser that runs the budgets of `script` in turn, one per call (cycling), counting as
    PlanChooser does: the test's forced switches."""

    def __init__(self, script):
        self.script, self.calls, self.used, self.seen = list(script), 0, {}, []

    def next_plan(self, rows, rounds=1):
        plan = plan_choice.plan_name("ddtree", self.script[self.calls % len(self.script)])
        self.calls += 1
        self.used[plan] = self.used.get(plan, 0) + rounds
        return plan

    def observe_counts(self, hits, exposure, plan=None):
        self.seen.append((plan, int(np.sum(hits)), int(np.sum(exposure))))


def generator(budgets=BUDGETS, sampling=None, budget=7):
    cfg, params = load_target(TP)
    dcfg, dparams = load_drafter(DRAFT)
    plan = Plan(cfg, dcfg, "ddtree", max_new_tokens=24, budget=budget, branching=min(budget, 32))
    # 3 rows, 9 prompts: rows refilled mid-job; 2 rounds a call: many calls, many chances to switch
    schedule = Schedule(3, chunk=16, auto_budgets=budgets, choice_rounds=2)
    return Generator(params, dparams, plan, (), defaults=sampling, schedule=schedule)


def outputs(gen):
    items = [Prompt(i, i + 1, p, {}) for i, p in enumerate(PROMPTS)]
    by_id = {r.id: r for r in gen.run(items)}
    return [(by_id[i].output_ids, by_id[i].finish_reason) for i in range(len(PROMPTS))]


def scripted(script, sampling=None):
    gen = generator(sampling=sampling)
    chooser = Scripted(script)
    gen.make_chooser = lambda: chooser
    return outputs(gen), gen, chooser


@pytest.fixture(scope="module")
def fixed_greedy():
    """Today's fixed plan (budget 7, its program counts nothing), and the HF greedy outputs."""
    out = outputs(generator(budgets=()))
    hf = [golden(TP)[f"greedy_{i}"].tolist() for i in range(5)]
    assert all(ids[: len(h)] == h[: len(ids)] for (ids, _), h in zip(out, hf, strict=False))
    return out


def test_forced_switches_leave_greedy_outputs_unchanged(fixed_greedy):
    """Every fixed budget and a switch at every call give today's budget-7 tokens."""
    for script in ([3], [7], [3, 7], [7, 7, 3]):
        out, gen, chooser = scripted(script)
        assert out == fixed_greedy, script
        ran = gen.plan_rounds
        assert set(ran) == {plan_choice.plan_name("ddtree", n) for n in set(script)}, (script, ran)
        assert sum(ran.values()) == gen.occupancy.rounds
        # the counts given to the chooser: the rounds' observed depths, every call's under its plan
        assert sum(e for _, _, e in chooser.seen) > 0 and all(p is not None for p, _, _ in chooser.seen)


def test_forced_switches_leave_sampled_outputs_unchanged():
    """Seeded sampling: the target's draw at a position is keyed by the position (sampling.choose), so
    the tokens do not depend on the tree; a budget switch at every call keeps them."""
    fixed, _, _ = scripted([7], SAMPLED)
    assert fixed == scripted([3], SAMPLED)[0]
    assert fixed == scripted([3, 7], SAMPLED)[0]
    plain = outputs(generator(budgets=(), sampling=SAMPLED))
    assert fixed == plain
    assert fixed != outputs(generator(budgets=()))  # (sampling changed something: the test can fail)


class Recording:
    """A chooser's plans as it makes them (`sequence`)."""

    def __init__(self, chooser):
        self.chooser, self.sequence, self.used = chooser, [], chooser.used

    def next_plan(self, rows, rounds=1):
        self.sequence.append(self.chooser.next_plan(rows, rounds))
        return self.sequence[-1]

    def observe_counts(self, hits, exposure, plan=None):
        self.chooser.observe_counts(hits, exposure, plan)


def test_chosen_budgets_repeat_and_keep_the_tokens(fixed_greedy):
    """PlanChooser over a cost table where the prior (the bundled pair's curve) picks budget 7 and the
    fixture drafter's low acceptance, once counted, budget 3: the budgets it chooses follow the job's
    counts, repeat on a rerun, and the tokens are the fixed plan's."""
    costs = {"ddtree-3": {1: 1.0, 16: 1.0}, "ddtree-7": {1: 1.15, 16: 1.15}}
    plans = tuple(plan_choice.plan_name("ddtree", n) for n in BUDGETS)
    runs = []
    for _ in range(2):
        gen = generator()
        table = plan_choice.CostTable("test", "tiny", costs)
        chooser = Recording(
            plan_choice.PlanChooser(table, plans, plan_choice.curve_marginals("bundled-pair", 7))
        )
        gen.make_chooser = lambda chooser=chooser: chooser
        assert outputs(gen) == fixed_greedy
        runs.append((chooser.sequence, dataclasses.asdict(chooser.chooser.counts), dict(gen.plan_rounds)))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) > 4
    assert runs[0][0][0] == "ddtree-7" and runs[0][0][-1] == "ddtree-3"  # (the counts made it switch)
    np.testing.assert_array_equal(runs[0][1]["hits"], runs[1][1]["hits"])
    assert runs[0][1]["seen"].sum() > 0 and runs[0][2] == runs[1][2]


def test_budget_auto_reproduces_the_record(tmp_path, capsys):
    """`ddtree-generate --budget auto` on the dense fixture pair (float32) writes the recorded ddtree
    output ids (tests/fixtures/recorded_outputs.json; the acceptance lengths are the budgets' own) and
    says in its summary which budgets ran."""
    import json

    from recorded_outputs import RECORD, argv, outputs, write_prompts

    from ddtree_jax.cli import main

    out = tmp_path / "auto.jsonl"
    prompts = write_prompts("dense", tmp_path / "dense.jsonl")
    assert main([*argv("dense", "ddtree", prompts, out), "--budget", "auto"]) == 0
    recorded = json.loads(RECORD.read_text())["cases"]["dense"]["ddtree"]

    def ids(lines):
        return {k: (v["output_ids"], v["finish_reason"]) for k, v in lines.items()}

    assert ids(outputs(out)) == ids(recorded)
    summary = capsys.readouterr().out
    assert "budget: auto (ddtree-" in summary and "% of " in summary, summary
    settings = json.loads((tmp_path / "auto.jsonl.settings.json").read_text())
    assert settings["auto_budgets"] == [3, 7, 15]


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--budget", "auto", "--branching", "4"], "--branching applies to a fixed --budget"),
        (["--method", "dflash", "--budget", "auto"], "apply to --method ddtree only"),
        (["--budget", "0"], "--budget must be >= 1"),
    ],
)
def test_budget_auto_flags(tmp_path, capsys, flags, words):
    from ddtree_jax.cli import main

    assert main(["--out", str(tmp_path / "x.jsonl"), *flags]) != 0
    assert words in capsys.readouterr().err
