#!/usr/bin/env python
"""Write the tiny HF fixtures and their golden outputs under tests/fixtures/ (CI only reads them).

Run from the repository root with an interpreter that has torch and transformers:

    PYTHONPATH=$PWD python tests/make_fixtures.py [--out tests/fixtures] [--only NAME,...]

Every checkpoint is one `small(...)` or `drafter(...)` call below: the factory holds what they share
(vocabulary 256, head dim 16, MLP twice the hidden size, ...), a line names what each one tests. What
it writes, all float32:
  * targets (TARGETS): random Qwen3 / Llama / Qwen3-MoE / DeepSeek-V3 checkpoints saved by transformers,
    weights re-initialised with a large std so that logits are far from flat (one sharded, one with a
    byte-level BPE tokenizer and ChatML template, one as a Kimi-K2.5-style wrapper); golden.npz per
    target: prompts, HF logits, HF greedy continuations (24 tokens, stop ids off, top-2 margins at least
    MIN_MARGIN), the margins and HF hidden states;
  * DFlash drafters (DRAFTERS, z-lab layout, one with yarn RoPE) whose golden draft logits come from
    the independent PyTorch drafter of ddtree_jax/compare/torch_reference.py (the one ddtree-compare
    reference runs) on the target's HF hidden states;
  * router_ties.npz: torch.topk's choices on tied router probabilities (what HF's Qwen3-MoE router picks).

`--only NAME,...` writes only the named fixtures (a drafter needs its target named too). The quantized
fixtures are tests/fixtures/make_quant.py's; tests/test_fixtures.py rebuilds every checkpoint's weights
from these specs and compares them with the shipped files; made_with.json beside them records the
torch and transformers versions that wrote each.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GenerationConfig

from ddtree_jax.compare.oracles import default_target_layer_ids

FIXTURES = Path(__file__).resolve().parent / "fixtures"
VOCAB = 256
PROMPT_LENS = [1, 5, 12, 17, 30]
NEW_TOKENS = 24
MIN_MARGIN = 1e-3
GQA_FAMILIES = ("qwen3", "llama", "qwen3_moe")  # config.json gets both rope styles (make_target)


# -- the small-config factory -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """One fixture checkpoint: its family, the seed and std of its random weights, its config fields."""

    family: str  # qwen3 | llama | qwen3_moe | deepseek_v3 | dflash
    seed: int
    std: float
    config: dict  # HF config kwargs (a drafter: its own fields, completed from its target's config)
    target: str | None = None  # a drafter's target
    sharded: bool = False  # saved in several safetensors files with an index
    tokenizer: bool = False  # a byte-level BPE tokenizer and ChatML template beside it
    wrapped: bool = False  # rewritten as a Kimi-K2.5-style wrapper checkpoint


def small(
    family: str,
    seed: int,
    *,
    std: float = 0.3,
    hidden: int = 32,
    layers: int = 4,
    heads: int | None = None,
    kv_heads: int = 2,
    sharded: bool = False,
    tokenizer: bool = False,
    wrapped: bool = False,
    **config,
) -> Spec:
    """A tiny random target of `family`: the shared fields, the family's, then `config`'s. Heads default
    to one per 8 hidden units; DeepSeek-V3's K/V heads are its query heads (MLA)."""
    heads = heads or hidden // 8
    base = dict(
        vocab_size=VOCAB,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads if family == "deepseek_v3" else kv_heads,
        tie_word_embeddings=False,
    )
    if family == "deepseek_v3":
        base |= dict(
            intermediate_size=64,
            moe_intermediate_size=16,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=8,
            first_k_dense_replace=1,
        )
    else:
        base |= dict(head_dim=16, intermediate_size=2 * hidden, rope_theta=10000.0)
    if family == "qwen3_moe":
        base |= dict(moe_intermediate_size=16, num_experts=8)
    # a tokenizer fixes the special ids (build_tokenizer); the others: bos 0, eos 1
    base |= (
        dict(bos_token_id=None, eos_token_id=2, pad_token_id=0)
        if tokenizer
        else dict(bos_token_id=0, eos_token_id=1)
    )
    return Spec(family, seed, std, base | config, sharded=sharded, tokenizer=tokenizer, wrapped=wrapped)


