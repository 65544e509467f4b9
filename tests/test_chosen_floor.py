"""The MoE floor of the experts the router chose (ddtree_jax.bench.floor.chosen_expert_floor): the
routing log records what the router chose, the count of distinct experts per device and the bytes floor
agree with NumPy sets over the logged choices, and a dense row keeps its one floor (tests/test_bench.py
checks that MoE rows carry both)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import drafter, models, target
from ddtree_jax.bench import rounds
from ddtree_jax.bench.floor import chosen_expert_floor, distinct_per_device, record_routing
from ddtree_jax.bench.programs import synthetic_state
from ddtree_jax.bench.shapes import SHAPES, draft_shape
from ddtree_jax.models import moe
from ddtree_jax.pair import make_plan
from ddtree_jax.programs import Shape
from ddtree_jax.weights import random_params

TINY_MOE = ["--shape", "tiny-moe", "--draft-layers", "1", "--block-size", "4", "--contexts", "32"]
TINY_MOE += ["--rounds", "2", "--ceiling-bytes", "1048576"]


def test_routing_log_records_the_routers_choice():
    """Each traced run_experts call site logs, at every execution, the experts `route` chose."""
    rng = np.random.default_rng(0)
    layers = [
        {
            "router": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
            "experts_gate": jnp.asarray(rng.standard_normal((8, 16, 4)), jnp.float32),
            "experts_up": jnp.asarray(rng.standard_normal((8, 16, 4)), jnp.float32),
            "experts_down": jnp.asarray(rng.standard_normal((8, 4, 16)), jnp.float32),
        }
        for _ in range(2)
    ]

    def two_layers(x):
        for p in layers:
            x = x + moe.experts_ffn(p, x, 2, True)
        return x

    with moe.RoutingLog() as log:
        fn = jax.jit(two_layers).lower(jnp.zeros((5, 16))).compile()
    xs = [jnp.asarray(rng.standard_normal((5, 16)), jnp.float32) for _ in range(2)]
    for x in xs:
        jax.block_until_ready(fn(x))
    assert sorted(log.calls) == [0, 1] and moe.RoutingLog.active is None
    for x in xs:  # the second layer's input is the first layer's output
        want = [moe.route(layers[0]["router"], x, 2, True).experts]
        h = x + moe.experts_ffn(layers[0], x, 2, True)
        want.append(moe.route(layers[1]["router"], h, 2, True).experts)
        got = [log.calls[site].pop(0) for site in (0, 1)]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, np.asarray(w))


@pytest.mark.parametrize("tp,sharding", [(1, "ep"), (4, "ep"), (4, "tp")])
def test_distinct_per_device_against_sets(tp, sharding):
    experts = np.random.default_rng(tp).integers(0, 16, (3, 5, 2))
    held = [
        set(range(d * 16 // tp, (d + 1) * 16 // tp)) if sharding == "ep" else set(range(16))
        for d in range(tp)
    ]
    want = max(len(set(experts.ravel()) & h) for h in held)
    assert distinct_per_device(experts, 16, tp, sharding) == want


@pytest.mark.parametrize("method,batch,rows", [("ar", 1, 1), ("ddtree", 2, 3)])
def test_chosen_floor_against_numpy_sets(method, batch, rows):
    """Tiny MoE target (3 sparse layers of 8 experts, top-2): the floor from the logged routing of two
    rounds equals the bytes of the non-expert weights (less the embedding table) plus, per layer, the
    experts the live rows chose, counted with Python sets; a padding row's choices do not count."""
    cfg = SHAPES["tiny-moe"]
    dcfg = draft_shape(cfg, 1, 4)
    params = random_params(target.weight_specs(cfg), 0, jnp.bfloat16)
    dparams = random_params(drafter.weight_specs(dcfg), 1, jnp.bfloat16)
    budget = 3 if method == "ddtree" else None
    plan = make_plan(cfg, dcfg, method, batch_size=rows, max_new_tokens=8, budget=budget)
    shape = Shape.of(plan, rows, 32)
    state = synthetic_state(plan, shape, 32, 0, jnp.bfloat16, active=batch)
    log = record_routing(params, dparams, state, plan, 2)
    got = chosen_expert_floor(log, params, cfg, plan, shape, batch)

    sparse = [i for i in range(cfg.num_layers) if cfg.is_sparse(i)]
    assert sorted(log) == list(range(len(sparse))) and all(len(v) == 2 for v in log.values())
    expert_bytes = {
        i: sum(a.nbytes for n in moe.EXPERT_WEIGHTS for a in jax.tree.leaves(params["layers"][i][n]))
        for i in sparse
    }
    embedding = models.family(cfg).unread_weight_bytes(params, cfg, 1 << 40, lambda a: a.nbytes)
    rest = sum(a.nbytes for a in jax.tree.leaves(params)) - embedding - sum(expert_bytes.values())
    floors, counts = [], []
    for r in range(2):
        floor = rest
        for site, i in enumerate(sparse):
            chosen = log[site][r].reshape(rows, -1, cfg.experts_per_token)[:batch]
            distinct = len({int(e) for e in chosen.ravel()})
            counts.append(distinct)
            floor += distinct * expert_bytes[i] / cfg.num_experts
        floors.append(floor)
    assert got["weight_bytes"] == pytest.approx(np.mean(floors))
    assert got["distinct_experts"] == pytest.approx(np.mean(counts))
    assert min(counts) >= 1 and max(counts) <= cfg.num_experts


def test_dense_rows_have_one_floor(tmp_path):
    out = tmp_path / "bench.json"
    argv = [a if a != "tiny-moe" else "tiny" for a in TINY_MOE]
    assert rounds.main([*argv, "--methods", "ar", "--batch-sizes", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "chosen_floor_ms" not in row and row["round_over_floor"] == pytest.approx(
        row["round_ms"] / row["target_floor_ms"]
    )
