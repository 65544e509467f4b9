"""`ddtree-bench SUB-COMMAND`: the dispatch, the one --deadline-s and the one run header of every
sub-command, and the moved benchmarks (scheduling, prefill, load) end to end at tiny sizes on the CPU."""

import json
import re
import shlex

import pytest

from ddtree_jax.bench.cli import SUBCOMMANDS, main

HEADER = {"date", "machine", "device", "device_kind", "device_count", "jax", "python", "argv", "command"}
HEADER |= {"ddtree_jax", "commit", "dirty", "jaxlib", "platform", "cpu"}  # provenance.provenance()

# the least flags each sub-command needs at a tiny size (before --out)
TINY = {
    "rounds": ["--shape", "tiny", "--draft-layers", "1", "--block-size", "4", "--contexts", "32"]
    + ["--rounds", "2", "--ceiling-bytes", "1048576", "--methods", "ar,ddtree", "--budgets", "3"],
    "profile": ["--shape", "tiny", "--num-layers", "1", "--draft-layers", "1", "--block-size", "4"]
    + ["--context", "32", "--budgets", "3", "--attention", "reference", "--rounds", "2", "--iters", "1"],
    "scheduling": ["--shape", "tiny", "--prompts", "4", "--min-len", "4", "--max-len", "16"]
    + ["--max-new-tokens", "4", "--batch-size", "2", "--budget", "3", "--prefill-chunk", "16"]
    + ["--stop-fraction", "0"],
    "prefill": ["--shape", "tiny", "--runs", "40:16,40:64", "--attention", "reference", "--reps", "1"],
    "load": ["--shape", "tiny", "--reps", "1", "--evict", "fadvise"],
    "attention": ["--quick", "--batch-sizes", "1", "--contexts", "128", "--nodes", "1,16", "--no-sweep"],
    "mla-attention": ["--quick", "--heads", "4", "--batch-sizes", "1", "--contexts", "64", "--nodes", "4"]
    + ["--sweep", "none"],
    "mosaic-attention": ["--quick", "--phases", "gqa"],
    "prefix-attention": ["--cases", "1:64", "--nodes", "8", "--calls", "1", "--reps", "1"],
    "quant": ["--quick", "--tokens", "1"],
    "topk": ["--vocab-size", "512", "--cases", "4:8,2:16"],
    "tree": ["--cases", "1:7,2:3", "--depth", "3", "--branching", "4", "--reps", "2"],
    "moe": [
        "--layers",
        "1",
        "--experts",
        "4",
        "--experts-per-token",
        "2",
        "--hidden",
        "128",
        "--width",
        "128",
    ]
    + ["--tokens", "1", "--dispatches", "gather", "--reps", "1", "--ceiling-bytes", "1048576"],
    "moe-fused": ["--tiny", "--phases", "check"],  # one JSON per phase in --out-dir (tests/test_bench_moe.py)
    "torch-step": [
        "--shapes",
        "tiny",
        "--batch-sizes",
        "1",
        "--context",
        "16",
        "--steps",
        "2",
        "--reps",
        "1",
    ],
    "plot": [],  # writes plots into a directory: no --deadline-s (below)
}
MEASURING = sorted(set(SUBCOMMANDS) - {"plot"})  # the sub-commands with --deadline-s
OUT = {"moe-fused": "--out-dir"}  # where each writes (default --out)
# one JSON of jax's devices, past its deadline: moe-fused writes its phases' (tests/test_bench_moe.py),
# torch-step needs torch and describes torch's device (tests/test_bench.py)
ONE_JSON = [name for name in MEASURING if name not in ("moe-fused", "torch-step")]


def test_every_subcommand_is_exercised_here():
    assert set(TINY) == set(SUBCOMMANDS)


def test_help_lists_the_subcommands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in SUBCOMMANDS), out
    assert main([]) == 1  # nothing to run: the same text on stderr
    assert "sub-commands:" in capsys.readouterr().err


