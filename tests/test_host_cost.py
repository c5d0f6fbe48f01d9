"""benchmarks/host_cost.py on the CPU: both validation modes run a stack of layers and report host
and device time. Catches a mode that breaks a multi-layer model or a report that drops a mode."""

import importlib
import pathlib

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_host_cost_reports_both_validation_modes(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("host_cost")
    assert script.main(["--layers", "2", "--tokens", "16", "--steps", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "| collective |" in out and "| local |" in out
