"""ddtree-compare external: our outputs in SGLang's and the DDTree reference's formats agree; one
shifted token is found at its prompt and position; bad input files give clear errors."""

import json

import pytest
from conftest import FIXTURES, run

from ddtree_jax.compare.cli import main

TP, DRAFT = "qwen3_gqa4_tp", "dflash_qwen3_gqa4_tp"
SHIFTED_PROMPT, SHIFTED_POSITION = "golden-3", 6


@pytest.fixture(scope="module")
def ours():
    """Our ddtree-7 outputs (float32, 12 tokens) for the fixture prompts, as output-line dicts."""
    lines = [json.loads(s) for s in (FIXTURES / "prompts.jsonl").read_text().splitlines()]
    results = run(
        TP, [r["input_ids"] for r in lines], method="ddtree", draft_name=DRAFT, budget=7, max_new_tokens=12
    )
    return [r.to_json() | {"id": line["id"]} for r, line in zip(results, lines, strict=True)]


def sglang(line: dict) -> dict:
    """The same output as an SGLang /generate object (id in meta_info, acceptance as a histogram)."""
    hist = [0] * max(line["acceptance_lengths"])
    for a in line["acceptance_lengths"]:
        hist[a - 1] += 1  # SGLang counts accepted draft tokens, without the bonus
    meta = {
        "id": line["id"],
        "completion_tokens": line["num_output_tokens"],
        "spec_verify_ct": line["rounds"],
        "spec_accept_histogram": hist,
        "e2e_latency": 0.5,
    }
    return {"text": line.get("text", ""), "output_ids": line["output_ids"], "meta_info": meta}


def reference(line: dict) -> dict:
    """The same output as the DDTree reference reports it: ids and acceptance lengths."""
    return {
        "id": line["id"],
        "output_ids": line["output_ids"],
        "acceptance_lengths": line["acceptance_lengths"],
    }


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def argv(tmp_path, theirs, *flags, prompts=FIXTURES / "prompts.jsonl"):
    return [
        "external",
        "--target",
        str(FIXTURES / TP),
        "--prompts",
        str(prompts),
        "--dtype",
        "float32",
        "--ours",
        str(tmp_path / "ours.jsonl"),
        "--theirs",
        str(theirs),
        "--report",
        str(tmp_path / "r"),
        *flags,
    ]


@pytest.fixture
def setup(tmp_path, ours):
    write(tmp_path / "ours.jsonl", ours)
    return tmp_path


def report_of(tmp_path):
    return json.loads((tmp_path / "r" / "report.json").read_text())


@pytest.mark.parametrize("form", [sglang, reference])
def test_agrees_then_finds_shifted_token(setup, ours, capsys, form):
    tmp_path = setup
    assert main(argv(tmp_path, write(tmp_path / "theirs.jsonl", [form(r) for r in ours]))) == 0
    rep = report_of(tmp_path)
    (c,) = rep["comparisons"]
    assert rep["verdict"] == "agree" and c["prompts"] == c["identical"] == 5 and not c["divergences"]
    ours_mean = sum(a for r in ours for a in r["acceptance_lengths"]) / sum(r["rounds"] for r in ours)
    ratio = sum(r["num_output_tokens"] for r in ours) / sum(r["rounds"] for r in ours)
    if form is sglang:  # no per-round lengths: SGLang's ratio, and ours by the same rule beside it
        assert c["acceptance_source"]["theirs"] == "completion_tokens / spec_verify_ct"
        assert c["mean_acceptance"]["theirs"] == pytest.approx(ratio)
        assert c["mean_acceptance"]["ours (same rule)"] == pytest.approx(ratio)
    else:
        assert c["acceptance_source"]["theirs"] == "acceptance_lengths"
        assert c["mean_acceptance"]["theirs"] == pytest.approx(ours_mean)
    assert c["mean_acceptance"]["ours"] == pytest.approx(ours_mean)
    md = (tmp_path / "r" / "report.md").read_text()
    assert md.startswith("# ddtree-compare external: agree") and "Rounds per acceptance length" in md
    assert (tmp_path / "r" / "acceptance.png").exists()

    shifted = [dict(r, output_ids=list(r["output_ids"])) for r in ours]
    row = next(r for r in shifted if r["id"] == SHIFTED_PROMPT)
    row["output_ids"][SHIFTED_POSITION] = (row["output_ids"][SHIFTED_POSITION] + 1) % 256
    capsys.readouterr()
    assert main(argv(tmp_path, write(tmp_path / "theirs.jsonl", [form(r) for r in shifted]))) == 0
    assert capsys.readouterr().out.startswith("external: differ: theirs identical to ours on 4/5 samples")
    rep = report_of(tmp_path)
    (c,) = rep["comparisons"]
    (d,) = c["divergences"]
    assert rep["verdict"] == "differ" and c["identical"] == 4
    assert (d["id"], d["position"], d["token"]) == (
        SHIFTED_PROMPT,
        SHIFTED_POSITION,
        row["output_ids"][SHIFTED_POSITION],
    )
    assert d["reference_is_top1"] and d["margin"] > 0  # ours is the target's greedy token there


