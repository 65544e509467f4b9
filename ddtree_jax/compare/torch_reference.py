"""An independent PyTorch reference: the target through HF transformers, a DFlash drafter module, and
ar / dflash / ddtree greedy decoding at batch 1.

Written by this project from the papers and HF's definitions, sharing no code with the JAX engine (nor
with the DDTree reference, z-lab or SGLang), so that `ddtree-compare reference` compares two
implementations. It trades speed for obviousness: every round starts afresh from the committed tokens
(one causal target pass gives their K/V and the drafter's features; nothing carries over between
rounds), the tree is built by a best-first heap over the drafter's top-k lattice (the DDTree
reference's way, not the engine's per-depth beams), and the tree is verified in one target pass over
that prefix with an ancestor-only 4-D attention mask, which transformers 5 takes as is
(`masking_utils`: a 4-D mask is returned unchanged; eager attention adds it to the scores). `ar` is
plain greedy steps over HF's K/V cache.

The round, as docs/design.md describes it: draft a block `[bonus, mask x D]`, build the tree, verify it,
walk from the root along the target's choices, commit the walked path. A round's acceptance length
is the number of tokens it adds to the output (accepted draft tokens plus the bonus, cut by a stop id
or by `max_new_tokens`); the prefill's token belongs to no round.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from ddtree_jax.compare.oracles import (
    DraftTree,
    ancestor_mask,
    chain_tree,
    default_target_layer_ids,
    heap_tree,
    walk,
)

METHODS = ("ar", "dflash", "ddtree")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# -- the DFlash drafter -----------------------------------------------------------------------------


class DraftAttention(nn.Module):
    """Block queries over keys/values of [context features ; block], no mask (the block is bidirectional)."""

    def __init__(self, cfg):
        super().__init__()
        hd, self.heads, self.kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=False)
        self.q_norm = Qwen3RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[T, n * hd] -> [1, n, T, hd]."""
        return x.view(x.shape[0], n, -1).transpose(0, 1)[None]

    def forward(self, block: torch.Tensor, context: torch.Tensor, rope) -> torch.Tensor:
        """block [K, H], context [L, H] (normed features), rope (cos, sin) over L + K -> [K, H]."""
        k_len = block.shape[0]
        both = torch.cat([context, block])  # [L + K, H]
        q = self.q_norm(self._heads(self.q_proj(block), self.heads))
        k = self.k_norm(self._heads(self.k_proj(both), self.kv_heads))
        v = self._heads(self.v_proj(both), self.kv_heads)
        cos, sin = rope
        q, _ = apply_rotary_pos_emb(q, q, cos[:, -k_len:], sin[:, -k_len:])
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [1, Hq, K, L + K]
        out = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v  # [1, Hq, K, hd]
        return self.o_proj(out[0].transpose(0, 1).reshape(k_len, -1))


class DraftLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads the context features."""

    def __init__(self, cfg):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor, rope) -> torch.Tensor:
        """x [K, H] -> [K, H]; context [L, H] enters every layer unchanged (only its K/V are projected)."""
        x = x + self.self_attn(self.input_layernorm(x), context, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


def use_legacy_yarn(cfg) -> None:
    """A yarn drafter's cos/sin factor as older transformers computed it, 0.1 ln(factor) + 1, unless its
    config gives `attention_factor` or `dflash_config.yarn_scaling` says "hf" (the convention the
    published Kimi-K2.5 drafter was trained with; docs/architectures.md, "Drafter RoPE"). Written into
    the config's rope parameters, which HF's rotary embedding reads."""
    for params in {id(p): p for p in (getattr(cfg, "rope_parameters", None), cfg.rope_scaling) if p}.values():
        legacy = cfg.dflash_config.get("yarn_scaling", "legacy") == "legacy"
        if params.get("rope_type") == "yarn" and params.get("attention_factor") is None and legacy:
            original = params["original_max_position_embeddings"]
            factor = params.get("factor") or cfg.max_position_embeddings / original
            params["attention_factor"] = 0.1 * math.log(factor) + 1.0


class DFlashDrafter(nn.Module):
    """A z-lab layout DFlash drafter: `fc`, `hidden_norm`, `layers.{i}`, `norm` (no embedding, no head)."""

    def __init__(self, cfg, num_target_layers: int):
        super().__init__()
        self.cfg = cfg
        self.block_size = int(cfg.block_size)
        self.mask_token_id = int(cfg.dflash_config["mask_token_id"])
        ids = cfg.dflash_config.get("target_layer_ids")
        n_layers = int(getattr(cfg, "num_target_layers", None) or num_target_layers)
        self.target_layer_ids = list(ids or default_target_layer_ids(n_layers, cfg.num_hidden_layers))
        h = cfg.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, cfg.rms_norm_eps)
        use_legacy_yarn(cfg)
        self.rotary = Qwen3RotaryEmbedding(cfg)

    @classmethod
    def load(cls, directory: str | Path, num_target_layers: int, dtype: torch.dtype) -> DFlashDrafter:
        """The drafter of a directory (config.json, *.safetensors), every weight name checked."""
        directory = Path(directory)
        cfg = AutoConfig.from_pretrained(directory)
        model = cls(cfg, num_target_layers)
        weights = {}
        for f in sorted(directory.glob("*.safetensors")):
            weights.update(load_file(f))
        model.load_state_dict(weights, strict=True)  # the rotary table is a non-persistent buffer
        model = model.to(dtype).eval()
        model.rotary = Qwen3RotaryEmbedding(cfg)  # its inverse frequencies stay float32, as HF keeps them
        return model

    def hidden(self, features: torch.Tensor, block_embeds: torch.Tensor) -> torch.Tensor:
        """Normed outputs [K - 1, H] at depths 1..D from features [L, F] and the embedded block [K, H]."""
        context = self.hidden_norm(self.fc(features))
        positions = torch.arange(features.shape[0] + block_embeds.shape[0])[None]
        rope = self.rotary(block_embeds, positions)
        x = block_embeds
        for layer in self.layers:
            x = layer(x, context, rope)
        return self.norm(x[1:])


# -- the pair and its decoding ------------------------------------------------------------------------


class Decoding(NamedTuple):
    """How a generation decodes: the method and its tree settings."""

    method: str = "ar"
    budget: int = 0  # ddtree: tree nodes besides the root
    branching: int = 1  # ddtree: drafter candidates per depth
    block_size: int | None = None  # a shorter block than the drafter's (None: the drafter's)


class TorchPair:
    """A target (HF transformers) and an optional DFlash drafter, run at batch 1 on the CPU."""

    def __init__(
        self,
        target_dir: str | Path,
        draft_dir: str | Path | None = None,
        dtype: str = "float32",
        threads: int | None = 1,
    ):
        # One thread by default: these models are small, and on a shared CPU several torch threads
        # made every forward 30-50x slower (measured on the project's 2-core CI-like machines).
        if threads is not None:
            torch.set_num_threads(threads)
        self.dtype = DTYPES[dtype]
        self.target = AutoModelForCausalLM.from_pretrained(
            target_dir, dtype=self.dtype, attn_implementation="eager"
        ).eval()
        # transformers 5.2x renamed `past_key_values` to `cache` (the old name still works, with a warning).
        params = inspect.signature(self.target.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        num_layers = self.target.config.num_hidden_layers
        self.drafter = None if draft_dir is None else DFlashDrafter.load(draft_dir, num_layers, self.dtype)

    @torch.no_grad()
    def logits(self, input_ids: list[int]) -> np.ndarray:
        """float32 target logits [T, V] of one sequence under the ordinary causal mask."""
        out = self.target(input_ids=torch.tensor([input_ids]), use_cache=False)
        return out.logits[0].float().numpy()

    def _features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """HF `hidden_states[i + 1]` per drafter target layer id, concatenated: [T, F]."""
        return torch.cat([hidden_states[i + 1][0] for i in self.drafter.target_layer_ids], dim=-1)

    @torch.no_grad()
    def features(self, input_ids: list[int]) -> torch.Tensor:
        """The drafter's conditioning [T, F] of a sequence (HF's: the last layer's entry is post-norm)."""
        out = self.target.model(
            input_ids=torch.tensor([input_ids]), output_hidden_states=True, use_cache=False
        )
        return self._features(out.hidden_states)

    @torch.no_grad()
    def prefix(self, context: list[int]) -> tuple[DynamicCache, torch.Tensor | None]:
        """One causal pass over the committed tokens: their K/V in a fresh cache, and their features."""
        out = self.target.model(
            input_ids=torch.tensor([context]), output_hidden_states=self.drafter is not None, use_cache=True
        )
        return _cache_of(out), None if self.drafter is None else self._features(out.hidden_states)

    @torch.no_grad()
    def draft_logits(self, features: torch.Tensor, bonus: int, block_size: int | None = None) -> np.ndarray:
        """float32 drafter logits [D, V] at depths 1..D of the block `[bonus, mask x D]` after the context
        (block_size: a shorter block than the drafter's)."""
        size = block_size or self.drafter.block_size
        block = [bonus] + [self.drafter.mask_token_id] * (size - 1)
        embeds = self.target.get_input_embeddings()(torch.tensor(block))
        hidden = self.drafter.hidden(features.to(self.dtype), embeds)
        return self.target.lm_head(hidden).float().numpy()

    def _draft_candidates(self, features: torch.Tensor, bonus: int, k: int, block_size: int | None):
        """Per-depth top-k log-probs and tokens [D, k], sorted descending, equal values by lower token id."""
        logits = torch.from_numpy(self.draft_logits(features, bonus, block_size))
        logp = torch.log_softmax(logits, dim=-1)
        order = torch.sort(logp, dim=-1, descending=True, stable=True).indices[:, :k]
        return torch.gather(logp, -1, order).numpy(), order.numpy()

    @torch.no_grad()
    def verify(self, cache: DynamicCache, tree: DraftTree) -> list[int]:
        """The target's greedy choice at every tree node, from one pass over the tree after the cached
        committed tokens, each node seeing the whole prefix and its own ancestors (a 4-D mask)."""
        n, t = cache.get_seq_length(), len(tree.tokens)
        allowed = np.concatenate([np.ones((t, n), bool), ancestor_mask(tree.parent)], axis=1)  # [T, n + T]
        mask = torch.zeros(allowed.shape, dtype=self.dtype)
        mask[~torch.from_numpy(allowed)] = torch.finfo(self.dtype).min
        out = self.target(
            input_ids=torch.tensor([tree.tokens]),
            attention_mask=mask[None, None],
            position_ids=torch.tensor([[n + d for d in tree.depth]]),
            use_cache=True,
            **{self._cache_arg: cache},
        )
        return out.logits[0].float().argmax(-1).tolist()

    def round(self, context: list[int], bonus: int, decoding: Decoding) -> list[int]:
        """One round after `context` (the committed tokens) with root `bonus`: the tokens it emits
        (the target's choices along the accepted path: accepted draft tokens, then the next bonus).
        Everything is recomputed from `context`: nothing carries over from the previous round."""
        cache, features = self.prefix(context)
        if decoding.method == "dflash":
            _, tok = self._draft_candidates(features, bonus, 1, decoding.block_size)
            tree = chain_tree(bonus, tok[:, 0].tolist())
        else:
            logp, tok = self._draft_candidates(features, bonus, decoding.branching, decoding.block_size)
            tree = heap_tree(bonus, logp, tok, decoding.budget)
        choice = self.verify(cache, tree)
        return [choice[node] for node in walk(tree, choice)]

    def generate(
        self,
        input_ids: list[int],
        method: str = "ar",
        max_new_tokens: int = 128,
        budget: int = 0,
        branching: int = 1,
        stop_ids: tuple[int, ...] = (),
        block_size: int | None = None,
    ) -> tuple[list[int], list[int]]:
        """Greedy generation: (output ids, the stop id included when hit; acceptance length per round)."""
        decoding = Decoding(method, budget, branching, block_size)
        self._check(decoding)
        if method == "ar":
            output = self._ar(list(input_ids), max_new_tokens, stop_ids)
            return output, [1] * (len(output) - 1)
        output = [int(self.logits(list(input_ids))[-1].argmax())]  # the prefill's token
        acceptance: list[int] = []
        while output[-1] not in stop_ids and len(output) < max_new_tokens:
            context = list(input_ids) + output[:-1]  # the bonus output[-1] is not committed yet
            emitted = self.round(context, output[-1], decoding)
            stops = [i for i, tok in enumerate(emitted) if tok in stop_ids]
            emitted = emitted[: stops[0] + 1] if stops else emitted
            emitted = emitted[: max_new_tokens - len(output)]
            output += emitted
            acceptance.append(len(emitted))
        return output, acceptance

    @torch.no_grad()
    def _ar(self, input_ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...]) -> list[int]:
        """Plain greedy steps, each over HF's K/V cache of everything before it (ar needs no tree)."""
        out = self.target(input_ids=torch.tensor([input_ids]), use_cache=True)
        output = [int(out.logits[0, -1].argmax())]
        while output[-1] not in stop_ids and len(output) < max_new_tokens:
            step = torch.tensor([[output[-1]]])
            out = self.target(input_ids=step, use_cache=True, **{self._cache_arg: _cache_of(out)})
            output.append(int(out.logits[0, -1].argmax()))
        return output

    def _check(self, decoding: Decoding) -> None:
        """Reject settings this pair cannot run."""
        if decoding.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {decoding.method!r}")
        if decoding.method != "ar" and self.drafter is None:
            raise ValueError(f"method {decoding.method!r} needs a drafter")
        if decoding.method == "ddtree" and (decoding.budget < 1 or decoding.branching < 1):
            raise ValueError("ddtree needs budget >= 1 and branching >= 1")
        if (
            decoding.method != "ar"
            and decoding.block_size is not None
            and not 2 <= decoding.block_size <= self.drafter.block_size
        ):
            raise ValueError(f"block_size must lie in [2, {self.drafter.block_size}]")


def _cache_of(out) -> DynamicCache:
    """The K/V cache an HF forward returned (`cache` in recent transformers, `past_key_values` before)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def read_stop_ids(target_dir: str | Path) -> tuple[int, ...]:
    """The target's stop ids: generation_config.json's eos_token_id, else config.json's."""
    for name in ("generation_config.json", "config.json"):
        path = Path(target_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()
