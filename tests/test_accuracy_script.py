"""benchmarks/accuracy.py on the CPU (the triton backend's kernels under the interpreter): every
numerics form of the tiny layer against float64 and the form's oracle. Catches a script that no
longer runs (an API it calls changed) before GPU time is spent on it, and an oracle that is not
the form's (a correct MXFP8 or epilogue-form layer would then read as off)."""

from __future__ import annotations

import importlib
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.interpreter
@pytest.mark.slow
def test_every_form_is_checked_against_its_oracle(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("accuracy")
    out = tmp_path / "accuracy.md"
    assert script.main(["--preset", "tiny", "--tokens", "32", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    checked = {tuple(cell.strip() for cell in row.split("|")[1:3]): row for row in rows[2:]}
    for form in script.FORMS:
        triton = checked[(form, "triton")]
        assert triton.endswith("| yes |"), triton
        assert checked[(form, "reference")].endswith("| oracle |"), checked[(form, "reference")]
    assert "checks: all passed" in capsys.readouterr().out
