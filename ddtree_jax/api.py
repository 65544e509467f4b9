"""The Python API, in the style of vllm.LLM and SGLang's Engine: load a target (and drafter) once, then
generate for any prompts, reusing the compiled programs.

    from ddtree_jax import LLM, SamplingParams

    llm = LLM("Qwen3-8B", "Qwen3-8B-DFlash-b16", dtype="bfloat16")  # no target: the bundled pair
    for r in llm.generate(["Write a haiku", [{"role": "user", "content": "Hi"}]],
                          SamplingParams(temperature=0.6, seed=1, max_new_tokens=64)):
        print(r.id, r.finish_reason, r.text, r.acceptance_lengths, r.e2e_latency)

`LLM` takes ddtree-generate's options (the same names, defaults and checks: settings.py), checks
everything that needs no weight before it loads any, and serves `generate` (every result, in input
order) and `stream` (each result as its row finishes). ddtree-generate is a layer over it (cli.py):
it reads a prompts file, builds the same `LLM` and writes each result as a line.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddtree_jax import compile_cache
from ddtree_jax.errors import DDTreeError
from ddtree_jax.prompts import (
    INCLUDE_STOP,
    LIMIT,
    LOGPROBS,
    SAMPLES,
    STOP,
    Prompt,
    Record,
    check_logprobs,
    check_stop,
    tokenize,
)  # fmt: skip
from ddtree_jax.sampling import check as check_sampling
from ddtree_jax.settings import SAMPLING, Settings, defaults

if TYPE_CHECKING:  # (jax loads with the weights, not with the module: the CLI's checks come first)
    from ddtree_jax.results import Result
    from ddtree_jax.scheduler import Generator

__all__ = ["LLM", "PromptInput", "Result", "SamplingParams"]


def __getattr__(name: str):
    if name == "Result":  # one output: results.Result (imported on use: it imports jax)
        from ddtree_jax.results import Result

        return Result
    raise AttributeError(name)


# One prompt: text (the chat template applied unless the LLM has chat_template=False), chat messages
# [{role, content}] (the template applied) or token ids (used as they are).
PromptInput = str | list[dict[str, str]] | list[int]

_DEFAULTS = defaults((*SAMPLING, "n"))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt: ddtree-generate's sampling flags, with their defaults and checks."""

    temperature: float = _DEFAULTS["temperature"]  # 0 = greedy
    top_k: int = _DEFAULTS["top_k"]  # 0 = off
    top_p: float = _DEFAULTS["top_p"]  # 1 = off
    seed: int = _DEFAULTS["seed"]
    max_new_tokens: int | None = None  # None: the LLM's max_new_tokens (which sizes the cache)
    n: int = _DEFAULTS["n"]  # samples; sample i seeded scheduler.sample_seed(seed, i)
    stop: tuple[str, ...] = ()  # stop strings (one string: one stop string); stops.py
    include_stop_str_in_output: bool = False  # keep the stop string at the end of the text
    logprobs: int | None = None  # K top log-probabilities per token (<= the LLM's); None: the LLM's

    def __post_init__(self):
        if isinstance(self.stop, str | list):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if (why := check_stop(self.stop)) is not None:
            raise DDTreeError(f"SamplingParams.stop {why}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise DDTreeError("SamplingParams.include_stop_str_in_output must be True or False")
        if self.logprobs is not None and (why := check_logprobs(self.logprobs)) is not None:
            raise DDTreeError(f"SamplingParams.logprobs {why}")
        for name in SAMPLING:
            if (why := check_sampling(name, getattr(self, name))) is not None:
                raise DDTreeError(f"SamplingParams.{name} {why}")
        for name in (LIMIT, SAMPLES):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise DDTreeError(f"SamplingParams.{name} must be a positive integer, got {value!r}")

    def options(self) -> dict[str, Any]:
        """The prompt options these settings give (the keys of a prompts-file line)."""
        out = {name: getattr(self, name) for name in (*SAMPLING, SAMPLES, STOP, INCLUDE_STOP)}
        out |= {} if self.logprobs is None else {LOGPROBS: self.logprobs}
        return out if self.max_new_tokens is None else out | {LIMIT: self.max_new_tokens}


# -- checks that need the configs (ddtree-generate's and the LLM's) -------------------------------


def check_limits(s: Settings, cfg, dcfg) -> None:
    """Upper bounds of --max-new-tokens, --block-size and --branching from the configs."""
    if s.max_new_tokens >= cfg.max_position_embeddings:
        raise DDTreeError(
            f"--max-new-tokens {s.max_new_tokens}: the target's context holds "
            f"{cfg.max_position_embeddings} positions, prompt included"
        )
    if dcfg is not None and s.block_size is not None and s.block_size > dcfg.block_size:
        raise DDTreeError(f"--block-size {s.block_size} exceeds the drafter's {dcfg.block_size}")
    if s.method == "ddtree" and s.branching is not None and s.branching > cfg.vocab_size:
        raise DDTreeError(f"--branching {s.branching} exceeds the vocabulary ({cfg.vocab_size} tokens)")


def check_budget(s: Settings, dcfg) -> None:
    """--budget (as resolved) at most the nodes of the drafter's top-k lattice."""
    if s.method != "ddtree":
        return
    depth = (s.block_size or dcfg.block_size) - 1
    lattice = sum(s.branching**d for d in range(1, depth + 1))
    if s.budget > lattice:
        raise DDTreeError(
            f"--budget {s.budget} exceeds the {lattice} nodes of the drafter's lattice "
            f"({depth} depths of {s.branching} candidates, --branching): no tree that large exists"
        )


def device_memory() -> int:
    """Bytes of one device's memory (the host's RAM for CPU devices, which report none)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(s: Settings, cfg, dcfg) -> None:
    """An upper bound of --budget from the device's memory: the tree's float32 attention scores."""
    if s.method != "ddtree":
        return
    from ddtree_jax import models
    from ddtree_jax.budgets import rows_per_device
    from ddtree_jax.programs import rows_to_run

    depth = (s.block_size or dcfg.block_size) - 1
    rows = rows_to_run(s.method, rows_per_device(s.batch_size, s.dp), cfg)
    heads = models.family(cfg).heads_per_device(cfg, s.tp)
    context = 16 + s.max_new_tokens + depth + 1  # the smallest cache a prompt gets
    per_pair = rows * heads * 4  # float32 attention scores per (tree token, key) pair
    memory = device_memory()
    tree = s.budget + 1
    need = per_pair * tree * (tree + context)
    if need > memory // 2:
        fits = int((-context + math.sqrt(context**2 + 4 * (memory // 2) / per_pair)) / 2) - 1
        raise DDTreeError(
            f"--budget {s.budget}: verifying {tree} tree tokens takes float32 attention scores of {rows} "
            f"rows x {heads} heads x {tree} x {tree + context} positions = {need / 1e9:.1f} GB per device, "
            f"more than half of its {memory / 1e9:.1f} GB; at most --budget {max(fits, 0)} fits"
        )


def check_prompt_logprobs(prompts, most: int, path: str = "prompts") -> None:
    """Every prompt's own `logprobs` K is at most the run's (which sizes the buffers)."""
    for p in prompts:
        if p.options.get(LOGPROBS, 0) > most:
            raise DDTreeError(
                f"{path}:{p.line}: prompt {p.id!r}: logprobs {p.options[LOGPROBS]} exceeds the run's "
                f"--logprobs {most} (which sizes the buffers)"
            )


def check_lengths(prompts, max_positions: int, max_new_tokens: int, path: str = "prompts") -> None:
    """Every prompt plus its generation must fit the model's context."""
    for p in prompts:
        if len(p.input_ids) + max_new_tokens > max_positions:
            raise DDTreeError(
                f"{path}:{p.line}: prompt {p.id!r}: {len(p.input_ids)} tokens + --max-new-tokens "
                f"{max_new_tokens} exceed the model's context of {max_positions}"
            )


def check_stops(prompts: list[Prompt], s: Settings, codec) -> None:
    """Stop strings, the run's or a prompt's, need text to search: the target's tokenizer."""
    if codec is None and (s.stop or any(p.options.get(STOP) for p in prompts)):
        raise DDTreeError("stop strings need the target's tokenizer.json (token ids alone have no text)")


def read_configs(s: Settings):
    """(target config, drafter config or None, tokenizer or None) of the settings' pair, each read once,
    the limits that need them checked."""
    from ddtree_jax.config import load_draft_config
    from ddtree_jax.models import load_target_config
    from ddtree_jax.text import TextCodec

    cfg = load_target_config(s.target, moe_sharding=s.moe_sharding)
    dcfg = load_draft_config(s.draft, cfg, s.draft_yarn_scaling) if s.draft else None
    check_limits(s, cfg, dcfg)
    codec = TextCodec(s.target) if (Path(s.target) / "tokenizer.json").exists() else None
    return cfg, dcfg, codec


# -- the engine -----------------------------------------------------------------------------------

# The LLM's options: ddtree-generate's flags that decide the models, the plan and the schedule.
OPTIONS = (
    "method", "budget", "branching", "block_size", "draft_window", "draft_yarn_scaling", "dtype",
    "attention", "tp", "dp", "moe_sharding", "dequantize", "max_new_tokens", "logprobs", "logprobs_mode",
    "batch_size",
    "static_batches", "host_stepped", "batch_invariant", "prefill_chunk", "prefill_attention",
    "params_cache", "compile_cache",
)  # fmt: skip


class LLM:
    """A target (and drafter) loaded once with ddtree-generate's options; `generate` and `stream` run
    prompts through one host loop whose compiled programs every call reuses."""

    def __init__(
        self,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        *,
        method: str | None = None,
        budget: int | None = None,
        branching: int | None = None,
        block_size: int | None = None,
        draft_window: int | None = None,
        draft_yarn_scaling: str | None = None,
        dtype: str | None = None,
        attention: str | None = None,
        tp: int | None = None,
        dp: int | None = None,
        moe_sharding: str | None = None,
        dequantize: bool | None = None,
        max_new_tokens: int | None = None,
        logprobs: int | None = None,
        logprobs_mode: str | None = None,
        batch_size: int | None = None,
        chat_template: bool = True,
        static_batches: bool | None = None,
        host_stepped: bool | None = None,
        batch_invariant: bool | None = None,
        prefill_chunk: int | None = None,
        prefill_attention: str | None = None,
        params_cache: str | Path | None = None,
        compile_cache: str | None = None,
    ):
        """Check the options (None: ddtree-generate's default; no target: the bundled pair), read the
        configs, then load the weights. ddtree's budget, when not given, is the default for
        `batch_size` rows at a short context (the prompts are not known yet)."""
        given = {k: v for k, v in locals().items() if k in (*OPTIONS, "target", "draft") and v is not None}
        flags = argparse.Namespace(**given, no_chat_template=not chat_template)
        s = Settings.from_flags(flags, prompts_file=False)
        cfg, dcfg, codec = read_configs(s)
        s = s.with_budget(cfg, [])
        check_budget(s, dcfg)
        check_memory(s, cfg, dcfg)
        self._load(s, cfg, dcfg, codec)

    @classmethod
    def from_settings(cls, s: Settings, target_cfg, draft_cfg, codec) -> LLM:
        """An LLM of checked settings (budget resolved) whose configs and tokenizer are already read,
        as ddtree-generate makes it."""
        llm = cls.__new__(cls)
        llm._load(s, target_cfg, draft_cfg, codec)
        return llm

    def _load(self, s: Settings, target_cfg, draft_cfg, codec) -> None:
        from ddtree_jax.checkpoint import params_cache
        from ddtree_jax.pair import load_generator

        compile_cache.enable(s.compile_cache)
        self.settings, self.target_config, self.codec = s, target_cfg, codec
        with params_cache(s.params_cache):
            self.generator: Generator = load_generator(s, target_cfg, draft_cfg, codec)

    # -- prompts --------------------------------------------------------------------------------------

    def prompts(
        self, prompts: PromptInput | Sequence[PromptInput], sampling: SamplingParams | Sequence | None = None
    ) -> list[Prompt]:
        """The prompts tokenized (ids: their positions in the list), each with its sampling settings
        (one SamplingParams for all or one per prompt; None: the defaults)."""
        items = [prompts] if _is_one_prompt(prompts) else list(prompts)
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(items)
        if len(sampling) != len(items):
            raise DDTreeError(f"{len(sampling)} SamplingParams for {len(items)} prompts")
        pairs = enumerate(zip(items, sampling, strict=True))
        records = [Record(i, i, _kind(p, i), p, sp.options()) for i, (p, sp) in pairs]
        for r in records:
            if r.options.get(LIMIT, 0) > self.settings.max_new_tokens:
                raise DDTreeError(
                    f"prompt {r.id}: max_new_tokens {r.options[LIMIT]} exceeds the LLM's "
                    f"max_new_tokens {self.settings.max_new_tokens} (which sizes the cache)"
                )
        cfg = self.target_config
        out = tokenize(records, "prompt", self.codec, self.settings.chat_template, cfg.vocab_size)
        check_lengths(out, cfg.max_position_embeddings, self.settings.max_new_tokens, "prompt")
        check_prompt_logprobs(out, self.settings.logprobs, "prompt")
        check_stops(out, self.settings, self.codec)
        return out

    # -- generation -----------------------------------------------------------------------------------

    def run(self, prompts: list[Prompt], skip: frozenset = frozenset()) -> Iterator[Result]:
        """Each tokenized prompt's samples' Results as they finish, the samples in `skip`
        (`prompts.sample_key`) left out (ddtree-generate's --resume)."""
        return self.generator.run(prompts, skip=skip)

    def stream(
        self, prompts: PromptInput | Sequence[PromptInput], sampling: SamplingParams | Sequence | None = None
    ) -> Iterator[Result]:
        """Each prompt's samples' Results as their rows finish (`id`: the prompt's position)."""
        return self.run(self.prompts(prompts, sampling))

    def generate(
        self, prompts: PromptInput | Sequence[PromptInput], sampling: SamplingParams | Sequence | None = None
    ) -> list[Result]:
        """Every prompt's samples' Results in input order (prompt by prompt, its samples by index)."""
        return sorted(self.stream(prompts, sampling), key=lambda r: (r.id, r.index))

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling programs so far (each in `compile_log`)."""
        return self.generator.compile_seconds

    @property
    def compile_log(self) -> list[tuple[str, float]]:
        """(program, seconds) of each compilation so far."""
        return self.generator.compile_log

    @property
    def generate_seconds(self) -> float:
        """Seconds spent generating so far, compilation left out."""
        return self.generator.generate_seconds


def _is_one_prompt(value: Any) -> bool:
    """Whether `value` is one prompt (text, token ids or chat messages), not a list of them."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and bool(value) and all(isinstance(x, int | dict) for x in value)


def _kind(prompt: Any, i: int) -> str:
    """The prompts-file key of one prompt: prompt (text), messages or input_ids."""
    if isinstance(prompt, str):
        return "prompt"
    items = prompt if isinstance(prompt, list) and prompt else [None]
    if all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        return "input_ids"
    message = lambda m: isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))  # noqa: E731
    if all(message(m) for m in items):
        return "messages"
    raise DDTreeError(f"prompt {i}: expected text, token ids or [{{role, content}}] messages: {prompt!r:.80}")
