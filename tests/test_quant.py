"""Quantized formats (ddtree_jax.quant) against the fixtures of tests/fixtures/make_quant.py."""

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import FIXTURES

from ddtree_jax.checkpoint import Checkpoint
from ddtree_jax.errors import DDTreeError
from ddtree_jax.quant import arrays, formats, load
from ddtree_jax.sharding import make_mesh, param_sharding
from ddtree_jax.weights import WeightSpec

FP8, INT4 = FIXTURES / "quant" / "deepseek_fp8", FIXTURES / "quant" / "deepseek_int4"
EXPERT = "model.layers.1.mlp.experts.{}.{}_proj.weight"


@functools.cache
def fixture(directory):
    """(scheme, read, names, expected.npz) of a quantized fixture."""
    ckpt = Checkpoint(directory)
    scheme = formats.parse_quantization(json.loads((directory / "config.json").read_text()))
    return scheme, load.reader(ckpt), set(ckpt.where), dict(np.load(directory / "expected.npz"))


def references(directory):
    """(weight name, dequantised [out, in]) pairs recorded by the fixture script."""
    return [(k[4:], v) for k, v in fixture(directory)[3].items() if k.startswith("deq:")]


def device_weight(directory, name, tp=1, axes=(None, None)):
    """One checkpoint weight as its device container ([in, out]) on a tp-way mesh."""
    scheme, read, names, _ = fixture(directory)
    form = formats.stored_form(scheme, name, names)
    n_out, n_in = (read(name) if name in names else read(name + "_packed")).shape
    n_in = n_in * 8 if isinstance(form, formats.Int4Group) else n_in
    spec = WeightSpec(("w",), name, (n_in, n_out), axes, transpose=True)
    return load.place(
        load.read_fields(read, name, form, n_out, n_in), spec, form, param_sharding(make_mesh(tp))
    )


def stacked(directory, proj):
    """The 4 routed experts' `proj` weights of layer 1 as one [E, in, out] container (and the
    NumPy dequantisation [E, in, out])."""
    scheme, read, names, _ = fixture(directory)
    names_e = [EXPERT.format(e, proj) for e in range(4)]
    form = formats.stored_form(scheme, names_e[0], names)
    n_out, n_in = (64, 256) if proj != "down" else (256, 64)
    fields = load.stack_fields([load.read_fields(read, n, form, n_out, n_in) for n in names_e])
    spec = WeightSpec(("w",), names_e[0], (4, n_in, n_out), ("experts", None, None))
    w = load.place(fields, spec, form, param_sharding(make_mesh(1)))
    ref = np.stack([load.read_dequantized(read, n, form, n_out, n_in) for n in names_e]).astype(np.float32)
    return w, np.swapaxes(ref, -1, -2)


# ---- configuration -----------------------------------------------------------------------------------


def test_parse_fixture_configs():
    assert fixture(FP8)[0] == formats.Fp8Block((128, 128))
    scheme = fixture(INT4)[0]
    assert isinstance(scheme, formats.Int4Group) and scheme.group == 32
    assert formats.parse_quantization({"hidden_size": 8}) is None
    wrapped = {
        "text_config": {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    }
    assert formats.parse_quantization(wrapped) == formats.Fp8Block((128, 128))


def _int4(**weights):
    """A compressed-tensors config whose one group has these weight args over W4A16 group 32."""
    cfg = json.loads((INT4 / "config.json").read_text())["quantization_config"]
    cfg["config_groups"]["group_0"]["weights"] |= weights
    return cfg


@pytest.mark.parametrize(
    "qc, named",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
        ({"quant_method": "fp8", "weight_block_size": None}, "weight_block_size None"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"}, "expert_dtype"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "format 'float-quantized'"),
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "nvfp4-pack-quantized"),
        (_int4(num_bits=8), "num_bits=8"),
        (_int4(symmetric=False), "symmetric=False"),
        (_int4(strategy="channel"), "strategy='channel'"),
        (_int4(actorder="group"), "actorder"),
        (_int4(group_size=12), "group_size 12"),
        (_int4() | {"quantization_status": "frozen"}, "quantization_status 'frozen'"),
    ],
)
def test_unsupported_quantization_is_named(qc, named):
    with pytest.raises(DDTreeError, match="not supported") as err:
        formats.parse_quantization({"quantization_config": qc})
    assert named in str(err.value)


