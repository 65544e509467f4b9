"""Train the bundled default pair: a Qwen3 code model on the Python standard library, and its DFlash
drafter. Stages: tokenizer, target, eval, draft, prompts (default: all, in that order; run in the
order --stages gives; each stage reads the earlier stages' files from --out).

The bundled pair (results/default-pair.md; about five minutes on one H200):

    python scripts/train_default_pair.py --layers 6 --ff 1024 --draft-layers 2 --batch 64 \\
        --target-steps 2000 --warmup 100 --log-every 100 --stages tokenizer,target,eval,prompts
    python scripts/train_default_pair.py --draft-layers 2 --draft-target-layers 1,3,5 --draft-batch 64 \\
        --draft-steps 12000 --warmup 100 --selfgen-sequences 24576 --selfgen-batch 1024 \\
        --selfgen-fraction 0.5 --stages draft

The corpus is the `.py` files of the interpreter running this script (its version is logged), split
by file (a hash of the relative path) into train and held-out sets. The target keeps its best step
by the loss on a validation slice of the held-out split.

A script, not a CLI: it made the bundled pair once (ddtree_jax/assets/) and needs the `[train]` extra;
users load pairs, they do not train them with this package.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source tree

from ddtree_jax import drafter, target, train  # noqa: E402
from ddtree_jax.checkpoint import save_hf  # noqa: E402
from ddtree_jax.config import DFlash2Config  # noqa: E402
from ddtree_jax.engine import Plan  # noqa: E402
from ddtree_jax.prompts import Prompt  # noqa: E402
from ddtree_jax.scheduler import Generator, Schedule  # noqa: E402
from ddtree_jax.sharding import make_mesh, param_sharding  # noqa: E402

EOS, MASK = "<|endoftext|>", "<|mask|>"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "ddtree_jax" / "assets" / "default_pair"
RESULTS = ROOT / "results"


def corpus_files(include_tests: bool) -> tuple[Path, list[Path]]:
    """The stdlib root and its .py files (no site-packages; test suites only if asked), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        if not include_tests and any(p in ("test", "tests", "idle_test") for p in parts[:-1]):
            continue
        files.append(path)
    return root, files


def is_heldout(rel: str, fraction: float) -> bool:
    """Deterministic split by file: the first bytes of sha256(relative path)."""
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "little") / 2**64
    return h < fraction


def read_corpus(args) -> dict:
    root, files = corpus_files(args.include_tests)
    split = {"train": [], "heldout": []}
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        rel = str(path.relative_to(root))
        split["heldout" if is_heldout(rel, args.heldout_fraction) else "train"].append((rel, text))
    return {"root": str(root), **split}


def train_tokenizer(corpus: dict, out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((text for _, text in corpus["train"]), trainer)
    for d in (out / "target", out / "draft"):
        d.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "target" / "tokenizer.json"))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "bos_token": None,
        "pad_token": EOS,
        "unk_token": None,
        "mask_token": MASK,
        "add_bos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    (out / "target" / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")