@pytest.mark.parametrize("name", MEASURING)
def test_each_subcommand_help_lists_deadline_and_out(capsys, name):
    assert main([name, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith(f"usage: ddtree-bench {name} ")
    out = OUT.get(name, "--out")
    assert "--deadline-s DEADLINE_S" in text and f"{out} {out.lstrip('-').replace('-', '_').upper()}" in text


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_flag_has_a_help_line(capsys, name):
    """Every flag of `ddtree-bench NAME --help` says what it does (a flag line followed by its text on
    the same line or the next, never straight by the next flag)."""
    assert main([name, "--help"]) == 0
    lines = capsys.readouterr().out.split("\n")
    options = lines[next(i for i, line in enumerate(lines) if line.startswith("options")) + 1 :]
    for line, after in zip(options, [*options[1:], ""], strict=True):
        flag = re.match(r"^  (--[\w-]+)", line)
        if flag and len(line[2:].split("  ", 1)) == 1:  # no text on the flag's own line
            assert re.match(r"^ {10,}\S", after), flag.group(1)


def test_unknown_subcommand_is_one_line(capsys):
    assert main(["roundz", "--shape", "tiny"]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1, err
    names = ", ".join(SUBCOMMANDS)
    assert names.startswith("rounds, profile, scheduling, prefill, load, attention, ")
    assert err[0] == f"ddtree-bench: error: unknown sub-command 'roundz' (one of {names})"


@pytest.mark.parametrize("name", MEASURING)
@pytest.mark.parametrize("seconds", ["0", "-5"])
def test_deadline_must_be_positive(tmp_path, capsys, name, seconds):
    """A bad --deadline-s: one line naming it, exit 1, nothing written."""
    out = tmp_path / "b.json"
    assert main([name, *TINY[name], "--deadline-s", seconds, OUT.get(name, "--out"), str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ddtree-bench {name}: error: --deadline-s {seconds}: must be > 0"]
    assert not out.exists()


@pytest.mark.parametrize("name", ONE_JSON)
def test_past_deadline_skips_every_measurement_and_writes_the_header(tmp_path, capsys, name):
    """With a deadline that has passed by the first measurement, every sub-command exits 0 and writes
    one JSON: the run header (the command as run) and what it skipped, in order, measuring nothing."""
    out = tmp_path / "b.json"
    argv = [name, *TINY[name], "--deadline-s", "1e-9", "--out", str(out)]
    if name == "load":
        argv += ["--dir", str(tmp_path / "load")]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert set(meta) >= HEADER
    assert meta["argv"] == ["ddtree-bench", *argv] and meta["command"] == shlex.join(meta["argv"])
    assert meta["device_count"] == 8 and meta["device_kind"] == "cpu"  # conftest's 8 fake CPU devices
    skipped = {
        "rounds": ["ar batch 1 context 32 reference greedy", "ddtree 3 batch 1 context 32 reference greedy"],
        "profile": ["ar_verify", "ar_round", "ddtree3_verify", "ddtree3_round"],
        "scheduling": ["continuous", "static"],
        "prefill": ["40:16", "40:64"],
        "load": ["safetensors_first", "safetensors_cold", "safetensors_warm", "checks"]
        + ["convert_cold", "orbax_cold", "orbax_warm"],
        "attention": ["read ceiling", "B=1 S=128 T=1,16 1 tuning(s)"],
        "mla-attention": ["read ceiling", "{'H': 4, 'B': 1, 'S': 64, 'T': 4} 1 tuning(s)"],
        "mosaic-attention": ["ceilings"],
        "prefix-attention": ["merged check", "read ceiling", "1:64"],
        "quant": ["weights and read ceiling"],
        "topk": ["4:8", "2:16"],
        "tree": ["1:7 paths", "2:3 paths"],
        "moe": ["weights and read ceiling", {"dispatch": "gather", "format": "plain", "tokens": 1}],
    }[name]
    assert data["skipped"] == skipped
    assert not data.get("rows") and not data.get("continuous") and not data.get("seconds")
    assert "--deadline-s 1e-09 passed: skipped" in capsys.readouterr().err


def test_flags_without_a_subcommand_run_rounds(tmp_path):
    """`ddtree-bench --shape ...` (the recorded commands) is `ddtree-bench rounds --shape ...`."""
    out = tmp_path / "b.json"
    argv = [*TINY["rounds"], "--deadline-s", "1e-9", "--out", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["meta"]["argv"] == ["ddtree-bench", "rounds", *argv]


def test_scheduling_tiny(tmp_path):
    """Continuous against static batches at a tiny size: every prompt's tokens counted, the same outputs
    (float32, greedy), the speed-up their tokens/s ratio."""
    out = tmp_path / "s.json"
    assert main(["scheduling", *TINY["scheduling"], "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    cont, static = data["continuous"], data["static"]
    assert data["identical_outputs"] is True
    assert cont["tokens"] == static["tokens"] == 4 * 4  # no stop id: every prompt its 4 new tokens
    assert data["speedup"] == pytest.approx(cont["tokens_per_s"] / static["tokens_per_s"], rel=1e-2)
    assert len(data["settings"]["prompt_lengths"]) == 4 and data["skipped"] == []


def test_prefill_tiny(tmp_path):
    """One row a run, in order, with the run's length and chunk and its FLOP floor."""
    out = tmp_path / "p.json"
    assert main(["prefill", *TINY["prefill"], "--out", str(out)]) == 0
    from ddtree_jax.bench.shapes import SHAPES

    rows = json.loads(out.read_text())["rows"]
    assert [(r["length"], r["prefill_chunk"]) for r in rows] == [(40, 16), (40, 64)]
    for r in rows:
        assert r["seconds"] > 0 and r["capacity"] >= 40 and r["floor_s"] >= 0
        assert 0 <= r["first_token"] < SHAPES["tiny"].vocab_size


@pytest.mark.parametrize("bad", ["24", "24:0", "a:16", "24:8", "24:48"])
def test_prefill_bad_runs_refused(tmp_path, capsys, bad):
    out = tmp_path / "p.json"
    assert main(["prefill", "--shape", "tiny", "--runs", bad, "--out", str(out)]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"ddtree-bench prefill: error: --runs {bad}: ") and not out.exists()


def test_load_tiny(tmp_path):
    """The tiny target written as a sharded HF directory and loaded back from it and from the params
    cache: every timing once (--reps 1), the checks apart, the scratch directory removed."""
    out = tmp_path / "l.json"
    work = tmp_path / "load"
    assert main(["load", *TINY["load"], "--dir", str(work), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["seconds"]) == {
        "safetensors_first",
        "safetensors_cold",
        "safetensors_warm",
        "check_headers",
        "check_finite_compiling",
        "check_finite",
        "convert_cold",
        "orbax_cold",
        "orbax_warm",
    }
    assert all(len(v) == 1 and v[0] >= 0 for v in data["seconds"].values())
    assert data["safetensors_bytes"] > 0 and data["orbax_bytes"] > 0
    assert data["evicted_by"] == "fadvise" and not work.exists()


def test_old_spellings_still_run_with_a_warning(tmp_path, capsys):
    """--budget-s (seconds: now --deadline-s) and --batches (now --batch-sizes), as recorded commands
    spell them, run as the new flags do, each with one warning naming the new spelling."""
    out = tmp_path / "b.json"
    argv = ["rounds", *TINY["rounds"], "--batches", "2", "--budget-s", "1e-9", "--out", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    warning = "ddtree-bench rounds: warning: {} is deprecated and goes after 0.2: use {}"
    assert warning.format("--batches", "--batch-sizes") in err
    assert warning.format("--budget-s", "--deadline-s") in err
    assert json.loads(out.read_text())["skipped"] == [
        "ar batch 2 context 32 reference greedy",
        "ddtree 3 batch 2 context 32 reference greedy",
    ]


@pytest.mark.parametrize(
    "old, new, value",
    [(["--small"], "quick", True), (["--vocab", "7"], "vocab_size", 7), (["--repeats", "3"], "reps", 3)],
)
def test_a_deprecated_flag_stores_into_the_new_one(capsys, old, new, value):
    from ddtree_jax.bench import report

    p = report.parser("x", "doc")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--vocab-size", type=int, default=5)
    p.add_argument("--reps", type=int, default=1)
    report.add_deprecated(p, "--small", "--quick", flag=True)
    report.add_deprecated(p, "--vocab", "--vocab-size", type=int)
    report.add_deprecated(p, "--repeats", "--reps", type=int)
    defaults = vars(p.parse_args([]))
    assert defaults == {"quick": False, "vocab_size": 5, "reps": 1}  # the old spellings add no default
    assert vars(p.parse_args(old)) == defaults | {new: value}
    assert capsys.readouterr().err.count("is deprecated") == 1
    assert old[0] not in re.findall(r"--[a-z-]+", p.format_help())  # hidden from --help
