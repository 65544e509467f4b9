"""Output lines of any decoder, one JSON object per line: ours, SGLang's and the DDTree reference's.

Accepted fields (anything else is an error, so a misspelt field is never silently ignored):
- ours (`ddtree-generate --out`): id, output_ids, text, finish_reason, num_output_tokens, rounds,
  acceptance_lengths;
- SGLang `Engine.generate` / `/generate`: text, output_ids, meta_info {id, completion_tokens,
  spec_verify_ct, spec_accept_length, spec_accept_histogram, ...} (meta_info's other fields are read
  past); spec_accept_histogram[n] counts the verify steps that accepted n draft tokens, i.e. rounds of
  acceptance length n + 1 in our terms (the bonus token included);
- log-probabilities of the chosen tokens, when given: output_token_logprobs ([logprob, token_id, ...]
  per token) at the top level (ours, `--logprobs K`) or in meta_info (SGLang's return_logprob);
  output_top_logprobs is read past;
- the DDTree reference: acceptance_lengths per round (tokens added, the bonus included), as ours;
- OpenAI batch output lines (`vllm run-batch`, `ddtree-generate --output-format openai`): each choice a
  sample of the prompt whose id is the line's custom_id, compared as text.
The id sits at the top level or in meta_info.id; a line without one takes its line's index among the
file's non-empty lines (0-based), as a prompt without an id does.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from typing import Any

from ddtree_jax.errors import DDTreeError
from ddtree_jax.prompts import Prompt
from ddtree_jax.text import TextCodec

FIELDS = (
    "id",
    "index",
    "output_ids",
    "text",
    "meta_info",
    "finish_reason",
    "stop_reason",
    "prompt_tokens",
    "num_output_tokens",
    "rounds",
    "acceptance_lengths",
    "e2e_latency",
    "output_token_logprobs",
    "output_top_logprobs",
)


@dataclasses.dataclass
class OutputRecord:
    """One line: the prompt id, the generated tokens (or text) and whatever acceptance it reports."""

    id: Any
    where: str  # FILE:LINE
    output_ids: list[int] | None
    text: str | None
    index: int = 0  # which of the prompt's samples (ddtree-generate --n, vLLM's n)
    acceptance_lengths: list[int] | None = None
    completion_tokens: int | None = None  # SGLang: tokens generated
    verify_rounds: int | None = None  # SGLang: spec_verify_ct, target verify passes
    accept_histogram: list[int] | None = None  # SGLang: [n] = verify steps that accepted n draft tokens
    token_logprobs: list[float | None] | None = None  # the chosen tokens' log-probabilities (None: -inf)


def _int_list(value: Any, where: str, field: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise DDTreeError(f"{where}: '{field}' must be a list of integers")
    return value


def _logprobs(value: Any, where: str) -> list[float | None]:
    """output_token_logprobs: a list of [logprob (a number or null), token_id, ...] -> the logprobs."""

    def entry(x: Any) -> bool:
        return isinstance(x, list) and len(x) >= 2 and (x[0] is None or isinstance(x[0], int | float))

    if not isinstance(value, list) or not all(entry(x) for x in value):
        raise DDTreeError(f"{where}: 'output_token_logprobs' must be a list of [logprob, token_id] entries")
    return [None if x[0] is None else float(x[0]) for x in value]


def _count(value: Any, where: str, field: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DDTreeError(f"{where}: '{field}' must be a non-negative integer, got {value!r}")
    return value


def parse_line(record: Any, where: str, index: int) -> OutputRecord:
    """One JSON object -> OutputRecord; errors name the file, line and field."""
    if not isinstance(record, dict):
        raise DDTreeError(f"{where}: expected a JSON object")
    unknown = [k for k in record if k not in FIELDS]
    if unknown:
        raise DDTreeError(f"{where}: unknown field '{unknown[0]}' (known: {', '.join(FIELDS)})")
    meta = record.get("meta_info", {})
    if not isinstance(meta, dict):
        raise DDTreeError(f"{where}: 'meta_info' must be an object")
    if "id" in record and "id" in meta and record["id"] != meta["id"]:
        raise DDTreeError(f"{where}: 'id' {record['id']!r} and 'meta_info.id' {meta['id']!r} differ")
    if "output_ids" not in record and "text" not in record:
        raise DDTreeError(f"{where}: needs 'output_ids' or 'text'")
    text = record.get("text")
    if text is not None and not isinstance(text, str):
        raise DDTreeError(f"{where}: 'text' must be a string")
    sample = record.get("index", 0)
    if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
        raise DDTreeError(f"{where}: 'index' must be a non-negative integer, got {sample!r}")
    out = OutputRecord(
        id=record.get("id", meta.get("id", index)),
        index=sample,
        where=where,
        output_ids=_int_list(record["output_ids"], where, "output_ids") if "output_ids" in record else None,
        text=text,
        # ours: num_output_tokens / rounds is the same ratio as SGLang's completion_tokens / spec_verify_ct
        completion_tokens=_count(
            meta.get("completion_tokens", record.get("num_output_tokens")), where, "completion_tokens"
        ),
        verify_rounds=_count(meta.get("spec_verify_ct", record.get("rounds")), where, "spec_verify_ct"),
    )
    if "acceptance_lengths" in record:
        out.acceptance_lengths = _int_list(record["acceptance_lengths"], where, "acceptance_lengths")
    given = record.get("output_token_logprobs", meta.get("output_token_logprobs"))
    if given is not None:
        out.token_logprobs = _logprobs(given, where)
    if meta.get("spec_accept_histogram") is not None:
        out.accept_histogram = _int_list(
            meta["spec_accept_histogram"], where, "meta_info.spec_accept_histogram"
        )
    return out


def read_outputs(path: str | Path) -> list[OutputRecord]:
    """Every non-empty line of an outputs file, in order."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a byte-order mark is no part of line 1
    except FileNotFoundError:
        raise DDTreeError(f"{path}: file not found") from None
    except UnicodeDecodeError:
        raise DDTreeError(f"{path}: not UTF-8 text") from None
    records = []
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DDTreeError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno})") from None
        if isinstance(record, dict) and "custom_id" in record:  # an OpenAI batch output line
            records += batch_records(record, f"{path}:{n}")
            continue
        records.append(parse_line(record, f"{path}:{n}", len(records)))
    if not records:
        raise DDTreeError(f"{path}: no output lines")
    return records


