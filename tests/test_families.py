"""Every registered model family against one contract (models/family.py): float32 logits and greedy
outputs against HF transformers (the golden fixtures of tests/make_fixtures.py), speculative decoding
emitting ar's tokens (greedy and sampled), the same outcomes on every mesh, and host-stepped rounds on a
mesh equal to the device loop.

`CONFORMANCE` holds each family's fixtures and cases; a family registered from the tests
(family_fused_mlp.py: one new file plus the one `models.register` line below) runs through the same
tests, and a registered family without an entry fails `test_every_family_is_covered`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import conftest
import family_fused_mlp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import EXTRA_PROMPTS, FIXTURES, golden, golden_prompts, load_drafter, load_target, run

from ddtree_jax import models, target

models.register(family_fused_mlp.FAMILY)  # the one registry line of a new family (a test's own)
FUSED_TARGET = family_fused_mlp.fixture(FIXTURES / "qwen3_gqa4_tp")
FUSED_DRAFTER = family_fused_mlp.fixture(FIXTURES / "dflash_qwen3_gqa4_tp")
conftest.DRAFTERS[FUSED_DRAFTER] = FUSED_TARGET  # the drafter checked against (and reading) this target
conftest.DRAFTERS.setdefault("dflash_deepseek_v3_tp", "deepseek_v3_tp")

SAMPLING = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 7}


class Spec(NamedTuple):
    """A speculative run of the pair: its method, budget, sampling and rows (None: the pair's)."""

    method: str
    budget: int = 0
    sampled: bool = False
    batch: int | None = None


class Mesh(NamedTuple):
    """A run of the pair on a ("data", "model") mesh."""

    tp: int
    dp: int
    method: str = "ddtree"
    budget: int = 7
    sampled: bool = False
    moe_sharding: str = "ep"


# dflash greedy and ddtree sampled (dflash sampled ran the family's same forward passes; sampling on
# trees is tests/test_sampling.py's); ddtree 7 greedy is also the meshes' and host-stepped's reference.
COMMON = (Spec("dflash"), Spec("ddtree", 7), Spec("ddtree", 24, sampled=True))
# Greedy at tp 8 (heads, columns, experts and the vocabulary split 8 ways; fewer K/V heads than devices)
# and sampled at tp 4 x dp 2 (the vocabulary split over "model" and rows over "data" at once, each row's
# noise following it). tp 8 sampled, at twice the compile time, and tp 4 x dp 2 greedy ran the same code
# on the same splits.
COMMON_MESHES = (Mesh(8, 1), Mesh(4, 2, sampled=True))


@dataclasses.dataclass(frozen=True)
class Conformance:
    """How the tests exercise one family.

    targets      fixtures whose HF golden logits and greedy outputs (5 prompts) the family must give
    new_tokens   greedy tokens checked against HF per prompt
    pair         (target, drafter) fixtures of the speculative, mesh and host-stepped runs, on the
                 target's golden prompts plus `extra_prompts`, `batch` rows, `pair_new_tokens` each
    speculative  COMMON plus the family's own cases
    meshes       COMMON_MESHES plus the family's own cases
    host_mesh    (tp, dp) of the host-stepped run
    """

    targets: tuple[str, ...]
    new_tokens: int
    pair: tuple[str, str]
    batch: int
    pair_new_tokens: int
    extra_prompts: tuple[tuple[int, ...], ...] = ()
    speculative: tuple[Spec, ...] = COMMON
    meshes: tuple[Mesh, ...] = COMMON_MESHES
    host_mesh: tuple[int, int] = (4, 2)

    @property
    def prompts(self) -> list[list[int]]:
        return golden_prompts(self.pair[0]) + [list(p) for p in self.extra_prompts]


CONFORMANCE = {
    "dense": Conformance(
        targets=("qwen3_gqa1", "qwen3_gqa2_tied", "qwen3_gqa4_tp", "llama_gqa2", "llama3_scaled"),
        new_tokens=24,
        pair=("qwen3_gqa4_tp", "dflash_qwen3_gqa4_tp"),
        batch=8,
        pair_new_tokens=16,
        extra_prompts=tuple(map(tuple, EXTRA_PROMPTS)),  # 8 rows: one per device at dp 8
        # the engine's corners on the cheapest family: tiny and huge budgets, one row (at the huge
        # budget), padding rows (ddtree 15 at 8 rows repeated COMMON's ddtree 7 at 8 rows; ddtree 7 at one
        # row, ddtree 100's one row; dflash at 3 rows, ddtree 2's padding rows)
        speculative=COMMON
        + (Spec("ddtree", 1, batch=8), Spec("ddtree", 2, batch=3))
        + (Spec("ddtree", 32, batch=3), Spec("ddtree", 100, batch=1)),
        # each method on a mesh: its 2 K/V heads split exactly (tp 2), rows alone over 8 devices (dp 8),
        # ar with heads and rows split, the large tree with heads and rows split (tp 2 x dp 2); ar at tp 8,
        # dflash at tp 4 and tp 4 x dp 2, ddtree 7 at tp 2 x dp 2 and dp 8 ran the same splits
        meshes=COMMON_MESHES
        + (Mesh(2, 1), Mesh(1, 8, "dflash", 0), Mesh(2, 2, "ar", 0), Mesh(2, 2, "ddtree", 32)),
    ),
    "qwen3_moe": Conformance(
        targets=("qwen3_moe_norm", "qwen3_moe_tp"),
        new_tokens=24,
        pair=("qwen3_moe_tp", "dflash_qwen3_moe_tp"),
        batch=8,
        pair_new_tokens=10,
        extra_prompts=((5, 6, 7), (9,) * 4, (200, 3)),
        # 8 experts over tp devices (ep: 8 / tp each) or their 16 columns (tp); 2 K/V heads < tp 4, 8 (tp 2,
        # ep and tp, ran the same code at other counts)
        meshes=COMMON_MESHES + (Mesh(8, 1, moe_sharding="tp"), Mesh(4, 2, moe_sharding="tp")),
    ),
    "deepseek_v3": Conformance(
        targets=("deepseek_v3_qlora", "deepseek_v3_tp", "kimi_k25_wrapped"),
        new_tokens=12,
        pair=("deepseek_v3_tp", "dflash_deepseek_v3_tp"),
        batch=5,
        pair_new_tokens=12,
        # heads and experts (ep) over "model", the latent cache replicated
        meshes=COMMON_MESHES,
        host_mesh=(2, 1),
    ),
    "fused_mlp": Conformance(
        targets=(FUSED_TARGET,),
        new_tokens=12,
        pair=(FUSED_TARGET, FUSED_DRAFTER),
        batch=5,
        pair_new_tokens=12,
        meshes=COMMON_MESHES[:1],  # its gate_up split over "ff" like any MLP's columns
        host_mesh=(2, 1),
    ),
}


def test_every_family_is_covered():
    assert {f.name for f in models.families()} == set(CONFORMANCE)


def _name(fixture: str) -> str:
    return fixture.rsplit("/", 1)[-1] + ("@fused" if fixture.startswith("/") else "")


TARGET_CASES = [pytest.param(f, t, id=f"{f}-{_name(t)}") for f, c in CONFORMANCE.items() for t in c.targets]


# -- against HF --------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=1)
def _prefill_logits(params, cfg, tokens: jax.Array) -> jax.Array:
    """float32 logits [B, T, V] of prompts [B, T] run as a prefill (causal, no cache): a prompt padded
    at its end has its own tokens' logits in its first positions."""
    b, n = tokens.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
    out = target.forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(n), (b, n)), causal, None)
    return target.logits(params, out.hidden)


