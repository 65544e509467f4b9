"""ddtree-generate on OpenAI Batch API files (what `vllm run-batch` reads): each request served as the
same prompt in a prompts file is (the texts, token counts and log-probabilities of ddtree-generate's own
lines), the requests it cannot serve become their lines' errors while the rest of the file runs,
`--output-format openai` writes OpenAI's batch output lines, and --resume continues such a file."""

import json

import pytest
from conftest import FIXTURES

from ddtree_jax.cli import main
from ddtree_jax.text import TextCodec

TARGET = FIXTURES / "qwen3_gqa2_tied"  # a tokenizer and a chat template
FLAGS = ["--target", str(TARGET), "--dtype", "float32", "--max-new-tokens", "8", "--logprobs", "2"]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hello there"}]


def request(custom_id, url, **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}}


SERVED = [
    request("chat", CHAT, messages=MESSAGES, max_tokens=5, n=2, temperature=0.8, seed=1),
    request("text", COMPLETIONS, prompt="once upon a time", max_tokens=6, logprobs=2),
    request("ids", COMPLETIONS, prompt=[5, 6, 7, 8], max_tokens=4, stop=["zz"]),
    request("chat-lp", CHAT, messages=MESSAGES, max_completion_tokens=3, logprobs=True, top_logprobs=1),
]
REFUSED = {
    "embed": (request("embed", "/v1/embeddings", input="x"), "url '/v1/embeddings'"),
    "tools": (request("tools", CHAT, messages=MESSAGES, tools=[{"type": "function"}]), "'tools' is not supp"),
    "long": (
        request("long", CHAT, messages=MESSAGES, max_tokens=100),
        "max_tokens 100 exceeds the run's --max-new",
    ),
    "penalty": (
        request("penalty", COMPLETIONS, prompt="a", presence_penalty=0.5),
        "'presence_penalty' is not",
    ),
    "lp": (request("lp", COMPLETIONS, prompt="a", logprobs=3), "logprobs 3 exceeds the run's --logprobs 2"),
}
# the same prompts as a prompts file (ddtree-generate's own lines are the reference)
SAME = [
    {"id": "chat", "messages": MESSAGES, "max_new_tokens": 5, "n": 2, "temperature": 0.8, "seed": 1},
    {"id": "text", "prompt": "once upon a time", "max_new_tokens": 6, "logprobs": 2},
    {"id": "ids", "input_ids": [5, 6, 7, 8], "max_new_tokens": 4, "stop": ["zz"]},
    {"id": "chat-lp", "messages": MESSAGES, "max_new_tokens": 3, "logprobs": 1},
]


def write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    lines = [SERVED[0], REFUSED["embed"][0], *SERVED[1:3], REFUSED["tools"][0], REFUSED["long"][0]]
    lines += [REFUSED["penalty"][0], SERVED[3], REFUSED["lp"][0]]
    batch, same = write(tmp / "batch.jsonl", lines), write(tmp / "same_prompts.jsonl", SAME)
    out = {}
    for name, prompts, fmt in (("openai", batch, "openai"), ("ours", batch, "ours"), ("same", same, "ours")):
        out[name] = tmp / f"{name}.jsonl"
        argv = [*FLAGS, "--prompts", str(prompts), "--out", str(out[name]), "--output-format", fmt]
        assert main(argv) == 0
    return tmp, batch, {name: read(path) for name, path in out.items()}


