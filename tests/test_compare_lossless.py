"""ddtree-compare lossless: agreement on the fixtures, and an injected tree-verify bug found at its
prompt and position (with the target's margin there); bad flags."""

import json

import jax.numpy as jnp
import pytest
from conftest import FIXTURES, forget_programs

from ddtree_jax import engine
from ddtree_jax.compare.cli import main

TP, DRAFT = "qwen3_gqa4_tp", "dflash_qwen3_gqa4_tp"
# Fixture prompts of lengths 1, 12 and 30: absolute position 17 is output position 5 of the 12-token
# prompt only (16 outputs: position 17 is past the 1-token prompt's last output, before the 30's prompt).
PROMPT_IDS, BUG_POSITION, BUGGY_PROMPT, BUGGY_OUTPUT = ("golden-0", "golden-2", "golden-4"), 17, "golden-2", 5


@pytest.fixture
def prompts(tmp_path):
    lines = [json.loads(s) for s in (FIXTURES / "prompts.jsonl").read_text().splitlines()]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines if r["id"] in PROMPT_IDS))
    return path


def argv(prompts, report, *flags):
    return [
        "lossless",
        "--target",
        str(FIXTURES / TP),
        "--draft",
        str(FIXTURES / DRAFT),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "16",
        "--budgets",
        "7",
        "--report",
        str(report),
        *flags,
    ]


def report_of(path):
    return json.loads((path / "report.json").read_text())


def buggy_choose(real):
    """The target's choice shifted by one at BUG_POSITION, in tree verify passes only (T > 1)."""

    def choose(logits, sampling=None, position=None, model_axis=None):
        token = real(logits, sampling, position, model_axis)
        if logits.shape[1] == 1:  # prefill and ar rounds
            return token
        return jnp.where(position == BUG_POSITION, (token + 1) % logits.shape[-1], token)

    return choose


SAMPLED = ["--dtype", "float32", "--temperature", "0.8", "--seed", "3"]


def check_agrees(report):
    ok = report_of(report)
    assert ok["verdict"] == "agree"
    assert [c["name"] for c in ok["comparisons"]] == ["dflash vs ar", "ddtree-7 vs ar"]
    assert all(c["prompts"] == c["identical"] == 3 and not c["divergences"] for c in ok["comparisons"])
    assert (report / "report.md").read_text().startswith("# ddtree-compare lossless: agree")
    assert (report / "acceptance.png").stat().st_size > 1000


def check_finds_bug(report):
    bug = report_of(report)
    assert bug["verdict"] == "differ"
    for c in bug["comparisons"]:
        assert c["identical"] == 2
        (d,) = c["divergences"]
        assert (d["id"], d["position"]) == (BUGGY_PROMPT, BUGGY_OUTPUT)
        assert d["token"] == (d["reference_token"] + 1) % 256 and d["reference_is_top1"]
        assert d["margin"] > 0 and not d["near_tie"]


def test_seed_exact_sampling_agrees_then_finds_injected_bug(tmp_path, prompts, capsys, monkeypatch):
    assert main(argv(prompts, tmp_path / "ok", *SAMPLED)) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("lossless: agree")
    # progress on stderr: each method's generation as it starts and ends
    assert "ddtree-compare lossless: [1/3] ar: 3 prompts ..." in captured.err
    assert "ddtree-compare lossless: [3/3] ddtree-7: done in " in captured.err
    check_agrees(tmp_path / "ok")
    forget_programs(monkeypatch)  # the programs above were traced with the real choose
    monkeypatch.setattr(engine, "choose", buggy_choose(engine.choose))
    assert main(argv(prompts, tmp_path / "bug", *SAMPLED)) == 0  # it ran: exit 0 whatever the verdict
    check_finds_bug(tmp_path / "bug")  # margins of the Gumbel-max scores
    forget_programs(monkeypatch)


