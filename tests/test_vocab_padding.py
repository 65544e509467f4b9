"""Any vocabulary on any mesh: a prime vocabulary (389 tokens) padded to a multiple of tp.

The pair is written here with the project's own writer (random weights, `checkpoint.save_hf`). Its
weights make every real logit negative (a large constant in embedding dim 0, read back through a
negative lm_head row, or a negative final-norm weight when tied), so the padded columns, zeros in
the head, would outrank every real token if they were not masked: a missing mask changes the
greedy choice, the drafter's top-k and log-softmax, and the sampled tokens.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ddtree_jax import drafter, target
from ddtree_jax.checkpoint import save_hf
from ddtree_jax.cli import main
from ddtree_jax.config import load_draft_config
from ddtree_jax.engine import Plan
from ddtree_jax.errors import DDTreeError
from ddtree_jax.models import dense, load_target_config
from ddtree_jax.models.common import PADDED_LOGIT
from ddtree_jax.prompts import Prompt
from ddtree_jax.sampling import GREEDY
from ddtree_jax.scheduler import Generator, Schedule
from ddtree_jax.sharding import make_mesh, param_sharding
from ddtree_jax.weights import assemble

V = 389  # prime: padded to 390, 392, 392 at tp 2, 4, 8
NEW = 16
DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}
PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(0, V, 3 + 2 * i)] for i in range(8)]
SAMPLED = [  # rows 4-7 of the mixed batch; rows 0-3 stay greedy
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 3},
    {"temperature": 0.7, "top_k": 20, "top_p": 1.0, "seed": 4},
    {"temperature": 1.0, "top_k": 0, "top_p": 0.9, "seed": 5},
    {"temperature": 1.3, "top_k": V + 1, "top_p": 0.95, "seed": 6},  # top-k past the vocabulary
]
MIXED = [{"temperature": 0.0}] * 4 + SAMPLED
POPULAR = [5, 50, 100, 150, 200, 250, 300, 350, 380, V - 1]  # V - 1 lies next to the padding


def _write_pair(root, tied: bool) -> tuple:
    """A 2-layer Qwen3 target (untied or tied) and a 1-layer DFlash drafter, random, float32."""
    name = "tied" if tied else "untied"
    tdir, ddir = root / name, root / f"draft_{name}"
    tconf = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": V, "num_hidden_layers": 2}
    tconf |= DIMS | {"tie_word_embeddings": tied}
    dconf = {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 1, "num_target_layers": 2}
    dconf |= DIMS | {"block_size": 4, "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": [0, 1]}}
    for d, conf in ((tdir, tconf), (ddir, dconf)):
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps(conf))
    tcfg = load_target_config(tdir)
    dcfg = load_draft_config(ddir, tcfg)
    tspecs, dspecs = target.weight_specs(tcfg), drafter.weight_specs(dcfg)
    tparams, dparams = _random(tspecs, 0), _random(dspecs, 1)  # small layers: the residual is the embedding
    rng = np.random.default_rng(2)
    tparams["embed"] = rng.standard_normal((V, 64), dtype=np.float32)
    # A constant 20 in embedding dim 0 (about 5 after the final norm), read back through a negative head
    # row, puts every real logit far below the 0 of an unmasked padded column.
    if tied:
        tparams["embed"][:, 0] = -20.0
        tparams["norm"][0] = dparams["norm"][0] = -1.0
    else:  # and dim 1 lifts a few popular ids close to (still below) 0: drafts get accepted
        tparams["embed"][:, :2] = 20.0
        tparams["lm_head"] = 0.2 * rng.standard_normal((64, V), dtype=np.float32)
        tparams["lm_head"][0], tparams["lm_head"][1] = -1.5, 0.0
        tparams["lm_head"][1, POPULAR] = 1.2
    save_hf(tparams, tspecs, tdir, tconf, dtype=np.float32)
    save_hf(dparams, dspecs, ddir, dconf, dtype=np.float32)
    return tdir, ddir


def _random(specs, seed: int, scale: float = 0.02):
    """NumPy float32 weights: normal * scale, norms near 1 (as `weights.random_params`, no compiling)."""
    rng = np.random.default_rng(seed)

    def make(spec):
        noise = rng.standard_normal(spec.shape, dtype=np.float32)
        return 1.0 + 0.1 * noise if spec.is_norm else scale * noise

    return assemble(specs, make)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("prime_vocab")
    return {tied: _write_pair(root, tied) for tied in (False, True)}


@functools.cache
def _load(tdir, ddir, tp):
    placement = param_sharding(make_mesh(tp))
    tcfg, tparams = target.load(tdir, jnp.float32, placement)
    dcfg, dparams = drafter.load(ddir, tcfg, jnp.float32, placement)
    return tcfg, tparams, dcfg, dparams


def generate(dirs, method, tp, options):
    """(output ids, acceptance lengths) of the 8 prompts in one batch on a tp x 1 mesh."""
    tcfg, tparams, dcfg, dparams = _load(*dirs, tp)
    budget = 24 if method == "ddtree" else 0
    plan = Plan(
        target=tcfg,
        draft=None if method == "ar" else dcfg,
        method=method,
        max_new_tokens=NEW,
        budget=budget,
        branching=min(budget, 8) or 1,
        tp=tp,
    )
    dparams = None if method == "ar" else dparams
    gen = Generator(tparams, dparams, plan, (), defaults=dict(GREEDY), schedule=Schedule(8, "static"))
    items = [Prompt(i, i + 1, p, dict(o)) for i, (p, o) in enumerate(zip(PROMPTS, options, strict=True))]
    return [(r.output_ids, r.acceptance_lengths) for r in gen.run(items)]


@pytest.fixture(scope="module")
def one_device(pair):
    """Outcomes on one device (no padding), per (tied, method, options)."""
    cache = {}

    def get(tied, method, options):
        key = (tied, method, json.dumps(options))
        if key not in cache:
            cache[key] = generate(pair[tied], method, 1, options)
        return cache[key]

    return get


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_prime_vocabulary_identical_to_one_device(pair, one_device, method, tp):
    """Greedy rows and sampled rows in one batch: the same tokens and acceptance lengths as on one
    device, every id a real one, and (lossless) ar's tokens."""
    want = one_device(False, method, MIXED)
    assert generate(pair[False], method, tp, MIXED) == want
    assert all(0 <= t < V for ids, _ in want for t in ids)
    assert [ids for ids, _ in want] == [ids for ids, _ in one_device(False, "ar", MIXED)]


