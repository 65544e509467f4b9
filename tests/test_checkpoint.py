"""Reading HF safetensors: the file's blocks equal numpy's slices; placed tensors (transposed and
converted on the devices) equal the whole tensor transposed on the host and placed."""

import json
import re
import shutil
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import FIXTURES

from ddtree_jax import target
from ddtree_jax.checkpoint import TRANSPOSE_TILE, Checkpoint, transpose_2d, write_safetensors
from ddtree_jax.checkpoint_checks import ALLOW_UNUSED
from ddtree_jax.errors import DDTreeError
from ddtree_jax.sharding import make_mesh, param_sharding
from ddtree_jax.weights import linear


@pytest.mark.parametrize("shape", [(1, 1), (5, 300), (TRANSPOSE_TILE + 3, 2 * TRANSPOSE_TILE + 1)])
def test_transpose_2d_equals_numpy(shape):
    block = np.random.default_rng(0).normal(size=shape).astype(ml_dtypes.bfloat16)
    got = transpose_2d(block)
    assert got.flags.c_contiguous and got.dtype == block.dtype
    np.testing.assert_array_equal(got.view(np.uint16), block.T.view(np.uint16))


def test_lazy_blocks_of_a_transposed_weight(tmp_path):
    """A [out, in] nn.Linear weight read as [in, out] blocks, whole and in column slices (one device's
    share under tensor parallelism), equals the file's tensor transposed."""
    d_in, d_out = 2 * TRANSPOSE_TILE + 7, TRANSPOSE_TILE + 9
    hf = np.random.default_rng(1).normal(size=(d_out, d_in)).astype(np.float32)
    write_safetensors(tmp_path / "model.safetensors", {"w.weight": hf})
    lazy = Checkpoint(tmp_path).lazy(linear(("w",), "w.weight", d_in, d_out, (None, None)))
    np.testing.assert_array_equal(lazy[:, :], hf.T)
    np.testing.assert_array_equal(lazy[:, 10:70], hf.T[:, 10:70])
    np.testing.assert_array_equal(lazy[3:200, :], hf.T[3:200, :])


def rewritten(src: Path, dst: Path, change) -> Path:
    """A copy of the fixture checkpoint `src` whose tensors pass through `change(dict) -> dict`."""
    shutil.copytree(src, dst)
    tensors = {k: Checkpoint(src).where[k].read(k) for k in Checkpoint(src).where}
    tensors = change(tensors)
    write_safetensors(dst / "model.safetensors", tensors)
    return dst


def load(directory, **options):
    """target.load in float32 on one device."""
    return target.load(directory, jnp.float32, param_sharding(make_mesh(1, 1)), **options)


