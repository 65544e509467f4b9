"""Stop strings (stops.py, the host loop's cut): the fewest tokens whose text holds a stop string,
against a token-by-token scan; and on the bundled pair (it has a tokenizer), ddtree's and dflash's
outputs with stop strings equal ar's, greedy and seeded, both equal to ar's run without stop strings
cut by that scan, for stop strings inside one token and spanning tokens."""

import dataclasses
import json

import pytest
from conftest import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax import LLM, SamplingParams
from ddtree_jax.cli import main
from ddtree_jax.errors import DDTreeError
from ddtree_jax.settings import BUNDLED
from ddtree_jax.stops import cut_rounds, find_stop, first_stop

PIECES = ["a", "b", "ab", "ba", "\n", "x", "aab"]


def scan(ids, decode, stops):
    """The reference: decode after every token, stop at the first prefix whose text holds a stop."""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        hits = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
        if hits:
            _, _, s = min(hits)
            return k, text[: text.find(s)], s
    return None


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=12),
    stops=st.lists(st.text("abx\n", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_find_stop_equals_a_token_by_token_scan(ids, stops):
    decode = lambda ids: "".join(PIECES[i] for i in ids)  # noqa: E731
    got, want = find_stop(ids, decode, stops, include=False), scan(ids, decode, stops)
    assert (got is None) == (want is None)
    if got is not None:
        assert (got.tokens, got.text, got.matched) == want
        with_stop = find_stop(ids, decode, stops, include=True)
        assert with_stop.text == want[1] + want[2] and with_stop.tokens == want[0]


def test_the_stop_that_completes_first_wins():
    assert first_stop("xabcb", ["abc", "b"]) == (2, "b")  # "b" completes before "abc" does
    assert first_stop("xabc", ["bc", "abc"]) == (1, "abc")  # both end together: the longer one
    assert first_stop("xyz", ["q"]) is None


def test_cut_rounds():
    assert cut_rounds([3, 2, 4], 1) == []  # the prefill's token alone
    assert cut_rounds([3, 2, 4], 3) == [2]  # the first round cut after its second token
    assert cut_rounds([3, 2, 4], 6) == [3, 2]
    assert cut_rounds([3, 2, 4], 8) == [3, 2, 2]


# -- on the bundled pair --------------------------------------------------------------------------

TARGET, DRAFT = str(BUNDLED / "target"), str(BUNDLED / "draft")
PROMPTS = [json.loads(line)["prompt"] for line in (BUNDLED / "prompts.jsonl").read_text().splitlines()[:2]]
KW = dict(dtype="float32", max_new_tokens=40, batch_size=2)


@pytest.fixture(scope="module")
def llms():
    return {m: LLM(TARGET, None if m == "ar" else DRAFT, method=m, **KW) for m in ("ar", "dflash", "ddtree")}


def stops_of(llm, ids: list[int]) -> list[str]:
    """Stop strings of a run's output: one spanning a token boundary (the last two characters of the
    tenth token's text and the first two of the next), one inside a later token."""
    decode = llm.codec.decode
    boundary = len(decode(ids[:10]))
    text = decode(ids)
    span = text[boundary - 2 : boundary + 2]
    inside = decode(ids[20:21]).strip()[:2] or "\n"
    return [span, inside]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_ddtree_and_dflash_stop_where_ar_stops(llms, temperature):
    sampling = dict(temperature=temperature, top_k=40, seed=5, n=2)
    free = llms["ar"].results(PROMPTS, SamplingParams(**sampling))
    stops = [tuple(stops_of(llms["ar"], r.output_ids)) for r in free[::2]]  # from each prompt's sample 0
    per_prompt = [SamplingParams(**sampling, stop=s) for s in stops]
    assert all(len(s[0]) == 4 for s in stops)  # the spanning stop string is whole
    want = []
    for r in free:
        cut = scan(r.output_ids, llms["ar"].codec.decode, stops[r.id])
        if cut is None:  # (sample 1 may hold neither stop string)
            want.append((r.id, r.index, r.output_ids, r.text, r.finish_reason, None))
        else:
            want.append((r.id, r.index, r.output_ids[: cut[0]], cut[1], "stop", cut[2]))
    assert want[0][4] == want[2][4] == "stop"
    for method, llm in llms.items():
        results = llm.results(PROMPTS, per_prompt)
        got = [(r.id, r.index, r.output_ids, r.text, r.finish_reason, r.stop_reason) for r in results]
        assert got == want, method
        for r in results:
            assert 1 + sum(r.acceptance_lengths) == len(r.output_ids)
            assert r.rounds == len(r.acceptance_lengths)
    if temperature == 0:  # the case the cut inside a round needs: ddtree accepted tokens past the stop
        free_tree = llms["ddtree"].results(PROMPTS, SamplingParams(**sampling))
        ends = [{1 + sum(r.acceptance_lengths[:j]) for j in range(r.rounds + 1)} for r in free_tree]
        assert any(len(w[2]) not in e for w, e in zip(want, ends, strict=True))
    including = [dataclasses.replace(s, include_stop_str_in_output=True) for s in per_prompt]
    included = llms["ddtree"].results(PROMPTS, including)
    assert [r.text for r in included] == [w[3] + (w[5] or "") for w in want]


def test_cli_stop_flags_equal_the_api(llms, tmp_path):
    """--stop (repeated) on a static batch run, and a prompt line's own stop: the API's results."""
    free = llms["ar"].results(PROMPTS)
    stops = stops_of(llms["ar"], free[0].output_ids)
    prompts = tmp_path / "p.jsonl"
    lines = [{"id": 0, "prompt": PROMPTS[0]}, {"id": 1, "prompt": PROMPTS[1], "stop": "\n"}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "o.jsonl"
    flags = ["--target", TARGET, "--draft", DRAFT, "--prompts", str(prompts), "--out", str(out)]
    flags += ["--dtype", "float32", "--max-new-tokens", "40", "--batch-size", "2", "--static-batches"]
    assert main([*flags, "--stop", stops[0], "--stop", stops[1]]) == 0
    got = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["id"])
    api = llms["ar"].results(PROMPTS, [SamplingParams(stop=tuple(stops)), SamplingParams(stop=("\n",))])
    keys = ("output_ids", "text", "finish_reason", "stop_reason")
    assert [{k: r.get(k) for k in keys} for r in got] == [{k: getattr(r, k) for k in keys} for r in api]
    assert all(r["finish_reason"] == "stop" for r in got)


def test_stop_strings_need_a_tokenizer(tmp_path, capsys):
    with pytest.raises(DDTreeError, match="stop strings need the target's tokenizer.json"):
        LLM(str(FIXTURES / "qwen3_gqa4_tp"), dtype="float32", max_new_tokens=4).results(
            [[1, 2]], SamplingParams(stop="x")
        )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2]}\n')
    argv = [
        "--target",
        str(FIXTURES / "qwen3_gqa4_tp"),
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "o"),
    ]
    assert main([*argv, "--stop", "x"]) == 1
    assert "stop strings need the target's tokenizer.json" in capsys.readouterr().err
    with pytest.raises(DDTreeError, match=r"SamplingParams\(stop=...\) must be a non-empty string"):
        SamplingParams(stop=("",))


@pytest.mark.parametrize(
    "line,needle",
    [
        ('{"input_ids": [1], "n": 0}', "p.jsonl:1: 'n' must be a positive integer, got 0"),
        ('{"input_ids": [1], "n": true}', "p.jsonl:1: 'n' must be a positive integer"),
        ('{"input_ids": [1], "stop": ""}', "p.jsonl:1: 'stop' must be a non-empty string or a list of them"),
        ('{"input_ids": [1], "stop": ["a", 1]}', "p.jsonl:1: 'stop' must be a non-empty string or a list"),
        ('{"input_ids": [1], "include_stop_str_in_output": 1}', "'include_stop_str_in_output' must be true"),
    ],
)
def test_prompt_line_options_are_checked(tmp_path, line, needle):
    from ddtree_jax.prompts import scan_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DDTreeError) as e:
        scan_prompts(path)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "flags,needle", [(["--n", "0"], "--n must be >= 1"), (["--stop", ""], "--stop must ")]
)
def test_flags_are_checked(flags, needle, capsys):
    assert main(["--out", "-", *flags]) == 1
    assert needle in capsys.readouterr().err
