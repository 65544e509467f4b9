"""HF safetensors checkpoints (single file or sharded): headers checked by `safetensors.safe_open`, each
device's block read from the file's bytes on its own (threads, positional reads) and placed, transposes
and dtype conversions done on the devices; orbax save/restore and the `--params-cache` built on it."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import json
import math
import os
import struct
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes  # registers bfloat16 with numpy, which safe_open(framework="numpy") needs
import numpy as np
from safetensors import SafetensorError, safe_open

from ddtree_jax.errors import DDTreeError
from ddtree_jax.sharding import Placement
from ddtree_jax.weights import Params, WeightSpec, assemble, join, split

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _open_error(path: Path, error: SafetensorError) -> DDTreeError:
    """safe_open's complaint about `path` in this project's words."""
    why = str(error)
    if any(s in why for s in ("incomplete metadata", "header too small", "invalid header length")):
        return DDTreeError(f"{path}: truncated safetensors file ({why})")
    if "invalid JSON" in why or "invalid UTF-8" in why:
        return DDTreeError(f"{path}: corrupt safetensors header ({why})")
    return DDTreeError(f"{path}: not a valid safetensors file ({why})")


class SafetensorsFile:
    """One safetensors file: the header checked by `safe_open`, tensors read straight from the file's
    bytes (`StoredTensor`), several at once from threads."""

    def __init__(self, path: Path):
        self.path = path
        try:
            handle = safe_open(str(path), framework="numpy")
        except FileNotFoundError:
            raise DDTreeError(f"{path}: file not found") from None
        except IsADirectoryError:
            raise DDTreeError(f"{path}: a directory, not a safetensors file") from None
        except SafetensorError as e:
            raise _open_error(path, e) from None
        self.entries: set[str] = set(handle.keys())
        with open(path, "rb") as f:  # safe_open checked it: the length, the JSON, the offsets
            (n,) = struct.unpack("<Q", f.read(8))
            self.header: dict = json.loads(f.read(n))
        self.data_start = 8 + n
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)
        self._map: np.memmap | None = None

    def stored(self, name: str) -> StoredTensor:
        """The tensor as the file stores it, not read yet; unsupported dtypes refused."""
        entry = self.header[name]
        if entry["dtype"] not in _DTYPES:
            raise DDTreeError(f"{self.path}: tensor '{name}' has unsupported dtype {entry['dtype']}")
        return StoredTensor(
            self, np.dtype(_DTYPES[entry["dtype"]]), tuple(entry["shape"]), entry["data_offsets"][0]
        )

    def memmap(self) -> np.memmap:
        """The whole file mapped read-only (for blocks that are not one byte range)."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map

    def read(self, name: str) -> np.ndarray:
        """The whole tensor as a numpy array of its own."""
        return self.stored(name)[...]


class StoredTensor:
    """One tensor in a safetensors file, in the file's layout; indexing (slices) reads that block into
    an array of its own: one positional read (os.preadv, which releases the GIL) when the block is one
    byte range (whole trailing dims), else a copy out of the memory-mapped file."""

    def __init__(self, file: SafetensorsFile, dtype: np.dtype, shape: tuple[int, ...], offset: int):
        self.file, self.dtype, self.shape, self.offset = file, dtype, shape, offset

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return math.prod(self.shape) * self.dtype.itemsize

    def __getitem__(self, index) -> np.ndarray:
        """The block `index` (a slice or a tuple of slices, step 1) as a fresh C-contiguous array."""
        index = index if isinstance(index, tuple) else (index,)
        if index == (Ellipsis,):
            index = ()
        index = index + (slice(None),) * (self.ndim - len(index))
        ranges = [range(n)[s] for n, s in zip(self.shape, index, strict=True)]
        if any(r.step != 1 for r in ranges):
            raise ValueError(f"blocks are read with step-1 slices, got {index}")
        if not self.shape:
            return self._read(0, (), 1)
        if all(len(r) == n for r, n in zip(ranges[1:], self.shape[1:], strict=True)):
            row = math.prod(self.shape[1:])
            return self._read(ranges[0].start * row, tuple(len(r) for r in ranges), len(ranges[0]) * row)
        whole = self.file.memmap()[self.file.data_start + self.offset :][: self.nbytes]
        return np.array(whole.view(self.dtype).reshape(self.shape)[tuple(index)])

    def _read(self, first: int, shape: tuple[int, ...], count: int) -> np.ndarray:
        """`count` elements from element `first` on, as an array of `shape`."""
        out = np.empty(shape, self.dtype)
        buffer = memoryview(out.reshape(-1).view(np.uint8))
        start, done = self.file.data_start + self.offset + first * self.dtype.itemsize, 0
        while done < len(buffer):
            got = os.preadv(self.file.fd, [buffer[done:]], start + done)
            if got == 0:
                raise DDTreeError(
                    f"{self.file.path}: truncated safetensors file (a tensor ends past its end)"
                )
            done += got
        return out


