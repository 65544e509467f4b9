"""The Python API (ddtree_jax.LLM, SamplingParams): examples/generate.py on the fixture pair gives the
lines ddtree-generate writes for the same prompts, a second call compiles nothing new, options and
sampling settings are checked as the CLI checks its flags, and n seeded samples per prompt are
ar's samples under the seeds `sample_seed` documents."""

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import FIXTURES, golden_prompts, timeless

from ddtree_jax import LLM, SamplingParams
from ddtree_jax.cli import main
from ddtree_jax.errors import DDTreeError
from ddtree_jax.scheduler import sample_seed

ROOT = Path(__file__).parent.parent
TARGET, DRAFT = str(FIXTURES / "qwen3_gqa4_tp"), str(FIXTURES / "dflash_qwen3_gqa4_tp")
KEYS = ("index", "output_ids", "finish_reason", "prompt_tokens", "num_output_tokens", "rounds")
KEYS += ("acceptance_lengths",)


def example():
    spec = importlib.util.spec_from_file_location("example_generate", ROOT / "examples" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cli_lines(tmp_path, prompts: list[list[int]], *flags: str) -> list[dict]:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": i, "input_ids": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "o.jsonl"
    argv = ["--target", TARGET, "--prompts", str(path), "--out", str(out), "--dtype", "float32", *flags]
    assert main(argv) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return sorted(lines, key=lambda r: (r["id"], r["index"]))


def test_example_equals_the_cli_and_a_second_call_compiles_nothing(tmp_path, capsys):
    prompts = golden_prompts("qwen3_gqa4_tp")[:3]
    ids = [f"--input-ids={','.join(map(str, p))}" for p in prompts]
    sampled = ["--temperature", "0.8", "--seed", "3", "--n", "2", "--max-new-tokens", "12"]
    pair = ["--target", TARGET, "--draft", DRAFT, "--dtype", "float32"]
    llm, results = example().main([*pair, *ids, *sampled])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == [r.to_json() for r in results]
    assert [(r.id, r.index) for r in results] == [(i, j) for i in range(3) for j in range(2)]
    flags = ["--draft", DRAFT, "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "3", "--n", "2"]
    lines = cli_lines(tmp_path, prompts, *flags)
    assert [{k: line[k] for k in KEYS} for line in lines] == [{k: r[k] for k in KEYS} for r in printed]
    assert all(r["prompt_tokens"] == len(prompts[r["id"]]) and r["e2e_latency"] > 0 for r in printed)
    # a second call with other sampling values on the same shapes (rows, prompt slots) compiles nothing
    compiled = list(llm.compile_log)
    again = llm.results(prompts, SamplingParams(temperature=0.5, top_k=9, seed=9, max_new_tokens=5, n=2))
    assert llm.compile_log == compiled
    assert [len(r.output_ids) for r in again] == [5] * 6


def test_prompt_forms_and_per_prompt_sampling():
    """Token ids, one prompt or a list, one SamplingParams or one per prompt; bad input refused."""
    llm = LLM(TARGET, dtype="float32", max_new_tokens=6, batch_size=2)
    prompts = golden_prompts("qwen3_gqa4_tp")[:2]
    one = llm.results(prompts[0])
    both = llm.results(prompts, [SamplingParams(), SamplingParams(max_new_tokens=3)])
    assert [r.output_ids for r in one] == [both[0].output_ids]
    assert len(both[1].output_ids) == 3 and both[1].finish_reason == "length"
    with pytest.raises(DDTreeError, match=r"^prompt 1: SamplingParams\(max_new_tokens=7\) exceeds LLM\("):
        llm.results([prompts[0], prompts[1]], [SamplingParams(), SamplingParams(max_new_tokens=7)])
    with pytest.raises(DDTreeError, match=r"^prompt 0: SamplingParams\(max_tokens=7\) exceeds LLM\(max_new"):
        llm.generate(prompts, SamplingParams(max_tokens=7))
    with pytest.raises(DDTreeError, match="^prompt 0: 'prompt' needs a tokenizer.json"):
        llm.generate("text needs a tokenizer")
    with pytest.raises(DDTreeError, match="2 SamplingParams for 1 prompts"):
        llm.generate([prompts[0]], [SamplingParams()] * 2)
    with pytest.raises(DDTreeError, match="^prompt 0: expected text, token ids"):
        llm.generate([[1.5]])
    with pytest.raises(DDTreeError, match=r"^prompt 0: \d+ tokens \+ LLM\(max_new_tokens=6\) exceed"):
        llm.generate([[1] * 100_000])


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: SamplingParams(temperature=-1), r"^SamplingParams\(temperature=...\) must be >= 0"),
        (lambda: SamplingParams(top_p=0), r"^SamplingParams\(top_p=...\) must be in"),
        (lambda: SamplingParams(seed=2**32), r"^SamplingParams\(seed=...\) must be in"),
        (lambda: SamplingParams(n=0), r"^SamplingParams\(n=...\) must be a positive integer"),
        (lambda: SamplingParams(max_new_tokens=0), r"^SamplingParams\(max_new_tokens=...\) must be a posi"),
        (lambda: SamplingParams(max_tokens=0), r"^SamplingParams\(max_tokens=...\) must be a positive"),
        (lambda: LLM(TARGET, method="dflash"), "^method dflash needs draft DIR$"),
        (lambda: LLM(TARGET, DRAFT, method="ar"), "^draft applies to method dflash and ddtree"),
        (lambda: LLM(TARGET, tp=0), "^tp must be >= 1"),
        (lambda: LLM(TARGET, budget=0), "^budget must be >= 1, got 0$"),
        (lambda: LLM(TARGET, DRAFT, block_size=99), r"^LLM\(block_size=99\) exceeds the drafter's"),
        (lambda: LLM(TARGET, prefill_chunk=24), "^prefill_chunk must be a power of two"),
    ],
)
def test_checks_are_the_clis_in_the_apis_words(make, needle):
    """The CLI's checks, their errors naming keyword arguments, never flags."""
    with pytest.raises(DDTreeError, match=needle) as e:
        make()
    assert "--" not in str(e.value)


