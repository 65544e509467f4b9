"""The prompts file: one JSON object per line, with `prompt`, `messages` or `input_ids`.

Optional per-prompt `temperature`, `top_k`, `top_p`, `seed` and `n` (samples) override the
command-line defaults; an optional `max_new_tokens` (at most the run's `--max-new-tokens`, which sizes
the cache) ends that prompt's generation earlier.
Reading has two stages: `scan_prompts` checks everything that needs no model (line size, UTF-8,
JSON, keys, ids, settings) before any weight is loaded; `tokenize` then encodes the prompts.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
from pathlib import Path
from typing import Any

from ddtree_jax import openai_batch
from ddtree_jax.errors import DDTreeError
from ddtree_jax.sampling import GREEDY as SAMPLING_OPTIONS
from ddtree_jax.sampling import check as check_sampling
from ddtree_jax.text import TextCodec

PROMPT_KINDS = ("prompt", "messages", "input_ids")
LIMIT = "max_new_tokens"  # a prompt's own limit of new tokens (SGLang's per-request name)
SAMPLES = "n"  # a prompt's own number of samples (vLLM's and SGLang's name)
STOP, INCLUDE_STOP = "stop", "include_stop_str_in_output"  # stop strings (stops.py), vLLM's names
LOGPROBS = "logprobs"  # a prompt's own K of top log-probabilities (at most the run's --logprobs)
IGNORE_EOS = "ignore_eos"  # the prompt's row runs on past the stop ids to its limit (vLLM's name)
KNOWN_KEYS = (
    "id", *PROMPT_KINDS, *SAMPLING_OPTIONS, SAMPLES, STOP, INCLUDE_STOP, LIMIT, LOGPROBS, IGNORE_EOS
)  # fmt: skip
# A line longer than this is refused before it is decoded or tokenised: 8 MiB of text is millions of
# tokens, far past any supported context (tokenising 50 MB took 58 s and 8 GB before it was refused).
MAX_LINE_BYTES = 8 << 20


@dataclasses.dataclass
class Prompt:
    """One request: its id, where it came from, its token ids, its own settings and which of its
    samples it is (`index`, 0 to n - 1)."""

    id: Any
    line: int
    input_ids: list[int]
    options: dict[str, Any]
    index: int = 0


@dataclasses.dataclass
class Record:
    """One checked line of the prompts file, not tokenised yet."""

    id: Any
    line: int
    kind: str  # "prompt" | "messages" | "input_ids" ("error": a batch request not served)
    value: Any
    options: dict[str, Any]
    endpoint: str | None = None  # an OpenAI batch request's url (openai_batch.py); None: a prompts line
    error: str | None = None  # why a batch request is not served (its output line's error)


def id_key(value: Any) -> str:
    """A canonical form of an id for comparisons (1 and "1" differ)."""
    return json.dumps(value, sort_keys=True)


def sample_key(value: Any, index: int) -> str:
    """A canonical form of sample `index` of the prompt with id `value` (sample 0: the id's own key;
    ids are strings or integers, never lists, so the keys of other samples differ from every id's)."""
    return id_key(value) if index == 0 else id_key([value, index])


def _lines(path: Path, max_line_bytes: int):
    """(line number, bytes) of every line, each refused past `max_line_bytes` before it is read whole."""
    try:
        with open(path, "rb") as f:
            n = 0
            while raw := f.readline(max_line_bytes + 2):
                n += 1
                body = raw.rstrip(b"\r\n")
                if n == 1:  # a UTF-8 byte-order mark (Windows editors write one) is no part of the JSON
                    body = body.removeprefix(codecs.BOM_UTF8)
                if len(body) > max_line_bytes:
                    raise DDTreeError(
                        f"{path}:{n}: line longer than {max_line_bytes} bytes (--max-line-bytes; "
                        "no supported context holds a prompt that long)"
                    )
                yield n, body
    except FileNotFoundError:
        raise DDTreeError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise DDTreeError(f"{path}: a directory, not a prompts file") from None
    except PermissionError:
        raise DDTreeError(f"{path}: permission denied") from None


def scan_prompts(
    path: str | Path, max_line_bytes: int = MAX_LINE_BYTES, max_new_tokens: int | None = None
) -> list[Record]:
    """Check every line for what needs no model; errors name the file and line. `max_new_tokens`:
    the run's limit, which a prompt's own may not exceed (None: not checked here)."""
    path = Path(path)
    records: list[Record] = []
    seen: dict[str, int] = {}
    batch = None  # whether the file holds OpenAI batch requests: its first line decides
    for n, raw in _lines(path, max_line_bytes):
        where = f"{path}:{n}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DDTreeError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)") from None
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise DDTreeError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(record, dict):
            raise DDTreeError(f"{where}: expected a JSON object")
        batch = openai_batch.is_batch_line(record) if batch is None else batch
        if batch != openai_batch.is_batch_line(record):
            raise DDTreeError(
                f"{where}: {'no' if batch else 'a'} custom_id: a file holds OpenAI batch requests (each with "
                "a custom_id) or prompts lines, not both"
            )
        id_ = record["custom_id"] if batch else record.get("id", len(records))
        name = "custom_id" if batch else "id"
        if not isinstance(id_, str | int) or isinstance(id_, bool):
            raise DDTreeError(f"{where}: '{name}' must be a string or an integer, got {id_!r}")
        if (first := seen.get(id_key(id_))) is not None:
            raise DDTreeError(f"{where}: duplicate {name} {id_!r} (first on line {first})")
        seen[id_key(id_)] = n
        if batch:
            records.append(_batch_record(record, id_, n, where, max_new_tokens))
            continue
        unknown = [k for k in record if k not in KNOWN_KEYS]
        if unknown:
            raise DDTreeError(f"{where}: unknown key {unknown[0]!r} (known keys: {', '.join(KNOWN_KEYS)})")
        kind, value = _prompt_field(record, where)
        records.append(Record(id_, n, kind, value, _options(record, where, max_new_tokens)))
    if not records:
        raise DDTreeError(f"{path}: no prompts")
    return records