TRANSPOSE_TILE = 128  # square tiles that stay in the CPU's cache while they are transposed


def transpose_2d(block: np.ndarray) -> np.ndarray:
    """block.T as a contiguous array, copied tile by tile: numpy's own transposing copy of a large
    matrix misses the cache on every element (about 5x slower for an 8B model's projections, whose
    transposes dominated the load: 71 s for 16.4 GB on the H200 host, results/h200/load/)."""
    if block.ndim != 2:
        return np.ascontiguousarray(block.T)
    rows, cols = block.shape
    out = np.empty((cols, rows), block.dtype)
    t = TRANSPOSE_TILE
    for i in range(0, rows, t):
        for j in range(0, cols, t):
            out[j : j + t, i : i + t] = block[i : i + t, j : j + t].T
    return out


class LazyTensor:
    """A checkpoint tensor in our layout (transposed when the spec says so), read block by block."""

    def __init__(self, view: StoredTensor, shape: tuple[int, ...], transpose: bool):
        self.view, self.shape, self.transpose = view, shape, transpose

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def __getitem__(self, index) -> np.ndarray:
        """The block `index` (slices in our layout), read from the file alone."""
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (self.ndim - len(index))
        if not self.transpose:
            return self.view[index]
        return transpose_2d(self.view[index[::-1]])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole tensor."""
        whole = self[(slice(None),) * self.ndim]
        return whole if dtype is None else whole.astype(dtype)


class Checkpoint:
    """All safetensors files of an HF directory, indexed by tensor name."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            what = "does not exist" if not self.directory.exists() else "is not a directory"
            raise DDTreeError(f"{self.directory}: checkpoint directory {what}")
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DDTreeError(f"{index}: not a valid safetensors index (no 'weight_map')") from None
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not names:
                raise DDTreeError(f"{self.directory}: no *.safetensors files")
        self.files = [SafetensorsFile(self.directory / n) for n in names]
        self.where = {k: f for f in self.files for k in f.entries}

    def stored(self, spec: WeightSpec) -> StoredTensor:
        """One tensor in the file's layout, its shape checked against the config, not read yet."""
        file = self.where.get(spec.hf_name)
        if file is None:
            raise DDTreeError(f"{self.directory}: tensor '{spec.hf_name}' not found in the checkpoint")
        view = file.stored(spec.hf_name)
        if view.shape != spec.hf_shape:
            raise DDTreeError(
                f"{file.path}: tensor '{spec.hf_name}' has shape {list(view.shape)}, "
                f"config.json implies {list(spec.hf_shape)}"
            )
        return view

    def lazy(self, spec: WeightSpec) -> LazyTensor:
        """One tensor, its shape checked against the config, in our layout, not read yet."""
        return LazyTensor(self.stored(spec), spec.shape, spec.transpose)

    def read(self, spec: WeightSpec) -> np.ndarray:
        """Read one tensor, check its shape against the config, return it in our layout."""
        return np.asarray(self.lazy(spec))


class Stacked:
    """Several checkpoint tensors (each [*shape], read lazily) seen as one array [n, *shape]: indexing
    reads only the tensors and blocks it selects."""

    def __init__(self, pieces: list[LazyTensor] | list[StoredTensor]):
        self.pieces = pieces
        self.shape = (len(pieces), *pieces[0].shape)

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        first, rest = index[0], tuple(index[1:])
        return np.stack([self.pieces[i][rest] for i in range(len(self.pieces))[first]])


def read_stacked(ckpt: Checkpoint, spec: WeightSpec) -> LazyTensor | Stacked:
    """The spec's tensor in our layout, not read yet; a stacked spec (experts) as a `Stacked` of its
    pieces."""
    if not spec.stack:
        return ckpt.lazy(spec)
    return Stacked([ckpt.lazy(piece) for piece in spec.pieces()])


