"""Every mode of `ddtree-generate` reproduces the float32 outputs recorded in
tests/fixtures/recorded_outputs.json (by tests/recorded_outputs.py, where every mode agreed): output
ids, acceptance lengths and finish reason of each prompt, for ar, dflash and ddtree, greedy and seeded
sampling, prompts with their own limits, on a dense and a MoE fixture pair and on the bundled pair."""

import json

import pytest
from recorded_outputs import CASES, METHODS, MODES, PROCESSES, RECORD, run_mode

RECORDED = json.loads(RECORD.read_text())["cases"]
# Each run compiles its programs (half a minute on two CPU cores), so not every combination runs here
# (tests/recorded_outputs.py checks them all when recording): every method in the four main modes on
# the dense pair, ddtree in them on the MoE and bundled pairs, every mode with ddtree on the dense pair.
MAIN = ("continuous", "static", "host-stepped", "mesh")
RUNS = [("dense", m, mode) for m in METHODS for mode in MAIN]
RUNS += [("dense", "ddtree", mode) for mode in MODES if mode not in MAIN]
RUNS += [(case, "ddtree", mode) for case in ("moe", "bundled") for mode in MAIN]
RUNS += [(case, m, "continuous") for case in ("moe", "bundled") for m in ("ar", "dflash")]
RUNS += [("dense", m, PROCESSES) for m in ("ar", "ddtree")]


def test_record_covers_every_case_and_method():
    assert set(RECORDED) == set(CASES)
    for case, lines in ((c, CASES[c][2]) for c in CASES):
        for method in METHODS:
            assert set(RECORDED[case][method]) == {str(line["id"]) for line in lines}, (case, method)


@pytest.mark.parametrize("case,method,mode", RUNS)
def test_mode_reproduces_the_record(tmp_path, case, method, mode):
    assert run_mode(case, method, mode, tmp_path) == RECORDED[case][method]
