"""Model families: one module per family over shared pieces, found from HF `architectures`.

  common     RMSNorm, RoPE, SwiGLU, embedding and head, the decoder stack with drafter features
  gqa        grouped-query attention: its cache entry (`KVEntry`), projections, attend functions
  dense      Qwen3ForCausalLM, LlamaForCausalLM
  moe        routed experts: router, stacked expert weights, dropless dispatches, expert parallelism
  qwen3_moe  Qwen3MoeForCausalLM
  mla        multi-head latent attention: its latent cache entry (`LatentEntry`), absorbed and expanded forms
  deepseek_v3  DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2; Kimi-K2.5's text model)

A family module provides `config_from_hf(raw, path, arch, eos, **options)`, `weight_specs(cfg)`,
`forward(params, cfg, tokens, positions, mask, cache, *, feature_layers, attention, model_axis,
dropout)` -> `common.ForwardOutput`, `Entry` (its cache entry type: a pytree whose cached leaves share
one time axis, `Entry.time_axis`, with `cache_spec()` / `new_spec()` PartitionSpecs),
`cache_shapes(cfg, batch, capacity, tp, dtype)`, `unread_weight_bytes` (the benchmark's floor),
`PAD_ONE_ROW_AR` (whether a one-row ar step runs as two rows), `ROUTED_EXPERTS` (whether tokens are
routed to experts: the CLI then takes the MoE default budgets), `check_divisible(cfg, tp)` (its mesh
rules), `ignored_tensors(cfg)` (patterns of checkpoint tensors it may find and not read: anything else
unread is refused, checkpoint_checks) and `embed` / `logits` (the drafter reads the target's through
them). The engine, the benchmark, sharding and training reach a family only through `family(cfg)`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# HF architecture -> our architecture name (TargetConfig.architecture)
ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3_moe"}
ARCHITECTURES |= {"DeepseekV3ForCausalLM": "deepseek_v3", "KimiK25ForConditionalGeneration": "kimi_k25"}
# our architecture name -> family module
FAMILIES = {"qwen3": "dense", "llama": "dense", "qwen3_moe": "qwen3_moe"}
FAMILIES |= {"deepseek_v3": "deepseek_v3", "kimi_k25": "deepseek_v3"}


def family_of(architecture: str) -> ModuleType:
    """The family module of an architecture name ("qwen3", "llama", ...)."""
    return importlib.import_module(f"ddtree_jax.models.{FAMILIES[architecture]}")


def family(cfg) -> ModuleType:
    """The family module of a target config."""
    return family_of(cfg.architecture)