def drafter(
    target: str,
    seed: int,
    *,
    layers: int,
    block_size: int,
    target_layer_ids: list[int] | None,
    heads: int | None = None,
    kv_heads: int = 2,
    std: float = 0.3,
    rope_scaling: dict | None = None,
) -> Spec:
    """A tiny DFlash drafter on `target` (its hidden size; MLP twice that), mask token 255; no layer ids:
    DFlash's default spacing."""
    hidden = TARGETS[target].config["hidden_size"]
    config = dict(
        num_hidden_layers=layers,
        num_attention_heads=heads or hidden // 8,
        num_key_value_heads=kv_heads,
        head_dim=16,
        intermediate_size=2 * hidden,
        block_size=block_size,
        mask_token_id=255,
        target_layer_ids=target_layer_ids,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
    )
    return Spec("dflash", seed, std, config, target=target)


def yarn(factor: float, original: int, beta_fast: int, mscale_all_dim: float, **extra) -> dict:
    """A yarn rope_scaling dict (mscale 1)."""
    return dict(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=beta_fast,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=mscale_all_dim,
        **extra,
    )


TARGETS = {
    "qwen3_gqa1": small("qwen3", 101, std=0.4, kv_heads=4),  # one query head per K/V head
    "qwen3_gqa2_tied": small("qwen3", 202, std=0.4, tokenizer=True, tie_word_embeddings=True),
    "qwen3_gqa4_tp": small("qwen3", 303, hidden=64, layers=6),  # 8 heads: meshes up to 8
    "llama_gqa2": small("llama", 404),
    "llama3_scaled": small(
        "llama",
        505,
        std=0.25,
        hidden=64,
        sharded=True,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # norm_topk_prob on and off; dense layers through mlp_only_layers and decoder_sparse_step
    "qwen3_moe_norm": small(
        "qwen3_moe",
        808,
        layers=3,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
    ),
    "qwen3_moe_tp": small(
        "qwen3_moe",
        909,
        hidden=64,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        mlp_only_layers=[],
    ),
    # q_lora_rank, n_group 4 > topk_group 2, yarn (mscale_all_dim 0.5: the cos/sin factor and the
    # softmax scale both differ from 1), interleaved RoPE, one shared expert, norm_topk_prob
    "deepseek_v3_qlora": small(
        "deepseek_v3",
        1111,
        hidden=64,
        layers=3,
        heads=4,
        q_lora_rank=32,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_interleave=True,
        rope_scaling=yarn(4.0, 128, 32, 0.5, rope_theta=10000.0),
    ),
    # direct q_proj, 8 heads and 8 experts (meshes up to 8), n_group 1, no yarn, rotate-half RoPE, two
    # shared experts, no renormalising
    "deepseek_v3_tp": small(
        "deepseek_v3",
        1212,
        hidden=64,
        layers=3,
        heads=8,
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
    # Kimi-K2.5-style: a kimi_k2 text_config (yarn factor 4, mscale = mscale_all_dim = 1) in a wrapper,
    # weights under `language_model.`, plus vision-tower tensors the loader must leave alone
    "kimi_k25_wrapped": small(
        "deepseek_v3",
        1313,
        hidden=64,
        layers=2,
        heads=4,
        wrapped=True,
        q_lora_rank=32,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.827,
        rope_interleave=True,
        rope_scaling=yarn(4.0, 128, 1, 1.0, rope_theta=50000.0),
    ),
}
DRAFTERS = {
    "dflash_qwen3_gqa4_tp": drafter("qwen3_gqa4_tp", 606, layers=2, block_size=8, target_layer_ids=[1, 4]),
    "dflash_qwen3_gqa1": drafter(  # no layer ids in its config: DFlash's default
        "qwen3_gqa1", 707, std=0.4, layers=1, kv_heads=4, block_size=4, target_layer_ids=None
    ),
    "dflash_qwen3_moe_tp": drafter("qwen3_moe_tp", 1010, layers=2, block_size=6, target_layer_ids=[0, 2]),
    # yarn RoPE in its own config (mscale = mscale_all_dim = 1, Kimi-K2.5-DFlash style): golden logits
    # under the LEGACY cos/sin factor 1 + 0.1 ln(factor), frequencies checked against HF's here
    "dflash_deepseek_v3_tp": drafter(
        "deepseek_v3_tp",
        1414,
        layers=2,
        block_size=6,
        target_layer_ids=[0, 1],
        rope_scaling=yarn(8.0, 64, 32, 1.0),
    ),
}
SPECS = TARGETS | DRAFTERS


# -- deterministic files -------------------------------------------------------------------------------


def save_npz(path: Path, arrays: dict) -> None:
    """Like np.savez but byte-deterministic (fixed zip timestamps, sorted keys)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(arrays[key]), allow_pickle=False)  # 0-d stays 0-d
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def write_json(path: Path, obj) -> None:
    """Sorted keys, two-space indent, a final newline."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# -- weights -------------------------------------------------------------------------------------------


def reinit(named_params, seed: int, std: float, named_buffers=()) -> None:
    """Matrices and stacked experts ~ N(0, std^2), 1-D norm weights ~ U[0.5, 1.5], then DeepSeek's
    choice biases ~ N(0, 0.1^2); one generator per seed, in the given (sorted) order."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_params:
            if p.ndim in (2, 3):  # 3: stacked experts (transformers 5 keeps them as [E, ...] parameters)
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
            elif p.ndim == 1 and "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float32) + 0.5)
            else:
                raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")
        for name, b in named_buffers:
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def build_target(spec: Spec):
    """The random HF model of a target spec, float32, eager attention."""
    import transformers

    classes = {
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    }
    config_cls, model_cls = (getattr(transformers, n) for n in classes[spec.family])
    cfg = config_cls(**spec.config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(spec.seed)
    model = model_cls(cfg).float().eval()
    reinit(sorted(model.named_parameters()), spec.seed, spec.std, sorted(model.named_buffers()))
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    gen = model.generation_config
    gen.eos_token_id, gen.bos_token_id = ([2, 0], None) if spec.tokenizer else (1, 0)
    if spec.tokenizer:
        gen.pad_token_id = 0
    return model


def drafter_config(spec: Spec, num_target_layers: int) -> dict:
    """A drafter spec's config.json (z-lab's DFlash layout)."""
    c = spec.config
    dflash = {"mask_token_id": c["mask_token_id"]}
    if c["target_layer_ids"] is not None:
        dflash["target_layer_ids"] = list(c["target_layer_ids"])
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": TARGETS[spec.target].config["hidden_size"],
        **{k: c[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")},
        "intermediate_size": c["intermediate_size"],
        "rms_norm_eps": 1e-6,
        "rope_theta": c["rope_theta"],
        "rope_scaling": c["rope_scaling"],
        "max_position_embeddings": 512,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "block_size": c["block_size"],
        "num_target_layers": num_target_layers,
        "dflash_config": dflash,
    }


def drafter_weights(spec: Spec, feature_layers: int) -> dict[str, torch.Tensor]:
    """A drafter spec's random weights under z-lab's names (`fc` reads `feature_layers` target layers)."""
    c = spec.config
    h = TARGETS[spec.target].config["hidden_size"]
    hq, hkv, dh, ff = (
        c[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
    )
    shapes = {"norm.weight": (h,), "hidden_norm.weight": (h,), "fc.weight": (h, feature_layers * h)}
    for i in range(c["num_hidden_layers"]):
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
    reinit(sorted(w.items()), spec.seed, spec.std)
    return w


def feature_layer_ids(spec: Spec, num_target_layers: int) -> list[int]:
    """The target layers a drafter reads: its config's, else DFlash's default."""
    ids = spec.config["target_layer_ids"]
    return (
        list(ids)
        if ids is not None
        else default_target_layer_ids(num_target_layers, spec.config["num_hidden_layers"])
    )


# -- the tokenizer -------------------------------------------------------------------------------------

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


def build_tokenizer(out_dir: Path) -> dict:
    """A byte-level BPE of at most VOCAB pieces trained on TOKENIZER_TEXT, specials at ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
    tok.save(str(out_dir / "tokenizer.json"))
    write_json(
        out_dir / "tokenizer_config.json",
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


def check_tokenizer(out_dir: Path) -> tuple[str, np.ndarray, np.ndarray]:
    """HF's AutoTokenizer reads it back: the ChatML prompt, its ids and a plain text's ids round-trip."""
    from transformers import AutoTokenizer

    tk = AutoTokenizer.from_pretrained(out_dir)
    msgs = [{"role": "user", "content": "hello world"}]
    chat = tk.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n", repr(chat)
    chat_ids = tk(chat, add_special_tokens=False)["input_ids"]
    chat_ids2 = tk.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids2, dict) or hasattr(chat_ids2, "keys"):
        chat_ids2 = chat_ids2["input_ids"]
    assert list(chat_ids) == list(chat_ids2), (chat_ids, chat_ids2)
    text_ids = tk("the quick brown fox", add_special_tokens=False)["input_ids"]
    assert max(chat_ids) < VOCAB and max(text_ids) < VOCAB
    assert tk.decode(chat_ids) == chat and tk.decode(text_ids) == "the quick brown fox"
    assert tk.eos_token == "<|im_end|>" and tk.pad_token == "<|endoftext|>" and tk.bos_token is None
    assert chat_ids[0] == 1 and 2 in chat_ids
    return chat, np.asarray(chat_ids, np.int32), np.asarray(text_ids, np.int32)


# -- a target's golden outputs -------------------------------------------------------------------------


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """The top-1 minus top-2 logit, in float64."""
    t = torch.topk(logits.double(), 2, dim=-1).values
    return t[..., 0] - t[..., 1]


@torch.no_grad()
def forward_all(model, ids: torch.Tensor):
    """HF logits [L, V] and hidden states [layers + 1, L, H] of one prompt; also the last layer's output
    before the final norm [L, H]."""
    captured = {}

    def hook(_m, _inp, out):
        captured["last"] = (out[0] if isinstance(out, tuple) else out).detach().clone()

    h = model.model.layers[-1].register_forward_hook(hook)
    try:
        out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    finally:
        h.remove()
    return out.logits[0], torch.stack([x[0] for x in out.hidden_states]), captured["last"][0]


@torch.no_grad()
def greedy(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF generate's NEW_TOKENS greedy tokens (stop ids off), checked against a full forward's argmax at
    every step; and the smaller top-2 margin of the two at each step."""
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
    gen_logits = torch.stack([x[0] for x in out.logits])  # raw logits [24, V]
    assert torch.equal(gen_logits.argmax(-1), new), "generate did not do plain argmax"
    full = torch.cat([ids, new])
    ref = model(input_ids=full[None], use_cache=False).logits[0, ids.numel() - 1 : -1]
    assert torch.equal(ref.argmax(-1), new), "cached generate differs from full-forward argmax"
    return new, torch.minimum(top2_gap(gen_logits), top2_gap(ref))


def goldens(model, spec: Spec) -> dict[str, np.ndarray]:
    """Per prompt (lengths PROMPT_LENS, the first seed whose greedy margins reach MIN_MARGIN): the prompt,
    HF logits, greedy tokens, margin, hidden states (and, GQA families, the last layer before the norm)."""
    arrays = {}
    for i, plen in enumerate(PROMPT_LENS):
        for attempt in range(100):
            rng = np.random.RandomState(spec.seed * 1000 + 10 * i + attempt)
            prompt = rng.randint(3, VOCAB, size=plen).astype(np.int32)
            ids = torch.from_numpy(prompt).long()
            new, margins = greedy(model, ids)
            if float(margins.min()) >= MIN_MARGIN:
                break
        else:
            raise RuntimeError(f"prompt {i}: no seed with margin >= {MIN_MARGIN}")
        logits, hidden, last_prenorm = forward_all(model, ids)
        arrays[f"prompt_{i}"] = prompt
        arrays[f"logits_{i}"] = logits.float().numpy()
        arrays[f"greedy_{i}"] = new.numpy().astype(np.int32)
        arrays[f"margin_{i}"] = np.float32(min(float(margins.min()), float(top2_gap(logits).min())))
        arrays[f"hidden_{i}"] = hidden.float().numpy()
        if spec.family in GQA_FAMILIES:
            post_norm = model.model.norm(last_prenorm)  # HF's last hidden state: after the final norm
            assert torch.allclose(hidden[-1], post_norm, atol=1e-6)
            arrays[f"hidden_last_prenorm_{i}"] = last_prenorm.float().numpy()
        distinct = len(set(new.tolist()))
        print(f"   prompt {i}: margin {float(margins.min()):.4f} (attempt {attempt}), {distinct} distinct")
    return arrays


def both_rope_styles(path: Path) -> None:
    """config.json with rope_theta / rope_scaling beside transformers 5's rope_parameters, and both dtype
    keys: the loader reads either style."""
    cj = json.loads(path.read_text())
    rp = cj.get("rope_parameters")
    if rp is not None:
        cj.setdefault("rope_theta", rp["rope_theta"])
        scaled = rp.get("rope_type", "default") != "default"
        cj.setdefault("rope_scaling", {k: v for k, v in rp.items() if k != "rope_theta"} if scaled else None)
    cj.setdefault("torch_dtype", cj.get("dtype", "float32"))
    cj.setdefault("dtype", "float32")
    write_json(path, cj)


def wrap_kimi_k25(d: Path) -> None:
    """Rewrite an HF DeepseekV3 directory as a Kimi-K2.5-style wrapper checkpoint."""
    path = d / "model.safetensors"
    tensors = {"language_model." + k: v for k, v in load_file(path).items()}
    gen = torch.Generator().manual_seed(7)
    tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 2, generator=gen)
    tensors["mm_projector.proj.0.weight"] = torch.randn(64, 16, generator=gen)
    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, path, metadata={"format": "pt"})
    text = json.loads((d / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {"model_type": "moonvit", "patch_size": 2, "hidden_size": 16},
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    write_json(d / "config.json", wrapper)


def write_target(name: str, d: Path):
    """A target's checkpoint files in directory `d` (config, weights, tokenizer); returns the model."""
    spec = TARGETS[name]
    model = build_target(spec)
    if spec.tokenizer:
        build_tokenizer(d)
    model.save_pretrained(d, safe_serialization=True, **({"max_shard_size": "300KB"} if spec.sharded else {}))
    if spec.family in GQA_FAMILIES:
        both_rope_styles(d / "config.json")
    return model


def make_target(name: str, root: Path) -> dict:
    """One target directory and its golden.npz; returns the reloaded model and the golden arrays."""
    spec, d = TARGETS[name], root / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    model = write_target(name, d)
    reloaded = AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32
    ).eval()
    for k, v in model.state_dict().items():
        assert torch.equal(v, reloaded.state_dict()[k]), k
    assert reloaded.config.rope_parameters == model.config.rope_parameters
    if spec.sharded:
        assert (d / "model.safetensors.index.json").exists() and len(list(d.glob("model-*.safetensors"))) >= 2
    print(f"== {name}")
    arrays = goldens(reloaded, spec)  # from what a loader will see
    if spec.tokenizer:
        chat, arrays["chat_ids"], arrays["text_ids"] = check_tokenizer(d)
        (d / "golden_chat.txt").write_text(chat)
    save_npz(d / "golden.npz", arrays)
    if spec.wrapped:
        wrap_kimi_k25(d)
    return {"model": reloaded, "arrays": arrays}


# -- a drafter's golden outputs ------------------------------------------------------------------------


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


def yarn_goldens(spec: Spec) -> dict[str, np.ndarray]:
    """A yarn drafter's frequencies (checked against HF's) and its legacy cos/sin factor."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c, s = spec.config, spec.config["rope_scaling"]
    hc = Qwen3Config(
        hidden_size=64,
        num_attention_heads=c["num_attention_heads"],
        head_dim=c["head_dim"],
        max_position_embeddings=512,
        rope_scaling=dict(s, rope_theta=c["rope_theta"]),
    )
    hf, factor = ROPE_INIT_FUNCTIONS["yarn"](hc, "cpu")
    inv = yarn_inv_freq(c["head_dim"], c["rope_theta"], s)
    assert torch.allclose(hf, inv, rtol=1e-6, atol=0), (hf, inv)
    assert abs(factor - 1.0) < 1e-12, factor  # transformers today: mscale / mscale_all_dim = 1
    return {"yarn_inv_freq": inv.numpy(), "yarn_legacy_factor": np.float32(0.1 * math.log(s["factor"]) + 1.0)}


def write_drafter(name: str, d: Path) -> list[int]:
    """A drafter's checkpoint files in directory `d` (config, weights); returns the target layers it reads."""
    spec = DRAFTERS[name]
    n_target = TARGETS[spec.target].config["num_hidden_layers"]
    ids = feature_layer_ids(spec, n_target)
    assert all(0 <= i < n_target - 1 for i in ids), ids  # pre-final-norm in HF's hidden states
    write_json(d / "config.json", drafter_config(spec, n_target))
    w = drafter_weights(spec, len(ids))
    save_file({k: w[k].contiguous() for k in sorted(w)}, d / "model.safetensors", metadata={"format": "pt"})
    return ids


def make_drafter(name: str, root: Path, target: dict) -> None:
    """One drafter directory; golden.npz: per target prompt, the features (HF hidden states of its layers),
    the block [greedy token, mask...], the context and the draft logits of torch_reference's drafter."""
    from ddtree_jax.compare.torch_reference import DFlashDrafter

    spec, d = DRAFTERS[name], root / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    ids = write_drafter(name, d)
    tmodel = target["model"]
    n_target = tmodel.config.num_hidden_layers
    model = DFlashDrafter.load(d, n_target, torch.float32)
    embed, lm_head = tmodel.model.embed_tokens.weight.detach(), tmodel.lm_head.weight.detach()
    arrays = yarn_goldens(spec) if spec.config["rope_scaling"] else {}
    tarr = target["arrays"]
    for i in range(len(PROMPT_LENS)):
        hs = torch.from_numpy(tarr[f"hidden_{i}"])
        feat = torch.cat([hs[layer + 1] for layer in ids], dim=-1)
        block = torch.full((spec.config["block_size"],), spec.config["mask_token_id"], dtype=torch.long)
        block[0] = int(tarr[f"greedy_{i}"][0])
        with torch.no_grad():
            logits = model.hidden(feat, embed[block]) @ lm_head.T
            ctx = model.hidden_norm(model.fc(feat))
        arrays[f"feat_{i}"] = feat.float().numpy()
        arrays[f"block_{i}"] = block.numpy().astype(np.int32)
        arrays[f"draft_logits_{i}"] = logits.float().numpy()
        arrays[f"ctx_{i}"] = ctx.float().numpy()
    save_npz(d / "golden.npz", arrays)
    print(f"== {name}: target layers {ids}, draft logits std {float(logits.std()):.2f}")


def make_router_ties(root: Path) -> None:
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
    arrays = {
        "probs": rows.numpy(),
        "torch_values": values.numpy(),
        "torch_indices": indices.numpy().astype(np.int32),
    }
    save_npz(root / "router_ties.npz", arrays)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=FIXTURES)
    ap.add_argument("--only", help=f"comma list of {', '.join([*SPECS, 'router_ties'])}")
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else {*SPECS, "router_ties"}
    root = args.out.resolve()
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    np.random.seed(0)
    torch.set_num_threads(1)  # reproducible reductions
    targets = {name: make_target(name, root) for name in TARGETS if name in only}
    for name, spec in DRAFTERS.items():
        if name in only:
            assert spec.target in targets, f"{name} needs its target {spec.target} in --only"
            make_drafter(name, root, targets[spec.target])
    if "router_ties" in only:
        make_router_ties(root)
    record_versions(root, [name for name in SPECS if name in only])


def record_versions(root: Path, names: list[str]) -> None:
    """made_with.json: the torch and transformers versions (and the date) that wrote these fixtures;
    tests/test_fixtures.py holds rebuilt outputs to them within a tolerance across versions."""
    import datetime

    import transformers

    path = root / "made_with.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    today = datetime.date.today().isoformat()
    for name in names:
        record[name] = {"transformers": transformers.__version__, "torch": torch.__version__, "date": today}
    write_json(path, record)


if __name__ == "__main__":
    main()
