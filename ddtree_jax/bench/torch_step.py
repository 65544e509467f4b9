"""A PyTorch decode step of a small Qwen3-shaped target, replayed from CUDA graphs: the baseline
ddtree-bench's tiny rows are read against (issue 32, item 3). Needs torch (the `compare` extra).

Written here in plain torch (no HF, no engine): embedding, per layer RMSNorm, q/k/v projections, Qwen3's
per-head q/k norm, RoPE, the new K/V written into a static cache [B, Hkv, S, D] at the current position,
attention over the cache up to that position (GQA, masked over the static length), o_proj, the SiLU MLP;
final norm, lm_head, greedy argmax fed back as the next step's token. Random weights, the cache filled
with random K/V up to --context (as ddtree-bench fills its own). T new tokens per step (T = 1: decode;
T > 1: a causal block of T, a chain verify's shape).

Per (shape, batch size, T) it times, with CUDA events after warm-up:
  eager        the step called from Python (one kernel launch per op)
  graph_1      the step captured in a CUDA graph, replayed once per step
  graph_STEPS  STEPS steps captured in one graph (the closest to one XLA program with a loop inside)
and writes one JSON (run header and rows; ms per step). On a machine without CUDA only `eager` runs
(float32 on the CPU): a smoke test of the same code. It measures no code of this package.

    ddtree-bench torch-step --shapes tiny,default-pair --batch-sizes 1,16 --out $OUT/torch_graph.json

(Formerly scripts/torch_graph_step.py, `--repeats` now `--reps`.)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

from ddtree_jax.bench import report
from ddtree_jax.bench.shapes import SHAPES
from ddtree_jax.errors import DDTreeError

torch = F = None  # torch and torch.nn.functional, imported by `run` (the `compare` extra)


def import_torch() -> None:
    """Import torch into this module's `torch` and `F`, or a one-line error saying how to install it."""
    global torch, F
    try:
        import torch as torch_module
        import torch.nn.functional as functional
    except ImportError:
        raise DDTreeError("needs torch: pip install 'ddtree-jax[compare]'") from None
    torch, F = torch_module, functional


