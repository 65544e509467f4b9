"""The two quantized checkpoint formats as published, read from config.json and safetensors.

FP8 block-scaled (DeepSeek-V3, Kimi-K2; `quant_method: fp8`): `<m>.weight` float8 e4m3fn [out, in] and
`<m>.weight_scale_inv` float32 [ceil(out / bo), ceil(in / bi)] for `weight_block_size: [bo, bi]`;
the weight is `fp8 * scale` in float32 per block (DeepSeek's own dequantisation: its blocks at the
edges are partial, the scale covers the whole block).

INT4 W4A16 (Kimi-K2.5/K2.6 routed experts; `quant_method: compressed-tensors`, `format:
pack-quantized`): `<m>.weight_packed` int32 [out, ceil(in / 8)], `<m>.weight_scale` bf16
[out, in / g], `<m>.weight_shape` [out, in]. Value q in [-8, 7] is stored as the nibble q + 8;
element i of a row sits in word i // 8 at bits 4 * (i % 8) (the lowest nibble first), as
compressed-tensors' `pack_to_int32` writes it. The weight is `q * scale` per group of g inputs,
rounded to the scale's dtype (compressed-tensors' `dequantize`).

Here weights are [in, out] (x @ W); the on-device layouts are in `ddtree_jax.quant.arrays`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Container

import ml_dtypes
import numpy as np

from ddtree_jax.errors import DDTreeError

SUPPORTED = "fp8 (block-scaled e4m3, DeepSeek-V3 layout) and compressed-tensors (pack-quantized int4, W4A16)"


@dataclasses.dataclass(frozen=True)
class Fp8Block:
    """FP8 e4m3 weights with one float32 scale per [bo, bi] block (HF [out, in] order)."""

    block: tuple[int, int]  # (out, in), e.g. (128, 128)
    ignored: tuple[str, ...] = ()  # module names stored unquantized (modules_to_not_convert)


@dataclasses.dataclass(frozen=True)
class Int4Group:
    """Symmetric int4 weights packed 8 per int32, one scale per `group` consecutive inputs."""

    group: int  # e.g. 32
    ignore: tuple[str, ...] = ()  # compressed-tensors ignore list: names or "re:" patterns


Scheme = Fp8Block | Int4Group


@dataclasses.dataclass(frozen=True)
class Plain:
    """A tensor stored as an ordinary float weight."""


Form = Fp8Block | Int4Group | Plain
PLAIN = Plain()


def _unsupported(what: str) -> DDTreeError:
    """A clear error naming the quantization method or option."""
    return DDTreeError(f"config.json quantization_config: {what} is not supported (supported: {SUPPORTED})")


def parse_quantization(config: dict) -> Scheme | None:
    """The scheme of an HF config.json (None: not quantized); the text config of a wrapper counts too."""
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _parse_fp8(qc)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    raise _unsupported(f"quant_method '{method}'")


def _parse_fp8(qc: dict) -> Fp8Block:
    """DeepSeek-V3's fp8 block config: fmt e4m3, dynamic activations, weight_block_size [bo, bi]."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _unsupported(f"fp8 fmt '{fmt}'")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _unsupported(f"fp8 activation_scheme '{qc['activation_scheme']}'")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise _unsupported(f"fp8 weight_block_size {block!r} (per-tensor or malformed)")
    if qc.get("scale_fmt", "float") not in ("float", "ue8m0"):
        raise _unsupported(f"fp8 scale_fmt '{qc['scale_fmt']}'")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise _unsupported(f"fp8 expert_dtype '{qc['expert_dtype']}'")
    ignored = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return Fp8Block((int(block[0]), int(block[1])), tuple(ignored))


def _parse_compressed_tensors(qc: dict) -> Int4Group:
    """compressed-tensors pack-quantized, one config group of symmetric int4 group weights."""
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise _unsupported(f"compressed-tensors format '{fmt}'")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _unsupported(f"compressed-tensors quantization_status '{qc['quantization_status']}'")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _unsupported(f"compressed-tensors with {len(groups)} config_groups (one is)")
    group = groups[0]
    if group.get("format", fmt) != "pack-quantized":
        raise _unsupported(f"compressed-tensors group format '{group['format']}'")
    if group.get("input_activations") or group.get("output_activations"):
        raise _unsupported("compressed-tensors activation quantization (W4A16 only)")
    w = group.get("weights") or {}
    wanted = {"num_bits": 4, "type": "int", "strategy": "group", "symmetric": True}
    for key, value in wanted.items():
        if w.get(key) != value:
            raise _unsupported(f"compressed-tensors weights {key}={w.get(key)!r} (need {value!r})")
    if w.get("actorder") not in (None, False) or w.get("dynamic") not in (None, False):
        raise _unsupported("compressed-tensors weights with actorder or dynamic scales")
    size = w.get("group_size")
    if not isinstance(size, int) or size <= 0 or size % 8:
        raise _unsupported(f"compressed-tensors group_size {size!r} (a multiple of 8)")
    return Int4Group(size, tuple(qc.get("ignore") or ()))


