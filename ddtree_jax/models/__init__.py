"""Model families: one module per family over shared pieces, each ending with its `FAMILY` record
(models/family.py: the contract), registered below in one line each and found from HF `architectures`.

  family     the contract: `Family`, everything a family decides
  common     RMSNorm, RoPE, SwiGLU, embedding and head, the decoder stack with drafter features
  gqa        grouped-query attention: its cache entry (`KVEntry`), projections, attend functions
  dense      Qwen3ForCausalLM, LlamaForCausalLM (`DenseConfig`: GQA layers)
  moe        routed experts: the config part MoE families share, router, stacked expert weights,
             dropless dispatches, expert parallelism
  qwen3_moe  Qwen3MoeForCausalLM
  mla        multi-head latent attention: its latent cache entry (`LatentEntry`), absorbed and expanded forms
  deepseek_v3  DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2; Kimi-K2.5's text model)

The engine, the benchmark, sharding, training and the loaders reach a family only through `family(cfg)`
(or `family_of(architecture)`); `load_target_config` reads a checkpoint's config with its family.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ddtree_jax.config import TargetConfig, read_json, token_ids
from ddtree_jax.errors import DDTreeError
from ddtree_jax.models import deepseek_v3, dense, gqa, qwen3_moe
from ddtree_jax.models.family import Family
from ddtree_jax.quant import formats

# HF architecture -> family, and our architecture name (TargetConfig.architecture) -> family
HF_ARCHITECTURES: dict[str, Family] = {}
ARCHITECTURES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make a family findable by its HF architectures and our architecture names (each claimed once)."""
    for hf, ours in family.architectures.items():
        for table, key in ((HF_ARCHITECTURES, hf), (ARCHITECTURES, ours)):
            if table.get(key, family) is not family:
                raise DDTreeError(f"architecture {key!r} of family {family.name!r} is {table[key].name!r}'s")
    for hf, ours in family.architectures.items():
        HF_ARCHITECTURES[hf], ARCHITECTURES[ours] = family, family
    return family


def unregister(family: Family) -> None:
    """Forget a registered family (a test's own family, once the test is done)."""
    for hf, ours in family.architectures.items():
        HF_ARCHITECTURES.pop(hf, None)
        ARCHITECTURES.pop(ours, None)


register(dense.FAMILY)
register(qwen3_moe.FAMILY)
register(deepseek_v3.FAMILY)


def families() -> list[Family]:
    """Every registered family, in registration order."""
    return list(dict.fromkeys(ARCHITECTURES.values()))


def family_of(architecture: str) -> Family:
    """The family of an architecture name ("qwen3", "llama", ...)."""
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise DDTreeError(f"no model family for architecture {architecture!r}") from None


def family(cfg: TargetConfig) -> Family:
    """The family of a target config."""
    return family_of(cfg.architecture)


def with_scan_layers(cfg: TargetConfig, scan: bool = True) -> TargetConfig:
    """`cfg` with its decoder stack as a scan over stacked layers (`TargetConfig.scan_layers`), or
    unrolled (`scan` False). Only the dense family (Qwen3, Llama) scans, and only plain weights: any
    other is refused with a DDTreeError."""
    if not scan:
        return dataclasses.replace(cfg, scan_layers=False)
    fam = family(cfg)
    if fam is not dense.FAMILY or type(cfg) is not dense.DenseConfig:
        raise DDTreeError(
            f"--scan-layers: the {fam.name} family ({cfg.architecture}) runs its layers unrolled only"
        )
    if cfg.quantization is not None:
        raise DDTreeError(
            f"--scan-layers: quantized weights ({type(cfg.quantization).__name__}) load unrolled only"
        )
    return dataclasses.replace(cfg, scan_layers=True)


def cache_entry(cfg: TargetConfig) -> tuple[type, int]:
    """The target cache's entry type and how many entries it holds: the family's `Entry` per layer, or
    one `gqa.StackedKVEntry` of every layer when `cfg.scan_layers`."""
    if cfg.scan_layers:
        return gqa.StackedKVEntry, 1
    return family(cfg).Entry, cfg.num_layers


def bench_shapes() -> dict[str, TargetConfig]:
    """Every family's benchmark shapes by name (`ddtree-bench --shape`)."""
    shapes: dict[str, TargetConfig] = {}
    for f in families():
        for name, cfg in f.SHAPES.items():
            if name in shapes:
                raise DDTreeError(f"benchmark shape {name!r} is declared by two families")
            shapes[name] = cfg
    return shapes


def load_target_config(directory: str | Path, **options: Any) -> TargetConfig:
    """Parse `config.json` (and `generation_config.json` for stop ids) of an HF target directory.

    The family of its `architectures` entry parses the rest (`options`: family settings such as
    `moe_sharding`; families without them ignore them; `scan_layers`: `with_scan_layers`). A quantized
    checkpoint loads only for a family that reads its scheme (`Family.QUANTIZED_FORMATS`); unsupported
    methods are refused by name.
    """
    directory = Path(directory)
    path = directory / "config.json"
    raw = read_json(path)
    archs = raw.get("architectures") or []
    hf = next((a for a in archs if a in HF_ARCHITECTURES), None)
    if hf is None:
        supported = sorted(HF_ARCHITECTURES)
        raise DDTreeError(f"{path}: unsupported architecture {archs!r}; supported: {supported}")
    fam = HF_ARCHITECTURES[hf]
    eos = token_ids(raw.get("eos_token_id"))
    gen_path = directory / "generation_config.json"
    if gen_path.exists():
        eos = token_ids(read_json(gen_path).get("eos_token_id")) or eos
    try:
        scheme = formats.parse_quantization(raw)
    except DDTreeError as e:
        raise DDTreeError(f"{path}: {e}") from None
    if scheme is not None and type(scheme) not in fam.QUANTIZED_FORMATS:
        readers = [a for a, f in HF_ARCHITECTURES.items() if type(scheme) in f.QUANTIZED_FORMATS]
        raise DDTreeError(
            f"{path}: {type(scheme).__name__} quantized checkpoints load for {', '.join(readers)} "
            f"targets only, not {hf}"
        )
    scan = bool(options.pop("scan_layers", False))
    cfg = fam.config_from_hf(raw, path, fam.architectures[hf], eos, **options)
    cfg = cfg if scheme is None else dataclasses.replace(cfg, quantization=scheme)
    return with_scan_layers(cfg) if scan else cfg
