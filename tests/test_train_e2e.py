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


@pytest.fixture
def script(monkeypatch):
    """The script as the module `train_e2e` (importable by name: spawned ranks import it)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    return importlib.import_module("train_e2e")


def test_native_and_mok_experts_train_alike(script, tmp_path):
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
    # The routing's skew per layer (max / mean pairs an expert takes: >= 1, and at most 8, all
    # pairs on one of the 8 experts), recorded whichever experts implementation runs.
    for run in (native, ours):
        assert len(run["expert_load"]) == 4
        assert all(1.0 <= load <= 8.0 for load in run["expert_load"])


def test_expert_parallel_training_follows_the_one_process_run(script, tmp_path):
    """EP 2 on gloo ranks (experts sharded, other gradients averaged): `mok` and `mok-baseline`
    follow the one-process run on the union of the ranks' batches. Catches: gradients of the
    replicated parameters not averaged (or experts' averaged twice), a rank's experts not sliced
    to its own, the ranks' batches overlapping."""
    sizes = ["--layers", "4", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    sizes += ["--moe-intermediate", "32", "--steps", "12", "--warmup", "1", "--seq", "32"]
    sizes += ["--lr", "3e-3", "--device", "cpu"]
    one = tmp_path / "one"
    assert script.main([*sizes, "--batch", "4", "--implementations", "mok", "--out", str(one)]) == 0
    two = tmp_path / "two"
    assert script.main([*sizes, "--batch", "2", "--ep", "2", "--out", str(two)]) == 0
    reference = json.loads((one / "train-e2e.json").read_text())["results"]["mok"]["losses"]
    results = json.loads((two / "train-e2e.json").read_text())["results"]
    assert list(results) == ["mok-baseline", "mok"]
    for result in results.values():
        assert max(abs(a - b) for a, b in zip(result["losses"], reference, strict=True)) < 0.05


def test_gradient_accumulation_steps(script, tmp_path):
    """--accumulate 2: two micro-batches a step, their mean loss reported, both sets of
    implementations training alike. Catches the loss summed instead of averaged (the first loss
    would be ~2 ln 512 instead of ~ln 512 = 6.24) and tokens/s that leave the micro-batches out
    (the layer's accumulation of gradients over micro-batches: tests/test_grad_accumulation.py)."""
    args = ["--device", "cpu", "--implementations", "eager,mok", "--steps", "8", "--warmup", "1"]
    args += ["--layers", "2", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    args += ["--moe-intermediate", "32", "--batch", "2", "--seq", "32", "--lr", "3e-3"]
    assert script.main([*args, "--accumulate", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "train-e2e.json").read_text())["results"]
    native, ours = results["eager"], results["mok"]
    assert native["losses"][0] == pytest.approx(6.24, abs=0.3)
    assert ours["losses"][-1] < ours["losses"][0] - 0.1
    assert ours["max_loss_difference"] < 0.05
    median_s = ours["median_ms"] / 1e3
    assert ours["tokens_per_s"] == pytest.approx(2 * 2 * 32 / median_s)


def test_mixed_precision_with_fp32_weights(script, tmp_path):
    """--weights fp32-autocast: fp32 weights, every step under autocast to bf16 (a trainer's bf16
    mode), MoK against the native experts alike. Catches the option not reaching the model
    (the report would say bf16 weights were trained) or MoK failing on fp32 experts."""
    args = ["--device", "cpu", "--implementations", "eager,mok", "--steps", "8", "--warmup", "1"]
    args += ["--layers", "2", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    args += ["--moe-intermediate", "32", "--batch", "2", "--seq", "32", "--lr", "3e-3"]
    assert script.main([*args, "--weights", "fp32-autocast", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "train-e2e.json").read_text())
    assert report["args"]["weights"] == "fp32-autocast"
    assert "fp32-autocast weights" in (tmp_path / "train-e2e.md").read_text()
    ours = report["results"]["mok"]
    assert ours["losses"][-1] < ours["losses"][0] - 0.1
    assert ours["max_loss_difference"] < 0.05


def test_torchtitan_model_trains_alike_with_mok_behind_its_experts(script, tmp_path):
    """--framework torchtitan: TorchTitan's own Qwen3-MoE (its debug flavor cut to two layers;
    eager causal attention on the CPU) against itself with MoK behind its routed experts.
    Catches use_mok not taking effect (the report would show TorchTitan's path twice: equal
    curves are then no test, so the mok model is checked to route through MoK), its experts'
    gradients not reaching the optimizer (the curves would part), the report's MoE shape
    taken from the wrong module."""
    pytest.importorskip("torchtitan")
    from mok.integrations.torchtitan import missing_torch_features

    if missing := missing_torch_features():
        pytest.skip(f"TorchTitan's models need {', '.join(missing)} (a newer PyTorch)")
    args = ["--device", "cpu", "--framework", "torchtitan", "--titan-flavor", "debugmodel_moe"]
    args += ["--layers", "2", "--steps", "16", "--warmup", "1", "--batch", "4", "--seq", "32"]
    args += ["--lr", "1e-3", "--out", str(tmp_path)]
    assert script.main(args) == 0
    report = json.loads((tmp_path / "train-e2e.json").read_text())
    native, ours = report["results"]["torchtitan"], report["results"]["mok"]
    assert ours["losses"][0] == pytest.approx(native["losses"][0], abs=1e-2)
    # A noisy curve at this size: the last four steps against the first four.
    assert sum(ours["losses"][-4:]) / 4 < sum(ours["losses"][:4]) / 4 - 0.1
    assert ours["max_loss_difference"] < 0.05
    assert ours["losses"] != native["losses"]  # two implementations, not one twice
    assert report["args"]["experts"] == 64 and report["args"]["top_k"] == 8


def test_compiled_training_follows_the_eager_run(script, tmp_path):
    """--compile aot_eager: every implementation compiled from the second step on (MoK's
    experts need the first, eager, to make their workspaces). aot_eager keeps every operation,
    so the native run's losses must equal the eager run's exactly, and MoK's follow them.
    Catches the compiled model not being the one trained (its losses would stay at the first
    step's), a compile before the workspaces exist (the run would raise)."""
    args = ["--device", "cpu", "--implementations", "eager,mok", "--steps", "6", "--warmup", "1"]
    args += ["--layers", "2", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    args += ["--moe-intermediate", "32", "--batch", "2", "--seq", "16", "--lr", "3e-3"]
    assert script.main([*args, "--out", str(tmp_path / "eager")]) == 0
    assert script.main([*args, "--compile", "aot_eager", "--out", str(tmp_path / "compiled")]) == 0
    eager, compiled = (
        json.loads((tmp_path / run / "train-e2e.json").read_text())["results"]
        for run in ("eager", "compiled")
    )
    assert compiled["eager"]["losses"] == eager["eager"]["losses"]
    assert compiled["mok"]["max_loss_difference"] < 0.05
    assert compiled["mok"]["losses"][-1] < compiled["mok"]["losses"][0]


def test_under_torchrun_the_ranks_join_its_job(script, tmp_path):
    """`torchrun --nproc-per-node 2 benchmarks/train_e2e.py --ep 2`: the script joins torchrun's
    job instead of spawning ranks, rank 0 alone writes the report, and the losses are the
    spawned run's. Catches a second set of ranks spawned inside the job (it would hang or
    fail), every rank writing the same files, ranks that train on the same batch."""
    import os
    import subprocess
    import sys

    args = ["--device", "cpu", "--ep", "2", "--layers", "2", "--hidden", "64", "--experts", "8"]
    args += ["--top-k", "2", "--moe-intermediate", "32", "--steps", "5", "--warmup", "1"]
    args += ["--batch", "2", "--seq", "16", "--lr", "3e-3"]
    assert script.main([*args, "--out", str(tmp_path / "spawned")]) == 0
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += [str(SCRIPT), *args, "--out", str(tmp_path / "torchrun")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("| mok |") == 1  # one report, rank 0's
    spawned, joined = (
        json.loads((tmp_path / run / "train-e2e.json").read_text())["results"]
        for run in ("spawned", "torchrun")
    )
    for name in ("mok-baseline", "mok"):
        pairs = zip(joined[name]["losses"], spawned[name]["losses"], strict=True)
        assert max(abs(a - b) for a, b in pairs) < 1e-3, name