@pytest.mark.parametrize("family,fixture", TARGET_CASES)
def test_float32_logits_match_hf(family, fixture):
    cfg, params = load_target(fixture)
    assert models.family(cfg).name == family
    g, prompts = golden(fixture), golden_prompts(fixture)
    width = max(map(len, prompts))  # the five prompts in one call (one compilation), padded at the end
    tokens = np.array([p + [0] * (width - len(p)) for p in prompts], np.int32)
    logits = np.asarray(_prefill_logits(params, cfg, jnp.asarray(tokens)))
    for i, p in enumerate(prompts):
        ref = g[f"logits_{i}"]
        err = np.abs(logits[i, : len(p)] - ref).max() / np.abs(ref).max()
        assert err < 1e-4, (fixture, i, err)


@pytest.mark.parametrize("family,fixture", TARGET_CASES)
def test_ar_is_hf_greedy(family, fixture):
    new = CONFORMANCE[family].new_tokens
    results = run(fixture, golden_prompts(fixture), batch_size=5, max_new_tokens=new)
    for i, r in enumerate(results):
        assert r.output_ids == golden(fixture)[f"greedy_{i}"].tolist()[:new], (fixture, i)
        assert r.finish_reason == "length"
        assert r.rounds == new - 1 and r.acceptance_lengths == [1] * (new - 1)


