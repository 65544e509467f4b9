#!/usr/bin/env python
"""Generate the small HF fixtures and golden outputs under tests/fixtures/.

Run with an interpreter that has torch + transformers (CI never runs this; it only
consumes the files written here):

    python scripts/make_golden.py [--out tests/fixtures]

What it writes (all float32):
  * five tiny random target checkpoints (Qwen3 / Llama, HF layout, one sharded),
    weights re-initialised with a large std so that logits are far from flat;
  * golden.npz per target: prompts, HF logits, HF greedy continuations (24 tokens,
    stop tokens disabled), per-prompt minimal top1-top2 margins and HF hidden states;
  * a tiny byte-level BPE tokenizer + ChatML template for qwen3_gqa2_tied;
  * two DFlash drafters (z-lab layout) with golden draft logits computed by an
    independent plain-PyTorch drafter forward defined below;
  * two tiny random Qwen3-MoE targets (norm_topk_prob on and off, dense layers through
    mlp_only_layers and decoder_sparse_step), a DFlash drafter on one of them, and
    router_ties.npz (torch.topk's choices on tied router probabilities).

The DeepSeek-V3 / Kimi-K2 fixtures (and the yarn drafter) come from scripts/make_golden_deepseek.py,
which writes only those, with the helpers below.

`--only NAME,...` writes only the named fixtures (a drafter needs its target named too), so that
new fixtures can be added without rewriting the others.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import zipfile

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 256
PROMPT_LENS = [1, 5, 12, 17, 30]
NEW_TOKENS = 24
MIN_MARGIN = 1e-3

COMMON = dict(
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
)

# name -> (class, config kwargs, seed, init std, sharded)
TARGETS = {
    "qwen3_gqa1": dict(
        cls="qwen3",
        seed=101,
        std=0.4,
        sharded=False,
        cfg=dict(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            intermediate_size=64,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_gqa2_tied": dict(
        cls="qwen3",
        seed=202,
        std=0.4,
        sharded=False,
        tokenizer=True,
        cfg=dict(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            rope_theta=10000.0,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_gqa4_tp": dict(
        cls="qwen3",
        seed=303,
        std=0.3,
        sharded=False,
        cfg=dict(
            hidden_size=64,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
    ),
    "llama_gqa2": dict(
        cls="llama",
        seed=404,
        std=0.3,
        sharded=False,
        cfg=dict(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
    ),
    "llama3_scaled": dict(
        cls="llama",
        seed=505,
        std=0.25,
        sharded=True,
        cfg=dict(
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_moe_norm": dict(
        cls="qwen3_moe",
        seed=808,
        std=0.3,
        sharded=False,
        cfg=dict(
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe_tp": dict(
        cls="qwen3_moe",
        seed=909,
        std=0.3,
        sharded=False,
        cfg=dict(
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
    ),
}

DRAFTERS = {
    "dflash_qwen3_gqa4_tp": dict(
        target="qwen3_gqa4_tp",
        seed=606,
        std=0.3,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        block_size=8,
        mask_token_id=255,
        target_layer_ids=[1, 4],
    ),
    "dflash_qwen3_gqa1": dict(
        target="qwen3_gqa1",
        seed=707,
        std=0.4,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        intermediate_size=64,
        block_size=4,
        mask_token_id=255,
        target_layer_ids=None,
    ),
    "dflash_qwen3_moe_tp": dict(
        target="qwen3_moe_tp",
        seed=1010,
        std=0.3,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        block_size=6,
        mask_token_id=255,
        target_layer_ids=[0, 2],
    ),
}
MOE_FIXTURES = ("qwen3_moe_norm", "qwen3_moe_tp", "dflash_qwen3_moe_tp", "router_ties")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOKENIZER_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog does not mind; it is a very lazy dog,
and the fox is a very quick fox. Every morning the fox runs across the field, past the old
barn and the tall trees, and every morning the dog watches it from the porch.

Speculative decoding lets a small model guess several tokens ahead, and the large model checks
all of the guesses at once. When the guesses are right, many tokens are accepted in a single
step; when they are wrong, nothing is lost, because the large model always has the last word.
A tree of guesses can hold more than one path, so that a wrong first choice need not end the
round: the second choice may be right, and its children may be right as well.

Hello world! This is a small test of a tiny tokenizer. It has only a few hundred pieces, which
is enough for short English sentences, numbers like 0, 1, 2, 3, 42 and 2024, and simple code:
def add(a, b): return a + b. The user asks a question and the assistant gives an answer.
"""


