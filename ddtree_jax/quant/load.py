"""Reading quantized tensors from a checkpoint and placing them on the mesh like their bf16 counterparts.

A quantized weight is a few raw tensors ("fields"): fp8 `w` + `scale`, int4 `q` + `scale`. Each field
gets the WeightSpec of the weight it replaces with the same logical axes (the scale's dims count blocks
of the weight's dims), so `sharding.Placement` splits the scales with their blocks; a split dim must
then hold whole blocks on every device, which Placement checks (the dim must divide by tp).

`read` below is any `name -> np.ndarray` (`reader(Checkpoint(directory))` reads an HF directory, float8
included); weights are [out, in] in the checkpoint and come back in our [in, out] layout, as views of
the memory-mapped file where no padding is needed (stacked experts: stack the per-expert fields with
`stack_fields`). `place` then reads each device's block of each field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
from collections.abc import Callable, Container
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.checkpoint import Checkpoint, active_params_cache, place_tensor
from ddtree_jax.errors import DDTreeError
from ddtree_jax.quant import formats
from ddtree_jax.quant.arrays import Fp8Weight, Int4Weight, Weight, fp8_host, int4_host
from ddtree_jax.quant.formats import Form, Fp8Block, Int4Group, blocks
from ddtree_jax.sharding import SPLIT_AXES, Placement
from ddtree_jax.weights import Params, WeightSpec, assemble, set_path

Read = Callable[[str], np.ndarray]
Fields = dict[str, np.ndarray]


@functools.cache
def _header(path: Path) -> tuple[dict, int]:
    """(the safetensors header's tensor entries, the byte where the data starts) of one file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def read_e4m3(path: Path, name: str) -> np.ndarray:
    """A float8 e4m3 tensor memory-mapped from its file: safetensors' numpy reader has no float8 type."""
    entries, start = _header(path)
    entry = entries[name]
    if entry["dtype"] != "F8_E4M3":
        raise DDTreeError(f"{path}: tensor '{name}' is {entry['dtype']}, not F8_E4M3")
    begin, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    if end - begin != int(np.prod(shape)) or start + end > path.stat().st_size:
        raise DDTreeError(f"{path}: tensor '{name}' is truncated or does not match its shape {list(shape)}")
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=start + begin, shape=shape)
    return raw.view(formats.E4M3)


def reader(ckpt: Checkpoint) -> Read:
    """name -> tensor of an HF checkpoint (float8 ones memory-mapped), a clear error for a missing name."""

    def read(name: str) -> np.ndarray:
        if name not in ckpt.where:
            raise DDTreeError(f"{ckpt.directory}: tensor '{name}' not found in the checkpoint")
        path = ckpt.where[name].path
        if _header(path)[0][name]["dtype"] == "F8_E4M3":
            return read_e4m3(path, name)
        return ckpt.where[name].read(name)

    return read


def _check_shape(name: str, array: np.ndarray, want: tuple[int, ...]) -> None:
    """A clear error when a raw tensor's shape is not the one the config implies."""
    if tuple(array.shape) != tuple(want):
        raise DDTreeError(f"tensor '{name}' has shape {list(array.shape)}, config.json implies {list(want)}")


