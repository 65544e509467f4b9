"""`ddtree-generate`: batched offline generation from a JSONL prompts file to a JSONL outputs file.

What runs: the flags become one frozen `settings.Settings`; `prepare` checks everything that needs no
weight (the --out path, the prompts file, the configs, the limits) and resolves the budget; the Python
API's `LLM` (api.py) loads the pair (pair.py) and runs the prompts through one host loop (scheduler.py)
that drives the device programs (programs.py) whose rounds are engine.py's; each finished prompt's line
is appended to --out as it comes.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddtree_jax import openai_batch, plan_choice
from ddtree_jax.api import (
    LLM,
    check_budget,
    check_lengths,
    check_memory,
    check_prompt_logprobs,
    check_stops,
    read_configs,
)  # fmt: skip
from ddtree_jax.errors import DDTreeError
from ddtree_jax.outfile import STDOUT, Interrupted, Writer, check_out, critical, finished_ids, interruptible
from ddtree_jax.prompts import KNOWN_KEYS, LOGPROBS, SAMPLES, id_key, sample_key, scan_prompts, tokenize
from ddtree_jax.settings import BUNDLED, GENERATE, HelpFormatter, Parser, Settings, add_flags

__all__ = ["BUNDLED", "check_lengths", "main"]

EXIT_ERROR = 1  # bad flags (argparse's too), input, checkpoint or output path: one line, no output file
EXIT_SIGNAL = 128  # + the signal's number: 130 after SIGINT, 143 after SIGTERM (finished lines kept)

EPILOG = f"""prompt lines (JSONL, one object per line; keys: {", ".join(KNOWN_KEYS)}):
  {{"id": ..., "prompt": "text"}}, {{"id": ..., "messages": [{{"role": ..., "content": ...}}]}} or
  {{"id": ..., "input_ids": [ints]}}; optional per-line temperature, top_k, top_p, seed, n, stop,
  include_stop_str_in_output, ignore_eos and logprobs override the flags; an optional per-line
  max_new_tokens (at most --max-new-tokens) ends that prompt earlier.
  Ids must be unique (default: the line's index among the prompts); unknown keys are refused.
  OpenAI Batch API files (`vllm run-batch`'s: {{"custom_id", "method", "url": "/v1/chat/completions" or
  "/v1/completions", "body": {{messages | prompt, max_tokens, temperature, top_p, n, stop, seed,
  logprobs, ...}}}}) are read too, the first line deciding; a request that cannot be served becomes its
  output line's error and the rest runs.

output: one JSON line per prompt and sample (--n): id, index, output_ids, text, finish_reason,
  stop_reason (after a --stop string), prompt_tokens, num_output_tokens, rounds, acceptance_lengths,
  e2e_latency; written as each prompt finishes (so in finishing order; with --static-batches batch by
  batch, in input order); the settings go to OUT.settings.json, which --resume checks: a resumed run's
  lines are those of an uninterrupted run with the same settings. --output-format openai writes OpenAI
  batch output lines instead: one per prompt, its n samples as choices.

exit status: 0 done; {EXIT_ERROR} an error (flag, input, checkpoint or output path; one line on stderr);
  {EXIT_SIGNAL + 2} after SIGINT, {EXIT_SIGNAL + 15} after SIGTERM (finished lines kept; --resume goes on);
  {EXIT_SIGNAL + 13} when standard output closes early (--out - | head)."""


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = Parser(
        prog="ddtree-generate",
        description="Batched generation with autoregressive, DFlash or DDTree decoding.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    add_flags(p, GENERATE)
    return p


# -- the run --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A run checked before any weight loads: its settings (budget resolved), the configs and the
    tokenizer (each read once), every prompt of the file, the ids already in --out, and the batch
    requests not served (their lines' errors) with every request's url."""

    settings: Settings
    target_cfg: Any
    draft_cfg: Any
    codec: Any
    prompts: list
    done: frozenset
    refused: tuple = ()  # prompts.Record of each batch request not served (its `error` says why)
    # id_key -> (its OpenAI url, whether a batch request gave it): chat for messages, else completions
    endpoints: dict = dataclasses.field(default_factory=dict)


