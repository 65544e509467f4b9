"""Continuous batching and chunked prefill: the same tokens as static batches and one-prompt runs."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import golden, golden_prompts, load_drafter, load_target, run

from ddtree_jax import engine, scheduling
from ddtree_jax.engine import Plan
from ddtree_jax.generation import Generator
from ddtree_jax.prompts import Prompt
from ddtree_jax.sampling import GREEDY
from ddtree_jax.scheduling import Schedule

TP = "qwen3_gqa4_tp"
DRAFT = "dflash_qwen3_gqa4_tp"
# mixed lengths (1 to 40 tokens): more prompts than rows, so rows are refilled
PROMPTS = golden_prompts(TP) + [[7, 9, 11], list(range(200, 240)), [42] * 9, [5, 6]]


def generator(method="ddtree", budget=7, batch_size=3, max_new_tokens=24, stop_ids=(), sampling=None, **kw):
    cfg, params = load_target(TP)
    dcfg, dparams = load_drafter(DRAFT) if method != "ar" else (None, None)
    plan = Plan(
        target=cfg,
        draft=dcfg,
        method=method,
        batch_size=batch_size,
        prompt_len=16,
        max_new_tokens=max_new_tokens,
        budget=budget,
        branching=min(budget, 32) if method == "ddtree" else 1,
    )
    return Generator(
        params, dparams, plan, tuple(stop_ids), sampling=GREEDY | (sampling or {}), schedule=Schedule(**kw)
    )


def stream(prompts, **kw):
    """Results of `Generator.stream` in prompt order, and the generator (compiled programs are shared
    by generators of the same plan: generation.STREAM_PROGRAMS)."""
    gen = generator(**kw)
    items = [Prompt(i, i + 1, p, {}) for i, p in enumerate(prompts)]
    by_id = {r.id: r for r in gen.stream(items)}
    assert sorted(by_id) == list(range(len(prompts)))
    return [by_id[i] for i in range(len(prompts))], gen


def ids(results):
    return [r.output_ids for r in results]


@pytest.fixture(scope="module")
def static_ar():
    return ids(run(TP, PROMPTS, batch_size=len(PROMPTS)))


def test_ar_stream_matches_hf_greedy():
    results, gen = stream(golden_prompts(TP), method="ar", budget=0, batch_size=2, chunk=16)
    assert ids(results) == [golden(TP)[f"greedy_{i}"].tolist() for i in range(5)]
    assert gen.stream_rows(5) == 2 and gen.occupancy.refills >= 3


@pytest.mark.parametrize("batch_size,chunk", [(3, 16), (1, 32)])
def test_ddtree_stream_equals_static_ar(static_ar, batch_size, chunk):
    # a 40-token prompt after short ones: the cache capacity grows mid-run (prompt slots 32 -> 64)
    results, gen = stream(PROMPTS, batch_size=batch_size, chunk=chunk)
    assert ids(results) == static_ar
    for r in results:
        assert sum(r.acceptance_lengths) + 1 == len(r.output_ids) and r.rounds == len(r.acceptance_lengths)
    assert gen.occupancy.busy == sum(r.rounds for r in results)


def test_stop_ids_and_sampling_equal_one_prompt_at_a_time():
    out = golden(TP)["greedy_2"].tolist()
    kw = dict(stop_ids=[out[10]], sampling={"temperature": 0.8, "top_p": 0.9, "seed": 3}, chunk=16)
    together, gen = stream(PROMPTS, batch_size=4, **kw)
    alone = [stream([p], batch_size=4, **kw)[0][0] for p in PROMPTS[2:4]]  # 12 and 17 tokens
    assert ids(together)[2:4] == ids(alone)
    assert any(r.finish_reason == "stop" for r in together)
    static = run(TP, PROMPTS, method="ar", stop_ids=kw["stop_ids"], sampling=kw["sampling"])
    assert ids(together) == ids(static)


# each prompt's own max_new_tokens (None: the run's 24; 1 finishes at the prefill's token), on prompts
# of at most 16 tokens (the runs alone share programs); prompts 5 and 8 sample (seeded), others are greedy
LIMITS = [5, None, 1, None, None, 9, None, 1, 5]
SAMPLED = {5, 8}


def test_own_max_new_tokens_equal_runs_alone():
    """Each row stops at its prompt's own limit, in the stream (refills at batch 4) and in a static
    batch, with the tokens of an ar run of the prompt alone at --max-new-tokens = that limit."""
    seeded = {"temperature": 0.8, "top_p": 0.9, "seed": 3}
    options = [
        ({} if n is None else {"max_new_tokens": n}) | (seeded if i in SAMPLED else {})
        for i, n in enumerate(LIMITS)
    ]
    gen = generator(batch_size=4, chunk=16)  # the programs of test_stop_ids_and_sampling_...
    items = [Prompt(i, i + 1, p, o) for i, (p, o) in enumerate(zip(PROMPTS, options, strict=True))]
    by_id = {r.id: r for r in gen.stream(items)}
    streamed = [by_id[i] for i in range(len(PROMPTS))]
    static = run(TP, PROMPTS, method="ar", options=options)
    for i, n in enumerate(LIMITS):
        r = streamed[i]
        assert len(r.output_ids) == (n or 24) and r.finish_reason == "length"
        assert r.output_ids == static[i].output_ids
        if n is not None:  # (the run's own limit: test_ddtree_stream_equals_static_ar)
            alone = run(TP, [PROMPTS[i]], max_new_tokens=n, options=[options[i]])[0]
            assert r.output_ids == alone.output_ids, i
    with pytest.raises(ValueError, match="max_new_tokens 25 is not in"):
        list(gen.stream([Prompt(0, 1, [1, 2], {"max_new_tokens": 25})]))


def test_never_more_rows_than_prompts():
    gen = generator(batch_size=1000)
    assert gen.stream_rows(2) == 2 and gen.stream_rows(5000) == 1000
    assert generator(method="ar", budget=0, batch_size=8).stream_rows(1) == 2  # engine.rows_to_run
    assert generator(batch_size=8, batch_invariant=True).stream_rows(2) == 8


def test_prompt_slots_pad_to_chunks():
    assert [scheduling.prompt_slots(n, 256) for n in (1, 256, 257, 700, 2049)] == [256, 256, 512, 1024, 4096]
    # full chunks of 256 while more than 192 tokens are left, then tail chunks of 64
    got = [scheduling.chunk_steps(n, 256) for n in (3, 64, 65, 192, 193, 256, 300, 3000)]
    assert got == [(0, 1), (0, 1), (0, 2), (0, 3), (1, 0), (1, 0), (1, 1), (11, 3)]
    for n in range(1, 2000, 7):  # every prompt is covered, with fewer than 64 padding tokens
        full, tails = scheduling.chunk_steps(n, 256)
        assert n <= full * 256 + tails * 64 < n + 64 and tails <= 3
    assert scheduling.chunk_steps(40, 16) == (3, 0)


def test_chunked_prefill_equals_one_pass(method="ddtree"):
    """A 900-token prompt in chunks of 128 (7, then a tail chunk of 32) and of 1024 (one) against the
    unchunked prefill; in chunks of 256 with the chunks' attention composed of two flash-attention calls
    (attention.causal_chunk through XLA, what cuDNN runs on CUDA)."""
    cfg, params = load_target(TP)
    dcfg, dparams = load_drafter(DRAFT)
    rng = np.random.default_rng(0)
    lengths = np.array([900, 77], np.int32)
    prompts = np.zeros((2, 1024), np.int32)
    for i, n in enumerate(lengths):
        prompts[i, :n] = rng.integers(0, cfg.vocab_size, n)
    plan = Plan(cfg, dcfg if method != "ar" else None, method, 2, 1024, 8, budget=7, branching=7)
    args = (jnp.asarray(prompts), jnp.asarray(lengths), jnp.ones((2,), bool), jnp.asarray([-1], jnp.int32))
    one = engine.prefill(params, dparams, *args, plan=plan)
    for chunk, impl in ((128, None), (1024, None), (256, "causal-xla")):
        got = scheduling.chunked_prefill(params, dparams, *args, plan=plan, chunk=chunk, attention=impl)
        np.testing.assert_array_equal(got.bonus, one.bonus)
        np.testing.assert_array_equal(got.cache.lengths, one.cache.lengths)
        caches = [(got.cache, one.cache)] + ([(got.draft_cache, one.draft_cache)] if method != "ar" else [])
        for a, b in caches:
            for x, y in zip(jax.tree.leaves(a.layers), jax.tree.leaves(b.layers), strict=True):
                # the committed slots of each row; the composed attention sums in another order (float32
                # noise of 2e-5 on entries of magnitude 5 after 900 tokens)
                tol = 2e-5 if impl is None else 1e-4
                for row, n in enumerate(lengths):
                    np.testing.assert_allclose(x[row, :, :n], y[row, :, :n], rtol=tol, atol=tol)


def test_batch_invariant_bf16_layouts_of_the_bundled_prompts():
    """bfloat16, batch-invariant: each bundled prompt's tokens are the same in every batch layout."""
    from pathlib import Path

    from ddtree_jax import drafter, target
    from ddtree_jax.sharding import make_mesh, param_sharding
    from ddtree_jax.text import TextCodec

    pair = Path(__file__).parent.parent / "ddtree_jax" / "assets" / "default_pair"
    place = param_sharding(make_mesh(1, 1))
    cfg, params = target.load(pair / "target", jnp.bfloat16, place)
    dcfg, dparams = drafter.load(pair / "draft", cfg, jnp.bfloat16, place)
    codec = TextCodec(pair / "target")
    texts = [json.loads(line)["prompt"] for line in (pair / "prompts.jsonl").read_text().splitlines()]
    prompts = [Prompt(i, i + 1, codec.encode(t, add_special_tokens=False), {}) for i, t in enumerate(texts)]

    def outputs(order, batch_size):
        plan = Plan(cfg, dcfg, "ddtree", batch_size, 16, 16, budget=15, branching=15)
        gen = Generator(
            params, dparams, plan, cfg.eos_token_ids, schedule=Schedule(chunk=64, batch_invariant=True)
        )
        return {r.id: r.output_ids for r in gen.stream([prompts[i] for i in order])}

    n = len(prompts)
    first = outputs(range(n), 4)
    assert outputs(range(n - 1, -1, -1), 3) == first  # other neighbours, other rows, other join times
    assert outputs([5, 2], 1) == {i: first[i] for i in (5, 2)}


