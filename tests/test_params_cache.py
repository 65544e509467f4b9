"""`--params-cache`: an HF checkpoint converted once to orbax, restored onto the mesh's shards."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, timeless

from ddtree_jax import target
from ddtree_jax.checkpoint import params_cache
from ddtree_jax.errors import DDTreeError
from ddtree_jax.sharding import make_mesh, param_sharding


def load(directory, dtype="float32", tp=1, dp=1, cache=None):
    """target.load onto a tp x dp mesh, through the cache when one is given."""
    with params_cache(cache):
        return target.load(directory, jnp.dtype(dtype), param_sharding(make_mesh(tp, dp)))[1]


def assert_same(restored, fresh) -> None:
    """Equal structure, values, dtypes and shardings, leaf by leaf."""
    assert jax.tree.structure(restored) == jax.tree.structure(fresh)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(fresh), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)


@pytest.mark.parametrize("tp,dp", [(1, 1), (4, 2)])
def test_restore_equals_fresh_load(tmp_path, capsys, tp, dp):
    """The first load converts, the second restores; both equal the plain safetensors load."""
    fresh = load(FIXTURES / "qwen3_gqa4_tp", tp=tp, dp=dp)
    converted = load(FIXTURES / "qwen3_gqa4_tp", tp=tp, dp=dp, cache=tmp_path)
    assert "params cache: converted" in capsys.readouterr().err
    restored = load(FIXTURES / "qwen3_gqa4_tp", tp=tp, dp=dp, cache=tmp_path)
    assert "params cache: restored" in capsys.readouterr().err
    assert_same(converted, fresh)
    assert_same(restored, fresh)
    assert len(list(tmp_path.iterdir())) == 1


def test_different_inputs_get_their_own_entries(tmp_path):
    """dtype, a layout that changes placed shapes (K/V heads repeated at tp 4) and a changed weight
    file each key a new entry; none restores another's."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "qwen3_gqa4_tp", ckpt)
    cache = tmp_path / "cache"
    load(ckpt, cache=cache)
    load(ckpt, "bfloat16", cache=cache)
    load(ckpt, tp=4, cache=cache)  # 2 K/V heads repeated over 4 devices: another placed shape
    load(ckpt, tp=2, cache=cache)  # placed shapes as at tp 1: the tp-1 entry serves
    assert len(list(cache.iterdir())) == 3
    weights = ckpt / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-4:] = np.float32(7.0).tobytes()  # the last tensor's last value changes
    weights.write_bytes(bytes(raw))
    os.utime(weights, ns=(1, 1))
    changed = load(ckpt, cache=cache)
    assert len(list(cache.iterdir())) == 4
    assert_same(changed, load(ckpt))


def test_tampered_entry_refused(tmp_path):
    load(FIXTURES / "qwen3_gqa1", cache=tmp_path)
    (stamp,) = tmp_path.glob("*/fingerprint.json")
    record = json.loads(stamp.read_text())
    record["dtype"] = "bfloat16"
    stamp.write_text(json.dumps(record))
    with pytest.raises(DDTreeError, match="does not describe .* delete .* to rebuild it"):
        load(FIXTURES / "qwen3_gqa1", cache=tmp_path)


def test_interrupted_conversion_is_redone(tmp_path, capsys):
    """An entry without its fingerprint (a conversion cut short) is converted again."""
    load(FIXTURES / "qwen3_gqa1", cache=tmp_path)
    (stamp,) = tmp_path.glob("*/fingerprint.json")
    stamp.unlink()
    capsys.readouterr()
    assert_same(load(FIXTURES / "qwen3_gqa1", cache=tmp_path), load(FIXTURES / "qwen3_gqa1"))
    assert "params cache: converted" in capsys.readouterr().err


def test_cli_params_cache(tmp_path, capsys):
    """`ddtree-generate --params-cache DIR` converts the pair once, then restores the same outputs."""
    from ddtree_jax.cli import main

    (tmp_path / "p.jsonl").write_text('{"id": 0, "input_ids": [3, 4, 5]}\n')
    base = ["--target", str(FIXTURES / "qwen3_gqa4_tp"), "--draft", str(FIXTURES / "dflash_qwen3_gqa4_tp")]
    base += ["--prompts", str(tmp_path / "p.jsonl"), "--dtype", "float32", "--max-new-tokens", "8"]
    base += ["--budget", "7", "--params-cache", str(tmp_path / "cache")]
    assert main([*base, "--out", str(tmp_path / "a.jsonl")]) == 0
    assert capsys.readouterr().err.count("params cache: converted") == 2  # target and drafter
    assert main([*base, "--out", str(tmp_path / "b.jsonl")]) == 0
    assert capsys.readouterr().err.count("params cache: restored") == 2
    records = lambda name: [timeless(json.loads(line)) for line in (tmp_path / name).read_text().splitlines()]  # noqa: E731
    assert records("a.jsonl") == records("b.jsonl")


def test_damaged_entry_refused(tmp_path):
    """An entry whose orbax files are gone: a one-line refusal naming it, not orbax's traceback."""
    load(FIXTURES / "qwen3_gqa1", cache=tmp_path)
    (entry,) = tmp_path.iterdir()
    shutil.rmtree(entry / "params")
    (entry / "params").mkdir()
    with pytest.raises(DDTreeError, match=f"cannot restore {entry} .*delete it to rebuild"):
        load(FIXTURES / "qwen3_gqa1", cache=tmp_path)


def test_damaged_chunks_one_short_line(tmp_path):
    """An entry missing its data chunks: ddtree-generate says so in one short line naming the entry,
    with no traceback after it (tensorstore's other reads once each printed one at exit)."""
    import subprocess
    import sys
    from pathlib import Path

    load(FIXTURES / "qwen3_gqa1", cache=tmp_path / "cache")
    (entry,) = (tmp_path / "cache").iterdir()
    shutil.rmtree(entry / "params" / "d")
    (tmp_path / "p.jsonl").write_text('{"id": 0, "input_ids": [3, 4, 5]}\n')
    argv = ["--target", str(FIXTURES / "qwen3_gqa1"), "--prompts", str(tmp_path / "p.jsonl")]
    argv += [
        "--out",
        str(tmp_path / "o.jsonl"),
        "--params-cache",
        str(tmp_path / "cache"),
        "--dtype",
        "float32",
    ]
    root = Path(__file__).parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "ddtree_jax.cli", *argv], cwd=root, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in done.stderr.splitlines() if "Warning" not in line and line.strip()]
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"ddtree-generate: error: --params-cache: cannot restore {entry} (")
    assert lines[0].endswith("); delete it to rebuild") and len(lines[0]) < 300
    assert not (tmp_path / "o.jsonl").exists()
