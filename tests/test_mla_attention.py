"""Absorbed MLA attention over a latent cache: the Pallas kernel against its jnp reference (interpret
mode on CPU), both against the expanded per-head form computed independently in numpy, and the
kernel's CUDA lowering checked on CPU under an abstract H200."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_tree_attention import H200, check_close, make_mask

from ddtree_jax.kernels.mla_attention import mla_attention, mla_attention_reference
from ddtree_jax.kernels.tuning import resolve_mla_tuning

F32, BF16 = jnp.float32, jnp.bfloat16
SCALE = 192**-0.5 * 1.3**2  # DeepSeek-V3's (qk_nope + qk_rope)**-0.5 times a yarn mscale**2


def make_inputs(seed, *, b, t, h, c, r, s, lengths, mask_kind, dtype):
    """(q_latent, q_rope, latent_cache, rope_cache, lengths, latent_new, rope_new, mask), random."""
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 6)
    shapes = [(b, t, h, c), (b, t, h, r), (b, s, c), (b, s, r), (b, t, c), (b, t, r)]
    ql, qr, lc, rc, ln, rn = (
        jax.random.normal(key, shape, F32).astype(dtype) for key, shape in zip(keys, shapes, strict=True)
    )
    mask = jnp.asarray(make_mask(rng, mask_kind, b, t)).astype(jnp.int8)
    return ql, qr, lc, rc, jnp.asarray(lengths, jnp.int32), ln, rn, mask


# (t, h, c, r, s, lengths, mask kind, dtype, window, tuning): a covering subset, not the product.
CASES = [
    # Autoregressive (T = 1): 8 heads (fewer packed rows than the 16-row tile), S not a multiple of
    # the tile, splits, an empty cache; real widths (512 + 64) with a window.
    (1, 8, 64, 16, 100, [100, 0], "ones", F32, None, {"tile_k": 16, "splits": 3}),
    (1, 16, 512, 64, 96, [96, 40], "ones", BF16, 16, {}),
    # Chain (causal).
    (16, 2, 64, 16, 200, [200, 123], "causal", BF16, None, {"tile_q": 16, "splits": 3}),
    # Verify: ancestor masks of random trees; T * H not a multiple of the row tile; splits.
    (33, 4, 64, 16, 192, [100, 5], "tree", F32, None, {}),
    (64, 2, 128, 32, 300, [299, 300], "tree", F32, 100, {"tile_k": 16, "splits": 7}),
    (24, 8, 64, 16, 160, [160, 17], "tree", BF16, None, {"tile_q": 64, "tile_k": 64, "splits": 1}),
    # Rows that see nothing at all give zeros (length 0 and rows with an empty mask row).
    (16, 2, 64, 16, 64, [0, 40], "sparse", BF16, 8, {"splits": 2}),
    # Value splits (output columns over programs sharing a row tile): real widths, all 64 heads in
    # one tile (the TP1 decode default), 2 parts, with cache splits, a partial last tile and an
    # empty cache; a verify with 4 parts, one split, a window, and rows past T * H.
    (1, 64, 512, 64, 80, [80, 0], "ones", BF16, None, {"splits": 2, "value_splits": 2}),
    (12, 4, 64, 16, 96, [96, 50], "tree", F32, 40, {"tile_q": 32, "value_splits": 4, "splits": 1}),
]


@pytest.mark.parametrize("t,h,c,r,s,lengths,mask_kind,dtype,window,tuning", CASES)
def test_matches_reference(t, h, c, r, s, lengths, mask_kind, dtype, window, tuning):
    seed = zlib.crc32(repr((t, h, c, r, s, lengths, mask_kind, window)).encode())
    args = make_inputs(seed, b=2, t=t, h=h, c=c, r=r, s=s, lengths=lengths, mask_kind=mask_kind, dtype=dtype)
    out = mla_attention(*args, softmax_scale=SCALE, window=window, interpret=True, **tuning)
    ref = mla_attention_reference(*args, softmax_scale=SCALE, window=window)
    check_close(out, ref, dtype)


def test_under_jit_with_traced_lengths():
    """A drafter block (all-ones mask) inside an outer jit, lengths traced, as the engine calls it."""
    args = make_inputs(
        3, b=3, t=8, h=4, c=64, r=16, s=128, lengths=[5, 64, 128], mask_kind="ones", dtype=BF16
    )
    out = jax.jit(lambda *a: mla_attention(*a, softmax_scale=SCALE, interpret=True))(*args)
    check_close(out, mla_attention_reference(*args, softmax_scale=SCALE), BF16)


def test_rejects_mismatched_shapes():
    ql, qr, lc, rc, lengths, ln, rn, mask = make_inputs(
        0, b=1, t=2, h=2, c=64, r=16, s=32, lengths=[3], mask_kind="ones", dtype=F32
    )
    with pytest.raises(ValueError, match="rope_new"):
        mla_attention(ql, qr, lc, rc, lengths, ln, rn[..., :8], mask, softmax_scale=SCALE, interpret=True)


def test_heads_split_over_model_cache_replicated():
    """Under shard_map on a 2 (data) x 4 (model) mesh, as a TP model calls it: heads split over
    "model", the latent cache (no head axis) replicated over "model", sequences over "data"."""
    from jax.sharding import PartitionSpec as P

    args = make_inputs(5, b=2, t=4, h=8, c=64, r=16, s=80, lengths=[80, 23], mask_kind="tree", dtype=F32)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    heads, per_seq = P("data", None, "model", None), P("data")
    specs = (heads, heads, per_seq, per_seq, per_seq, per_seq, per_seq, per_seq)
    fn = jax.shard_map(
        lambda *a: mla_attention(*a, softmax_scale=SCALE, interpret=True),
        mesh=mesh,
        in_specs=specs,
        out_specs=heads,
        check_vma=False,
    )
    placed = [jax.device_put(a, jax.NamedSharding(mesh, spec)) for a, spec in zip(args, specs, strict=True)]
    check_close(jax.jit(fn)(*placed), mla_attention_reference(*args, softmax_scale=SCALE), F32)


# ---- The absorbed identity against the expanded form, in float64 numpy. ----


def expanded_attention(kv_b, q_nope, q_rope, latent, rope, visible, softmax_scale):
    """DeepSeek-V3 attention as HF writes it: per-head keys and values from kv_b_proj, plain softmax.

    kv_b [H * (N + V), C] (kv_b_proj.weight); q_nope [B, T, H, N], q_rope [B, T, H, R]; latent
    [B, K, C] and rope [B, K, R] for every key (cache and in-flight); visible [B, T, K] bool
    -> [B, T, H, V].
    """
    b, t, h, n = q_nope.shape
    kv = (latent @ kv_b.T).reshape(b, -1, h, kv_b.shape[0] // h)  # [B, K, H, N + V]
    k_nope, v = kv[..., :n], kv[..., n:]
    k = np.concatenate(
        [k_nope, np.broadcast_to(rope[:, :, None, :], (*k_nope.shape[:3], rope.shape[-1]))], -1
    )
    q = np.concatenate([q_nope, q_rope], -1)
    scores = np.einsum("bthd,bkhd->bthk", q, k) * softmax_scale
    scores = np.where(visible[:, :, None, :], scores, -np.inf)
    m = np.max(scores, axis=-1, keepdims=True)
    p = np.exp(scores - np.where(np.isfinite(m), m, 0.0))
    p /= np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bthk,bkhv->bthv", p, v)


def test_absorbed_form_matches_expanded():
    """q_latent = W_uk^T q_nope, output mapped through W_uv: the reference and the kernel equal the
    expanded per-head attention (HF's formula), with a tree mask and lengths that differ per row."""
    b, t, h, n, v, c, r, s = 2, 12, 4, 16, 24, 64, 16, 80
    lengths = np.array([80, 31])
    rng = np.random.default_rng(11)
    kv_b = rng.normal(size=(h * (n + v), c)) / np.sqrt(c)
    q_nope, q_rope = rng.normal(size=(b, t, h, n)), rng.normal(size=(b, t, h, r))
    latent_cache, rope_cache = rng.normal(size=(b, s, c)), rng.normal(size=(b, s, r))
    latent_new, rope_new = rng.normal(size=(b, t, c)), rng.normal(size=(b, t, r))
    mask = make_mask(rng, "tree", b, t)

    pos = np.arange(s)[None, :]
    in_cache = pos < lengths[:, None]
    visible = np.concatenate([np.broadcast_to(in_cache[:, None, :], (b, t, s)), mask], -1)
    expected = expanded_attention(
        kv_b,
        q_nope,
        q_rope,
        np.concatenate([latent_cache, latent_new], 1),
        np.concatenate([rope_cache, rope_new], 1),
        visible,
        SCALE,
    )

    w = kv_b.reshape(h, n + v, c)
    w_uk, w_uv = w[:, :n], w[:, n:]  # [H, N, C], [H, V, C]
    q_latent = np.einsum("bthn,hnc->bthc", q_nope, w_uk)
    args = [jnp.asarray(x, F32) for x in (q_latent, q_rope, latent_cache, rope_cache)]
    args += [jnp.asarray(lengths, jnp.int32), jnp.asarray(latent_new, F32), jnp.asarray(rope_new, F32)]
    args += [jnp.asarray(mask)]
    for fn in (mla_attention_reference, lambda *a, **k: mla_attention(*a, **k, interpret=True)):
        latent_out = np.asarray(fn(*args, softmax_scale=SCALE), np.float64)
        got = np.einsum("bthc,hvc->bthv", latent_out, w_uv)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_default_tuning_for_kimi_k2_shapes():
    """64 heads at TP1, 8 per device at TP8: all heads of a decode in one 64-row tile, splits
    counted in waves of 132 SMs (two 16-row programs per SM, one 64-row), the fewest within 10% of
    the least waves x tiles, at most 256 and at least 4 cache tiles each."""
    keys = ("tile_q", "tile_k", "num_warps", "row_tiles", "value_splits", "splits")
    assert [resolve_mla_tuning((1, 1, 64, 512), 32768)[k] for k in keys] == [64, 64, 8, 1, 1, 128]
    assert [resolve_mla_tuning((1, 1, 8, 512), 32768)[k] for k in keys] == [16, 32, 4, 1, 1, 256]
    assert resolve_mla_tuning((1, 1, 8, 512), 1024)["splits"] == 8  # 4 tiles of 32 per split
    assert [resolve_mla_tuning((1, 64, 8, 512), 32768)[k] for k in keys] == [64, 64, 8, 8, 1, 15]  # one wave
    tp1_verify = resolve_mla_tuning((1, 64, 64, 512), 32768)
    assert (tp1_verify["row_tiles"], tp1_verify["splits"]) == (64, 2)  # not 3: 192 programs, two waves
    assert resolve_mla_tuning((16, 64, 64, 512), 32768)["splits"] == 1
    assert resolve_mla_tuning((16, 1, 64, 512), 32768)["splits"] == 8  # 128 programs
    assert resolve_mla_tuning((1, 1, 64, 512), 1024, value_splits=2)["splits"] == 4  # 16 tiles of 64
    with pytest.raises(ValueError, match="value_splits"):
        resolve_mla_tuning((1, 1, 64, 64), 256, value_splits=8)


# ---- CUDA lowering on CPU: catches Triton lowering-rule errors before any GPU time. ----


def lower_for_h200(b, t, h, s, dtype, c=512, r=64, **kwargs):
    """StableHLO text of `mla_attention` lowered for CUDA under an abstract H200 (no GPU needed)."""
    shapes = (
        jax.ShapeDtypeStruct((b, t, h, c), dtype),
        jax.ShapeDtypeStruct((b, t, h, r), dtype),
        jax.ShapeDtypeStruct((b, s, c), dtype),
        jax.ShapeDtypeStruct((b, s, r), dtype),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b, t, c), dtype),
        jax.ShapeDtypeStruct((b, t, r), dtype),
        jax.ShapeDtypeStruct((b, t, t), jnp.int8),
    )
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        fn = jax.jit(lambda *a: mla_attention(*a, softmax_scale=SCALE, **kwargs))
        return fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("h", [8, 64])