def test_served_requests_equal_the_same_prompts_lines(runs):
    _, _, got = runs
    codec = TextCodec(TARGET)
    ours = {(r["id"], r["index"]): r for r in got["same"]}
    lines = {r["custom_id"]: r for r in got["openai"]}
    assert sorted(lines) == sorted([*(r["custom_id"] for r in SERVED), *REFUSED])
    for req in SERVED:
        line = lines[req["custom_id"]]
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == ("chat.completion" if req["url"] == CHAT else "text_completion")
        choices = body["choices"]
        refs = [ours[(req["custom_id"], i)] for i in range(len(choices))]
        assert len(choices) == req["body"].get("n", 1)
        for c, ref in zip(choices, refs, strict=True):
            text = codec.tokenizer.decode(ref["output_ids"], skip_special_tokens=True)
            assert (c["message"]["content"] if req["url"] == CHAT else c["text"]) == text
            assert c["finish_reason"] == ref["finish_reason"]
        assert body["usage"] == {
            "prompt_tokens": refs[0]["prompt_tokens"],
            "completion_tokens": sum(len(r["output_ids"]) for r in refs),
            "total_tokens": refs[0]["prompt_tokens"] + sum(len(r["output_ids"]) for r in refs),
        }
    text = lines["text"]["response"]["body"]["choices"][0]["logprobs"]  # completions' form, top 2
    assert text["token_logprobs"] == [lp for lp, _ in ours[("text", 0)]["output_token_logprobs"]]
    assert [len(t) for t in text["top_logprobs"]] == [2] * len(text["tokens"])
    chat = lines["chat-lp"]["response"]["body"]["choices"][0]["logprobs"]["content"]  # chat's form, top 1
    assert [t["logprob"] for t in chat] == [lp for lp, _ in ours[("chat-lp", 0)]["output_token_logprobs"]]
    assert [[x["logprob"] for x in t["top_logprobs"]] for t in chat] == [
        [top[0][0]] for top in ours[("chat-lp", 0)]["output_top_logprobs"]
    ]
    assert lines["chat"]["response"]["body"]["choices"][0]["logprobs"] is None  # not asked for


def test_requests_not_served_are_their_lines_errors(runs):
    _, _, got = runs
    lines = {r["custom_id"]: r for r in got["openai"]}
    for custom_id, (_, needle) in REFUSED.items():
        line = lines[custom_id]
        assert line["response"] is None and needle in line["error"]["message"], line
    ours = {r["id"]: r for r in got["ours"] if "error" in r}
    assert sorted(ours) == sorted(REFUSED) and all("--" not in k for k in ours)
    served = [r for r in got["ours"] if "error" not in r]
    assert sorted((r["id"], r["index"], r["output_ids"]) for r in served) == sorted(
        (r["id"], r["index"], r["output_ids"]) for r in got["same"]
    )


def test_resume_continues_a_batch_output(runs, tmp_path):
    _, batch, got = runs
    out = tmp_path / "o.jsonl"
    argv = [*FLAGS, "--prompts", str(batch), "--out", str(out), "--output-format", "openai"]
    assert main(argv) == 0
    whole = out.read_text().splitlines()
    kept = whole[:3]
    out.write_text("".join(line + "\n" for line in kept) + whole[3][:20])  # a killed run's cut line
    assert main([*argv, "--resume"]) == 0
    lines = out.read_text().splitlines()
    assert lines[:3] == kept and len(lines) == len(whole)
    untimed = lambda rows: sorted(  # noqa: E731
        json.dumps(
            {
                **r,
                "response": r["response"]
                and {**r["response"], "body": {**r["response"]["body"], "created": 0}},
            }
        )
        for r in rows
    )
    assert untimed(map(json.loads, lines)) == untimed(map(json.loads, whole))
    assert main([*argv[:-2], "--output-format", "ours", "--resume"]) == 1  # another format: refused


@pytest.mark.parametrize(
    "lines,needle",
    [
        ([SERVED[0], {"prompt": "x"}], "b.jsonl:2: no custom_id: a file holds OpenAI batch requests"),
        ([SERVED[0], SERVED[0]], "b.jsonl:2: duplicate custom_id 'chat' (first on line 1)"),
        ([{"custom_id": ["x"], "url": CHAT}], "b.jsonl:1: 'custom_id' must be a string or an integer"),
    ],
)
def test_a_file_that_is_not_a_batch_file_stops_the_run(tmp_path, capsys, lines, needle):
    prompts = write(tmp_path / "b.jsonl", lines)
    assert main([*FLAGS, "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]) == 1
    assert needle in capsys.readouterr().err and not (tmp_path / "o.jsonl").exists()


def test_json_errors_read_once(tmp_path, capsys):
    """json's "Unterminated string starting at" ends its message: no "at at column"."""
    (tmp_path / "b.jsonl").write_text('{"prompt": "x\n')
    assert main([*FLAGS, "--prompts", str(tmp_path / "b.jsonl"), "--out", str(tmp_path / "o.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "not valid JSON (Unterminated string starting at, column 12)" in err and "at at" not in err
