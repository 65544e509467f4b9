"""The settings of a run: ddtree-generate's flags, declared once in groups that every tool sharing them
adds, and resolved once into a frozen record (`Settings`) that the rest of the program reads.

`Settings.from_flags` turns parsed flags into the record (the bundled pair when no --target, the method
by whether a drafter is given, every budget-free check); `with_budget` resolves ddtree's budget and
branching once the target's config and the prompts are known. Nothing here imports jax.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
from pathlib import Path
from typing import Any

from ddtree_jax import compile_cache
from ddtree_jax.budgets import (
    DEFAULT_BUDGETS,
    MOE_DEFAULT_BUDGETS,
    ddtree_branching,
    default_budget,
    describe,
    rows_per_device,
    run_context,
)
from ddtree_jax.errors import DDTreeError
from ddtree_jax.prompts import LIMIT, MAX_LINE_BYTES, check_stop

BUNDLED = Path(__file__).parent / "assets" / "default_pair"
SAMPLING = ("temperature", "top_k", "top_p", "seed")  # the sampling settings: flags, prompt keys, API fields
AUTO = "auto"  # --budget auto: the job chooses its budget (scheduler.Schedule.auto_budgets)
# The budgets --budget auto chooses among (plan_choice's cost table has each); 0: root-only rounds
# (engine.Plan.root_only: ar's tokens, the drafter's context kept; plan_choice.ROOT_ONLY)
AUTO_BUDGETS = (0, 3, 7, 15)


def _budget(text: str) -> int | str:
    """--budget's value: a number of tree nodes, or 'auto'."""
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (nodes, or auto)") from None