def module_of(weight_name: str) -> str:
    """'model.layers.1.mlp.experts.3.up_proj.weight' -> 'model.layers.1.mlp.experts.3.up_proj'."""
    if not weight_name.endswith(".weight"):
        raise DDTreeError(f"'{weight_name}' is not a module weight (no '.weight' suffix)")
    return weight_name[: -len(".weight")]


def _ignored(module: str, patterns: tuple[str, ...]) -> bool:
    """compressed-tensors' name rule: 're:<regex>' is re.match on the module name, else equality."""
    return any(re.match(p[3:], module) is not None if p.startswith("re:") else p == module for p in patterns)


def stored_form(scheme: Scheme | None, weight_name: str, names: Container[str]) -> Form:
    """How the checkpoint stores the weight `weight_name`: the tensors present decide, the config
    gives the parameters; a tensor present against the config's ignore list is an error."""
    module = module_of(weight_name)
    if isinstance(scheme, Fp8Block) and module + ".weight_scale_inv" in names:
        if module in scheme.ignored:
            raise DDTreeError(f"'{module}' has fp8 block scales but quantization_config ignores it")
        return scheme
    if isinstance(scheme, Int4Group) and module + ".weight_packed" in names:
        if _ignored(module, scheme.ignore):
            raise DDTreeError(f"'{module}' is packed int4 but quantization_config ignores it")
        return scheme
    if module + ".weight_packed" in names or module + ".weight_scale_inv" in names:
        kind = "no" if scheme is None else type(scheme).__name__
        raise DDTreeError(f"'{module}' is stored quantized but config.json declares {kind} quantization")
    return PLAIN


def blocks(n: int, size: int) -> int:
    """How many blocks of `size` cover n (the last one may be partial)."""
    return -(-n // size)


# ---- NumPy references, in the checkpoint's [out, in] layout ------------------------------------------


def unpack_int4(packed: np.ndarray, n_in: int) -> np.ndarray:
    """int32 [..., out, ceil(in / 8)] -> int8 values in [-8, 7], [..., out, in]."""
    words = np.asarray(packed, dtype=np.int32).view(np.uint32)
    shifts = np.arange(8, dtype=np.uint32) * 4
    nibbles = (words[..., None] >> shifts) & 0xF  # [..., out, words, 8]: lowest nibble first
    flat = nibbles.reshape(*words.shape[:-1], -1)[..., :n_in]
    return (flat.astype(np.int16) - 8).astype(np.int8)


def pack_int4(values: np.ndarray) -> np.ndarray:
    """int8 values in [-8, 7], [..., out, in] -> int32 [..., out, ceil(in / 8)] (the inverse)."""
    v = np.asarray(values).astype(np.int16)
    if v.min(initial=0) < -8 or v.max(initial=0) > 7:
        raise ValueError("int4 values must lie in [-8, 7]")
    pad = -v.shape[-1] % 8
    v = np.pad(v + 8, [(0, 0)] * (v.ndim - 1) + [(0, pad)]).astype(np.uint32)
    v = v.reshape(*v.shape[:-1], -1, 8) << (np.arange(8, dtype=np.uint32) * 4)
    return np.bitwise_or.reduce(v, axis=-1).view(np.int32)


def dequant_int4(packed: np.ndarray, scale: np.ndarray, n_in: int) -> np.ndarray:
    """The weight [..., out, in] in the scale's dtype: q * scale per group, computed in float32."""
    q = unpack_int4(packed, n_in).astype(np.float32)
    group = n_in // scale.shape[-1]
    s = np.repeat(np.asarray(scale, dtype=np.float32), group, axis=-1)
    return (q * s).astype(scale.dtype)


def dequant_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """The weight [..., out, in] in float32: e4m3 value * its block's scale."""
    w = np.asarray(weight).astype(np.float32)
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=-2), block[1], axis=-1)
    return w * s[..., : w.shape[-2], : w.shape[-1]]


E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