def test_ours_generated_from_the_flags(tmp_path, ours):
    """Without --ours, ours come from ddtree-generate's flags: the library run above, token for token."""
    theirs = write(tmp_path / "theirs.jsonl", [reference(r) for r in ours])
    flags = ["--draft", str(FIXTURES / DRAFT), "--budget", "7", "--max-new-tokens", "12"]
    args = argv(tmp_path, theirs, *flags)
    i = args.index("--ours")
    assert main(args[:i] + args[i + 2 :]) == 0
    rep = report_of(tmp_path)
    assert rep["verdict"] == "agree" and rep["comparisons"][0]["identical"] == 5
    assert rep["settings"]["ours"] == "generated" and rep["settings"]["budget"] == 7


def test_partial_coverage(setup, ours):
    tmp_path = setup
    theirs = [reference(ours[3]), sglang(ours[1])]
    assert main(argv(tmp_path, write(tmp_path / "theirs.jsonl", theirs))) == 0
    (c,) = report_of(tmp_path)["comparisons"]
    assert c["prompts"] == c["identical"] == 2
    assert c["not_compared"] == [{"id": ours[i]["id"], "index": 0, "missing_in": "theirs"} for i in (0, 2, 4)]
    md = (tmp_path / "r" / "report.md").read_text()
    assert f"Not compared, missing in theirs: {ours[0]['id']!r} #0" in md


def test_text_only_needs_a_tokenizer(setup, capsys):
    tmp_path = setup
    theirs = write(tmp_path / "theirs.jsonl", [{"meta_info": {"id": "golden-1"}, "text": "abc"}])
    assert main(argv(tmp_path, theirs)) == 1
    assert (
        "theirs.jsonl:1: only 'text' given, and the target has no tokenizer.json" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "lines,needle",
    [
        ([{"id": "nobody", "output_ids": [1]}], "theirs.jsonl:1: id 'nobody' matches no prompt in"),
        (
            [{"id": "golden-1", "output_ids": [1]}, {"meta_info": {"id": "golden-1"}, "output_ids": [2]}],
            "theirs.jsonl:2: duplicate sample: id 'golden-1', index 0 (first at",
        ),
        (
            [{"id": "golden-1", "meta_info": {"completion_tokens": 3}}],
            "theirs.jsonl:1: needs 'output_ids' or 'text'",
        ),
        ([{"id": "golden-1", "output_ids": [1], "logprobs": []}], "theirs.jsonl:1: unknown field 'logprobs'"),
        (
            [{"id": "golden-1", "output_ids": [1, "a"]}],
            "theirs.jsonl:1: 'output_ids' must be a list of integers",
        ),
        (
            [{"id": "golden-1", "meta_info": {"id": "golden-2"}, "output_ids": [1]}],
            "theirs.jsonl:1: 'id' 'golden-1' and",
        ),
        (["not json"], "theirs.jsonl:1: not valid JSON"),
        (['{"id": "golden-1", "output_ids": [1], "text": "x'], "Unterminated string starting at, column"),
        ([{"id": "golden-1", "index": -1, "output_ids": [1]}], "'index' must be a non-negative integer"),
    ],
)
def test_bad_their_lines(setup, capsys, lines, needle):
    tmp_path = setup
    path = tmp_path / "theirs.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    assert main(argv(tmp_path, path)) == 1
    err = capsys.readouterr().err
    assert err.startswith("ddtree-compare: error: ") and needle in err and "Traceback" not in err
    assert not (tmp_path / "r").exists() and not list(tmp_path.glob(".r.*"))


def test_missing_files(setup, capsys):
    tmp_path = setup
    assert main(argv(tmp_path, tmp_path / "none.jsonl")) == 1
    assert f"{tmp_path / 'none.jsonl'}: file not found" in capsys.readouterr().err
    theirs = write(tmp_path / "theirs.jsonl", [{"id": "golden-1", "output_ids": [1]}])
    assert main(argv(tmp_path, theirs, prompts=tmp_path / "no_prompts.jsonl")) == 1
    assert f"{tmp_path / 'no_prompts.jsonl'}: file not found" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_own_max_new_tokens_refused_before_loading(tmp_path, capsys, monkeypatch):
    """A prompt's own max_new_tokens is ddtree-generate's: the comparisons refuse it, naming the line,
    before any weight is read."""
    from ddtree_jax.compare import inputs

    monkeypatch.setattr(inputs, "load_pair", lambda *a, **k: pytest.fail("weights loaded"))
    prompts = write(
        tmp_path / "p.jsonl",
        [{"id": "a", "input_ids": [1, 2]}, {"id": "b", "input_ids": [3], "max_new_tokens": 2}],
    )
    theirs = write(tmp_path / "theirs.jsonl", [{"id": "a", "output_ids": [1]}])
    assert main(argv(tmp_path, theirs, prompts=prompts)) == 1
    assert f"{prompts}:2: 'max_new_tokens' per prompt is for ddtree-generate" in capsys.readouterr().err


