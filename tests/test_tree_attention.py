"""The Pallas tree-attention kernel against its jnp reference (interpret mode on CPU), and its
CUDA lowering checked on CPU under an abstract H200."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.compare.oracles import ancestor_mask
from ddtree_jax.kernels.flash import combine_splits
from ddtree_jax.kernels.tree_attention import merge_splits, tree_attention, tree_attention_reference
from ddtree_jax.kernels.tuning import TREE_TUNING, default_tree_splits, resolve_tree_tuning

F32, BF16 = jnp.float32, jnp.bfloat16
TREE_RULE = {k: TREE_TUNING[k] for k in ("waves", "min_tiles_per_split")}
TOLERANCE = {F32: 1e-5, BF16: 1e-2}


def random_parents(rng: np.random.Generator, t: int) -> np.ndarray:
    """A random tree in the engine's order: node 0 is the root, parent[i] < i."""
    parent = np.full(t, -1, np.int64)
    for i in range(1, t):
        # Bias towards recent nodes so that trees get deep, not only wide.
        parent[i] = rng.integers(max(0, i - 8), i) if rng.random() < 0.7 else rng.integers(0, i)
    return parent


def make_mask(rng: np.random.Generator, kind: str, b: int, t: int) -> np.ndarray:
    if kind == "ones":  # drafter block: bidirectional
        return np.ones((b, t, t), bool)
    if kind == "causal":  # chain
        return np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t)).copy()
    if kind == "tree":  # verify: ancestor-or-self mask of a random tree per sequence
        return np.stack([ancestor_mask(random_parents(rng, t)) for _ in range(b)])
    if kind == "sparse":  # some rows see no in-flight token at all (not even themselves)
        return rng.random((b, t, t)) < 0.2
    raise ValueError(kind)


