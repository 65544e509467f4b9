#!/usr/bin/env bash
# Issue 20 on one H200 (~6 min, most of it compilation), results under $OUT:
#   cudnn-check.json  attention.causal_chunk through cuDNN against the jnp reference (bf16, Qwen3-8B
#                     heads, a 512-token chunk after 1500 cached tokens): max abs error; seconds
#   mixed-8b.json     continuous against static batching on a mixed workload (64 prompts of 64 to 1024
#                     tokens, 64 new tokens, batch 16, ddtree budget 7, up to 8 stop ids calibrated to
#                     stop 30% of rows), prefill chunks through cuDNN ("auto"), then the batch-invariant
#                     schedule's tokens/s against the default's (rewritten after each phase)
#   prefill-{cudnn,pallas}.json  chunked prefill of a 1k and a 32k prompt (Qwen3-8B shape, random bf16
#                     weights), chunks of 1k: cuDNN first, then the Pallas tree kernel (one process each,
#                     so each peak memory is its own): seconds, peak memory, x the FLOP floor at 790 TFLOP/s
# Run from the repository root:  OUT=$OUT bash results/h200/scheduling-2/run.sh   (PY=echo: print only)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/scheduling} PY=${PY:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
# One check, no loop and so no --deadline-s: `timeout` guards a hang in the cuDNN call.
timeout 45 $PY - "$OUT/cudnn-check.json" > "$OUT/cudnn-check.log" 2>&1 <<'PY'
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from ddtree_jax.attention import causal_chunk
from ddtree_jax.kernels.tree_attention import tree_attention_reference
rng = np.random.default_rng(0)
b, t, hq, hkv, d, s, n = 2, 512, 32, 8, 128, 2048, 1500
x = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
q, kn, vn, kc, vc = x(b, t, hq, d), x(b, t, hkv, d), x(b, t, hkv, d), x(b, hkv, s, d), x(b, hkv, s, d)
lengths = jnp.asarray([0, n], jnp.int32)
mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
fn = jax.jit(lambda *a: causal_chunk(*a, implementation="cudnn"))
got = jax.block_until_ready(fn(q, kc, vc, lengths, kn, vn, mask))
start = time.perf_counter(); jax.block_until_ready(fn(q, kc, vc, lengths, kn, vn, mask)); sec = time.perf_counter() - start
ref = tree_attention_reference(q, kc, vc, lengths, kn, vn, mask)
err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
out = {"max_abs_error": err, "bf16_ok": err < 0.05, "seconds": round(sec, 5), "shape": [b, t, hq, hkv, d, s, n],
       "device": jax.devices()[0].device_kind}
print(json.dumps(out)); open(sys.argv[1], "w").write(json.dumps(out) + "\n")
PY
$PY -m ddtree_jax.bench scheduling --shape qwen3-8b --dtype bfloat16 --attention pallas --prompts 64 --min-len 64 \
  --max-len 1024 --max-new-tokens 64 --batch-size 16 --budget 7 --prefill-chunk 512 --stop-tokens 8 \
  --batch-invariant --deadline-s 150 --out "$OUT/mixed-8b.json" > "$OUT/mixed.log" 2>&1
$PY -m ddtree_jax.bench prefill --runs 1024:1024,32768:1024 --attention pallas --prefill-attention causal-cudnn \
  --deadline-s 50 --out "$OUT/prefill-cudnn.json" > "$OUT/prefill-cudnn.log" 2>&1
$PY -m ddtree_jax.bench prefill --runs 1024:1024,32768:1024 --attention pallas --deadline-s 50 \
  --out "$OUT/prefill-pallas.json" > "$OUT/prefill-pallas.log" 2>&1