def _batch_record(record: dict, id_: Any, n: int, where: str, max_new_tokens: int | None) -> Record:
    """One OpenAI batch request as a Record; a request this engine cannot serve as a Record with its
    `error` (the run goes on)."""
    url = record.get("url")
    try:
        kind, value, options = openai_batch.request(record)
        if value in ("", []):
            raise ValueError("empty prompt")
        limit = options.get(LIMIT)
        if isinstance(limit, int) and max_new_tokens is not None and limit > max_new_tokens:
            raise ValueError(
                f"max_tokens {limit} exceeds the run's --max-new-tokens {max_new_tokens} (which sizes the "
                "cache; run with a larger one to serve it)"
            )
        top = options.pop(openai_batch.TOP_LOGPROBS, None)
        options = _options(options, "", max_new_tokens) | (
            {} if top is None else {openai_batch.TOP_LOGPROBS: top}
        )
    except (ValueError, DDTreeError) as e:
        why = str(e).removeprefix(": ")
        return Record(id_, n, "error", record.get("body"), {}, endpoint=url, error=why)
    return Record(id_, n, kind, value, options, endpoint=url)


def _options(record: dict, where: str, max_new_tokens: int | None) -> dict[str, Any]:
    """A line's own settings (sampling, n, stop strings, limit, logprobs), checked; errors name `where`."""
    options = {k: record[k] for k in SAMPLING_OPTIONS if k in record}
    for name, option in options.items():
        if (why := check_sampling(name, option)) is not None:
            raise DDTreeError(f"{where}: '{name}' {why}")
    if SAMPLES in record:
        options[SAMPLES] = _samples(record[SAMPLES], where)
    if STOP in record:
        stop = record[STOP]
        if (why := check_stop(stop)) is not None:
            raise DDTreeError(f"{where}: '{STOP}' {why}")
        options[STOP] = (stop,) if isinstance(stop, str) else tuple(stop)
    for name in (INCLUDE_STOP, IGNORE_EOS):
        if name in record:
            if not isinstance(record[name], bool):
                raise DDTreeError(f"{where}: '{name}' must be true or false")
            options[name] = record[name]
    if LIMIT in record:
        options[LIMIT] = _limit(record[LIMIT], max_new_tokens, where)
    if LOGPROBS in record:
        if (why := check_logprobs(record[LOGPROBS])) is not None:
            raise DDTreeError(f"{where}: '{LOGPROBS}' {why}")
        options[LOGPROBS] = record[LOGPROBS]
    return options


