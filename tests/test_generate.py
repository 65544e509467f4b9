"""End-to-end generation: batches, stop ids, the drafter's default layer ids; acceptance > 1.

Ar against HF greedy outputs and dflash / ddtree lossless against ar, for every family, are
test_families.py's. Random drafters rarely agree with random targets, so acceptance > 1 is exercised
here with an oracle tree source that proposes the target's own greedy continuation (fully, or wrong
at one depth).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import golden, golden_prompts, run

from ddtree_jax import engine

TP = "qwen3_gqa4_tp"
DRAFT = "dflash_qwen3_gqa4_tp"  # block size 8: depth 7


def ids(results):
    return [r.output_ids for r in results]


def test_prompt_alone_equals_prompt_in_batch():
    prompts = golden_prompts("llama_gqa2")
    batched = ids(run("llama_gqa2", prompts, batch_size=3))  # two batches, padding rows in the second
    alone = ids(run("llama_gqa2", prompts, batch_size=1))
    assert batched == alone == [golden("llama_gqa2")[f"greedy_{i}"].tolist() for i in range(5)]


def test_stop_id_ends_sequence_and_is_kept():
    g = golden(TP)
    out = g["greedy_2"].tolist()
    stop = out[10]
    expected = out[: out.index(stop) + 1]
    r = run(TP, golden_prompts(TP), stop_ids=[stop])[2]
    assert r.output_ids == expected and r.finish_reason == "stop"
    assert sum(r.acceptance_lengths) + 1 == len(expected)


def test_other_target_and_default_layer_ids():
    prompts = golden_prompts("qwen3_gqa1")
    ar = ids(run("qwen3_gqa1", prompts))
    assert ids(run("qwen3_gqa1", prompts, method="ddtree", draft_name="dflash_qwen3_gqa1", budget=5)) == ar


# -- acceptance > 1: an oracle tree source ------------------------------------------------------


@pytest.fixture()
def oracle(monkeypatch):
    """Install a draft stage that proposes the reference continuation; `corrupt` = a wrong depth."""

    def install(reference: list[list[int]], batch_size: int, corrupt: int | None = None):
        width = max(len(r) for r in reference) + 16
        table = np.zeros((len(reference), width), np.int32)
        for i, r in enumerate(reference):
            table[i, : len(r)] = r
        calls = {"row": 0}

        def oracle_draft(params, draft_params, state, plan):
            # Rows of this batch: the engine runs batches in order, so count them.
            rows = jnp.asarray(table[calls["row"] : calls["row"] + batch_size])
            rows = jnp.pad(rows, ((0, batch_size - rows.shape[0]), (0, 0)))
            d, k, v = plan.depth, plan.branching, plan.target.vocab_size
            pos = state.cache.lengths[:, None] + 1 + jnp.arange(d)[None, :]
            right = jnp.take_along_axis(rows, jnp.minimum(pos, width - 1), axis=1)
            tok = (right[:, :, None] + jnp.arange(k)[None, None, :]) % v
            if corrupt is not None:  # rank 0 wrong at that depth, the right token at rank 1
                tok = tok.at[:, corrupt, 0].set((right[:, corrupt] + 1) % v)
                tok = tok.at[:, corrupt, 1].set(right[:, corrupt])
            logp = -jnp.broadcast_to(jnp.arange(k, dtype=jnp.float32), tok.shape)
            return logp, tok.astype(jnp.int32)

        jax.clear_caches()
        monkeypatch.setattr(engine, "draft", oracle_draft)
        return calls

    yield install
    jax.clear_caches()


def _full_reference(prompts, outputs):
    return [p + o for p, o in zip(prompts, outputs, strict=True)]


def test_oracle_full_depth_acceptance(oracle):
    prompts = golden_prompts(TP)
    ar = [golden(TP)[f"greedy_{i}"].tolist() for i in range(5)]
    oracle(_full_reference(prompts, ar), batch_size=5)
    for method, budget in [("dflash", 0), ("ddtree", 7), ("ddtree", 32)]:
        results = run(TP, prompts, method=method, draft_name=DRAFT, budget=budget, batch_size=5)
        assert ids(results) == ar
        # 23 tokens after the first: rounds of 8, 8, then the 7 left.
        assert all(r.acceptance_lengths == [8, 8, 7] for r in results), method


def test_oracle_partial_agreement_tree_beats_chain(oracle):
    prompts = golden_prompts(TP)
    ar = [golden(TP)[f"greedy_{i}"].tolist() for i in range(5)]
    oracle(_full_reference(prompts, ar), batch_size=5, corrupt=3)
    chain = run(TP, prompts, method="dflash", draft_name=DRAFT, batch_size=5)
    tree = run(TP, prompts, method="ddtree", draft_name=DRAFT, budget=100, batch_size=5)
    assert ids(chain) == ids(tree) == ar
    assert all(r.acceptance_lengths[0] == 4 for r in chain)  # bonus + depths 1..3
    assert all(r.acceptance_lengths[:2] == [8, 8] for r in tree)  # the rank-1 branch is in the tree


def test_oracle_stop_inside_path_and_length_mid_path(oracle):
    prompts = golden_prompts(TP)
    ar = [golden(TP)[f"greedy_{i}"].tolist() for i in range(5)]
    oracle(_full_reference(prompts, ar), batch_size=5)
    stop = ar[3][5]  # falls inside the first 8-token round of prompt 3
    results = run(
        TP,
        prompts,
        method="ddtree",
        draft_name=DRAFT,
        budget=32,
        batch_size=5,
        stop_ids=[stop],
        max_new_tokens=13,
    )
    for r, ref in zip(results, ar, strict=True):
        expected = ref[:13]
        if stop in expected:
            expected = expected[: expected.index(stop) + 1]
            assert r.finish_reason == "stop"
        else:
            assert r.finish_reason == "length"
        assert r.output_ids == expected
        assert sum(r.acceptance_lengths) + 1 == len(expected)
