"""`ddtree-generate` end to end, and its errors on bad input (message, exit status, no output file)."""

import json
import re
import shutil
import struct

import numpy as np
import pytest
from conftest import FIXTURES, golden, golden_prompts, xla_flags

from ddtree_jax.cli import main


def write_prompts(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_generate_ar_and_ddtree_on_fixture(tmp_path, capsys):
    name = "qwen3_gqa4_tp"
    limits = [24, 7, 24, 1, 24]  # p1 and p3 with their own max_new_tokens: the HF output's first tokens
    records = [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(golden_prompts(name))]
    records[1]["max_new_tokens"], records[3]["max_new_tokens"] = 7, 1
    prompts = write_prompts(tmp_path / "p.jsonl", records)
    for method in ("ar", "ddtree"):
        out = tmp_path / f"{method}.jsonl"
        argv = [
            "--target",
            str(FIXTURES / name),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--method",
            method,
            "--dtype",
            "float32",
            "--max-new-tokens",
            "24",
            "--batch-size",
            "1" if method == "ar" else "2",  # ar at one row runs as two (programs.rows_to_run)
        ]
        if method == "ddtree":
            argv += ["--draft", str(FIXTURES / "dflash_qwen3_gqa4_tp"), "--budget", "15"]
        else:
            argv += ["--trace-device"]  # the same tokens, and the device's busy time in the summary
        assert main(argv) == 0
        lines = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["id"])
        assert [r["id"] for r in lines] == [f"p{i}" for i in range(5)]  # written as they finish
        for i, (r, n) in enumerate(zip(lines, limits, strict=True)):
            assert r["output_ids"] == golden(name)[f"greedy_{i}"].tolist()[:n]
            assert r["num_output_tokens"] == n and r["finish_reason"] == "length"
            assert sum(r["acceptance_lengths"]) + 1 == n and len(r["acceptance_lengths"]) == r["rounds"]
    summary = capsys.readouterr().out
    assert "prompts: 5" in summary and "mean acceptance length" in summary
    assert "batch size: 1 (run as 2 rows)" in summary and "batch size: 2   attention" in summary
    busy = re.findall(r"device busy: ([\d.]+) s, \d+% of the generation \((\d+) kernels on ", summary)
    assert len(busy) == 1 and float(busy[0][0]) > 0 and int(busy[0][1]) > 0  # the ar run's only


def test_text_prompts_use_tokenizer_and_chat_template(tmp_path):
    name = "qwen3_gqa2_tied"
    g = golden(name)
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [
            {"id": "chat", "messages": [{"role": "user", "content": "hello world"}]},
            {"id": "text", "prompt": "the quick brown fox"},
            {"id": "ids", "input_ids": g["chat_ids"].tolist()},
        ],
    )
    for flags, same in ((["--no-chat-template"], False), ([], True)):
        out = tmp_path / "o.jsonl"
        argv = [
            "--target",
            str(FIXTURES / name),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--dtype",
            "float32",
            "--max-new-tokens",
            "8",
            "--overwrite",
            *flags,
        ]
        assert main(argv) == 0
        rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
        assert isinstance(rows["chat"]["text"], str)
        # with the template, the chat prompt is exactly HF's apply_chat_template ids
        assert (rows["chat"]["output_ids"] == rows["ids"]["output_ids"]) is same
        assert rows["text"]["finish_reason"] in ("stop", "length")
        if not same:
            from ddtree_jax.text import TextCodec

            codec = TextCodec(FIXTURES / name)
            assert codec.encode("the quick brown fox", add_special_tokens=False) == g["text_ids"].tolist()
            assert (
                codec.render_chat([{"role": "user", "content": "hello world"}])
                == (FIXTURES / name / "golden_chat.txt").read_text()
            )