def stored_spec(spec: WeightSpec) -> WeightSpec:
    """The spec of the tensor as the checkpoint stores it: a transposed weight with its last two dims
    (shape and logical axes) swapped back, so that a placement splits it as it splits `spec`, each
    device's block being the transpose of its block of `spec`."""
    if not spec.transpose:
        return spec

    def swap(t: tuple) -> tuple:
        return (*t[:-2], t[-1], t[-2])

    return dataclasses.replace(spec, shape=swap(spec.shape), axes=swap(spec.axes), transpose=False)


LOAD_THREADS = min(16, os.cpu_count() or 1)  # blocks read and sent to their devices at once
READ_AHEAD_BYTES = 4 << 30  # blocks of later tensors in host memory at once (a tensor's own: any size)
_DEVICE_CONVERTS = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}


def load_params(
    directory: str | Path, specs: list[WeightSpec], dtype: jnp.dtype, placement: Placement
) -> Params:
    """Load every spec'd tensor, placed shard by shard: each device's block is read from the
    checkpoint on its own (several at once, from threads) and sent to its device, where transposed
    weights are transposed and the dtype converted (no full copy on one device, no transposing copy
    on the host). Inside `params_cache(DIR)`, through the orbax cache there instead."""
    cache = _PARAMS_CACHE.get()
    if cache is not None:
        return _load_cached(cache, Path(directory), specs, jnp.dtype(dtype), placement)
    return _load_safetensors(directory, specs, dtype, placement)


def _load_safetensors(
    directory: str | Path, specs: list[WeightSpec], dtype: jnp.dtype, placement: Placement
) -> Params:
    """`load_params` from the HF files: later tensors' blocks are read (READ_AHEAD_BYTES of them at
    most, whole tensors) while earlier ones are finished on their devices."""
    ckpt = Checkpoint(directory)
    placed, started, ahead = {}, collections.deque(), 0
    with _reader_pool() as pool:
        for spec in specs:
            reading = start_tensor(ckpt, spec, dtype, placement, pool)
            started.append((spec, reading))
            ahead += reading.nbytes
            while len(started) > 1 and (ahead > READ_AHEAD_BYTES or len(started) > 2 * LOAD_THREADS):
                done, reading = started.popleft()
                placed[done.path] = reading.finish()
                ahead -= reading.nbytes
        for done, reading in started:
            placed[done.path] = reading.finish()
    return assemble(specs, lambda spec: placed[spec.path])


@contextlib.contextmanager
def _reader_pool() -> Iterator[ThreadPoolExecutor]:
    """A pool of LOAD_THREADS reader threads (joined on exit; a failed read cancels the rest)."""
    pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="ddtree-load")
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def place_tensor(ckpt: Checkpoint, spec: WeightSpec, dtype: jnp.dtype, placement: Placement) -> jax.Array:
    """One spec'd tensor converted to `dtype` (float32 where the spec says) and placed, each device's
    block read on its own."""
    with _reader_pool() as pool:
        return start_tensor(ckpt, spec, dtype, placement, pool).finish()


class Reading(NamedTuple):
    """A tensor whose device blocks are being read: their bytes, and the call that waits for them
    and returns the placed array."""

    nbytes: int
    finish: Callable[[], jax.Array]


def start_tensor(
    ckpt: Checkpoint, spec: WeightSpec, dtype: jnp.dtype, placement: Placement, pool: ThreadPoolExecutor
) -> Reading:
    """Start reading one spec'd tensor's device blocks on `pool` (each sent to its device from the
    reading thread). Finishing waits for them: the array placed as the file stores it (`stored_spec`),
    then transposed and converted on the devices into `spec`'s placement. A fused weight: its parts
    read so, then joined on the devices (`weights.join`)."""
    if spec.parts:
        parts = [start_tensor(ckpt, part, dtype, placement, pool) for part in spec.parts]
        fuse = _join(spec.fuse, spec.shape[-1], placement(spec))
        return Reading(sum(p.nbytes for p in parts), lambda: fuse([p.finish() for p in parts]))
    want = np.dtype(np.float32 if spec.float32 else dtype)
    stored = stored_spec(spec)
    pieces = [ckpt.stored(stored_spec(piece)) for piece in spec.pieces()]
    host = Stacked(pieces) if spec.stack else pieces[0]
    on_host = pieces[0].dtype not in _DEVICE_CONVERTS  # e.g. float64 or integers: converted as read
    shape, sharding = placement.placed_shape(stored), placement(stored)
    by_index: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        by_index.setdefault(_key(index, shape), []).append(device)

    def read_block(index: tuple[slice, ...], devices: list) -> list[jax.Array]:
        block = placement.host_block(stored, host, index)
        block = np.ascontiguousarray(block, dtype=want if on_host else None)
        return [jax.device_put(block, device) for device in devices]

    futures = [pool.submit(read_block, tuple(slice(*k) for k in key), devs) for key, devs in by_index.items()]
    nbytes = sum(math.prod(b - a for a, b in key) for key in by_index) * pieces[0].dtype.itemsize

    def finish() -> jax.Array:
        arrays = [a for f in futures for a in f.result()]
        placed = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
        if not spec.transpose and placed.dtype == want:
            return placed
        return _transform(spec.transpose, jnp.dtype(want), placement(spec))(placed)

    return Reading(nbytes, finish)


