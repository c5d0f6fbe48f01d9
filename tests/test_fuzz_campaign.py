"""benchmarks/fuzz.py on the CPU (its kernels under the interpreter): a few cases through the
campaign's whole path, one of each kind that needs its own handling (MXFP8 with gpt-oss's
experts, the fused backend with the router-gradient epilogue, ids out of range). Catches a
campaign that no longer runs (an API it calls changed) before GPU time is spent on it, and an
oracle that ignores the case's precision (a correct MXFP8 layer then reads as a mismatch)."""

from __future__ import annotations

import importlib
import pathlib
import random
import time

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def fuzz(monkeypatch):
    """The script as the module `fuzz` (importable by name: spawned ranks import it)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("fuzz")


@pytest.mark.interpreter
@pytest.mark.slow
def test_the_campaign_runs_every_kind_of_case_without_a_finding(fuzz):
    base = fuzz.draw_case(random.Random(0), 1, 0)
    variants = [
        {"shape": 3, "backend": "triton", "precision": "mxfp8"},  # gpt-oss's experts in MXFP8
        {"shape": 2, "backend": "fused", "router_gradient": "epilogue", "routing": "zipf"},
        {"shape": 1, "backend": "triton", "router_gradient": "epilogue", "bad_ids": True},
    ]
    cases = []
    for index, changes in enumerate(variants):
        case = {**base, "index": index, "tokens": [37], "precision": "bf16", "bad_ids": False}
        cases.append({**case, "router_gradient": "saved_outputs", **changes})
    results = fuzz.campaign(cases, 1, time.time() + 600)
    assert sorted(results) == [0, 1, 2]
    outcomes = {index: result["outcome"] for index, result in results.items()}
    assert outcomes == {0: "exact", 1: "exact", 2: "bad ids raised"}, results
