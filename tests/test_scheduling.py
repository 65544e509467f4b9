"""Continuous batching and chunked prefill: the same tokens as static batches and one-prompt runs."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import golden, golden_prompts, load_drafter, load_target, run

from ddtree_jax import prefill, programs
from ddtree_jax.engine import MAX_STOP_IDS, Plan
from ddtree_jax.prompts import Prompt
from ddtree_jax.scheduler import Generator, Schedule

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
        max_new_tokens=max_new_tokens,
        budget=budget,
        branching=min(budget, 32) if method == "ddtree" else 1,
    )
    schedule = Schedule(batch_size, **kw)
    return Generator(params, dparams, plan, tuple(stop_ids), defaults=sampling, schedule=schedule)


def stream(prompts, **kw):
    """Results of continuous batching in prompt order, and the generator (compiled programs are shared
    by generators of the same plan and shapes: jax's cache)."""
    gen = generator(**kw)
    items = [Prompt(i, i + 1, p, {}) for i, p in enumerate(prompts)]
    by_id = {r.id: r for r in gen.run(items)}
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
    # the job on the device: two rows, prompts admitted two at a time (the first pass fills both rows)
    assert gen.rows(5) == 2 and gen.loop == "device" and gen.occupancy.prefilled == 5


@pytest.mark.parametrize("batch_size,chunk", [(3, 16), (1, 32)])
def test_ddtree_stream_equals_static_ar(static_ar, batch_size, chunk):
    # prompts of 1 to 40 tokens: the capacity is the 40-token prompt's from the start (64 prompt slots)
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
    by_id = {r.id: r for r in gen.run(items)}
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
        list(gen.run([Prompt(0, 1, [1, 2], {"max_new_tokens": 25})]))


def test_rows_rule():
    """Continuous runs never have more rows than prompts; one ar row runs as two, except for a MoE
    target (its family's rule, whatever the policy); batch-invariant and static runs keep every row."""
    gen = generator(batch_size=1000)
    assert gen.rows(2) == 2 and gen.rows(5000) == 1000
    assert generator(method="ar", budget=0, batch_size=8).rows(1) == 2  # programs.rows_to_run
    assert generator(batch_size=8, batch_invariant=True).rows(2) == 8
    assert generator(batch_size=8, policy="static").rows(2) == 8
    cfg, params = load_target("qwen3_moe_tp")
    for policy in ("continuous", "static"):
        moe = Generator(params, None, Plan(cfg, None, "ar", 8), (), schedule=Schedule(1, policy))
        assert moe.rows(1) == 1, policy


def test_one_bucket_rule_and_chunk_steps():
    assert [programs.prompt_slots(n) for n in (1, 16, 17, 256, 257, 700, 2049)] == [
        16,
        16,
        32,
        256,
        512,
        1024,
        4096,
    ]
    # full chunks of 256 while more than 192 tokens are left, then tail chunks of 64
    got = [prefill.chunk_steps(n, 256) for n in (3, 64, 65, 192, 193, 256, 300, 3000)]
    assert got == [(0, 1), (0, 1), (0, 2), (0, 3), (1, 0), (1, 0), (1, 1), (11, 3)]
    for n in range(1, 2000, 7):  # every prompt is covered, with fewer than 64 padding tokens
        full, tails = prefill.chunk_steps(n, 256)
        assert n <= full * 256 + tails * 64 < n + 64 and tails <= 3
    assert prefill.chunk_steps(40, 16) == (3, 0)


def one_pass_prefill(params, dparams, cfg, dcfg, prompts, lengths):
    """The reference: the whole prompts [B, P] in one causal pass ([P, P] mask, no cache), their
    target and drafter cache entries [B, P, ...] and the greedy first token."""
    from ddtree_jax import drafter, target

    b, p = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    mask = jnp.tril(jnp.ones((p, p), bool))[None] & (positions[:, None, :] < lengths[:, None, None])
    out = target.forward(params, cfg, prompts, positions, mask, None, feature_layers=dcfg.target_layer_ids)
    ctx = drafter.context_kv(dparams, dcfg, out.features, positions)
    logits = target.logits(params, out.hidden[jnp.arange(b), lengths - 1][:, None], cfg.vocab_size)
    return out.kv, ctx, jnp.argmax(logits[:, 0], axis=-1)


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_prefill_equals_one_pass(packed):
    """A 900-token prompt in chunks of 128 (7, then a tail chunk of 32) and of 1024 (one) against one
    causal pass; in chunks of 256 with the chunks' attention composed of two flash-attention calls
    (attention.causal_chunk through XLA, what cuDNN runs on CUDA). In packed pieces (the continuous
    job's passes: pieces of 32 tokens, 2 a step, the 77-token prompt's three after the other's 29, so
    a step holds pieces of both prompts, or two of one) in chunks of 128 only (each prefill program
    compiles in ~10 CPU-s)."""
    cfg, params = load_target(TP)
    dcfg, dparams = load_drafter(DRAFT)
    rng = np.random.default_rng(0)
    lengths = np.array([900, 77], np.int32)
    prompts = np.zeros((2, 1024), np.int32)
    for i, n in enumerate(lengths):
        prompts[i, :n] = rng.integers(0, cfg.vocab_size, n)
    plan = Plan(cfg, dcfg, "ddtree", 8, budget=7, branching=7)
    req = programs.Requests(
        jnp.asarray(prompts), jnp.asarray(lengths), jnp.arange(2, dtype=jnp.int32), None, jnp.full((2,), 8)
    )
    kv, ctx, first = one_pass_prefill(params, dparams, cfg, dcfg, jnp.asarray(prompts), jnp.asarray(lengths))
    stop = jnp.full((MAX_STOP_IDS,), -1, jnp.int32)
    cases = ((128, "reference"), (1024, "reference"), (256, "causal-xla"))
    for chunk, impl in cases[:1] if packed else cases:
        got = prefill.prefill(
            params, dparams, req, stop, plan=plan, rows=2, capacity=1088, chunk=chunk, attention=impl,
            packed=packed,
        )  # fmt: skip
        np.testing.assert_array_equal(got.bonus, first)
        np.testing.assert_array_equal(got.cache.lengths, lengths)
        for cached, new in ((got.cache.layers, kv), (got.draft_cache, ctx)):
            for x, y in zip(jax.tree.leaves(cached), jax.tree.leaves(new), strict=True):
                y = jnp.swapaxes(y, 1, 2)  # in flight [B, T, H, D], cached [B, H, S, D]
                # the committed slots of each row; the chunks and the composed attention sum in another
                # order than one pass (float32 noise up to 2.6e-5, on one element of 28,800, on entries of
                # magnitude 5 after 900 tokens)
                tol = 3e-5 if impl == "reference" else 1e-4
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
        plan = Plan(cfg, dcfg, "ddtree", 16, budget=15, branching=15)
        schedule = Schedule(batch_size, chunk=64, batch_invariant=True)
        gen = Generator(params, dparams, plan, cfg.eos_token_ids, schedule=schedule)
        return {r.id: r.output_ids for r in gen.run([prompts[i] for i in order])}

    n = len(prompts)
    first = outputs(range(n), 4)
    # other neighbours, rows and join times (the same programs); then alone in a batch of one row
    assert outputs(range(n - 1, -1, -1), 4) == first
    assert outputs([5, 2], 1) == {i: first[i] for i in (5, 2)}


def test_stream_on_a_mesh_equals_one_device(static_ar):
    """tp 2 x dp 2 (fake CPU devices): the same tokens as one device, each row to its own limit."""
    cfg, params = load_target(TP, tp=2, dp=2)
    dcfg, dparams = load_drafter(DRAFT, tp=2, dp=2)
    plan = Plan(cfg, dcfg, "ddtree", 24, budget=7, branching=7, tp=2, dp=2)
    gen = Generator(params, dparams, plan, (), schedule=Schedule(4, chunk=16))
    limits = [n or 24 for n in LIMITS]
    items = [
        Prompt(i, i + 1, p, {"max_new_tokens": n})
        for i, (p, n) in enumerate(zip(PROMPTS, limits, strict=True))
    ]
    by_id = {r.id: r.output_ids for r in gen.run(items)}
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
    plan = dataclasses.replace(gen.plan, attention="pallas")
    assert Generator(gen.programs.params, None, plan, ()).prefill_attention() == "pallas"
    on_cpu = Schedule(prefill_attention="cudnn")  # on the CPU: the plan's
    assert Generator(gen.programs.params, None, plan, (), schedule=on_cpu).prefill_attention() == "pallas"
    named = gen.scheduled(prefill_attention="causal-xla")
    assert named.prefill_attention() == "causal-xla" and named.programs.attention == "causal-xla"
