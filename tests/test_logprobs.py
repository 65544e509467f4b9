"""Log-probabilities (--logprobs K): per generated token the target's log-probability of the chosen
token and of its top K, equal to HF transformers' log_softmax of its own forward's logits over the
prompt and the generated tokens, equal across ar / dflash / ddtree, raw and processed; off by default
nothing changes (test_recorded_outputs)."""

import json

import numpy as np
import pytest
import torch
from conftest import FIXTURES, golden_prompts, run

from ddtree_jax import LLM, SamplingParams
from ddtree_jax.cli import main
from ddtree_jax.errors import DDTreeError
from ddtree_jax.logprobs import node_logprobs
from ddtree_jax.sampling import SamplingArrays

TARGET, DRAFT = "qwen3_gqa4_tp", "dflash_qwen3_gqa4_tp"
K = 5
SAMPLED = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7}


def generate(method: str, sampling=None, mode="raw", max_new_tokens=16):
    budget = 6 if method == "ddtree" else 0
    draft = None if method == "ar" else DRAFT
    return run(
        TARGET, golden_prompts(TARGET), method=method, draft_name=draft, budget=budget,
        max_new_tokens=max_new_tokens, sampling=sampling, logprobs=K, logprobs_mode=mode,
    )  # fmt: skip


def arrays(result):
    """The chosen log-probs [N], the top K's [N, K] (None, i.e. -inf: NaN) and their ids [N, K]."""
    num = lambda x: np.nan if x is None else x  # noqa: E731
    chosen = np.array([num(lp) for lp, _ in result.output_token_logprobs], np.float64)
    top = np.array([[num(lp) for lp, _ in alts] for alts in result.output_top_logprobs], np.float64)
    ids = np.array([[t for _, t in alts] for alts in result.output_top_logprobs])
    return chosen, top, ids


def hf_log_softmax(prompt: list[int], output: list[int]) -> np.ndarray:
    """HF transformers' log_softmax [N, V] of its logits at the positions that chose `output`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(FIXTURES / TARGET, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1]
    return torch.log_softmax(logits.double(), dim=-1).numpy()


@pytest.fixture(scope="module")
def greedy():
    return {m: generate(m) for m in ("ar", "dflash", "ddtree")}


def test_greedy_equal_to_hf(greedy):
    for prompt, r in zip(golden_prompts(TARGET), greedy["ar"], strict=True):
        ref = hf_log_softmax(prompt, r.output_ids)
        chosen, top, ids = arrays(r)
        assert [t for _, t in r.output_token_logprobs] == r.output_ids
        np.testing.assert_allclose(chosen, ref[np.arange(len(ref)), r.output_ids], atol=1e-4)
        np.testing.assert_allclose(top, -np.sort(-ref, axis=-1)[:, :K], atol=1e-4)
        np.testing.assert_allclose(np.take_along_axis(ref, ids, axis=-1), top, atol=1e-4)
        assert (ids[:, 0] == r.output_ids).all()  # greedy: the chosen token is the top one


def assert_same(a, b):
    assert a.output_ids == b.output_ids
    ca, ta, ia = arrays(a)
    cb, tb, ib = arrays(b)
    np.testing.assert_allclose(ca, cb, atol=1e-4)
    np.testing.assert_allclose(ta, tb, atol=1e-4)  # (NaN, i.e. -inf, in the same places)
    assert (ia == ib).all()


def test_greedy_equal_across_methods(greedy):
    for method in ("dflash", "ddtree"):
        for a, b in zip(greedy["ar"], greedy[method], strict=True):
            assert_same(a, b)
    assert any(max(r.acceptance_lengths) > 1 for r in greedy["ddtree"])  # rounds accepted several


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_sampled_equal_across_methods_and_to_hf(mode):
    ar = generate("ar", SAMPLED, mode)
    ddtree = generate("ddtree", SAMPLED, mode)
    for a, b in zip(ar, ddtree, strict=True):
        assert_same(a, b)
    for prompt, r in zip(golden_prompts(TARGET), ar, strict=True):
        ref = hf_log_softmax(prompt, r.output_ids)
        if mode == "processed":
            ref = processed_reference(ref)
        chosen, top, _ = arrays(r)
        np.testing.assert_allclose(chosen, ref[np.arange(len(ref)), r.output_ids], atol=1e-4)
        ref_top = -np.sort(-ref, axis=-1)[:, :K]
        np.testing.assert_allclose(top, np.where(np.isfinite(ref_top), ref_top, np.nan), atol=1e-4)


def processed_reference(logp: np.ndarray) -> np.ndarray:
    """HF's order on the raw log-probs [N, V] in NumPy: temperature, top-k, then top-p over the
    renormalised survivors (the smallest set of mass >= top_p), renormalised; dropped: -inf."""
    x = logp / SAMPLED["temperature"]
    kth = -np.sort(-x, axis=-1)[:, SAMPLED["top_k"] - 1 : SAMPLED["top_k"]]
    x = np.where(x >= kth, x, -np.inf)
    out = np.full_like(x, -np.inf)
    for i, row in enumerate(x):
        p = np.exp(row - row.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        need = np.searchsorted(np.cumsum(p[order]), SAMPLED["top_p"]) + 1
        keep = order[:need]
        out[i, keep] = row[keep] - np.log(np.exp(row[keep] - row.max()).sum()) - row.max()
    return out


def test_node_logprobs_vocab_split_equal_unsplit():
    """On a "model" axis of 2 devices (vocabulary split) the values and ids equal one device's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from ddtree_jax.sharding import make_mesh

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 3, 64)) * 3, jnp.float32)
    choice = jnp.asarray(rng.integers(0, 64, size=(2, 3)), jnp.int32)
    sampling = SamplingArrays.from_rows([SAMPLED, {**SAMPLED, "temperature": 0.0}])
    mesh = make_mesh(tp=2, dp=1)  # ("data", "model") of 1 x 2
    for mode in ("raw", "processed"):
        one = node_logprobs(logits, choice, sampling, K, mode)
        split = jax.jit(jax.shard_map(
            lambda x, c, s, mode=mode: node_logprobs(x, c, s, K, mode, "model"),
            mesh=mesh, in_specs=(P(None, None, "model"), P(), P()), out_specs=P(), check_vma=False),
        )(logits, choice, sampling)  # fmt: skip
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(split), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def cli_run(tmp_path, records: list[dict], *flags: str) -> tuple[int, object]:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "o.jsonl"
    argv = ["--target", str(FIXTURES / TARGET), "--prompts", str(path), "--out", str(out)]
    return main([*argv, "--dtype", "float32", "--max-new-tokens", "6", *flags]), out