def test_text_only_is_compared_as_text(tmp_path):
    """SGLang lines with text only: the same text agrees even where our tokens are not the tokenizer's
    own encoding of it (re-encoding once reported 'differ' for byte-identical text), and a stop token's
    text on our side alone (SGLang leaves special tokens out of its text) does not count; other text
    differs."""
    from ddtree_jax.text import TextCodec

    tied = FIXTURES / "qwen3_gqa2_tied"
    codec = TextCodec(tied)
    vocab = codec.tokenizer.get_vocab_size()
    pieces = {codec.decode([i]): i for i in range(3, vocab)}
    merged = next(s for s in pieces if len(s) > 1 and s[0] in pieces and s[1:] in pieces)
    ids = [pieces[merged[0]], pieces[merged[1:]]]  # one text, not the tokenizer's tokens for it
    assert codec.decode(ids) == merged and codec.encode(merged, add_special_tokens=False) != ids
    prompts = write(
        tmp_path / "p.jsonl", [{"id": "a", "input_ids": [5, 6, 7]}, {"id": "b", "input_ids": [8]}]
    )
    eos = 2  # <|im_end|>
    write(
        tmp_path / "ours.jsonl",
        [
            {"id": "a", "output_ids": ids, "text": merged},
            {"id": "b", "output_ids": [*ids, eos], "text": codec.decode([*ids, eos])},
        ],
    )
    args = argv(tmp_path, tmp_path / "theirs.jsonl", prompts=prompts)
    args[args.index("--target") + 1] = str(tied)
    theirs = [{"meta_info": {"id": "a"}, "text": merged}, {"meta_info": {"id": "b"}, "text": merged}]
    write(tmp_path / "theirs.jsonl", theirs)
    assert main(args) == 0
    (c,) = report_of(tmp_path)["comparisons"]
    assert (
        report_of(tmp_path)["verdict"] == "agree"
        and c["identical"] == 2
        and c["text_only"]
        == [
            {"id": "a", "index": 0},
            {"id": "b", "index": 0},
        ]
    )
    write(tmp_path / "theirs.jsonl", [theirs[0], {"meta_info": {"id": "b"}, "text": merged + "x"}])
    assert main(args) == 0
    (c,) = report_of(tmp_path)["comparisons"]
    assert c["identical"] == 1 and [d["id"] for d in c["divergences"]] == ["b"]


def test_logprobs_compared_where_both_give_them(setup):
    """Both sides' output_token_logprobs (ours top-level, SGLang's in meta_info as [logprob, id, text]):
    the maximum and mean absolute difference over the tokens generated alike, the largest's position;
    a line without them on one side is left out."""
    ours, theirs = [], []
    for k, line in enumerate(json.loads(s) for s in (setup / "ours.jsonl").read_text().splitlines()):
        lps = [-0.1 * (i + 1) - k for i in range(len(line["output_ids"]))]
        ours.append(
            line | {"output_token_logprobs": [[x, t] for x, t in zip(lps, line["output_ids"], strict=True)]}
        )
        shift = [0.25 if (k, i) == (1, 3) else 0.01 for i in range(len(lps))]
        entries = [[x + d, t, None] for x, d, t in zip(lps, shift, line["output_ids"], strict=True)]
        other = sglang(line)
        if k != 2:
            other["meta_info"]["output_token_logprobs"] = entries
        theirs.append(other)
    write(setup / "ours.jsonl", ours)
    assert main(argv(setup, write(setup / "sglang.jsonl", theirs))) == 0
    lp = report_of(setup)["comparisons"][0]["logprobs"]
    n = sum(len(line["output_ids"]) for k, line in enumerate(ours) if k != 2)
    assert lp["tokens"] == n
    assert lp["max_abs_diff"] == pytest.approx(0.25)
    assert lp["mean_abs_diff"] == pytest.approx((0.25 + 0.01 * (n - 1)) / n)
    assert (lp["largest"][0]["id"], lp["largest"][0]["position"]) == (ours[1]["id"], 3)
    assert "log-probabilities" in (setup / "r" / "report.md").read_text()


