"""Sampling: seed-exact against ar, the target's distribution (G-test), edge cases, invalid settings.

Seed-exact: the noise depends only on (seed, position, token id), so dflash and ddtree must emit the
tokens ar emits under the same settings, token for token (docs/design.md, "Sampling that stays lossless
on a tree"). Sampling settings are traced, so one compiled program per plan serves every setting.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, golden, golden_prompts, load_target, oracle_draft, run
from scipy import stats

from ddtree_jax import sampling, target
from ddtree_jax.cli import main
from ddtree_jax.compare.stats import combined_p_value, position_tests

TP = "qwen3_gqa4_tp"
DRAFT = "dflash_qwen3_gqa4_tp"
PROMPTS8 = golden_prompts(TP) + [[7, 9, 11], [200, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [42] * 9]
GREEDY5 = [golden(TP)[f"greedy_{i}"].tolist() for i in range(5)]

# Per-prompt settings: every feature alone and together, and a greedy row in a sampled batch.
MIXED = [
    {"temperature": 0.7, "top_k": 20, "seed": 1},
    {"temperature": 1.0, "top_p": 0.9, "seed": 2},
    {"temperature": 0.0, "seed": 3},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 4},
    {"temperature": 1.0, "seed": 5},
    {"temperature": 0.7, "top_p": 0.9, "seed": 6},
    {"temperature": 1.0, "top_k": 20, "seed": 7},
    {"temperature": 0.7, "seed": 2**32 - 1},
]
SETTINGS = {
    "mixed": MIXED,
    "t1": [{"temperature": 1.0, "seed": 100 + i} for i in range(8)],
    "t07_k20_p09": [{"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 50 + i} for i in range(8)],
}


def ids(results):
    return [r.output_ids for r in results]


@pytest.fixture(scope="module")
def ar_sampled():
    return {name: ids(run(TP, PROMPTS8, batch_size=5, options=opts)) for name, opts in SETTINGS.items()}


def test_tempered_draft_scores_stay_seed_exact(ar_sampled):
    """Scoring the tree with the drafter at the sampled temperature changes the tree, not the output."""
    for name, opts in SETTINGS.items():
        results = run(
            TP,
            PROMPTS8,
            method="ddtree",
            draft_name=DRAFT,
            budget=7,
            batch_size=5,
            options=opts,
            tempered_draft=True,
        )
        assert ids(results) == ar_sampled[name], name


@pytest.mark.parametrize(
    "method,budget,batch_size,host_stepped",
    [
        ("ar", 0, 1, False),
        ("dflash", 0, 5, False),
        ("ddtree", 1, 5, False),
        ("ddtree", 7, 1, False),
        # budget 7 at batch 5 in one program: test_tempered_draft_scores_stay_seed_exact runs it (its
        # "t1" rows score at temperature 1, as untempered), budgets 1 and 32 run it here (~18 CPU-s)
        ("ddtree", 7, 5, True),
        ("ddtree", 32, 5, False),
    ],
)
def test_seed_exact_against_ar(ar_sampled, method, budget, batch_size, host_stepped):
    draft = None if method == "ar" else DRAFT
    for name, opts in SETTINGS.items():
        results = run(
            TP,
            PROMPTS8,
            method=method,
            draft_name=draft,
            budget=budget,
            batch_size=batch_size,
            options=opts,
            host_stepped=host_stepped,
        )
        assert ids(results) == ar_sampled[name], name
        for r in results:
            assert sum(r.acceptance_lengths) + 1 == len(r.output_ids) == 24
    # the greedy row of the mixed batch is exactly the greedy output
    assert ar_sampled["mixed"][2] == GREEDY5[2]


def test_sampling_differs_from_greedy_and_between_seeds():
    prompts = golden_prompts(TP)
    a = ids(run(TP, prompts, sampling={"temperature": 1.0, "seed": 0}))
    b = ids(run(TP, prompts, sampling={"temperature": 1.0, "seed": 1}))
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert all(x != g for x, g in zip(a, GREEDY5, strict=True))
    # the seed does not matter to greedy rows
    assert ids(run(TP, prompts, sampling={"temperature": 0.0, "seed": 9})) == GREEDY5


def test_request_independent_of_its_batch():
    me = {"temperature": 0.7, "top_k": 20, "seed": 11}
    prompt = PROMPTS8[2]
    alone = ids(run(TP, [prompt], method="ddtree", draft_name=DRAFT, budget=7, batch_size=1, options=[me]))[0]
    for others in (SETTINGS["t1"][1:5], [{"temperature": 0.0}, {"temperature": 2.0, "seed": 11}] * 2):
        batch = [prompt] + PROMPTS8[4:8]
        out = ids(
            run(TP, batch, method="ddtree", draft_name=DRAFT, budget=7, batch_size=5, options=[me, *others])
        )
        assert out[0] == alone
    assert alone == ids(run(TP, [prompt], batch_size=1, options=[me]))[0]


@pytest.mark.parametrize("method,budget", [("ar", 0), ("ddtree", 7)])
def test_limits_equal_greedy(method, budget):
    draft = None if method == "ar" else DRAFT
    prompts = golden_prompts(TP)
    for settings in (
        {"temperature": 1e-5, "seed": 1},  # the fixture's greedy margins are > 1e-3
        {"temperature": 1.0, "top_k": 1, "seed": 2},
        {"temperature": 1.0, "top_p": 1e-6, "seed": 3},
    ):
        out = ids(run(TP, prompts, method=method, draft_name=draft, budget=budget, sampling=settings))
        assert out == GREEDY5, settings
    full = {"temperature": 1.0, "seed": 4}
    assert ids(run(TP, prompts, sampling=full | {"top_p": 1.0, "top_k": 0})) == ids(
        run(TP, prompts, sampling=full | {"top_k": 256})
    )


# -- the processing steps against sort-based references --------------------------------------------


def test_top_k_and_top_p_masks_match_sorting():
    rng = np.random.default_rng(0)
    logits = np.round(rng.normal(size=(3, 4, 256)) * 2, 1).astype(np.float32)  # ties on purpose
    logits[0, 0, :10] = -np.inf
    top_k = np.array([1, 20, 0], np.int32)
    keep = np.asarray(sampling.top_k_mask(jnp.asarray(logits), jnp.asarray(top_k)))
    for b in range(3):
        for t in range(4):
            k = top_k[b] or 256
            kth = np.sort(logits[b, t])[::-1][k - 1]
            np.testing.assert_array_equal(keep[b, t], logits[b, t] >= kth)
            assert keep[b, t].sum() >= k

    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
    top_p = np.array([0.3, 0.9, 1.0], np.float32)
    keep = np.asarray(sampling.top_p_mask(jnp.asarray(probs), jnp.asarray(top_p)))
    for b in range(3):
        for t in range(4):
            p = probs[b, t].astype(np.float64)
            desc = np.sort(p)[::-1]
            n = np.searchsorted(np.cumsum(desc), top_p[b] * (1 - 1e-6)) + 1
            expect = p >= desc[min(n, 256) - 1] if top_p[b] < 1 else np.ones(256, bool)
            np.testing.assert_array_equal(keep[b, t], expect)


def oracle_floor(row: np.ndarray, temperature: float, top_k: int, top_p: float) -> float:
    """The smallest kept logit after top-k then top-p, by full sort in float64 (ties all in)."""
    row = row.astype(np.float64)
    keep = np.ones(row.shape, bool)
    if top_k > 0:
        keep = row >= np.sort(row)[::-1][min(top_k, row.size) - 1]
    if top_p < 1:
        z = np.where(keep, row / temperature, -np.inf)
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        desc = np.sort(probs)[::-1]
        n = np.searchsorted(np.cumsum(desc), top_p * (1 - 1e-6))
        keep &= probs >= desc[n]
    return row[keep].min()


def filter_cases(v: int) -> tuple[np.ndarray, list[dict]]:
    """Logits [R, 2, v] (ties, -inf, flat and peaked rows) and one setting per row."""
    rng = np.random.default_rng(1)
    settings = [
        {"top_k": 20, "top_p": 1.0},
        {"top_k": 64, "top_p": 1.0},  # the shortlist's last entry
        {"top_k": 65, "top_p": 1.0},  # past it: bisection
        {"top_k": 0, "top_p": 0.9},
        {"top_k": 20, "top_p": 0.9},
        {"top_k": 50, "top_p": 0.3},
        {"top_k": 1, "top_p": 1.0},
        {"top_k": 0, "top_p": 1e-6},
        {"top_k": 0, "top_p": 1.0},
        {"top_k": v + 5, "top_p": 0.95},
    ]
    r = len(settings)
    logits = rng.normal(size=(r, 2, v)).astype(np.float32) * 4  # node 0: peaked enough for top-p
    logits[:, 1] = np.round(rng.normal(size=(r, v)), 1) * 0.5  # node 1: flat, ties everywhere
    logits[:, 0, :7] = -np.inf
    logits[3, 0, 100:140] = 30.0  # 40 tied maxima
    return logits, settings


@pytest.mark.parametrize("v", [256, 10240, 10000])
def test_support_floor_matches_sorting(v):
    """The shortlist (and its fallback to bisection) keeps exactly what a full sort keeps."""
    logits, settings = filter_cases(v)
    temps = np.linspace(0.5, 1.5, len(settings)).astype(np.float32)
    params = sampling.SamplingArrays.from_rows(
        [s | {"temperature": float(t), "seed": 0} for s, t in zip(settings, temps, strict=True)]
    )
    x = jnp.asarray(logits)
    floor = np.asarray(jax.jit(sampling.support_floor)(x, params))
    fast, exact = map(np.asarray, jax.jit(sampling.shortlist_floor)(x, params))
    bisect = np.asarray(jax.jit(sampling.bisection_floor)(x, params))
    for i, s in enumerate(settings):
        for t in range(2):
            row = logits[i, t]
            want = row >= oracle_floor(row, float(temps[i]), s["top_k"], s["top_p"])
            np.testing.assert_array_equal(row >= floor[i, t], want, err_msg=str((i, t, s)))
            np.testing.assert_array_equal(row >= bisect[i, t], want, err_msg=str((i, t, s)))
            if exact[i, t]:
                np.testing.assert_array_equal(row >= fast[i, t], want, err_msg=str((i, t, s)))
    assert not exact[2].any()  # top-k 65
    assert exact[[0, 1, 4, 5, 6, 7, 8], 0].all()
    if v > 64 * 128:  # the tiled shortlist: its values are the sorted top 64
        np.testing.assert_array_equal(sampling.shortlist(x), -np.sort(-logits, axis=-1)[..., :64])


def test_floor_of_a_node_ignores_the_rest_of_the_batch():
    """top_p at the partial sums of the shortlist (where the two ways may round apart): each row's
    floor is the same whether or not another row of the batch needs bisection."""
    rng = np.random.default_rng(3)
    v, n = 10240, 24
    row = rng.normal(size=v).astype(np.float32) * 3
    top = np.sort(row)[::-1][:64].astype(np.float64)
    partial = np.cumsum(np.exp(top - top[0]) / np.exp(row.astype(np.float64) - top[0]).sum())[:n]
    logits = jnp.asarray(np.broadcast_to(row, (n + 1, 1, v)))
    rows = [{"temperature": 1.0, "top_k": 0, "top_p": float(np.float32(p)), "seed": 0} for p in partial]
    floors = {}
    for first_k in (20, 65):  # row 0 alone: shortlist, or bisection for the whole batch
        params = sampling.SamplingArrays.from_rows([{**rows[0], "top_k": first_k, "top_p": 1.0}, *rows])
        floors[first_k] = np.asarray(jax.jit(sampling.support_floor)(logits, params))[1:]
    np.testing.assert_array_equal(floors[20], floors[65])


def test_shortlist_vocab_parallel():
    """Split over 8 devices (tiled per device), the shortlist equals the unsplit one."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("model",))
    x = jax.random.randint(jax.random.key(0), (2, 3, 8 * 9216), 0, 50).astype(jnp.float32)
    split = jax.shard_map(
        lambda a: sampling.shortlist(a, "model"),
        mesh=mesh,
        in_specs=P(None, None, "model"),
        out_specs=P(),
        check_vma=False,
    )
    np.testing.assert_array_equal(split(x), jax.lax.top_k(x, 64)[0])


