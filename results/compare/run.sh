#!/usr/bin/env bash
# The reports in results/compare/, on a CPU, from the repository root with the package installed
# (pip install -e ".[compare]"). Each line is the exact command behind one report directory.
set -euo pipefail
C=ddtree-compare
F=tests/fixtures
$C lossless --budgets 15,32 --dtype float32 --report results/compare/lossless-default-pair
$C lossless --budgets 15,32 --report results/compare/lossless-default-pair-bf16
$C lossless --budgets 15,32 --dtype float32 --temperature 0.7 --top-k 20 --top-p 0.9 --seed 7 --report results/compare/lossless-default-pair-sampled
$C external --target $F/qwen3_gqa4_tp --draft $F/dflash_qwen3_gqa4_tp --prompts $F/prompts.jsonl --budget 15 --dtype float32 --max-new-tokens 24 --theirs results/h200/fx_ddtree.jsonl --report results/compare/external-h200-fixture
$C distribution --target $F/qwen3_gqa4_tp --draft $F/dflash_qwen3_gqa4_tp --prompts $F/prompts.jsonl --budget 15 --dtype float32 --temperature 1.0 --top-k 20 --samples 2000 --batch-size 1000 --positions 3 --report results/compare/distribution-fixture
