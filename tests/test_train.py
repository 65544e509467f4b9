"""Training module: the losses go down, the drafter's training forward equals its inference path,
and HF checkpoints written from our parameters load back exactly."""

import argparse
import dataclasses
import hashlib
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import drafter, target, train
from ddtree_jax.checkpoint import save_hf
from ddtree_jax.kv_cache import write
from ddtree_jax.models.gqa import empty_cache
from ddtree_jax.sharding import make_mesh, param_sharding
from ddtree_jax.weights import random_params

VOCAB, MASK_ID = 96, 95


def tiny_pair(block_size=4):
    tcfg = train.make_target_config(VOCAB, hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, ff=64)
    dcfg = train.make_draft_config(tcfg, MASK_ID, layers=1, block_size=block_size, ff=48)
    return tcfg, dcfg


def tokens_of(seed, batch, length):
    return jnp.asarray(np.random.default_rng(seed).integers(0, MASK_ID, (batch, length)), jnp.int32)


def test_target_step_lowers_loss():
    tcfg, _ = tiny_pair()
    params = train.init_params(target.weight_specs(tcfg), 0, tcfg.num_layers)
    trainer = train.target_trainer(tcfg, params, train.OptimConfig(steps=10, lr=1e-2, warmup=1))
    batch = tokens_of(0, 2, 17)
    before = float(train.target_loss(trainer.params, tcfg, batch))
    for _ in range(3):
        trainer.step(batch, jax.random.key(0))
    assert float(train.target_loss(trainer.params, tcfg, batch)) < before


def test_residual_dropout_drops_at_its_rate_and_keeps_the_mean():
    drop = train.residual_dropout(jax.random.key(0), 0.2, 2)
    x = jnp.ones((512, 256), jnp.float32)
    first, second = np.asarray(drop(x)), np.asarray(drop(x))
    assert set(np.unique(first)) == {0.0, 1.25}
    assert abs((first == 0).mean() - 0.2) < 0.005 and abs(first.mean() - 1.0) < 0.01
    assert (first != second).any()  # each call draws its own mask


def test_target_dropout_step_lowers_the_plain_loss():
    tcfg, _ = tiny_pair()
    params = train.init_params(target.weight_specs(tcfg), 0, tcfg.num_layers)
    batch = tokens_of(0, 2, 17)
    plain = float(train.target_loss(params, tcfg, batch))
    noisy = [float(train.target_loss(params, tcfg, batch, jax.random.key(k), 0.3)) for k in (0, 0, 1)]
    assert noisy[0] == noisy[1] and noisy[0] != noisy[2] and plain not in noisy
    oc = train.OptimConfig(steps=10, lr=1e-2, warmup=1)
    trainer, plain_trainer = (
        train.target_trainer(tcfg, params, oc, 0.1),
        train.target_trainer(tcfg, params, oc),
    )
    for k in range(3):
        trainer.step(batch, jax.random.key(k))
        plain_trainer.step(batch, jax.random.key(k))
    assert float(train.target_loss(trainer.params, tcfg, batch)) < plain
    # the trainer applies the dropout: its steps differ from the plain trainer's
    assert not np.allclose(np.asarray(trainer.params["norm"]), np.asarray(plain_trainer.params["norm"]))


def test_draft_step_lowers_loss():
    tcfg, dcfg = tiny_pair()
    tparams = train.init_params(target.weight_specs(tcfg), 0, tcfg.num_layers)
    params = train.init_params(drafter.weight_specs(dcfg), 1, dcfg.num_layers)
    oc = train.OptimConfig(steps=10, lr=1e-2, warmup=1)
    trainer = train.draft_trainer(dcfg, params, tparams, tcfg, oc, num_anchors=3, gamma=4.0)
    batch, key = tokens_of(1, 2, 16), jax.random.key(3)

    def loss(p):
        return float(train.draft_loss(p, dcfg, tparams, tcfg, batch, key, 3, 4.0)[0])

    before = loss(trainer.params)
    for _ in range(3):
        trainer.step(batch, key)
    assert loss(trainer.params) < before