# Every flag once: dest -> (option strings, argparse keywords).
FLAGS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "target": (("--target",), dict(help="HF target directory (any family in ddtree_jax/models: Qwen3, "
        "Llama 3, Qwen3-MoE, DeepSeek-V3/Kimi-K2); default: the bundled code model")),
    "draft": (("--draft",), dict(help="DFlash drafter directory (z-lab layout); default with no --target: "
        "the bundled one")),
    "prompts": (("--prompts",), dict(help="JSONL: {id, prompt | messages | input_ids}; default with no "
        "--target: bundled code starts")),
    "out": (("--out",), dict(required=True, help="JSONL output, one line per prompt, in the order they "
        "finish; '-' for standard output (the summary then goes to stderr). An existing file needs "
        "--resume or --overwrite")),
    "resume": (("--resume",), dict(action="store_true", help="skip the ids already in --out, append the "
        "rest (the settings must be those --out was made with)")),
    "overwrite": (("--overwrite",), dict(action="store_true", help="replace an existing --out")),
    "output_format": (("--output-format",), dict(choices=["ours", "openai"], default="ours", help="the lines "
        "of --out: ours (one per sample, below) or openai (OpenAI Batch API output lines, one per prompt "
        "with its n samples as choices, as `vllm run-batch` writes them)")),
    "method": (("--method",), dict(choices=["ar", "dflash", "ddtree"], help="default: ddtree with --draft, "
        "else ar")),
    "max_new_tokens": (("--max-new-tokens",), dict(type=int, default=128, help="tokens generated per "
        "prompt at most")),
    "logprobs": (("--logprobs",), dict(type=int, default=0, metavar="K", help="per generated token, the "
        "target's log-probability of the chosen token and of its top K alternatives "
        "(output_token_logprobs, output_top_logprobs); default 0: none computed")),
    "logprobs_mode": (("--logprobs-mode",), dict(choices=["raw", "processed"], default="raw", help="the "
        "distribution of --logprobs: raw (the default) is log_softmax of the target's logits; processed "
        "applies temperature, top-k and top-p first (greedy rows read the raw one)")),
    "batch_size": (("--batch-size",), dict(type=int, default=8, help="prompts generated together")),
    "dtype": (("--dtype",), dict(choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype "
        "(float32 also sets the highest matmul precision)")),
    "seed": (("--seed",), dict(type=int, default=0, help="sampling seed of prompts that set none")),
    "no_chat_template": (("--no-chat-template",), dict(action="store_true", help="encode 'prompt' text "
        "as is")),
    "budget": (("--budget",), dict(type=_budget, metavar="N|auto", help="ddtree: tree nodes besides the "
        "root (default by rows per --dp device and the prompts' mean length plus their new tokens: "
        f"{describe(DEFAULT_BUDGETS)}; mixture-of-experts targets: {describe(MOE_DEFAULT_BUDGETS)}); "
        "auto: the continuous job chooses among root-only rounds (ar's tokens) and "
        f"{', '.join(str(n) for n in AUTO_BUDGETS if n)} every few rounds from the acceptance it counts "
        "and the shipped cost table (the same tokens as any fixed budget in float32; the summary "
        "says the share of rounds each ran)")),
    "block_size": (("--block-size",), dict(type=int, help="draft block size (<= the drafter's, the "
        "default; depth = block - 1)")),
    "branching": (("--branching",), dict(type=int, help="ddtree: drafter candidates per depth (default "
        "min(budget, 32))")),
    "draft_window": (("--draft-window",), dict(type=int, help="drafter attends to the last N context "
        "tokens only (default: all)")),
    "draft_yarn_scaling": (("--draft-yarn-scaling",), dict(choices=["legacy", "hf"], help="a yarn "
        "drafter's cos/sin factor when its config gives none: legacy = 1 + 0.1 ln(factor) (what the "
        "Kimi-K2.5 DFlash drafter was trained with), hf = today's transformers mscale ratio; default: "
        "the drafter config's dflash_config.yarn_scaling, else legacy")),
    "attention": (("--attention",), dict(choices=["auto", "reference", "pallas", "mosaic"], default="auto",
        help="decode attention: the Pallas kernel (auto on GPU), the Mosaic GPU one (Hopper) or the jnp "
        "reference")),
    "host_stepped": (("--host-stepped",), dict(action="store_true", help="drive rounds from Python, time "
        "each step (draft, build, verify, walk, commit)")),
    "prefill_chunk": (("--prefill-chunk",), dict(type=int, default=256, help="prefill tokens per row per "
        "step (a power of two >= 16)")),
    "prefill_slots": (("--prefill-slots",), dict(type=int, help="prompts prefilled together in one pass "
        "of the continuous job (at most the rows per --dp device; default 8 on a GPU, 1 on a CPU); a "
        "prompt's tokens are the same whichever prompts share its pass")),
    "host_loop": (("--host-loop",), dict(action="store_true", help="continuous batching driven from the "
        "host (a refill program per admission, rounds between): the baseline of the job on the device")),
    "trace_device": (("--trace-device",), dict(action="store_true", help="trace the generation with JAX's "
        "profiler and say in the summary how long the device was busy (kernels running) beside it; "
        "tracing slows the host a little, and GEMM autotuning in a first run's compilation counts as busy")),
    "prefill_attention": (("--prefill-attention",), dict(choices=("same", "cudnn"), default="same",
        help="the prefill chunks' attention: the decode attention (same) or, on CUDA in bf16, cuDNN flash "
        "attention (faster for one long prompt, slower for continuous refills: results/notes.md)")),
    "batch_invariant": (("--batch-invariant",), dict(action="store_true", help="fixed shapes: a prompt's "
        "tokens do not depend on the prompts beside it or on --batch-size (bfloat16 too)")),
    "static_batches": (("--static-batches",), dict(action="store_true", help="run --batch-size prompts "
        "at a time in input order, each batch until its slowest row (no continuous batching)")),
    "temperature": (("--temperature",), dict(type=float, default=0.0, help="sampling temperature "
        "(0 = greedy)")),
    "top_p": (("--top-p",), dict(type=float, default=1.0, help="nucleus sampling mass (1 = off)")),
    "top_k": (("--top-k",), dict(type=int, default=0, help="sample among the k most likely tokens "
        "(0 = off)")),
    "n": (("--n",), dict(type=int, default=1, help="samples per prompt of prompts that set none (each "
        "output line carries its index i; sample i is seeded (seed + i * 0x9E3779B9) mod 2^32, sample 0 "
        "with the prompt's seed)")),
    "stop": (("--stop",), dict(action="append", metavar="TEXT", help="a stop string of prompts that set "
        "none (repeat the flag for several): generation ends at the first one in the decoded text, which "
        "is cut before it; the line records it as stop_reason (needs the target's tokenizer.json)")),
    "include_stop_str_in_output": (("--include-stop-str-in-output",), dict(action="store_true", help="keep "
        "the stop string at the end of the text")),
    "tp": (("--tp",), dict(type=int, default=1, help="tensor-parallel devices: heads, MLP columns and "
        "vocabulary split")),
    "dp": (("--dp",), dict(type=int, default=1, help="data-parallel devices: the batch split (padded to "
        "a multiple)")),
    "params_cache": (("--params-cache",), dict(metavar="DIR", help="convert the checkpoints once into "
        "orbax checkpoints under DIR (keyed by the checkpoint's files, --dtype and the layout) and restore "
        "them from there afterwards (default: off)")),
    "compile_cache": compile_cache.FLAG,
    "max_line_bytes": (("--max-line-bytes",), dict(type=int, default=MAX_LINE_BYTES, help="refuse a "
        "prompts line longer than this before decoding it")),
    "coordinator": (("--coordinator",), dict(metavar="HOST:PORT", help="several processes (one per "
        "host): process 0's address for jax.distributed (default: one process)")),
    "num_processes": (("--num-processes",), dict(type=int, help="several processes: how many (with "
        "--coordinator)")),
    "process_id": (("--process-id",), dict(type=int, help="several processes: this one's index; process 0 "
        "writes --out")),
    "moe_sharding": (("--moe-sharding",), dict(choices=["ep", "tp"], default="ep", help="MoE targets "
        "under --tp: whole experts per device (ep) or columns of every expert (tp)")),
    "scan_layers": (("--scan-layers",), dict(action="store_true", help="run the target's decoder layers "
        "as one lax.scan over stacked weights: compile time independent of depth (dense targets, plain "
        "weights; default: every layer unrolled)")),
    "dequantize": (("--dequantize",), dict(action="store_true", help="a quantized target (FP8 "
        "block-scaled, INT4 experts): expand its weights to --dtype at load, for comparison (default: "
        "kept quantized in device memory)")),
}  # fmt: skip

