"""Reading HF safetensors in our layout: transposed blocks equal numpy's transpose of the file's tensor."""

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

    from ddtree_jax.checkpoint_checks import CHUNK, _device_finite, _host_finite

    dt = jnp.dtype(dtype)
    host = np.ones((8, 3, CHUNK // 2 + 4), np.float32)  # several chunks per row, split 4 ways
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
