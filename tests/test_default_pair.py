"""The bundled default pair loads, decodes losslessly with ddtree, and its drafter is trained."""

import functools
import json
from pathlib import Path

import jax.numpy as jnp
import pytest

from ddtree_jax import drafter, target
from ddtree_jax.engine import Plan
from ddtree_jax.generation import Generator
from ddtree_jax.prompts import Prompt
from ddtree_jax.sharding import make_mesh, param_sharding
from ddtree_jax.text import TextCodec

PAIR = Path(__file__).parent.parent / "ddtree_jax" / "assets" / "default_pair"
NUM_PROMPTS, MAX_NEW = 4, 32

pytestmark = pytest.mark.skipif(not (PAIR / "draft" / "config.json").exists(), reason="no bundled pair")


@functools.cache
def pair():
    place = param_sharding(make_mesh(1, 1))
    tcfg, tparams = target.load(PAIR / "target", jnp.float32, place)
    dcfg, dparams = drafter.load(PAIR / "draft", tcfg, jnp.float32, place)
    codec = TextCodec(PAIR / "target")
    lines = (PAIR / "prompts.jsonl").read_text().splitlines()[:NUM_PROMPTS]
    prompts = [
        Prompt(r["id"], i + 1, codec.encode(r["prompt"], add_special_tokens=False), {})
        for i, r in enumerate(map(json.loads, lines))
    ]
    return tcfg, tparams, dcfg, dparams, prompts


def generate(method, budget=0):
    tcfg, tparams, dcfg, dparams, prompts = pair()
    plan = Plan(
        target=tcfg,
        draft=dcfg if method != "ar" else None,
        method=method,
        batch_size=len(prompts),
        prompt_len=16,
        max_new_tokens=MAX_NEW,
        budget=budget,
        branching=min(budget, 32) if method == "ddtree" else 1,
    )
    gen = Generator(tparams, dparams if method != "ar" else None, plan, tcfg.eos_token_ids)
    return gen.run_batch(prompts)


def test_bundled_pair_configs():
    tcfg, _, dcfg, _, prompts = pair()
    assert tcfg.architecture == "qwen3" and tcfg.eos_token_ids
    assert dcfg.mask_token_id not in tcfg.eos_token_ids
    assert len(prompts) == NUM_PROMPTS and all(len(p.input_ids) > 16 for p in prompts)


def test_ddtree_equals_ar_and_drafter_is_trained():
    ar = generate("ar")
    tree = generate("ddtree", budget=32)
    assert [r.output_ids for r in tree] == [r.output_ids for r in ar]
    accepted = [a for r in tree for a in r.acceptance_lengths]
    assert sum(accepted) / len(accepted) > 2
