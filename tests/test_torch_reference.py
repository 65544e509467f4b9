"""The independent PyTorch reference (compare/torch_reference.py) against HF's golden outputs, the
golden drafter and our engine."""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import DRAFTERS, FIXTURES, TARGETS, fixture_id, golden, golden_prompts, run  # noqa: E402

from ddtree_jax.compare import oracles  # noqa: E402
from ddtree_jax.compare import torch_reference as tr  # noqa: E402


@functools.cache
def pair(target: str, draft: str | None = None) -> tr.TorchPair:
    """A fixture pair on the PyTorch side (float32)."""
    return tr.TorchPair(FIXTURES / target, None if draft is None else FIXTURES / draft)


@pytest.mark.parametrize("name", TARGETS)
def test_target_logits_and_greedy_equal_hf_golden(name):
    g, p = golden(name), pair(name)
    for i, prompt in enumerate(golden_prompts(name)):
        np.testing.assert_allclose(p.logits(prompt), g[f"logits_{i}"], rtol=0, atol=1e-4)
        out, acceptance = p.generate(prompt, "ar", max_new_tokens=24)
        assert out == g[f"greedy_{i}"].tolist() and acceptance == [1] * 23


# The drafters and their targets, the yarn drafter (its legacy cos/sin factor) included.
ALL_DRAFTERS = DRAFTERS | {"dflash_deepseek_v3_tp": "deepseek_v3_tp"}


@pytest.mark.parametrize("name", sorted(ALL_DRAFTERS), ids=fixture_id)
def test_drafter_equals_golden_drafter(name):
    """Features from HF hidden states equal the golden ones and draft logits the golden drafter's
    (tests/make_fixtures.py records them with this drafter; the shipped ones came from an earlier
    plain-torch forward of the same layers, written apart from this one)."""
    g, gt, p = golden(name), golden(ALL_DRAFTERS[name]), pair(ALL_DRAFTERS[name], name)
    for i in range(5):
        feats = p.features(gt[f"prompt_{i}"].tolist())
        np.testing.assert_allclose(feats.numpy(), g[f"feat_{i}"], rtol=0, atol=1e-3)
        ref = g[f"draft_logits_{i}"]
        got = p.draft_logits(torch.from_numpy(g[f"feat_{i}"]), int(g[f"block_{i}"][0]))
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5, (name, i)


def test_features_of_the_last_layer_are_post_norm():
    """A drafter reading the target's last layer gets HF's hidden_states[L]: the final norm's output."""
    p = pair("qwen3_gqa4_tp", "dflash_qwen3_gqa4_tp")
    last = p.target.config.num_hidden_layers - 1
    ids = golden_prompts("qwen3_gqa4_tp")[2]
    saved = p.drafter.target_layer_ids
    try:
        p.drafter.target_layer_ids = [last]
        feats = p.features(ids).numpy()
    finally:
        p.drafter.target_layer_ids = saved
    g = golden("qwen3_gqa4_tp")
    np.testing.assert_allclose(feats, g["hidden_2"][last + 1], rtol=0, atol=1e-4)
    assert np.abs(feats - g["hidden_last_prenorm_2"]).max() > 1e-2


def test_verify_equals_plain_causal_pass_per_node():
    """Under the 4-D ancestor mask every node's choice is the argmax after the prefix and its own path."""
    p = pair("qwen3_gqa4_tp", "dflash_qwen3_gqa4_tp")
    context = golden_prompts("qwen3_gqa4_tp")[3]
    cache, features = p.prefix(context)
    logp, tok = p._draft_candidates(features, 17, 3, None)
    t = oracles.heap_tree(17, logp, tok, 12)
    choice = p.verify(cache, t)
    for node in range(len(t.tokens)):
        path, j = [], node
        while j >= 0:
            path.insert(0, t.tokens[j])
            j = t.parent[j]
        assert choice[node] == int(p.logits(context + path)[-1].argmax()), node


@pytest.mark.parametrize(("method", "budget", "branching"), [("dflash", 0, 1), ("ddtree", 15, 4)])
def test_outputs_and_acceptance_equal_the_engine(method, budget, branching):
    prompts = golden_prompts("qwen3_gqa4_tp")
    draft = "dflash_qwen3_gqa4_tp"
    ours = run("qwen3_gqa4_tp", prompts, method=method, draft_name=draft, budget=budget, max_new_tokens=16)
    p = pair("qwen3_gqa4_tp", draft)
    for prompt, res in zip(prompts, ours, strict=True):
        out, acceptance = p.generate(prompt, method, 16, budget, branching=branching if budget else 1)
        assert (out, acceptance) == (res.output_ids, res.acceptance_lengths)


def test_long_acceptance_equals_the_engine_on_the_bundled_pair():
    """The random fixture drafters are rarely accepted: the bundled pair accepts long paths."""
    from ddtree_jax.cli import BUNDLED
    from ddtree_jax.pair import generator, load_pair, make_plan
    from ddtree_jax.prompts import Prompt, read_prompts

    loaded = load_pair(BUNDLED / "target", BUNDLED / "draft", "float32")
    prompt = read_prompts(BUNDLED / "prompts.jsonl", loaded.codec, True, loaded.target.vocab_size)[0]
    ids = prompt.input_ids[:48]
    plan = make_plan(loaded.target, loaded.draft, "ddtree", batch_size=1, max_new_tokens=24, budget=15)
    ours = generator(loaded, plan).run_batch([Prompt(0, 1, ids, {})])[0]
    p = tr.TorchPair(BUNDLED / "target", BUNDLED / "draft")
    out, acceptance = p.generate(ids, "ddtree", 24, 15, plan.branching, tr.read_stop_ids(BUNDLED / "target"))
    assert (out, acceptance) == (ours.output_ids, ours.acceptance_lengths)
    assert max(acceptance) >= 4 and sum(acceptance) / len(acceptance) > 2