# The groups tools share (ddtree-generate takes them all; ddtree-compare the ones it honours).
PAIR = ("target", "draft", "dtype", "tp", "dp", "moe_sharding", "dequantize", "draft_yarn_scaling")
PROMPTS = ("prompts", "no_chat_template")
DECODING = ("max_new_tokens", "batch_size", "block_size", "branching", "draft_window", "attention")
RUN = ("method", "budget", "host_stepped")
COMPILE = ("compile_cache",)
GENERATE_ONLY = (
    "n", "stop", "include_stop_str_in_output", "logprobs", "logprobs_mode", "out", "resume", "overwrite",
    "params_cache", "max_line_bytes", "prefill_chunk", "prefill_slots", "prefill_attention",
    "batch_invariant", "static_batches", "host_loop", "trace_device",
    "coordinator", "num_processes", "process_id",
    "output_format", "scan_layers",
)  # fmt: skip
GENERATE = (*PAIR, *PROMPTS, *DECODING, *SAMPLING, *RUN, *COMPILE, *GENERATE_ONLY)


# Other engines' spellings of our flags and keyword arguments (vLLM's and SGLang's offline and
# run-batch options): what "did you mean" suggests for them.
OTHER_NAMES = {
    "max_tokens": ("max_new_tokens", "vLLM's"),
    "max_completion_tokens": ("max_new_tokens", "OpenAI's"),
    "model": ("target", "vLLM's"),
    "model_path": ("target", "SGLang's"),
    "tokenizer": ("target", "vLLM's (the tokenizer is the target directory's tokenizer.json)"),
    "speculative_model": ("draft", "vLLM's"),
    "speculative_draft_model_path": ("draft", "SGLang's"),
    "speculative_algorithm": ("method", "SGLang's"),
    "speculative_num_draft_tokens": ("budget", "SGLang's"),
    "num_speculative_tokens": ("budget", "vLLM's"),
    "tensor_parallel_size": ("tp", "vLLM's"),
    "tp_size": ("tp", "SGLang's"),
    "data_parallel_size": ("dp", "vLLM's"),
    "dp_size": ("dp", "SGLang's"),
    "max_num_seqs": ("batch_size", "vLLM's"),
    "max_running_requests": ("batch_size", "SGLang's"),
    "input_file": ("prompts", "vLLM run-batch's"),
    "i": ("prompts", "vLLM run-batch's"),
    "output_file": ("out", "vLLM run-batch's"),
    "o": ("out", "vLLM run-batch's"),
    "output": ("out", None),
    "input": ("prompts", None),
    "temp": ("temperature", None),
    "num_samples": ("n", None),
}


