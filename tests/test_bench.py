"""ddtree-bench runs end to end at tiny sizes (a smoke test: no timing is asserted)."""

import json

from ddtree_jax.bench import main


def test_bench_tiny_writes_every_configuration(tmp_path):
    out = tmp_path / "bench.json"
    argv = [
        "--shape",
        "tiny",
        "--draft-layers",
        "1",
        "--block-size",
        "4",
        "--methods",
        "ar,ddtree",
        "--budgets",
        "3",
        "--contexts",
        "32",
        "--batches",
        "2",
        "--rounds",
        "2",
        "--stages",
        "--sampling",
        "greedy,0.7:5:0.9",
        "--ceiling-bytes",
        "1048576",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["method"], r["sampling"] is None) for r in rows] == [
        ("ar", True),
        ("ar", False),
        ("ddtree", True),
        ("ddtree", False),
    ]
    for r in rows:
        assert "error" not in r, r.get("error")
        assert r["round_ms"] > 0 and r["target_floor_ms"] > 0
        assert set(r["stages_ms"]) >= {"tree_build", "verify", "walk_commit"}
        drafted = {"draft", "tree_build"} if r["method"] == "ddtree" else set()
        assert set(r["device_stages_ms"]) == {"verify", "walk_commit_rest"} | drafted
        assert all(r["device_stages_ms"][k] > 0 for k in {"verify"} | drafted)
    assert data["meta"]["read_ceiling_gbs"] > 0