# --------------------------------------------------------------------------------------------
# deterministic file writing
# --------------------------------------------------------------------------------------------


def save_npz(path: str, arrays: dict) -> None:
    """Like np.savez but byte-deterministic (fixed zip timestamps, sorted keys)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(
                buf, np.asarray(arrays[key]), allow_pickle=False
            )  # keeps 0-d scalars 0-d
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------


def reinit_(named_params, seed: int, std: float) -> None:
    """Matrices ~ N(0, std^2); 1-D norm weights ~ U[0.5, 1.5]. Deterministic per seed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_params:
            if p.ndim in (2, 3):  # 3: stacked experts (transformers 5 keeps them as [E, ...] parameters)
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
            elif p.ndim == 1 and "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float32) + 0.5)
            else:
                raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")


def build_target(name: str, spec: dict):
    kw = dict(COMMON)
    kw.update(spec["cfg"])
    if spec.get("tokenizer"):
        kw.update(bos_token_id=None, eos_token_id=2, pad_token_id=0)  # ids fixed by the tokenizer
    else:
        kw.update(bos_token_id=0, eos_token_id=1)
    config_cls, model_cls = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }[spec["cls"]]
    cfg = config_cls(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(spec["seed"])
    model = model_cls(cfg)
    model = model.float().eval()
    reinit_(sorted(model.named_parameters()), spec["seed"], spec["std"])
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------


def build_tokenizer(out_dir: str) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_map = pre_tokenizers.ByteLevel.alphabet()  # noqa: F841 (documents the mapping used)
    # initial alphabet: printable ASCII plus newline and tab, in ByteLevel's byte->char mapping
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    alphabet = sorted({piece for ch in chars for piece, _ in bl.pre_tokenize_str(ch)})
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = bl
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator([TOKENIZER_TEXT], trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}, ids
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHAT_TEMPLATE,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 512,
            "additional_special_tokens": ["<|im_start|>"],
        },
    )
    return ids


def check_tokenizer(out_dir: str):
    from transformers import AutoTokenizer

    tk = AutoTokenizer.from_pretrained(out_dir)
    msgs = [{"role": "user", "content": "hello world"}]
    chat = tk.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    expect = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert chat == expect, repr(chat)
    chat_ids = tk(chat, add_special_tokens=False)["input_ids"]
    chat_ids2 = tk.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids2, dict) or hasattr(chat_ids2, "keys"):
        chat_ids2 = chat_ids2["input_ids"]
    assert list(chat_ids) == list(chat_ids2), (chat_ids, chat_ids2)
    text_ids = tk("the quick brown fox", add_special_tokens=False)["input_ids"]
    assert max(chat_ids) < VOCAB and max(text_ids) < VOCAB
    assert tk.decode(chat_ids) == chat, tk.decode(chat_ids)
    assert tk.decode(text_ids) == "the quick brown fox"
    assert tk.eos_token == "<|im_end|>" and tk.pad_token == "<|endoftext|>" and tk.bos_token is None
    assert chat_ids[0] == 1 and 2 in chat_ids
    return chat, np.asarray(chat_ids, np.int32), np.asarray(text_ids, np.int32), len(tk)


# --------------------------------------------------------------------------------------------
# target golden outputs
# --------------------------------------------------------------------------------------------


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    t = torch.topk(logits.double(), 2, dim=-1).values
    return t[..., 0] - t[..., 1]


