"""What `LLM.generate` and `LLM.chat` return: one `RequestOutput` per prompt, shaped as vLLM's
(vllm/outputs.py: `request_id`, `prompt`, `prompt_token_ids`, `outputs[i]` a `CompletionOutput` with
`index`, `text`, `token_ids`, `finish_reason`, `stop_reason`, `logprobs`, `cumulative_logprob`), with
this engine's own measurements on each output besides (`rounds`, `acceptance_lengths`, `e2e_latency`).

Built on the host from the per-sample `results.Result`s that `LLM.stream` yields; nothing here imports
jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ddtree_jax.stops import cut_rounds


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's log-probability, as vLLM's `Logprob`: its rank in the target's distribution (1: the
    most likely; None: the chosen token outside the top K, whose rank was not computed)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One sample of one prompt (vLLM's `CompletionOutput`, plus this engine's measurements)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per token: {token id: Logprob}, the chosen one and top K
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop string or stop token id; None at EOS or length
    rounds: int = 0  # decoding rounds (target forwards after the prefill)
    acceptance_lengths: list[int] = dataclasses.field(default_factory=list)  # tokens committed per round
    e2e_latency: float = 0.0  # seconds from admission into a row to finish, compilation left out

    def finished(self) -> bool:
        """Whether it finished (always, offline: vLLM's method)."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """One prompt's outputs (vLLM's `RequestOutput`): its `n` samples in `outputs`, by index."""

    request_id: str
    prompt: str | None  # the text given (the chat template applied for messages); None for token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: None = None  # not computed (SamplingParams(prompt_logprobs=...) is refused)


@dataclasses.dataclass(frozen=True)
class Shaping:
    """How one prompt's Results become CompletionOutputs: a SamplingParams' output options."""

    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    detokenize: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # vLLM's K: None none, 0 the chosen token's only, K the top K besides


def completion(result, shaping: Shaping, decode: Callable[[list[int], bool], str] | None) -> CompletionOutput:
    """One Result as a CompletionOutput: cut after its first stop token id (`shaping.stop_token_ids`;
    the row ran on, the output is what a stop there gives), its text decoded as `shaping` asks
    (`decode(ids, skip_special_tokens)`; None: no tokenizer, empty text), its log-probabilities in
    vLLM's form."""
    ids, acceptance = list(result.output_ids), list(result.acceptance_lengths)
    finish, reason = result.finish_reason, result.stop_reason
    token_lp, top_lp = result.output_token_logprobs, result.output_top_logprobs
    cut = next((i for i, t in enumerate(ids) if t in shaping.stop_token_ids), None)
    if cut is not None:
        ids, acceptance, finish, reason = ids[: cut + 1], cut_rounds(acceptance, cut + 1), "stop", ids[cut]
        token_lp, top_lp = token_lp and token_lp[: cut + 1], top_lp and top_lp[: cut + 1]
    text = ""
    if shaping.detokenize and decode is not None:
        text = decode(ids, shaping.skip_special_tokens)
        if isinstance(reason, str) and (at := text.find(reason)) >= 0:  # a stop string: cut the text there
            text = text[: at + (len(reason) if shaping.include_stop_str_in_output else 0)]
    logprobs, cumulative = None, None
    if shaping.logprobs is not None and token_lp is not None:
        logprobs = [
            _token_logprobs(c, top, shaping.logprobs, decode) for c, top in zip(token_lp, top_lp, strict=True)
        ]
        cumulative = float(sum(lp for lp, _ in token_lp))
    return CompletionOutput(
        index=result.index,
        text=text,
        token_ids=ids,
        cumulative_logprob=cumulative,
        logprobs=logprobs,
        finish_reason=finish,
        stop_reason=reason,
        rounds=len(acceptance),
        acceptance_lengths=acceptance,
        e2e_latency=result.e2e_latency,
    )


def _token_logprobs(chosen: list, top: list, k: int, decode) -> dict[int, Logprob]:
    """{token id: Logprob} of one generated token: its top `k` alternatives (ranks 1..k) and the chosen
    token (`chosen` = [logprob, id], `top` = K [logprob, id] descending)."""
    text = (lambda t: decode([t], False)) if decode is not None else (lambda t: None)
    out = {int(t): Logprob(float(lp), rank + 1, text(int(t))) for rank, (lp, t) in enumerate(top[:k])}
    lp, t = chosen
    if int(t) not in out:
        ranks = [rank + 1 for rank, (_, u) in enumerate(top) if int(u) == int(t)]
        out[int(t)] = Logprob(float(lp), ranks[0] if ranks else None, text(int(t)))
    return out


def request_output(
    request_id: str, prompt: str | None, prompt_token_ids: list[int], results: list, shaping: Shaping, decode
) -> RequestOutput:
    """One prompt's RequestOutput from its samples' Results (any order)."""
    ordered = sorted(results, key=lambda r: r.index)
    outputs = [completion(r, shaping, decode) for r in ordered]
    return RequestOutput(request_id, prompt, list(prompt_token_ids), outputs)