def test_noise_depends_only_on_seed_position_token():
    seed = jnp.asarray([5, 5, 6], jnp.uint32)
    pos = jnp.asarray([[3, 4], [4, 3], [3, 4]], jnp.int32)
    g = np.asarray(sampling.gumbel(seed, pos, 256))
    one = np.asarray(sampling.gumbel(jnp.asarray([5], jnp.uint32), jnp.asarray([[3]]), 256))[0, 0]
    np.testing.assert_array_equal(g[0, 0], one)
    np.testing.assert_array_equal(g[1, 1], one)
    assert not np.array_equal(g[0, 0], g[0, 1]) and not np.array_equal(g[0, 0], g[2, 0])
    many = np.asarray(
        sampling.gumbel(jnp.arange(64, dtype=jnp.uint32), jnp.arange(64 * 64).reshape(64, 64), 256)
    )
    assert np.all(np.isfinite(many))
    assert abs(many.mean() - np.euler_gamma) < 0.01 and abs(many.var() - np.pi**2 / 6) < 0.02
    assert stats.kstest(many.ravel()[::7], stats.gumbel_r.cdf).pvalue > 1e-4


# -- distribution of the first two tokens ----------------------------------------------------------

DIST_PROMPT = PROMPTS8[2]
NUM_SEEDS = 4000


