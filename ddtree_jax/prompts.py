"""The prompts file: one JSON object per line, with `prompt`, `messages` or `input_ids`.

Optional per-prompt `temperature`, `top_k`, `top_p` and `seed` override the command-line defaults.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ddtree_jax.errors import DDTreeError
from ddtree_jax.sampling import GREEDY as SAMPLING_OPTIONS
from ddtree_jax.sampling import check as check_sampling
from ddtree_jax.text import TextCodec


@dataclasses.dataclass
class Prompt:
    """One request: its id, where it came from, its token ids and its own settings."""

    id: Any
    line: int
    input_ids: list[int]
    options: dict[str, Any]


def read_prompts(
    path: str | Path, codec: TextCodec | None, chat_template: bool, vocab_size: int
) -> list[Prompt]:
    """Parse and tokenize every line; errors name the file and line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise DDTreeError(f"{path}: file not found") from None
    except UnicodeDecodeError:
        raise DDTreeError(f"{path}: not UTF-8 text") from None
    prompts = []
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DDTreeError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise DDTreeError(f"{where}: expected a JSON object")
        ids = _input_ids(record, where, codec, chat_template)
        if not ids:
            raise DDTreeError(f"{where}: empty prompt")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise DDTreeError(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        options = {k: v for k, v in record.items() if k not in ("id", "prompt", "messages", "input_ids")}
        for name in SAMPLING_OPTIONS:
            if name in options and (why := check_sampling(name, options[name])) is not None:
                raise DDTreeError(f"{where}: '{name}' {why}")
        prompts.append(Prompt(record.get("id", len(prompts)), n, ids, options))
    if not prompts:
        raise DDTreeError(f"{path}: no prompts")
    return prompts


def _input_ids(record: dict, where: str, codec: TextCodec | None, chat_template: bool) -> list[int]:
    kinds = [k for k in ("prompt", "messages", "input_ids") if k in record]
    if len(kinds) != 1:
        raise DDTreeError(f"{where}: needs exactly one of 'prompt', 'messages', 'input_ids'")
    kind, value = kinds[0], record[kinds[0]]
    if value == "" or value == []:
        raise DDTreeError(f"{where}: empty prompt")
    if kind == "input_ids":
        if not isinstance(value, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in value
        ):
            raise DDTreeError(f"{where}: 'input_ids' must be a list of integers")
        return value
    if codec is None:
        raise DDTreeError(f"{where}: '{kind}' needs a tokenizer.json in the target directory")
    if kind == "messages":
        if not isinstance(value, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        ):
            raise DDTreeError(f"{where}: 'messages' must be a list of {{role, content}} strings")
        if not chat_template:
            return codec.encode("".join(m["content"] for m in value))
        return codec.encode(codec.render_chat(value), add_special_tokens=False)
    if not isinstance(value, str):
        raise DDTreeError(f"{where}: 'prompt' must be a string")
    if chat_template and codec.template is not None:
        return codec.encode(codec.render_chat([{"role": "user", "content": value}]), add_special_tokens=False)
    return codec.encode(value)
