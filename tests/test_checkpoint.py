"""Reading HF safetensors: the file's blocks equal numpy's slices; placed tensors (transposed and
converted on the devices) equal the whole tensor transposed on the host and placed."""

import ml_dtypes
import numpy as np
import pytest

from ddtree_jax.checkpoint import TRANSPOSE_TILE, Checkpoint, transpose_2d, write_safetensors
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
