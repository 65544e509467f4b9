#!/usr/bin/env bash
# The kernels after issue 29 item 2 (branch `kernels`: the Mosaic kernels' tuning moved into
# kernels/tuning.py, fused_experts fed plain arrays by quant.arrays.expert_weight) on one H200: do they
# compile, match their references and run at the recorded speed? One call, about 6 minutes at most
# (each step bounded by its own --deadline-s, a hang by the Mosaic benchmark's --hang-s watchdog and the
# MoE benchmark's per-phase --grace-s kill; both write their JSON as they go). Run from the repository root:
#   bash results/h200/recipes/kernels_check.sh          # $OUT set by the device call; else /tmp/kernels-check
# Steps:
#   1. mosaic  `ddtree-bench mosaic-attention`, phases checks, gqa, mla (Triton and Mosaic only: the
#              cuDNN-merged and bundled-decode columns are left out), --deadline-s 180, --hang-s 45
#   2. moe     `ddtree-bench moe-fused`, phases check, qwen3-dispatch, --deadline-s 120, --grace-s 15
#   3. compare the new Mosaic rows against the recorded table (printed; $OUT/compare.txt)
# Compare with (results/h200/2026-12-02/, jax 0.11.2; README.md there names the commands and commits):
#   mosaic-checks/mosaic_checks.json (08:14): every form within max_abs 7.81e-03 (GQA) / 3.91e-03 (MLA)
#     of the jnp reference, as Triton.
#   mosaic-table/mosaic_attention.json (05:19), us per call, Triton / Mosaic (Mosaic / Triton):
#     gqa B=16 T=64 S=32k 1491.0 / 1194.1 (0.80)   gqa B=16 T=64 S=8k 401.8 / 310.5 (0.77)
#     gqa B=16 T=16 S=32k  632.6 /  556.0 (0.88)   gqa B=16 T=16 S=8k 208.0 / 175.5 (0.84)
#     gqa B=1  T=1  S=8k    45.9 /   55.5 (1.21)   gqa B=1  T=1 S=32k  71.0 /  87.4 (1.23)
#     mla B=1 T=64 S=32k H=64 1191.4 / 583.5 (0.49)   mla B=1 T=1 S=32k H=64 78.4 / 68.7 (0.88)
#     mla B=1 T=1  S=32k H=8    61.6 /  66.5 (1.08)   mla B=1 T=64 S=32k H=8 208.4 / 128.3 (0.62)
#   moe-fused/check.json (08:15): fused_rel_err 2.9e-03 to 3.2e-03, every case ok;
#   moe-fused/moe_fused.log, qwen3-dispatch, fused ms a layer: 0.292 (1 token), 0.273 (2), 0.358 (4),
#     0.347 (8), 0.434 (16), 0.460 (32), 0.539 (64), 0.622 (128).
# The same speed: Mosaic / Triton ratios within ~5% of those (the ratio cancels the device's day), and
# every check ok. Step 3 prints the ratios side by side.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/kernels-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1

python3 -m ddtree_jax.bench mosaic-attention --phases checks,gqa,mla --skip cudnn-merged,bundled-decode \
  --deadline-s 180 --hang-s 45 --out "$OUT/mosaic_attention.json" > "$OUT/mosaic.log" 2>&1
echo "mosaic: rc $?" | tee -a "$OUT/steps.log"
python3 -m ddtree_jax.bench moe-fused --phases check,qwen3-dispatch --deadline-s 120 --grace-s 15 \
  --out-dir "$OUT/moe-fused" > "$OUT/moe.log" 2>&1
echo "moe: rc $?" | tee -a "$OUT/steps.log"
python3 - "$OUT/mosaic_attention.json" results/h200/2026-12-02/mosaic-table/mosaic_attention.json \
  <<'EOF' | tee "$OUT/compare.txt"
import json, sys

def rows(path):
    try:
        with open(path) as f:
            found = json.load(f)["rows"]
    except (OSError, ValueError, KeyError) as e:
        print(f"{path}: {e}")
        return {}
    return {(r["kind"], r["B"], r["T"], r["S"], r.get("H")): r.get("kernels", {}) for r in found}

def us(kernels, name):
    k = kernels.get(name, {})
    return k["s"] * 1e6 if "s" in k else None

new, old = rows(sys.argv[1]), rows(sys.argv[2])
print("row | Triton us new / recorded | Mosaic us new / recorded | Mosaic/Triton new / recorded")
for key, kernels in new.items():
    t, m = us(kernels, "triton"), us(kernels, "mosaic")
    t0, m0 = us(old.get(key, {}), "triton"), us(old.get(key, {}), "mosaic")
    r = m / t if m is not None and t else None
    r0 = m0 / t0 if m0 is not None and t0 else None
    cells = [f"{a:.{p}f} / {b:.{p}f}" if a is not None and b is not None else f"{a} / {b}"
             for a, b, p in ((t, t0, 1), (m, m0, 1), (r, r0, 2))]
    print(" ".join(str(x) for x in key if x is not None), "|", " | ".join(cells))
EOF
date -u