def broken_checkpoint(tmp_path, how):
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "qwen3_gqa1", d)
    path = d / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    if how == "truncated":
        path.write_bytes(raw[: len(raw) - 1000])
    elif how in ("missing", "shape"):
        name = "model.layers.1.self_attn.k_proj.weight"
        if how == "missing":
            header[name.replace("k_proj", "kk_proj")] = header.pop(name)
        else:
            header[name]["shape"] = header[name]["shape"][::-1]
        blob = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    elif how == "architecture":
        cfg = json.loads((d / "config.json").read_text())
        cfg["architectures"] = ["MysteryForCausalLM"]
        (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "how,needle",
    [
        ("missing", "model.layers.1.self_attn.k_proj.weight' not found"),
        ("shape", "model.layers.1.self_attn.k_proj.weight' has shape [32, 64], config.json implies [64, 32]"),
        ("truncated", "truncated"),
        ("architecture", "unsupported architecture ['MysteryForCausalLM']"),
    ],
)
def test_bad_checkpoint(tmp_path, capsys, how, needle):
    d = broken_checkpoint(tmp_path, how)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": 0, "input_ids": [1, 2, 3]}])
    out = tmp_path / "out.jsonl"
    assert main(["--target", str(d), "--prompts", str(prompts), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert needle in err and str(d) in err
    assert not out.exists() and not list(tmp_path.glob(".out.jsonl*"))


@pytest.mark.parametrize(
    "line,needle",
    [
        ('{"id": 1, "input_ids": [1, 2]}\nnot json\n', "p.jsonl:2: not valid JSON"),
        ('{"id": 1, "prompt": ""}\n', "p.jsonl:1: empty prompt"),
        ('{"id": 1, "input_ids": []}\n', "p.jsonl:1: empty prompt"),
        ('{"id": 1, "input_ids": [1, 999]}\n', "p.jsonl:1: token ids [999] outside the vocabulary"),
        ('{"id": 1, "prompt": "hi"}\n', "p.jsonl:1: 'prompt' needs a tokenizer.json"),
        ('{"id": 7, "input_ids": ' + json.dumps([3] * 500) + "}\n", "p.jsonl:1: 500 tokens + --max-new"),
    ],
)
def test_bad_prompts(tmp_path, capsys, line, needle):
    (tmp_path / "p.jsonl").write_text(line)
    out = tmp_path / "out.jsonl"
    argv = [
        "--target",
        str(FIXTURES / "qwen3_gqa1"),
        "--prompts",
        str(tmp_path / "p.jsonl"),
        "--out",
        str(out),
        "--max-new-tokens",
        "16",
    ]
    assert main(argv) == 1
    assert needle in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--method", "ddtree"], "needs --draft"),
        (["--budget", "0"], "--budget must be >= 1"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--tp", "16"], "--tp 16 x --dp 1 needs 16 devices, 8 available"),
        (["--tp", "2", "--dp", "8"], "needs 16 devices"),
        (["--tp", "8"], "the target's num_attention_heads (4) is not divisible by 8"),
        (["--tp", "3"], "num_attention_heads (4) is not divisible by 3"),
    ],
)
def test_bad_flags(tmp_path, capsys, flags, needle):
    write_prompts(tmp_path / "p.jsonl", [{"id": 0, "input_ids": [1]}])
    argv = [
        "--target",
        str(FIXTURES / "qwen3_gqa1"),
        "--prompts",
        str(tmp_path / "p.jsonl"),
        "--out",
        str(tmp_path / "o.jsonl"),
        *flags,
    ]
    assert main(argv) == 1
    assert needle in capsys.readouterr().err


def test_orbax_round_trip(tmp_path):
    from conftest import load_target

    from ddtree_jax.checkpoint import restore_converted, save_converted

    _, params = load_target("qwen3_gqa1")
    save_converted(params, tmp_path / "conv")
    restored = restore_converted(tmp_path / "conv", params)
    saved, back = params["layers"][2]["qkv_proj"], restored["layers"][2]["qkv_proj"]
    for a, b in zip(np.asarray(saved), np.asarray(back), strict=True):
        np.testing.assert_array_equal(a, b)
    assert restored["embed"].shape == params["embed"].shape


def test_prompts_required_with_target_and_draft_needs_target(tmp_path, capsys):
    out = str(tmp_path / "o.jsonl")
    assert main(["--target", str(FIXTURES / "qwen3_gqa1"), "--out", out]) == 1
    assert "--prompts FILE is required with --target" in capsys.readouterr().err
    assert main(["--draft", str(FIXTURES / "dflash_qwen3_gqa1"), "--out", out]) == 1
    assert "--draft needs --target" in capsys.readouterr().err


def settings_of(argv: list[str]):
    """The Settings ddtree-generate makes of `argv`."""
    from ddtree_jax.cli import build_parser
    from ddtree_jax.settings import Settings

    return Settings.from_flags(build_parser().parse_args(argv))


def test_default_budget_follows_batch_size():
    """Without --budget, ddtree uses the measured default of the batch size (budgets.DEFAULT_BUDGETS)."""
    from ddtree_jax.pair import load_generator

    base = ["--target", str(FIXTURES / "qwen3_gqa4_tp"), "--draft", str(FIXTURES / "dflash_qwen3_gqa4_tp")]
    base += ["--prompts", "unused.jsonl", "--out", "unused.jsonl"]
    for batch, budget in ((1, 15), (3, 15), (4, 15), (15, 15), (16, 7), (63, 7), (64, 3)):
        assert load_generator(settings_of([*base, "--batch-size", str(batch)])).plan.budget == budget, batch
    assert load_generator(settings_of([*base, "--batch-size", "1", "--budget", "5"])).plan.budget == 5


def test_default_budget_of_moe_targets():
    """A MoE target's default budget comes from budgets.MOE_DEFAULT_BUDGETS (trees select many experts)."""
    from ddtree_jax.budgets import MOE_DEFAULT_BUDGETS
    from ddtree_jax.pair import load_generator

    base = ["--target", str(FIXTURES / "qwen3_moe_tp"), "--draft", str(FIXTURES / "dflash_qwen3_moe_tp")]
    base += ["--prompts", "unused.jsonl", "--out", "unused.jsonl", "--dtype", "float32"]
    for batch in (1, 16):
        gen = load_generator(settings_of([*base, "--batch-size", str(batch)]))
        assert gen.plan.budget == MOE_DEFAULT_BUDGETS[1, 0] == 7, batch


def test_default_budget_table_lookup():
    """default_budget takes the entry of the largest rows <= the run's, then of the largest context <= its
    mean context; run_context is the prompts' mean length plus its new tokens."""
    from ddtree_jax.budgets import DEFAULT_BUDGETS, default_budget, describe, run_context

    long = max(c for _, c in DEFAULT_BUDGETS)
    assert [default_budget(b, None, c) for b, c in ((1, 0), (1, long), (15, long), (16, 0))] == [
        15,
        15,
        15,
        7,
    ]
    assert default_budget(16, None, long - 1) == 7 and default_budget(64, None, long) == 15
    assert describe(DEFAULT_BUDGETS) == (
        f"15 from batch 1, 7 from batch 16 (15 from context {long}), 3 from batch 64 (15 from context {long})"
    )
    assert run_context([110, 120, 131]) == 120 and run_context([]) == 0


def test_run_budget_follows_target_kind_and_context(tmp_path, monkeypatch):
    """ddtree-generate resolves the budget once, from the target's kind and the prompts' mean context, and
    records it in the output settings (a MoE target's default is not the dense table's)."""
    from ddtree_jax import budgets
    from ddtree_jax.cli import prepare

    prompts = write_prompts(
        tmp_path / "p.jsonl", [{"id": i, "input_ids": [1] * n} for i, n in enumerate((4, 8))]
    )

    def settings(target, draft, *extra):
        flags = [
            "--target",
            str(FIXTURES / target),
            "--draft",
            str(FIXTURES / draft),
            "--prompts",
            str(prompts),
        ]
        s = settings_of([*flags, "--out", str(tmp_path / "o.jsonl"), "--max-new-tokens", "4", *extra])
        return prepare(s).settings.record()

    assert settings("qwen3_moe_tp", "dflash_qwen3_moe_tp", "--dtype", "float32")["budget"] == 7
    assert settings("qwen3_gqa4_tp", "dflash_qwen3_gqa4_tp", "--batch-size", "16")["budget"] == 7
    # mean context 6 + 4 = 10: an entry from context 10 applies, one from 11 would not
    monkeypatch.setattr(budgets, "DEFAULT_BUDGETS", {(1, 0): 15, (16, 0): 7, (16, 10): 5, (16, 11): 3})
    assert settings("qwen3_gqa4_tp", "dflash_qwen3_gqa4_tp", "--batch-size", "16")["budget"] == 5
    assert (
        settings("qwen3_gqa4_tp", "dflash_qwen3_gqa4_tp", "--batch-size", "16", "--budget", "9")["budget"]
        == 9
    )


def test_resumed_run_keeps_the_whole_files_budget(tmp_path, monkeypatch):
    """On --resume the default budget comes from the whole prompts file, not from the prompts left, so
    the settings match the first run's: contexts 2 + 4 and 12 + 4 average 11 (budget 5); the prompt
    left alone, 16, would take 3."""
    from ddtree_jax import budgets, cli
    from ddtree_jax.prompts import id_key

    monkeypatch.setattr(budgets, "DEFAULT_BUDGETS", {(1, 0): 15, (16, 0): 7, (16, 11): 5, (16, 16): 3})
    monkeypatch.setattr(cli, "check_out", lambda *a: None)
    monkeypatch.setattr(cli, "finished_ids", lambda out, settings: {id_key(0)})
    prompts = write_prompts(
        tmp_path / "p.jsonl", [{"id": 0, "input_ids": [1] * 2}, {"id": 1, "input_ids": [1] * 12}]
    )
    flags = ["--target", str(FIXTURES / "qwen3_gqa4_tp"), "--draft", str(FIXTURES / "dflash_qwen3_gqa4_tp")]
    flags += ["--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"), "--max-new-tokens", "4"]
    run = cli.prepare(settings_of([*flags, "--batch-size", "16", "--resume"]))
    assert [p.id for p in run.prompts] == [0, 1] and run.done == {id_key(0)} and run.settings.budget == 5