def last_logits(tokens: jax.Array) -> jax.Array:
    """The target's logits at the last position of each row of tokens [R, n] -> [R, V]."""
    cfg, params = load_target(TP)
    r, m = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(m), (r, m))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((m, m), bool)), (r, m, m))
    out = target.forward(params, cfg, tokens, positions, mask, None)
    return target.logits(params, out.hidden[:, -1])


def exact_next_probs(prefixes: list[tuple[int, ...]]) -> np.ndarray:
    """P(next token | DIST_PROMPT + prefix) [P, V] of the target at temperature 1 (one row per prefix)."""
    rows = jnp.asarray([DIST_PROMPT + list(p) for p in prefixes])
    return np.asarray(jax.nn.softmax(last_logits(rows), axis=-1), np.float64)


def test_noise_position_is_the_chosen_tokens_position():
    """x1 (at position L) uses the noise at L, x2 the noise at L + 1: Gumbel-max by hand."""
    n, seed, temp = len(DIST_PROMPT), 123, 0.8
    out = ids(run(TP, [DIST_PROMPT], options=[{"temperature": temp, "seed": seed}], max_new_tokens=2))[0]
    expect, tokens = [], list(DIST_PROMPT)
    for pos in (n, n + 1):
        noise = sampling.gumbel(jnp.asarray([seed], jnp.uint32), jnp.asarray([[pos]]), 256)[0, 0]
        expect.append(int(jnp.argmax(last_logits(jnp.asarray([tokens]))[0] / temp + noise)))
        tokens.append(expect[-1])
    assert out == expect


