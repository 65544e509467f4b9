"""Reading HF safetensors in our layout: transposed blocks equal numpy's transpose of the file's tensor."""

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