def test_activation_quantization_and_several_groups_are_refused():
    qc = _int4()
    qc["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    with pytest.raises(DDTreeError, match="activation quantization"):
        formats.parse_quantization({"quantization_config": qc})
    qc = _int4()
    qc["config_groups"]["group_1"] = qc["config_groups"]["group_0"]
    with pytest.raises(DDTreeError, match="2 config_groups"):
        formats.parse_quantization({"quantization_config": qc})


def test_stored_form_follows_the_tensors_present():
    scheme, _, names, _ = fixture(FP8)
    assert formats.stored_form(scheme, EXPERT.format(2, "up"), names) == scheme
    assert formats.stored_form(scheme, "model.layers.0.self_attn.kv_b_proj.weight", names) == scheme
    for plain in ("model.layers.1.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert formats.stored_form(scheme, plain, names) == formats.PLAIN
    scheme4, _, names4, _ = fixture(INT4)
    assert formats.stored_form(scheme4, EXPERT.format(0, "down"), names4) == scheme4
    assert (
        formats.stored_form(scheme4, "model.layers.1.mlp.shared_experts.up_proj.weight", names4)
        == formats.PLAIN
    )
    with pytest.raises(DDTreeError, match="declares no quantization"):
        formats.stored_form(None, EXPERT.format(0, "down"), names4)
    with pytest.raises(DDTreeError, match="ignores it"):
        ignoring = formats.Int4Group(32, ("re:.*experts.*",))
        formats.stored_form(ignoring, EXPERT.format(0, "down"), names4)


# ---- on-disk layout and dequantisation ---------------------------------------------------------------


def test_int4_nibble_order_and_offset():
    q = np.arange(-8, 8, dtype=np.int8).reshape(1, 16)
    words = formats.pack_int4(q)
    assert words.view(np.uint32).tolist() == [[0x76543210, 0xFEDCBA98]]  # q + 8, lowest nibble first
    assert (formats.unpack_int4(words, 16) == q).all()
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, size=(3, 5, 40)).astype(np.int8)  # 40: a partly filled last word
    assert (formats.unpack_int4(formats.pack_int4(q), 40) == q).all()


def test_fixture_packing_is_compressed_tensors_layout():
    _, read, _, _ = fixture(INT4)
    module = EXPERT.format(0, "gate")[: -len(".weight")]
    packed = read(module + ".weight_packed")
    assert packed.dtype == np.int32 and packed.shape == (64, 32)
    assert read(module + ".weight_scale").dtype == ml_dtypes.bfloat16
    assert np.asarray(read(module + ".weight_shape")).tolist() == [64, 256]
    assert (formats.pack_int4(formats.unpack_int4(packed, 256)) == packed).all()


@pytest.mark.parametrize("directory", [FP8, INT4], ids=["fp8", "int4"])
def test_numpy_dequantisation_equals_the_reference_exactly(directory):
    scheme, read, names, _ = fixture(directory)
    for name, want in references(directory):
        form = formats.stored_form(scheme, name, names)
        assert form == scheme, name
        got = load.read_dequantized(read, name, form, *want.shape)
        assert got.dtype == (np.float32 if directory == FP8 else ml_dtypes.bfloat16)
        np.testing.assert_array_equal(got.astype(np.float32), want, err_msg=name)


@pytest.mark.parametrize("directory", [FP8, INT4], ids=["fp8", "int4"])
def test_device_dequantisation_equals_numpy_exactly(directory):
    for name, want in references(directory):
        w = device_weight(directory, name)
        got = np.asarray(jax.jit(arrays.dequantize, static_argnums=1)(w, jnp.float32))
        np.testing.assert_array_equal(got, want.T, err_msg=name)
        if isinstance(w, arrays.Int4Weight):
            np.testing.assert_array_equal(
                np.asarray(arrays.dequantize(arrays.as_int4(w), jnp.float32)), want.T
            )


def test_fp8_pads_partial_blocks_and_counts_bytes():
    w = device_weight(FP8, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight")  # [out 160, in 256]
    assert w.shape == (256, 160) and w.w.shape == (256, 256) and w.scale.shape == (2, 2)
    assert arrays.stored_bytes(w) == 256 * 256 + 4 * 4
    w4 = device_weight(INT4, EXPERT.format(1, "up"))  # [out 64, in 256]
    assert w4.q.shape == (32, 64) and w4.scale.shape == (8, 64) and w4.shape == (256, 64)
    assert arrays.stored_bytes(w4) == arrays.stored_bytes(arrays.as_int4(w4)) == 256 * 64 // 2 + 8 * 64 * 2


# ---- matmuls -----------------------------------------------------------------------------------------


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def _close_dot(got, want):
    """XLA may turn reduce_matmul's multiply-and-sum into a dot at its default (reduced) precision."""
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=5e-3 * np.abs(want).max())


@pytest.mark.parametrize("directory", [FP8, INT4], ids=["fp8", "int4"])
def test_dense_matmul_equals_x_at_dequantised(directory):
    rng = np.random.default_rng(1)
    for name, want in references(directory):
        w = device_weight(directory, name)
        for rows in (1, 5):
            x = rng.standard_normal((rows, want.shape[1])).astype(np.float32)
            _close(jax.jit(arrays.matmul)(x, w), x @ want.T)
            _close_dot(jax.jit(arrays.reduce_matmul)(x, w), x @ want.T)
        if isinstance(w, arrays.Int4Weight):
            _close(jax.jit(arrays.matmul)(x, arrays.as_int4(w)), x @ want.T)


@pytest.mark.parametrize("directory", [FP8, INT4], ids=["fp8", "int4"])
@pytest.mark.parametrize("proj", ["gate", "down"])
def test_expert_matmuls_gather_and_sort(directory, proj):
    w, ref = stacked(directory, proj)  # ref [E, in, out]
    rng = np.random.default_rng(2)
    for rows in (1, 8, 9, 40):
        x = rng.standard_normal((rows, ref.shape[1])).astype(np.float32)
        expert = rng.integers(0, 3, rows).astype(np.int32)  # expert 3: chosen by no row
        want = np.einsum("pi,pio->po", x, ref[expert])
        for fn in (arrays.gather_matmul, arrays.sorted_matmul):
            _close(jax.jit(fn)(x, w, expert), want)
        _close_dot(jax.jit(arrays.reduce_matmul)(x, w, expert), want)


@pytest.mark.parametrize("directory", [FP8, INT4], ids=["fp8", "int4"])
def test_slot_matmul_shared_and_per_slot_rows(directory):
    """Each token's k experts, x shared by the slots [N, in] or one row per slot [N, k, in]."""
    w, ref = stacked(directory, "gate")  # ref [E, in, out]
    rng = np.random.default_rng(5)
    experts = rng.integers(0, ref.shape[0], (3, 2)).astype(np.int32)  # N 3, k 2
    x = rng.standard_normal((3, ref.shape[1])).astype(np.float32)
    _close(jax.jit(arrays.slot_matmul)(x, w, experts), np.einsum("ni,nkio->nko", x, ref[experts]))
    xk = rng.standard_normal((3, 2, ref.shape[1])).astype(np.float32)
    _close(jax.jit(arrays.slot_matmul)(xk, w, experts), np.einsum("nki,nkio->nko", xk, ref[experts]))


def test_ragged_matmul_groups_and_trailing_rows():
    w, ref = stacked(INT4, "gate")
    x = np.random.default_rng(3).standard_normal((7, 256)).astype(np.float32)
    sizes = np.array([2, 0, 3, 1], np.int32)  # 6 rows in groups, the 7th in none
    expert = np.repeat(np.arange(4), sizes)
    got = np.asarray(jax.jit(arrays.ragged_matmul)(x, w, sizes))
    _close(got[:6], np.einsum("pi,pio->po", x[:6], ref[expert]))
    assert (got[6] == 0).all()


def test_plain_arrays_pass_through():
    w = np.random.default_rng(4).standard_normal((3, 16, 8)).astype(np.float32)
    x = np.ones((2, 16), np.float32)
    _close(arrays.matmul(x, w[0]), x @ w[0])
    for fn in (arrays.gather_matmul, arrays.sorted_matmul):
        _close(fn(x, w, np.array([2, 0])), np.stack([x[0] @ w[2], x[1] @ w[0]]))


def test_bfloat16_matmul_reads_dequantised_weights_in_bf16():
    name, want = references(INT4)[0]
    w = device_weight(INT4, name)
    x = np.random.default_rng(5).standard_normal((4, want.shape[1])).astype(ml_dtypes.bfloat16)
    got = jax.jit(arrays.matmul)(x, w)
    assert got.dtype == jnp.bfloat16
    exact = jnp.asarray(x) @ jnp.asarray(want.T.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(exact))


# ---- sharding ----------------------------------------------------------------------------------------


def test_scales_split_with_their_blocks():
    name = "model.layers.0.self_attn.kv_b_proj.weight"  # [out 256, in 128]: 2 x 1 blocks
    scheme, read, _, _ = fixture(FP8)
    want = load.read_dequantized(read, name, scheme, 256, 128)
    w = device_weight(FP8, name, tp=2, axes=(None, "heads"))
    assert w.w.sharding.spec == w.scale.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert [s.data.shape for s in w.scale.addressable_shards] == [(1, 1), (1, 1)]
    x = np.random.default_rng(6).standard_normal((3, 128)).astype(np.float32)
    one = np.asarray(arrays.matmul(x, device_weight(FP8, name)))
    np.testing.assert_array_equal(np.asarray(jax.jit(arrays.matmul)(x, w)), one)
    _close(one, x @ want.T)
    w4 = device_weight(INT4, EXPERT.format(0, "down"), tp=2, axes=("ff", None))  # in 64: 2 groups
    assert w4.q.sharding.spec == w4.scale.sharding.spec == jax.sharding.PartitionSpec("model", None)
    assert [s.data.shape for s in w4.scale.addressable_shards] == [(1, 256), (1, 256)]


def test_a_split_must_hold_whole_blocks():
    with pytest.raises(DDTreeError, match="whole quantization blocks"):
        device_weight(FP8, "model.layers.0.self_attn.kv_b_proj.weight", tp=4, axes=(None, "heads"))
    with pytest.raises(DDTreeError, match="whole quantization blocks"):
        device_weight(INT4, EXPERT.format(0, "down"), tp=4, axes=("ff", None))


def test_abstract_matches_placed():
    name = EXPERT.format(0, "gate")
    scheme, _, names, _ = fixture(INT4)
    spec = WeightSpec(("w",), name, (256, 64), (None, "ff"), transpose=True)
    form = formats.stored_form(scheme, name, names)
    placed, ab = (
        device_weight(INT4, name),
        load.abstract(spec, form, param_sharding(make_mesh(1)), jnp.bfloat16),
    )
    assert jax.tree.map(lambda a: (a.shape, a.dtype), placed) == jax.tree.map(
        lambda a: (a.shape, a.dtype), ab
    )


def test_matmul_on_local_shards_under_shard_map():
    """Megatron use: fp8 columns split (no collective), int4 rows split (psum of partial products)."""
    from jax.sharding import PartitionSpec as P

    mesh = make_mesh(2)
    x = np.random.default_rng(7).standard_normal((3, 128)).astype(np.float32)
    name = "model.layers.0.self_attn.kv_b_proj.weight"  # [in 128, out 256], out split
    w = device_weight(FP8, name, tp=2, axes=(None, "heads"))
    specs = jax.tree.map(lambda a: a.sharding.spec, w)
    cols = jax.shard_map(arrays.matmul, mesh=mesh, in_specs=(P(), specs), out_specs=P(None, "model"))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(cols)(x, w)), np.asarray(arrays.matmul(x, device_weight(FP8, name)))
    )

    name = EXPERT.format(1, "down")  # [in 64, out 256], in split: 2 groups of 32
    w4 = device_weight(INT4, name, tp=2, axes=("ff", None))
    specs4 = jax.tree.map(lambda a: a.sharding.spec, w4)

    def rows(x, w):
        return jax.lax.psum(arrays.matmul(x, w), "model")

    fn = jax.shard_map(rows, mesh=mesh, in_specs=(P(None, "model"), specs4), out_specs=P())
    x4 = x[:, :64]
    _close(jax.jit(fn)(x4, w4), np.asarray(arrays.matmul(x4, device_weight(INT4, name))))


def test_a_padded_fp8_dim_does_not_split():
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # out 160: 1.25 blocks
    with pytest.raises(DDTreeError, match="not a whole number of fp8 blocks"):
        device_weight(FP8, name, tp=2, axes=(None, "heads"))