def suggestion(name: str, known: list[str], flags: bool = True) -> str:
    """' (did you mean X? ...)' for an unknown flag (`flags`: '--max-tokens') or keyword argument
    ('max_tokens') among `known` (the same spelling), or '' when nothing is close."""
    bare = name.lstrip("-").replace("-", "_")
    spell = (lambda n: ("-" if len(n) == 1 else "--") + n.replace("_", "-")) if flags else (lambda n: n)
    if bare in OTHER_NAMES:
        ours, whose = OTHER_NAMES[bare]
        if spell(ours) in known:
            return (
                f" (did you mean {spell(ours)}? {name} is {whose} name)"
                if whose
                else f" (did you mean {spell(ours)}?)"
            )
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help lines end with the flag's default unless they already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not quiet and "default" not in text:
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """argparse for every command: no abbreviations (a script keeps working the day a flag is added),
    usage errors in one line that exit 1, and a "did you mean" for each unknown flag (a close one of
    ours, or ours for vLLM's and SGLang's spellings)."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(1, f"{self.prog}: error: {message} (--help lists the flags)\n")

    def parse_args(self, args=None, namespace=None):  # noqa: D102 (argparse's, with hints)
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            known = _options(self, parsed)
            hints = "".join(
                f"; {x.split('=')[0]}{hint}" for x in extras if x.startswith("-")
                if (hint := suggestion(x.split("=")[0], known))
            )  # fmt: skip
            self.error(f"unrecognized arguments: {' '.join(extras)}{hints}")
        return parsed


def _options(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> list[str]:
    """The option strings `parser` takes, with those of the sub-command chosen in `parsed`."""
    out = []
    for action in parser._actions:
        out += [o for o in action.option_strings if o.startswith("--") or len(o) == 2]
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
            out += _options(chosen, parsed) if chosen is not None else []
    return out


_FLAG = re.compile(r"--([a-z][a-z0-9-]*)(?: (-?\d[\d.e+-]*)(?![\w.]))?")


def api_words(message: str, owner: str = "LLM") -> str:
    """A message written with flags in the Python API's words: `--max-new-tokens 128` becomes
    `LLM(max_new_tokens=128)`, `--budget` becomes `budget`, "the run's" becomes "the LLM's"."""

    def keyword(m: re.Match) -> str:
        name = m.group(1).replace("-", "_")
        return f"{owner}({name}={m.group(2)})" if m.group(2) else name

    message = message.replace("--no-chat-template", f"{owner}(chat_template=False)")
    return _FLAG.sub(keyword, message).replace("the run's ", f"the {owner}'s ")


def add_flags(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    """Give `parser` the flags `names`, as ddtree-generate declares them."""
    for name in names:
        options, kwargs = FLAGS[name]
        parser.add_argument(*options, dest=name, **kwargs)


def defaults(names: tuple[str, ...]) -> dict[str, Any]:
    """The default value of each flag in `names` (for tools that do not offer them)."""
    return {name: FLAGS[name][1].get("default", False if _is_switch(name) else None) for name in names}


def _is_switch(name: str) -> bool:
    return FLAGS[name][1].get("action") == "store_true"


@dataclasses.dataclass(frozen=True)
class Processes:
    """Several processes joined by jax.distributed."""

    coordinator: str  # HOST:PORT of process 0
    count: int
    index: int


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a run reads from its flags, each default resolved once."""

    target: str
    draft: str | None = None  # None: no drafter (ar)
    prompts: str | None = None  # the prompts file (None: prompts given otherwise)
    method: str = "ar"
    dtype: str = "bfloat16"
    max_new_tokens: int = 128
    logprobs: int = 0  # K top log-probabilities per generated token (0: none)
    logprobs_mode: str = "raw"
    batch_size: int = 8
    budget: int | None = None  # ddtree: nodes besides the root (None until `with_budget`); else 0
    branching: int | None = None  # ddtree: candidates per depth (None until `with_budget`); else None
    # --budget auto: the budgets the continuous job chooses among (each at its default branching), the
    # resolved `budget` then only the host loops' and the first state's; (): `budget` throughout
    auto_budgets: tuple[int, ...] = ()
    block_size: int | None = None  # None: the drafter's
    draft_window: int | None = None
    draft_yarn_scaling: str | None = None
    attention: str = "auto"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    n: int = 1  # samples per prompt
    stop: tuple[str, ...] = ()  # stop strings
    include_stop_str_in_output: bool = False
    chat_template: bool = True
    static_batches: bool = False
    host_stepped: bool = False
    batch_invariant: bool = False
    prefill_chunk: int = 256
    prefill_slots: int | None = None
    host_loop: bool = False
    trace_device: bool = False  # the summary's device-busy seconds, from a profile of the generation
    prefill_attention: str = "same"
    tp: int = 1
    dp: int = 1
    moe_sharding: str = "ep"
    dequantize: bool = False
    scan_layers: bool = False  # the target's layers as one scan (TargetConfig.scan_layers)
    out: str | None = None
    output_format: str = "ours"  # --out's lines: "ours" or "openai" (openai_batch.py)
    resume: bool = False
    overwrite: bool = False
    params_cache: str | None = None
    compile_cache: str | None = None  # --compile-cache: DIR, 'off' or None (compile_cache.enable)
    max_line_bytes: int = MAX_LINE_BYTES
    processes: Processes | None = None

    def __post_init__(self):
        if self.method not in ("ar", "dflash", "ddtree"):
            raise DDTreeError(f"method must be ar, dflash or ddtree, got {self.method!r}")
        if (self.method == "ar") != (self.draft is None):
            need = "uses no" if self.method == "ar" else "needs a"
            raise DDTreeError(f"--method {self.method} {need} --draft")
        if self.logprobs and self.host_stepped:
            raise DDTreeError("--logprobs is not kept by --host-stepped rounds; leave one of them out")

    @classmethod
    def from_flags(cls, args: argparse.Namespace, prompts_file: bool = True) -> Settings:
        """The settings of parsed flags, checked (flags a tool does not offer take their defaults);
        the bundled pair (and its prompts) when no --target is given. `prompts_file`: whether the run
        reads a prompts file (the Python API's runs take their prompts otherwise)."""
        flags = defaults(tuple(FLAGS)) | vars(args)
        _check_numbers(flags)
        target, draft, prompts = _pair(flags, prompts_file)
        method = flags["method"] or ("ddtree" if draft else "ar")
        if method == "ar":
            draft = None  # the bundled pair's drafter is not used
        elif not draft:
            raise DDTreeError(f"--method {method} needs --draft DIR")
        if method != "ddtree" and (flags["budget"] or flags["branching"]):
            raise DDTreeError("--budget and --branching apply to --method ddtree only")
        auto = flags["budget"] == AUTO
        if auto and flags["branching"]:
            raise DDTreeError("--branching applies to a fixed --budget (auto: each budget's default)")
        names = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in flags.items() if k in names}
        return cls(
            **given
            | dict(
                target=target,
                draft=draft,
                prompts=prompts,
                method=method,
                budget=(None if auto else flags["budget"]) if method == "ddtree" else 0,
                auto_budgets=AUTO_BUDGETS if auto else (),
                branching=flags["branching"] if method == "ddtree" else None,
                chat_template=not flags["no_chat_template"],
                stop=tuple(flags["stop"] or ()),
                processes=_processes(flags),
            )
        )

    @property
    def defaults(self) -> dict[str, Any]:
        """The default sampling settings {temperature, top_k, top_p, seed, n, stop,
        include_stop_str_in_output} (a prompt's own override)."""
        return {k: getattr(self, k) for k in (*SAMPLING, "n", "stop", "include_stop_str_in_output")}

    @property
    def is_writer(self) -> bool:
        """Whether this process writes --out and the summary (process 0, or the only process)."""
        return self.processes is None or self.processes.index == 0

    def with_budget(self, target_cfg, prompts: list) -> Settings:
        """ddtree's budget (when not given: the default for the rows per device, the target's kind and
        the prompts' mean context, each one's length plus its new tokens) and branching, resolved."""
        if self.method != "ddtree":
            return self
        budget = self.budget
        if budget is None:
            context = run_context(
                [len(p.input_ids) + p.options.get(LIMIT, self.max_new_tokens) for p in prompts]
            )
            budget = default_budget(rows_per_device(self.batch_size, self.dp), target_cfg, context)
        branching = ddtree_branching(budget, target_cfg.vocab_size, self.branching)
        return dataclasses.replace(self, budget=budget, branching=branching)

    def schedule(self):
        """The scheduler's Schedule of these settings."""
        from ddtree_jax.scheduler import Schedule

        return Schedule(
            batch_size=self.batch_size,
            policy="static" if self.static_batches else "continuous",
            host_stepped=self.host_stepped,
            chunk=self.prefill_chunk,
            prefill_slots=self.prefill_slots,
            device_loop=not self.host_loop,
            batch_invariant=self.batch_invariant,
            prefill_attention=self.prefill_attention,
            auto_budgets=self.auto_budgets,
        )

    def record(self) -> dict[str, Any]:
        """What OUT.settings.json records: every setting, paths resolved (--resume checks those that
        decide the outputs: outfile.SETTINGS)."""
        out = dataclasses.asdict(self)
        out["target"] = str(Path(self.target).resolve())
        out["draft"] = str(Path(self.draft).resolve()) if self.draft else None
        out["no_chat_template"] = not out.pop("chat_template")
        out["stop"] = list(self.stop)
        out["auto_budgets"] = list(self.auto_budgets)
        return out