@torch.no_grad()
def forward_all(model, ids: torch.Tensor):
    """HF logits + hidden states for one unpadded prompt; also the pre-final-norm last layer."""
    captured = {}

    def hook(_m, _inp, out):
        captured["last"] = (out[0] if isinstance(out, tuple) else out).detach().clone()

    h = model.model.layers[-1].register_forward_hook(hook)
    try:
        out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    finally:
        h.remove()
    hs = torch.stack([x[0] for x in out.hidden_states])  # [layers+1, L, H]
    return out.logits[0], hs, captured["last"][0]


@torch.no_grad()
def greedy(model, ids: torch.Tensor):
    gc = GenerationConfig(
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        temperature=None,
        top_p=None,
        top_k=None,
        return_dict_in_generate=True,
        output_logits=True,
    )
    # generate() fills unset (None) fields from model.generation_config: blank the stop ids there
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(
            input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), generation_config=gc
        )
    finally:
        model.generation_config.eos_token_id = saved
    new = out.sequences[0, ids.numel() :]
    assert new.numel() == NEW_TOKENS, new.shape
    gen_logits = torch.stack([x[0] for x in out.logits])  # raw logits, [24, V]
    assert torch.equal(gen_logits.argmax(-1), new), "generate did not do plain argmax"
    # independent check: full (no cache) forward on prompt+new, argmax at every step
    full = torch.cat([ids, new])
    ref = model(input_ids=full[None], use_cache=False).logits[0, ids.numel() - 1 : -1]
    assert torch.equal(ref.argmax(-1), new), "cached generate differs from full-forward argmax"
    margins = torch.minimum(top2_gap(gen_logits), top2_gap(ref))
    return new, margins


def make_target(name: str, spec: dict, root: str) -> dict:
    d = os.path.join(root, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    model = build_target(name, spec)
    if spec.get("tokenizer"):
        build_tokenizer(d)
        model.generation_config.eos_token_id = [2, 0]
        model.generation_config.bos_token_id = None
        model.generation_config.pad_token_id = 0
    else:
        model.generation_config.eos_token_id = 1
        model.generation_config.bos_token_id = 0
    save_kw = dict(safe_serialization=True)
    if spec["sharded"]:
        save_kw["max_shard_size"] = "300KB"
    model.save_pretrained(d, **save_kw)

    # config.json post-processing: make both rope styles (and both dtype keys) present
    cpath = os.path.join(d, "config.json")
    with open(cpath) as f:
        cj = json.load(f)
    written_keys = sorted(cj)
    rp = cj.get("rope_parameters")
    if rp is not None:
        cj.setdefault("rope_theta", rp["rope_theta"])
        if rp.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
            cj.setdefault("rope_scaling", scaling)
        else:
            cj.setdefault("rope_scaling", None)
    cj.setdefault("torch_dtype", cj.get("dtype", "float32"))
    cj.setdefault("dtype", "float32")
    write_json(cpath, cj)

    # reload from disk and check equality
    reloaded = AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32
    ).eval()
    sd0, sd1 = model.state_dict(), reloaded.state_dict()
    assert sd0.keys() == sd1.keys()
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k
    rc = reloaded.config
    assert rc.rope_parameters == model.config.rope_parameters, (
        rc.rope_parameters,
        model.config.rope_parameters,
    )
    probe = torch.arange(3, 3 + 40)[None]
    with torch.no_grad():
        assert torch.equal(model(input_ids=probe).logits, reloaded(input_ids=probe).logits), (
            "reload changed logits"
        )
    if spec["sharded"]:
        shards = [f for f in os.listdir(d) if f.startswith("model-") and f.endswith(".safetensors")]
        assert os.path.exists(os.path.join(d, "model.safetensors.index.json")) and len(shards) >= 2, shards
    model = reloaded  # golden from what a loader will see

    arrays, report = {}, {"name": name, "config_keys": written_keys, "margins": [], "distinct": []}
    rng_base = spec["seed"] * 1000
    for i, plen in enumerate(PROMPT_LENS):
        for attempt in range(100):
            rng = np.random.RandomState(rng_base + 10 * i + attempt)
            prompt = rng.randint(3, VOCAB, size=plen).astype(np.int32)
            ids = torch.from_numpy(prompt).long()
            new, gmarg = greedy(model, ids)
            if float(gmarg.min()) >= MIN_MARGIN:
                break
        else:
            raise RuntimeError(f"{name} prompt {i}: no seed with margin >= {MIN_MARGIN}")
        logits, hs, last_pre = forward_all(model, ids)
        # consistency: HF hidden_states[-1] is the final-normed state in this transformers version?
        post = model.model.norm(last_pre)
        assert torch.allclose(hs[-1], post, atol=1e-6) or torch.allclose(hs[-1], last_pre, atol=1e-6)
        report["hidden_last_is_post_norm"] = bool(
            torch.allclose(hs[-1], post, atol=1e-6) and not torch.allclose(hs[-1], last_pre, atol=1e-6)
        )
        margin = min(float(gmarg.min()), float(top2_gap(logits).min()))
        arrays[f"prompt_{i}"] = prompt
        arrays[f"logits_{i}"] = logits.float().numpy()
        arrays[f"greedy_{i}"] = new.numpy().astype(np.int32)
        arrays[f"margin_{i}"] = np.float32(margin)
        arrays[f"hidden_{i}"] = hs.float().numpy()
        arrays[f"hidden_last_prenorm_{i}"] = last_pre.float().numpy()
        report["margins"].append((float(gmarg.min()), margin, attempt))
        report["distinct"].append(len(set(new.tolist())))
        report.setdefault("logit_std", []).append(float(logits.std()))
    assert max(report["distinct"]) > 1, f"{name}: degenerate greedy output"

    if spec.get("tokenizer"):
        chat, chat_ids, text_ids, ntok = check_tokenizer(d)
        arrays["chat_ids"] = chat_ids
        arrays["text_ids"] = text_ids
        with open(os.path.join(d, "golden_chat.txt"), "w") as f:
            f.write(chat)
        report.update(chat=chat, chat_ids=chat_ids.tolist(), text_ids=text_ids.tolist(), tok_len=ntok)
    save_npz(os.path.join(d, "golden.npz"), arrays)
    report["model"] = model
    report["arrays"] = arrays
    return report


