"""Every mode of `ddtree-generate` reproduces the float32 outputs recorded in
tests/fixtures/recorded_outputs.json (by tests/recorded_outputs.py, where every mode agreed): output
ids, acceptance lengths and finish reason of each prompt, for ar, dflash and ddtree, greedy and seeded
sampling, prompts with their own limits, on a dense and a MoE fixture pair and on the bundled pair."""

import json

import pytest
from recorded_outputs import CASES, METHODS, MODES, PROCESSES, RECORD, argv, outputs, run_mode, write_prompts

RECORDED = json.loads(RECORD.read_text())["cases"]
# Each run compiles its programs (15-25 CPU-s on two cores), so not every combination runs here
# (tests/recorded_outputs.py checks them all when recording). Here: ddtree, whose outputs and acceptance
# lengths go through every part of the engine, in every mode on the dense pair; ar and dflash in the
# default (continuous) mode and host-stepped (their own stage sequence) on it; ddtree continuous and on
# a mesh on the MoE pair, continuous on the bundled pair. ar and dflash give ar's tokens in static
# batches and on meshes in tests/test_families.py (speculative equals ar, identical on meshes).
RUNS = [("dense", "ddtree", mode) for mode in (*MODES, PROCESSES)]
RUNS += [("dense", m, mode) for m in ("ar", "dflash") for mode in ("continuous", "host-stepped")]
RUNS += [("moe", "ddtree", mode) for mode in ("continuous", "mesh")]
RUNS += [("bundled", "ddtree", "continuous")]


def test_record_covers_every_case_and_method():
    assert set(RECORDED) == set(CASES)
    for case, lines in ((c, CASES[c][2]) for c in CASES):
        for method in METHODS:
            assert set(RECORDED[case][method]) == {str(line["id"]) for line in lines}, (case, method)


@pytest.mark.parametrize("case,method,mode", RUNS)
def test_mode_reproduces_the_record(tmp_path, case, method, mode):
    assert run_mode(case, method, mode, tmp_path) == RECORDED[case][method]


@pytest.mark.parametrize("mode", ["continuous", "mesh"])
def test_scan_layers_reproduces_the_record(tmp_path, mode):
    """`--scan-layers` (the dense target's layers as one scan, issue 42) gives the recorded ddtree
    outputs of the dense pair, on one device and on a 2x2 mesh."""
    from ddtree_jax.cli import main

    out = tmp_path / "scan.jsonl"
    prompts = write_prompts("dense", tmp_path / "dense.jsonl")
    assert main([*argv("dense", "ddtree", prompts, out), "--scan-layers", *MODES[mode]]) == 0
    assert outputs(out) == RECORDED["dense"]["ddtree"]