def tokenize(corpus: dict, out: Path) -> dict[str, np.ndarray]:
    """Each split as one stream: documents each followed by the eos token."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    streams = {}
    for name in ("train", "heldout"):
        encs = tok.encode_batch([text for _, text in corpus[name]], add_special_tokens=False)
        ids = [i for e in encs for i in [*e.ids, eos]]
        streams[name] = np.asarray(ids, np.int32)
    return streams


def log(record: dict, path: Path) -> None:
    print(json.dumps(record), flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def run_steps(
    trainer, make_batch, steps, seed, name, log_path, log_every, aux_name=None, max_seconds=None, hook=None
) -> list[dict]:
    """Train `steps` steps (fewer if `max_seconds` of wall clock pass first), logging every `log_every`;
    `hook(step)` runs at each logged step and may add fields to the record."""
    key = jax.random.key(seed)
    history, start = [], time.perf_counter()
    window = []
    for step in range(1, steps + 1):
        key, sub = jax.random.split(key)
        loss, aux = trainer.step(jnp.asarray(make_batch()), sub)
        window.append(loss)
        if step % log_every == 0 or step == steps or step == 1:
            rec = {
                "stage": name,
                "step": step,
                "loss": float(np.mean([float(x) for x in window])),
                "lr": float(trainer.schedule(step - 1)),
                "seconds": round(time.perf_counter() - start, 1),
            }
            if aux_name is not None:
                rec[aux_name] = [round(float(a), 3) for a in np.asarray(aux)]
            if hook is not None:
                rec |= hook(step)
            window = []
            history.append(rec)
            log(rec, log_path)
            if max_seconds is not None and rec["seconds"] > max_seconds and step < steps:
                stop = {"stage": name, "stopped_at_step": step, "of": steps, "max_seconds": max_seconds}
                log(stop, log_path)
                break
    return history


def stage_target(args, streams, out, summary, log_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    cfg = train.make_target_config(
        tok.get_vocab_size(),
        args.hidden,
        args.layers,
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.ff,
        eos_token_ids=(eos,),
    )
    params = train.init_params(target.weight_specs(cfg), args.seed, cfg.num_layers)
    summary["target_params"] = train.count_params(params)
    oc = train.OptimConfig(args.target_steps, args.target_lr, args.warmup)
    trainer = train.target_trainer(cfg, params, oc, args.target_dropout)
    rng = np.random.default_rng(args.seed)
    # Early stopping on a validation slice of the held-out split, after the part `eval` reports on.
    valid = streams["heldout"][args.eval_tokens + 1 :][: args.valid_tokens + 1]
    best = {"loss": float("inf"), "step": 0, "params": None}

    def keep_best(step):
        if len(valid) <= args.seq_len + 1:
            return {}
        loss = train.eval_target_loss(trainer.params, cfg, valid, args.seq_len, args.batch)
        if loss < best["loss"]:
            best.update(loss=loss, step=step, params=jax.tree.map(jnp.copy, trainer.params))
        return {"valid_loss": round(loss, 4)}

    start = time.perf_counter()
    summary["target_history"] = run_steps(
        trainer,
        lambda: train.random_windows(streams["train"], rng, args.batch, args.seq_len + 1),
        args.target_steps,
        args.seed,
        "target",
        log_path,
        args.log_every,
        max_seconds=args.max_seconds,
        hook=keep_best,
    )
    summary["target_seconds"] = round(time.perf_counter() - start, 1)
    summary["target_best"] = {"step": best["step"], "valid_loss": best["loss"]}
    log({"stage": "target", "saved_step": best["step"], "valid_loss": best["loss"]}, log_path)
    params = trainer.params if best["params"] is None else best["params"]
    save_hf(params, target.weight_specs(cfg), out / "target", train.target_hf_config(cfg))
    gen = {"eos_token_id": eos, "bos_token_id": eos, "do_sample": False}
    (out / "target" / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def load_target_f32(out: Path):
    return target.load(out / "target", jnp.float32, param_sharding(make_mesh(1, 1)))


def stage_eval(args, streams, out, summary, log_path):
    cfg, params = load_target_f32(out)
    held = streams["heldout"][: args.eval_tokens + 1]
    loss = train.eval_target_loss(params, cfg, held, args.seq_len, args.batch)
    rec = {
        "stage": "eval",
        "heldout_loss_bf16": loss,
        "heldout_ppl": float(np.exp(loss)),
        "tokens": len(held),
    }
    summary["heldout"] = rec
    log(rec, log_path)


def self_generated(args, tcfg, tparams, stream: np.ndarray, log_path) -> np.ndarray:
    """The target's own greedy continuations of random training windows [n, draft_seq_len].

    At inference the drafter extends the target's own output, which is more regular than the corpus
    (small models repeat themselves); training on it too is DFlash's self-distillation data.
    """
    rng = np.random.default_rng(args.seed + 2)
    n, prompt_len, new = args.selfgen_sequences, args.selfgen_prompt, args.draft_seq_len - args.selfgen_prompt
    plan = Plan(tcfg, None, "ar", new)
    gen = Generator(tparams, None, plan, (), schedule=Schedule(args.selfgen_batch, policy="static"))
    start, rows = time.perf_counter(), []
    for first in range(0, n, args.selfgen_batch):
        windows = train.random_windows(stream, rng, min(args.selfgen_batch, n - first), prompt_len)
        prompts = [Prompt(first + i, 0, w.tolist(), {}) for i, w in enumerate(windows)]
        rows += [[*p.input_ids, *r.output_ids] for p, r in zip(prompts, gen.run(prompts), strict=True)]
    seconds = round(time.perf_counter() - start, 1)
    log({"stage": "selfgen", "sequences": len(rows), "seconds": seconds}, log_path)
    return np.asarray(rows, np.int32)  # [n, draft_seq_len]: each row one window


def from_v1_drafter(params, dcfg, directory: Path, tcfg):
    """A DFlash2 drafter's initial parameters from a v1 drafter of the same shape (--init-draft): its
    weights, identity convolutions (tap 0 of both sides at 1, no dynamic part) and the selector as
    initialised, so that it drafts exactly as the v1 drafter until training moves it."""
    vcfg, vparams = drafter.load(directory, tcfg, jnp.float32, param_sharding(make_mesh(1, 1)))
    if dcfg.dflash2 is None or (vcfg.num_layers, vcfg.dims, vcfg.target_layer_ids) != (
        dcfg.num_layers,
        dcfg.dims,
        dcfg.target_layer_ids,
    ):
        raise SystemExit(f"--init-draft {directory}: needs --dflash2 and a drafter of the same shape")
    out = dict(params, fc=vparams["fc"], hidden_norm=vparams["hidden_norm"], norm=vparams["norm"])
    out["layers"] = []
    for new, old in zip(params["layers"], vparams["layers"], strict=True):
        old = dict(old)  # drafter.load fuses k/v and gate/up; the trained (and saved) layout keeps them apart
        kv, gate_up = old.pop("kv_proj"), old.pop("gate_up_proj")  # [H, kv_heads, 2, D], [H, 2, F]
        old |= {
            "k_proj": kv[:, :, 0].reshape(kv.shape[0], -1),
            "v_proj": kv[:, :, 1].reshape(kv.shape[0], -1),
        }
        old |= {"gate_proj": gate_up[:, 0], "up_proj": gate_up[:, 1]}
        if set(old) - set(new):
            raise SystemExit(f"--init-draft {directory}: unexpected weights {sorted(set(old) - set(new))}")
        layer = dict(new, **old)
        for conv in ("attention_conv", "mlp_conv"):
            base = jnp.zeros_like(new[conv]["base_kernel"]).at[:, 0].set(1.0)
            layer[conv] = {
                "base_kernel": base,
                "kernel_projection": jnp.zeros_like(new[conv]["kernel_projection"]),
            }
        out["layers"].append(layer)
    return out


def stage_draft(args, streams, out, summary, log_path):
    from tokenizers import Tokenizer

    tcfg, tparams = load_target_f32(out)  # the bf16 weights the engine will run, upcast
    mask_id = Tokenizer.from_file(str(out / "target" / "tokenizer.json")).token_to_id(MASK)
    layer_ids = (
        tuple(int(i) for i in args.draft_target_layers.split(",")) if args.draft_target_layers else None
    )
    if layer_ids and not all(0 <= i < tcfg.num_layers for i in layer_ids):
        raise SystemExit(
            f"--draft-target-layers {args.draft_target_layers}: the target has {tcfg.num_layers} layers"
        )
    dcfg = train.make_draft_config(
        tcfg, mask_id, args.draft_layers, args.block_size, args.draft_ff, layer_ids
    )
    if args.dflash2:  # taps, group size, selector rank, top-K: a DFlash2 drafter (no window, not causal)
        taps, group, rank, top_k = (int(x) for x in args.dflash2.split(","))
        layers = (False,) * args.draft_layers
        dcfg = dataclasses.replace(
            dcfg, dflash2=DFlash2Config(taps, group, rank, top_k, sliding=layers, causal=layers)
        )
    params = train.init_params(drafter.weight_specs(dcfg), args.seed + 1, dcfg.num_layers)
    # The drafter's logits go through the target's lm_head: start its output norm at the target's.
    params["norm"] = jnp.asarray(tparams["norm"], jnp.float32)
    if args.init_draft:
        params = from_v1_drafter(params, dcfg, args.init_draft, tcfg)
    summary["draft_params"] = train.count_params(params)
    only = tuple(args.draft_train_only.split(",")) if args.draft_train_only else ()
    oc = train.OptimConfig(args.draft_steps, args.draft_lr, args.warmup, weight_decay=0.0 if only else 0.1)
    gamma = args.gamma if args.gamma > 0 else None
    trainer = train.draft_trainer(
        dcfg,
        params,
        tparams,
        tcfg,
        oc,
        args.anchors,
        gamma,
        args.consistent_labels,
        args.greedy_anchors,
        only=only,
    )
    rng = np.random.default_rng(args.seed + 1)
    own = self_generated(args, tcfg, tparams, streams["train"], log_path) if args.selfgen_sequences else None
    num_own = 0 if own is None else round(args.draft_batch * args.selfgen_fraction)

    def make_batch():
        parts = []
        if args.draft_batch > num_own:
            parts.append(
                train.random_windows(streams["train"], rng, args.draft_batch - num_own, args.draft_seq_len)
            )
        if num_own:  # whole continuations, never a window across two of them
            parts.append(own[rng.integers(0, len(own), size=num_own)])
        return np.concatenate(parts)

    start = time.perf_counter()
    summary["draft_history"] = run_steps(
        trainer,
        make_batch,
        args.draft_steps,
        args.seed + 1,
        "draft",
        log_path,
        args.log_every,
        aux_name="agree_per_slot",
        max_seconds=args.max_seconds,
    )
    summary["draft_seconds"] = round(time.perf_counter() - start, 1)
    draft_dir = out / args.draft_dir
    save_hf(trainer.params, drafter.weight_specs(dcfg), draft_dir, train.draft_hf_config(dcfg, tcfg))


def stage_prompts(args, corpus, out, summary):
    """Held-out code: --prompt-lines lines from the start of held-out files chosen by hash (and, with
    --prompt-stride S, from every S-th line after it while as many lines again follow)."""
    n = args.prompt_lines
    files = [(rel, text) for rel, text in corpus["heldout"] if text.count("\n") >= 2 * n]
    files.sort(key=lambda f: hashlib.sha256(f[0].encode()).hexdigest())
    lines = []
    for rel, text in files[: args.num_prompts]:
        rows = text.splitlines(keepends=True)
        starts = range(0, len(rows) - 2 * n + 1, args.prompt_stride) if args.prompt_stride else [0]
        for start in starts:
            prompt_id = rel if start == 0 else f"{rel}:{start + 1}"
            lines.append(json.dumps({"id": prompt_id, "prompt": "".join(rows[start : start + n])}))
    path = args.prompts_out or out / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    summary["prompts"] = len(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--log-json", type=Path, default=RESULTS / "default-pair-training.json")
    ap.add_argument("--stages", default="tokenizer,target,eval,draft,prompts")
    ap.add_argument("--include-tests", action="store_true", help="also train on the stdlib test suites")
    ap.add_argument("--heldout-fraction", type=float, default=0.05)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ff", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--target-steps", type=int, default=600)
    ap.add_argument("--target-lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument(
        "--target-dropout", type=float, default=0.0, help="target dropout (embeddings, residual branches)"
    )
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--draft-ff", type=int, default=None)
    ap.add_argument(
        "--dflash2",
        default=None,
        help="TAPS,GROUP,RANK,TOP_K: train a DFlash2 drafter (convolutions of TAPS taps over groups of GROUP "
        "channels, a selector of rank RANK over TOP_K candidates) instead of a v1 one",
    )
    ap.add_argument("--draft-dir", default="draft", help="the drafter's folder under --out")
    ap.add_argument(
        "--draft-train-only",
        default=None,
        help="comma list of the drafter's top-level parameter groups that learn (e.g. selector); the rest "
        "stay as initialised (no weight decay)",
    )
    ap.add_argument(
        "--init-draft", type=Path, default=None, help="with --dflash2: start from this v1 drafter's weights"
    )
    ap.add_argument(
        "--draft-target-layers",
        default=None,
        help="comma list of target layers whose outputs feed the drafter (default: DFlash's spacing)",
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=16, help="anchors per training sequence")
    ap.add_argument("--draft-seq-len", type=int, default=256)
    ap.add_argument("--draft-batch", type=int, default=8)
    ap.add_argument("--draft-steps", type=int, default=400)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument(
        "--selfgen-sequences",
        type=int,
        default=0,
        help="drafter data: this many greedy continuations by the target of random training windows",
    )
    ap.add_argument("--selfgen-prompt", type=int, default=32, help="tokens of each continuation's window")
    ap.add_argument("--selfgen-batch", type=int, default=256)
    ap.add_argument("--selfgen-fraction", type=float, default=0.5, help="share of each drafter batch")
    ap.add_argument(
        "--consistent-labels",
        action="store_true",
        help="train a slot only where the target's greedy path from the anchor reproduces the text before it",
    )
    ap.add_argument(
        "--greedy-anchors",
        action="store_true",
        help="train only anchors whose token is the target's greedy choice (as the bonus is at inference)",
    )
    ap.add_argument("--gamma", type=float, default=7.0, help="slot-weight decay (DFlash); <= 0: uniform")
    ap.add_argument("--eval-tokens", type=int, default=65536)
    ap.add_argument(
        "--valid-tokens",
        type=int,
        default=32768,
        help="held-out tokens after the eval slice, scored at each logged target step; the best is saved",
    )
    ap.add_argument(
        "--num-prompts",
        type=int,
        default=16,
        help="held-out files the prompts come from (one from each by default)",
    )
    ap.add_argument("--prompt-lines", type=int, default=24)
    ap.add_argument(
        "--prompt-stride", type=int, default=0, help="a prompt every N lines of each file (0: its start only)"
    )
    ap.add_argument("--prompts-out", type=Path, default=None, help="default: --out/prompts.jsonl")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop a training stage after this many seconds even if steps remain (logged)",
    )
    args = ap.parse_args()

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    log_json = args.log_json
    log_path = log_json.with_suffix(".jsonl")
    stages = args.stages.split(",")
    unknown = set(stages) - {"tokenizer", "target", "eval", "draft", "prompts"}
    if unknown:
        ap.error(f"--stages: unknown stage(s) {sorted(unknown)}")
    if not 0 <= args.selfgen_fraction <= 1:
        ap.error(f"--selfgen-fraction must be in [0, 1], got {args.selfgen_fraction}")
    if args.selfgen_prompt >= args.draft_seq_len:
        ap.error("--selfgen-prompt must be shorter than --draft-seq-len")
    summary = json.loads(log_json.read_text()) if log_json.exists() else {}
    summary |= {"python": sys.version, "jax": jax.__version__, "backend": jax.default_backend()}
    summary.setdefault("args", {})[args.stages] = {k: str(v) for k, v in vars(args).items()}

    start = time.perf_counter()
    corpus = read_corpus(args)
    if "tokenizer" in stages:
        t0 = time.perf_counter()
        train_tokenizer(corpus, out, args.vocab_size)
        summary["tokenizer_seconds"] = round(time.perf_counter() - t0, 1)
    streams = tokenize(corpus, out)
    summary["corpus"] = {
        "stdlib": corpus["root"],
        "files": {k: len(corpus[k]) for k in ("train", "heldout")},
        "bytes": {k: sum(len(t.encode()) for _, t in corpus[k]) for k in ("train", "heldout")},
        "tokens": {k: int(len(v)) for k, v in streams.items()},
    }
    log({"stage": "corpus", **summary["corpus"]}, log_path)
    run = {
        "target": lambda: stage_target(args, streams, out, summary, log_path),
        "eval": lambda: stage_eval(args, streams, out, summary, log_path),
        "draft": lambda: stage_draft(args, streams, out, summary, log_path),
        "prompts": lambda: stage_prompts(args, corpus, out, summary),
    }
    for stage in stages:
        if stage in run:
            run[stage]()
            # Written after every stage: what is done survives a later stage's failure.
            log_json.write_text(json.dumps(summary, indent=2) + "\n")
    sizes = {
        d: sum(f.stat().st_size for f in (out / d).glob("*"))
        for d in ("target", "draft")
        if (out / d).exists()
    }
    summary["sizes_bytes"] = sizes
    summary.setdefault("stage_seconds", {})[args.stages] = round(time.perf_counter() - start, 1)
    log_json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