def prepare(s: Settings) -> Prepared:
    """Every check that needs no weight: --out, the prompts file, the configs, the limits. A prompt that
    fails a check stops the run, except in an OpenAI batch file, where it becomes its line's error."""
    if s.is_writer:
        check_out(s.out, s.prompts, s.resume, s.overwrite)
    records = scan_prompts(s.prompts, s.max_line_bytes, s.max_new_tokens)
    cfg, dcfg, codec = read_configs(s)
    batch = any(r.endpoint is not None for r in records)
    refused = [r for r in records if r.error is not None]
    records = [r for r in records if r.error is None]
    if batch:  # each request checked alone: one that fails is refused, the others run
        prompts = []
        for r in records:
            try:
                (p,) = tokenize([r], s.prompts, codec, s.chat_template, cfg.vocab_size)
                check_lengths([p], cfg.max_position_embeddings, s.max_new_tokens, s.prompts)
                check_prompt_logprobs([p], s.logprobs, s.prompts)
                check_stops([p], s, codec)
                prompts.append(p)
            except DDTreeError as e:
                refused.append(dataclasses.replace(r, error=str(e).removeprefix(f"{s.prompts}:{r.line}: ")))
        refused.sort(key=lambda r: r.line)
    else:
        prompts = tokenize(records, s.prompts, codec, s.chat_template, cfg.vocab_size)
    s = s.with_budget(cfg, prompts)  # from the whole file, resumed or not: one budget per --out
    check_budget(s, dcfg)
    if not batch:
        check_lengths(prompts, cfg.max_position_embeddings, s.max_new_tokens, s.prompts)
        check_prompt_logprobs(prompts, s.logprobs, s.prompts)
        check_stops(prompts, s, codec)
    done = finished_ids(s.out, s.record()) if s.resume else set()
    start_processes(s)
    check_memory(s, cfg, dcfg)
    endpoints = {id_key(r.id): _endpoint(r) for r in records}
    return Prepared(s, cfg, dcfg, codec, prompts, frozenset(done), tuple(refused), endpoints)


def _endpoint(r) -> tuple[str, bool]:
    """(a prompt's OpenAI url, whether its batch request gave it): a prompts line's messages are chat's,
    its text or token ids completions'."""
    if r.endpoint is not None:
        return r.endpoint, True
    return (openai_batch.CHAT if r.kind == "messages" else openai_batch.COMPLETIONS), False


class Lines:
    """What --out gets for each finished sample and each refused request, in --output-format: ours (a
    line per sample) or openai (a line per prompt once its n samples are in; openai_batch.py)."""

    def __init__(self, run: Prepared):
        s = run.settings
        self.openai = s.output_format == "openai"
        self.prompts = {id_key(p.id): p for p in run.prompts}
        self.samples = {key: p.options.get(SAMPLES, s.n) for key, p in self.prompts.items()}
        self.endpoints, self.model, self.logprobs = run.endpoints, Path(s.target).name, s.logprobs
        self.pending: dict[str, list] = collections.defaultdict(list)
        codec = run.codec
        self.decode = (
            None if codec is None else lambda ids, skip: codec.tokenizer.decode(ids, skip_special_tokens=skip)
        )

    def refused(self, r) -> dict:
        """The line of a request not served."""
        return (
            openai_batch.error_line(r.id, r.error)
            if self.openai
            else {"id": r.id, "index": 0, "error": r.error}
        )

    def of(self, result) -> list[dict]:
        """The lines a finished sample completes: its own (ours), or its prompt's once every sample is in."""
        if not self.openai:
            return [result.to_json()]
        key = id_key(result.id)
        self.pending[key].append(result)
        if len(self.pending[key]) < self.samples[key]:
            return []
        p, results = self.prompts[key], self.pending.pop(key)
        url, batch = self.endpoints[key]
        # log-probabilities: those a batch request asked for; a prompts line's own K, else the run's
        k = (
            p.options.get(openai_batch.TOP_LOGPROBS)
            if batch
            else p.options.get(LOGPROBS, self.logprobs or None)
        )
        return [openai_batch.response_line(p.id, url, self.model, len(p.input_ids), results, k, self.decode)]


