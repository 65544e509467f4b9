"""The fixture maker's specs (tests/make_fixtures.py) rebuild the shipped checkpoints: each one written
afresh in a temporary directory, every weight bit for bit and every config, tokenizer and generation
file equal to the shipped one (the shipped files are never rewritten: their goldens record HF's
outputs under the transformers that made them)."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import make_fixtures as mf  # noqa: E402
from conftest import FIXTURES  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

GOLDENS = ("golden.npz", "golden_chat.txt")  # the maker's recorded outputs, not rebuilt here
WRITTEN_BY = "transformers_version"  # config keys that name the writer, not the checkpoint


def tensors(d) -> dict:
    """Every tensor of a directory's safetensors files, by name."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= load_file(f)
    return out


def without_writer(obj):
    """A JSON value without the keys that name the transformers version that wrote it."""
    if isinstance(obj, dict):
        return {k: without_writer(v) for k, v in obj.items() if k != WRITTEN_BY}
    return obj


def assert_same_checkpoint(built, shipped) -> None:
    """The same files; the same tensors (bit for bit), JSON (writer aside) and other bytes."""
    names = sorted(p.name for p in shipped.iterdir() if p.name not in GOLDENS)
    assert sorted(p.name for p in built.iterdir()) == names
    got, want = tensors(built), tensors(shipped)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    for name in names:
        if name.endswith(".json"):
            a, b = (json.loads((d / name).read_text()) for d in (built, shipped))
            if name.endswith(".index.json"):  # shard names and sizes, not the tensors' bytes
                a, b = a["weight_map"], b["weight_map"]
            assert without_writer(a) == without_writer(b), name
        elif not name.endswith(".safetensors"):
            assert (built / name).read_bytes() == (shipped / name).read_bytes(), name


@pytest.mark.parametrize("name", list(mf.TARGETS))
def test_target_spec_rebuilds_the_shipped_checkpoint(name, tmp_path):
    mf.write_target(name, tmp_path)
    if mf.TARGETS[name].wrapped:
        mf.wrap_kimi_k25(tmp_path)
    assert_same_checkpoint(tmp_path, FIXTURES / name)


@pytest.mark.parametrize("name", list(mf.DRAFTERS))
def test_drafter_spec_rebuilds_the_shipped_checkpoint(name, tmp_path):
    mf.write_drafter(name, tmp_path)
    assert_same_checkpoint(tmp_path, FIXTURES / name)


def test_every_shipped_checkpoint_has_a_spec():
    shipped = {p.name for p in FIXTURES.iterdir() if (p / "config.json").exists()}
    assert shipped == set(mf.SPECS)