@functools.cache
def _join(how: str, head_dim: int, sharding) -> Callable[[list[jax.Array]], jax.Array]:
    """A jitted program joining a fused weight's placed parts into its placement (`weights.join`: each
    device joins its own blocks, no collective); one per fusion, head size and sharding."""
    return jax.jit(functools.partial(join, how, head_dim), out_shardings=sharding)


def _key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
    """A device block's index as a hashable (start, stop) per dim."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


@functools.cache
def _transform(transpose: bool, dtype: jnp.dtype, sharding) -> Callable[[jax.Array], jax.Array]:
    """A jitted program: swap the last two dims (when `transpose`), convert to `dtype`, lay out as
    `sharding` (each device transposes its own block: the stored placement mirrors the final one)."""

    def transform(x: jax.Array) -> jax.Array:
        return (jnp.swapaxes(x, -1, -2) if transpose else x).astype(dtype)

    return jax.jit(transform, out_shardings=sharding)


# -- the params cache --------------------------------------------------------------------------

_PARAMS_CACHE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("params_cache", default=None)
CACHE_FORMAT = 1  # bump when the converted layout changes: old entries then no longer match


@contextlib.contextmanager
def params_cache(directory: str | Path | None) -> Iterator[None]:
    """Within this block `load_params` goes through an orbax cache under `directory` (None: off)."""
    token = _PARAMS_CACHE.set(None if directory is None else Path(directory))
    try:
        yield
    finally:
        _PARAMS_CACHE.reset(token)


def active_params_cache() -> Path | None:
    """The `params_cache` directory in effect (None: off)."""
    return _PARAMS_CACHE.get()


def fingerprint(directory: Path, specs: list[WeightSpec], dtype: jnp.dtype, placement: Placement) -> dict:
    """What a cache entry was made from: the checkpoint's files (config.json hashed; weight files by
    size and mtime), the dtype and every tensor's name and placed shape (which depends on --tp)."""
    directory = directory.absolute()
    files = sorted(p for p in directory.iterdir() if p.suffix == ".safetensors" or p.name.endswith(".json"))
    config = directory / "config.json"
    return {
        "format": CACHE_FORMAT,
        "checkpoint": str(directory),
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else None,
        "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files},
        "dtype": jnp.dtype(dtype).name,
        # a fused weight also by its fusion (weights.join): its layout
        "tensors": [
            [spec.hf_name, list(placement.placed_shape(spec))] + ([spec.fuse] if spec.fuse else [])
            for spec in specs
        ],
    }


def cache_entry(cache: Path, print_: dict) -> Path:
    """The entry directory of a fingerprint: its hash, so different inputs never share an entry."""
    key = hashlib.sha256(json.dumps(print_, sort_keys=True).encode()).hexdigest()[:20]
    return cache / key


