#!/usr/bin/env python
"""Write the DeepSeek-V3 / Kimi-K2 fixtures under tests/fixtures/ (and only those), with HF transformers.

    /tmp/tv/bin/python scripts/make_golden_deepseek.py [--out tests/fixtures]

Uses scripts/make_golden.py's helpers (deterministic npz, greedy with margins, HF hidden states, the
independent plain-torch DFlash drafter forward) and writes, all float32:
  * deepseek_v3_qlora  q_lora_rank, n_group 4 > topk_group 2, yarn (mscale_all_dim 0.5: both the
                       cos/sin factor and the softmax scale differ from 1), interleaved RoPE,
                       first_k_dense_replace 1, one shared expert, norm_topk_prob
  * deepseek_v3_tp     direct q_proj (q_lora_rank null), 8 heads and 8 experts (meshes up to 8),
                       n_group 1, no yarn, rotate-half RoPE, two shared experts, no renormalising
  * kimi_k25_wrapped   a Kimi-K2.5-style wrapper: KimiK25ForConditionalGeneration with a kimi_k2
                       `text_config` (yarn factor 4, mscale = mscale_all_dim = 1), weights under
                       `language_model.`, plus vision-tower tensors the loader must leave alone
  * dflash_deepseek_v3_tp  a DFlash drafter on deepseek_v3_tp with yarn RoPE in its own config
                       (mscale = mscale_all_dim = 1, Kimi-K2.5-DFlash style); golden draft logits from the
                       plain-torch drafter with the LEGACY cos/sin factor 1 + 0.1 ln(factor), the yarn
                       frequencies computed here in torch and checked against HF's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil

import make_golden as mg
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

COMMON = dict(
    vocab_size=mg.VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=16,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    first_k_dense_replace=1,
)

TARGETS = {
    "deepseek_v3_qlora": dict(
        seed=1111,
        std=0.3,
        cfg=dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "rope_theta": 10000.0,
            },
        ),
    ),
    "deepseek_v3_tp": dict(
        seed=1212,
        std=0.3,
        cfg=dict(
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=8,
            q_lora_rank=None,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            rope_interleave=False,
            rope_theta=10000.0,
        ),
    ),
    "kimi_k25_wrapped": dict(
        seed=1313,
        std=0.3,
        wrapped=True,
        cfg=dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.827,
            rope_interleave=True,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 1,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "rope_theta": 50000.0,
            },
        ),
    ),
}

DRAFT = dict(
    name="dflash_deepseek_v3_tp",
    target="deepseek_v3_tp",
    seed=1414,
    std=0.3,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    block_size=6,
    mask_token_id=255,
    target_layer_ids=[0, 1],
    rope_theta=10000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)


def reinit(model, seed: int, std: float) -> None:
    """Matrices and stacked experts ~ N(0, std^2), norms ~ U[0.5, 1.5], choice biases ~ N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim in (2, 3):
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif p.ndim == 1 and "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def build(spec: dict) -> DeepseekV3ForCausalLM:
    cfg = DeepseekV3Config(**(COMMON | spec["cfg"]))
    cfg._attn_implementation = "eager"
    torch.manual_seed(spec["seed"])
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    reinit(model, spec["seed"], spec["std"])
    model.generation_config.eos_token_id = 1
    model.generation_config.bos_token_id = 0
    return model


def goldens(model, seed: int) -> dict:
    """Prompts, HF logits, greedy continuations (margins >= MIN_MARGIN) and hidden states."""
    arrays = {}
    for i, plen in enumerate(mg.PROMPT_LENS):
        for attempt in range(100):
            rng = np.random.RandomState(seed * 1000 + 10 * i + attempt)
            prompt = rng.randint(3, mg.VOCAB, size=plen).astype(np.int32)
            ids = torch.from_numpy(prompt).long()
            new, margins = mg.greedy(model, ids)
            if float(margins.min()) >= mg.MIN_MARGIN:
                break
        else:
            raise RuntimeError(f"prompt {i}: no seed with margin >= {mg.MIN_MARGIN}")
        logits, hidden, _ = mg.forward_all(model, ids)
        arrays[f"prompt_{i}"] = prompt
        arrays[f"logits_{i}"] = logits.float().numpy()
        arrays[f"greedy_{i}"] = new.numpy().astype(np.int32)
        arrays[f"margin_{i}"] = np.float32(min(float(margins.min()), float(mg.top2_gap(logits).min())))
        arrays[f"hidden_{i}"] = hidden.float().numpy()
        print(f"   prompt {i}: margin {float(margins.min()):.4f} (attempt {attempt}), "
              f"distinct greedy tokens {len(set(new.tolist()))}")  # fmt: skip
    return arrays