def start_processes(s: Settings) -> None:
    """Join the other processes through jax.distributed (before JAX touches any device)."""
    if s.processes is None:
        return
    import jax

    p = s.processes
    try:
        jax.distributed.initialize(p.coordinator, p.count, p.index)
    except Exception as e:  # noqa: BLE001 (jax raises RuntimeError or XlaRuntimeError, with long texts)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DDTreeError(f"--coordinator {p.coordinator}: cannot join the processes ({first})") from None


def budget_words(gen) -> str:
    """The summary's budget: the plan's and its branching, or with --budget auto the budgets the job
    chose and the share of its rounds each ran."""
    plan, ran = gen.plan, gen.plan_rounds
    fixed = f"budget: {plan.budget}   branching: {plan.branching}"
    if not gen.schedule.auto_budgets:
        return fixed
    if not ran:
        return f"{fixed} (--budget auto: only the job on the device chooses; this loop: {gen.loop})"
    total = max(sum(ran.values()), 1)
    order = sorted(ran, key=lambda p: plan_choice.parse_plan(p)[1])
    return "budget: auto (" + ", ".join(f"{p} {ran[p] / total:.0%}" for p in order) + f" of {total} rounds)"


def summarize(results, gen, wall: float, batch_size: int, busy: dict | None = None) -> str:
    """The end-of-run summary (`batch_size`: the prompts per batch asked for; `busy`: `traced`'s
    measurement of the generation, with --trace-device)."""
    tokens = sum(len(r.output_ids) for r in results)
    accepted = [a for r in results for a in r.acceptance_lengths]
    plan, rows = gen.plan, gen.rows_run
    lines = [
        f"method: {plan.method}"
        + (f"   {budget_words(gen)}" if plan.method == "ddtree" else "")
        + f"   batch size: {batch_size}"
        + (f" (run as {rows} rows)" if rows != batch_size else "")
        + f"   attention: {plan.attention}",
        f"prompts: {len(results)}   output tokens: {tokens}   "
        f"generation: {gen.generate_seconds:.2f} s ({tokens / max(gen.generate_seconds, 1e-9):.1f} tok/s)   "
        f"compile: {gen.compile_seconds:.2f} s"
        + (f" (then a warm-up call: {gen.warmup_seconds:.2f} s)" if gen.warmup_seconds else "")
        + f"   wall: {wall:.2f} s",
    ]
    if gen.compile_log:
        hits = gen.cache_hits
        loaded = f", {hits} read from the compile cache" if hits else ""
        lines.append(compiled_programs(gen.compile_log) + loaded)
    if accepted:
        hist = collections.Counter(accepted)
        lines.append(
            f"mean acceptance length: {sum(accepted) / len(accepted):.3f} over {len(accepted)} rounds   "
            "histogram: " + " ".join(f"{k}:{hist[k]}" for k in sorted(hist))
        )
    occ = gen.occupancy
    if occ.host_returns:
        passes = (
            f"prefill passes: {occ.refills} ({occ.prefilled / occ.refills:.1f} prompts"
            + (f", {occ.prefill_steps / occ.refills:.1f} steps" if occ.prefill_steps else "")
            + " a pass)"
            if occ.prefilled and occ.refills
            else f"refills: {occ.refills}"
        )
        lines.append(
            f"loop: {gen.loop}   rounds: {occ.rounds}   host returns: {occ.host_returns}   {passes}   "
            f"rows busy: {occ.busy / max(occ.row_rounds, 1):.1%} of {occ.row_rounds} row-rounds, "
            f"{occ.waiting_fraction():.1%} while prompts waited"
        )
    if busy and "busy_s" in busy:
        generation = max(gen.generate_seconds, 1e-9)
        lines.append(
            f"device busy: {busy['busy_s']:.3f} s, {busy['busy_s'] / generation:.0%} of the generation "
            f"({busy['kernels']} kernels on {busy['plane']}; traced, compilation included)"
        )
    if gen.stage_seconds:
        lines.append("stage seconds: " + " ".join(f"{k}={v:.3f}" for k, v in gen.stage_seconds.items()))
    return "\n".join(lines)


