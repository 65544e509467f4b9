"""Training a DFlash2 drafter (train.py): its training forward equals the inference path (convolutions
within each block, causal and windowed layers, logit transforms), and a step with the selector's loss
lowers the loss."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import drafter, target, train
from ddtree_jax.config import DFlash2Config, load_draft_config
from ddtree_jax.kv_cache import write
from ddtree_jax.models.gqa import empty_cache
from ddtree_jax.sharding import make_mesh, param_sharding
from ddtree_jax.weights import random_params

VOCAB, MASK_ID = 96, 95


def tiny_pair(block_size=5):
    tcfg = train.make_target_config(VOCAB, hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, ff=64)
    dcfg = train.make_draft_config(tcfg, MASK_ID, layers=2, block_size=block_size, ff=48)
    extra = DFlash2Config(
        conv_kernel_size=3,
        conv_group_size=8,
        selector_rank=4,
        selector_top_k=4,
        input_embedding_scale=1.5,
        output_multiplier=0.7,
        final_logit_softcapping=6.0,
        sliding_window=6,
        sliding=(False, True),
        causal=(False, True),
    )
    return tcfg, dataclasses.replace(dcfg, dflash2=extra)


def tokens_of(seed, batch, length):
    return jnp.asarray(np.random.default_rng(seed).integers(0, MASK_ID, (batch, length)), jnp.int32)


def test_training_forward_equals_inference():
    tcfg, dcfg = tiny_pair()
    tparams = random_params(target.weight_specs(tcfg), 0, jnp.float32, scale=0.2)
    params = random_params(drafter.weight_specs(dcfg), 1, jnp.float32, scale=0.2)
    tokens = tokens_of(2, 1, 20)
    features, _ = train.target_teacher(tparams, tcfg, dcfg, tokens)
    anchors = jnp.asarray([[1, 7, 15]], jnp.int32)  # contexts 1, 7 and 15 against a window of 6
    got = train.draft_train_logits(params, dcfg, tparams, features, tokens, anchors)  # [1, 3, K-1, V]
    d = dcfg.dims
    for n, a in enumerate(anchors[0].tolist()):
        kv = drafter.context_kv(params, dcfg, features[:, :a], jnp.arange(a, dtype=jnp.int32)[None])
        cache = empty_cache(dcfg.num_layers, 1, d.num_kv_heads, 32, d.head_dim, jnp.float32)
        cache = write(cache, kv, jnp.zeros((1,), jnp.int32))
        cache.lengths = jnp.asarray([a], jnp.int32)
        want = drafter.draft_logits(params, dcfg, tparams, tokens[:, a], cache)  # [1, K-1, V]
        np.testing.assert_allclose(got[0, n], want[0], rtol=1e-4, atol=1e-4)


def test_step_with_the_selector_lowers_loss():
    tcfg, dcfg = tiny_pair(block_size=4)
    dcfg = dataclasses.replace(dcfg, dflash2=dataclasses.replace(dcfg.dflash2, selector_top_k=32))
    tparams = train.init_params(target.weight_specs(tcfg), 0, tcfg.num_layers)
    params = train.init_params(drafter.weight_specs(dcfg), 1, dcfg.num_layers)
    oc = train.OptimConfig(steps=10, lr=1e-2, warmup=1)
    trainer = train.draft_trainer(dcfg, params, tparams, tcfg, oc, num_anchors=3, gamma=4.0)
    batch, key = tokens_of(1, 2, 16), jax.random.key(3)

    def losses(p):
        loss = float(train.draft_loss(p, dcfg, tparams, tcfg, batch, key, 3, 4.0)[0])
        plain = dataclasses.replace(dcfg, dflash2=dataclasses.replace(dcfg.dflash2, selector=False))
        return loss, float(train.draft_loss(p, plain, tparams, tcfg, batch, key, 3, 4.0)[0])

    before, plain_before = losses(trainer.params)
    assert before > plain_before  # the selector's term is in the loss
    for _ in range(3):
        trainer.step(batch, key)
    after, plain_after = losses(trainer.params)
    assert after < before and after - plain_after < before - plain_before  # the selector's term fell too


def test_written_checkpoint_loads_back(tmp_path):
    """train.draft_hf_config + save_hf write the published layout: drafter.load reads the same config
    and weights back (float32 here)."""
    import ml_dtypes

    from ddtree_jax.checkpoint import save_hf
    from ddtree_jax.sharding import make_mesh, param_sharding

    tcfg, dcfg = tiny_pair()
    params = random_params(drafter.weight_specs(dcfg), 1, jnp.float32, scale=0.2)
    config = train.draft_hf_config(dcfg, tcfg)
    assert config["architectures"] == ["DFlash2DraftModel"] and "is_causal" not in config
    save_hf(params, drafter.weight_specs(dcfg), tmp_path, config, dtype=ml_dtypes.bfloat16)
    unfused = dataclasses.replace(load_draft_config(tmp_path, tcfg), fused_projections=False)  # dcfg's layout
    cfg, loaded = drafter.load(tmp_path, tcfg, jnp.float32, param_sharding(make_mesh(1, 1)), cfg=unfused)
    assert cfg.dflash2 == dcfg.dflash2 and cfg.block_size == dcfg.block_size
    as_bf16 = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)), params)
    jax.tree.map(np.testing.assert_array_equal, as_bf16, jax.tree.map(np.asarray, loaded))


def test_training_the_selector_alone_keeps_the_drafter():
    """draft_trainer(only=("selector",)) with no weight decay: the selector learns, every other weight
    stays exactly (the marginals of the drafter it started from)."""
    tcfg, dcfg = tiny_pair(block_size=4)
    dcfg = dataclasses.replace(dcfg, dflash2=dataclasses.replace(dcfg.dflash2, selector_top_k=32))
    tparams = train.init_params(target.weight_specs(tcfg), 0, tcfg.num_layers)
    params = train.init_params(drafter.weight_specs(dcfg), 1, dcfg.num_layers)
    oc = train.OptimConfig(steps=10, lr=1e-2, warmup=1, weight_decay=0.0)
    trainer = train.draft_trainer(dcfg, params, tparams, tcfg, oc, 3, 4.0, only=("selector",))
    for _ in range(2):
        trainer.step(tokens_of(1, 2, 16), jax.random.key(3))
    for name in params:
        same = jax.tree.leaves(
            jax.tree.map(lambda a, b: bool(jnp.all(a == b)), params[name], trainer.params[name])
        )
        assert all(same) == (name != "selector"), name


def test_init_from_the_bundled_v1_drafter_drafts_as_it():
    """train_default_pair.py --init-draft: the DFlash2 drafter made from the bundled v1 drafter (identity
    convolutions) gives its logits exactly (what results/dflash2's marginal rows rely on)."""
    import importlib.util
    from pathlib import Path

    from ddtree_jax.pair import load_pair

    path = Path(__file__).parent.parent / "scripts" / "train_default_pair.py"
    spec = importlib.util.spec_from_file_location("train_default_pair", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assets = Path(__file__).parent.parent / "ddtree_jax" / "assets" / "default_pair"
    pair = load_pair(assets / "target", assets / "draft", "float32")
    tcfg, v1 = pair.target, pair.draft
    dcfg = train.make_draft_config(tcfg, v1.mask_token_id, 2, v1.block_size, None, v1.target_layer_ids)
    extra = DFlash2Config(2, 16, 8, 4, sliding=(False, False), causal=(False, False))
    dcfg = dataclasses.replace(dcfg, dflash2=extra)
    params = script.from_v1_drafter(
        train.init_params(drafter.weight_specs(dcfg), 2, 2), dcfg, assets / "draft", tcfg
    )
    feats = jax.random.normal(jax.random.key(0), (1, 20, len(v1.target_layer_ids) * tcfg.hidden_size))
    d = v1.dims
    outs = []
    # the v1 drafter in the trainer's layout (unfused; fused and unfused matmuls round differently)
    v1 = dataclasses.replace(v1, fused_projections=dcfg.fused_projections)
    _, v1_params = drafter.load(assets / "draft", tcfg, jnp.float32, param_sharding(make_mesh(1, 1)), cfg=v1)
    for cfg, p in ((v1, v1_params), (dcfg, params)):
        cache = empty_cache(2, 1, d.num_kv_heads, 64, d.head_dim, jnp.float32)
        cache = write(cache, drafter.context_kv(p, cfg, feats, jnp.arange(20)[None]), jnp.array([0]))
        cache.lengths = jnp.array([20], jnp.int32)
        outs.append(np.asarray(drafter.draft_logits(p, cfg, pair.params, jnp.array([5]), cache)))
    np.testing.assert_array_equal(outs[0], outs[1])
    # every tensor is one of the new drafter's, in its layout: the trainer trains what save_hf writes (a
    # fused v1 copy beside the unfused initialisation drafted as v1 and saved the random tensors)
    specs = {spec.path for spec in drafter.weight_specs(dcfg)}
    held = {path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert {tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path) for path in held} == specs