def wrap_kimi_k25(d: str) -> None:
    """Rewrite an HF DeepseekV3 directory as a Kimi-K2.5-style wrapper checkpoint."""
    path = os.path.join(d, "model.safetensors")
    tensors = {"language_model." + k: v for k, v in load_file(path).items()}
    gen = torch.Generator().manual_seed(7)
    tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 2, generator=gen)
    tensors["mm_projector.proj.0.weight"] = torch.randn(64, 16, generator=gen)
    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, path, metadata={"format": "pt"})
    cpath = os.path.join(d, "config.json")
    with open(cpath) as f:
        text = json.load(f)
    text["model_type"] = "kimi_k2"
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {"model_type": "moonvit", "patch_size": 2, "hidden_size": 16},
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    mg.write_json(cpath, wrapper)


def make_target(name: str, spec: dict, root: str) -> dict:
    d = os.path.join(root, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    model = build(spec)
    model.save_pretrained(d, safe_serialization=True)
    reloaded = DeepseekV3ForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32
    ).eval()
    for k, v in model.state_dict().items():
        assert torch.equal(v, reloaded.state_dict()[k]), k
    print(f"== {name}: scaling {reloaded.model.layers[0].self_attn.scaling:.6f}, "
          f"rope attention factor {reloaded.model.rotary_emb.attention_scaling:.6f}")  # fmt: skip
    arrays = goldens(reloaded, spec["seed"])
    mg.save_npz(os.path.join(d, "golden.npz"), arrays)
    if spec.get("wrapped"):
        wrap_kimi_k25(d)
    return {"model": reloaded, "arrays": arrays}


