"""HF safetensors checkpoints (single file or sharded), read tensor by tensor; orbax save/restore."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ddtree_jax.errors import DDTreeError
from ddtree_jax.sharding import Placement
from ddtree_jax.weights import Params, WeightSpec, assemble

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


class SafetensorsFile:
    """A safetensors file opened lazily: the header is parsed, tensors are memory-mapped on demand."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise DDTreeError(f"{path}: truncated safetensors file (no header)")
                (n,) = struct.unpack("<Q", head)
                if 8 + n > size:
                    raise DDTreeError(f"{path}: truncated safetensors file (header of {n} bytes)")
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise DDTreeError(f"{path}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DDTreeError(f"{path}: corrupt safetensors header") from None
        header.pop("__metadata__", None)
        self.entries: dict[str, dict] = header
        self.data_start = 8 + n
        self.size = size

    def read(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory-mapped numpy array."""
        entry = self.entries[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise DDTreeError(f"{self.path}: tensor '{name}' has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if self.data_start + end > self.size:
            raise DDTreeError(
                f"{self.path}: truncated: tensor '{name}' needs bytes up to {self.data_start + end}, "
                f"file has {self.size}"
            )
        count = int(np.prod(shape)) if shape else 1
        if end - begin != count * np.dtype(dtype).itemsize:
            raise DDTreeError(
                f"{self.path}: tensor '{name}' byte size does not match its shape {list(shape)}"
            )
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + begin, shape=shape)


class Checkpoint:
    """All safetensors files of an HF directory, indexed by tensor name."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError):
                raise DDTreeError(f"{index}: not a valid safetensors index (no 'weight_map')") from None
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not names:
                raise DDTreeError(f"{self.directory}: no *.safetensors files")
        self.files = [SafetensorsFile(self.directory / n) for n in names]
        self.where = {k: f for f in self.files for k in f.entries}

    def read(self, spec: WeightSpec) -> np.ndarray:
        """Read one tensor, check its shape against the config, return it in our layout."""
        file = self.where.get(spec.hf_name)
        if file is None:
            raise DDTreeError(f"{self.directory}: tensor '{spec.hf_name}' not found in the checkpoint")
        array = file.read(spec.hf_name)
        if tuple(array.shape) != spec.hf_shape:
            raise DDTreeError(
                f"{file.path}: tensor '{spec.hf_name}' has shape {list(array.shape)}, "
                f"config.json implies {list(spec.hf_shape)}"
            )
        return array.T if spec.transpose else array


class Stacked:
    """Several checkpoint tensors (each [*shape], memory-mapped) seen as one array [n, *shape]: indexing
    reads only the tensors and blocks it selects."""

    def __init__(self, pieces: list[np.ndarray]):
        self.pieces = pieces
        self.shape = (len(pieces), *pieces[0].shape)

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        first, rest = index[0], tuple(index[1:])
        return np.stack([self.pieces[i][rest] for i in range(len(self.pieces))[first]])


def read_stacked(ckpt: Checkpoint, spec: WeightSpec) -> np.ndarray | Stacked:
    """The spec's tensor in our layout; a stacked spec (experts) as a lazy `Stacked` of its pieces."""
    if not spec.stack:
        return ckpt.read(spec)
    return Stacked([ckpt.read(piece) for piece in spec.pieces()])


def load_params(
    directory: str | Path, specs: list[WeightSpec], dtype: jnp.dtype, placement: Placement
) -> Params:
    """Load every spec'd tensor, placed shard by shard: each device's block is read from the
    memory-mapped checkpoint and converted to `dtype` on its own (no full copy on one device)."""
    ckpt = Checkpoint(directory)

    def make(spec: WeightSpec) -> jax.Array:
        host = read_stacked(ckpt, spec)  # memory-mapped

        def block(index):
            block_dtype = np.float32 if spec.float32 else dtype
            return np.ascontiguousarray(placement.host_block(spec, host, index), dtype=block_dtype)

        return jax.make_array_from_callback(placement.placed_shape(spec), placement(spec), block)

    return assemble(specs, make)


def save_converted(params: Params, directory: str | Path) -> None:
    """Save converted parameters with orbax (a fast reload path for big checkpoints)."""
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(Path(directory).absolute(), params, force=True)
    ckptr.wait_until_finished()


def restore_converted(directory: str | Path, abstract: Params) -> Params:
    """Restore parameters saved by `save_converted`; `abstract` gives shapes, dtypes and shardings."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(Path(directory).absolute(), abstract)


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
    for spec in specs:
        node = params
        for key in spec.path:
            node = node[key]
        array = np.asarray(jax.device_get(node), dtype=np.float32)
        for piece, part in zip(spec.pieces(), array if spec.stack else [array], strict=True):
            tensors[piece.hf_name] = (part.T if spec.transpose else part).astype(dtype)
    write_safetensors(directory / "model.safetensors", tensors)
    (directory / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