def make_inputs(seed, *, b, t, hkv, g, d, s, lengths, mask_kind, dtype, mask_dtype=jnp.int8):
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (b, t, hkv * g, d), F32).astype(dtype)
    k_cache = jax.random.normal(keys[1], (b, hkv, s, d), F32).astype(dtype)
    v_cache = jax.random.normal(keys[2], (b, hkv, s, d), F32).astype(dtype)
    k_new = jax.random.normal(keys[3], (b, t, hkv, d), F32).astype(dtype)
    v_new = jax.random.normal(keys[4], (b, t, hkv, d), F32).astype(dtype)
    mask = jnp.asarray(make_mask(rng, mask_kind, b, t)).astype(mask_dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    return q, k_cache, v_cache, lengths, k_new, v_new, mask


def check_close(out, ref, dtype):
    """Every element written and finite; relative error overall and per (node, head) row."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out = np.asarray(out.astype(F32))
    ref = np.asarray(ref.astype(F32))
    assert np.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    tol = TOLERANCE[dtype]
    rel = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert rel < tol, f"relative error {rel:.3g} >= {tol}"
    # Per row, relative to the typical row norm: catches one wrong or skipped row among many.
    row_err = np.linalg.norm(out - ref, axis=-1)
    row_ref = np.linalg.norm(ref, axis=-1)
    scale = np.maximum(row_ref, np.mean(row_ref) + 1e-30)
    worst = float(np.max(row_err / scale))
    assert worst < 5 * tol, f"worst row error {worst:.3g}"


# (t, g, d, s, lengths, mask kind, dtype, window, tuning): a covering subset, not the product.
CASES = [
    # Autoregressive (T = 1).
    (1, 1, 64, 64, [0, 1], "ones", F32, None, {}),
    (1, 4, 128, 256, [255, 256], "ones", BF16, None, {}),
    (1, 8, 64, 100, [100, 37], "ones", F32, 16, {}),
    # T = 1 with many one-tile splits (the decode rule), more splits than a short row has tiles,
    # and both merges (Pallas kernel, XLA ops).
    (1, 4, 64, 512, [512, 3], "ones", BF16, None, {"tile_k": 16, "merge": "pallas"}),
    (1, 4, 64, 512, [512, 0], "ones", F32, None, {"tile_k": 16, "splits": 40, "merge": "xla"}),
    (1, 5, 64, 96, [96, 50], "ones", F32, 32, {"tile_k": 16, "splits": 6}),
    # Drafter block (all ones) and chain (causal).
    (16, 2, 64, 128, [0, 77], "ones", F32, None, {}),
    (16, 4, 128, 256, [1, 256], "causal", BF16, None, {}),
    (16, 4, 64, 200, [200, 123], "causal", F32, None, {"tile_q": 16, "splits": 3}),
    # Verify (random ancestor masks), T padded (33) and larger trees.
    (33, 4, 64, 192, [100, 5], "tree", F32, None, {}),
    (33, 2, 128, 128, [128, 0], "tree", BF16, 48, {}),
    (64, 4, 64, 512, [300, 511], "tree", F32, None, {}),
    (64, 1, 128, 256, [256, 17], "tree", BF16, 64, {"splits": 1}),
    (64, 2, 64, 300, [299, 300], "tree", F32, 100, {"tile_k": 16, "splits": 7}),
    (64, 2, 64, 300, [299, 41], "tree", F32, None, {"tile_k": 16, "splits": 5, "merge": "pallas"}),
    (128, 2, 64, 128, [99, 128], "tree", F32, None, {}),
    (128, 1, 128, 192, [191, 64], "tree", BF16, None, {"tile_q": 128, "tile_k": 32}),
    # Rows that see nothing at all give zeros (length 0 and rows with an empty mask row).
    (16, 2, 64, 64, [0, 0], "sparse", F32, None, {}),
    (16, 2, 64, 64, [0, 40], "sparse", BF16, 8, {"splits": 2}),
]


@pytest.mark.parametrize("t,g,d,s,lengths,mask_kind,dtype,window,tuning", CASES)
def test_matches_reference(t, g, d, s, lengths, mask_kind, dtype, window, tuning):
    seed = zlib.crc32(repr((t, g, d, s, lengths, mask_kind, window)).encode())
    args = make_inputs(
        seed, b=2, t=t, hkv=2, g=g, d=d, s=s, lengths=lengths, mask_kind=mask_kind, dtype=dtype
    )
    out = tree_attention(*args, window=window, interpret=True, **tuning)
    ref = tree_attention_reference(*args, window=window)
    check_close(out, ref, dtype)


def test_bool_mask_and_many_heads():
    """G = 8 with bool masks and three K/V heads (head mapping h // G across programs)."""
    args = make_inputs(
        7, b=1, t=16, hkv=3, g=8, d=64, s=96, lengths=[50], mask_kind="tree", dtype=F32,
        mask_dtype=jnp.bool_,
    )  # fmt: skip
    out = tree_attention(*args, interpret=True)
    check_close(out, tree_attention_reference(*args), F32)


def test_under_jit_and_vmap_free_shapes():
    """Called inside an outer jit with traced lengths, as the engine does."""
    args = make_inputs(
        3, b=3, t=8, hkv=2, g=2, d=64, s=128, lengths=[5, 64, 128], mask_kind="causal",
        dtype=BF16,
    )  # fmt: skip
    out = jax.jit(lambda *a: tree_attention(*a, interpret=True))(*args)
    check_close(out, tree_attention_reference(*args), BF16)


def test_default_splits_fill_the_gpu():
    assert default_tree_splits(1, 8, 1, 32768, 64, **TREE_RULE) == 33  # 8 programs per split -> ~264
    assert default_tree_splits(16, 8, 1, 32768, 64, **TREE_RULE) == 3
    assert default_tree_splits(64, 8, 1, 32768, 64, **TREE_RULE) == 1
    assert default_tree_splits(1, 8, 1, 256, 64, **TREE_RULE) == 1  # short caches: few tiles per split
    assert default_tree_splits(1, 1, 1, 1 << 20, 16, **TREE_RULE) == 64  # capped


def test_decode_tuning_fills_the_sms():
    """T = 1 (one 16-row tile): splits aim at 4 waves of 132 programs, down to one tile per split."""

    def splits(b, s, **kw):
        return resolve_tree_tuning((b, 1, 32, 128), (b, 8, s, 128), **kw)["splits"]

    assert [splits(1, s) for s in (1024, 8192, 32768)] == [8, 64, 64]  # 1k: every split one tile
    assert [splits(4, s) for s in (1024, 8192, 32768)] == [8, 17, 17]
    assert [splits(16, s) for s in (1024, 8192, 32768)] == [5, 5, 5]
    assert splits(1, 1024, tile_k=64) == 16 and splits(16, 32768, waves=8) == 9
    assert resolve_tree_tuning((1, 1, 32, 128), (1, 8, 1024, 128))["merge"] == "pallas"
    tree = resolve_tree_tuning((1, 16, 32, 128), (1, 8, 1024, 128))  # 64 rows: the tree tuning is unchanged
    assert (tree["tile_k"], tree["num_stages"], tree["splits"], tree["merge"]) == (64, 3, 4, "xla")
    with pytest.raises(ValueError):
        resolve_tree_tuning((1, 1, 32, 128), (1, 8, 1024, 128), merge="atomic")


@pytest.mark.parametrize("splits,t,g,d", [(1, 1, 4, 64), (3, 1, 4, 128), (17, 2, 3, 64), (64, 1, 8, 32)])
def test_merge_kernel_matches_xla_combine(splits, t, g, d):
    """The Pallas merge against the jnp combine, with empty splits (max M_INIT, sum 0) among them."""
    keys = jax.random.split(jax.random.key(splits), 3)
    shape = (splits, 2, t, 3, g)
    m = jax.random.normal(keys[0], shape, F32) * 4
    l = jax.random.uniform(keys[1], shape, F32, 0.5, 8.0)
    acc = jax.random.normal(keys[2], (*shape, d), F32) * l[..., None]
    empty = jnp.arange(splits)[:, None, None, None, None] % 3 == 1  # every third split saw nothing
    m = jnp.where(empty, 0.5 * -1e30, m)
    l = jnp.where(empty, 0.0, l)
    acc = jnp.where(empty[..., None], 0.0, acc)
    m = m.at[:, 1, :, 0].set(0.5 * -1e30)  # one (sequence, head) empty in every split: zeros
    l = l.at[:, 1, :, 0].set(0.0)
    acc = acc.at[:, 1, :, 0].set(0.0)
    out = merge_splits(acc, m, l, out_dtype=F32, interpret=True)
    ref = combine_splits(acc, m, l)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
    assert not np.asarray(out[1, :, 0]).any()


# ---- CUDA lowering on CPU: catches Triton lowering-rule errors before any GPU time. ----

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


def lower_for_h200(b, t, hkv, g, d, s, dtype, **kwargs):
    shapes = (
        jax.ShapeDtypeStruct((b, t, hkv * g, d), dtype),
        jax.ShapeDtypeStruct((b, hkv, s, d), dtype),
        jax.ShapeDtypeStruct((b, hkv, s, d), dtype),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b, t, hkv, d), dtype),
        jax.ShapeDtypeStruct((b, t, hkv, d), dtype),
        jax.ShapeDtypeStruct((b, t, t), jnp.int8),
    )
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        fn = jax.jit(lambda *a: tree_attention(*a, **kwargs))
        return fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("t", [1, 16, 64, 128])
