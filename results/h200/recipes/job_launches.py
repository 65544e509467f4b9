"""Issue 50: why the device job's rounds keep the GPU busy ~37% of the time where the bench's loop of
rounds keeps it ~100%. One device call: the README's main job (ar, batch 16, the held-out prompts) at
strides 1, 8 and 32 (second runs timed), one traced run (host API calls by name, kernels), the bench's
round loop at the job's shape, the same job under the 'graphs' XLA preset; XLA's optimized HLO of every
program, read by hlo_graphs.py (graph launches against host-launched kernels per loop body).

    OUT=$OUT PYTHONPATH=$PWD python3 results/h200/recipes/job_launches.py
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/job-launches"))
OUT.mkdir(parents=True, exist_ok=True)
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PROMPTS = ROOT / "results" / "heldout-prompts-96.jsonl"
DUMP = "/tmp/xla-dump-job"
os.environ["XLA_FLAGS"] = f"--xla_dump_to={DUMP} --xla_dump_hlo_as_text"
os.environ["DDTREE_EXECUTABLES"] = "off"

import jax  # noqa: E402

from ddtree_jax.api import LLM  # noqa: E402
from ddtree_jax.bench.profile import busy_ns, device_events, read_trace  # noqa: E402

report: dict = {"device": jax.devices()[0].device_kind}


def save():
    (OUT / "job_launches.json").write_text(json.dumps(report, indent=1))


def graphs(dump: str, pattern: str) -> dict:
    text = subprocess.run(
        [sys.executable, str(HERE / "hlo_graphs.py"), dump, pattern], capture_output=True, text=True
    ).stdout
    return json.loads(text or "{}")


QUICK = os.environ.get("QUICK")  # a CPU check of this script: 8 prompts x 8 tokens, reference attention
new, attention = (8, "reference") if QUICK else (128, "pallas")
llm = LLM(method="ar", batch_size=16, max_new_tokens=new, attention=attention)
prompts = llm.prompts([json.loads(x)["prompt"] for x in PROMPTS.open()][: 8 if QUICK else None])
base = llm.generator
for stride in (8, 1, 32):
    gen = base.scheduled(stride=stride)
    llm.generator = gen
    list(llm.run(prompts))  # compiles
    runs = []
    for _ in range(2):
        gen.generate_seconds = 0.0
        rounds = gen.occupancy.rounds  # (a generator's occupancy sums over its runs)
        results = list(llm.run(prompts))
        runs.append((gen.generate_seconds, gen.occupancy.rounds - rounds))
    tokens = sum(len(r.output_ids) for r in results)
    report[f"stride{stride}"] = {
        "generate_s": [round(s, 4) for s, _ in runs],
        "rounds": runs[-1][1],
        "tok_s": round(tokens / min(s for s, _ in runs)),
        "ms_per_round": round(1e3 * min(s for s, _ in runs) / runs[-1][1], 4),
    }
    print(json.dumps({f"stride{stride}": report[f"stride{stride}"]}), flush=True)
    save()

# one traced run at stride 8: host API calls by name, kernels
gen = base.scheduled(stride=8)
llm.generator = gen
list(llm.run(prompts))
logdir = tempfile.mkdtemp()
options = jax.profiler.ProfileOptions()
options.python_tracer_level = 0
with jax.profiler.trace(logdir, profiler_options=options):
    start = time.perf_counter()
    list(llm.run(prompts))
    wall = time.perf_counter() - start
data = read_trace(logdir)
plane, events = device_events(data)
host = Counter()
host_ns = Counter()
for p in data.planes:
    if p.name.startswith("/host"):
        for line in p.lines:
            for e in line.events:
                host[e.name[:60]] += 1
                host_ns[e.name[:60]] += e.duration_ns
report["traced"] = {
    "wall_s": round(wall, 4),
    "device_busy_s": round(busy_ns(events) / 1e9, 4),
    "kernels": len(events),
    "host_events": {k: [n, round(host_ns[k] / 1e6, 2)] for k, n in host.most_common(40)},
}
print(json.dumps({"traced": report["traced"]}), flush=True)
save()

# the job's optimized HLO (this process's dump)
report["hlo_job"] = graphs(DUMP, "job")
save()

# the bench's loop of rounds at the job's shape, its HLO dumped apart
env = dict(os.environ, XLA_FLAGS="--xla_dump_to=/tmp/xla-dump-bench --xla_dump_hlo_as_text")
bench = subprocess.run(
    [
        sys.executable,
        "-m",
        "ddtree_jax.bench",
        "rounds",
        "--shape",
        "default-pair",
        "--draft-layers",
        "2",
        "--methods",
        "ar",
        "--batch-sizes",
        "16",
        "--contexts",
        "256",
        "--attention",
        "pallas",
        "--rounds",
        "64",
        "--out",
        str(OUT / "bench_rounds.json"),
    ],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
)
report["bench_tail"] = bench.stdout[-1500:] + bench.stderr[-1500:]
report["hlo_bench"] = graphs("/tmp/xla-dump-bench", "round")
save()

# the same job under the 'graphs' preset (loops and conditionals inside command buffers)
env = dict(
    os.environ,
    DDTREE_XLA_PRESET="graphs",
    XLA_FLAGS="--xla_dump_to=/tmp/xla-dump-graphs --xla_dump_hlo_as_text",
)
lines = []
for run in (1, 2):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddtree_jax.cli",
            "--prompts",
            str(PROMPTS),
            "--max-new-tokens",
            "128",
            "--batch-size",
            "16",
            "--method",
            "ar",
            "--compile-cache",
            "/tmp/cc-graphs",
            "--out",
            f"/tmp/graphs-{run}.jsonl",
            "--overwrite",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    lines.append(p.stdout[-600:] + p.stderr[-400:])
report["graphs_preset"] = lines
report["hlo_graphs_preset"] = graphs("/tmp/xla-dump-graphs", "job")
save()
print(json.dumps({k: report[k] for k in ("bench_tail", "graphs_preset")}, indent=1))
