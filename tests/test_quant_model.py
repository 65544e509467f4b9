"""Quantized DeepseekV3 targets (FP8 block-scaled, INT4 experts) loaded as published, against the same
model with dequantised weights, HF's logits (tests/fixtures/make_quant.py), ar, and other meshes."""

import functools
import json

import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, golden_prompts, run

from ddtree_jax import target
from ddtree_jax.checkpoint import params_cache
from ddtree_jax.engine import Plan, on_mesh, param_specs
from ddtree_jax.errors import DDTreeError
from ddtree_jax.quant import Fp8Weight, Int4Weight, stored_bytes
from ddtree_jax.sharding import make_mesh, param_sharding

QUANT = ["quant/deepseek_fp8", "quant/deepseek_int4", "quant/deepseek_v3_tp_fp8", "quant/deepseek_v3_tp_int4"]
TP_QUANT = ["quant/deepseek_v3_tp_fp8", "quant/deepseek_v3_tp_int4"]
DRAFT = "dflash_deepseek_v3_tp"
conftest.DRAFTERS.setdefault(DRAFT, "deepseek_v3_tp")  # the quantized tp fixtures share its config
P = jax.sharding.PartitionSpec


@functools.cache
def load(name: str, tp: int = 1, dequantize: bool = False):
    return target.load(FIXTURES / name, jnp.float32, param_sharding(make_mesh(tp)), dequantize)


def expected(name: str) -> dict:
    return dict(np.load(FIXTURES / name / "expected.npz"))


def logits_on_mesh(name: str, tp: int = 1, dequantize: bool = False) -> np.ndarray:
    """float32 logits [T, V] of the fixture's prompt, the model split over `tp` devices."""
    cfg, params = load(name, tp, dequantize)
    ids = expected(name)["prompt"]
    n = len(ids)
    plan = Plan(cfg, None, "ar", 4, tp=tp)
    spec, _ = param_specs(plan)
    causal = jnp.tril(jnp.ones((n, n), bool))[None]

    def logits(params, tokens, *, plan):
        axis = "model" if plan.tp > 1 else None
        out = target.forward(params, cfg, tokens, jnp.arange(n)[None], causal, None, model_axis=axis)
        local = target.logits(params, out.hidden, cfg.vocab_size, axis)
        return local if axis is None else jax.lax.all_gather(local, axis, axis=-1, tiled=True)

    got = jax.jit(on_mesh(logits, plan, (spec, P()), P()))(params, jnp.asarray(ids)[None])
    return np.asarray(got)[0, :, : cfg.vocab_size]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", QUANT)
def test_logits_equal_dequantised_model_and_hf(name):
    """Weights read quantized and dequantised inside the matmuls give the logits of the same model
    with weights expanded at load (--dequantize) and HF's logits of the dequantised model."""
    got = logits_on_mesh(name)
    assert rel(got, logits_on_mesh(name, dequantize=True)) < 1e-4
    assert rel(got, expected(name)["logits"]) < 1e-4


@pytest.mark.parametrize("name", QUANT[1:])  # deepseek_fp8's 64-wide experts pad to 128-blocks: 2x
def test_params_are_quantized_and_smaller(name):
    cfg, params = load(name)
    _, plain = load(name, dequantize=True)
    layer, kind = params["layers"][1], Fp8Weight if "fp8" in name else Int4Weight
    assert all(isinstance(layer[k], kind) for k in ("experts_gate", "experts_up", "experts_down"))
    dense_kind = kind if kind is Fp8Weight else jax.Array
    assert all(isinstance(layer[k], dense_kind) for k in ("o_proj", "kv_b_proj", "shared_down"))
    assert isinstance(layer["router"], jax.Array) and isinstance(params["embed"], jax.Array)
    experts = sum(stored_bytes(layer[k]) for k in ("experts_gate", "experts_up", "experts_down"))
    as_bf16 = 2 * sum(plain["layers"][1][k].size for k in ("experts_gate", "experts_up", "experts_down"))
    assert experts < (0.65 if kind is Fp8Weight else 0.35) * as_bf16  # 1 or 1/2 byte per weight + scales
    assert cfg.quantization is not None and load(name, dequantize=True)[0].quantization is None