def test_sampled_runs_compare_sample_by_sample(tmp_path, capsys):
    """ddtree-generate --n 2 output (two lines per id, by index) read as theirs: ours generated with the
    same flags agree sample by sample; a changed sample 1 is found at its index; a missing and an extra
    sample are named; the report gives our generation's time and tok/s and no unset setting."""
    from ddtree_jax.cli import main as generate

    prompts = write(
        tmp_path / "p.jsonl", [{"id": "a", "input_ids": [5, 6, 7]}, {"id": "b", "input_ids": [9, 3]}]
    )
    sampled = ["--temperature", "0.9", "--seed", "5", "--max-new-tokens", "6", "--dtype", "float32"]
    pair = ["--target", str(FIXTURES / TP), "--prompts", str(prompts)]
    assert generate([*pair, *sampled, "--n", "2", "--out", str(tmp_path / "n2.jsonl")]) == 0
    lines = [json.loads(s) for s in (tmp_path / "n2.jsonl").read_text().splitlines()]
    assert sorted((r["id"], r["index"]) for r in lines) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    args = ["external", *pair, *sampled, "--n", "2", "--theirs", str(tmp_path / "n2.jsonl")]
    args += ["--report", str(tmp_path / "r")]
    capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("external: agree: n2 identical to ours on 4/4 samples")
    md = (tmp_path / "r" / "report.md").read_text()
    assert "None" not in md and "budget" not in md and "## Our generation" in md and "tok/s" in md
    changed = [dict(r) for r in lines]
    b1 = next(r for r in changed if (r["id"], r["index"]) == ("b", 1))
    b1["output_ids"] = [*b1["output_ids"][:2], (b1["output_ids"][2] + 1) % 256, *b1["output_ids"][3:]]
    a1 = next(r for r in changed if (r["id"], r["index"]) == ("a", 1))
    changed.remove(a1)
    changed.append(dict(a1, index=2))  # an extra sample, beyond --n 2
    write(tmp_path / "n2.jsonl", changed)
    assert main(args) == 0
    (c,) = report_of(tmp_path)["comparisons"]
    (d,) = c["divergences"]
    assert (c["prompts"], c["identical"], d["id"], d["index"], d["position"]) == (3, 2, "b", 1, 2)
    assert c["not_compared"] == [{"id": "a", "index": 1, "missing_in": "theirs"}]
    assert c["extra_samples"] == [{"id": "a", "index": 2, "in": "theirs"}]
    md = (tmp_path / "r" / "report.md").read_text()
    assert "Extra samples in theirs, beyond --n 2" in md and "'a' #2" in md


def test_divergent_tokens_shown_as_text():
    from ddtree_jax.compare.inputs import token_text
    from ddtree_jax.text import TextCodec

    codec = TextCodec(FIXTURES / "qwen3_gqa2_tied")
    assert token_text(7, codec) == f"7 {codec.decode([7])!r}" and token_text(7, None) == "7"
    assert token_text(None, codec) is None


def test_openai_batch_output_compared_as_text(tmp_path, capsys):
    """`vllm run-batch` output lines (here ddtree-generate --output-format openai's): each choice a sample
    of the prompt named by custom_id, compared as text; a changed text is found at its sample."""
    from ddtree_jax.cli import main as generate

    tied = str(FIXTURES / "qwen3_gqa2_tied")
    prompts = write(
        tmp_path / "p.jsonl", [{"id": "a", "prompt": "hello"}, {"id": "b", "input_ids": [9, 3, 4]}]
    )
    flags = ["--target", tied, "--prompts", str(prompts), "--temperature", "0.9", "--seed", "2"]
    flags += ["--max-new-tokens", "6", "--dtype", "float32"]
    run_batch = tmp_path / "run_batch.jsonl"
    assert generate([*flags, "--n", "2", "--out", str(run_batch), "--output-format", "openai"]) == 0
    args = ["external", *flags, "--n", "2", "--theirs", str(run_batch), "--report", str(tmp_path / "r")]
    capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("external: agree: run_batch identical to ours on 4/4 samples")
    (c,) = report_of(tmp_path)["comparisons"]
    assert sorted((t["id"], t["index"]) for t in c["text_only"]) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    lines = [json.loads(s) for s in run_batch.read_text().splitlines()]
    b = next(r for r in lines if r["custom_id"] == "b")
    b["response"]["body"]["choices"][1]["text"] += "!"
    write(run_batch, lines)
    assert main(args) == 0
    (c,) = report_of(tmp_path)["comparisons"]
    assert c["identical"] == 3 and [(d["id"], d["index"]) for d in c["divergences"]] == [("b", 1)]
    write(run_batch, [{"custom_id": "a", "response": None, "error": {"code": "x", "message": "m"}}])
    assert main(args) == 1 and "request 'a' has no response" in capsys.readouterr().err