def g_test_pvalue(samples: list[list[int]]) -> float:
    """The package's G-test (per sampled prefix, summed over the first two positions) at temperature 1."""
    tests = position_tests(samples, 2, exact_next_probs)
    assert sum(t.dof for t in tests) > 50  # enough bins for the test to mean something
    return combined_p_value(tests)


@pytest.mark.parametrize("method,budget", [("ar", 0), ("ddtree", 7)])
def test_first_two_tokens_follow_target_distribution(method, budget):
    opts = [{"temperature": 1.0, "seed": 1000 + i} for i in range(NUM_SEEDS)]
    draft = None if method == "ar" else DRAFT
    out = ids(
        run(
            TP,
            [DIST_PROMPT] * NUM_SEEDS,
            method=method,
            draft_name=draft,
            budget=budget,
            options=opts,
            max_new_tokens=2,
        )
    )
    assert g_test_pvalue(out) > 1e-4
    if method == "ar":  # power: a sampler at the wrong temperature is rejected
        hot = [o | {"temperature": 1.3} for o in opts]
        biased = ids(run(TP, [DIST_PROMPT] * NUM_SEEDS, options=hot, max_new_tokens=2))
        assert g_test_pvalue(biased) < 1e-6
        top = [o | {"top_k": 8} for o in opts]
        biased = ids(run(TP, [DIST_PROMPT] * NUM_SEEDS, options=top, max_new_tokens=2))
        assert g_test_pvalue(biased) < 1e-6


