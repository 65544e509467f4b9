"""The bundled default pair loads, decodes losslessly with ddtree, and its drafter is trained."""

import functools
import json
from pathlib import Path

import pytest

from ddtree_jax.pair import generator, load_pair, make_plan
from ddtree_jax.prompts import Prompt

PAIR = Path(__file__).parent.parent / "ddtree_jax" / "assets" / "default_pair"
NUM_PROMPTS, MAX_NEW = 4, 32

pytestmark = pytest.mark.skipif(not (PAIR / "draft" / "config.json").exists(), reason="no bundled pair")


@functools.cache
def pair():
    p = load_pair(PAIR / "target", PAIR / "draft", "float32")
    lines = (PAIR / "prompts.jsonl").read_text().splitlines()[:NUM_PROMPTS]
    prompts = [
        Prompt(r["id"], i + 1, p.codec.encode(r["prompt"], add_special_tokens=False), {})
        for i, r in enumerate(map(json.loads, lines))
    ]
    return p, prompts


def generate(method, budget=None):
    p, prompts = pair()
    plan = make_plan(
        p.target, p.draft, method, batch_size=len(prompts), max_new_tokens=MAX_NEW, budget=budget
    )
    return generator(p, plan).run_batch(prompts)


def test_bundled_pair_configs():
    p, prompts = pair()
    assert p.target.architecture == "qwen3" and p.target.eos_token_ids
    assert p.draft.mask_token_id not in p.target.eos_token_ids
    assert len(prompts) == NUM_PROMPTS and all(len(p.input_ids) > 16 for p in prompts)


def test_ddtree_equals_ar_and_drafter_is_trained():
    ar = generate("ar")
    tree = generate("ddtree", budget=32)
    assert [r.output_ids for r in tree] == [r.output_ids for r in ar]
    accepted = [a for r in tree for a in r.acceptance_lengths]
    assert sum(accepted) / len(accepted) > 2
