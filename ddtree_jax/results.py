"""What a finished row becomes: one output line (`Result`), one sample of one prompt, read from the
decode state's outputs on the host.

The fields follow SGLang's offline output where one exists (`output_ids`, `finish_reason`,
`prompt_tokens`, `e2e_latency`, `output_token_logprobs`, `output_top_logprobs`); docs/generate.md
lists them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ddtree_jax.engine import DecodeState
from ddtree_jax.logprobs import to_lists
from ddtree_jax.prompts import Prompt
from ddtree_jax.stops import Stop, cut_rounds

OUTPUT_KEYS = ("output", "num_output", "stopped", "rounds", "acceptance", "done")


@dataclasses.dataclass
class Result:
    """One output line: one sample of one prompt."""

    id: Any
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"
    rounds: int
    acceptance_lengths: list[int]
    text: str | None = None
    index: int = 0  # which of the prompt's n samples (0 to n - 1)
    prompt_tokens: int = 0  # the prompt's token count
    e2e_latency: float = 0.0  # seconds from admission into a row to finish, compilation left out
    stop_reason: str | None = None  # the stop string that ended it (finish_reason "stop"), else None
    output_token_logprobs: list | None = None  # per token [logprob, token_id] (logprobs K > 0)
    output_top_logprobs: list | None = None  # per token K [logprob, token_id], descending

    def to_json(self) -> dict[str, Any]:
        """The JSON object written for this prompt."""
        out = {"id": self.id, "index": self.index, "output_ids": self.output_ids}
        if self.text is not None:
            out["text"] = self.text
        out |= {
            "finish_reason": self.finish_reason,
            **({} if self.stop_reason is None else {"stop_reason": self.stop_reason}),
            "prompt_tokens": self.prompt_tokens,
            "num_output_tokens": len(self.output_ids),
            "rounds": self.rounds,
            "acceptance_lengths": self.acceptance_lengths,
            "e2e_latency": round(self.e2e_latency, 6),
        }
        if self.output_token_logprobs is not None:
            out["output_token_logprobs"] = self.output_token_logprobs
            out["output_top_logprobs"] = self.output_top_logprobs
        return out


def device_outputs(state: DecodeState) -> dict[str, jax.Array]:
    """The state's per-row outputs the host reads after rounds ([B, ...] each; log-probabilities
    only when the run keeps them)."""
    out = {k: getattr(state, k) for k in OUTPUT_KEYS}
    if state.logprobs is not None:
        lp = state.logprobs
        out |= {"logprobs": lp.chosen, "top_logprobs": lp.top, "top_ids": lp.top_ids}
    return out


def fetch(tree: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """Arrays on the host; with several processes, each gathers every process's rows."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def row_result(
    prompt: Prompt,
    out: dict,
    r: int,
    latency: float,
    stop: Stop | None,
    decode: Callable[[list[int]], str] | None,
    logprobs: int,
) -> Result:
    """Row `r` of the fetched `device_outputs` as `prompt`'s Result: cut at `stop` (a stop string)
    when given, its text by `decode` (None: no text), its top `logprobs` log-probabilities (0: none)."""
    n, rounds = int(out["num_output"][r]), int(out["rounds"][r])
    ids, acceptance = out["output"][r, :n].tolist(), out["acceptance"][r, :rounds].tolist()
    if stop is not None:
        ids, acceptance = ids[: stop.tokens], cut_rounds(acceptance, stop.tokens)
    token_lp = top_lp = None
    if "logprobs" in out and logprobs:
        chosen, top, top_ids = (out[name][r] for name in ("logprobs", "top_logprobs", "top_ids"))
        token_lp, top_lp = to_lists(chosen, top[:, :logprobs], top_ids[:, :logprobs], ids)
    return Result(
        id=prompt.id,
        output_ids=ids,
        finish_reason="stop" if stop is not None or out["stopped"][r] else "length",
        rounds=len(acceptance),
        acceptance_lengths=acceptance,
        text=stop.text if stop is not None else None if decode is None else decode(ids),
        index=prompt.index,
        prompt_tokens=len(prompt.input_ids),
        e2e_latency=latency,
        stop_reason=None if stop is None else stop.matched,
        output_token_logprobs=token_lp,
        output_top_logprobs=top_lp,
    )
