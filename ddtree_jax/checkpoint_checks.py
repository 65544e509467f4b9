"""A checkpoint checked against its config around loading: tensors the model would not read (before
any is read), and weights that are not finite (once placed, one reduction per tensor on the device).

Unused tensors mean the config and the checkpoint disagree (a config with fewer layers than the
checkpoint ran a truncated model without a word), so they are refused, named, unless the family
declares them ignorable (HF's `_keys_to_ignore_on_load_unexpected`: DeepSeek-V3's multi-token-
prediction layer, Kimi-K2.5's vision tower, old checkpoints' `rotary_emb.inv_freq` buffers), or the
environment variable DDTREE_ALLOW_UNUSED_TENSORS=1 allows them (then a notice names them).
"""

from __future__ import annotations

import collections
import functools
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.errors import DDTreeError
from ddtree_jax.weights import Params, WeightSpec

ALLOW_UNUSED = "DDTREE_ALLOW_UNUSED_TENSORS"
SHOWN = 6  # tensor groups named in a message


def used_names(specs: list[WeightSpec], scheme=None, names: Iterable[str] = ()) -> set[str]:
    """The checkpoint tensors a load of `specs` reads: each spec's HF tensors (every stacked piece);
    for a quantized checkpoint (`scheme`, `names` the checkpoint's), the raw fields of each weight in
    the form it is stored in."""
    if scheme is None:
        return {piece.hf_name for spec in specs for piece in spec.pieces()}
    from ddtree_jax.quant import formats
    from ddtree_jax.quant import load as quant_load

    names = set(names)
    used = set()
    for spec in specs:
        form = quant_load.spec_form(scheme, spec, names)
        for piece in spec.pieces():
            if isinstance(form, formats.Plain):
                used.add(piece.hf_name)
                continue
            used |= {f.hf_name for f in quant_load.field_specs(piece, form).values()}
            if isinstance(form, formats.Int4Group):
                used.add(formats.module_of(piece.hf_name) + ".weight_shape")
    return used


def grouped(names: Iterable[str]) -> list[str]:
    """Tensor names for a message: those of one decoder layer (or expert) as `prefix.*` with a count."""
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for name in sorted(names):
        m = re.match(r"(.*?layers\.\d+\.)", name)
        groups[m.group(1) + "*" if m else name].append(name)
    return [k if len(v) == 1 and k == v[0] else f"{k} ({len(v)} tensors)" for k, v in groups.items()]


def check_unused(directory: str | Path, names: Iterable[str], used: set[str], ignored: Iterable[str]) -> None:
    """Refuse a checkpoint holding tensors that the load would not read (`names`: all of its tensors,
    `used`: those read), except those matching an `ignored` pattern (re.match) of the family."""
    ignore = re.compile("|".join(f"(?:{p})" for p in ignored)) if ignored else None
    unused = [n for n in names if n not in used and not (ignore and ignore.match(n))]
    if not unused:
        return
    groups = grouped(unused)
    shown = ", ".join(groups[:SHOWN]) + (f" and {len(groups) - SHOWN} more" if len(groups) > SHOWN else "")
    what = f"{directory}: {len(unused)} tensors that config.json does not use: {shown}"
    if os.environ.get(ALLOW_UNUSED) == "1":
        print(f"{what}; not loaded ({ALLOW_UNUSED}=1)", file=sys.stderr)
        return
    raise DDTreeError(
        f"{what} (does the config describe this checkpoint? more layers or experts?); "
        f"{ALLOW_UNUSED}=1 loads it anyway"
    )


def check_against_config(
    directory: str | Path, specs: list[WeightSpec], ignored: Iterable[str], scheme=None
) -> None:
    """Before any tensor is read (headers only): refuse a checkpoint that lacks a tensor `specs` read, or
    holds tensors they do not read (`check_unused`)."""
    from ddtree_jax.checkpoint import Checkpoint

    names = Checkpoint(directory).where
    used = used_names(specs, scheme, names)
    missing = sorted(used.difference(names))
    if missing:  # what the load would find first
        raise DDTreeError(f"{directory}: tensor '{missing[0]}' not found in the checkpoint")
    check_unused(directory, names, used, ignored)