def test_one_ar_row_runs_as_two():
    """ar at one row per device compiles a two-row program (the faster matmul path); others do not."""
    from ddtree_jax.pair import load_generator

    base = ["--target", str(FIXTURES / "qwen3_gqa4_tp"), "--draft", str(FIXTURES / "dflash_qwen3_gqa4_tp")]
    base += ["--prompts", "unused.jsonl", "--out", "unused.jsonl"]
    for extra, rows in (
        (["--method", "ar", "--batch-size", "1"], 2),
        (["--method", "ar", "--batch-size", "3"], 3),
        (["--method", "ar", "--batch-size", "2", "--dp", "2"], 4),
        (["--method", "ddtree", "--batch-size", "1"], 1),
        (["--method", "dflash", "--batch-size", "1"], 1),
    ):
        ar = extra[1] == "ar"  # --method ar refuses --draft
        gen = load_generator(settings_of([*(base[:2] + base[4:] if ar else base), *extra]))
        assert gen.rows(100) == rows, extra


# -- input edges: refused before any model load, one line naming file and line, exit 1 -----------

PAIR = ["--target", str(FIXTURES / "qwen3_gqa4_tp"), "--draft", str(FIXTURES / "dflash_qwen3_gqa4_tp")]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--budget", "100000"], "GB per device, more than half of its"),
        (
            ["--block-size", "2", "--branching", "4", "--budget", "5"],
            "exceeds the 4 nodes of the drafter's lattice",
        ),
        (["--branching", "300"], "--branching 300 exceeds the vocabulary (256 tokens)"),
        (["--block-size", "64"], "--block-size 64 exceeds the drafter's 8"),
        (["--max-new-tokens", "512"], "the target's context holds 512 positions"),
        (["--method", "ar"], "--draft applies to --method dflash and ddtree"),
        (["--num-processes", "2"], "--coordinator, --num-processes and --process-id go together"),
    ],
)
def test_limits_refused_before_loading(tmp_path, capsys, monkeypatch, flags, needle):
    """Upper bounds come from the configs and the device memory; no weight is read."""
    from ddtree_jax import checkpoint

    monkeypatch.setattr(checkpoint, "load_params", lambda *a: pytest.fail("weights loaded"))
    write_prompts(tmp_path / "p.jsonl", [{"id": 0, "input_ids": [1, 2]}])
    argv = [*PAIR, "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl"), *flags]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize(
    "content,needle",
    [
        (
            b'{"id": 1, "input_ids": [1]}\n{"id": 2, "input_ids": [1]\n',
            "p.jsonl:2: not valid JSON (Expecting ',' delimiter, column 27)",
        ),
        (b'{"id": 1, "input_ids": [1]}\n{"id": 2, "prompt": "\xff"}\n', "p.jsonl:2: not UTF-8 text"),
        (
            b'{"id": "a", "input_ids": [1]}\n\n{"id": "b", "input_ids": [1]}\n'
            b'{"id": "a", "input_ids": [2]}\n',
            "p.jsonl:4: duplicate id 'a' (first on line 1)",
        ),
        (b'{"input_ids": [1]}\n{"id": 0, "input_ids": [1]}\n', "p.jsonl:2: duplicate id 0 (first on line 1)"),
        (
            b'{"id": 1, "input_ids": [1], "temprature": 0.5}\n',
            "p.jsonl:1: unknown key 'temprature' (known keys: "
            "id, prompt, messages, input_ids, temperature, top_k, top_p, seed, n, stop, "
            "include_stop_str_in_output, max_new_tokens, logprobs, ignore_eos)",
        ),
        (
            b'{"id": 1, "input_ids": [1]}\n{"id": 2, "input_ids": [1], "max_new_tokens": 129}\n',
            "p.jsonl:2: 'max_new_tokens' 129 exceeds the run's --max-new-tokens 128",
        ),
        (
            b'{"id": 1, "input_ids": [1], "max_new_tokens": 0}\n',
            "p.jsonl:1: 'max_new_tokens' must be a positive integer, got 0",
        ),
        (
            b'{"id": 1, "input_ids": [1], "max_new_tokens": "5"}\n',
            "p.jsonl:1: 'max_new_tokens' must be a positive integer, got '5'",
        ),
        (
            b'{"id": 1, "input_ids": [1], "max_new_tokens": true}\n',
            "p.jsonl:1: 'max_new_tokens' must be a positive integer, got True",
        ),
        (
            b'{"id": 1, "input_ids": [1], "max_new_tokens": 2.0}\n',
            "p.jsonl:1: 'max_new_tokens' must be a positive integer, got 2.0",
        ),
        (
            b'{"id": 1, "input_ids": [1]}\n{"id": 2, "input_ids": [' + b"1, " * 40 + b"1]}\n",
            "p.jsonl:2: line longer than 64 bytes (--max-line-bytes",
        ),
        (b'{"id": [1], "input_ids": [1]}\n', "p.jsonl:1: 'id' must be a string or an integer"),
    ],
)
def test_prompt_lines_refused_before_loading(tmp_path, capsys, monkeypatch, content, needle):
    """Prompt file errors name the file and line, and come before any weight is read."""
    from ddtree_jax import checkpoint

    monkeypatch.setattr(checkpoint, "load_params", lambda *a: pytest.fail("weights loaded"))
    (tmp_path / "p.jsonl").write_bytes(content)
    argv = ["--target", str(FIXTURES / "qwen3_gqa1"), "--prompts", str(tmp_path / "p.jsonl")]
    assert main([*argv, "--out", str(tmp_path / "o.jsonl"), "--max-line-bytes", "64"]) == 1
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_missing_chat_template_names_the_line(tmp_path, capsys):
    target = tmp_path / "t"
    shutil.copytree(FIXTURES / "qwen3_gqa2_tied", target)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [{"id": 0, "prompt": "hi"}, {"id": 1, "messages": [{"role": "user", "content": "hi"}]}],
    )
    assert main(["--target", str(target), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]) == 1
    assert "p.jsonl:2: the target has no chat template" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--out"], "argument --out: expected one argument"),
        (["--out", "o.jsonl", "--budget", "x"], "argument --budget: invalid int value: 'x'"),
        (
            ["--out", "o.jsonl", "--tempreature", "1"],
            "unrecognized arguments: --tempreature 1; --tempreature (did you mean --temperature?)",
        ),
        ([], "the following arguments are required: --out"),
        # no abbreviations: a script keeps working the day a flag is added
        (
            ["--out", "o.jsonl", "--temp", "0.5"],
            "unrecognized arguments: --temp 0.5; --temp (did you mean --temperature?)",
        ),
        (["--out", "o.jsonl", "--max-new", "16"], "unrecognized arguments: --max-new 16"),
        # vLLM's and SGLang's spellings
        (
            ["--out", "o.jsonl", "--max-tokens", "16"],
            "--max-tokens (did you mean --max-new-tokens? --max-tokens is vLLM's name)",
        ),
        (["--out", "o.jsonl", "--model", "M"], "--model (did you mean --target? --model is vLLM's name)"),
        (["--out", "o.jsonl", "--tp-size=2"], "--tp-size (did you mean --tp? --tp-size is SGLang's name)"),
        (["-i", "b.jsonl", "--out", "o.jsonl"], "-i (did you mean --prompts? -i is vLLM run-batch's name)"),
    ],
)
def test_usage_errors_exit_1(capsys, argv, needle):
    """argparse's errors exit with 1 and one line, like every other error (the README's promise)."""
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("ddtree-generate: error: ")


