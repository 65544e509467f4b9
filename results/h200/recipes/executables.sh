#!/usr/bin/env bash
# Issue 42 item 2 on one H200: the bundled main job's compile seconds, first and second run, with whole
# executables kept (ddtree_jax/executables.py through a driver that routes programs.Programs._call to
# executables.load_or_compile, the wiring proposed for programs.py) beside JAX's cache alone; and whether
# a loaded executable gives the same outputs on the GPU. About 2-3 minutes (each run under `timeout`).
# Run from the repository root:
#   bash results/h200/recipes/executables.sh          # $OUT set by the device call; else /tmp/executables
# ($EXTRA: more flags for every run, e.g. EXTRA="--max-new-tokens 16" for a smoke run on a CPU.)
# Steps (each `python3 -m ddtree_jax.cli --out ... --overwrite --compile-cache DIR`, the default main job):
#   1. plain-first, plain-second   JAX's cache alone, on an empty $OUT/cc-plain, twice
#   2. exe-first, exe-second       the driver, on an empty $OUT/cc-exe, twice
#   3. $OUT/summary.json: each run's summary compile seconds and per-program line, and whether the four
#      runs' output_ids are equal
# Compare with the issue: 15.4 s first, 2.5 s second (16%) with JAX's cache (H200, 2026-12-04). The goal:
# second run <= 10% of the first, outputs equal. On CPU (docs/job-cost.md, 2026-12-07): 30.1 s -> 6.3 s
# with JAX's cache alone, 32.4 s -> 1.3 s with the executables.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/executables}
mkdir -p "$OUT"
rm -rf "$OUT/cc-plain" "$OUT/cc-exe"
cat >"$OUT/driver.py" <<'PY'
"""ddtree_jax.cli.main with programs.Programs._call going through executables.load_or_compile."""
import sys
import time

import jax

from ddtree_jax import executables, programs

_EXECUTABLES: dict = {}


def _call(self, name, *args, **static):
    static |= {"plan": self.plan}
    args = (self.params, self.draft_params, *args)
    leaves, tree = jax.tree.flatten(args[2:])
    key = (name, tree, *((x.shape, x.dtype) for x in leaves), *static.items(), self.params["embed"].dtype)
    if key not in _EXECUTABLES:
        begin = time.perf_counter()
        loaded = executables.load_or_compile(
            name, (static, executables.signature(args)), lambda: programs.JITTED[name].lower(*args, **static)
        )
        _EXECUTABLES[key] = loaded.compiled
        self.count_compile(name, time.perf_counter() - begin)
        print(f"program {name}: {'hit' if loaded.hit else 'miss'} {loaded.seconds:.2f} s", file=sys.stderr)
    return _EXECUTABLES[key](*args)


programs.Programs._call = _call
from ddtree_jax.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
PY
for run in plain-first plain-second exe-first exe-second; do
  case $run in
    plain-*) cmd=(-m ddtree_jax.cli); cache=$OUT/cc-plain ;;
    exe-*) cmd=("$OUT/driver.py"); cache=$OUT/cc-exe ;;
  esac
  echo "== $run"
  # shellcheck disable=SC2086
  timeout 150 python3 "${cmd[@]}" --out "$OUT/$run.jsonl" --overwrite --compile-cache "$cache" ${EXTRA:-} \
    >"$OUT/$run.log" 2>"$OUT/$run.err"
  echo "rc $?"; grep -E "compile:|programs compiled" "$OUT/$run.log"; grep -E "^program |error" "$OUT/$run.err"
done
python3 - "$OUT" <<'PY'
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {}
for run in ("plain-first", "plain-second", "exe-first", "exe-second"):
    log = (out / f"{run}.log").read_text() if (out / f"{run}.log").exists() else ""
    compile_s = re.search(r"compile: ([\d.]+) s", log)
    programs = re.search(r"programs compiled: .*", log)
    lines = (out / f"{run}.jsonl").read_text().splitlines() if (out / f"{run}.jsonl").exists() else []
    runs[run] = {
        "compile_s": float(compile_s.group(1)) if compile_s else None,
        "programs": programs.group(0) if programs else None,
        "output_ids": [json.loads(line)["output_ids"] for line in lines],
    }
first = runs["plain-first"]["output_ids"]
summary = {
    "runs": {k: {kk: vv for kk, vv in v.items() if kk != "output_ids"} for k, v in runs.items()},
    "outputs_equal": bool(first) and all(v["output_ids"] == first for v in runs.values()),
}
for kind in ("plain", "exe"):
    a, b = runs[f"{kind}-first"]["compile_s"], runs[f"{kind}-second"]["compile_s"]
    summary[f"{kind}_second_over_first"] = round(b / a, 3) if a and b is not None else None
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
PY