def test_lowers_for_cuda_engine_shapes(b, t):
    text = lower_for_h200(b, t, 8, 4, 128, 1024, BF16)
    assert "__gpu$xla.gpu.triton" in text
    if t == 1:  # the decode default: the split kernel and the Pallas merge, two Triton calls
        assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "t,g,d,dtype,kwargs",
    [
        (33, 4, 128, BF16, {"window": 256}),
        (512, 4, 64, BF16, {}),
        (64, 4, 128, F32, {"splits": 1}),
        (64, 4, 128, BF16, {"tile_q": 128, "tile_k": 32, "num_warps": 8, "num_stages": 4}),
        (1, 4, 128, BF16, {"splits": 64, "merge": "pallas"}),  # the widest merge tile
        (1, 4, 128, BF16, {"splits": 16, "tile_k": 64, "merge": "xla"}),
        (1, 5, 128, BF16, {"splits": 33}),
        (64, 4, 128, BF16, {"splits": 9, "merge": "pallas"}),
    ],
)
def test_lowers_for_cuda_other_shapes(t, g, d, dtype, kwargs):
    assert "__gpu$xla.gpu.triton" in lower_for_h200(2, t, 8, g, d, 1024, dtype, **kwargs)


def test_invariant_splits_ignore_batch_and_capacity():
    """'pallas-invariant': a row's output is bit-equal whatever the batch and the cache capacity."""
    from ddtree_jax.attention import pallas_invariant

    q, kc, vc, lengths, kn, vn, mask = make_inputs(
        11, b=3, t=8, hkv=2, g=2, d=64, s=256, lengths=[200, 17, 256], mask_kind="tree", dtype=BF16
    )
    full = pallas_invariant(q, kc, vc, lengths, kn, vn, mask, interpret=True)
    check_close(full, tree_attention_reference(q, kc, vc, lengths, kn, vn, mask), BF16)
    row = (q[1:2], kc[1:2, :, :128], vc[1:2, :, :128], lengths[1:2], kn[1:2], vn[1:2], mask[1:2])
    alone = pallas_invariant(*row, interpret=True)
    np.testing.assert_array_equal(np.asarray(alone, np.float32), np.asarray(full[1:2], np.float32))