def cli_lines(tmp_path, records: list[dict], *flags: str) -> list[dict]:
    rc, out = cli_run(tmp_path, records, *flags)
    assert rc == 0
    return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["id"])


def test_cli_lines_and_per_prompt_k(tmp_path, greedy):
    """--logprobs 3: every line carries 6 tokens' [logprob, id] and 3 alternatives each (a line's own
    `logprobs` 1 keeps one, 0 none) equal to the engine's; off, no line has them."""
    prompts = golden_prompts(TARGET)[:3]
    records = [{"id": i, "input_ids": p} for i, p in enumerate(prompts)]
    records[1]["logprobs"], records[2]["logprobs"] = 1, 0
    lines = cli_lines(tmp_path, records, "--logprobs", "3")
    for line, k, r in zip(lines, (3, 1), greedy["ar"], strict=False):
        assert [t for _, t in line["output_token_logprobs"]] == line["output_ids"] == r.output_ids[:6]
        np.testing.assert_allclose(
            np.array(line["output_token_logprobs"]), r.output_token_logprobs[:6], atol=1e-5
        )  # (other rows in the batch: float rounding apart)
        assert np.array(line["output_top_logprobs"]).shape == (6, k, 2)
        np.testing.assert_allclose(
            np.array(line["output_top_logprobs"]), np.array(r.output_top_logprobs[:6])[:, :k], atol=1e-5
        )
    assert "output_token_logprobs" not in lines[2]
    off = cli_lines(tmp_path, records[:1], "--overwrite")
    assert not any("logprobs" in key for key in off[0])
    assert off[0]["output_ids"] == lines[0]["output_ids"]


@pytest.mark.parametrize(
    "record, flags, needle",
    [
        (
            {"logprobs": 4},
            ("--logprobs", "3"),
            "p.jsonl:1: logprobs 4 exceeds the run's --logprobs 3",
        ),
        ({"logprobs": -1}, ("--logprobs", "3"), "'logprobs' must be an integer >= 0, got -1"),
        ({}, ("--logprobs", "-2"), "--logprobs must be >= 0, got -2"),
    ],
)
def test_bad_logprobs(tmp_path, capsys, record, flags, needle):
    rc, out = cli_run(tmp_path, [{"id": 0, "input_ids": [1, 2], **record}], *flags)
    assert rc == 1
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_bad_sampling_params_logprobs():
    with pytest.raises(DDTreeError, match=r"SamplingParams\(logprobs=...\) must be an integer >= 0"):
        SamplingParams(logprobs=-1)


def test_api_sampling_params_logprobs(greedy):
    """LLM(logprobs=2): SamplingParams(logprobs=1) keeps one alternative, the default two; a K above
    the LLM's is refused."""
    llm = LLM(FIXTURES / TARGET, dtype="float32", max_new_tokens=4, logprobs=2)
    prompts = golden_prompts(TARGET)[:2]
    one, two = llm.results(prompts, [SamplingParams(logprobs=1), SamplingParams()])
    for res, k, ref in zip((one, two), (1, 2), greedy["ar"], strict=False):
        assert res.output_ids == ref.output_ids[:4]
        np.testing.assert_allclose(
            np.array(res.output_top_logprobs), np.array(ref.output_top_logprobs[:4])[:, :k], atol=1e-5
        )
    with pytest.raises(DDTreeError, match=r"^prompt 0: SamplingParams\(logprobs=3\) needs an LLM made"):
        llm.results(prompts[:1], SamplingParams(logprobs=3))


def test_on_a_mesh_equal_to_one_device(greedy):
    """tp 2 x dp 2 (vocabulary and rows split; the state's log-probabilities by rows): the values of one
    device."""
    prompts = golden_prompts(TARGET)[:4]
    results = run(TARGET, prompts, max_new_tokens=16, logprobs=K, tp=2, dp=2, batch_size=4)
    for a, b in zip(greedy["ar"], results, strict=False):
        assert_same(a, b)