# -- the pair: speculative decoding, meshes, host-stepped -------------------------------------------


def outcome(results) -> list[tuple]:
    return [(r.output_ids, r.acceptance_lengths, r.finish_reason) for r in results]


@functools.cache
def pair_run(family: str, method: str, budget: int, sampled: bool, batch: int | None = None, **kw) -> list:
    """Outcomes of the family's pair on its prompts (`kw`: tp, dp, moe_sharding, host_stepped)."""
    c = CONFORMANCE[family]
    return outcome(
        run(c.pair[0], c.prompts, method=method, draft_name=None if method == "ar" else c.pair[1],
            budget=budget, batch_size=batch or c.batch, max_new_tokens=c.pair_new_tokens,
            sampling=SAMPLING if sampled else None, **kw)
    )  # fmt: skip


def _case_id(family, method, budget, sampled, *rest) -> str:
    return f"{family}-{method}{budget or ''}-{'sampled' if sampled else 'greedy'}-" + "-".join(map(str, rest))


SPECULATIVE_CASES = [
    pytest.param(f, *case, id=_case_id(f, *case[:3], f"b{case.batch or c.batch}"))
    for f, c in CONFORMANCE.items()
    for case in c.speculative
]


@pytest.mark.parametrize("family,method,budget,sampled,batch", SPECULATIVE_CASES)
def test_speculative_equals_ar(family, method, budget, sampled, batch):
    """dflash and ddtree emit ar's tokens, greedy and sampled (the same Gumbel noise per position);
    ar's greedy tokens are HF's."""
    c = CONFORMANCE[family]
    ar = pair_run(family, "ar", 0, sampled)
    if not sampled:
        want = [golden(c.pair[0])[f"greedy_{i}"].tolist()[: c.pair_new_tokens] for i in range(5)]
        assert [o[0] for o in ar[:5]] == want
    got = pair_run(family, method, budget, sampled, batch)
    assert [o[0] for o in got] == [o[0] for o in ar]
    block = load_drafter(c.pair[1])[0].block_size
    for ids, acceptance, _ in got:
        assert sum(acceptance) + 1 == len(ids) and all(1 <= a <= block for a in acceptance)


MESH_CASES = [
    pytest.param(
        f, *m, id=_case_id(f, m.method, m.budget, m.sampled, f"tp{m.tp}", f"dp{m.dp}", m.moe_sharding)
    )
    for f, c in CONFORMANCE.items()
    for m in c.meshes
]


@pytest.mark.parametrize("family,tp,dp,method,budget,sampled,moe_sharding", MESH_CASES)
def test_identical_on_meshes(family, tp, dp, method, budget, sampled, moe_sharding):
    """The same tokens, acceptance lengths and finish reasons on a ("data", "model") mesh as on one
    device (heads, columns, experts and vocabulary split over "model", rows over "data")."""
    kw = {"moe_sharding": moe_sharding} if moe_sharding != "ep" else {}
    got = pair_run(family, method, budget, sampled, tp=tp, dp=dp, **kw)
    assert got == pair_run(family, method, budget, sampled)


@pytest.mark.parametrize("family", list(CONFORMANCE))
def test_host_stepped_on_a_mesh(family):
    """The host-stepped stages (each round's programs called from Python) carry the family's cache
    entries between verify and commit on a mesh: the device loop's outcomes."""
    tp, dp = CONFORMANCE[family].host_mesh
    got = pair_run(family, "ddtree", 7, False, tp=tp, dp=dp, host_stepped=True)
    assert got == pair_run(family, "ddtree", 7, False)
