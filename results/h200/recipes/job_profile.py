"""Where the main job's generation goes on the device: the README's main job (the bundled pair, the held-out
prompts) run once warm, then once under jax.profiler.trace; prints the wall, the device's busy time (the
union of kernel intervals), the kernel count and the top kernels, per method. Recipe (one device call):
    OUT=$OUT python3 results/h200/recipes/job_profile.py ar,ddtree 16 [host-loop]
"""

import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import jax

from ddtree_jax.api import LLM
from ddtree_jax.bench.profile import busy_ns, device_events, read_trace

methods = sys.argv[1].split(",") if len(sys.argv) > 1 else ["ar"]
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 16
host_loop = "host-loop" in sys.argv[3:]
prompts_file = Path(__file__).resolve().parents[3] / "results" / "heldout-prompts-96.jsonl"
rows = {}
for method in methods:
    llm = LLM(method=method, batch_size=batch, max_new_tokens=128, attention="pallas")
    if host_loop:
        llm.generator = llm.generator.scheduled(device_loop=False)
    prompts = llm.prompts([json.loads(x)["prompt"] for x in prompts_file.open()])
    list(llm.run(prompts))  # compiles
    gen = llm.generator
    gen.generate_seconds = 0.0
    logdir = tempfile.mkdtemp()
    with jax.profiler.trace(logdir):
        start = time.perf_counter()
        results = list(llm.run(prompts))
        wall = time.perf_counter() - start
    plane, events = device_events(read_trace(logdir))
    names = Counter()
    for e in events:
        names[e.name.split(".")[0][:60]] += e.self_ns
    occ = gen.occupancy
    rows[method] = {
        "wall_s": round(wall, 4), "generate_s": round(gen.generate_seconds, 4),
        "device_busy_s": round(busy_ns(events) / 1e9, 4), "kernels": len(events), "plane": plane,
        "rounds": occ.rounds, "host_returns": occ.host_returns, "passes": occ.refills,
        "tokens": sum(len(r.output_ids) for r in results), "loop": gen.loop,
        "top_ms": {k: round(v / 1e6, 2) for k, v in names.most_common(25)},
    }
    print(json.dumps({method: rows[method]}, indent=1), flush=True)
name = f"job_profile_b{batch}{'_host' if host_loop else ''}.json"
Path(os.environ.get("OUT", "/tmp"), name).write_text(json.dumps(rows, indent=1))