@pytest.mark.parametrize(
    "command,argv,needle",
    [
        (
            "compare",
            ["external", "--report", "r", "--theirs", "t", "--budg", "3"],
            "--budg (did you mean --budget?)",
        ),
        ("compare", ["external", "--report", "r", "--theirs", "t", "--max-tokens", "3"], "is vLLM's name"),
        ("compare", ["lossless", "--report", "r", "--temp", "1"], "unrecognized arguments: --temp 1"),
        ("bench", ["load", "--out", "o.json", "--deadline", "3"], "--deadline (did you mean --deadline-s?)"),
    ],
)
def test_every_command_refuses_abbreviations_with_a_suggestion(capsys, command, argv, needle):
    """ddtree-compare's and ddtree-bench's sub-commands parse as ddtree-generate does."""
    from ddtree_jax.bench.cli import main as bench
    from ddtree_jax.compare.cli import main as compare

    assert (compare if command == "compare" else bench)(argv) == 1
    err = capsys.readouterr().err
    assert needle in err and len(err.splitlines()) == 1, err


def test_help_shows_defaults_keys_and_exit_codes(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for needle in (
        "(default: 128)",
        "(default: 8)",
        "(default: bfloat16)",
        "(default: 0.0)",
        "(default: 8388608)",
        "keys: id, prompt, messages, input_ids, temperature, top_k, top_p, seed",
        "130 after SIGINT, 143 after SIGTERM",
        "written as each prompt finishes (so in finishing order",
        "DeepSeek-V3/Kimi-K2",
    ):
        assert needle in text, needle
    assert "in input order, flushed" not in text


@pytest.mark.parametrize("which", ["prompts_dir", "target_file", "target_missing"])
def test_wrong_kinds_of_path(tmp_path, capsys, which):
    """A directory for --prompts or a file for --target: one line, exit 1, no traceback."""
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": 0, "input_ids": [1]}])
    target = FIXTURES / "qwen3_gqa1"
    if which == "prompts_dir":
        prompts = tmp_path
    elif which == "target_file":
        target = prompts
    else:
        target = tmp_path / "nowhere"
    assert main(["--target", str(target), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("ddtree-generate: error: ") and len(err.splitlines()) == 1 and "Traceback" not in err
    )


def test_stdout_closed_early_ends_quietly(tmp_path):
    """`--out - | head -1`: once the reader is gone the run stops with 141 (128 + SIGPIPE), as other
    tools do, and no error line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    short = [p for p in golden_prompts("qwen3_gqa1") if len(p) <= 16]  # 40 lines: far more than one
    records = [{"id": i, "input_ids": short[i % len(short)]} for i in range(40)]
    prompts = write_prompts(tmp_path / "p.jsonl", records)
    argv = ["--target", str(FIXTURES / "qwen3_gqa1"), "--prompts", str(prompts), "--out", "-"]
    argv += ["--dtype", "float32", "--max-new-tokens", "4", "--batch-size", "1"]
    env = dict(os.environ, XLA_FLAGS=xla_flags(1))
    root = Path(__file__).parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree_jax.cli", *argv],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = json.loads(proc.stdout.readline())
    proc.stdout.close()  # what head does after its line
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, err
    assert first["id"] in range(40)
    assert "rror" not in err and "Traceback" not in err and "Broken pipe" not in err


def test_summary_lists_the_programs_compiled():
    """The summary's programs line: the count, and seconds per program summed over its shapes."""
    from ddtree_jax.cli import compiled_programs

    log = [("start", 1.5), ("rounds", 2.25), ("refill", 0.5), ("rounds", 0.75)]
    assert compiled_programs(log) == "programs compiled: 4 (start 1.50 s, rounds x2 3.00 s, refill 0.50 s)"
