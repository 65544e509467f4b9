"""A target/drafter pair and the plan `ddtree-generate` makes for it: the CLI's defaults in one place.

`make_plan` holds the defaults (budget by rows per device at 1k context when not given: ddtree-generate
and the comparisons resolve it from their prompts' context first, `cli.resolve_budget`; branching
`budgets.default_branching`, the block-size
override, attention "auto", ar's padding to two rows); `load_pair` loads the models once for any
number of plans; `load_generator` does both, as `ddtree-generate` does. Tools, scripts and tests call
these instead of copying the rules.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from ddtree_jax.budgets import default_branching
from ddtree_jax.config import DraftConfig, TargetConfig
from ddtree_jax.engine import Plan, rows_to_run
from ddtree_jax.errors import DDTreeError
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
) -> Pair:
    """Load the target (and the drafter when `draft_dir` is given) onto a tp x dp mesh
    (`moe_sharding`: how a MoE target's experts split; `draft_yarn_scaling`: a yarn drafter's factor;
    `dequantize`: a quantized target's weights expanded to `dtype` at load instead of kept quantized)."""
    from ddtree_jax import drafter, models, target
    from ddtree_jax.config import load_draft_config
    from ddtree_jax.models import load_target_config
    from ddtree_jax.sharding import make_mesh, param_sharding

    jdtype = use_dtype(dtype)
    sharding = param_sharding(make_mesh(tp, dp))
    # Check that both models split tp ways before placing any weight.
    cfg = load_target_config(target_dir, moe_sharding=moe_sharding)
    models.family(cfg).check_divisible(cfg, tp)
    if draft_dir is not None:
        drafter.check_divisible(load_draft_config(draft_dir, cfg, draft_yarn_scaling), tp)
    cfg, params = target.load(target_dir, jdtype, sharding, dequantize, moe_sharding=moe_sharding)
    dcfg = draft_params = None
    if draft_dir is not None:
        dcfg, draft_params = drafter.load(draft_dir, cfg, jdtype, sharding, draft_yarn_scaling)
    codec = TextCodec(target_dir) if (Path(target_dir) / "tokenizer.json").exists() else None
    return Pair(cfg, params, dcfg, draft_params, codec, cfg.eos_token_ids)


def make_plan(
    target_cfg: TargetConfig,
    draft_cfg: DraftConfig | None,
    method: str,
    *,
    batch_size: int,
    max_new_tokens: int,
    budget: int | None = None,
    branching: int | None = None,
    block_size: int | None = None,
    attention: str = "auto",
    draft_window: int | None = None,
    tp: int = 1,
    dp: int = 1,
    prompt_len: int = 16,
    tempered_draft: bool = False,
) -> Plan:
    """The plan ddtree-generate compiles for `batch_size` prompts per batch (None: its defaults)."""
    from ddtree_jax.attention import default_implementation
    from ddtree_jax.budgets import default_budget, rows_per_device

    rows = rows_per_device(batch_size, dp)
    if method == "ar":
        draft_cfg = None
    elif block_size is not None:
        if block_size > draft_cfg.block_size:
            raise DDTreeError(f"--block-size {block_size} exceeds the drafter's {draft_cfg.block_size}")
        draft_cfg = dataclasses.replace(draft_cfg, block_size=block_size)
    budget = (budget or default_budget(rows, target_cfg)) if method == "ddtree" else 0
    branching = branching or default_branching(method, budget)
    return Plan(
        target=target_cfg,
        draft=draft_cfg,
        method=method,
        batch_size=rows_to_run(method, rows, target_cfg) * dp,  # padded with inactive rows
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        budget=budget,
        branching=min(branching, target_cfg.vocab_size),
        attention=default_implementation() if attention == "auto" else attention,
        draft_window=draft_window,
        tempered_draft=tempered_draft,
        tp=tp,
        dp=dp,
    )


def plan_from_args(
    pair: Pair, args, method: str | None = None, budget: int | None = None, max_new_tokens: int | None = None
) -> Plan:
    """make_plan from ddtree-generate's flags (`method`, `budget`, `max_new_tokens` override the flags')."""
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
    """The default sampling settings {temperature, top_k, top_p, seed} from ddtree-generate's flags."""
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}


def generator(
    pair: Pair, plan: Plan, sampling: dict | None = None, host_stepped: bool = False, schedule=None
):
    """A Generator for `plan` over the pair's models (greedy unless `sampling` says otherwise;
    `schedule`: a `scheduling.Schedule`, None for its defaults)."""
    from ddtree_jax.generation import Generator
    from ddtree_jax.sampling import GREEDY
    from ddtree_jax.scheduling import Schedule

    draft_params = None if plan.method == "ar" else pair.draft_params
    return Generator(
        pair.params,
        draft_params,
        plan,
        pair.stop_ids,
        pair.codec,
        host_stepped,
        sampling=GREEDY | (sampling or {}),
        schedule=schedule or Schedule(),
    )


def load_generator(args):
    """Load the pair named by ddtree-generate's (checked) flags and make its Generator."""
    from ddtree_jax.scheduling import Schedule

    pair = load_pair(
        args.target,
        None if args.method == "ar" else args.draft,
        args.dtype,
        args.tp,
        args.dp,
        moe_sharding=args.moe_sharding,
        draft_yarn_scaling=args.draft_yarn_scaling,
        dequantize=args.dequantize,
    )
    plan = plan_from_args(pair, args)
    schedule = Schedule(
        chunk=args.prefill_chunk,
        batch_invariant=args.batch_invariant,
        prefill_attention=getattr(args, "prefill_attention", "same"),
    )
    return generator(pair, plan, sampling_from_args(args), args.host_stepped, schedule)
