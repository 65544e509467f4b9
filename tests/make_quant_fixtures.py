#!/usr/bin/env python
"""Write the quantized fixtures under tests/fixtures/quant/ (CI only reads them).

Run from the repository root with an interpreter that has torch, transformers and compressed-tensors:

    PYTHONPATH=$PWD python tests/make_quant_fixtures.py [--out tests/fixtures/quant]

One tiny random DeepseekV3ForCausalLM (QUANT, from make_fixtures.py's factory: 2 layers, the first dense,
4 routed experts + 1 shared, hidden 256), saved by transformers, then written in the two published
formats:
  * deepseek_fp8/: every Linear weight of attention and MLPs (experts included) as float8 e4m3 with a
    float32 `weight_scale_inv` per 128 x 128 block (partial blocks at the edges: q_lora 192,
    kv_a 160, experts 64 wide), config `quant_method: fp8` as DeepSeek-V3 publishes it; embeddings,
    norms, router and lm_head stay bf16.
  * deepseek_int4/: routed experts as compressed-tensors pack-quantized int4 (W4A16, group 32),
    packed by compressed-tensors' own compressor; the rest bf16, with the ignore list Kimi-K2.5 uses.
and, from the golden DeepseekV3 fixture tests/fixtures/deepseek_v3_tp (whose DFlash drafter,
dflash_deepseek_v3_tp, fits it: speculative tests run on these), the same two formats at block sizes
that split over 2, 4 and 8 devices: deepseek_v3_tp_fp8/ (4 x 4 blocks: every split dim holds whole
blocks at --tp 8) and deepseek_v3_tp_int4/ (routed experts in groups of 16, the experts 16 wide).
Each directory holds expected.npz: the dequantised weights of a few tensors as the reference code
computes them (fp8: DeepSeek's `fp8 * scale` in float32; int4: compressed-tensors' own
`decompress`), the HF logits of the dequantised model for one prompt (float32), and whether HF
transformers loaded the quantized directory itself (hf_load.json; its weights are then cast to float32
before the forward: HF keeps decompressed experts in bf16).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from make_fixtures import FIXTURES, small
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

BLOCK = 128
GROUP = 32
PROMPT = [3, 17, 42, 99, 5, 64, 7, 120, 33, 1]
REFERENCE_TENSORS = {
    "deepseek_fp8": [
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.1.self_attn.q_b_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight",
    ],
    "deepseek_int4": [
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.2.up_proj.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight",
    ],
    "deepseek_v3_tp_fp8": [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.mlp.shared_experts.down_proj.weight",
        "model.layers.2.mlp.experts.5.up_proj.weight",
    ],
    "deepseek_v3_tp_int4": [
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.2.mlp.experts.7.down_proj.weight",
    ],
}
TP_SOURCE = FIXTURES / "deepseek_v3_tp"  # the golden DeepseekV3 fixture
TP_BLOCK, TP_GROUP = 4, 16
INT4_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
]


# Dims that make full and partial 128-blocks and whole 32-groups; bf16 weights ~ N(0, 0.06^2) (seed 19).
QUANT = small(
    "deepseek_v3",
    19,
    std=0.06,
    vocab_size=128,
    hidden=256,
    layers=2,
    heads=2,
    intermediate_size=256,
    moe_intermediate_size=64,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    q_lora_rank=192,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    max_position_embeddings=256,
    rope_scaling=None,
    num_nextn_predict_layers=0,
    torch_dtype="bfloat16",
)


def checkpoint_tensors(seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The random model's tensors under their checkpoint names (bf16) and its config.json."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**QUANT.config)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, QUANT.std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            tensors |= load_file(f)
        config = json.loads((Path(tmp) / "config.json").read_text())
    return tensors, config


def is_linear(name: str) -> bool:
    """A Linear weight of attention or an MLP (not norms, router, embeddings or lm_head)."""
    return name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight")


def quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (e4m3 [out, in], float32 scale [ceil(out/b), ceil(in/b)]): amax / 448 per block."""
    out, inp = w.shape
    nbo, nbi = -(-out // block), -(-inp // block)
    padded = torch.zeros(nbo * block, nbi * block, dtype=torch.float32)
    padded[:out, :inp] = w.float()
    blocks = padded.reshape(nbo, block, nbi, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:out, :inp].to(torch.float8_e4m3fn)
    return q, scale


def dequant_fp8_torch(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """DeepSeek's dequantisation: fp8 value * its block's scale in float32."""
    s = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * s


def int4_scheme(group: int) -> QuantizationScheme:
    """W4A16 symmetric int4 with one scale per `group` inputs (Kimi-K2.5's experts: 32)."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    return QuantizationScheme(targets=["Linear"], weights=args)


def quantize_int4(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """[out, in] -> compressed-tensors' weight_packed / weight_scale / weight_shape (its compressor)."""
    groups = w.float().reshape(w.shape[0], -1, group)
    scale = (groups.abs().amax(dim=-1) / 7.0).clamp(min=1e-6).to(torch.bfloat16)
    state = {"weight": w.to(torch.bfloat16), "weight_scale": scale}
    return PackedQuantizationCompressor.compress(state, int4_scheme(group))


def dequant_int4_lib(fields: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """compressed-tensors' own decompression of one packed weight."""
    return PackedQuantizationCompressor.decompress(dict(fields), int4_scheme(group))["weight"]


def fp8_config(block: int) -> dict:
    """DeepSeek-V3's quantization_config."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [block, block],
    }


def int4_config(group: int) -> dict:
    """compressed-tensors' quantization_config as Kimi-K2.5 publishes it (one W4A16 group)."""
    weights = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": group,
        "num_bits": 4,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "group",
        "symmetric": True,
        "type": "int",
    }
    group = {"input_activations": None, "output_activations": None, "targets": ["Linear"], "weights": weights}
    return {
        "config_groups": {"group_0": group},
        "format": "pack-quantized",
        "ignore": INT4_IGNORE,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def write_fp8(tensors: dict, config: dict, out: Path, block: int = BLOCK) -> dict[str, torch.Tensor]:
    """The fp8 directory; returns the dequantised weights of every tensor (checkpoint names)."""
    stored, deq = {}, {}
    for name, w in tensors.items():
        if is_linear(name):
            q, s = quantize_fp8(w, block)
            stored[name], stored[name[: -len("weight")] + "weight_scale_inv"] = q, s
            deq[name] = dequant_fp8_torch(q, s, block)
        else:
            stored[name] = w
            deq[name] = w.float()
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(
        json.dumps(config | {"quantization_config": fp8_config(block)}, indent=2) + "\n"
    )
    return deq


def write_int4(tensors: dict, config: dict, out: Path, group: int = GROUP) -> dict[str, torch.Tensor]:
    """The int4 directory (routed experts packed); returns the dequantised weights."""
    stored, deq = {}, {}
    for name, w in tensors.items():
        if ".mlp.experts." in name and is_linear(name):
            fields = quantize_int4(w, group)
            module = name[: -len(".weight")]
            stored |= {f"{module}.{k}": v.contiguous() for k, v in fields.items()}
            deq[name] = dequant_int4_lib(fields, group).float()
        else:
            stored[name] = w
            deq[name] = w.float()
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(
        json.dumps(config | {"quantization_config": int4_config(group)}, indent=2) + "\n"
    )
    return deq


def hf_logits(directory: Path, **kwargs) -> np.ndarray:
    """float32 logits [T, V] of PROMPT from an HF directory."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.float()  # HF keeps decompressed weights in their bf16
        return model(torch.tensor([PROMPT])).logits[0].float().numpy()


def dequantised_logits(deq: dict, config: dict) -> np.ndarray:
    """HF logits of the model whose weights are the dequantised ones (float32)."""
    with tempfile.TemporaryDirectory() as tmp:
        save_file({k: v.contiguous() for k, v in deq.items()}, Path(tmp) / "model.safetensors")
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return hf_logits(Path(tmp))


def hf_quantized_logits(directory: Path, reference: np.ndarray) -> dict:
    """Whether HF transformers loads the quantized directory itself, and how close its logits are."""
    try:
        logits = hf_logits(directory)
    except Exception as e:  # noqa: BLE001 - recorded in the fixture, not raised
        return {"hf_loads_quantized": False, "hf_error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"hf_loads_quantized": True, "hf_max_abs_diff": float(np.abs(logits - reference).max())}


def golden_tp_tensors() -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and config.json of tests/fixtures/deepseek_v3_tp (its generation config copied too)."""
    config = json.loads((TP_SOURCE / "config.json").read_text())
    return load_file(TP_SOURCE / "model.safetensors"), config


def write_fixture(name: str, write, tensors: dict, config: dict, out: Path) -> None:
    """One quantized directory with its expected.npz and hf_load.json."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    deq = write(tensors, config, out)
    logits = dequantised_logits(deq, config)
    info = hf_quantized_logits(out, logits)
    (out / "hf_load.json").write_text(json.dumps(info, indent=2) + "\n")
    ref = {f"deq:{k}": deq[k].numpy() for k in REFERENCE_TENSORS[name]}
    np.savez_compressed(out / "expected.npz", prompt=np.array(PROMPT), logits=logits, **ref)
    print(name, info, {k: v.shape for k, v in ref.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(FIXTURES / "quant"))
    parser.add_argument("--seed", type=int, default=QUANT.seed)
    args = parser.parse_args()
    tensors, config = checkpoint_tensors(args.seed)
    config.pop("quantization_config", None)
    for name, write in (("deepseek_fp8", write_fp8), ("deepseek_int4", write_int4)):
        write_fixture(name, write, tensors, config, Path(args.out) / name)
    tensors, config = golden_tp_tensors()
    tp_writers = {
        "deepseek_v3_tp_fp8": lambda t, c, o: write_fp8(t, c, o, TP_BLOCK),
        "deepseek_v3_tp_int4": lambda t, c, o: write_int4(t, c, o, TP_GROUP),
    }
    for name, write in tp_writers.items():
        out = Path(args.out) / name
        write_fixture(name, write, tensors, config, out)
        shutil.copy(TP_SOURCE / "generation_config.json", out / "generation_config.json")


if __name__ == "__main__":
    main()
