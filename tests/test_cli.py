"""The command line: `mok bench` checks and times the layer; `mok env` describes the machine."""

import json
import subprocess
import sys

import pytest

from mok.cli import main


def run_mok(*args):
    return subprocess.run(
        [sys.executable, "-m", "mok", *args], capture_output=True, text=True, timeout=300
    )


def test_bench_checks_then_times_on_spawned_gloo_ranks(tmp_path):
    out = tmp_path / "bench.json"
    done = run_mok(
        "bench",
        "--device",
        "cpu",
        "--ep",
        "2",
        "--tokens",
        "300",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--check-tokens",
        "64",
        "--no-progress",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert "forward+backward" in done.stdout
    result = json.loads(out.read_text())
    assert result["backend"] == "reference"
    assert result["spec"]["ep"] == 2 and result["spec"]["tokens"] == 300
    assert result["forward_ms"] > 0 and result["forward_backward_ms"] > 0
    assert set(result["check_errors"]) >= {"y", "grad x", "grad topk_weights", "grad gate"}
    assert max(result["check_errors"].values()) < 1e-2


def test_bench_in_one_process_with_skewed_routing(capsys):
    assert (
        main(
            [
                "bench",
                "--device",
                "cpu",
                "--ep",
                "1",
                "--tokens",
                "100",
                "--iters",
                "2",
                "--warmup",
                "0",
                "--routing",
                "zipf",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "zipf routing" in capsys.readouterr().out


def test_bench_refuses_what_it_cannot_run():
    done = run_mok("bench", "--preset", "nope")
    assert done.returncode == 2 and "invalid choice: 'nope'" in done.stderr
    with pytest.raises(SystemExit):
        main(["bench", "--iters", "0"])


def test_env_reports_backends_as_json():
    done = run_mok("env", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["backends"]["reference"] == "ok"
    assert info["distributed"]["gloo"] is True
    assert "torch" in info and "symmetric_memory" in info