def yarn_inv_freq(dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN inverse frequencies written out from the paper's formulas (float32 torch)."""
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)

    def correction_dim(rot):
        return (
            dim
            * math.log(s["original_max_position_embeddings"] / (rot * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(s["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(s["beta_slow"])), dim - 1)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    return (1.0 / (s["factor"] * pos)) * (1 - keep) + (1.0 / pos) * keep


def check_yarn_against_hf(spec: dict) -> None:
    """Our torch yarn frequencies equal HF's, and HF's current cos/sin factor is the mscale ratio (1)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hc = Qwen3Config(
        hidden_size=64, num_attention_heads=spec["num_attention_heads"], head_dim=spec["head_dim"],
        max_position_embeddings=512, rope_scaling=dict(spec["rope_scaling"], rope_theta=spec["rope_theta"]),
    )  # fmt: skip
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hc, "cpu")
    mine = yarn_inv_freq(spec["head_dim"], spec["rope_theta"], spec["rope_scaling"])
    assert torch.allclose(inv, mine, rtol=1e-6, atol=0), (inv, mine)
    assert abs(factor - 1.0) < 1e-12, factor  # transformers today: mscale / mscale_all_dim = 1


def make_yarn_drafter(root: str, target: dict) -> None:
    """The DFlash drafter with yarn RoPE, golden logits under the legacy cos/sin factor."""
    spec = DRAFT
    check_yarn_against_hf(spec)
    legacy = 0.1 * math.log(spec["rope_scaling"]["factor"]) + 1.0
    inv = yarn_inv_freq(spec["head_dim"], spec["rope_theta"], spec["rope_scaling"])

    def rope_cos_sin(positions, head_dim, theta):
        ang = positions.float()[:, None] * inv[None, :]
        emb = torch.cat([ang, ang], dim=-1)
        return emb.cos() * legacy, emb.sin() * legacy

    mg.rope_cos_sin = rope_cos_sin  # dflash_forward reads it: the drafter's own (yarn) RoPE
    d = os.path.join(root, spec["name"])
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    tcfg = target["model"].config
    h, n_target = tcfg.hidden_size, tcfg.num_hidden_layers
    hq, hkv, dh, ff = (
        spec[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
    )
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
        "num_hidden_layers": spec["num_hidden_layers"], "num_attention_heads": hq, "num_key_value_heads": hkv,
        "head_dim": dh, "intermediate_size": ff, "rms_norm_eps": 1e-6, "rope_theta": spec["rope_theta"],
        "rope_scaling": spec["rope_scaling"], "max_position_embeddings": 512, "vocab_size": mg.VOCAB,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
        "block_size": spec["block_size"], "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": spec["mask_token_id"],
                          "target_layer_ids": spec["target_layer_ids"]},
    }  # fmt: skip
    mg.write_json(os.path.join(d, "config.json"), cfg)
    shapes = {
        "norm.weight": (h,),
        "hidden_norm.weight": (h,),
        "fc.weight": (h, len(spec["target_layer_ids"]) * h),
    }
    for i in range(spec["num_hidden_layers"]):
        pre = f"layers.{i}."
        shapes |= {
            pre + "self_attn.q_proj.weight": (hq * dh, h), pre + "self_attn.k_proj.weight": (hkv * dh, h),
            pre + "self_attn.v_proj.weight": (hkv * dh, h), pre + "self_attn.o_proj.weight": (h, hq * dh),
            pre + "self_attn.q_norm.weight": (dh,), pre + "self_attn.k_norm.weight": (dh,),
            pre + "mlp.gate_proj.weight": (ff, h), pre + "mlp.up_proj.weight": (ff, h),
            pre + "mlp.down_proj.weight": (h, ff), pre + "input_layernorm.weight": (h,),
            pre + "post_attention_layernorm.weight": (h,),
        }  # fmt: skip
    w = {k: torch.empty(s, dtype=torch.float32) for k, s in shapes.items()}
    mg.reinit_(sorted(w.items()), spec["seed"], spec["std"])
    save_file(
        {k: w[k].contiguous() for k in sorted(w)},
        os.path.join(d, "model.safetensors"),
        metadata={"format": "pt"},
    )
    model, tarr = target["model"], target["arrays"]
    embed, lm_head = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    arrays = {}
    for i in range(len(mg.PROMPT_LENS)):
        hs = torch.from_numpy(tarr[f"hidden_{i}"])
        feat = torch.cat([hs[layer + 1] for layer in spec["target_layer_ids"]], dim=-1)
        block = torch.full((spec["block_size"],), spec["mask_token_id"], dtype=torch.long)
        block[0] = int(tarr[f"greedy_{i}"][0])
        with torch.no_grad():
            logits, ctx = mg.dflash_forward(w, cfg, feat, block, embed, lm_head, attn=mg.attn_sdpa)
            loops, _ = mg.dflash_forward(w, cfg, feat, block, embed, lm_head, attn=mg.attn_loops)
        assert torch.allclose(logits, loops, atol=1e-5, rtol=1e-5)
        arrays |= {f"feat_{i}": feat.float().numpy(), f"block_{i}": block.numpy().astype(np.int32),
                   f"draft_logits_{i}": logits.float().numpy(), f"ctx_{i}": ctx.float().numpy()}  # fmt: skip
    arrays["yarn_inv_freq"] = inv.numpy()
    arrays["yarn_legacy_factor"] = np.float32(legacy)
    mg.save_npz(os.path.join(d, "golden.npz"), arrays)
    print(f"== {spec['name']}: legacy cos/sin factor {legacy:.4f}, logits std {float(logits.std()):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
    )
    root = os.path.abspath(ap.parse_args().out)
    torch.manual_seed(0)
    np.random.seed(0)
    torch.set_num_threads(1)
    made = {name: make_target(name, spec, root) for name, spec in TARGETS.items()}
    make_yarn_drafter(root, made[DRAFT["target"]])


if __name__ == "__main__":
    main()