# Non-finite values by their bits, for the host check: (unsigned view, the bits below the sign); a value
# is infinity or NaN when those bits are at least the exponent's all-ones pattern (float8_e4m3fn has no
# infinity: its NaN is exponent and mantissa all ones).
_NONFINITE_BITS = {
    jnp.dtype(jnp.bfloat16): (np.uint16, 0x7FFF, 0x7F80),
    jnp.dtype(jnp.float16): (np.uint16, 0x7FFF, 0x7C00),
    jnp.dtype(jnp.float32): (np.uint32, 0x7FFFFFFF, 0x7F800000),
    jnp.dtype(jnp.float8_e4m3fn): (np.uint8, 0x7F, 0x7F),
}
SLICE = 1 << 18  # elements checked at a time: the temporary stays in the CPU's cache (~2 GB/s)


def _all_finite(data: np.ndarray) -> bool:
    """Every value of a host array finite, read slice by slice by its bits (no float arithmetic)."""
    if data.dtype not in _NONFINITE_BITS:
        return bool(np.isfinite(data.astype(np.float32)).all())
    view, magnitude, nonfinite = _NONFINITE_BITS[data.dtype]
    flat = np.ascontiguousarray(data).reshape(-1).view(view)
    buf = np.empty((min(SLICE, flat.size),), view)
    for start in range(0, flat.size, SLICE):
        part = flat[start : start + SLICE]
        np.bitwise_and(part, magnitude, out=buf[: part.size])
        if buf[: part.size].max() >= nonfinite:
            return False
    return True


def _host_finite(x: jax.Array, stacked: bool) -> np.ndarray:
    """x finite, from its shards' bytes in host memory (CPU devices: no copy, nothing to compile);
    stacked: per leading index, [n] bools."""
    n = x.shape[0] if stacked else 1
    ok = np.ones((n,), bool)
    for shard in x.addressable_shards:
        data = np.asarray(shard.data)
        if data.size == 0 or _all_finite(data):
            continue
        if not stacked:
            ok[0] = False
            continue
        for row, index in zip(data, range(n)[shard.index[0]], strict=True):  # which piece: errors only
            ok[index] &= _all_finite(row)
    return ok


@functools.cache
def _device_finite(stacked: bool):
    """A jitted check: all finite (stacked: per leading index, [n] bools)."""
    if stacked:
        return jax.jit(lambda x: jnp.isfinite(x).reshape(x.shape[0], -1).all(axis=1))
    return jax.jit(lambda x: jnp.isfinite(x).all())


def _finite(x: jax.Array, stacked: bool):
    """Whether x is finite (per leading index when stacked), as an array or a pending device result.

    On accelerators one jitted reduction per tensor reads it at memory speed; on CPU devices the same
    reductions cost a compilation per shape (4-5 s for the bundled pair on a loaded 2-core host, more
    than its whole load), so the bytes are checked in place instead. Several processes always reduce
    on the devices: each sees only its own shards, and all must agree."""
    on_cpu = all(d.platform == "cpu" for d in x.sharding.device_set)
    if on_cpu and jax.process_count() == 1:
        return _host_finite(x, stacked)
    if jax.process_count() > 1:
        # one reduction at a time: the CPU client may run queued collective programs in another order in
        # each process, and two processes then wait on different collectives (Gloo gives up after 30 s)
        return jax.block_until_ready(_device_finite(stacked)(x))
    return _device_finite(stacked)(x)


def check_finite(directory: str | Path, params: Params, specs: list[WeightSpec]) -> None:
    """Refuse weights holding NaN or infinity, naming the first such tensor (a stacked one by its
    piece). One reduction per floating-point array (`_finite`), dispatched for all tensors before any
    result is fetched; quantized weights are checked field by field (int4 words cannot be non-finite)."""
    pending = []
    for spec in specs:
        node = params
        for key in spec.path:
            node = node[key]
        for path, leaf in jax.tree_util.tree_leaves_with_path(node):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                field = jax.tree_util.keystr(path, simple=True)
                pending.append((spec, field, _finite(leaf, bool(spec.stack))))
    for spec, field, ok in pending:
        ok = np.asarray(jax.device_get(ok)).reshape(-1)
        if ok.all():
            continue
        name = spec.pieces()[int((~ok).argmax())].hf_name if spec.stack else spec.hf_name
        of = f" ({field} field)" if field else ""
        raise DDTreeError(f"{directory}: tensor '{name}'{of} holds NaN or infinite values")
