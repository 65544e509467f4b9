"""A target/drafter pair and the plan `ddtree-generate` makes for it: the defaults in one place.

`make_plan` holds the plan's defaults (budget by rows per device at 1k context when not given: the
tools resolve it from their prompts' context first, `settings.Settings.with_budget`; branching
`budgets.default_branching`; the block-size override; attention "auto"); `batch_shape` the rows a batch
runs (`programs.rows_to_run`); `load_pair` loads the models once for any number of plans;
`load_generator` does all of it from a run's settings, as `ddtree-generate` does. Tools, scripts and
tests call these instead of copying the rules.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from ddtree_jax.budgets import default_branching, rows_per_device
from ddtree_jax.config import DraftConfig, TargetConfig
from ddtree_jax.engine import Plan
from ddtree_jax.errors import DDTreeError
from ddtree_jax.programs import Shape, rows_to_run
from ddtree_jax.text import TextCodec
from ddtree_jax.weights import Params


@dataclasses.dataclass
class Pair:
    """A loaded target (and drafter, None without one), its tokenizer and stop ids."""

    target: TargetConfig
    params: Params
    draft: DraftConfig | None
    draft_params: Params | None
    codec: TextCodec | None
    stop_ids: tuple[int, ...]


def use_dtype(dtype: str) -> jnp.dtype:
    """The compute dtype; float32 also sets the highest matmul precision, as ddtree-generate does."""
    if dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")
    return jnp.dtype(dtype)


def load_pair(
    target_dir: str | Path,
    draft_dir: str | Path | None,
    dtype: str,
    tp: int = 1,
    dp: int = 1,
    *,
    moe_sharding: str = "ep",
    draft_yarn_scaling: str | None = None,
    dequantize: bool = False,
    scan_layers: bool = False,
    configs: tuple[TargetConfig, DraftConfig | None] | None = None,
    codec: TextCodec | None = None,
) -> Pair:
    """Load the target (and the drafter when `draft_dir` is given) onto a tp x dp mesh
    (`moe_sharding`: how a MoE target's experts split; `draft_yarn_scaling`: a yarn drafter's factor;
    `dequantize`: a quantized target's weights expanded to `dtype` at load instead of kept quantized;
    `scan_layers`: the target's layers stacked for one scan, `models.with_scan_layers`).
    `configs` and `codec`: the configs and tokenizer already read (default: read here)."""
    from ddtree_jax import drafter, models, target
    from ddtree_jax.config import load_draft_config
    from ddtree_jax.models import load_target_config
    from ddtree_jax.sharding import make_mesh, param_sharding

    jdtype = use_dtype(dtype)
    sharding = param_sharding(make_mesh(tp, dp))
    if configs is None:
        cfg = load_target_config(target_dir, moe_sharding=moe_sharding)
        dcfg = None if draft_dir is None else load_draft_config(draft_dir, cfg, draft_yarn_scaling)
    else:
        cfg, dcfg = configs
    if scan_layers:
        cfg = models.with_scan_layers(cfg)
    # Check that both models split tp ways before placing any weight.
    models.family(cfg).check_divisible(cfg, tp)
    if draft_dir is not None:
        drafter.check_divisible(dcfg, tp)
    cfg, params = target.load(target_dir, jdtype, sharding, dequantize, cfg=cfg)
    draft_params = None
    if draft_dir is not None:
        dcfg, draft_params = drafter.load(draft_dir, cfg, jdtype, sharding, cfg=dcfg)
    if codec is None and (Path(target_dir) / "tokenizer.json").exists():
        codec = TextCodec(target_dir)
    return Pair(cfg, params, dcfg if draft_dir is not None else None, draft_params, codec, cfg.eos_token_ids)


def make_plan(
    target_cfg: TargetConfig,
    draft_cfg: DraftConfig | None,
    method: str,
    *,
    max_new_tokens: int,
    batch_size: int = 1,
    budget: int | None = None,
    branching: int | None = None,
    block_size: int | None = None,
    attention: str = "auto",
    draft_window: int | None = None,
    tp: int = 1,
    dp: int = 1,
    tempered_draft: bool = False,
    logprobs: int = 0,
    logprobs_mode: str = "raw",
) -> Plan:
    """The plan ddtree-generate compiles (None: its defaults; `batch_size` decides the default budget)."""
    from ddtree_jax.attention import default_implementation
    from ddtree_jax.budgets import default_budget

    if method == "ar":
        draft_cfg = None
    elif block_size is not None:
        if block_size > draft_cfg.block_size:
            raise DDTreeError(f"--block-size {block_size} exceeds the drafter's {draft_cfg.block_size}")
        draft_cfg = dataclasses.replace(draft_cfg, block_size=block_size)
    rows = rows_per_device(batch_size, dp)
    budget = (budget or default_budget(rows, target_cfg)) if method == "ddtree" else 0
    branching = branching or default_branching(method, budget)
    return Plan(
        target=target_cfg,
        draft=draft_cfg,
        method=method,
        max_new_tokens=max_new_tokens,
        budget=budget,
        branching=min(branching, target_cfg.vocab_size),
        attention=default_implementation() if attention == "auto" else attention,
        draft_window=draft_window,
        tempered_draft=tempered_draft,
        tp=tp,
        dp=dp,
        logprobs=logprobs,
        logprobs_mode=logprobs_mode,
    )


def batch_shape(plan: Plan, batch_size: int, prompt_slots: int) -> Shape:
    """The shape of a static batch of `batch_size` prompts of up to `prompt_slots` tokens: the rows per
    "data" device (one ar row runs as two, `programs.rows_to_run`) times the devices."""
    rows = rows_to_run(plan.method, rows_per_device(batch_size, plan.dp), plan.target) * plan.dp
    return Shape.of(plan, rows, prompt_slots)


def plan_from_args(
    pair: Pair, args, method: str | None = None, budget: int | None = None, max_new_tokens: int | None = None
) -> Plan:
    """make_plan from a tool's parsed flags (`method`, `budget`, `max_new_tokens` override the flags')."""
    method = method or args.method
    return make_plan(
        pair.target,
        pair.draft,
        method,
        batch_size=args.batch_size,
        max_new_tokens=max_new_tokens or args.max_new_tokens,
        budget=budget if budget is not None else args.budget,
        branching=args.branching if method == "ddtree" else None,
        block_size=args.block_size,
        attention=args.attention,
        draft_window=args.draft_window,
        tp=args.tp,
        dp=args.dp,
    )


def sampling_from_args(args) -> dict:
    """The default sampling settings {temperature, top_k, top_p, seed} from a tool's parsed flags."""
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}


