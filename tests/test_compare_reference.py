"""ddtree-compare reference: agreement on the fixtures, and a weight perturbed on the PyTorch side (a tmp
copy of a checkpoint) found at its prompt and position; bad flags."""

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import FIXTURES  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from ddtree_jax.compare.cli import main  # noqa: E402

TP, DRAFT = "qwen3_gqa4_tp", "dflash_qwen3_gqa4_tp"
PROMPT_IDS = ("golden-1", "golden-3")  # 5 and 17 tokens
# Token 167 first appears at position 5 of golden-3's prompt and in no other prompt: scaling its
# embedding row changes the target's logits from that position on, and nowhere before it.
PERTURBED_TOKEN, PERTURBED_PROMPT, PERTURBED_POSITION = 167, "golden-3", 5


@pytest.fixture
def prompts(tmp_path):
    lines = [json.loads(s) for s in (FIXTURES / "prompts.jsonl").read_text().splitlines()]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines if r["id"] in PROMPT_IDS))
    return path


def argv(prompts, report, *flags):
    draft = () if "ar" in flags else ("--draft", str(FIXTURES / DRAFT))  # ar takes no drafter
    return [
        "reference",
        *("--target", str(FIXTURES / TP), *draft, "--prompts", str(prompts)),
        *("--max-new-tokens", "8", "--budgets", "7", "--dtype", "float32", "--report", str(report)),
        *flags,
    ]


def report_of(path):
    return json.loads((path / "report.json").read_text())


def perturbed_copy(src, dst, name, change):
    """A copy of checkpoint directory `src` with weight `name` replaced by change(weight)."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights[name] = change(weights[name]).astype(weights[name].dtype)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_agrees_on_the_fixture_pair(tmp_path, prompts, capsys):
    assert main(argv(prompts, tmp_path / "ok")) == 0
    ok = report_of(tmp_path / "ok")
    assert ok["verdict"] == "agree" and capsys.readouterr().out.startswith("reference: agree")
    names = [c["name"] for c in ok["comparisons"]]
    assert names == [
        "target logits",
        "drafter logits",
        "ar tokens",
        "dflash tokens",
        "dflash acceptance",
        "ddtree-7 tokens",
        "ddtree-7 acceptance",
    ]
    assert all(c["prompts"] == c["identical"] == 2 and not c["divergences"] for c in ok["comparisons"])
    for entry in ok["logits"]:
        assert entry["target"]["max_rel"] < 1e-4 and entry["target"]["top1"] == 1.0
        assert entry["draft"]["max_rel"] < 1e-4
    assert (tmp_path / "ok" / "report.md").read_text().startswith("# ddtree-compare reference: agree")
    for png in ("logit_error", "acceptance_dflash", "acceptance_ddtree-7"):
        assert (tmp_path / "ok" / f"{png}.png").stat().st_size > 1000


def test_flags_a_perturbed_target_weight_at_its_prompt_and_position(tmp_path, prompts):
    row = lambda w: np.where(np.arange(w.shape[0])[:, None] == PERTURBED_TOKEN, 2 * w, w)  # noqa: E731
    copy = perturbed_copy(FIXTURES / TP, tmp_path / "target", "model.embed_tokens.weight", row)
    assert main(argv(prompts, tmp_path / "r", "--method", "ar", "--reference-target", str(copy))) == 0
    rep = report_of(tmp_path / "r")
    assert rep["verdict"] == "differ"
    logits = next(c for c in rep["comparisons"] if c["name"] == "target logits")
    found = {d["id"]: d for d in logits["divergences"]}
    assert found[PERTURBED_PROMPT]["position"] == PERTURBED_POSITION
    assert found[PERTURBED_PROMPT]["max_rel"] > 1e-2
    prompt_len = {"golden-1": 5, "golden-3": 17}
    for id_, d in found.items():  # elsewhere only where an output produced the token
        assert id_ == PERTURBED_PROMPT or d["position"] >= prompt_len[id_]


def test_flags_a_perturbed_drafter_weight_at_depth_one(tmp_path, prompts):
    copy = perturbed_copy(
        FIXTURES / DRAFT, tmp_path / "draft", "layers.0.mlp.down_proj.weight", lambda w: 1.5 * w
    )
    assert main(argv(prompts, tmp_path / "r", "--method", "dflash", "--reference-draft", str(copy))) == 0
    rep = report_of(tmp_path / "r")
    assert rep["verdict"] == "differ"
    comparisons = {c["name"]: c for c in rep["comparisons"]}
    assert comparisons["target logits"]["identical"] == 2
    drafter = comparisons["drafter logits"]
    assert drafter["identical"] == 0
    assert [(d["id"], d["position"]) for d in drafter["divergences"]] == [(i, 1) for i in PROMPT_IDS]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--budgets", "x"], "--budgets 'x': expected a comma list of integers"),
    ],
)
def test_bad_flags(tmp_path, prompts, capsys, flags, needle):
    assert main(argv(prompts, tmp_path / "r", *flags)) == 1
    err = capsys.readouterr().err
    assert err.startswith("ddtree-compare: error: ") and needle in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()