# --------------------------------------------------------------------------------------------
# independent DFlash drafter (plain torch)
# --------------------------------------------------------------------------------------------


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list:
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def rms_norm(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    ang = positions.float()[:, None] * inv[None, :]  # [T, D/2]
    emb = torch.cat([ang, ang], dim=-1)  # [T, D]
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    # x [T, heads, D]; rotate-half convention
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def attn_sdpa(q, k, v):
    """q [K, Hq, D], k/v [S, Hkv, D]; full (non-causal) attention, GQA."""
    rep = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, S, D]
    vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=False, scale=q.shape[-1] ** -0.5)
    return o.transpose(0, 1).reshape(q.shape[0], -1)


def attn_loops(q, k, v):
    """Same as attn_sdpa, written with explicit per-head loops and a manual softmax (float64)."""
    K, Hq, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    out = torch.zeros(K, Hq, D, dtype=torch.float64)
    for h in range(Hq):
        kh = k[:, h // g, :].double()
        vh = v[:, h // g, :].double()
        for t in range(K):
            s = (kh @ q[t, h].double()) / math.sqrt(D)
            s = s - s.max()
            p = s.exp() / s.exp().sum()
            out[t, h] = p @ vh
    return out.reshape(K, Hq * D).float()


def dflash_forward(w: dict, cfg: dict, feat, block, embed, lm_head, attn=attn_sdpa):
    """Independent DFlash drafter forward. feat [L, n*H], block [K] -> draft logits [K-1, V]."""
    eps, D = cfg["rms_norm_eps"], cfg["head_dim"]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    L, K = feat.shape[0], block.shape[0]
    ctx = rms_norm(feat @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [L, H]
    h = embed[block]  # [K, H]
    cos_all, sin_all = rope_cos_sin(torch.arange(L + K), D, cfg["rope_theta"])
    cos_q, sin_q = cos_all[L:], sin_all[L:]
    for i in range(cfg["num_hidden_layers"]):
        p = lambda n, i=i: w[f"layers.{i}.{n}"]  # noqa: E731
        x = rms_norm(h, p("input_layernorm.weight"), eps)
        q = rms_norm((x @ p("self_attn.q_proj.weight").T).view(K, Hq, D), p("self_attn.q_norm.weight"), eps)
        q = apply_rope(q, cos_q, sin_q)
        kin = torch.cat([ctx @ p("self_attn.k_proj.weight").T, x @ p("self_attn.k_proj.weight").T])
        k = rms_norm(kin.view(L + K, Hkv, D), p("self_attn.k_norm.weight"), eps)
        k = apply_rope(k, cos_all, sin_all)
        v = torch.cat([ctx @ p("self_attn.v_proj.weight").T, x @ p("self_attn.v_proj.weight").T]).view(
            L + K, Hkv, D
        )
        h = h + attn(q, k, v) @ p("self_attn.o_proj.weight").T
        y = rms_norm(h, p("post_attention_layernorm.weight"), eps)
        h = (
            h
            + (F.silu(y @ p("mlp.gate_proj.weight").T) * (y @ p("mlp.up_proj.weight").T))
            @ p("mlp.down_proj.weight").T
        )
    out = rms_norm(h, w["norm.weight"], eps)
    return out[1:] @ lm_head.T, ctx


@torch.no_grad()
def check_against_hf_layer(w: dict, cfg: dict, layer_idx: int, x: torch.Tensor):
    """With an empty context a draft layer is exactly an HF Qwen3DecoderLayer without a mask."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    hc = Qwen3Config(
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"],
        vocab_size=VOCAB,
        num_hidden_layers=1,
    )
    hc._attn_implementation = "eager"
    layer = Qwen3DecoderLayer(hc, 0).float().eval()
    pre = f"layers.{layer_idx}."
    layer.load_state_dict({k[len(pre) :]: v for k, v in w.items() if k.startswith(pre)})
    pos = torch.arange(5, 5 + x.shape[0])[None]
    cos, sin = Qwen3RotaryEmbedding(hc)(x[None], pos)
    mine_cos, mine_sin = rope_cos_sin(pos[0], cfg["head_dim"], cfg["rope_theta"])
    assert torch.allclose(cos[0], mine_cos, atol=1e-6) and torch.allclose(sin[0], mine_sin, atol=1e-6)
    out = layer(x[None], attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
    out = out[0] if isinstance(out, tuple) else out
    return out[0]


@torch.no_grad()
def my_draft_layer_no_ctx(w, cfg, i, h, start):
    """One draft layer with L = 0 context, positions start.., via dflash_forward's math."""
    eps, D = cfg["rms_norm_eps"], cfg["head_dim"]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    K = h.shape[0]
    cos, sin = rope_cos_sin(torch.arange(start, start + K), D, cfg["rope_theta"])
    p = lambda n: w[f"layers.{i}.{n}"]  # noqa: E731
    x = rms_norm(h, p("input_layernorm.weight"), eps)
    q = apply_rope(
        rms_norm((x @ p("self_attn.q_proj.weight").T).view(K, Hq, D), p("self_attn.q_norm.weight"), eps),
        cos,
        sin,
    )
    k = apply_rope(
        rms_norm((x @ p("self_attn.k_proj.weight").T).view(K, Hkv, D), p("self_attn.k_norm.weight"), eps),
        cos,
        sin,
    )
    v = (x @ p("self_attn.v_proj.weight").T).view(K, Hkv, D)
    h = h + attn_sdpa(q, k, v) @ p("self_attn.o_proj.weight").T
    y = rms_norm(h, p("post_attention_layernorm.weight"), eps)
    return (
        h
        + (F.silu(y @ p("mlp.gate_proj.weight").T) * (y @ p("mlp.up_proj.weight").T))
        @ p("mlp.down_proj.weight").T
    )


def make_drafter(name: str, spec: dict, root: str, target: dict) -> dict:
    d = os.path.join(root, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    tmodel = target["model"]
    tcfg = tmodel.config
    H, T = tcfg.hidden_size, tcfg.num_hidden_layers
    n_layers = spec["num_hidden_layers"]
    layer_ids = spec["target_layer_ids"]
    eff_ids = layer_ids if layer_ids is not None else default_target_layer_ids(T, n_layers)
    assert all(0 <= l < T - 1 for l in eff_ids), eff_ids  # all pre-final-norm in HF hidden_states
    D, Hq, Hkv, I = (
        spec["head_dim"],
        spec["num_attention_heads"],
        spec["num_key_value_heads"],
        spec["intermediate_size"],
    )
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "num_hidden_layers": n_layers,
        "num_attention_heads": Hq,
        "num_key_value_heads": Hkv,
        "head_dim": D,
        "intermediate_size": I,
        "rms_norm_eps": COMMON["rms_norm_eps"],
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": COMMON["max_position_embeddings"],
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "block_size": spec["block_size"],
        "num_target_layers": T,
        "dflash_config": {"mask_token_id": spec["mask_token_id"]},
    }
    if layer_ids is not None:
        cfg["dflash_config"]["target_layer_ids"] = list(layer_ids)
    write_json(os.path.join(d, "config.json"), cfg)

    shapes = {"norm.weight": (H,), "hidden_norm.weight": (H,), "fc.weight": (H, len(eff_ids) * H)}
    for i in range(n_layers):
        pre = f"layers.{i}."
        shapes.update(
            {
                pre + "self_attn.q_proj.weight": (Hq * D, H),
                pre + "self_attn.k_proj.weight": (Hkv * D, H),
                pre + "self_attn.v_proj.weight": (Hkv * D, H),
                pre + "self_attn.o_proj.weight": (H, Hq * D),
                pre + "self_attn.q_norm.weight": (D,),
                pre + "self_attn.k_norm.weight": (D,),
                pre + "mlp.gate_proj.weight": (I, H),
                pre + "mlp.up_proj.weight": (I, H),
                pre + "mlp.down_proj.weight": (H, I),
                pre + "input_layernorm.weight": (H,),
                pre + "post_attention_layernorm.weight": (H,),
            }
        )
    w = {k: torch.empty(s, dtype=torch.float32) for k, s in shapes.items()}
    reinit_(sorted(w.items()), spec["seed"], spec["std"])
    save_file(
        {k: w[k].contiguous() for k in sorted(w)},
        os.path.join(d, "model.safetensors"),
        metadata={"format": "pt"},
    )

    # sanity: an empty-context draft layer equals an HF Qwen3DecoderLayer without mask
    xs = torch.randn(spec["block_size"], H, generator=torch.Generator().manual_seed(spec["seed"]))
    for i in range(n_layers):
        a = check_against_hf_layer(w, cfg, i, xs)
        b = my_draft_layer_no_ctx(w, cfg, i, xs, 5)
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()

    embed = tmodel.model.embed_tokens.weight.detach()
    lm_head = tmodel.lm_head.weight.detach()
    arrays, report = {}, {"name": name, "target_layer_ids": eff_ids, "logit_std": [], "max_diff": 0.0}
    tarr = target["arrays"]
    K = spec["block_size"]
    for i in range(len(PROMPT_LENS)):
        prompt = torch.from_numpy(tarr[f"prompt_{i}"]).long()
        hs = torch.from_numpy(tarr[f"hidden_{i}"])  # HF hidden_states; l+1 < T so pre-final-norm
        feat = torch.cat([hs[l + 1] for l in eff_ids], dim=-1)
        L = prompt.numel()
        assert feat.shape == (L, len(eff_ids) * H)
        block = torch.full((K,), spec["mask_token_id"], dtype=torch.long)
        block[0] = int(tarr[f"greedy_{i}"][0])
        with torch.no_grad():
            logits, ctx = dflash_forward(w, cfg, feat, block, embed, lm_head, attn=attn_sdpa)
            logits2, _ = dflash_forward(w, cfg, feat, block, embed, lm_head, attn=attn_loops)
        diff = float((logits - logits2).abs().max())
        assert torch.allclose(logits, logits2, atol=1e-5, rtol=1e-5), diff
        report["max_diff"] = max(report["max_diff"], diff)
        report["logit_std"].append(float(logits.std()))
        arrays[f"feat_{i}"] = feat.float().numpy()
        arrays[f"block_{i}"] = block.numpy().astype(np.int32)
        arrays[f"draft_logits_{i}"] = logits.float().numpy()
        arrays[f"ctx_{i}"] = ctx.float().numpy()
    save_npz(os.path.join(d, "golden.npz"), arrays)
    return report


def make_router_ties(root: str) -> None:
    """torch.topk's choices on router probabilities with exact ties (what HF's Qwen3-MoE router picks)."""
    rows = torch.tensor(
        [
            [0.1, 0.3, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0],
            [0.125] * 8,
            [0.05, 0.2, 0.2, 0.05, 0.2, 0.1, 0.1, 0.1],
            [0.4, 0.1, 0.2, 0.05, 0.05, 0.1, 0.05, 0.05],  # no tie at the top-2 boundary
        ],
        dtype=torch.float32,
    )
    values, indices = torch.topk(rows, 2, dim=-1)
    save_npz(
        os.path.join(root, "router_ties.npz"),
        {
            "probs": rows.numpy(),
            "torch_values": values.numpy(),
            "torch_indices": indices.numpy().astype(np.int32),
        },
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
    )
    ap.add_argument(
        "--only", help="comma list of fixture names to write (the MoE ones: " + ",".join(MOE_FIXTURES) + ")"
    )
    args = ap.parse_args()
    only = None if args.only is None else set(args.only.split(","))
    root = os.path.abspath(args.out)
    os.makedirs(root, exist_ok=True)
    torch.manual_seed(0)
    np.random.seed(0)
    torch.set_num_threads(1)  # reproducible reductions
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")

    targets = {}
    for name, spec in TARGETS.items():
        if only is not None and name not in only:
            continue
        r = make_target(name, spec, root)
        targets[name] = r
        with open(os.path.join(root, name, "config.json")) as f:
            cj = json.load(f)
        print(f"== {name}")
        print("   keys written by save_pretrained:", r["config_keys"])
        print(
            "   rope_parameters:",
            cj.get("rope_parameters"),
            "| rope_theta:",
            cj.get("rope_theta"),
            "| rope_scaling:",
            cj.get("rope_scaling"),
        )
        print(
            "   greedy margin (min over greedy steps), margin_i, seed attempt:",
            [(f"{a:.4f}", f"{b:.4f}", c) for a, b, c in r["margins"]],
        )
        print("   distinct tokens per greedy output:", r["distinct"])
        print("   logits std per prompt:", [f"{s:.2f}" for s in r["logit_std"]])
        print("   hidden[-1] is post-final-norm:", r["hidden_last_is_post_norm"])
        if "chat" in r:
            print(
                "   chat:",
                repr(r["chat"]),
                "ids:",
                r["chat_ids"],
                "text ids:",
                r["text_ids"],
                "tokenizer size:",
                r["tok_len"],
            )
    for name, spec in DRAFTERS.items():
        if only is not None and name not in only:
            continue
        assert spec["target"] in targets, f"{name} needs its target {spec['target']} in --only"
        r = make_drafter(name, spec, root, targets[spec["target"]])
        print(
            f"== {name}: target_layer_ids used {r['target_layer_ids']}, "
            f"draft logits std {[f'{s:.2f}' for s in r['logit_std']]}, "
            f"sdpa-vs-loops max diff {r['max_diff']:.2e}"
        )
    if only is None or "router_ties" in only:
        make_router_ties(root)


if __name__ == "__main__":
    main()