@contextlib.contextmanager
def traced(enabled: bool) -> Iterator[dict]:
    """With `enabled`, the body runs under JAX's profiler and the dict it yields then holds the device's
    busy seconds (`busy_s`: the union of its kernels' intervals), the kernel count and the traced plane;
    else it stays empty."""
    out: dict = {}
    if not enabled:
        yield out
        return
    import jax

    from ddtree_jax.bench.profile import busy_ns, device_events, read_trace

    with tempfile.TemporaryDirectory() as logdir:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # kernels and runtime calls only: Python frames cost host time
        with jax.profiler.trace(logdir, profiler_options=options):
            yield out
        plane, events = device_events(read_trace(logdir))
        out.update(busy_s=busy_ns(events) / 1e9, kernels=len(events), plane=plane)


def compiled_programs(log: list[tuple[str, float]]) -> str:
    """The summary's line of compiled programs: how many, and seconds per program name (x N where a
    name compiled for N shapes), e.g. `programs compiled: 3 (empty 2.92 s, refill 3.87 s, rounds 4.35 s)`."""
    seconds: dict[str, float] = collections.defaultdict(float)
    shapes = collections.Counter(name for name, _ in log)
    for name, s in log:
        seconds[name] += s
    times = {name: "" if shapes[name] == 1 else f" x{shapes[name]}" for name in shapes}
    parts = [f"{name}{times[name]} {s:.2f} s" for name, s in seconds.items()]
    return f"programs compiled: {len(log)} ({', '.join(parts)})"


def left(run: Prepared, llm: LLM) -> int:
    """The samples of the prompts file not yet in --out."""
    return sum(sample_key(p.id, p.index) not in run.done for p in llm.generator.samples(run.prompts))