class Step:
    """One decode step of a Qwen3-shaped model on static buffers: `tokens` [B, T] in, the argmax of
    the last position written back into `tokens[:, 0]` and `pos` advanced by T."""

    def __init__(self, cfg, batch: int, tokens: int, context: int, steps: int, device, dtype):
        d = cfg.dims
        self.cfg, self.d, self.batch, self.t = cfg, d, batch, tokens
        g = torch.Generator(device="cpu").manual_seed(0)

        def w(*shape, scale=0.02):
            return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

        h, hq, hkv, hd = d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim
        self.embed = w(cfg.vocab_size, h)
        self.lm_head = self.embed if cfg.tie_word_embeddings else w(cfg.vocab_size, h)
        self.layers = [
            dict(
                ln1=1 + w(h, scale=0.1),
                ln2=1 + w(h, scale=0.1),
                q=w(hq * hd, h),
                k=w(hkv * hd, h),
                v=w(hkv * hd, h),
                o=w(h, hq * hd),
                qn=1 + w(hd, scale=0.1),
                kn=1 + w(hd, scale=0.1),
                gate=w(d.intermediate_size, h),
                up=w(d.intermediate_size, h),
                down=w(h, d.intermediate_size),
            )
            for _ in range(cfg.num_layers)
        ]
        self.norm = 1 + w(h, scale=0.1)
        self.capacity = -(-(context + tokens * (steps + 2)) // 128) * 128
        shape = (batch, hkv, self.capacity, hd)
        self.k_cache = [w(*shape, scale=1.0) for _ in range(cfg.num_layers)]
        self.v_cache = [w(*shape, scale=1.0) for _ in range(cfg.num_layers)]
        self.context = context
        self.pos = torch.tensor([context], device=device)  # where the step's first token goes
        self.tokens = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=g).to(device)
        inv = 1.0 / (cfg.rope.theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        angles = torch.arange(self.capacity, dtype=torch.float32)[:, None] * inv[None, :]
        self.cos, self.sin = angles.cos().to(device), angles.sin().to(device)
        self.slots = torch.arange(self.capacity, device=device)
        self.offsets = torch.arange(tokens, device=device)

    def reset(self) -> None:
        """Back to the first step's position (the cache beyond it is rewritten as the steps go)."""
        self.pos.fill_(self.context)

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.d.rms_norm_eps)).to(
            x.dtype
        ) * weight

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] rotated at `positions` [T] (HF's rotate_half convention)."""
        cos = torch.cat([self.cos[positions]] * 2, -1)[None, None]
        sin = torch.cat([self.sin[positions]] * 2, -1)[None, None]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    def __call__(self) -> None:
        d, b, t = self.d, self.batch, self.t
        positions = self.pos + self.offsets  # [T]
        # a slot is visible to new token i when it holds a position <= the token's own
        visible = self.slots[None, :] <= positions[:, None]  # [T, S]
        x = self.embed[self.tokens]  # [B, T, H]
        for layer, k_cache, v_cache in zip(self.layers, self.k_cache, self.v_cache, strict=True):
            y = self.rms(x, layer["ln1"])
            q = (y @ layer["q"].T).view(b, t, d.num_heads, d.head_dim).transpose(1, 2)
            k = (y @ layer["k"].T).view(b, t, d.num_kv_heads, d.head_dim).transpose(1, 2)
            v = (y @ layer["v"].T).view(b, t, d.num_kv_heads, d.head_dim).transpose(1, 2)
            if d.qk_norm:
                q, k = self.rms(q, layer["qn"]), self.rms(k, layer["kn"])
            q, k = self.rope(q, positions), self.rope(k, positions)
            k_cache.index_copy_(2, positions, k)
            v_cache.index_copy_(2, positions, v)
            a = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=visible, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(b, t, -1) @ layer["o"].T
            y = self.rms(x, layer["ln2"])
            x = x + (F.silu(y @ layer["gate"].T) * (y @ layer["up"].T)) @ layer["down"].T
        logits = self.rms(x[:, -1], self.norm) @ self.lm_head.T  # [B, V]
        self.tokens[:, 0] = logits.argmax(-1)
        self.pos += t


def time_ms(run, reps: int, cuda: bool) -> float:
    """Median ms of `run()` over `reps` timings (CUDA events on the GPU)."""
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def bench(step: Step, steps: int, reps: int, cuda: bool) -> dict[str, float]:
    """ms per step: eager, and on CUDA replayed from a one-step graph and from a `steps`-step graph."""

    def eager():
        step.reset()
        for _ in range(steps):
            step()

    eager()  # warm-up (and cuBLAS / SDPA kernel choice)
    out = {"eager": time_ms(eager, reps, cuda) / steps}
    if not cuda:
        return out
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream before capture (PyTorch's recipe)
        for _ in range(3):
            eager()
    torch.cuda.current_stream().wait_stream(stream)
    graph_1, graph_n = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    step.reset()
    with torch.cuda.graph(graph_1):
        step()
    step.reset()
    with torch.cuda.graph(graph_n):
        for _ in range(steps):
            step()

    def one_step_graphs():
        step.reset()
        for _ in range(steps):
            graph_1.replay()

    def one_graph():
        step.reset()
        graph_n.replay()

    first = step.tokens.clone()  # the graphs replay the eager steps: the same tokens come out
    for run in (eager, one_graph):
        step.tokens.copy_(first)
        run()
        out.setdefault("_last_tokens", []).append(step.tokens[:, 0].tolist())
    same = out.pop("_last_tokens")
    out["graph_matches_eager"] = same[0] == same[1]
    one_step_graphs()
    out["graph_1"] = time_ms(one_step_graphs, reps, cuda) / steps
    one_graph()
    out[f"graph_{steps}"] = time_ms(one_graph, reps, cuda) / steps
    return out


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench torch-step`; the exit status."""
    p = report.parser("torch-step", __doc__)
    p.add_argument("--shapes", default="tiny,default-pair", help=f"comma list of {', '.join(sorted(SHAPES))}")
    p.add_argument("--batch-sizes", default="1,16", help="comma list of rows per step")
    p.add_argument("--tokens", default="1", help="comma list of new tokens per step (1: decode)")
    p.add_argument("--context", type=int, default=1024, help="cached tokens before the first step")
    p.add_argument("--steps", type=int, default=16, help="steps per timing (and in the multi-step graph)")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions")
    report.add_deprecated(p, "--repeats", "--reps", type=int)
    report.add_deadline(p)
    p.add_argument("--out", required=True, help="JSON output path")
    return report.run_subcommand("torch-step", p, argv, run)


def run(args: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """Time every (shape, batch size, T) while `deadline` allows; the JSON after each row."""
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        raise DDTreeError(f"--shapes: unknown {unknown} (one of {', '.join(sorted(SHAPES))})")
    import_torch()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    kind = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    meta = report.run_header(command, device=(kind, torch.cuda.device_count() if cuda else 1))
    meta |= {"torch": torch.__version__, "dtype": str(dtype), "context": args.context, "steps": args.steps}
    rows = []
    for name in args.shapes.split(","):
        cfg = SHAPES[name]
        for batch in map(int, args.batch_sizes.split(",")):
            for tokens in map(int, args.tokens.split(",")):
                if not deadline.allows(f"{name} batch {batch} tokens {tokens}"):
                    continue
                step = Step(cfg, batch, tokens, args.context, args.steps, device, dtype)
                ms = bench(step, args.steps, args.reps, cuda)
                params = sum(math.prod(w.shape) for layer in step.layers for w in layer.values())
                row = {"shape": name, "batch_size": batch, "tokens": tokens, "layer_params": params, "ms": ms}
                rows.append(row)
                print(json.dumps(row), flush=True)
                report.write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})
                del step
                if cuda:
                    torch.cuda.empty_cache()
    report.write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})
    return 0