def test_greedy_finds_injected_bug(tmp_path, prompts, monkeypatch):
    """(Greedy agreement of every method with ar is tests/test_generate.py's and the external tests'.)"""
    forget_programs(monkeypatch)
    monkeypatch.setattr(engine, "choose", buggy_choose(engine.choose))
    assert main(argv(prompts, tmp_path / "bug", "--dtype", "float32")) == 0
    check_finds_bug(tmp_path / "bug")  # margins of the float32 logits
    forget_programs(monkeypatch)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--budgets", "7,x"], "--budgets '7,x': expected a comma list of integers"),
        (["--budgets", "0"], "every budget must be >= 1"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
    ],
)
def test_bad_flags(tmp_path, prompts, capsys, flags, needle):
    assert main(argv(prompts, tmp_path / "r", *flags)) == 1
    err = capsys.readouterr().err
    assert err.startswith("ddtree-compare: error: ") and needle in err and "Traceback" not in err
    assert not (tmp_path / "r").exists() and not list(tmp_path.glob(".r.*"))


def test_missing_prompts_file(tmp_path, capsys):
    assert main(argv(tmp_path / "nope.jsonl", tmp_path / "r")) == 1
    assert f"{tmp_path / 'nope.jsonl'}: file not found" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_report_dir_that_is_not_a_report_is_kept(tmp_path, prompts, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "mine.txt").write_text("x")
    assert main(argv(prompts, tmp_path / "r")) == 1
    assert "holds no report.json" in capsys.readouterr().err
    assert (tmp_path / "r" / "mine.txt").exists()


def test_bfloat16_divergences_are_near_ties(tmp_path, capsys):
    """In bfloat16 a tree may part from ar only where the target nearly ties (on this fixture, seed and
    CPU: dflash at golden-1, position 12, where ar's bf16 token is not even the float32 winner)."""
    flags = ["--dtype", "bfloat16", "--temperature", "0.9", "--top-p", "0.9", "--seed", "0"]
    argv_all = argv(FIXTURES / "prompts.jsonl", tmp_path / "r", *flags)
    assert main(argv_all) == 0
    rep = report_of(tmp_path / "r")
    found = [d for c in rep["comparisons"] for d in c["divergences"]]
    assert all(d["near_tie"] and d["gap"] <= 0.25 for d in found)
    assert rep["verdict"] == ("differ" if found else "agree")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["lossless"], "the following arguments are required: --report"),
        (["nonsense"], "argument SUBCOMMAND: invalid choice: 'nonsense'"),
        (["lossless", "--report", "r", "--dtype", "float16"], "argument --dtype: invalid choice"),
    ],
)
def test_usage_errors_exit_1(capsys, args, needle):
    """Usage errors exit 1 with one line, like every other error (argparse's own status is 2)."""
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_unwritable_report_refused_before_loading(tmp_path, prompts, capsys, monkeypatch):
    """A --report where nothing can be written (/proc refuses new directories, even to root) is refused
    before any model loads, not after the whole run."""
    from ddtree_jax.compare import inputs

    monkeypatch.setattr(inputs, "load_pair", lambda *a, **k: pytest.fail("models loaded"))
    assert main(argv(prompts, "/proc/ddtree-report")) == 1
    err = capsys.readouterr().err
    assert "--report /proc/ddtree-report: cannot write in /proc" in err and "Traceback" not in err


def test_a_failed_report_write_is_one_line(tmp_path):
    """A report that cannot be written at the end (a full disk) is one error line, and nothing is left."""
    from ddtree_jax.bench.report import run_header
    from ddtree_jax.compare.report import Report, write_report
    from ddtree_jax.errors import DDTreeError

    class Full:
        def savefig(self, *a, **k):
            raise OSError(28, "No space left on device")

    report = Report(command="lossless", verdict="agree", summary="", comparisons=[], figures={"x": Full()})
    with pytest.raises(DDTreeError, match="r: cannot write the report \\(No space left on device\\)"):
        write_report(tmp_path / "r", report, run_header(["ddtree-compare", "lossless"]))
    assert list(tmp_path.iterdir()) == []


def test_help_reads_without_matplotlib():
    """--help (the command's and a sub-command's) needs no matplotlib; a run says what to install."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['matplotlib'] = None; from ddtree_jax.compare.cli import main; "
        "codes = [main(['--help']), main(['lossless', '--help']), main(['lossless', '--report', 'r'])]; "
        "print(codes, 'matplotlib' in [m.split('.')[0] for m in sys.modules if sys.modules[m]])"
    )
    root = FIXTURES.parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().splitlines()[-1] == "[0, 0, 1] False", done.stderr[-2000:]
    assert "ddtree-compare: error: needs matplotlib: pip install 'ddtree-jax[compare]'" in done.stderr