def _limit(value: Any, most: int | None, where: str) -> int:
    """A prompt's `max_new_tokens`: a positive integer, at most the run's --max-new-tokens."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DDTreeError(f"{where}: '{LIMIT}' must be a positive integer, got {value!r}")
    if most is not None and value > most:
        raise DDTreeError(
            f"{where}: '{LIMIT}' {value} exceeds the run's --max-new-tokens {most} (which sizes the cache)"
        )
    return value


def check_logprobs(value: Any) -> str | None:
    """Why `value` is not a prompt's `logprobs` K (an integer >= 0), or None if it is."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return f"must be an integer >= 0, got {value!r}"
    return None


def check_stop(value: Any) -> str | None:
    """Why `value` is not a stop string or a list of them, or None if it is."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list | tuple) or not all(isinstance(s, str) and s for s in values):
        return f"must be a non-empty string or a list of them, got {value!r}"
    return None


def _samples(value: Any, where: str) -> int:
    """A prompt's `n`: a positive integer."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DDTreeError(f"{where}: '{SAMPLES}' must be a positive integer, got {value!r}")
    return value


def _prompt_field(record: dict, where: str) -> tuple[str, Any]:
    """The line's one prompt field, its type checked."""
    kinds = [k for k in PROMPT_KINDS if k in record]
    if len(kinds) != 1:
        raise DDTreeError(f"{where}: needs exactly one of 'prompt', 'messages', 'input_ids'")
    kind, value = kinds[0], record[kinds[0]]
    if value == "" or value == []:
        raise DDTreeError(f"{where}: empty prompt")
    if kind == "input_ids" and not (
        isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    ):
        raise DDTreeError(f"{where}: 'input_ids' must be a list of integers")
    if kind == "messages" and not (
        isinstance(value, list)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        raise DDTreeError(f"{where}: 'messages' must be a list of {{role, content}} strings")
    if kind == "prompt" and not isinstance(value, str):
        raise DDTreeError(f"{where}: 'prompt' must be a string")
    return kind, value


def tokenize(
    records: list[Record],
    path: str | Path | None,
    codec: TextCodec | None,
    chat_template: bool,
    vocab_size: int,
) -> list[Prompt]:
    """Token ids of every scanned record; errors name the file and line (`path` None: the Python API's
    `prompt N`, N the record's line: its position)."""
    prompts = []
    for r in records:
        where = f"prompt {r.line}" if path is None else f"{path}:{r.line}"
        try:
            ids = _input_ids(r, where, codec, chat_template)
        except DDTreeError as e:
            message = str(e)
            raise DDTreeError(message if message.startswith(where) else f"{where}: {message}") from None
        if not ids:
            raise DDTreeError(f"{where}: empty prompt")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise DDTreeError(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        prompts.append(Prompt(r.id, r.line, ids, dict(r.options)))
    return prompts


def read_prompts(
    path: str | Path,
    codec: TextCodec | None,
    chat_template: bool,
    vocab_size: int,
    max_new_tokens: int | None = None,
) -> list[Prompt]:
    """Parse and tokenize every line (prompts' own limits at most `max_new_tokens`); errors name the
    file and line."""
    return tokenize(scan_prompts(path, max_new_tokens=max_new_tokens), path, codec, chat_template, vocab_size)


def _input_ids(r: Record, where: str, codec: TextCodec | None, chat_template: bool) -> list[int]:
    if r.kind == "input_ids":
        return r.value
    if codec is None:
        raise DDTreeError(f"{where}: '{r.kind}' needs a tokenizer.json in the target directory")
    if r.kind == "messages":
        if not chat_template:
            return codec.encode("".join(m["content"] for m in r.value))
        return codec.encode(codec.render_chat(r.value), add_special_tokens=False)
    if chat_template and codec.template is not None:
        chat = codec.render_chat([{"role": "user", "content": r.value}])
        return codec.encode(chat, add_special_tokens=False)
    return codec.encode(r.value)