def _check_numbers(flags: dict[str, Any]) -> None:
    """Positive counts, the prefill chunk, block size and sampling values (no config needed)."""
    from ddtree_jax.sampling import check

    for name in ("max_new_tokens", "batch_size", "budget", "branching", "draft_window", "tp", "dp", "n"):
        if flags[name] is not None and flags[name] != AUTO and flags[name] < 1:
            raise DDTreeError(f"--{name.replace('_', '-')} must be >= 1, got {flags[name]}")
    if flags["logprobs"] < 0:
        raise DDTreeError(f"--logprobs must be >= 0, got {flags['logprobs']}")
    if flags["max_line_bytes"] < 1:
        raise DDTreeError(f"--max-line-bytes must be >= 1, got {flags['max_line_bytes']}")
    chunk = flags["prefill_chunk"]
    if chunk < 16 or chunk & (chunk - 1):
        raise DDTreeError(f"--prefill-chunk must be a power of two >= 16, got {chunk}")
    for name in SAMPLING:
        if (why := check(name, flags[name])) is not None:
            raise DDTreeError(f"--{name.replace('_', '-')} {why}")
    if flags["stop"] is not None and (why := check_stop(flags["stop"])) is not None:
        raise DDTreeError(f"--stop {why}")
    if flags["block_size"] is not None and flags["block_size"] < 2:
        raise DDTreeError("--block-size must be >= 2")