class Status:
    """What a run says on stderr while no result has come yet (loading the weights, compiling the
    programs, then how many the compile cache gave); to a terminal only, so that an error stays the one
    line a log or a script reads."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def say(self, text: str) -> None:
        """One status line on stderr (when enabled: process 0, on a terminal)."""
        if self.enabled:
            print(f"ddtree-generate: {text}", file=sys.stderr, flush=True)


def cache_note(gen) -> str:
    """How many of the programs compiled so far the compile cache gave (executables.py)."""
    hits = getattr(gen, "cache_hits", 0)
    return f"{hits} of {len(gen.compile_log)} programs read from the compile cache"


def generate_all(run: Prepared, llm: LLM | None, writer: Writer, status: Status | None = None) -> list:
    """Write the refused requests' lines not yet in --out, then run every prompt's samples not yet in
    --out through the LLM (None: none left); process 0 writes each line as its sample finishes. The bar's
    rate and ETA count generation only (its clock is moved past every compilation); an interruption
    carries the results so far (`Interrupted.results`)."""
    from tqdm import tqdm

    s = run.settings
    lines = Lines(run)
    results = []
    try:
        if s.is_writer:
            writer.write([lines.refused(r) for r in run.refused if id_key(r.id) not in run.done])
        if llm is None:
            return results
        finished = llm.run(run.prompts, skip=run.done)
        total = left(run, llm)
        bar = tqdm(
            total=total, desc="prompts (compiling)", unit="prompt", file=sys.stderr, disable=not s.is_writer,
            smoothing=0,
        )  # fmt: skip
        with bar:
            # (a disabled bar, every process but the writer's, has no clock: process 1 died here, and
            # process 0 then gave up waiting for it in Gloo's context after 30 s; issue 50)
            start, compiled = getattr(bar, "start_t", None), llm.compile_seconds
            for result in finished:
                if start is not None:
                    bar.start_t = start + (llm.compile_seconds - compiled)  # the ETA from generation only
                    # (a bar whose last print is before its start is one tqdm's close takes for never
                    # shown: it would leave the line unended, and an interruption's message after it)
                    bar.last_print_t = max(bar.last_print_t, bar.start_t)
                if not results:
                    bar.set_description("prompts", refresh=False)
                if not results and status is not None and status.enabled:
                    bar.write(
                        f"ddtree-generate: first result after {llm.compile_seconds - compiled:.1f} s of "
                        f"compiling ({cache_note(llm.generator)})",
                        file=sys.stderr,
                    )
                with critical():  # a result counts in the summary once its line is written
                    if s.is_writer:
                        writer.write(lines.of(result))
                    results.append(result)
                bar.update(1)
    except Interrupted as e:
        e.kept = f"{writer.written} new results written to {s.out}"  # not a note: JAX adds its own
        e.results = results
        raise
    finally:
        writer.close()
    return results


def run(s: Settings) -> None:
    """Generate for every prompt not yet in --out, appending each result as it finishes; the summary
    at the end, or at an interruption (of what was written)."""
    start = time.perf_counter()
    prepared = prepare(s)
    s = prepared.settings
    report = sys.stderr if s.out == STDOUT else sys.stdout
    samples = [sample_key(p.id, i) for p in prepared.prompts for i in range(p.options.get("n", s.n))]
    refused = [r for r in prepared.refused if id_key(r.id) not in prepared.done]
    if all(key in prepared.done for key in samples) and not refused:
        print(f"all {len(prepared.done)} prompts are already in {s.out}: nothing to do", file=report)
        return
    writer = Writer(s.out, s.record(), append=s.resume)
    if all(key in prepared.done for key in samples):  # only refused requests' lines to write
        generate_all(prepared, None, writer)
        print(f"{len(refused)} requests not served (their lines hold the errors)", file=report)
        return
    status = Status(s.is_writer and sys.stderr.isatty())
    pair = f"{s.target}" + (f" and {s.draft}" if s.draft else "")
    pair = "the bundled pair" if Path(s.target) == BUNDLED / "target" else pair
    status.say(f"loading {pair} ({s.dtype}) ...")
    loading = time.perf_counter()
    # after prepare: jax.distributed starts first, then the compile cache (LLM) and the weights
    llm = LLM.from_settings(s, prepared.target_cfg, prepared.draft_cfg, prepared.codec)
    status.say(
        f"loaded in {time.perf_counter() - loading:.1f} s; compiling the programs (the first result "
        "waits for them)"
    )
    busy: dict = {}
    try:
        with traced(s.trace_device and s.is_writer) as busy:
            results = generate_all(prepared, llm, writer, status)
    except Interrupted as e:
        if s.is_writer and e.results:
            print(
                summarize(e.results, llm.generator, time.perf_counter() - start, s.batch_size),
                file=report,
            )
        raise
    if s.is_writer:
        wall = time.perf_counter() - start
        print(summarize(results, llm.generator, wall, s.batch_size, busy), file=report)
        if prepared.done:
            print(
                f"resumed: {len(prepared.done)} samples were already in {s.out}; {len(results)} generated "
                "now",
                file=report,
            )
        if refused:
            print(f"requests not served: {len(refused)} (their lines hold the errors)", file=report)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (see EPILOG)."""
    __import__("ddtree_jax.xla_flags").xla_flags.apply()  # before any backend starts
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (EXIT_ERROR)
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    try:
        with interruptible():
            run(Settings.from_flags(args))
    except DDTreeError as e:
        print(f"ddtree-generate: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except Interrupted as e:
        where = f" ({e.kept}; --resume continues)" if e.kept else ""
        print(f"ddtree-generate: interrupted by {e}{where}", file=sys.stderr)
        return EXIT_SIGNAL + e.signum
    except BrokenPipeError:  # standard output closed early (| head): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return EXIT_SIGNAL + signal.SIGPIPE
    except OSError as e:  # an unreadable file the checks above did not foresee: one line, no traceback
        print(f"ddtree-generate: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return EXIT_ERROR
    except RuntimeError as e:
        if type(e).__name__ not in ("JaxRuntimeError", "XlaRuntimeError"):
            raise  # a bug: keep its traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"ddtree-generate: error: the device failed ({first}); finished lines are kept", file=sys.stderr
        )
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
