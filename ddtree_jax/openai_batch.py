"""OpenAI Batch API files (what `vllm run-batch` reads and writes), for ddtree-generate.

An input line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}`, the body holding `messages` (chat) or `prompt` (completions) and OpenAI's sampling fields
(`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `n`, `stop`, `seed`, `logprobs` and
`top_logprobs`; vLLM's `top_k` too). A file is a batch file when its first line has a `custom_id`
(`is_batch_line`). A request this engine cannot serve (another url, tools, penalties, ...) becomes that
line's `error` in the output, not a failure of the run; a line that is not a JSON object with a
`custom_id` stays an error of the file (no output line could name it).

With `--output-format openai` each prompt's samples become one output line `{"id", "custom_id",
"response": {"status_code": 200, "request_id", "body": {"id", "object", "created", "model", "choices",
"usage"}}, "error": null}`; a refused request's line is `{"id", "custom_id", "response": null, "error":
{"code", "message"}}`.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from ddtree_jax.request_outputs import CompletionOutput, Shaping, completion

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TOP_LOGPROBS = "top_logprobs"  # a request's own K of top log-probabilities (its options' logprobs: >= 1)
# body fields read (besides messages / prompt); `model`, `user` and `metadata` are accepted and unused
# (the run's --target serves every line)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "n", "stop")
IGNORED_FIELDS = ("model", "user", "metadata", "stream_options")
# body fields whose "off" value is served and any other refused, with the reason
REFUSED_FIELDS = {
    "tools": (None, "tool calls are not served"),
    "tool_choice": (None, "tool calls are not served"),
    "functions": (None, "function calls are not served"),
    "function_call": (None, "function calls are not served"),
    "response_format": (None, "structured outputs are not served"),
    "presence_penalty": (0, "penalties change the target's distribution"),
    "frequency_penalty": (0, "penalties change the target's distribution"),
    "repetition_penalty": (1, "penalties change the target's distribution"),
    "logit_bias": (None, "changes the target's distribution"),
    "stream": (False, "a batch is answered whole, never streamed"),
    "echo": (False, "the prompt is not echoed"),
    "best_of": (None, "no ranking of samples: ask for n samples"),
    "suffix": (None, "insertion (suffix) is not served"),
}


def is_batch_line(record: Any) -> bool:
    """Whether a parsed line is an OpenAI Batch API request (it has a custom_id)."""
    return isinstance(record, dict) and "custom_id" in record


def request(record: dict) -> tuple[str, Any, dict[str, Any]]:
    """(prompt kind, prompt, options) of one batch request, the options under the prompts file's keys;
    raises ValueError with the reason when this engine cannot serve it."""
    unknown = [k for k in record if k not in ("custom_id", "method", "url", "body")]
    if unknown:
        raise ValueError(f"unknown request field {unknown[0]!r}")
    if record.get("method", "POST") != "POST":
        raise ValueError(f"method {record.get('method')!r}: only POST requests are served")
    url, body = record.get("url"), record.get("body")
    if url not in (CHAT, COMPLETIONS):
        raise ValueError(f"url {url!r}: only {CHAT} and {COMPLETIONS} are served")
    if not isinstance(body, dict):
        raise ValueError("'body' must be a JSON object")
    for name, (off, why) in REFUSED_FIELDS.items():
        if body.get(name, off) not in (off, None) or (off is None and body.get(name) not in (None, [], {})):
            raise ValueError(f"'{name}' is not supported: {why}")
    prompt_key = "messages" if url == CHAT else "prompt"
    known = (prompt_key, *SAMPLING_FIELDS, *IGNORED_FIELDS, *REFUSED_FIELDS, "max_tokens", "logprobs")
    known += ("max_completion_tokens", "top_logprobs") if url == CHAT else ()
    if unknown := [k for k in body if k not in known]:
        raise ValueError(f"body field {unknown[0]!r} is not supported at {url}")
    if prompt_key not in body:
        raise ValueError(f"the body of a {url} request needs {prompt_key!r}")
    kind, value = _prompt(url, body[prompt_key])
    options = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    limits = [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if len(set(map(str, limits))) > 1:
        raise ValueError("max_tokens and max_completion_tokens differ")
    if limits:
        options["max_new_tokens"] = limits[0]
    if (k := _logprobs(url, body)) is not None:  # the engine keeps at least the top 1 beside the chosen
        options["logprobs"], options[TOP_LOGPROBS] = max(k, 1), k
    return kind, value, options


def _prompt(url: str, value: Any) -> tuple[str, Any]:
    """The prompt kind and value: chat messages (text content parts joined), or a completion's one
    prompt (text or token ids)."""
    if url == CHAT:
        if not isinstance(value, list) or not value:
            raise ValueError("'messages' must be a non-empty list")
        out = []
        for m in value:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise ValueError("only text content parts are served")
                content = "".join(str(p.get("text", "")) for p in content)
            if not isinstance(content, str) or not isinstance(m.get("role"), str):
                raise ValueError("each message needs a 'role' and a text 'content'")
            out.append({"role": m["role"], "content": content})
        return "messages", out
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # one prompt in a list
    if isinstance(value, str):
        return "prompt", value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return "input_ids", value
    raise ValueError("'prompt' must be one text or one list of token ids (one prompt per request)")


def _logprobs(url: str, body: dict) -> int | None:
    """The K of top log-probabilities asked for (None: none): chat's logprobs true with top_logprobs K,
    completions' logprobs K."""
    if url == CHAT:
        if body.get("logprobs") in (None, False):
            if body.get("top_logprobs"):
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        if body["logprobs"] is not True:
            raise ValueError("'logprobs' must be true or false at /v1/chat/completions")
        return int(body.get("top_logprobs") or 0)
    value = body.get("logprobs")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError("'logprobs' must be an integer >= 0 at /v1/completions")
    return value


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:24]