@pytest.mark.parametrize("consistent, greedy_anchors", [(True, False), (False, True), (True, True)])
def test_label_mask_keeps_labels_the_greedy_path_reaches(consistent, greedy_anchors):
    rng = np.random.default_rng(5)
    b, length, k = 3, 40, 6
    greedy = rng.integers(0, 4, (b, length))
    # text that follows the greedy choice most of the time, so long kept runs occur
    tokens = np.where(
        rng.random((b, length)) < 0.7, np.roll(greedy, 1, axis=1), rng.integers(0, 4, (b, length))
    )
    anchors = np.sort(
        np.stack([rng.choice(np.arange(1, length - k + 2), 5, replace=False) for _ in range(b)])
    )
    args = (jnp.asarray(tokens), jnp.asarray(greedy), jnp.asarray(anchors), k, consistent, greedy_anchors)
    got = np.asarray(train.label_mask(*args))
    want = np.zeros_like(got)
    for row in range(b):
        for n, a in enumerate(anchors[row]):
            for j in range(1, k):  # slot j: label greedy[a + j - 1]
                path = (
                    all(tokens[row, a + i] == greedy[row, a + i - 1] for i in range(1, j)) or not consistent
                )
                bonus = tokens[row, a] == greedy[row, a - 1] or not greedy_anchors
                want[row, n, j - 1] = path and bonus
    np.testing.assert_array_equal(got, want)
    assert 0 < want.mean() < 1


def test_draft_step_with_consistent_labels_lowers_loss():
    tcfg, dcfg = tiny_pair()
    tparams = train.init_params(target.weight_specs(tcfg), 0, tcfg.num_layers)
    params = train.init_params(drafter.weight_specs(dcfg), 1, dcfg.num_layers)
    oc = train.OptimConfig(steps=10, lr=1e-2, warmup=1)
    trainer = train.draft_trainer(
        dcfg, params, tparams, tcfg, oc, 3, 4.0, consistent=True, greedy_anchors=True
    )
    # the target's own greedy continuation: every label is kept, so the loss equals the plain one
    own = tokens_of(1, 2, 16)
    for _ in range(16):  # causal: after i passes the first i + 1 tokens are the greedy path's
        own = jnp.concatenate([own[:, :1], train.target_teacher(tparams, tcfg, dcfg, own)[1][:, :-1]], axis=1)
    key = jax.random.key(3)

    def loss(p, consistent):
        return float(train.draft_loss(p, dcfg, tparams, tcfg, own, key, 3, 4.0, consistent, consistent)[0])

    assert loss(trainer.params, True) == pytest.approx(loss(trainer.params, False), rel=1e-6)
    # on other text some labels go: the loss and agreement are means over the kept ones only
    text = tokens_of(2, 2, 16)
    got_loss, got_agree = train.draft_loss(
        trainer.params, dcfg, tparams, tcfg, text, key, 3, 4.0, True, False
    )
    features, greedy = train.target_teacher(tparams, tcfg, dcfg, text)
    anchors = train.sample_anchors(key, 2, 16, 3, dcfg.block_size)
    logits = np.asarray(train.draft_train_logits(trainer.params, dcfg, tparams, features, text, anchors))
    keep = np.asarray(train.label_mask(text, greedy, anchors, dcfg.block_size, True, False))
    assert 0 < keep.mean() < 1
    where = np.asarray(anchors)[:, :, None] + np.arange(dcfg.block_size - 1)
    labels = np.take_along_axis(np.asarray(greedy), where.reshape(2, -1), 1).reshape(where.shape)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    w = np.asarray(train.slot_weights(dcfg.block_size, 4.0))
    assert float(got_loss) == pytest.approx((ce * w * keep).sum() / keep.sum(), rel=1e-5)
    hits = (logits.argmax(-1) == labels) & keep
    want_agree = hits.sum((0, 1)) / np.maximum(keep.sum((0, 1)), 1)
    np.testing.assert_allclose(np.asarray(got_agree), want_agree, rtol=1e-6)
    before = loss(trainer.params, True)
    for _ in range(3):
        trainer.step(own, key)
    assert loss(trainer.params, True) < before


def test_draft_training_forward_equals_inference():
    tcfg, dcfg = tiny_pair(block_size=5)
    tparams = random_params(target.weight_specs(tcfg), 0, jnp.float32, scale=0.2)
    params = random_params(drafter.weight_specs(dcfg), 1, jnp.float32, scale=0.2)
    length = 20
    tokens = tokens_of(2, 1, length)
    features, _ = train.target_teacher(tparams, tcfg, dcfg, tokens)
    anchors = jnp.asarray([[1, 7, 15]], jnp.int32)  # 15 + 5 = 20: the last block reaches the end
    got = train.draft_train_logits(params, dcfg, tparams, features, tokens, anchors)  # [1, 3, K-1, V]
    for n, a in enumerate(anchors[0].tolist()):
        # Inference: the context K/V of positions < a in a cache, then one block after bonus tokens[a].
        kv = drafter.context_kv(params, dcfg, features[:, :a], jnp.arange(a, dtype=jnp.int32)[None])
        d = dcfg.dims
        cache = empty_cache(dcfg.num_layers, 1, d.num_kv_heads, 32, d.head_dim, jnp.float32)
        cache = write(cache, kv, jnp.zeros((1,), jnp.int32))
        cache.lengths = jnp.asarray([a], jnp.int32)
        want = drafter.draft_logits(params, dcfg, tparams, tokens[:, a], cache)  # [1, K-1, V]
        np.testing.assert_allclose(got[0, n], want[0], rtol=1e-4, atol=1e-4)