def read_fields(read: Read, weight_name: str, form: Form, n_out: int, n_in: int) -> Fields:
    """The raw tensors of one [out, in] checkpoint weight, in our layout (see arrays.py)."""
    module = formats.module_of(weight_name)
    if isinstance(form, Fp8Block):
        w, s = read(weight_name), read(module + ".weight_scale_inv")
        _check_shape(weight_name, w, (n_out, n_in))
        if w.dtype != formats.E4M3:
            raise DDTreeError(f"tensor '{weight_name}' is {w.dtype}, fp8 block-scaled weights are e4m3")
        w, s = fp8_host(w, s, form.block)
        return {"w": w, "scale": s}
    if isinstance(form, Int4Group):
        shape = np.asarray(read(module + ".weight_shape")).tolist()
        if shape != [n_out, n_in]:
            raise DDTreeError(f"'{module}.weight_shape' is {shape}, config.json implies {[n_out, n_in]}")
        packed, scale = read(module + ".weight_packed"), read(module + ".weight_scale")
        _check_shape(module + ".weight_packed", packed, (n_out, blocks(n_in, 8)))
        _check_shape(module + ".weight_scale", scale, (n_out, n_in // form.group))
        q, s = int4_host(packed, scale, n_in, form.group)
        return {"q": q, "scale": s}
    w = read(weight_name)
    _check_shape(weight_name, w, (n_out, n_in))
    return {"w": np.swapaxes(w, -1, -2)}


def read_dequantized(read: Read, weight_name: str, form: Form, n_out: int, n_in: int) -> np.ndarray:
    """The weight [out, in] as the format defines it (fp8: float32; int4: the scale's dtype): the
    `--dequantize` path, expanded on the host at load."""
    module = formats.module_of(weight_name)
    if isinstance(form, Fp8Block):
        w = read(weight_name)
        _check_shape(weight_name, w, (n_out, n_in))
        return formats.dequant_fp8(w, read(module + ".weight_scale_inv"), form.block)
    if isinstance(form, Int4Group):
        f = read_fields(read, weight_name, form, n_out, n_in)
        return formats.dequant_int4(np.swapaxes(f["q"], -1, -2), np.swapaxes(f["scale"], -1, -2), n_in)
    return read(weight_name)


def stack_fields(per_expert: list[Fields]) -> Fields:
    """Fields of E experts -> fields with a leading expert axis [E, ...]."""
    return {k: np.stack([f[k] for f in per_expert]) for k in per_expert[0]}


def field_specs(spec: WeightSpec, form: Form) -> dict[str, WeightSpec]:
    """One WeightSpec per raw field of the weight `spec` ([..., in, out]): same path prefix and logical
    axes, the field's shape, the raw tensor's HF name."""
    *lead, n_in, n_out = spec.shape
    module = formats.module_of(spec.hf_name)

    def field(key: str, suffix: str, rows: int, cols: int) -> WeightSpec:
        path, shape = (*spec.path, key), (*lead, rows, cols)
        return dataclasses.replace(spec, path=path, hf_name=module + suffix, shape=shape)

    if isinstance(form, Fp8Block):
        bo, bi = form.block
        nbi, nbo = blocks(n_in, bi), blocks(n_out, bo)
        return {
            "w": field("w", ".weight", nbi * bi, nbo * bo),
            "scale": field("scale", ".weight_scale_inv", nbi, nbo),
        }
    if isinstance(form, Int4Group):
        return {
            "q": field("q", ".weight_packed", n_in // 8, n_out),
            "scale": field("scale", ".weight_scale", n_in // form.group, n_out),
        }
    return {"w": spec}


def check_placeable(spec: WeightSpec, form: Form, placement: Placement) -> None:
    """Clear errors for a quantized weight the mesh cannot split with whole blocks per device."""
    if isinstance(form, formats.Plain):
        return
    if "kv_heads" in spec.axes and placement.placed_shape(spec) != spec.shape:
        raise DDTreeError(f"{spec.hf_name}: quantized K/V heads cannot be repeated over --tp {placement.tp}")
    if isinstance(form, Fp8Block):
        for n, axis, size in zip(spec.shape[-2:], spec.axes[-2:], form.block[::-1], strict=True):
            if placement.tp > 1 and axis in SPLIT_AXES and n % size:
                raise DDTreeError(
                    f"{spec.hf_name}: its '{axis}' dim ({n}) is not a whole number of fp8 blocks of {size}: "
                    f"it cannot split over --tp {placement.tp}"
                )
    for fspec in field_specs(spec, form).values():
        for n, axis in zip(fspec.shape, fspec.axes, strict=True):
            if placement.tp > 1 and axis in SPLIT_AXES and n % placement.tp:
                raise DDTreeError(
                    f"{fspec.hf_name}: {n} blocks along '{axis}' do not split over --tp {placement.tp} "
                    f"(each device must hold whole quantization blocks)"
                )


def _in_out(spec: WeightSpec) -> tuple[int, int]:
    """The logical (in, out) of a weight spec [..., in, out]."""
    return int(spec.shape[-2]), int(spec.shape[-1])


def place(fields: Fields, spec: WeightSpec, form: Form, placement: Placement) -> Weight:
    """Host fields (our layout) -> the device weight, each field sharded by its own spec."""
    check_placeable(spec, form, placement)
    specs = field_specs(spec, form)
    arrays = {}
    for key, fspec in specs.items():
        host = fields[key]
        _check_shape(fspec.hf_name, host, fspec.shape)
        arrays[key] = jax.make_array_from_callback(host.shape, placement(fspec), lambda idx, h=host: h[idx])
    if isinstance(form, Fp8Block):
        return Fp8Weight(arrays["w"], arrays["scale"], _in_out(spec), form.block[::-1])
    if isinstance(form, Int4Group):
        return Int4Weight(arrays["q"], arrays["scale"], form.group)
    return arrays["w"]


def abstract(spec: WeightSpec, form: Form, placement: Placement, dtype) -> Weight:
    """ShapeDtypeStructs (with shardings) of the device weight: for orbax restore and jit specs."""
    specs = field_specs(spec, form)

    def sds(key: str, dt) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(specs[key].shape, dt, sharding=placement(specs[key]))

    if isinstance(form, Fp8Block):
        return Fp8Weight(sds("w", formats.E4M3), sds("scale", np.float32), _in_out(spec), form.block[::-1])
    if isinstance(form, Int4Group):
        return Int4Weight(sds("q", np.int32), sds("scale", dtype), form.group)
    return sds("w", dtype)


def spec_form(scheme: formats.Scheme, spec: WeightSpec, names: Container[str]) -> Form:
    """The stored form of a spec'd weight; a stacked one (experts) must store every piece alike."""
    if not spec.hf_name.endswith(".weight"):  # biases and buffers are never quantized
        return formats.PLAIN
    forms = {formats.stored_form(scheme, piece.hf_name, names) for piece in spec.pieces()}
    if len(forms) > 1:
        raise DDTreeError(f"{spec.hf_name}: the experts of '{spec.path}' are stored in different forms")
    return forms.pop()


def _dequantized_host(read: Read, spec: WeightSpec, form: Form) -> np.ndarray:
    """The whole weight [..., in, out] expanded on the host (float32 for fp8, the scale's dtype for int4)."""
    n_in, n_out = _in_out(spec)
    pieces = [read_dequantized(read, p.hf_name, form, n_out, n_in) for p in spec.pieces()]
    host = np.stack(pieces) if spec.stack else pieces[0]
    return np.swapaxes(host, -1, -2)


def load_params(
    directory: str | Path,
    specs: list[WeightSpec],
    scheme: formats.Scheme,
    dtype: jnp.dtype,
    placement: Placement,
    dequantize: bool = False,
) -> Params:
    """A quantized checkpoint's parameters: weights stored quantized become Fp8Weight / Int4Weight
    placed like their bf16 counterparts (or, with `dequantize`, expanded to `dtype` at load); every
    other tensor as `checkpoint.load_params` loads it. The params cache does not hold these."""
    if active_params_cache() is not None:
        raise DDTreeError(
            f"--params-cache: {directory} is a quantized checkpoint ({type(scheme).__name__}); the cache "
            "stores converted bf16/f32 parameters only: load it without --params-cache (it is already small)"
        )
    ckpt = Checkpoint(directory)
    read = reader(ckpt)

    def make(spec: WeightSpec) -> Weight:
        form = spec_form(scheme, spec, ckpt.where)
        if isinstance(form, formats.Plain):
            return place_tensor(ckpt, spec, dtype, placement)
        if dequantize:
            host = _dequantized_host(read, spec, form)
            sharding = placement(spec)

            def block(index):
                return np.ascontiguousarray(placement.host_block(spec, host, index), dtype=dtype)

            return jax.make_array_from_callback(placement.placed_shape(spec), sharding, block)
        n_in, n_out = _in_out(spec)
        fields = [read_fields(read, p.hf_name, form, n_out, n_in) for p in spec.pieces()]
        return place(stack_fields(fields) if spec.stack else fields[0], spec, form, placement)

    return assemble(specs, make)


def published_form(scheme: formats.Scheme | None, spec: WeightSpec) -> Form:
    """The form the published checkpoints store a weight in: FP8 (DeepSeek-V3, Kimi-K2) every linear
    projection but the router, embedding and head; INT4 (Kimi-K2.5/K2.6) the routed experts only (the
    stacked specs: one HF tensor per expert, models/moe.py)."""
    if scheme is None or not spec.transpose or "vocab" in spec.axes or spec.path[-1] == "router":
        return formats.PLAIN
    if isinstance(scheme, Int4Group) and not spec.stack:
        return formats.PLAIN
    return scheme


def random_params(
    specs: list[WeightSpec], scheme: formats.Scheme | None, seed: int, dtype: jnp.dtype, placement: Placement
) -> Params:
    """Random weights made on the device in their published forms (`published_form`), for benchmarks
    of shapes: fp8 values N(0, 1) with block scales near 0.02, int4 words of random bits with group
    scales near 0.02 / 4.6 (the values' spread), the plain weights as weights.random_params makes them."""
    from ddtree_jax.weights import random_params as plain_random

    keys = iter(jax.random.split(jax.random.key(seed), 2 * len(specs)))

    def field(fspec: WeightSpec, make) -> jax.Array:
        fn = jax.jit(lambda k: make(k, fspec.shape), out_shardings=placement(fspec))
        return fn(next(keys))

    def fp8(k, shape):
        return jax.random.normal(k, shape, jnp.bfloat16).astype(formats.E4M3)

    def int4(k, shape):
        return jax.lax.bitcast_convert_type(jax.random.bits(k, shape, jnp.uint32), jnp.int32)

    def scale(value: float, dt):
        return lambda k, shape: (value * jax.random.uniform(k, shape, jnp.float32, 0.5, 1.5)).astype(dt)

    def make(spec: WeightSpec, form: Form) -> Weight:
        if isinstance(form, Int4Group) and _in_out(spec)[0] % form.group:
            raise DDTreeError(
                f"{spec.hf_name}: {_in_out(spec)[0]} inputs are not whole groups of {form.group}"
            )
        check_placeable(spec, form, placement)
        f = field_specs(spec, form)
        if isinstance(form, Fp8Block):
            w, s = field(f["w"], fp8), field(f["scale"], scale(0.02, jnp.float32))
            return Fp8Weight(w, s, _in_out(spec), form.block[::-1])
        q, s = field(f["q"], int4), field(f["scale"], scale(0.02 / 4.6, dtype))
        return Int4Weight(q, s, form.group)

    forms = {spec.path: published_form(scheme, spec) for spec in specs}
    plain = [spec for spec in specs if isinstance(forms[spec.path], formats.Plain)]
    tree = plain_random(plain, seed, dtype, place=placement.place)
    for spec in specs:
        if not isinstance(forms[spec.path], formats.Plain):
            set_path(tree, spec.path, make(spec, forms[spec.path]))
    return tree