def error_line(custom_id: Any, message: str, code: str = "invalid_request") -> dict[str, Any]:
    """The output line of a request that was not served."""
    return {
        "id": f"batch_req_{_digest(custom_id)}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def response_line(
    custom_id: Any, url: str, model: str, prompt_tokens: int, results: list, logprobs: int | None, decode
) -> dict[str, Any]:
    """The output line of one served request: its samples' Results (any order) as OpenAI's choices."""
    shaping = Shaping(skip_special_tokens=True, logprobs=logprobs)
    outputs = [completion(r, shaping, decode) for r in sorted(results, key=lambda r: r.index)]
    chat = url == CHAT
    choices = [_choice(o, chat, logprobs or 0, decode) for o in outputs]
    tokens = sum(len(o.token_ids) for o in outputs)
    request_id = _digest([custom_id, "request"])
    return {
        "id": f"batch_req_{_digest(custom_id)}",
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": request_id,
            "body": {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": tokens,
                    "total_tokens": prompt_tokens + tokens,
                },
            },
        },
        "error": None,
    }


def _choice(o: CompletionOutput, chat: bool, k: int, decode) -> dict[str, Any]:
    """One sample as an OpenAI choice (chat: a message; completions: text), with its log-probabilities
    (the chosen token's and its top `k`) in that endpoint's form when asked for."""
    text = (lambda t: decode([t], False)) if decode is not None else str
    out: dict[str, Any] = {"index": o.index}
    out |= {"message": {"role": "assistant", "content": o.text}} if chat else {"text": o.text}
    lps = None
    if o.logprobs is not None:
        chosen = [(t, d[t]) for t, d in zip(o.token_ids, o.logprobs, strict=True)]
        ranked = [
            sorted(
                ((u, x) for u, x in d.items() if x.rank is not None and x.rank <= k), key=lambda e: e[1].rank
            )
            for d in o.logprobs
        ]
        if chat:
            entry = lambda t, lp, r: {  # noqa: E731
                "token": text(t),
                "logprob": lp.logprob,
                "top_logprobs": [{"token": text(u), "logprob": x.logprob} for u, x in r],
            }
            lps = {"content": [entry(t, lp, r) for (t, lp), r in zip(chosen, ranked, strict=True)]}
        else:
            lps = {
                "tokens": [text(t) for t, _ in chosen],
                "token_logprobs": [lp.logprob for _, lp in chosen],
                "top_logprobs": [{text(u): x.logprob for u, x in r} for r in ranked],
            }
    out |= {"logprobs": lps, "finish_reason": o.finish_reason}
    if o.stop_reason is not None:
        out["stop_reason"] = o.stop_reason  # vLLM's addition
    return out