def test_prime_vocabulary_greedy_program(pair, one_device):
    """The greedy-only program (every row greedy) too."""
    greedy = [{}] * 8
    assert generate(pair[False], "ddtree", 8, greedy) == one_device(False, "ddtree", greedy)


def test_prime_vocabulary_tied_identical_to_one_device(pair, one_device):
    """Tied embeddings: the padded table is also the head (the target's and the drafter's)."""
    assert generate(pair[True], "ddtree", 8, MIXED) == one_device(True, "ddtree", MIXED)


def test_ddtree_accepts_on_the_prime_pair(one_device):
    """The comparisons above are not vacuous: the random pair's trees are accepted now and then."""
    longest = [max(acc) for _, acc in one_device(False, "ddtree", MIXED)]
    assert max(longest[:4]) > 1 and max(longest[4:]) > 1  # greedy rows, sampled rows


def test_any_vocabulary_splits_heads_still_checked(pair):
    """The vocabulary no longer refuses a mesh (389 is prime); heads and MLP columns still do."""
    tcfg = load_target_config(pair[False][0])
    dcfg = load_draft_config(pair[False][1], tcfg)
    for tp in (2, 4, 8):
        dense.check_divisible(tcfg, tp)
        drafter.check_divisible(dcfg, tp)
    with pytest.raises(DDTreeError, match=r"the target's num_attention_heads \(8\) is not divisible by 3"):
        dense.check_divisible(tcfg, 3)


@pytest.mark.parametrize("tp", [2, 8])
def test_padded_placement_and_logits(pair, tp):
    """Embedding rows and lm_head columns padded with zeros, read shard by shard, equal to `place`
    of the whole weights (the benchmark's path); padded logits masked, real ones as on one device."""
    tdir, ddir = pair[False]
    tcfg, one, *_ = _load(tdir, ddir, 1)
    _, params, *_ = _load(tdir, ddir, tp)
    padded = -(-V // tp) * tp
    assert params["embed"].shape == (padded, 64) and params["lm_head"].shape == (64, padded)
    assert {s.data.shape for s in params["lm_head"].addressable_shards} == {(64, padded // tp)}
    np.testing.assert_array_equal(np.asarray(params["embed"])[:V], np.asarray(one["embed"]))
    assert not np.asarray(params["embed"])[V:].any() and not np.asarray(params["lm_head"])[:, V:].any()
    placement = param_sharding(make_mesh(tp))
    for spec in target.weight_specs(tcfg)[:3]:  # embed, norm, lm_head
        placed = placement.place(spec, one[spec.path[0]])
        assert placed.sharding == params[spec.path[0]].sharding
        np.testing.assert_array_equal(np.asarray(placed), np.asarray(params[spec.path[0]]))

    hidden = jax.random.normal(jax.random.key(0), (2, 3, 64))
    split = jax.shard_map(
        lambda p, h: dense.FAMILY.logits(p, h, V, "model"),
        mesh=params["lm_head"].sharding.mesh,
        in_specs=({"lm_head": P(None, "model")}, P()),
        out_specs=P(None, None, "model"),
        check_vma=False,
    )
    got = np.asarray(split({"lm_head": params["lm_head"]}, hidden))
    np.testing.assert_array_equal(got[..., :V], np.asarray(dense.FAMILY.logits(one, hidden, V)))
    assert (got[..., V:] == PADDED_LOGIT).all()


def test_cli_tp_with_a_prime_vocabulary(pair, one_device, tmp_path):
    """`--tp 8` runs (it was refused: 389 is not divisible by 8) and writes one device's greedy tokens."""
    tdir, ddir = pair[False]
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "input_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))
    argv = ["--target", str(tdir), "--draft", str(ddir), "--prompts", str(prompts), "--out", str(out),
            "--dtype", "float32", "--max-new-tokens", str(NEW), "--batch-size", "8", "--budget", "24",
            "--tp", "8"]  # fmt: skip
    assert main(argv) == 0
    rows = sorted(map(json.loads, out.read_text().splitlines()), key=lambda r: r["id"])  # finish order
    got = [r["output_ids"] for r in rows]
    assert got == [ids for ids, _ in one_device(False, "ddtree", [{}] * 8)]  # lossless: any tree
