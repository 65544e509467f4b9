"""What of a compiled GPU program runs inside XLA's command buffers (CUDA graphs) and what the host
launches itself: reads the optimized HLO that `--xla_dump_to=DIR --xla_dump_hlo_as_text` wrote and, from
ENTRY down through every while loop and conditional, lists each computation's top-level operations (a
call of a `command_buffer` computation is one graph launch; a fusion, custom call or copy outside one is
a kernel the host launches each time it runs).

    python3 results/h200/recipes/hlo_graphs.py DUMP_DIR [module-name-regex]   # prints JSON
"""

from __future__ import annotations

import glob
import json
import re
import sys
from collections import Counter
from pathlib import Path

TRIVIAL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "opt-barrier"}
HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{$")
NAME = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
CALLEES = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
TARGET = re.compile(r'custom_call_target="([^"]+)"')


def _opcode(rest: str) -> str:
    """The opcode of an instruction's text after ' = ' (its type may be a nested tuple)."""
    i, depth = 0, 0
    if rest.startswith("("):
        for i, ch in enumerate(rest):  # noqa: B007 (i is read after the loop)
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        rest = rest[i + 1 :]
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    m = re.match(r"\s*([a-z][a-z0-9\-]*)\(", rest)
    return m.group(1) if m else "?"


def computations(text: str) -> tuple[dict[str, list[dict]], str]:
    """{computation: [instruction: name, opcode, callees, target]}, and the ENTRY's name."""
    comps: dict[str, list[dict]] = {}
    entry, current = "", None
    for line in text.splitlines():
        h = HEADER.match(line)
        if h and not line.startswith(" "):
            current = h.group(2)
            comps[current] = []
            entry = current if h.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        n = NAME.match(line)
        if current is None or not n:
            continue
        rest = line[n.end() :]
        callees = [c for _, c in CALLEES.findall(line)]
        for group in BRANCHES.findall(line):
            callees += [c.strip().lstrip("%") for c in group.split(",")]
        t = TARGET.search(line)
        comps[current].append(
            {"name": n.group(1), "op": _opcode(rest), "callees": callees, "target": t.group(1) if t else ""}
        )
    return comps, entry


def _kernels_inside(comps, name: str, seen=None) -> int:
    """Non-trivial operations inside a command buffer computation (nested loops counted through)."""
    seen = seen if seen is not None else set()
    total = 0
    for ins in comps.get(name, []):
        if ins["op"] in TRIVIAL:
            continue
        if ins["op"] in ("while", "conditional", "call") and ins["callees"]:
            for c in ins["callees"]:
                if c not in seen:
                    seen.add(c)
                    total += _kernels_inside(comps, c, seen)
        else:
            total += 1
    return total


def walk(comps, entry: str) -> dict:
    """Per computation reached from ENTRY outside command buffers: its top-level operations."""
    out, todo, seen = {}, [(entry, "entry")], set()
    while todo:
        name, role = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        counts, sequence = Counter(), []
        for ins in comps.get(name, []):
            op = ins["op"]
            if op in TRIVIAL:
                continue
            if op == "call" and ins["callees"] and "command_buffer" in ins["callees"][0]:
                n = _kernels_inside(comps, ins["callees"][0])
                counts["graph launches"] += 1
                counts["ops inside graphs"] += n
                sequence.append(f"G{n}")
                continue
            if op in ("while", "conditional", "call"):  # (a fusion's callee is its kernel's body)
                todo += [(c, f"{op} {ins['name']}") for c in ins["callees"]]
            label = f"{op}:{ins['target']}" if ins["target"] else op
            counts[label] += 1
            sequence.append(label if op != "fusion" else "f")
        seq = " ".join(sequence)[:1500]
        out[name] = {"role": role, "counts": dict(counts.most_common()), "sequence": seq}
    return out


def main() -> None:
    dump, pattern = sys.argv[1], re.compile(sys.argv[2] if len(sys.argv) > 2 else ".")
    report = {}
    for path in sorted(glob.glob(f"{dump}/*after_optimizations.txt")):
        module = Path(path).name
        if not pattern.search(module):
            continue
        comps, entry = computations(Path(path).read_text())
        report[module] = walk(comps, entry)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
