"""The command line: `mok bench` checks and times the layer; `mok env` describes the machine."""

import argparse
import json
import math
import operator
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import mok
from mok.bench import BenchSpec
from mok.cli import main
from mok.presets import PRESETS, Preset


def run_mok(*args):
    """Run `mok` in a subprocess; its tables are laid out for 200 columns (rich otherwise takes
    80 for a pipe and wraps cells, such as a pass name, differently by the columns shown)."""
    return subprocess.run(
        [sys.executable, "-m", "mok", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
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
    assert "forward+" in done.stdout and "backward" in done.stdout and "baseline" in done.stdout
    assert "…" not in done.stdout  # no header or cell cut short
    report = json.loads(out.read_text())
    assert report["dense_tflops"] is None  # no compute floor on the CPU unless asked for
    # The settings that chose the kernels are stamped on the report (the interpreter's here).
    assert report["settings"] == {
        name: os.environ[name] for name in ("TRITON_INTERPRET",) if name in os.environ
    }
    (result,) = report["results"]
    assert result["spec"]["ep"] == 2 and result["spec"]["tokens"] == 300
    backend, baseline = result["backend"], result["baseline"]
    assert backend["name"] == "reference" and baseline["name"] == "baseline"
    # The reference is the oracle: not compared with itself, and the table says what it is.
    assert backend["check_errors"] == {}
    printed = " ".join(done.stdout.split())  # rich wraps long lines
    assert "reference: the oracle itself, not checked" in printed
    assert "backend=reference (the oracle, not a fast path)" in printed
    assert "plain-PyTorch oracle" in printed
    assert set(baseline["check_errors"]) >= {"y", "grad x", "grad topk_weights", "grad gate"}
    for measurement in (backend, baseline):
        for pass_name in ("forward", "forward_backward"):
            timing = measurement[pass_name]
            assert timing["ms"] > 0 and timing["floor_ratio"] is None
    assert max(baseline["check_errors"].values()) < 2e-2
    assert result["forward_speedup"] == pytest.approx(
        baseline["forward"]["ms"] / backend["forward"]["ms"]
    )


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
                "--accumulate-grads",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "zipf routing" in capsys.readouterr().out


def test_bench_writes_json_markdown_and_png_for_several_ep_sizes(tmp_path):
    done = run_mok(
        "bench",
        "--device",
        "cpu",
        "--ep",
        "1,2",
        "--tokens",
        "200",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--check-tokens",
        "32",
        "--dense-tflops",
        "0.5",
        "--no-progress",
        "--out",
        str(tmp_path / "report"),
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report" / "mok-bench.json").read_text())
    assert {"date", "commit", "machine", "torch", "device", "command"} <= set(report)
    assert report["dense_tflops"] == 0.5 and "--ep 1,2" in report["command"]
    assert [result["spec"]["ep"] for result in report["results"]] == [1, 2]
    for result in report["results"]:
        assert result["forward_backward_floor_ms"] == pytest.approx(3 * result["forward_floor_ms"])
        for which in ("backend", "baseline"):
            timing = result[which]["forward_backward"]
            assert timing["ms_min"] <= timing["ms"] <= timing["ms_max"]
            floor_ratio = timing["ms"] / result["forward_backward_floor_ms"]
            assert timing["floor_ratio"] == pytest.approx(floor_ratio)
            assert timing["tflops"] > 0 and timing["peak_memory_gib"] > 0
    markdown = (tmp_path / "report" / "mok-bench.md").read_text()
    assert f"commit `{report['commit']}`" in markdown and "0.5 TFLOP/s" in markdown
    assert "| tiny | 1 | 200 | forward | reference |" in markdown
    assert "(min-max)" in markdown
    assert "| tiny | 2 | 200 | forward+backward | reference |" in markdown
    png = (tmp_path / "report" / "mok-bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


def test_bench_runs_several_presets_in_one_call(monkeypatch, tmp_path):
    monkeypatch.setitem(PRESETS, "tiny-odd", Preset("tiny-odd", 48, 40, 6, 3, 24))
    out = tmp_path / "bench.json"
    args = ["bench", "--device", "cpu", "--preset", "tiny,tiny-odd", "--ep", "1", "--tokens", "50"]
    args += ["--iters", "1", "--warmup", "0", "--no-progress", "--json", str(out)]
    assert main(args) == 0
    results = json.loads(out.read_text())["results"]
    assert [result["spec"]["preset"] for result in results] == ["tiny", "tiny-odd"]


def test_bench_times_both_precisions_beside_the_baseline(tmp_path):
    """`--precision bf16,mxfp8`: one spec per precision, each beside the bf16 baseline; the MX
    layer checked against the MX reference, the baseline against the bf16 one (against the MX
    reference its errors would be e4m3's, ~3e-2, and the check would fail)."""
    out = tmp_path / "bench.json"
    args = ["bench", "--device", "cpu", "--ep", "1", "--tokens", "40", "--iters", "1"]
    args += ["--warmup", "0", "--precision", "bf16,mxfp8", "--no-progress", "--json", str(out)]
    assert main(args) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["spec"]["precision"] for r in results] == ["bf16", "mxfp8"]
    assert [r["backend"]["name"] for r in results] == ["reference", "reference mxfp8"]
    for result in results:
        assert result["baseline"]["name"] == "baseline"
        assert max(result["baseline"]["check_errors"].values()) < 2e-2


BAD_OPTIONS = [
    (["--preset", "nope"], "--preset: invalid choice: 'nope'"),
    (["--device", "cpu", "--ep", "1,3"], "--ep 3: preset tiny's 8 experts cannot be split evenly"),
    (["--ep", "2,abc"], "--ep: expected integers >= 1 separated by commas, got '2,abc'"),
    (["--backend", "nope"], "--backend: invalid choice: 'nope'"),
    (
        ["--precision", "bf16,fp4"],
        "--precision: invalid choice: 'fp4' (choose from bf16, mxfp8, fp8_block)",
    ),
    (["--swiglu-limit", "-1"], "--swiglu-limit: must be a finite number > 0, got -1"),
    (["--tokens", "0"], "--tokens: must be >= 1, got 0"),
    (["--tokens", "abc"], "--tokens: expected an integer, got 'abc'"),
    (["--iters", "0"], "--iters: must be >= 1"),
    (["--dense-tflops", "0"], "--dense-tflops: must be a finite number > 0"),
    (["--cuda-graph", "--exact-buffers"], "--cuda-graph with --exact-buffers: the exact sizes"),
    (["--out", "/proc/mok-results"], "--out /proc/mok-results: cannot write there"),
    (
        ["--preset", "tiny", "--precision", "mxfp8", "--router-gradient", "epilogue"],
        "tiny in mxfp8: router_gradient='epilogue' takes bf16 experts",
    ),
    (
        ["--preset", "tiny", "--precision", "bf16,mxfp8", "--recompute", "gate_up"],
        "tiny in mxfp8: recompute='gate_up' applies to bf16 experts",
    ),
    (["--json", "/proc/mok/results.json"], "--json /proc/mok/results.json: cannot write there"),
]
CPU_ONLY_BAD_OPTIONS = [
    (["--device", "cuda"], "--device cuda: this machine has no CUDA GPU"),
    (["--cuda-graph"], "--cuda-graph: CUDA graphs need a CUDA GPU"),
    (["--graphs", "on"], "--graphs on: the layer's CUDA graphs need a CUDA GPU"),
    (
        ["--backend", "triton"],
        "--backend triton cannot run tiny in bf16 here: needs a CUDA device",
    ),
]


@pytest.mark.parametrize(
    ("options", "message"),
    BAD_OPTIONS + ([] if torch.cuda.is_available() else CPU_ONLY_BAD_OPTIONS),
)
def test_bench_refuses_bad_options_in_one_line_before_running(
    options, message, capsys, monkeypatch
):
    """Catches a traceback (or an error after the whole run) where one line naming the option
    and the problem belongs."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # with it, triton runs on CPUs (a test mode)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--no-progress", *options])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    assert (
        f"mok bench: error: argument {message}" in error or f"mok bench: error: {message}" in error
    )


def test_env_reports_backends_as_json(monkeypatch):
    monkeypatch.setenv("MOK_WARP_SPECIALIZED", "0")
    monkeypatch.delenv("MOK_TRITON_LAUNCH", raising=False)
    done = run_mok("env", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["backends"]["reference"] == "ok"
    assert info["distributed"]["gloo"] is True
    assert "torch" in info and "symmetric_memory" in info
    # The settings in effect, so that a report says which kernels ran.
    assert info["settings"]["MOK_WARP_SPECIALIZED"] == "0"
    assert info["settings"]["MOK_TRITON_LAUNCH"] is None


def test_pair_capacity_factor_sizes_the_expert_buffers():
    spec = BenchSpec(preset="tiny", tokens=37, pair_capacity_factor=1.25)
    top_k = PRESETS["tiny"].top_k
    assert spec.config().recv_pair_capacity == math.ceil(1.25 * 37 * top_k)
    assert BenchSpec(preset="tiny").config().recv_pair_capacity is None
    assert BenchSpec(preset="tiny", exact_buffers=True).config().tuning.exact_buffers
    assert not BenchSpec(preset="tiny").config().tuning.exact_buffers
    with pytest.raises(SystemExit):
        main(["bench", "--pair-capacity-factor", "0"])


def test_report_figure_says_what_it_shows(monkeypatch):
    """The figure of a CPU run: bars on linear axes from 0 (a log axis hid the small bars), every
    bar labelled with its value, whiskers for the spread, the backend named in the speedup title,
    the same colour for an implementation in both rows, and a note that the `reference` backend is
    the oracle (a CPU figure once read as "MoK is 3x slower")."""
    pytest.importorskip("matplotlib")
    from mok import bench

    spec = BenchSpec(ep=1, tokens=64, iters=3, warmup=0, check_tokens=16, progress=False)
    results = bench.run_bench([spec])
    header = bench.report_header("cpu", None, "mok bench")
    figure = bench.report_figure(header, results)
    speed_axes, time_axes = figure.axes[0], figure.axes[1]
    assert all(axes.get_yscale() == "linear" for axes in figure.axes)
    assert time_axes.get_ylim()[0] == 0
    assert "reference backend" in speed_axes.get_title()
    assert bench.REFERENCE_NOTE in " ".join(figure.get_suptitle().split("\n")[2:])
    bars = time_axes.patches
    assert len(bars) == 4 and len(time_axes.texts) == 4  # one value label per bar
    timings = [
        getattr(results[0], which).timing(pass_name)
        for pass_name in bench.PASS_HATCHES
        for which in ("backend", "baseline")
    ]
    assert [bar.get_height() for bar in bars] == pytest.approx([t.ms for t in timings])
    bar_container = next(c for c in time_axes.containers if hasattr(c, "errorbar"))
    whiskers = bar_container.errorbar.lines[2][0].get_segments()
    assert len(whiskers) == 4
    assert [w[0][1] for w in whiskers] == pytest.approx([t.ms_min for t in timings])
    colours = {bar.get_facecolor() for bar in speed_axes.patches}
    assert colours == {bars[0].get_facecolor()}  # the backend's colour in both rows


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_bench_default_shape_is_sized_to_the_machine(monkeypatch, gpus):
    """Without --preset and --ep: on GPUs a real model's layer with one rank per GPU (the `tiny`
    layer is bound by the host's launches there and made a first run read as "slower than
    PyTorch"); on the CPU the tiny layer on 2 ranks. Catches a default that ignores the GPUs."""
    from mok import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=141 << 30)
    )
    captured = []

    class Captured(Exception):
        pass

    def run_bench(specs):  # stop before anything touches a GPU
        captured.extend(specs)
        raise Captured

    monkeypatch.setattr(cli, "run_bench", run_bench)
    with pytest.raises(Captured):
        main(["bench", "--no-progress"])
    (spec,) = captured
    if gpus:
        assert (spec.preset, spec.ep, spec.device) == (cli.GPU_DEFAULT_PRESET, gpus, "cuda")
        assert spec.tokens_per_rank == 8192 and spec.dense_tflops is not None
    else:
        assert (spec.preset, spec.ep, spec.device) == ("tiny", 2, "cpu")


def test_bench_runs_the_backend_with_local_validation(tmp_path):
    """--validation reaches the backend's config (and the report says which). Catches an option
    parsed but dropped on the way to the layer."""
    out = tmp_path / "bench.json"
    args = ["bench", "--device", "cpu", "--ep", "2", "--tokens", "40", "--iters", "1"]
    args += ["--warmup", "0", "--check-tokens", "16", "--no-progress", "--validation", "local"]
    assert main([*args, "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["spec"]["validation"] == "local"
    assert BenchSpec(validation="local").config().validation is mok.Validation.LOCAL


@pytest.mark.parametrize(
    ("option", "value", "field", "kind"),
    [
        # --graphs on is refused on the CPU (BAD_OPTIONS)
        *(("--graphs", value, "tuning.graphs", mok.Graphs) for value in ("auto", "off")),
        *(
            ("--mx-weight-casts", value, "tuning.mx_weight_casts", mok.MXWeightCasts)
            for value in ("auto", "keep", "per_pass")
        ),
        *(
            ("--recompute", value, "tuning.recompute", mok.Recompute)
            for value in ("none", "gate_up")
        ),
        *(
            ("--router-gradient", value, "router_gradient", mok.RouterGradient)
            for value in ("saved_outputs", "epilogue")
        ),
    ],
)
def test_bench_passes_config_options_to_the_layer(monkeypatch, option, value, field, kind):
    """--graphs, --mx-weight-casts, --recompute and --router-gradient reach the backend's config
    (default: the enum's first value). Catches an option parsed but dropped on the way to the
    layer (every run would time the default)."""
    from mok import cli

    captured = []

    class Captured(Exception):
        pass

    def run_bench(specs):
        captured.extend(specs)
        raise Captured

    monkeypatch.setattr(cli, "run_bench", run_bench)
    with pytest.raises(Captured):
        main(["bench", "--no-progress", "--device", "cpu", option, value])
    (spec,) = captured
    assert operator.attrgetter(field)(spec.config()) is kind(value)
    assert operator.attrgetter(field)(BenchSpec().config()) is next(iter(kind))
    with pytest.raises(SystemExit):
        main(["bench", option, "sometimes"])


@pytest.mark.parametrize(
    ("status", "expected"), [("", "abc1234"), (" M src/mok/bench.py", "abc1234+modified")]
)
def test_results_name_a_modified_tree_as_such(monkeypatch, status, expected):
    """A tree copied over an older history (as on a remote GPU machine without MOK_COMMIT) must
    not pass for the older commit. Catches the modification check dropped or reading the wrong
    git output."""
    from mok import bench

    outputs = {"rev-parse": "abc1234\n", "status": status}

    def fake_run(command, **kwargs):
        return subprocess.CompletedProcess(command, 0, stdout=outputs[command[1]], stderr="")

    monkeypatch.delenv("MOK_COMMIT", raising=False)
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    assert bench.git_commit() == expected


@pytest.mark.gpu
def test_bench_times_the_layer_replayed_from_a_cuda_graph(tmp_path):
    """`--cuda-graph`: the backend's passes replayed from CUDA graphs, checked bit for bit against
    the eager pass before timing, beside the eager baseline. Catches the flag not reaching the
    backend's timing (its name would not say so), the baseline captured too (it synchronizes
    with the host: the capture would fail), and a replay that redoes nothing (its times would
    sit far below the GPU work of the pass, which the compute floor bounds from below)."""
    out = tmp_path / "bench.json"
    args = ["bench", "--no-progress", "--preset", "qwen3-30b-a3b", "--ep", "1", "--tokens", "2048"]
    main([*args, "--iters", "3", "--warmup", "1", "--cuda-graph", "--json", str(out)])
    (result,) = json.loads(out.read_text())["results"]
    assert result["backend"]["name"].endswith(", CUDA graph")
    assert result["baseline"]["name"] == "baseline"
    for timing in ("forward", "forward_backward"):
        assert result["backend"][timing]["floor_ratio"] >= 1.0


@pytest.mark.parametrize("replay_differs", [False, True])
def test_a_graphed_pass_is_checked_against_the_eager_pass(monkeypatch, replay_differs):
    """The check `--cuda-graph` runs before timing, with the capture faked on the CPU (a
    "graph" whose replay redoes the pass, or leaves one gradient off by one ulp). Catches a
    check that compares the eager pass with itself, or skips the input gradients."""
    from mok import bench

    class FakeGraph:
        def __init__(self, call):
            self.call = call

        def replay(self):
            self.call()
            if replay_differs:
                weights = inputs[2]
                weights.grad.copy_(torch.nextafter(weights.grad, weights.grad + 1))

    def fake_capture(call):
        return FakeGraph(call), call()

    monkeypatch.setattr(bench, "capture_in_graph", fake_capture)
    spec = BenchSpec(preset="tiny", ep=1, tokens=64, device="cpu")
    config = spec.config()
    layer = mok.MoE(config, device="cpu")
    layer.load_global_weights(bench.global_weights(config, 0, torch.device("cpu")))
    inputs = bench._timing_inputs(spec, config, 0, torch.device("cpu"))
    if replay_differs:
        with pytest.raises(AssertionError, match=r"differs from the eager pass in \['grad topk"):
            bench._graphed_pass(spec, layer, inputs, True, "reference")
    else:
        bench._graphed_pass(spec, layer, inputs, True, "reference")()


def test_symmetric_buffer_sizes_follow_the_layout_arithmetic():
    """deepseek-v3 at EP 2, 8192 tokens a rank (H 7168, k 8), sized by hand in the design notes:
    staging rows for every token of every rank (16384 x H bf16), expert outputs for k pairs each
    (131072 x H bf16), pair gradients (T k x H bf16), staging gradients (16384 x H fp32); the
    overlapped layout without staging and expert outputs, with a copy of x and its pair slots
    in the pair gradients' memory and its copy of x in the staging gradients' (the larger);
    --pair-capacity-factor 1.25 trims the expert outputs to
    81920 rows. Catches a region sized by the wrong capacity or dtype (the estimate and the
    allocation share this layout)."""
    config = mok.get_preset("deepseek-v3").config(max_tokens_per_rank=8192)
    row = 7168 * 2
    triton = mok.symmetric_buffer_bytes(config, 2)
    assert triton["staging"] == 16384 * row and triton["expert_out"] == 131072 * row
    assert triton["grad_pairs"] == 8192 * 8 * row and triton["grad_staging"] == 16384 * 2 * row
    trimmed = mok.symmetric_buffer_bytes(config.replace(recv_pair_capacity=81920), 2)
    assert trimmed["expert_out"] == 81920 * row
    fused = mok.symmetric_buffer_bytes(config.replace(backend="fused"), 2)
    assert "staging" not in fused and "expert_out" not in fused
    assert "x_copy" not in fused and "pair_out" not in fused
    assert fused["grad_staging"] == 16384 * 2 * row
    # Staging gradients for fewer rows than x's copy: the region holds the copy.
    small = mok.symmetric_buffer_bytes(config.replace(backend="fused", recv_capacity=2048), 2)
    assert small["grad_staging"] == 8192 * row
    assert fused["grad_pairs"] == 8192 * 8 * row
    # router_gradient="epilogue": no pair gradients, two fp32 values per grouped row instead.
    epilogue = mok.symmetric_buffer_bytes(config.replace(router_gradient="epilogue"), 2)
    assert "grad_pairs" not in epilogue
    assert epilogue["row_weights"] == epilogue["row_dots"] == 131072 * 4
    assert sum(triton.values()) - sum(epilogue.values()) == 8192 * 8 * row - 2 * 131072 * 4
    assert mok.symmetric_buffer_bytes(config, 1) == {}
    assert mok.symmetric_buffer_bytes(config.replace(backend="reference"), 2) == {}


def test_memory_prints_the_buffer_per_preset_and_ep(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich's table width: no cell cut short
    assert main(["memory", "--preset", "deepseek-v3", "--ep", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "3.283" in out  # EP 2: 0.219 + 1.75 + 0.875 + 0.438 GiB and the small regions
    argv = ["memory", "--preset", "deepseek-v3", "--ep", "2", "--router-gradient", "epilogue"]
    assert main(argv) == 0
    assert "2.409" in capsys.readouterr().out  # without the 0.875 GiB of pair gradients
    assert main([*argv, "--backend", "fused"]) == 0  # its pair slots stay: the forward's outputs
    assert "row_weights" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["memory", "--preset", "deepseek-v3", "--ep", "3"])
    assert "256 experts cannot be split evenly over 3 ranks" in capsys.readouterr().err


def test_memory_is_readable_at_80_columns_and_through_a_pipe():
    """rich lays a table out for 80 columns when piped: every region name and size must show
    whole (a table with a column per region cut them all to "…")."""
    done = subprocess.run(
        [sys.executable, "-m", "mok", "memory", "--preset", "deepseek-v3,qwen3-30b-a3b"],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "COLUMNS"},
    )
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout
    assert max(map(len, done.stdout.splitlines())) <= 80
    for text in ("grad_staging", "expert_out", "3.283", "10.508", "EP 8", "16384 tokens/rank"):
        assert text in done.stdout, text


def test_help_lists_every_command_and_every_bench_option_with_its_default(capsys):
    """Catches an option without help, a default the help does not show (a falsy one: 0), and a
    subcommand missing from `mok --help`."""
    from mok.cli import _parser

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"mok {mok.__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    for command in ("bench", "env", "memory"):
        assert f"    {command} " in top, command
    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for action in sub._actions:
            if not action.option_strings or action.help == "show this help message and exit":
                continue
            assert action.help, (name, action.option_strings)
            assert action.option_strings[0] in text, (name, action.option_strings)
            if action.default is not None and action.default is not False:
                shown = sub._get_formatter()._get_help_string(action)
                assert "default" in " ".join(shown.split()), (name, action.option_strings)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    bench_help = " ".join(capsys.readouterr().out.split())
    assert "--iters ITERS timed iterations per pass (default: 20)" in bench_help
    assert "(default: uniform)" in bench_help and "(default: auto)" in bench_help
    assert "--seed SEED seed of the weights, inputs and routing (default: 0)" in bench_help
    assert "output: --json PATH" in bench_help  # the options come in groups


def test_an_unknown_preset_is_a_config_error_naming_the_known_ones():
    with pytest.raises(mok.MoKConfigError, match="unknown preset 'deepseek'; known: tiny, "):
        mok.get_preset("deepseek")


def test_a_noisy_timing_is_marked_in_the_table_and_the_markdown():
    """A timing whose slowest iteration took over 1.5x its fastest (two identical CPU runs gave
    0.19x and 4.70x) is flagged where its median is printed; a steady one is not."""
    from mok.bench import BenchResult, Measurement, PassTiming, markdown_report, report_header

    def timing(ms_min, ms_max):
        return PassTiming(
            ms=1.0, ms_min=ms_min, ms_max=ms_max, tflops=1.0, floor_ratio=None, peak_memory_gib=0.1
        )

    steady, noisy = timing(0.9, 1.1), timing(0.5, 2.0)
    backend = Measurement("triton", {"y": 1e-3}, forward=steady, forward_backward=noisy)
    baseline = Measurement("baseline", {"y": 2e-3}, forward=steady, forward_backward=steady)
    result = BenchResult(BenchSpec(), "CUDA allocated", None, None, backend, baseline, 1.0, 1.0)
    assert not result.noisy("forward") and result.noisy("forward+backward")
    columns, rows = result.table()
    cells = dict(zip(columns, zip(*rows, strict=True), strict=True))
    assert "(noisy)" not in cells["forward\ntriton"][0]
    assert cells["forward+backward\ntriton"][0].endswith("(noisy)")  # the time
    assert cells["forward+backward\ntriton"][5].endswith("(noisy)")  # the speedup
    markdown = markdown_report(report_header("cpu", None, "mok bench"), [result])
    assert "2.000) (noisy)" in markdown and "the median is unreliable" in markdown


def test_env_without_triton_says_what_the_fast_backends_need(monkeypatch, capsys):
    """On a machine without Triton (a CPU build of PyTorch, `pip install -e .`): the reason
    names the package extra, shown whole in the table (rich took `[triton]` for markup)."""
    import importlib.util

    from mok.env import collect_env, print_env

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "triton" else real_find_spec(name, *args),
    )
    info = collect_env()
    assert "pip install 'mok[triton]'" in info["backends"]["triton"]
    monkeypatch.setenv("COLUMNS", "200")
    print_env(info)
    assert "pip install 'mok[triton]'" in capsys.readouterr().out


def test_bench_refuses_tokens_the_device_cannot_hold_in_one_line(capsys):
    """4M tokens a rank at deepseek-v3's shape: ~1 TB of per-pair activations, which neither an
    H200 nor this host holds. Catches an out-of-memory traceback (or a host swapping for an
    hour) where one line with the memory needed belongs."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--preset", "deepseek-v3", "--ep", "1", "--tokens", "4000000"])
    assert exit_info.value.code == 2
    error = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in error
    assert "deepseek-v3 at 4000000 tokens/rank, EP 1, needs at least about" in error
    need = float(error.split("needs at least about ")[1].split(" GiB")[0])
    assert 900 < need < 2000, need  # 4M x 8 pairs x (2 x 7168 + 3 x 2048) x 2 bytes: 1.2 TiB
