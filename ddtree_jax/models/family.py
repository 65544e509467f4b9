"""The contract of a model family: one frozen record of everything a family decides.

Each family module (models/dense.py, qwen3_moe.py, deepseek_v3.py) ends with `FAMILY = Family(...)`,
and models/__init__.py registers it in one line; the engine, the benchmark, sharding, the loaders and
the drafter reach a family only through `models.family(cfg)`, so a new family is one new file plus
one registry line.

Shapes in the signatures: tokens [B, T] int32, positions [B, T], mask [B, T, T] bool; a forward's
`kv` holds per layer the new tokens' cache entry (the family's `Entry`, in flight [B, T, ...]); a
config with `scan_layers` (dense family only) holds one `gqa.StackedKVEntry` instead
(`models.cache_entry` says which).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from ddtree_jax.config import LayerDims, TargetConfig


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """What a model family decides (functions lower case; its constants and entry type capitalised).

    name                 the family's name ("dense", "qwen3_moe", ...)
    architectures        HF `architectures` entry -> our architecture name (`TargetConfig.architecture`)
    config_from_hf       (raw config.json, path, architecture, eos ids, **options) -> its config; options
                         are family settings (e.g. `moe_sharding`), ignored by families without them
    weight_specs         cfg -> every weight with its HF name, shape and logical axes
    forward              (params, cfg, tokens, positions, mask, cache, *, feature_layers, attention,
                         model_axis, dropout) -> common.ForwardOutput
    embed, logits        the embedding and head (the drafter reads the target's through them)
    Entry                its cache entry type: a pytree whose cached leaves share one time axis
                         (`Entry.time_axis`), with `cache_spec()` / `new_spec()` PartitionSpecs
    cache_shapes         (cfg, batch, capacity, tp, dtype) -> global ShapeDtypeStructs per layer
    unread_weight_bytes  (params, cfg, tokens, nbytes) -> bytes one device holds that a pass over
                         `tokens` tokens need not read (the benchmark's floor)
    check_divisible      (cfg, tp, model) -> None, or a clear error: its mesh rules
    ignored_tensors      cfg -> patterns (re.match) of checkpoint tensors it may find and not read;
                         any other unread tensor is refused (checkpoint_checks)
    heads_per_device     (cfg, tp) -> query heads one device holds (the memory check's scores)
    draft_dims           cfg -> the layer shape of a DFlash drafter for it where none is published
                         (benchmarks)
    ATTENTION            the attention kind of its layers: the table of `attention.KERNELS` ("gqa",
                         "mla") that `--attention` names an implementation of
    PAD_ONE_ROW_AR       whether a one-row ar step runs as two rows (engine.py)
    ROUTED_EXPERTS       whether tokens are routed to experts (the default ddtree budgets: budgets.py)
    CUDNN_PREFILL        whether its prefill chunks may use cuDNN attention (GQA layers, `cfg.dims`)
    QUANTIZED_FORMATS    the quantization schemes (quant.formats types) its forward reads as stored
    SHAPES               benchmark shapes: name -> config (`ddtree-bench --shape`)
    unfused              cfg -> the config whose weights are as the checkpoint stores them, one matmul per
                         HF tensor (dense: q/k/v and gate/up unfused; others: cfg itself): the opt-out
                         of fused projections, and the layout quantized weights keep
    """

    name: str
    architectures: Mapping[str, str]
    config_from_hf: Callable[..., TargetConfig]
    weight_specs: Callable[[Any], list]
    forward: Callable[..., Any]
    embed: Callable[..., Any]
    logits: Callable[..., Any]
    Entry: type
    cache_shapes: Callable[..., list]
    unread_weight_bytes: Callable[..., float]
    check_divisible: Callable[..., None]
    ignored_tensors: Callable[[Any], tuple[str, ...]]
    heads_per_device: Callable[[Any, int], int]
    draft_dims: Callable[[Any], LayerDims]
    ATTENTION: str
    PAD_ONE_ROW_AR: bool
    ROUTED_EXPERTS: bool
    CUDNN_PREFILL: bool
    QUANTIZED_FORMATS: tuple[type, ...] = ()
    SHAPES: Mapping[str, TargetConfig] = dataclasses.field(default_factory=dict)
    unfused: Callable[[Any], Any] = lambda cfg: cfg

    def __post_init__(self):
        for name in ("architectures", "SHAPES"):  # read-only copies: a family is fixed once made
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
