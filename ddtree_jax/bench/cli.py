"""`ddtree-bench SUB-COMMAND [FLAGS]`: one entry point for the benchmarks; each sub-command is a module
of this package with its own flags (`ddtree-bench SUB-COMMAND --help`)."""

from __future__ import annotations

import importlib
import sys

from ddtree_jax.bench.report import EXIT_ERROR

# sub-command -> (module, what it measures); a module is imported only when its sub-command runs
SUBCOMMANDS = {
    "rounds": ("ddtree_jax.bench.rounds", "round and stage times against the HBM floor"),
    "profile": ("ddtree_jax.bench.profile", "a round's device time, kernel by kernel"),
    "scheduling": ("ddtree_jax.bench.scheduling", "continuous against static batching, a mixed workload"),
    "prefill": ("ddtree_jax.bench.prefill", "chunked prefill of one long prompt: time, memory, floor"),
    "load": ("ddtree_jax.bench.load", "load times: HF safetensors against the params cache"),
    # one kernel or op alone, against its alternatives and its floor
    "attention": ("ddtree_jax.bench.attention", "the tree-attention kernel, the jnp path, JAX's decode"),
    "mla-attention": ("ddtree_jax.bench.mla_attention", "the MLA latent-cache kernel against its reference"),
    "mosaic-attention": ("ddtree_jax.bench.mosaic_attention", "the Mosaic GPU kernels against Triton, cuDNN"),
    "prefix-attention": ("ddtree_jax.bench.prefix_attention", "one kernel against the cuDNN prefix merged"),
    "quant": ("ddtree_jax.bench.quant", "INT4 and FP8 matmuls against bf16, XLA and Pallas"),
    "moe": ("ddtree_jax.bench.moe", "the MoE expert dispatches against the floor of the experts chosen"),
    "moe-fused": ("ddtree_jax.bench.moe_fused", "the fused expert kernel: checks, dispatches, MoE rounds"),
    "topk": ("ddtree_jax.bench.topk", "jax.lax.top_k against the tiled top-k"),
    "tree": ("ddtree_jax.bench.tree", "the tree build alone, per batch size, budget and variant"),
    "torch-step": (
        "ddtree_jax.bench.torch_step",
        "a PyTorch decode step replayed from CUDA graphs (a baseline)",
    ),
    "plot": ("ddtree_jax.bench.plot", "plots of rounds sweeps and the default budget per batch size"),
}
DEFAULT = "rounds"  # `ddtree-bench --shape ...` (flags first, no sub-command): the rounds benchmark


def usage() -> str:
    """The top-level help: the sub-commands, one line each."""
    lines = [
        "usage: ddtree-bench SUB-COMMAND [FLAGS]   (ddtree-bench SUB-COMMAND --help lists its flags)",
        "",
        "Benchmarks on random-weight models of real shapes; each writes one JSON (--out) that starts",
        "with the run header (meta: date, machine, the provenance: code version and commit, jax,",
        "jaxlib, device; the command), and every one but plot takes --deadline-s.",
        "",
        "sub-commands:",
        *(f"  {name:<17} {what}" for name, (_, what) in SUBCOMMANDS.items()),
        "",
        f"Flags without a sub-command run `{DEFAULT}`: `ddtree-bench --shape tiny ...` is",
        f"`ddtree-bench {DEFAULT} --shape tiny ...`.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: dispatch to the sub-command's `main`; its exit status (EXIT_ERROR: an unknown one)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    importlib.import_module("ddtree_jax.xla_flags").apply()  # before any backend starts
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_ERROR
    name, rest = (argv[0], argv[1:]) if not argv[0].startswith("-") else (DEFAULT, argv)
    if name not in SUBCOMMANDS:
        print(
            f"ddtree-bench: error: unknown sub-command {name!r} (one of {', '.join(SUBCOMMANDS)})",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return importlib.import_module(SUBCOMMANDS[name][0]).main(rest)