@pytest.mark.parametrize("t", [1, 16, 64])
def test_lowers_for_cuda_kimi_k2_shapes(t, h):
    assert "__gpu$xla.gpu.triton" in lower_for_h200(2, t, h, 1024, BF16)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "t,h,dtype,kwargs",
    [
        (33, 16, BF16, {"window": 256}),
        (128, 64, BF16, {"splits": 1}),
        (64, 8, F32, {}),
        (64, 64, BF16, {"tile_q": 64, "tile_k": 64, "num_warps": 8, "num_stages": 3}),
        (1, 64, BF16, {"tile_q": 64, "tile_k": 16, "splits": 64, "num_warps": 4, "num_stages": 1}),
        (1, 64, BF16, {"tile_q": 16, "value_splits": 1, "num_warps": 4}),
        (1, 8, BF16, {"value_splits": 4, "tile_k": 64, "splits": 16}),
        (1, 64, BF16, {"value_splits": 2}),
        (64, 64, BF16, {"tile_q": 128, "value_splits": 2, "splits": 1}),
        (64, 8, BF16, {"tile_q": 64, "value_splits": 2, "num_warps": 4, "window": 512}),
    ],
)
def test_lowers_for_cuda_other_tunings(t, h, dtype, kwargs):
    assert "__gpu$xla.gpu.triton" in lower_for_h200(2, t, h, 1024, dtype, **kwargs)