def _bf16_exact(params):
    return jax.tree.map(lambda x: jnp.asarray(x.astype(jnp.bfloat16), jnp.float32), params)


def test_hf_writer_round_trips(tmp_path):
    tcfg, dcfg = tiny_pair()
    # fused projections, as a checkpoint's config reads: save_hf writes HF's tensors of them
    tcfg = dataclasses.replace(tcfg, eos_token_ids=(0,), fused_projections=True)
    dcfg = dataclasses.replace(dcfg, fused_projections=True)
    tparams = _bf16_exact(random_params(target.weight_specs(tcfg), 0, jnp.float32))
    dparams = _bf16_exact(random_params(drafter.weight_specs(dcfg), 1, jnp.float32))
    save_hf(tparams, target.weight_specs(tcfg), tmp_path / "t", train.target_hf_config(tcfg))
    save_hf(dparams, drafter.weight_specs(dcfg), tmp_path / "d", train.draft_hf_config(dcfg, tcfg))
    place = param_sharding(make_mesh(1, 1))
    cfg2, tparams2 = target.load(tmp_path / "t", jnp.float32, place)
    dcfg2, dparams2 = drafter.load(tmp_path / "d", cfg2, jnp.float32, place)
    assert cfg2 == tcfg and dcfg2 == dcfg
    for a, b in [(tparams, tparams2), (dparams, dparams2)]:
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    raw = (tmp_path / "t" / "model.safetensors").read_bytes()
    assert b'"BF16"' in raw and b"lm_head" not in raw  # tied embeddings


def test_eval_loss_averages_every_window_whatever_the_batch():
    """Held-out loss = mean over all consecutive windows, with batches larger than the window count
    and a smaller last batch (an earlier version returned 0 when the batch exceeded the windows)."""
    import pytest

    tcfg, _ = tiny_pair()
    params = train.init_params(target.weight_specs(tcfg), 0, tcfg.num_layers)
    stream = np.asarray(tokens_of(1, 1, 5 * 8 + 3)[0])  # 5 windows of 8 (+1 label), 2 tokens spare
    windows = np.stack([stream[i * 8 : i * 8 + 9] for i in range(5)])
    per_window = [float(train.target_loss(params, tcfg, jnp.asarray(w[None]))) for w in windows]
    for batch in (1, 2, 5, 64):
        got = train.eval_target_loss(params, tcfg, stream, 8, batch)
        np.testing.assert_allclose(got, np.mean(per_window), rtol=1e-5)
    with pytest.raises(ValueError, match="no window"):
        train.eval_target_loss(params, tcfg, stream[:8], 8, 4)


def test_held_out_prompts_from_file_starts_and_strides(tmp_path):
    """scripts/train_default_pair.py's prompts stage: file starts in hash order, and with a stride a
    prompt every S lines while as many lines again follow, each the file's own lines."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "train_default_pair.py"
    spec = importlib.util.spec_from_file_location("train_default_pair", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    files = {f"pkg/m{i}.py": "".join(f"line {i}.{j}\n" for j in range(n)) for i, n in enumerate([9, 20, 3])}
    corpus = {"heldout": list(files.items())}
    args = argparse.Namespace(prompt_lines=4, num_prompts=5, prompt_stride=0, prompts_out=None)

    def prompts():
        script.stage_prompts(args, corpus, tmp_path, {})
        out = args.prompts_out or tmp_path / "prompts.jsonl"
        return [json.loads(line) for line in out.read_text().splitlines()]

    long_enough = sorted(
        (r for r, t in files.items() if t.count("\n") >= 8),
        key=lambda r: hashlib.sha256(r.encode()).hexdigest(),
    )
    assert [p["id"] for p in prompts()] == long_enough  # m2 (3 lines) is too short
    args.prompt_stride, args.prompts_out = 5, tmp_path / "strided.jsonl"
    got = {p["id"]: p["prompt"] for p in prompts()}
    m0, m1 = (files[f"pkg/m{i}.py"].splitlines(keepends=True) for i in (0, 1))
    # m0 (9 lines): line 1 only (a second start at line 6 leaves 4 < 8 lines); m1 (20): lines 1, 6, 11
    expected = {
        "pkg/m0.py": "".join(m0[0:4]),
        "pkg/m1.py": "".join(m1[0:4]),
        "pkg/m1.py:6": "".join(m1[5:9]),
        "pkg/m1.py:11": "".join(m1[10:14]),
    }
    assert got == expected
