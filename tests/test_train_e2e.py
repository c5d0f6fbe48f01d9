"""benchmarks/train_e2e.py on the CPU: a few training steps of a tiny Qwen3-MoE with the native
and the MoK experts. Catches: implementations that start from different weights or see different
batches (their first losses would differ), MoK experts whose gradients do not reach the optimizer
(the curves would part within a few steps), a report or plot that is not written."""

import importlib.util
import json
import pathlib

import pytest

pytest.importorskip("transformers")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "train_e2e.py"


def load_script():
    spec = importlib.util.spec_from_file_location("train_e2e", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_native_and_mok_experts_train_alike(tmp_path):
    script = load_script()
    args = ["--device", "cpu", "--implementations", "eager,mok", "--steps", "15", "--warmup", "1"]
    # The CPU sizes, also where a GPU would make the script default to larger ones.
    args += ["--layers", "4", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    args += ["--moe-intermediate", "32"]
    args += ["--batch", "4", "--seq", "32", "--lr", "3e-3", "--out", str(tmp_path)]
    assert script.main(args) == 0
    report = json.loads((tmp_path / "train-e2e.json").read_text())
    native, ours = report["results"]["eager"], report["results"]["mok"]
    assert ours["losses"][0] == pytest.approx(native["losses"][0], abs=1e-2)
    # The loss falls, and the two runs stay within bf16 noise of each other.
    assert ours["losses"][-1] < ours["losses"][0] - 0.1
    assert ours["max_loss_difference"] < 0.05
    assert (tmp_path / "train-e2e.md").read_text().count("| mok |") == 1
    assert (tmp_path / "train-e2e.png").read_bytes().startswith(b"\x89PNG")
