"""The fixture maker's specs (tests/make_fixtures.py) rebuild the shipped checkpoints and their goldens:
each one written afresh in a temporary directory with whatever torch and transformers this machine has.
What this package reads is compared exactly (every weight bit for bit, every config, tokenizer and
generation file, the greedy tokens and tokenizer ids); what the reference library computes in floating
point (HF logits and hidden states, the torch drafter's logits) within RELATIVE of the shipped goldens,
which differ by up to ~2e-6 across machines and library versions. The versions that wrote each shipped
fixture are in tests/fixtures/made_with.json; the shipped files are never rewritten here."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import make_fixtures as mf  # noqa: E402
from conftest import FIXTURES  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

GOLDENS = ("golden.npz", "golden_chat.txt")  # the maker's recorded outputs: compared below, not as files
WRITTEN_BY = "transformers_version"  # config keys that name the writer, not the checkpoint
RELATIVE = 1e-5  # max |rebuilt - shipped| / max |shipped| of a floating-point golden
MADE_WITH = json.loads((FIXTURES / "made_with.json").read_text())


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


def made_with(name: str) -> str:
    """The versions that wrote a shipped fixture against this machine's, for failure messages."""
    shipped = MADE_WITH[name]
    return (
        f"shipped by transformers {shipped['transformers']} / torch {shipped['torch']}, rebuilt by "
        f"transformers {transformers.__version__} / torch {torch.__version__}"
    )


def assert_close(got, want, what: str) -> None:
    """`got` within RELATIVE of `want` (relative to the largest |want|), the same shape."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    assert err <= RELATIVE, f"{what}: max |rebuilt - shipped| / max |shipped| = {err:.2e} > {RELATIVE:g}"


def assert_same_checkpoint(built, shipped) -> None:
    """The same files; the same tensors (bit for bit), JSON (writer aside) and other bytes."""
    names = sorted(p.name for p in shipped.iterdir() if p.name not in GOLDENS)
    assert sorted(p.name for p in built.iterdir() if p.name not in GOLDENS) == names
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


def assert_target_goldens(name: str, d) -> None:
    """HF on the rebuilt checkpoint `d`, one forward over each shipped prompt and its greedy tokens:
    the argmax after every prefix is the shipped greedy token, the tokenizer's ids and chat text are
    as shipped, and the prompt's logits and hidden states are within RELATIVE."""
    golden = np.load(FIXTURES / name / "golden.npz")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32
    ).eval()
    for i in range(len(mf.PROMPT_LENS)):
        prompt, new = golden[f"prompt_{i}"], golden[f"greedy_{i}"]
        ids = torch.from_numpy(np.concatenate([prompt, new])).long()
        logits, hidden, last_prenorm = mf.forward_all(model, ids)
        n, why = len(prompt), made_with(name)
        chosen = logits[n - 1 : -1].argmax(-1).numpy()
        np.testing.assert_array_equal(chosen, new, err_msg=f"greedy_{i}, {why}")
        assert_close(logits[:n].numpy(), golden[f"logits_{i}"], f"logits_{i}, {why}")
        assert_close(hidden[:, :n].numpy(), golden[f"hidden_{i}"], f"hidden_{i}, {why}")
        if f"hidden_last_prenorm_{i}" in golden:
            assert_close(last_prenorm[:n].numpy(), golden[f"hidden_last_prenorm_{i}"], f"prenorm_{i}, {why}")
    if mf.TARGETS[name].tokenizer:
        chat, chat_ids, text_ids = mf.check_tokenizer(d)
        assert chat == (FIXTURES / name / "golden_chat.txt").read_text()
        np.testing.assert_array_equal(chat_ids, golden["chat_ids"])
        np.testing.assert_array_equal(text_ids, golden["text_ids"])


@pytest.mark.parametrize("name", list(mf.TARGETS))
def test_target_spec_rebuilds_the_shipped_checkpoint(name, tmp_path):
    mf.write_target(name, tmp_path)
    assert_target_goldens(name, tmp_path)  # before the wrapper, as the maker computed them
    if mf.TARGETS[name].wrapped:
        mf.wrap_kimi_k25(tmp_path)
    assert_same_checkpoint(tmp_path, FIXTURES / name)


@pytest.mark.parametrize("name", list(mf.DRAFTERS))
def test_drafter_spec_rebuilds_the_shipped_checkpoint(name, tmp_path):
    """The weights bit for bit; torch_reference's drafter on the rebuilt weights, fed the shipped
    target goldens, gives the shipped draft logits and context within RELATIVE (blocks exact)."""
    from ddtree_jax.compare.torch_reference import DFlashDrafter

    spec = mf.DRAFTERS[name]
    mf.write_drafter(name, tmp_path)
    assert_same_checkpoint(tmp_path, FIXTURES / name)
    golden = np.load(FIXTURES / name / "golden.npz")
    target_golden = np.load(FIXTURES / spec.target / "golden.npz")
    target = transformers.AutoModelForCausalLM.from_pretrained(
        FIXTURES / spec.target, attn_implementation="eager", dtype=torch.float32
    )
    model = DFlashDrafter.load(tmp_path, target.config.num_hidden_layers, torch.float32)
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    for i in range(len(mf.PROMPT_LENS)):
        block = torch.full((spec.config["block_size"],), spec.config["mask_token_id"], dtype=torch.long)
        block[0] = int(target_golden[f"greedy_{i}"][0])  # [bonus, mask...]
        np.testing.assert_array_equal(block.numpy(), golden[f"block_{i}"])
        feat = torch.from_numpy(golden[f"feat_{i}"])  # the target's HF features: checked with the target
        with torch.no_grad():
            logits = model.hidden(feat, embed[block]) @ lm_head.T
            ctx = model.hidden_norm(model.fc(feat))
        assert_close(logits.numpy(), golden[f"draft_logits_{i}"], f"draft_logits_{i}, {made_with(name)}")
        assert_close(ctx.numpy(), golden[f"ctx_{i}"], f"ctx_{i}, {made_with(name)}")
    if spec.config["rope_scaling"]:
        yarn = mf.yarn_goldens(spec)
        assert_close(yarn["yarn_inv_freq"], golden["yarn_inv_freq"], "yarn_inv_freq")
        assert yarn["yarn_legacy_factor"] == golden["yarn_legacy_factor"]


def test_every_shipped_checkpoint_has_a_spec_and_its_versions():
    """Every shipped checkpoint has a spec and a made_with.json entry; where its config names the
    transformers that wrote it, the entry says the same."""
    shipped = {p.name for p in FIXTURES.iterdir() if (p / "config.json").exists()}
    assert shipped == set(mf.SPECS)
    assert shipped == {k for k in MADE_WITH if not k.startswith("_")}
    for name in shipped:
        config = json.loads((FIXTURES / name / "config.json").read_text())
        writer = config.get(WRITTEN_BY) or config.get("text_config", {}).get(WRITTEN_BY)
        assert writer in (None, MADE_WITH[name]["transformers"]), name