def batch_records(record: dict, where: str) -> list[OutputRecord]:
    """An OpenAI batch output line (`vllm run-batch`'s, `ddtree-generate --output-format openai`'s):
    one record per choice, compared as text (the id: its custom_id; the index: the choice's); a line
    holding an error has no output to compare: an error naming it."""
    if record.get("error") is not None or not isinstance(record.get("response"), dict):
        raise DDTreeError(
            f"{where}: request {record.get('custom_id')!r} has no response ({record.get('error')})"
        )
    body = record["response"].get("body")
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list):
        raise DDTreeError(f"{where}: 'response.body.choices' must be a list")
    out = []
    for i, c in enumerate(choices):
        text = (c.get("message") or {}).get("content") if "message" in c else c.get("text")
        if not isinstance(text, str):
            raise DDTreeError(f"{where}: choice {i} has no text (message.content or text)")
        out.append(
            OutputRecord(
                id=record["custom_id"], index=c.get("index", i), where=where, output_ids=None, text=text
            )
        )
    return out


def match_samples(
    records: list[OutputRecord], prompts: list[Prompt], prompts_path: str
) -> dict[tuple[Any, int], OutputRecord]:
    """(prompt id, sample index) -> its record; an id that matches no prompt, or a sample given twice,
    is an error."""
    known = {p.id for p in prompts}
    by_key: dict[tuple[Any, int], OutputRecord] = {}
    for r in records:
        if r.id not in known:
            raise DDTreeError(f"{r.where}: id {r.id!r} matches no prompt in {prompts_path}")
        if (r.id, r.index) in by_key:
            first = by_key[(r.id, r.index)].where
            raise DDTreeError(f"{r.where}: duplicate sample: id {r.id!r}, index {r.index} (first at {first})")
        by_key[(r.id, r.index)] = r
    return by_key


def tokens_of(record: OutputRecord, codec: TextCodec | None) -> list[int]:
    """The record's output ids, or its text encoded with our tokenizer (no special tokens added)."""
    if record.output_ids is not None:
        return record.output_ids
    if codec is None:
        raise DDTreeError(f"{record.where}: only 'text' given, and the target has no tokenizer.json")
    return codec.encode(record.text, add_special_tokens=False)


def texts_to_compare(
    ours: OutputRecord, theirs: OutputRecord, codec: TextCodec | None
) -> tuple[str, str] | None:
    """(our text, their text) when one side gives text only (the other's text as given, else decoded
    with our tokenizer), special tokens' text left out of both when the target has a tokenizer (SGLang's
    text skips them by default, ours keeps its stop token); None when both give output_ids."""
    if ours.output_ids is not None and theirs.output_ids is not None:
        return None

    def text(record: OutputRecord, other: OutputRecord) -> str:
        if record.text is not None:
            return record.text
        if codec is None:
            raise DDTreeError(f"{other.where}: only 'text' given, and the target has no tokenizer.json")
        return codec.decode(record.output_ids)

    pair = text(ours, theirs), text(theirs, ours)
    return pair if codec is None else (codec.without_special(pair[0]), codec.without_special(pair[1]))


RATIO = "completion_tokens / spec_verify_ct"


def mean_acceptance(
    records: list[OutputRecord], source: str | None = None
) -> tuple[float | None, str | None]:
    """Tokens per round over all records and where it came from: acceptance_lengths (every record has
    them), else completion_tokens / spec_verify_ct summed over records (RATIO; forced by `source`, to
    compare like with like), else (None, None)."""
    if source != RATIO and all(r.acceptance_lengths is not None for r in records):
        rounds = [a for r in records for a in r.acceptance_lengths]
        return (sum(rounds) / len(rounds), "acceptance_lengths") if rounds else (None, None)
    if all(r.completion_tokens is not None and r.verify_rounds for r in records):
        total = sum(r.completion_tokens for r in records) / sum(r.verify_rounds for r in records)
        return total, RATIO
    return None, None


def histogram(records: list[OutputRecord]) -> dict[int, int]:
    """Rounds per acceptance length (bonus included): from acceptance_lengths, else SGLang's histogram."""
    hist: collections.Counter = collections.Counter()
    for r in records:
        if r.acceptance_lengths is not None:
            hist.update(r.acceptance_lengths)
        elif r.accept_histogram is not None:
            hist.update({n + 1: c for n, c in enumerate(r.accept_histogram) if c})
    return dict(hist)
