"""vLLM's offline API: a typical vLLM script runs with only its import line changed (on the bundled
pair), its results shaped as vLLM's RequestOutput; vLLM's names mean what they mean there (seed,
speculative_config, max_tokens, stop_token_ids, skip_special_tokens, logprobs); what this engine does
not do is refused by name, and a misspelt keyword argument gets a "did you mean"."""

import contextlib
import io
import runpy

import pytest
from conftest import FIXTURES, golden_prompts

from ddtree_jax import LLM, SamplingParams
from ddtree_jax.api import UnknownArgument
from ddtree_jax.errors import DDTreeError
from ddtree_jax.settings import BUNDLED

TARGET, DRAFT = BUNDLED / "target", BUNDLED / "draft"
FIXTURE = str(FIXTURES / "qwen3_gqa4_tp")

# vLLM's examples/offline_inference/basic/basic.py as users write it; only the import line differs.
SCRIPT = """
from ddtree_jax import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=7)


def main():
    llm = LLM(model=MODEL, dtype="auto", seed=0, tensor_parallel_size=1, max_model_len=512)
    outputs = llm.generate(prompts, sampling_params)
    print("\\nGenerated Outputs:\\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)
    return llm, outputs


RESULT = main()
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm") / "basic.py"
    path.write_text(SCRIPT.replace("MODEL", repr(str(TARGET))))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        llm, outputs = runpy.run_path(str(path))["RESULT"]
    return llm, outputs, printed.getvalue()


def test_a_vllm_script_runs_with_its_import_changed(script):
    llm, outputs, printed = script
    prompts = ["Hello, my name is", "The president of the United States is"]
    assert [o.prompt for o in outputs[:2]] == prompts and [o.request_id for o in outputs] == list("0123")
    for o in outputs:
        (c,) = o.outputs
        assert c.index == 0 and 1 <= len(c.token_ids) <= 12 and c.finish_reason in ("stop", "length")
        # the text is the tokens' text, special tokens skipped (vLLM's default)
        assert c.text == llm.codec.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert o.prompt_token_ids == llm.prompts(o.prompt)[0].input_ids
        assert c.logprobs is None and c.cumulative_logprob is None and o.finished
        assert sum(c.acceptance_lengths) == len(c.token_ids) - 1 and c.rounds == len(c.acceptance_lengths)
    # the same run through stream's Results: generate is stream's samples, grouped and shaped
    again = llm.results(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=7))
    assert [r.output_ids for r in again] == [o.outputs[0].token_ids for o in outputs[:2]]
    assert f"Output:    {outputs[3].outputs[0].text!r}" in printed


def test_speculative_config_and_seed_mean_what_they_mean_in_vllm(script):
    """LLM(seed=S) seeds the prompts whose SamplingParams set no seed; speculative_config's ddtree (the
    bundled drafter, num_speculative_tokens = budget) samples the same tokens as ar under that seed."""
    ar, _, _ = script
    spec = {"method": "ddtree", "model": str(DRAFT), "num_speculative_tokens": 7}
    tree = LLM(model=str(TARGET), speculative_config=spec, seed=3, max_new_tokens=12)
    assert tree.settings.method == "ddtree" and tree.settings.budget == 7 and tree.settings.seed == 3
    prompts = ["def fib(n):", "The capital of France is"]
    unseeded = tree.generate(prompts, SamplingParams(temperature=0.9, max_tokens=10, n=2), use_tqdm=False)
    seeded = ar.generate(prompts, SamplingParams(temperature=0.9, seed=3, max_tokens=10, n=2), use_tqdm=False)
    got = [[c.token_ids for c in o.outputs] for o in unseeded]
    assert got == [[c.token_ids for c in o.outputs] for o in seeded]
    assert [[c.index for c in o.outputs] for o in unseeded] == [[0, 1], [0, 1]]
    assert got[0][0] != got[0][1]  # two samples
    assert any(a > 1 for o in unseeded for c in o.outputs for a in c.acceptance_lengths)  # it speculated


def test_stop_token_ids_cut_the_output(script):
    llm, outputs, _ = script
    ids = outputs[0].outputs[0].token_ids
    stop = ids[3]
    first = ids.index(stop)
    (cut,) = llm.generate(
        "Hello, my name is",
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=7, stop_token_ids=[stop]),
        use_tqdm=False,
    )
    c = cut.outputs[0]
    assert c.token_ids == ids[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop
    assert sum(c.acceptance_lengths) == first  # the rounds cut with the tokens


def test_chat_applies_the_template():
    """vLLM's chat: one conversation (OpenAI's text content parts too), the template applied."""
    llm = LLM(model=str(FIXTURES / "qwen3_gqa2_tied"), dtype="float32", max_new_tokens=4)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello, my name is"}]}]
    (chat,) = llm.chat(messages, SamplingParams(max_tokens=4), use_tqdm=False)
    plain = [{"role": "user", "content": "Hello, my name is"}]
    assert chat.prompt == llm.codec.render_chat(plain) != "Hello, my name is"  # the template applied
    assert chat.prompt_token_ids == llm.prompts([plain])[0].input_ids and len(chat.outputs[0].token_ids) == 4


def test_logprobs_in_vllms_shape():
    llm = LLM(FIXTURE, dtype="float32", max_new_tokens=4, logprobs=2)
    prompt = golden_prompts("qwen3_gqa4_tp")[0]
    (ref,) = llm.results([prompt], SamplingParams(logprobs=2))
    (two,), (zero,) = (llm.generate([prompt], SamplingParams(logprobs=k), use_tqdm=False) for k in (2, 0))
    c = two.outputs[0]
    assert c.token_ids == ref.output_ids and c.text == "" and two.prompt is None  # no tokenizer: no text
    for lps, (chosen, token), top in zip(
        c.logprobs, ref.output_token_logprobs, ref.output_top_logprobs, strict=True
    ):
        assert {t: (lp.logprob, lp.rank) for t, lp in lps.items() if lp.rank is not None} == {
            t: (lp, r + 1) for r, (lp, t) in enumerate(top)
        }
        assert lps[token].logprob == chosen
    assert c.cumulative_logprob == pytest.approx(sum(lp for lp, _ in ref.output_token_logprobs))
    # vLLM's logprobs=0: the chosen token's only
    assert [list(d) for d in zero.outputs[0].logprobs] == [[t] for _, t in ref.output_token_logprobs]


@pytest.mark.parametrize(
    "make,error,needle",
    [
        (lambda: SamplingParams(max_token=5), UnknownArgument, "'max_token' .did you mean max_tokens"),
        (lambda: SamplingParams(temprature=1), UnknownArgument, "did you mean temperature"),
        (
            lambda: SamplingParams(presence_penalty=0.5),
            DDTreeError,
            r"presence_penalty=0.5\) is not supported: pen",
        ),
        (lambda: SamplingParams(repetition_penalty=1.2), DDTreeError, "repetition_penalty=1.2"),
        (lambda: SamplingParams(min_tokens=3), DDTreeError, r"min_tokens=3\) is not supported"),
        (lambda: SamplingParams(ignore_eos=1), DDTreeError, r"ignore_eos=...\) must be True or False"),
        (lambda: SamplingParams(guided_decoding={"json": {}}), DDTreeError, "guided"),
        (lambda: SamplingParams(max_tokens=3, max_new_tokens=4), DDTreeError, "one setting"),
        (lambda: LLM(FIXTURE, tensor_parallel_sizes=1), UnknownArgument, "did you mean tensor_parallel_size"),
        (
            lambda: LLM(FIXTURE, max_tokens=8),
            UnknownArgument,
            "did you mean max_new_tokens. max_tokens is vLLM",
        ),
        (
            lambda: LLM(model=FIXTURE, tensor_parallel_size=0),
            DDTreeError,
            "^tensor_parallel_size must be >= 1",
        ),
        (lambda: LLM(model=FIXTURE, target=FIXTURE), DDTreeError, "one setting"),
        (lambda: LLM(model=FIXTURE, speculative_config={"method": "eagle"}), DDTreeError, "'eagle'"),
        (
            lambda: LLM(model=FIXTURE, speculative_config={"num_spec_tokens": 3}),
            UnknownArgument,
            "num_specul",
        ),
        (lambda: LLM(model=FIXTURE, max_model_len=10**9), DDTreeError, "max_model_len 1000000000 exceeds"),
        (lambda: LLM(model=FIXTURE, dtype="float16"), DDTreeError, "dtype"),
    ],
)
def test_refusals_name_the_keyword_argument(make, error, needle):
    with pytest.raises(error, match=needle) as e:
        make()
    assert "--" not in str(e.value)


def test_logprobs_past_the_llms_name_the_keyword():
    llm = LLM(model=FIXTURE, dtype="float32", max_new_tokens=4)
    with pytest.raises(
        DDTreeError, match=r"^prompt 0: SamplingParams\(logprobs=0\) needs an LLM made with logprobs=1"
    ):
        llm.generate([[1, 2]], SamplingParams(logprobs=0), use_tqdm=False)


def test_penalties_at_their_off_values_are_accepted():
    s = SamplingParams(presence_penalty=0.0, repetition_penalty=1.0, min_tokens=0, top_k=-1, best_of=1)
    assert s.top_k == 0 and s.options()["top_k"] == 0
    # ignore_eos is the prompts line's option (the row runs on past the stop ids: test_job.py)
    assert SamplingParams(ignore_eos=True).options()["ignore_eos"] is True
    assert "ignore_eos" not in SamplingParams().options()


def test_generate_keyword_errors_and_max_model_len():
    llm = LLM(model=FIXTURE, dtype="float32", max_new_tokens=4, max_model_len=40)
    prompt = golden_prompts("qwen3_gqa4_tp")[0]
    with pytest.raises(UnknownArgument, match="did you mean sampling_params"):
        llm.generate([prompt], sampling_param=SamplingParams())
    with pytest.raises(
        DDTreeError, match=r"^prompt 1: 39 tokens \+ max_new_tokens 4 exceed LLM\(max_model_len=40\)"
    ):
        llm.generate([prompt, [1] * 39], use_tqdm=False)
    assert llm.generate([], use_tqdm=False) == []
    (out,) = llm.generate({"prompt_token_ids": prompt}, use_tqdm=False)
    assert out.prompt_token_ids == prompt and len(out.outputs[0].token_ids) == 4