def _pair(flags: dict[str, Any], prompts_file: bool = True) -> tuple[str, str | None, str | None]:
    """(target, draft, prompts): the given ones, or the bundled pair and its prompts (None when the
    run reads no prompts file)."""
    if flags["method"] == "ar" and flags["draft"] is not None:
        raise DDTreeError("--draft applies to --method dflash and ddtree; --method ar uses no drafter")
    if flags["target"] is not None:
        if flags["prompts"] is None and prompts_file:
            raise DDTreeError("--prompts FILE is required with --target")
        return str(flags["target"]), flags["draft"] and str(flags["draft"]), flags["prompts"]
    if flags["draft"] is not None:
        raise DDTreeError("--draft needs --target (the bundled target comes with its own drafter)")
    bundled = str(BUNDLED / "prompts.jsonl") if prompts_file else None
    return str(BUNDLED / "target"), str(BUNDLED / "draft"), flags["prompts"] or bundled


def _processes(flags: dict[str, Any]) -> Processes | None:
    """--coordinator, --num-processes and --process-id come together, with a valid process id."""
    given = [flags[k] is not None for k in ("coordinator", "num_processes", "process_id")]
    if not any(given):
        return None
    if not all(given):
        raise DDTreeError("--coordinator, --num-processes and --process-id go together")
    count, index = flags["num_processes"], flags["process_id"]
    if count < 1 or not 0 <= index < count:
        raise DDTreeError(f"--process-id {index} must be in [0, --num-processes {count})")
    if flags["resume"] and count > 1:
        raise DDTreeError("--resume runs in one process only (the others cannot read --out)")
    if ":" not in flags["coordinator"]:
        raise DDTreeError(f"--coordinator {flags['coordinator']}: expected HOST:PORT")
    return Processes(flags["coordinator"], count, index)