def _load_cached(
    cache: Path, directory: Path, specs: list[WeightSpec], dtype: jnp.dtype, placement: Placement
) -> Params:
    """Restore from the cache entry of this checkpoint, dtype and layout; convert it first if absent."""
    if cache.exists() and not cache.is_dir():
        raise DDTreeError(f"--params-cache {cache}: not a directory")
    if not directory.is_dir():
        raise DDTreeError(f"{directory}: checkpoint directory does not exist")
    print_ = fingerprint(directory, specs, dtype, placement)
    entry = cache_entry(cache, print_)
    stamp = entry / "fingerprint.json"
    start = time.perf_counter()
    if stamp.exists():
        try:
            stored = json.loads(stamp.read_text())
        except json.JSONDecodeError:
            stored = None
        if stored != print_:
            raise DDTreeError(
                f"--params-cache: {stamp} does not describe {directory} as it is now "
                f"(dtype {print_['dtype']}); delete {entry} to rebuild it"
            )
        abstract = assemble(
            specs, lambda s: jax.ShapeDtypeStruct(placement.placed_shape(s), dtype, sharding=placement(s))
        )
        previous_hook = _drop_closed_loop_reports()
        try:
            params = restore_converted(entry / "params", abstract)
        except Exception as e:  # noqa: BLE001 (orbax and tensorstore raise many kinds)
            raise DDTreeError(
                f"--params-cache: cannot restore {entry} ({_gist(e)}); delete it to rebuild"
            ) from None
        sys.unraisablehook = previous_hook  # restored: nothing is left in flight
        _note(f"params cache: restored {directory} from {entry} ({time.perf_counter() - start:.1f} s)")
        return params
    params = _load_safetensors(directory, specs, dtype, placement)
    try:
        entry.mkdir(parents=True, exist_ok=True)
        save_converted(params, entry / "params")
        if jax.process_index() == 0:
            stamp.write_text(json.dumps(print_, indent=1, sort_keys=True) + "\n")  # last: entry complete
    except OSError as e:
        raise DDTreeError(f"--params-cache {cache}: cannot write the cache ({e.strerror})") from None
    _note(f"params cache: converted {directory} into {entry} ({time.perf_counter() - start:.1f} s)")
    return params


def _drop_closed_loop_reports():
    """When a restore fails, tensorstore's other reads still finish and try to wake orbax's event loop,
    already closed: each reports "Event loop is closed" through sys.unraisablehook, a traceback per read
    around our one-line error (during the failing restore and at exit). Drop those reports (and only
    those) from here on; returns the hook in place before, for a restore that succeeds to put back."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not (
            isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
        ):
            previous(unraisable)

    sys.unraisablehook = hook
    return previous


def _gist(error: Exception, width: int = 120) -> str:
    """A restore error in one short phrase: tensorstore's first line holds its whole JSON spec and a
    chain of 'Error opening ...' contexts; keep the status code and the innermost cause."""
    text = str(error).strip()
    first = text.splitlines()[0].split(" [tensorstore_spec")[0] if text else type(error).__name__
    if len(first) <= width:
        return first
    code = first.split(":")[0] if first.split(":")[0].isupper() else ""
    return (f"{code}: " if code else "") + "..." + first[-(width - len(code) - 5) :]


def _note(message: str) -> None:
    """A progress line on stderr (process 0 only)."""
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


def save_converted(params: Params, directory: str | Path) -> None:
    """Save converted parameters with orbax (a fast reload path for big checkpoints)."""
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(Path(directory).absolute(), params, force=True)
    ckptr.wait_until_finished()


def restore_converted(directory: str | Path, abstract: Params) -> Params:
    """Restore parameters saved by `save_converted`; `abstract` gives shapes, dtypes and shardings."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:  # closed even when the restore fails (its threads)
        return checkpointer.restore(Path(directory).absolute(), abstract)


_DTYPE_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Write numpy arrays (bfloat16 included, via ml_dtypes) as one safetensors file."""
    header, offset = {}, 0
    for name, array in tensors.items():
        size = array.size * array.dtype.itemsize
        header[name] = {
            "dtype": _DTYPE_NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())


def save_hf(
    params: Params,
    specs: list[WeightSpec],
    directory: str | Path,
    config_json: dict,
    dtype=ml_dtypes.bfloat16,
) -> None:
    """Write parameters as an HF directory: config.json + model.safetensors with the specs' HF names
    and layouts (linear weights transposed back to [out, in]), converted to `dtype`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}

    def put(spec: WeightSpec, array: np.ndarray) -> None:
        if spec.parts:  # a fused weight: its parts (one device's layout)
            for part, x in zip(spec.parts, split(spec.fuse, spec.shape[-1], array), strict=True):
                put(part, x)
            return
        for piece, part in zip(spec.pieces(), array if spec.stack else [array], strict=True):
            tensors[piece.hf_name] = (part.T if spec.transpose else part).astype(dtype)

    for spec in specs:
        node = params
        for key in spec.path:
            node = node[key]
        put(spec, np.asarray(jax.device_get(node), dtype=np.float32))
    write_safetensors(directory / "model.safetensors", tensors)
    (directory / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