@pytest.mark.parametrize("name", TP_QUANT)
def test_greedy_ddtree_equals_ar(name):
    prompts = golden_prompts("deepseek_v3_tp")[:3]
    ar = run(name, prompts, max_new_tokens=10)
    got = run(name, prompts, method="ddtree", draft_name=DRAFT, budget=7, max_new_tokens=10)
    assert [r.output_ids for r in got] == [r.output_ids for r in ar]


@pytest.mark.parametrize("name", TP_QUANT)
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_logits_identical_across_meshes(name, tp):
    """Heads, MLP columns, experts and their scales split over "model" as their bf16 counterparts."""
    assert rel(logits_on_mesh(name, tp), logits_on_mesh(name)) < 1e-5


@pytest.mark.parametrize("name", TP_QUANT[:1])  # fp8: every projection and its scales split
def test_ddtree_on_tp8_equals_one_device(name):
    prompts = golden_prompts("deepseek_v3_tp")[:2]
    kw = dict(method="ddtree", draft_name=DRAFT, budget=7, max_new_tokens=8)
    one = run(name, prompts, **kw)
    got = run(name, prompts, tp=8, **kw)
    assert [(r.output_ids, r.acceptance_lengths) for r in got] == [
        (r.output_ids, r.acceptance_lengths) for r in one
    ]


def test_whole_blocks_per_device_or_a_clear_error():
    """The 128-block fixture (2 heads of 96: q_b_proj's 192 columns, 1.5 blocks) cannot split 2 ways."""
    with pytest.raises(DDTreeError, match="fp8 blocks"):
        load("quant/deepseek_fp8", 2)


def _with_quantization(tmp_path, source: str, qc: dict):
    raw = json.loads((FIXTURES / source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"quantization_config": qc}))
    return tmp_path


@pytest.mark.parametrize(
    "qc,named",
    [
        ({"quant_method": "awq"}, "awq"),
        ({"quant_method": "gptq", "bits": 4}, "gptq"),
        ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
    ],
)
def test_unsupported_method_is_named(tmp_path, qc, named):
    directory = _with_quantization(tmp_path, "deepseek_v3_tp", qc)
    with pytest.raises(DDTreeError, match=f"quant_method '{named}'"):
        target.load(directory, jnp.float32, param_sharding(make_mesh()))


def test_other_families_refuse_quantized_checkpoints(tmp_path):
    directory = _with_quantization(
        tmp_path, "qwen3_moe_tp", {"quant_method": "fp8", "weight_block_size": [128, 128]}
    )
    with pytest.raises(DDTreeError, match="DeepseekV3"):
        target.load(directory, jnp.float32, param_sharding(make_mesh()))


@pytest.mark.parametrize("dequantize", [False, True])
def test_params_cache_refuses_quantized_checkpoints(tmp_path, dequantize):
    with params_cache(tmp_path / "cache"), pytest.raises(DDTreeError, match="params-cache.*quantized"):
        target.load(FIXTURES / TP_QUANT[1], jnp.float32, param_sharding(make_mesh()), dequantize)
    assert not (tmp_path / "cache").exists()


def test_cli_dequantize_flag(tmp_path):
    """ddtree-generate on the INT4 target, kept quantized and with --dequantize: the same greedy tokens
    (float32); load_pair's --dequantize gives plain arrays."""
    from ddtree_jax.cli import main
    from ddtree_jax.pair import load_pair

    prompts = tmp_path / "p.jsonl"
    rows = [{"id": i, "input_ids": p} for i, p in enumerate(golden_prompts("deepseek_v3_tp")[:3])]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["--dtype", "float32", "--max-new-tokens", "6", "--batch-size", "3", "--method", "ar"]
    base += ["--target", str(FIXTURES / TP_QUANT[1]), "--prompts", str(prompts)]
    outs = []
    for extra in ([], ["--dequantize"]):
        out = tmp_path / f"out{len(extra)}.jsonl"
        assert main([*base, *extra, "--out", str(out)]) == 0
        outs.append(sorted((r["id"], r["output_ids"]) for r in map(json.loads, out.read_text().splitlines())))
    assert outs[0] == outs[1]
    pair = load_pair(FIXTURES / TP_QUANT[1], None, "float32", dequantize=True)
    assert isinstance(pair.params["layers"][1]["experts_up"], jax.Array)