def test_config_with_fewer_layers_refused(tmp_path, capsys, monkeypatch):
    """A config that describes fewer layers than the checkpoint holds is refused before any tensor is
    read, naming the unused layers; DDTREE_ALLOW_UNUSED_TENSORS=1 loads it with a notice."""
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "qwen3_gqa4_tp", d)
    cfg = json.loads((d / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    cfg["num_hidden_layers"] = layers - 1
    (d / "config.json").write_text(json.dumps(cfg))
    monkeypatch.delenv(ALLOW_UNUSED, raising=False)
    with pytest.raises(DDTreeError) as e:
        load(d)
    message = str(e.value)
    assert f"model.layers.{layers - 1}.* (" in message and str(d) in message and ALLOW_UNUSED in message
    assert "\n" not in message
    monkeypatch.setenv(ALLOW_UNUSED, "1")
    _, params = load(d)
    assert len(params["layers"]) == layers - 1
    assert f"model.layers.{layers - 1}.*" in capsys.readouterr().err


def test_unused_tensor_named(tmp_path, monkeypatch):
    monkeypatch.delenv(ALLOW_UNUSED, raising=False)
    d = rewritten(
        FIXTURES / "qwen3_gqa1", tmp_path / "ckpt", lambda t: t | {"extra.bias": np.zeros(3, np.float32)}
    )
    with pytest.raises(DDTreeError, match=r"1 tensors that config.json does not use: extra\.bias \("):
        load(d)


def test_family_ignorable_tensors_load(tmp_path, monkeypatch):
    """What HF itself ignores loads here too, with the same values: DeepSeek-V3's multi-token-prediction
    layer (model.layers.{L}.*) and an old checkpoint's rotary_emb.inv_freq buffers."""
    monkeypatch.delenv(ALLOW_UNUSED, raising=False)
    name = "deepseek_v3_tp"
    layers = json.loads((FIXTURES / name / "config.json").read_text())["num_hidden_layers"]
    extra = {
        f"model.layers.{layers}.eh_proj.weight": np.ones((4, 8), np.float32),
        f"model.layers.{layers}.shared_head.norm.weight": np.ones(4, np.float32),
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32),
    }
    d = rewritten(FIXTURES / name, tmp_path / "ckpt", lambda t: t | extra)
    _, got = load(d)
    _, want = load(FIXTURES / name)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the same layer index past the decoder is no MTP layer for a family without one
    d = rewritten(FIXTURES / "qwen3_gqa1", tmp_path / "dense", lambda t: t | extra)
    with pytest.raises(DDTreeError, match=rf"model\.layers\.{layers}\.\* \(2 tensors\)"):
        load(d)


@pytest.mark.parametrize(
    "name,tensor",
    [
        ("qwen3_gqa1", "model.layers.1.mlp.down_proj.weight"),
        ("qwen3_gqa1", "model.norm.weight"),
        ("qwen3_moe_norm", "model.layers.1.mlp.experts.2.up_proj.weight"),  # a stacked expert, by name
    ],
)
def test_non_finite_weight_refused(tmp_path, name, tensor):
    def poison(tensors):
        t = tensors[tensor].copy()
        t.flat[t.size // 2] = np.nan if "norm" not in tensor else np.inf
        return tensors | {tensor: t}

    d = rewritten(FIXTURES / name, tmp_path / "ckpt", poison)
    with pytest.raises(
        DDTreeError, match=rf"{d}: tensor '{re.escape(tensor)}' holds NaN or infinite values$"
    ):
        load(d)


def test_non_finite_drafter_refused(tmp_path):
    from ddtree_jax import drafter

    def poison(tensors):
        return tensors | {"fc.weight": np.full_like(tensors["fc.weight"], np.nan)}

    tcfg, _ = load(FIXTURES / "qwen3_gqa1")
    d = rewritten(FIXTURES / "dflash_qwen3_gqa1", tmp_path / "draft", poison)
    with pytest.raises(DDTreeError, match="tensor 'fc.weight' holds NaN"):
        drafter.load(d, tcfg, jnp.float32, param_sharding(make_mesh(1, 1)))


def test_non_finite_quantized_field_refused(tmp_path):
    """A quantized weight is checked field by field: a NaN fp8 block scale names its weight and field."""
    d = tmp_path / "fp8"
    shutil.copytree(FIXTURES / "quant" / "deepseek_fp8", d)
    path, name = d / "model.safetensors", "model.layers.0.mlp.down_proj.weight_scale_inv"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    entry = json.loads(raw[8 : 8 + n])[name]
    assert entry["dtype"] == "F32"
    begin = 8 + n + entry["data_offsets"][0]
    raw[begin : begin + 4] = struct.pack("<f", float("nan"))
    path.write_bytes(bytes(raw))
    with pytest.raises(
        DDTreeError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' \(scale field\) holds NaN"
    ):
        load(d)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_finite_checks_host_and_device_agree_with_numpy(dtype):
    """The two finiteness checks (the bytes on CPU devices, a jitted reduction elsewhere) against numpy,
    per stacked piece, on a tp 4 mesh: a NaN, an infinity (none in float8_e4m3fn), the largest finite
    value and a negative zero."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ddtree_jax.checkpoint_checks import SLICE, _device_finite, _host_finite

    dt = jnp.dtype(dtype)
    host = np.ones((8, 3, SLICE // 2 + 4), np.float32)  # several slices per row, split 4 ways
    host[1, 2, -1] = np.nan
    host[5, 0, 7] = np.inf if dtype != "float8_e4m3fn" else np.nan
    host[6, 1, 3] = float(jnp.finfo(dt).max)
    host[7, 0, 0] = -0.0
    mesh = make_mesh(4, 1)
    for spec in (P(), P("model"), P(None, None, "model")):  # replicated, experts split, columns split
        x = jax.device_put(jnp.asarray(host, dt), NamedSharding(mesh, spec))
        want = np.isfinite(np.asarray(x.astype(jnp.float32))).reshape(8, -1).all(axis=1)
        assert list(np.flatnonzero(~want)) == [1, 5]
        np.testing.assert_array_equal(_host_finite(x, True), want)
        np.testing.assert_array_equal(np.asarray(_device_finite(True)(x)), want)
        assert not _host_finite(x, False)[0] and not bool(_device_finite(False)(x))


def test_stored_blocks_equal_the_file_tensors(tmp_path):
    """Blocks read from the file's bytes (whole, row ranges by positional reads, column slices from the
    memory map) equal numpy's slices, bit for bit, in every stored dtype; each is an array of its own."""
    rng = np.random.default_rng(2)
    tensors = {
        "a": rng.normal(size=(37, 19)).astype(np.float32),
        "b": rng.normal(size=(5, 6, 7)).astype(ml_dtypes.bfloat16),
        "c": rng.normal(size=(11,)).astype(np.float16),
        "d": rng.integers(-9, 9, size=(3, 4)).astype(np.int32),
        "e": np.array(3.5, np.float32),
        "f": rng.integers(0, 2, size=(5,)).astype(np.int8),  # leaves the next tensor unaligned
        "g": rng.normal(size=(4, 3)).astype(np.float32),
    }
    write_safetensors(tmp_path / "model.safetensors", tensors)
    (file,) = Checkpoint(tmp_path).files
    blocks = [(), (slice(3, 20),), (slice(None), slice(2, 9)), (slice(1, 4), slice(0, 5)), (slice(2, 2),)]
    for name, want in tensors.items():
        stored = file.stored(name)
        assert stored.shape == want.shape and stored.dtype == want.dtype
        for index in blocks[: 1 if want.ndim == 0 else None]:
            index = index[: want.ndim]
            got = stored[index]
            assert type(got) is np.ndarray and got.flags.owndata and got.flags.c_contiguous
            assert got.shape == want[index].shape and got.tobytes() == want[index].tobytes()
        np.testing.assert_array_equal(file.read(name), want)


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (4, 2), (8, 1)])
@pytest.mark.parametrize(
    "case", ["linear_heads", "linear_rows", "kv_repeat", "vocab_padded_head", "embedding", "stacked", "norm"]
)
def test_placed_tensor_equals_placing_the_whole(tmp_path, case, tp, dp):
    """Each device's block read in the file's layout, then transposed and converted on the devices,
    equals the whole tensor transposed and converted on the host and placed by `Placement.place`
    (K/V heads repeated, vocabulary padded): values bit for bit, the same sharding."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax.checkpoint import place_tensor
    from ddtree_jax.sharding import make_mesh, param_sharding
    from ddtree_jax.weights import WeightSpec, norm, stacked_linear

    rng = np.random.default_rng(3)
    vocab = 8 * 7 + 3  # splits over no tp > 1: padded
    specs = {
        "linear_heads": linear(("w",), "w.weight", 24, 8 * 16, (None, "heads"), heads=8),
        "linear_rows": linear(("w",), "w.weight", 8 * 16, 24, ("heads", None), heads=8),
        "kv_repeat": linear(("w",), "w.weight", 24, 2 * 16, (None, "kv_heads"), heads=2),
        "vocab_padded_head": linear(("w",), "w.weight", 24, vocab, (None, "vocab")),
        "embedding": WeightSpec(("w",), "w.weight", (vocab, 24), ("vocab", None)),
        "stacked": stacked_linear(
            ("w",), [f"e{i}.weight" for i in range(8)], 24, 40, ("experts", None, None)
        ),
        "norm": norm(("w",), "w.weight", 24),
    }
    spec = specs[case]
    tensors = {p.hf_name: rng.normal(size=p.hf_shape).astype(np.float32) for p in spec.pieces()}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    placement = param_sharding(make_mesh(tp, dp))
    whole = [t.T if spec.transpose else t for t in tensors.values()]
    whole = np.stack(whole) if spec.stack else whole[0]
    for dtype in (jnp.float32, jnp.bfloat16):
        got = place_tensor(Checkpoint(tmp_path), spec, dtype, placement)
        want = placement.place(spec, jnp.asarray(whole.astype(dtype)))
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
        for shard in got.addressable_shards:  # each device holds its own block, not the whole
            assert shard.data.shape == got.sharding.shard_shape(got.shape)
            jax.block_until_ready(shard.data)