# -- settings from the command line and the prompts file -------------------------------------------


def _argv(tmp_path, *flags):
    return [
        "--target",
        str(FIXTURES / TP),
        "--prompts",
        str(tmp_path / "p.jsonl"),
        "--out",
        str(tmp_path / "o.jsonl"),
        "--dtype",
        "float32",
        *flags,
    ]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--temperature", "nan"], "--temperature must be a finite number"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--top-k", "-1"], "--top-k must be >= 0"),
        (["--seed", "-3"], "--seed must be in [0, 2^32)"),
    ],
)
def test_bad_sampling_flags(tmp_path, capsys, flags, needle):
    (tmp_path / "p.jsonl").write_text('{"input_ids": [1]}\n')
    assert main(_argv(tmp_path, *flags)) == 1
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize(
    "field,needle",
    [
        ('"temperature": -0.5', "p.jsonl:2: 'temperature' must be >= 0"),
        ('"temperature": "hot"', "p.jsonl:2: 'temperature' must be a finite number"),
        ('"top_p": 0', "p.jsonl:2: 'top_p' must be in (0, 1]"),
        ('"top_p": 2', "p.jsonl:2: 'top_p' must be in (0, 1]"),
        ('"top_k": -2', "p.jsonl:2: 'top_k' must be >= 0"),
        ('"top_k": 1.5', "p.jsonl:2: 'top_k' must be an integer"),
        ('"seed": 4294967296', "p.jsonl:2: 'seed' must be in [0, 2^32)"),
    ],
)
def test_bad_sampling_fields(tmp_path, capsys, field, needle):
    (tmp_path / "p.jsonl").write_text('{"input_ids": [1]}\n{"input_ids": [2], ' + field + "}\n")
    assert main(_argv(tmp_path)) == 1
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_sampling_defaults_and_per_prompt_overrides(tmp_path):
    prompts = golden_prompts(TP)
    own = [{}, {"seed": 77}, {"temperature": 0.0}, {"top_k": 0, "top_p": 0.5}, {"temperature": 1.0}]
    lines = [{"id": i, "input_ids": p, **o} for i, (p, o) in enumerate(zip(prompts, own, strict=True))]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    flags = [
        "--temperature",
        "0.7",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "5",
        "--max-new-tokens",
        "24",
    ]
    draft = ["--draft", str(FIXTURES / DRAFT), "--budget", "7", "--batch-size", "5"]
    assert main(_argv(tmp_path, *flags, *draft)) == 0
    rows = sorted(map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines()), key=lambda r: r["id"])
    out = [r["output_ids"] for r in rows]  # lines come in the order prompts finish
    defaults = {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 5}
    assert out == ids(run(TP, prompts, sampling=defaults, options=own))
    assert out[2] == GREEDY5[2] and out[0] != GREEDY5[0]


# -- deep acceptance under sampling: an oracle drafter proposing ar's sampled continuation ----------


def test_oracle_sampled_continuation_accepted_at_full_depth():
    """The walk follows sampled children at every depth (noise position = node position + 1)."""
    prompts, opts = golden_prompts(TP), SETTINGS["mixed"][:5]
    ar = ids(run(TP, prompts, options=opts))
    stage = oracle_draft([p + o for p, o in zip(prompts, ar, strict=True)])
    for method, budget in [("dflash", 0), ("ddtree", 32)]:
        results = run(
            TP, prompts, method=method, draft_name=DRAFT, budget=budget, options=opts, draft_stage=stage
        )
        assert ids(results) == ar, method
        assert all(r.acceptance_lengths == [8, 8, 7] for r in results), method
