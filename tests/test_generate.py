"""End-to-end generation: batches, stop ids, the drafter's default layer ids; acceptance > 1.

Ar against HF greedy outputs and dflash / ddtree lossless against ar, for every family, are
test_families.py's. Random drafters rarely agree with random targets, so acceptance > 1 is exercised
here with an oracle tree source that proposes the target's own greedy continuation (fully, or wrong
at one depth).
"""

from conftest import golden, golden_prompts, oracle_draft, run

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


def _full_reference(prompts, outputs):
    return [p + o for p, o in zip(prompts, outputs, strict=True)]


def test_oracle_full_depth_acceptance():
    prompts = golden_prompts(TP)
    ar = [golden(TP)[f"greedy_{i}"].tolist() for i in range(5)]
    stage = oracle_draft(_full_reference(prompts, ar))
    for method, budget in [("dflash", 0), ("ddtree", 7), ("ddtree", 32)]:
        results = run(
            TP, prompts, method=method, draft_name=DRAFT, budget=budget, batch_size=5, draft_stage=stage
        )
        assert ids(results) == ar
        # 23 tokens after the first: rounds of 8, 8, then the 7 left.
        assert all(r.acceptance_lengths == [8, 8, 7] for r in results), method


def test_oracle_partial_agreement_tree_beats_chain():
    prompts = golden_prompts(TP)
    ar = [golden(TP)[f"greedy_{i}"].tolist() for i in range(5)]
    stage = oracle_draft(_full_reference(prompts, ar), corrupt=3)
    chain = run(TP, prompts, method="dflash", draft_name=DRAFT, batch_size=5, draft_stage=stage)
    tree = run(TP, prompts, method="ddtree", draft_name=DRAFT, budget=100, batch_size=5, draft_stage=stage)
    assert ids(chain) == ids(tree) == ar
    assert all(r.acceptance_lengths[0] == 4 for r in chain)  # bonus + depths 1..3
    assert all(r.acceptance_lengths[:2] == [8, 8] for r in tree)  # the rank-1 branch is in the tree


def test_oracle_stop_inside_path_and_length_mid_path():
    prompts = golden_prompts(TP)
    ar = [golden(TP)[f"greedy_{i}"].tolist() for i in range(5)]
    stage = oracle_draft(_full_reference(prompts, ar))
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
        draft_stage=stage,
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