def generator(
    pair: Pair, plan: Plan, defaults: dict | None = None, host_stepped: bool = False, schedule=None
):
    """A Generator for `plan` over the pair's models (greedy unless the `defaults` say otherwise;
    `schedule`: a `scheduler.Schedule`, None for its defaults, host-stepped as asked)."""
    from ddtree_jax.scheduler import Generator, Schedule

    draft_params = None if plan.method == "ar" else pair.draft_params
    schedule = schedule or Schedule(host_stepped=host_stepped)
    if plan.method == "ddtree" and schedule.auto_budgets:
        schedule = dataclasses.replace(schedule, auto_budgets=priced_auto_budgets(pair, plan, schedule))
    return Generator(pair.params, draft_params, plan, pair.stop_ids, pair.codec, defaults, schedule)


def priced_auto_budgets(pair: Pair, plan: Plan, schedule) -> tuple[int, ...]:
    """--budget auto's budgets less those the job's cost table (plan_choice.job_costs: this device
    kind, the target's size) cannot price at the run's rows per device: its chooser would never pick
    them, so they are neither compiled nor warmed up (all of them if the table prices none: the
    chooser then says so)."""
    from ddtree_jax import plan_choice

    budgets = schedule.auto_budgets
    sizes = float(sum(x.size for x in jax.tree.leaves(pair.params)))
    _, costs = plan_choice.job_costs(jax.devices()[0].device_kind, plan.target, plan.draft, sizes, budgets)
    priced = plan_choice.priced_budgets(costs, budgets, rows_per_device(schedule.batch_size, plan.dp))
    return priced or budgets


def load_generator(s, target_cfg: TargetConfig | None = None, draft_cfg=None, codec=None):
    """Load the pair of a run's settings (`settings.Settings`, budget resolved) and make its
    Generator; `target_cfg`, `draft_cfg`, `codec`: already read (default: read here)."""
    configs = None if target_cfg is None else (target_cfg, draft_cfg)
    pair = load_pair(
        s.target,
        s.draft,
        s.dtype,
        s.tp,
        s.dp,
        moe_sharding=s.moe_sharding,
        draft_yarn_scaling=s.draft_yarn_scaling,
        dequantize=s.dequantize,
        scan_layers=s.scan_layers,
        configs=configs,
        codec=codec,
    )
    plan = make_plan(
        pair.target,
        pair.draft,
        s.method,
        max_new_tokens=s.max_new_tokens,
        batch_size=s.batch_size,
        budget=s.budget,
        branching=s.branching,
        block_size=s.block_size,
        attention=s.attention,
        draft_window=s.draft_window,
        tp=s.tp,
        dp=s.dp,
        logprobs=s.logprobs,
        logprobs_mode=s.logprobs_mode,
    )
    return generator(pair, plan, s.defaults, schedule=s.schedule())