def test_sampling_defaults_are_the_clis():
    from ddtree_jax.cli import build_parser

    flags = build_parser().parse_args(["--out", "-"])
    s = SamplingParams()
    assert (s.temperature, s.top_k, s.top_p, s.n) == (flags.temperature, flags.top_k, flags.top_p, flags.n)
    assert s.seed is None  # the LLM's seed (LLM(seed=), default ddtree-generate's --seed)


def test_n_samples_equal_ar_per_index_and_the_seeds_documented():
    """n = 3 seeded samples: ddtree's equal ar's index by index, sample i equals a run of the prompt
    alone seeded sample_seed(seed, i), and sample 0 is the n = 1 run."""
    prompts = golden_prompts("qwen3_gqa4_tp")[:2]
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=11, n=3)
    kw = dict(dtype="float32", max_new_tokens=10, batch_size=4)
    ar_llm = LLM(TARGET, **kw)
    ar = ar_llm.results(prompts, sampling)
    ddtree = LLM(TARGET, DRAFT, budget=7, **kw).results(prompts, sampling)
    assert [(r.id, r.index) for r in ar] == [(i, j) for i in range(2) for j in range(3)]
    assert [r.output_ids for r in ddtree] == [r.output_ids for r in ar]
    assert len({tuple(r.output_ids) for r in ar[:3]}) > 1  # the samples differ
    assert sample_seed(11, 0) == 11 and sample_seed(11, 2) == (11 + 2 * 0x9E3779B9) % 2**32
    alone = ar_llm.results(
        prompts, [SamplingParams(temperature=1.0, top_k=20, seed=sample_seed(11, i)) for i in (0, 2)]
    )
    assert [r.output_ids for r in alone] == [ar[0].output_ids, ar[5].output_ids]


def test_resume_with_n_samples_generates_the_missing_ones(tmp_path):
    """--resume keys each line by (id, index): a file holding some samples of a prompt gets the rest,
    and the whole file then equals an uninterrupted run's."""
    prompts = golden_prompts("qwen3_gqa4_tp")[:2]
    flags = ["--max-new-tokens", "6", "--temperature", "1.0", "--seed", "4", "--n", "3"]
    whole = [timeless(r) for r in cli_lines(tmp_path, prompts, *flags)]
    out = tmp_path / "o.jsonl"
    written = out.read_text().splitlines()
    kept = [written[0], written[4]]
    out.write_text("".join(line + "\n" for line in kept))
    argv = ["--target", TARGET, "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out)]
    assert main([*argv, "--dtype", "float32", *flags, "--resume"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert out.read_text().splitlines()[:2] == kept and len(lines) == 6
    assert [timeless(r) for r in sorted(lines, key=lambda r: (r["id"], r["index"]))] == whole
