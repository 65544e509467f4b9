"""Generate with the Python API (README, "Python API"): load a pair once, generate, stream.

    PYTHONPATH=. python examples/generate.py                      # the bundled pair, two text prompts
    PYTHONPATH=. python examples/generate.py --target DIR --draft DIR --dtype float32 \
        --input-ids 42,133,123 --input-ids 181 --temperature 0.8 --seed 3 --n 2

Prints one JSON line per result (the fields of ddtree-generate's output lines), in input order, then
the same prompts again through `stream` (each result as its row finishes), which compiles nothing new.
"""

from __future__ import annotations

import argparse
import json
import sys

from ddtree_jax import LLM, SamplingParams

TEXTS = ["def fibonacci(n):", [{"role": "user", "content": "Write a Python function that reverses a list."}]]


def main(argv: list[str] | None = None) -> tuple[LLM, list]:
    """Run the example; returns the LLM and the results of `generate`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="HF target directory (default: the bundled pair)")
    p.add_argument("--draft", help="DFlash drafter directory (default with --target: ar)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (chat template applied)")
    p.add_argument("--input-ids", action="append", default=[], help="a prompt as comma-separated ids")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=1)
    args = p.parse_args(argv)

    llm = LLM(args.target, args.draft, dtype=args.dtype, max_new_tokens=args.max_new_tokens)
    prompts = args.prompt + [[int(i) for i in ids.split(",")] for ids in args.input_ids] or TEXTS
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed, n=args.n)

    results = llm.results(prompts, sampling)  # every prompt's n samples, in input order (each a line)
    for r in results:
        print(json.dumps(r.to_json()))
    compiled = len(llm.compile_log)
    for r in llm.stream(prompts, sampling):  # as rows finish; the programs are compiled already
        print(f"streamed prompt {r.id} sample {r.index}: {r.finish_reason} after {r.e2e_latency:.3f} s",
              file=sys.stderr)  # fmt: skip
    print(f"second call compiled {len(llm.compile_log) - compiled} programs", file=sys.stderr)
    return llm, results


if __name__ == "__main__":
    main()