def test_stream_on_a_mesh_equals_one_device(static_ar):
    """tp 2 x dp 2 (fake CPU devices): the same tokens as one device, each row to its own limit."""
    cfg, params = load_target(TP, tp=2, dp=2)
    dcfg, dparams = load_drafter(DRAFT, tp=2, dp=2)
    plan = Plan(cfg, dcfg, "ddtree", 4, 16, 24, budget=7, branching=7, tp=2, dp=2)
    gen = Generator(params, dparams, plan, (), schedule=Schedule(chunk=16))
    limits = [n or 24 for n in LIMITS]
    items = [
        Prompt(i, i + 1, p, {"max_new_tokens": n})
        for i, (p, n) in enumerate(zip(PROMPTS, limits, strict=True))
    ]
    by_id = {r.id: r.output_ids for r in gen.stream(items)}
    assert [by_id[i] for i in range(len(PROMPTS))] == [o[:n] for o, n in zip(static_ar, limits, strict=True)]


def test_causal_chunk_equals_the_reference():
    """attention.causal_chunk (XLA) against the jnp tree attention under a causal mask: empty and
    partly filled caches, GQA."""
    from ddtree_jax.attention import causal_chunk
    from ddtree_jax.kernels.tree_attention import tree_attention_reference

    rng = np.random.default_rng(0)
    b, t, hq, hkv, d, s = 3, 8, 4, 2, 16, 32

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    q, k_new, v_new = normal(b, t, hq, d), normal(b, t, hkv, d), normal(b, t, hkv, d)
    k_cache, v_cache = normal(b, hkv, s, d), normal(b, hkv, s, d)
    lengths = jnp.asarray([0, 13, s], jnp.int32)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    with jax.default_matmul_precision("highest"):
        got = causal_chunk(q, k_cache, v_cache, lengths, k_new, v_new, mask, implementation="xla")
        want = tree_attention_reference(q, k_cache, v_cache, lengths, k_new, v_new, mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_causal_chunk_lowers_for_cuda(monkeypatch):
    """The cuDNN variant lowers for CUDA on a CPU host (Qwen3-8B heads, bf16), two fused attention
    calls (prefix: padding mask; chunk: causal). jax probes the cuDNN version and the GPU's compute
    capability while tracing, which needs a GPU: the probes answer as on an H200 with cuDNN 9.10."""
    import jax._src.cudnn.fused_attention_stablehlo as fused

    from ddtree_jax import attention

    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fused, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(fused, "is_cuda_compute_capability_equal", lambda capability: False)
    b, t, hq, hkv, d, s = 1, 128, 32, 8, 128, 1024
    bf16 = jnp.bfloat16
    shapes = [(b, t, hq, d), (b, hkv, s, d), (b, hkv, s, d), (b,), (b, t, hkv, d), (b, t, hkv, d), (b, t, t)]
    dtypes = [bf16, bf16, bf16, jnp.int32, bf16, bf16, bool]
    args = [jax.ShapeDtypeStruct(x, y) for x, y in zip(shapes, dtypes, strict=True)]
    fn = jax.jit(attention.kernel("causal-cudnn"))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__cudnn$fmhaSoftmax") == 2
    assert "\\22PADDING\\22" in text and "\\22CAUSAL\\22" in text


def test_prefill_attention_choice():
    """cuDNN (when asked) for bf16 GQA chunks on CUDA only; the plan's implementation on CPU, in
    float32, for MLA or when batch-invariant; a schedule may name one."""
    from ddtree_jax import attention

    assert attention.prefill_implementation("reference", jnp.bfloat16, 128, False) == "reference"  # CPU
    gen = generator()
    assert gen.prefill_attention(dataclasses.replace(gen.plan_template, attention="pallas")) == "pallas"
    gen.schedule = Schedule(prefill_attention="cudnn")  # on the CPU: the plan's
    assert gen.prefill_attention(dataclasses.replace(gen.plan_template, attention="pallas")) == "pallas"
    gen.schedule = Schedule(prefill_attention="causal-xla")
    assert gen.prefill_attention(gen.plan_template) == "causal-xla"
