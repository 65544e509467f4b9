"""The Python API, in the style of vllm.LLM (its names taken as well) and SGLang's Engine: load a
target (and drafter) once, then generate for any prompts, reusing the compiled programs.

    from ddtree_jax import LLM, SamplingParams

    llm = LLM("Qwen3-8B", "Qwen3-8B-DFlash-b16", dtype="bfloat16")  # no target: the bundled pair
    # or vLLM's: LLM(model="Qwen3-8B", speculative_config={"method": "ddtree", "model": "...-DFlash-b16"})
    for o in llm.generate(["Write a haiku", {"prompt_token_ids": [1, 2, 3]}],
                          SamplingParams(temperature=0.6, seed=1, max_tokens=64)):
        print(o.request_id, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].acceptance_lengths)

`LLM` takes ddtree-generate's options (the same names, defaults and checks: settings.py) or vLLM's names
for them, checks everything that needs no weight before it loads any, and serves `generate` and `chat`
(vLLM-shaped RequestOutputs: request_outputs.py), `results` (every sample's Result, in input order) and
`stream` (each Result as its row finishes). Errors name keyword arguments, never flags, and a prompt as
`prompt N` (its position). ddtree-generate is a layer over it (cli.py): it reads a prompts file, builds
the same `LLM` and writes each result as a line.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddtree_jax import compile_cache
from ddtree_jax.budgets import ddtree_branching
from ddtree_jax.errors import DDTreeError
from ddtree_jax.prompts import (
    IGNORE_EOS,
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
from ddtree_jax.request_outputs import RequestOutput, Shaping, request_output
from ddtree_jax.sampling import check as check_sampling
from ddtree_jax.settings import SAMPLING, Settings, api_words, defaults, suggestion

if TYPE_CHECKING:  # (jax loads with the weights, not with the module: the CLI's checks come first)
    from ddtree_jax.results import Result
    from ddtree_jax.scheduler import Generator

__all__ = ["LLM", "PromptInput", "RequestOutput", "Result", "SamplingParams"]


def __getattr__(name: str):
    if name == "Result":  # one output: results.Result (imported on use: it imports jax)
        from ddtree_jax.results import Result

        return Result
    raise AttributeError(name)


# One prompt: text (the chat template applied unless the LLM has chat_template=False), chat messages
# [{role, content}] (the template applied) or token ids (used as they are).
PromptInput = str | list[dict[str, str]] | list[int]

_DEFAULTS = defaults((*SAMPLING, "n"))


class UnknownArgument(DDTreeError, TypeError):
    """A keyword argument the API does not take (a TypeError, as Python's own, and a DDTreeError)."""


def check_keywords(owner: str, given: dict[str, Any], known: list[str]) -> None:
    """Refuse keyword arguments of `given` not in `known`, with a "did you mean" (ours for a close
    name, or for vLLM's and SGLang's spellings)."""
    for name in given:
        if name not in known:
            raise UnknownArgument(
                f"{owner}() got an unexpected keyword argument {name!r}{suggestion(name, known, flags=False)}"
            )


class _Checked(type):
    """Keyword arguments checked by name before the dataclass's own __init__ sees them."""

    def __call__(cls, *args, **kwargs):
        check_keywords(cls.__name__, kwargs, [f.name for f in dataclasses.fields(cls) if f.init])
        return super().__call__(*args, **kwargs)


# vLLM's SamplingParams fields this engine does not do: name -> (the value that means "off", why not).
REFUSED = {
    "presence_penalty": (0.0, "penalties change the target's distribution; speculative decoding here is "
        "lossless only for temperature, top-k and top-p"),
    "frequency_penalty": (0.0, "penalties change the target's distribution (see presence_penalty)"),
    "repetition_penalty": (1.0, "penalties change the target's distribution (see presence_penalty)"),
    "min_p": (0.0, "not implemented in the sampler (temperature, top_k and top_p are)"),
    "min_tokens": (0, "EOS is not masked per row on the device (a scheduler hook this engine lacks)"),
    "best_of": (None, "no ranking of samples: ask for n samples and rank them yourself"),
    "logit_bias": (None, "changes the target's distribution"),
    "allowed_token_ids": (None, "changes the target's distribution"),
    "bad_words": (None, "changes the target's distribution"),
    "guided_decoding": (None, "guided (structured) decoding is not implemented"),
    "structured_outputs": (None, "guided (structured) decoding is not implemented"),
    "prompt_logprobs": (None, "prompt log-probabilities are not computed (the prefill keeps none)"),
    "truncate_prompt_tokens": (None, "prompts are never truncated: a prompt too long is refused"),
    "logits_processors": (None, "no hook into the device's sampler"),
    "spaces_between_special_tokens": (True, "the tokenizer's decoder decides the spaces"),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SamplingParams(metaclass=_Checked):
    """How to sample one prompt: ddtree-generate's sampling flags, with their defaults and checks, and
    vLLM's SamplingParams fields of the same meaning (`max_tokens` is `max_new_tokens`); vLLM's fields
    this engine does not do are refused by name, with the reason, unless they hold their "off" value.
    One difference: temperature defaults to 0 (greedy), as ddtree-generate's, where vLLM's is 1."""

    temperature: float = _DEFAULTS["temperature"]  # 0 = greedy
    top_k: int = _DEFAULTS["top_k"]  # 0 = off (vLLM's -1 too)
    top_p: float = _DEFAULTS["top_p"]  # 1 = off
    seed: int | None = None  # None: the LLM's seed (LLM(seed=), default 0)
    max_new_tokens: int | None = None  # None: the LLM's max_new_tokens (which sizes the cache)
    n: int = _DEFAULTS["n"]  # samples; sample i seeded scheduler.sample_seed(seed, i)
    stop: tuple[str, ...] = ()  # stop strings (one string: one stop string); stops.py
    include_stop_str_in_output: bool = False  # keep the stop string at the end of the text
    logprobs: int | None = None  # K top log-probabilities per token (<= the LLM's); None: the LLM's
    # vLLM's names and output options (request_outputs.py)
    max_tokens: int | None = None  # vLLM's name of max_new_tokens
    stop_token_ids: tuple[int, ...] = ()  # the output ends after the first of these (the row runs on)
    skip_special_tokens: bool = True  # RequestOutput text without special tokens (vLLM's default)
    detokenize: bool = True  # False: RequestOutput text left empty
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    best_of: int | None = None
    logit_bias: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    guided_decoding: Any = None
    structured_outputs: Any = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    logits_processors: Any = None
    spaces_between_special_tokens: bool = True

    def __post_init__(self):
        for name, (off, why) in REFUSED.items():
            value = getattr(self, name)
            if value != off and not (name == "best_of" and value == self.n):
                raise DDTreeError(f"SamplingParams({name}={value!r}) is not supported: {why}")
        if self.max_tokens is not None:
            if self.max_new_tokens is not None and self.max_new_tokens != self.max_tokens:
                raise DDTreeError("SamplingParams: max_tokens and max_new_tokens are one setting; give one")
            object.__setattr__(self, "max_new_tokens", self.max_tokens)
        if self.top_k == -1:  # vLLM's "off"
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.stop, str | list):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if self.stop is None:
            object.__setattr__(self, "stop", ())
        if (why := check_stop(self.stop)) is not None:
            raise DDTreeError(f"SamplingParams(stop=...) {why}")
        ids = () if self.stop_token_ids is None else tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise DDTreeError(
                f"SamplingParams(stop_token_ids=...) must be token ids, got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", ids)
        for name in ("include_stop_str_in_output", "skip_special_tokens", "detokenize", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise DDTreeError(f"SamplingParams({name}=...) must be True or False")
        if self.logprobs is not None and (why := check_logprobs(self.logprobs)) is not None:
            raise DDTreeError(f"SamplingParams(logprobs=...) {why}")
        for name in SAMPLING:
            value = getattr(self, name)
            if value is not None and (why := check_sampling(name, value)) is not None:
                raise DDTreeError(f"SamplingParams({name}=...) {why}")
        for name in (LIMIT, SAMPLES):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                shown = "max_tokens" if name == LIMIT and self.max_tokens is not None else name
                raise DDTreeError(f"SamplingParams({shown}=...) must be a positive integer, got {value!r}")

    def options(self) -> dict[str, Any]:
        """The prompt options these settings give (the keys of a prompts-file line). vLLM's logprobs
        0 (the chosen token's only) asks the engine for 1 (the chosen token comes with its top K)."""
        out = {name: getattr(self, name) for name in (*SAMPLING, SAMPLES, STOP, INCLUDE_STOP)}
        out = {k: v for k, v in out.items() if v is not None}
        out |= {IGNORE_EOS: True} if self.ignore_eos else {}
        out |= {} if self.logprobs is None else {LOGPROBS: max(self.logprobs, 1)}
        return out if self.max_new_tokens is None else out | {LIMIT: self.max_new_tokens}

    def shaping(self) -> Shaping:
        """The output options of these settings (RequestOutput's text, stop token ids, logprobs)."""
        return Shaping(
            stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            detokenize=self.detokenize,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self.logprobs,
        )

    @property
    def limit_name(self) -> str:
        """The name the caller gave the limit of new tokens: max_tokens (vLLM's) or max_new_tokens."""
        return "max_tokens" if self.max_tokens is not None else "max_new_tokens"


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
    if s.auto_budgets:  # --budget auto: each budget it chooses among, at its default branching
        for n in s.auto_budgets:
            check_budget(dataclasses.replace(s, budget=n, branching=None, auto_budgets=()), dcfg)
        return
    depth = (s.block_size or dcfg.block_size) - 1
    branching = ddtree_branching(s.budget, dcfg.vocab_size, s.branching)
    lattice = sum(branching**d for d in range(1, depth + 1))
    if s.budget > lattice:
        raise DDTreeError(
            f"--budget {s.budget} exceeds the {lattice} nodes of the drafter's lattice "
            f"({depth} depths of {branching} candidates, --branching): no tree that large exists"
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
    tree = max((s.budget, *s.auto_budgets)) + 1  # (--budget auto: its largest)
    need = per_pair * tree * (tree + context)
    if need > memory // 2:
        fits = int((-context + math.sqrt(context**2 + 4 * (memory // 2) / per_pair)) / 2) - 1
        raise DDTreeError(
            f"--budget {s.budget}: verifying {tree} tree tokens takes float32 attention scores of {rows} "
            f"rows x {heads} heads x {tree} x {tree + context} positions = {need / 1e9:.1f} GB per device, "
            f"more than half of its {memory / 1e9:.1f} GB; at most --budget {max(fits, 0)} fits"
        )


def check_prompt_logprobs(prompts, most: int, path: str | None = "prompts") -> None:
    """Every prompt's own `logprobs` K is at most the run's (which sizes the buffers); errors name the
    prompt by `path`:line (the CLI) or, with `path` None, as the API's `prompt N` in its words."""
    for p in prompts:
        k = p.options.get(LOGPROBS, 0)
        if k > most and path is None:
            raise DDTreeError(
                f"prompt {p.line}: SamplingParams(logprobs={k}) exceeds LLM(logprobs={most}), which sizes "
                f"the buffers: make the LLM with logprobs={k} or more"
            )
        if k > most:
            raise DDTreeError(
                f"{path}:{p.line}: logprobs {k} exceeds the run's --logprobs {most} (which sizes the buffers)"
            )


def check_lengths(prompts, max_positions: int, max_new_tokens: int, path: str | None = "prompts") -> None:
    """Every prompt plus its generation must fit the model's context (errors named as
    check_prompt_logprobs's)."""
    for p in prompts:
        if len(p.input_ids) + max_new_tokens > max_positions:
            limit = (
                f"LLM(max_new_tokens={max_new_tokens})"
                if path is None
                else f"--max-new-tokens {max_new_tokens}"
            )
            where = f"prompt {p.line}" if path is None else f"{path}:{p.line}"
            raise DDTreeError(
                f"{where}: {len(p.input_ids)} tokens + {limit} exceed the model's context of {max_positions}"
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
    "batch_size", "seed",
    "static_batches", "host_stepped", "batch_invariant", "prefill_chunk", "prefill_slots", "host_loop",
    "prefill_attention", "params_cache", "compile_cache",
)  # fmt: skip

# vLLM's LLM(...) keyword arguments of the same meaning -> ours (speculative_config and max_model_len:
# vllm_options).
VLLM_OPTIONS = {
    "model": "target",
    "tensor_parallel_size": "tp",
    "data_parallel_size": "dp",
    "max_num_seqs": "batch_size",
}
# vLLM's keyword arguments that change nothing here: accepted, with the reason.
VLLM_NO_EFFECT = {
    "trust_remote_code": "no remote code runs: the families are in ddtree_jax/models",
    "gpu_memory_utilization": "JAX's XLA_PYTHON_CLIENT_MEM_FRACTION sets the memory it takes",
    "enforce_eager": "the rounds are always compiled (--host-stepped drives them from Python)",
    "disable_log_stats": "no statistics are logged",
    "tokenizer": "the tokenizer is the target directory's tokenizer.json",
}
VLLM_DTYPES = {"auto": None, "bfloat16": "bfloat16", "float32": "float32", "float": "float32"}
SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens")


def vllm_options(given: dict[str, Any], other: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """LLM(...)'s vLLM keyword arguments (`other`) as ours, added to `given` (ours); returns them with
    {our name: the name the caller used} for the errors. A name given both ways is refused."""
    used: dict[str, str] = {}
    check_keywords("LLM", other, [*VLLM_OPTIONS, *VLLM_NO_EFFECT, "speculative_config", "max_model_len",
                                 *OPTIONS, "target", "draft", "chat_template"])  # fmt: skip
    for theirs, value in other.items():
        if theirs in VLLM_NO_EFFECT and theirs != "tokenizer":
            continue
        if theirs == "tokenizer":
            if value is not None and Path(value) != Path(given.get("target", value)):
                raise DDTreeError(f"LLM(tokenizer={value!r}): {VLLM_NO_EFFECT['tokenizer']}; leave it out")
            continue
        if theirs in ("speculative_config", "max_model_len"):
            continue
        ours = VLLM_OPTIONS[theirs]
        if value is None:
            continue
        if ours in given:
            raise DDTreeError(f"LLM({theirs}=...) and LLM({ours}=...) are one setting; give one")
        given[ours], used[ours] = value, theirs
    spec = other.get("speculative_config")
    if spec is not None:
        if not isinstance(spec, dict):
            raise DDTreeError(f"LLM(speculative_config=...) must be a dict, got {spec!r}")
        check_keywords("LLM(speculative_config=...)", spec, list(SPECULATIVE_KEYS))
        method = spec.get("method", "ddtree")
        if method not in ("ddtree", "dflash"):
            raise DDTreeError(
                f"speculative_config method {method!r}: this engine runs 'ddtree' and 'dflash' drafters "
                "(and no speculative_config: autoregressive)"
            )
        for ours, value in (("method", method), ("draft", spec.get("model"))):
            if value is None:
                continue
            if ours in given and given[ours] != value:
                raise DDTreeError(f"LLM({ours}={given[ours]!r}) and speculative_config's {value!r} differ")
            given[ours] = value
        if (k := spec.get("num_speculative_tokens")) is not None:
            # ddtree: the tree's nodes besides the root (the budget); dflash: the drafted tokens a round
            ours = "budget" if method == "ddtree" else "block_size"
            given[ours], used[ours] = (k if method == "ddtree" else k + 1), "num_speculative_tokens"
    if "dtype" in given and given["dtype"] not in VLLM_DTYPES:
        raise DDTreeError(
            f"dtype {given['dtype']!r}: this engine computes in bfloat16 or float32 ('auto': bfloat16)"
        )
    if "dtype" in given:
        if VLLM_DTYPES[given["dtype"]] is None:
            del given["dtype"]  # vLLM's "auto": our default
        else:
            given["dtype"] = VLLM_DTYPES[given["dtype"]]
    return given, used


class LLM:
    """A target (and drafter) loaded once with ddtree-generate's options (or vLLM's names for them);
    `generate` and `chat` return vLLM-shaped RequestOutputs, `stream` each sample's Result as its row
    finishes; all run through one host loop whose compiled programs every call reuses."""

    def __init__(
        self,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        *,
        method: str | None = None,
        budget: int | str | None = None,
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
        seed: int | None = None,
        chat_template: bool = True,
        static_batches: bool | None = None,
        host_stepped: bool | None = None,
        batch_invariant: bool | None = None,
        prefill_chunk: int | None = None,
        prefill_slots: int | None = None,
        host_loop: bool | None = None,
        prefill_attention: str | None = None,
        params_cache: str | Path | None = None,
        compile_cache: str | None = None,
        **vllm: Any,
    ):
        """Check the options (None: ddtree-generate's default; no target: the bundled pair), read the
        configs, then load the weights. ddtree's budget, when not given, is the default for
        `batch_size` rows at a short context (the prompts are not known yet); "auto": the continuous job
        chooses among root-only rounds and a few budgets call by call (`--budget auto`). vLLM's names are
        taken too (`vllm`: model, tensor_parallel_size, data_parallel_size, max_num_seqs,
        speculative_config={"method": "ddtree" | "dflash", "model": DRAFT_DIR,
        "num_speculative_tokens": N}, max_model_len, and a few with no effect here: VLLM_NO_EFFECT);
        errors name the keyword arguments as given."""
        given = {k: v for k, v in locals().items() if k in (*OPTIONS, "target", "draft") and v is not None}
        used: dict[str, str] = {}
        try:
            given, used = vllm_options(given, vllm)
            if "target" in given and "draft" not in given and "method" not in given and vllm.get("model"):
                given["method"] = "ar"  # LLM(model=DIR) alone: vLLM's plain decoding
            flags = argparse.Namespace(**given, no_chat_template=not chat_template)
            s = Settings.from_flags(flags, prompts_file=False)
            cfg, dcfg, codec = read_configs(s)
            s = s.with_budget(cfg, [])
            check_budget(s, dcfg)
            check_memory(s, cfg, dcfg)
            self.max_model_len = _max_model_len(vllm.get("max_model_len"), cfg)
        except UnknownArgument:
            raise
        except DDTreeError as e:
            raise DDTreeError(_caller_words(str(e), used)) from None
        self._requests = 0
        self._load(s, cfg, dcfg, codec)

    @classmethod
    def from_settings(cls, s: Settings, target_cfg, draft_cfg, codec) -> LLM:
        """An LLM of checked settings (budget resolved) whose configs and tokenizer are already read,
        as ddtree-generate makes it."""
        llm = cls.__new__(cls)
        llm.max_model_len, llm._requests = None, 0
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
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence | None = None,
    ) -> list[Prompt]:
        """The prompts tokenized (ids: their positions in the list), each with its sampling settings
        (one SamplingParams for all or one per prompt; None: the defaults). Errors name the prompt as
        `prompt N` (its position) and the keyword arguments the caller gave."""
        items, sampling_params = self._pair_up(prompts, sampling_params)
        pairs = enumerate(zip(items, sampling_params, strict=True))
        records = [Record(i, i, *_kind(p, i), sp.options()) for i, (p, sp) in pairs]
        most = self.settings.max_new_tokens
        for r, sp in zip(records, sampling_params, strict=True):
            if sp.logprobs is not None and r.options[LOGPROBS] > self.settings.logprobs:
                raise DDTreeError(
                    f"prompt {r.id}: SamplingParams(logprobs={sp.logprobs}) needs an LLM made with "
                    f"logprobs={r.options[LOGPROBS]} or more (which sizes the buffers; this one has "
                    f"{self.settings.logprobs})"
                )
            if r.options.get(LIMIT, 0) > most:
                raise DDTreeError(
                    f"prompt {r.id}: SamplingParams({sp.limit_name}={r.options[LIMIT]}) exceeds "
                    f"LLM(max_new_tokens={most}), which sizes the cache: make the LLM with "
                    f"max_new_tokens={r.options[LIMIT]} or more"
                )
        cfg = self.target_config
        try:
            out = tokenize(records, None, self.codec, self.settings.chat_template, cfg.vocab_size)
        except DDTreeError as e:
            raise DDTreeError(api_words(str(e))) from None
        check_lengths(out, cfg.max_position_embeddings, most, None)
        if self.max_model_len is not None:
            for p, sp in zip(out, sampling_params, strict=True):
                if len(p.input_ids) + p.options.get(LIMIT, most) > self.max_model_len:
                    raise DDTreeError(
                        f"prompt {p.line}: {len(p.input_ids)} tokens + {sp.limit_name} "
                        f"{p.options.get(LIMIT, most)} exceed LLM(max_model_len={self.max_model_len})"
                    )
        check_prompt_logprobs(out, self.settings.logprobs, None)
        try:
            check_stops(out, self.settings, self.codec)
        except DDTreeError as e:
            raise DDTreeError(api_words(str(e))) from None
        return out

    def _pair_up(self, prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
        """(the prompts as a list, one SamplingParams each)."""
        items = [prompts] if _is_one_prompt(prompts) else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(items)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(items):
            raise DDTreeError(f"{len(sampling_params)} SamplingParams for {len(items)} prompts")
        if bad := [x for x in sampling_params if not isinstance(x, SamplingParams)]:
            raise DDTreeError(f"sampling_params: expected SamplingParams, got {bad[0]!r:.80}")
        return items, sampling_params

    # -- generation -----------------------------------------------------------------------------------

    def run(self, prompts: list[Prompt], skip: frozenset = frozenset()) -> Iterator[Result]:
        """Each tokenized prompt's samples' Results as they finish, the samples in `skip`
        (`prompts.sample_key`) left out (ddtree-generate's --resume)."""
        return self.generator.run(prompts, skip=skip)

    def stream(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence | None = None,
    ) -> Iterator[Result]:
        """Each prompt's samples' Results as their rows finish (`id`: the prompt's position; one line
        of ddtree-generate's output each: `Result.to_json()`)."""
        return self.run(self.prompts(prompts, sampling_params))

    def results(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence | None = None,
    ) -> list[Result]:
        """Every prompt's samples' Results in input order (prompt by prompt, its samples by index): what
        `stream` yields, sorted."""
        return sorted(self.stream(prompts, sampling_params), key=lambda r: (r.id, r.index))

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence | None = None,
        use_tqdm: bool = True,
        **other: Any,
    ) -> list[RequestOutput]:
        """One vLLM-shaped RequestOutput per prompt, in input order, its `n` samples in `outputs`.
        Prompts: text (the chat template applied unless LLM(chat_template=False)), vLLM's
        {"prompt": text} or {"prompt_token_ids": ids}, token ids, or chat messages."""
        check_keywords("LLM.generate", other, ["prompts", "sampling_params", "use_tqdm"])
        items, sampling_params = self._pair_up(prompts, sampling_params)
        items = [_vllm_prompt(p, i) for i, p in enumerate(items)]
        return self._outputs(items, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence | None = None,
        use_tqdm: bool = True,
        **other: Any,
    ) -> list[RequestOutput]:
        """vLLM's chat: one conversation ([{role, content}]) or a list of them, the chat template
        applied to each; one RequestOutput per conversation."""
        check_keywords(
            "LLM.chat",
            other,
            ["messages", "sampling_params", "use_tqdm", "add_generation_prompt", "chat_template"],
        )
        if other.get("add_generation_prompt") is False or other.get("chat_template") is not None:
            raise DDTreeError("LLM.chat: the target's own chat template applies, with the generation prompt")
        one = isinstance(messages, list) and bool(messages) and all(isinstance(m, dict) for m in messages)
        conversations = [messages] if one else list(messages)
        items = [[_message(m, i) for m in c] for i, c in enumerate(conversations)]
        if self.codec is None or self.codec.template is None:
            raise DDTreeError("LLM.chat needs the target's tokenizer.json and chat template")
        _, sampling_params = self._pair_up(items, sampling_params)
        return self._outputs(items, sampling_params, use_tqdm)

    def _outputs(
        self, items: list, sampling_params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        """Run the prompts; one RequestOutput each."""
        from tqdm import tqdm

        if not items:
            return []

        prompts = self.prompts(items, sampling_params)
        by_prompt: dict[int, list] = {i: [] for i in range(len(prompts))}
        total = sum(p.options.get(SAMPLES, self.settings.n) for p in prompts)
        for result in tqdm(self.run(prompts), total=total, desc="samples", disable=not use_tqdm):
            by_prompt[result.id].append(result)
        decode = None
        if self.codec is not None:
            decode = lambda ids, skip: self.codec.tokenizer.decode(ids, skip_special_tokens=skip)  # noqa: E731
        first, self._requests = self._requests, self._requests + len(prompts)
        return [
            request_output(
                str(first + i), self._prompt_text(item), p.input_ids, by_prompt[i], sp.shaping(), decode
            )
            for i, (item, p, sp) in enumerate(zip(items, prompts, sampling_params, strict=True))
        ]

    def _prompt_text(self, item) -> str | None:
        """The prompt as text: text as given; messages with the chat template applied; None for ids."""
        if isinstance(item, str):
            return item
        if item and isinstance(item[0], dict) and self.codec is not None and self.settings.chat_template:
            return self.codec.render_chat(item)
        return None

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
    """Whether `value` is one prompt (text, token ids, chat messages or vLLM's prompt dict), not a list
    of them."""
    if isinstance(value, str | dict):
        return True
    if not isinstance(value, list) or not value:
        return False
    ids = all(isinstance(x, int) for x in value)
    return ids or all(isinstance(x, dict) and "role" in x for x in value)


def _kind(prompt: Any, i: int) -> tuple[str, Any]:
    """(the prompts-file key of one prompt: prompt (text), messages or input_ids; the prompt)."""
    if isinstance(prompt, str):
        return "prompt", prompt
    items = prompt if isinstance(prompt, list) and prompt else [None]
    if all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        return "input_ids", prompt
    message = lambda m: isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))  # noqa: E731
    if all(message(m) for m in items):
        return "messages", prompt
    raise DDTreeError(f"prompt {i}: expected text, token ids or [{{role, content}}] messages: {prompt!r:.80}")


def _vllm_prompt(prompt: Any, i: int) -> Any:
    """vLLM's prompt dicts as ours: {"prompt": text} is text, {"prompt_token_ids": ids} token ids."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"}:
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"}:
        return list(prompt["prompt_token_ids"])
    raise DDTreeError(
        f"prompt {i}: a prompt dict takes one key, 'prompt' or 'prompt_token_ids', got {sorted(prompt)}"
    )


def _message(m: Any, i: int) -> dict[str, str]:
    """One chat message as {role, content} strings (OpenAI's content parts of type text joined)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise DDTreeError(f"prompt {i}: a message must be a {{role, content}} dict, got {m!r:.80}")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            raise DDTreeError(f"prompt {i}: only text content parts are supported (this engine reads text)")
        content = "".join(part.get("text", "") for part in content)
    if not isinstance(content, str):
        raise DDTreeError(f"prompt {i}: a message's content must be text, got {content!r:.80}")
    return {"role": m["role"], "content": content}


def _max_model_len(value: Any, cfg) -> int | None:
    """vLLM's max_model_len: a limit of prompt plus generated tokens, at most the target's context."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise DDTreeError(f"max_model_len must be an integer >= 2, got {value!r}")
    if value > cfg.max_position_embeddings:
        raise DDTreeError(
            f"max_model_len {value} exceeds the target's context of {cfg.max_position_embeddings}"
        )
    return value


def _caller_words(message: str, used: dict[str, str]) -> str:
    """An error written with flags, in the words of the LLM(...) call: keyword arguments, with the
    names the caller used (vLLM's `tensor_parallel_size` where it gave that)."""
    text = api_words(message.replace("the run's --", "--"))
    for ours, theirs in used.items():
        text = re.sub(rf"(?<![\w.]){ours}(?=[ =)]|$)", theirs, text)
    return text