def test_invariant_splits_ignore_batch_and_capacity():
    """MLA's 'pallas-invariant' (what --batch-invariant runs on DeepSeek-V3/Kimi-K2 targets): a row's
    output is bit-equal whatever the batch and the cache capacity, where the default splits differ."""
    from ddtree_jax.attention import kernel

    fn = kernel("pallas-invariant", "mla")
    ql, qr, lc, rc, lengths, ln, rn, mask = make_inputs(
        5, b=3, t=8, h=4, c=64, r=16, s=512, lengths=[17, 250, 512], mask_kind="tree", dtype=F32
    )
    assert resolve_mla_tuning(ql.shape, 512)["splits"] != resolve_mla_tuning(ql[:1].shape, 256)["splits"]
    full = fn(ql, qr, lc, rc, lengths, ln, rn, mask, softmax_scale=SCALE, interpret=True)
    want = mla_attention_reference(ql, qr, lc, rc, lengths, ln, rn, mask, softmax_scale=SCALE)
    check_close(full, want, F32)
    row = (ql[1:2], qr[1:2], lc[1:2, :256], rc[1:2, :256], lengths[1:2], ln[1:2], rn[1:2], mask[1:2])
    alone = fn(*row, softmax_scale=SCALE, interpret=True)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(full[1:2]))


def test_unknown_implementation_refused():
    """Every attention kind has its own table; a name outside it is refused, naming the known ones."""
    from ddtree_jax.attention import kernel

    assert kernel("pallas", "mla") is mla_attention
    assert kernel("reference", "mla") is mla_attention_reference
    for impl, kind in [("foo", "gqa"), ("foo", "mla"), ("causal-xla", "mla"), ("pallas_invariant", "gqa")]:
        with pytest.raises(ValueError, match=f"no {kind.upper()} attention implementation '{impl}'; known: "):
            kernel(impl, kind)
