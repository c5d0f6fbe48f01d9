"""`mok bench`: check, then time, the layer forward and forward+backward next to the standard
PyTorch path (`mok.baseline`), at one or several presets and expert-parallel sizes.

Every rank builds the same global weights and its inputs from seeded generators, and checks the
backend and the baseline against the reference backend (same group, same weights) before anything
is timed. The baseline and the backend run on the same weights and
inputs with the same iteration scheme: per iteration the slowest rank's time, then the median over
iterations. The baseline runs first, before the backend's workspace exists, so that each peak
memory figure holds the weights and inputs plus that implementation's own buffers only.

Reports (`write_report`): a JSON document, a markdown table and a PNG plot, stamped with the date,
the commit and the machine.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

import mok
from mok.baseline import BaselineMoE
from mok.distributed import all_gather_int64
from mok.presets import get_preset
from mok.ranks import init_from_env, run_ranks
from mok.routing import make_routing
from mok.testing import (
    RankInputs,
    capture_in_graph,
    global_weights,
    one_call_errors,
    one_call_results,
    relative_error,
)

BASELINE = "baseline"
# Relative Frobenius error allowed against the reference backend. The reference computes in
# fp32; bf16 outputs round at ~4e-3 relative per element, and the baseline rounds to bf16 more
# often (see mok.baseline).
CHECK_TOLERANCE = {"reference": 1e-2, BASELINE: 2e-2}
DEFAULT_CHECK_TOLERANCE = 2e-2
# The baseline rounds gate and up to bf16 before the SwiGLU clamp: elements whose rounded value
# lands on the other side of the limit switch their gradient on or off (~6e-2 relative error in the
# gradients at a limit near 1 on unit-scale data).
BASELINE_CLAMPED_GRADIENT_TOLERANCE = 1.5e-1
# Dense bf16 rate of the compute floor on CUDA unless told otherwise: cuBLAS bf16 GEMM 8192^3 on an
# H200, measured on the reference machine (2026-11-30).
H200_DENSE_BF16_TFLOPS = 794.0
PASSES = {"forward": False, "forward+backward": True}  # name -> with backward
NOISY_SPREAD = 1.5
"""A timing whose slowest iteration took more than this many times its fastest is flagged as
noisy: its median says little (a busy host, too few iterations)."""
ORACLE = "reference"
"""The backend that defines the results (`mok.reference`): the check compares with it, so it is
not checked against itself."""


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    """What to benchmark; see `mok bench --help`."""

    preset: str = "tiny"
    ep: int = 2
    tokens: int | None = None
    backend: str = "auto"
    device: str = "cpu"
    routing: str = "uniform"
    iters: int = 20
    warmup: int = 5
    check_tokens: int = 1024
    swiglu_limit: float | None = None
    """The SwiGLU clamp; None: the preset's (gpt-oss's 7, else none)."""
    seed: int = 0
    progress: bool = True
    dense_tflops: float | None = None
    """Dense bf16 TFLOP/s that defines the compute floor (FLOPs / rate); None: no floor."""
    pair_capacity_factor: float | None = None
    """Pairs each rank's experts can take, as a multiple of the mean T * k
    (`MoKConfig.recv_pair_capacity`); None: the worst case."""
    exact_buffers: bool = False
    """`MoKTuning.exact_buffers`: the per-pair tensors sized by the pairs each call received,
    read on the host (one synchronization per forward)."""
    validation: str = "collective"
    """`MoKConfig.validation` of the backend's layer: the ranks agree on every call's inputs, or
    each checks its own ("local")."""
    accumulate_grads: bool = False
    """Keep the weights' gradients between iterations (gradient accumulation over micro-batches:
    every backward but the first adds into existing `.grad`) instead of setting them to None."""
    precision: str = "bf16"
    """`MoKConfig.precision` of the backend's layer ("bf16" or "mxfp8"); the baseline is bf16."""
    graphs: str = "auto"
    """`MoKTuning.graphs` of the backend's layer: whether its calls replay their own CUDA graphs
    ("auto": small layers; "on"; "off")."""
    mx_weight_casts: str = "auto"
    """`MoKTuning.mx_weight_casts` of the backend's layer in MXFP8: "auto" casts the weights in
    every timed pass (a training step's cost; the timed passes run with gradients), "keep" once
    (the weights never change between iterations)."""
    recompute: str = "none"
    """`MoKTuning.recompute` of the backend's layer (bf16): "gate_up" makes the experts' h and
    pre-activations again in the backward instead of keeping them from the forward."""
    router_gradient: str = "saved_outputs"
    """`MoKConfig.router_gradient` of the backend's layer (bf16): "epilogue" forms the router
    weights' gradient in the down product's backward instead of keeping the pairs' outputs."""
    cuda_graph: bool = False
    """Time the backend's layer replayed from one CUDA graph per pass, captured on the timed
    inputs (it never synchronizes with the host, so it can be captured); the baseline, which
    reads its split sizes on the host, stays eager."""

    @property
    def tokens_per_rank(self) -> int:
        return self.tokens if self.tokens is not None else get_preset(self.preset).default_tokens

    def config(self) -> mok.MoKConfig:
        preset = get_preset(self.preset)
        tokens = max(self.tokens_per_rank, 1)
        pairs = None
        if self.pair_capacity_factor is not None:
            pairs = max(1, math.ceil(self.pair_capacity_factor * tokens * preset.top_k))
        clamp = {} if self.swiglu_limit is None else {"swiglu_limit": self.swiglu_limit}
        return preset.config(
            backend=self.backend,
            **clamp,
            max_tokens_per_rank=tokens,
            recv_pair_capacity=pairs,
            exact_buffers=self.exact_buffers,
            validation=self.validation,
            precision=self.precision,
            graphs=self.graphs,
            mx_weight_casts=self.mx_weight_casts,
            recompute=self.recompute,
            router_gradient=self.router_gradient,
        )


def estimated_peak_bytes(spec: BenchSpec) -> int:
    """A lower estimate of what one rank of `spec` holds at its peak on a GPU: the weights and
    their gradients (the benchmark keeps global weights for the check too), the per-pair
    tensors the backend keeps for its backward (rows, pre-activations, h, outputs: sized for the
    worst routing, EP x T x k pairs, unless `pair_capacity_factor` or `exact_buffers`), the
    token tensors and the NVLink exchange's symmetric buffer. For refusing a run that cannot fit
    before it starts; `benchmarks/peak_memory.py` measures."""
    config = spec.config()
    element = config.activation_dtype.itemsize
    local = config.local_experts(spec.ep)
    h, i = config.hidden_size, config.intermediate_size
    expert_weights = 3 * h * i * element
    shared = 3 * h * config.shared_intermediate_size * element
    weights = 2 * (local * expert_weights + shared) + config.num_experts * expert_weights
    tokens = spec.tokens_per_rank
    pairs = tokens * config.top_k
    if config.recv_pair_capacity is not None:
        pairs = min(config.recv_pair_capacity, spec.ep * pairs)
    elif not config.tuning.exact_buffers:
        pairs *= spec.ep
    per_pair = pairs * (2 * h + 3 * i) * element
    token_tensors = 6 * tokens * h * element
    symmetric = sum(mok.symmetric_buffer_bytes(config, spec.ep).values())
    return weights + per_pair + token_tensors + symmetric


@dataclasses.dataclass
class PassTiming:
    """One pass of one implementation: the median over iterations of the slowest rank's time."""

    ms: float
    ms_min: float
    """Fastest iteration of the slowest rank (with ms_max: the spread around the median)."""
    ms_max: float
    tflops: float
    """Per rank: the pass's GEMM FLOPs (`MoKConfig.forward_flops`, 3x with backward) / time."""
    floor_ratio: float | None
    """Time / compute floor (>= 1; 1 is the floor); None without a dense rate or without FLOPs."""
    peak_memory_gib: float
    """Of the rank that used the most."""

    @property
    def noisy(self) -> bool:
        """The iterations spread beyond NOISY_SPREAD (slowest / fastest)."""
        return self.ms_max > NOISY_SPREAD * self.ms_min


@dataclasses.dataclass
class Measurement:
    """One implementation at one spec: its check against the reference, then its timings."""

    name: str
    check_errors: dict[str, float]
    """Relative error against the reference backend per result; empty for the reference itself."""
    forward: PassTiming
    forward_backward: PassTiming

    def timing(self, pass_name: str) -> PassTiming:
        return self.forward if pass_name == "forward" else self.forward_backward


@dataclasses.dataclass
class BenchResult:
    """The backend and the baseline at one spec, on the same weights and inputs."""

    spec: BenchSpec
    memory_kind: str
    forward_floor_ms: float | None
    forward_backward_floor_ms: float | None
    backend: Measurement
    baseline: Measurement
    forward_speedup: float
    """Baseline time / backend time (> 1: the backend is faster)."""
    forward_backward_speedup: float

    def speedup(self, pass_name: str) -> float:
        return self.forward_speedup if pass_name == "forward" else self.forward_backward_speedup

    def noisy(self, pass_name: str) -> bool:
        """Either implementation's timing of the pass is noisy (so is the speedup)."""
        return any(m.timing(pass_name).noisy for m in (self.backend, self.baseline))

    @property
    def is_oracle(self) -> bool:
        """The backend timed is the reference, the oracle, not a fast path."""
        return self.backend.name.split()[0] == ORACLE

    def table(self) -> tuple[list[str], list[list[str]]]:
        """Column headers ("<pass>\n<implementation>") and rows (time, TFLOP/s per rank, time over
        the compute floor, peak memory per rank, speedup), each row led by its label."""
        columns, cells = [""], {label: [label] for label in TABLE_ROWS}
        for pass_name in PASSES:
            for measurement in (self.backend, self.baseline):
                timing = measurement.timing(pass_name)
                columns.append(f"{pass_name}\n{measurement.name}")
                cells["time"].append(f"{timing.ms:.3f} ms" + (NOISY_MARK if timing.noisy else ""))
                cells["min-max"].append(f"{timing.ms_min:.3g}-{timing.ms_max:.3g}")
                cells["TFLOP/s"].append(f"{timing.tflops:.2f}")
                cells["x floor"].append(_format_ratio(timing.floor_ratio))
                cells["peak memory"].append(f"{timing.peak_memory_gib:.2f} GiB")
                is_backend = measurement is self.backend
                speedup = f"{self.speedup(pass_name):.2f}x" + (
                    NOISY_MARK if self.noisy(pass_name) else ""
                )
                cells["speedup"].append(speedup if is_backend else "")
        return columns, list(cells.values())


TABLE_ROWS = ("time", "min-max", "TFLOP/s", "x floor", "peak memory", "speedup")
NOISY_MARK = " (noisy)"
NOISY_NOTE = (
    f"(noisy): the slowest iteration took over {NOISY_SPREAD:g}x the fastest, so the median is "
    "unreliable; rerun on a quiet machine or with more --iters"
)


def _format_ratio(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _rank_inputs(spec: BenchSpec, config: mok.MoKConfig, rank: int, tokens: int, device):
    """x [T, H] bf16, topk_idx, topk_weights of `rank`, identical wherever they are rebuilt."""
    generator = torch.Generator(device=device).manual_seed(spec.seed * 1000 + 1 + rank)
    x = torch.randn(tokens, config.hidden_size, generator=generator, device=device)
    idx, weights = make_routing(
        spec.routing, tokens, config.num_experts, config.top_k, generator, device
    )
    return x.to(config.activation_dtype), idx, weights


def _output_gradient(spec: BenchSpec, rank: int, tokens: int, config, device) -> torch.Tensor:
    """The gradient fed to backward on `rank`, identical wherever it is rebuilt."""
    generator = torch.Generator(device=device).manual_seed(spec.seed * 1000 + 500 + rank)
    shape = (tokens, config.hidden_size)
    return torch.randn(shape, generator=generator, device=device).to(config.activation_dtype)


def _check_against_reference(spec, config, layer, rank, ep, device) -> dict[str, float]:
    """Relative errors of `layer` against the reference backend on the same group and the same
    weights, on `spec.check_tokens` tokens per rank; none for the reference backend itself, the
    oracle (its tests check it against float64). The expert-parallel reference equals the
    single-process one (tests/test_gpu_reference.py, tests/test_ep_gloo.py) and holds only this
    rank's experts, so the check fits in memory for the largest presets."""
    if not isinstance(layer, BaselineMoE) and layer.workspace(device).backend_name == ORACLE:
        return {}
    tokens = min(spec.check_tokens, spec.tokens_per_rank)
    inputs = RankInputs(
        *_rank_inputs(spec, config, rank, tokens, device),
        _output_gradient(spec, rank, tokens, config, device),
    )
    reference = mok.MoE.sharing_weights_of(layer, config.replace(backend="reference"))
    expected = one_call_results(reference, inputs)
    graphs = None if isinstance(layer, BaselineMoE) else layer.workspace(device).graphs
    if graphs is None or not graphs.takes(tokens):
        # No copy of the layer's gradients beside the reference's: kimi-k2's weights alone fill
        # a quarter of an H200, and a third set of them did not fit.
        return one_call_errors(layer, inputs, expected)
    actual = one_call_results(layer, inputs)
    # The second call of a token count captures the layer's CUDA graphs (`MoKTuning.graphs`),
    # the third replays them: what the timed calls run must equal what was checked.
    for _ in range(2):
        again = one_call_results(layer, inputs)
        differ = [key for key, value in actual.items() if not torch.equal(again[key], value)]
        if differ:
            raise AssertionError(f"a layer call replayed from CUDA graphs differs in {differ}")
    return {key: relative_error(actual[key], value) for key, value in expected.items()}


def _tolerance(implementation: str, error_name: str, clamped: bool) -> float:
    if implementation == BASELINE and clamped and error_name.startswith("grad"):
        return BASELINE_CLAMPED_GRADIENT_TOLERANCE
    return CHECK_TOLERANCE.get(implementation, DEFAULT_CHECK_TOLERANCE)


class _Timer:
    """Wall time of a region: CUDA events on GPUs, the host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def ms(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        return (self.t1 - self.t0) * 1e3


def _max_over_ranks(values: list[float], group) -> list[float]:
    """Elementwise maximum over the ranks of equally long lists (to 1e-6)."""
    if group is None:
        return values
    scaled = (torch.tensor(values, dtype=torch.float64) * 1e6).round().to(torch.int64)
    return (all_gather_int64(scaled, group).max(0).values.double() / 1e6).tolist()


def _reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "CUDA allocated"
    # ru_maxrss is in KiB on Linux: the whole process since it started, so an upper bound on the
    # layer's memory that cannot be reset between passes.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "process RSS"


def _memory_outside_allocator_gib(layer, device: torch.device) -> float:
    """GiB of `layer`'s buffers that the peak above misses: the symmetric memory of its NVLink
    exchange, mapped outside PyTorch's caching allocator (none for the baseline)."""
    if isinstance(layer, BaselineMoE):
        return 0.0
    return layer.workspace(device).backend.memory_outside_allocator() / 2**30


def _graphed_pass(spec, layer, inputs, with_backward, name):
    """`replay` of a CUDA graph that runs one pass of `layer` on `inputs` (what is captured reads
    and writes the same tensors at every replay), after checking that a replay gives the eager
    pass's output and input gradients bit for bit (raises AssertionError otherwise)."""
    x, idx, weights, grad_y = inputs

    def one_pass():
        if not spec.accumulate_grads:
            layer.zero_grad(set_to_none=True)
        x.grad = weights.grad = None
        y = layer(x, idx, weights)
        if with_backward:
            y.backward(grad_y)
        return y

    def results(y):
        found = {"y": y}
        if with_backward:
            found.update({"grad x": x.grad, "grad topk_weights": weights.grad})
        return {key: value.detach().clone() for key, value in found.items()}

    eager = results(one_pass())
    graph, y = capture_in_graph(one_pass)
    graph.replay()
    replayed = results(y)
    differ = [key for key, value in eager.items() if not torch.equal(replayed[key], value)]
    if differ:
        raise AssertionError(f"{name}: a CUDA-graph replay differs from the eager pass in {differ}")
    return graph.replay


def _time_pass(spec, layer, inputs, with_backward, group, progress, label, graphed=False):
    """(median, min and max over iterations of the slowest rank's ms, peak memory GiB of the
    largest rank). `graphed`: each iteration replays a CUDA graph of the pass."""
    x, idx, weights, grad_y = inputs
    task = progress.add_task(label, total=spec.warmup + spec.iters) if progress else None
    _reset_peak_memory(x.device)
    replay = _graphed_pass(spec, layer, inputs, with_backward, label) if graphed else None
    times = []
    for it in range(spec.warmup + spec.iters):
        if group is not None:
            dist.barrier(group)
        if replay is not None:
            with _Timer(x.device) as timer:
                replay()
            elapsed = timer.ms()
        else:
            with _Timer(x.device) as timer:
                y = layer(x, idx, weights)
                if with_backward:
                    y.backward(grad_y)
            elapsed = timer.ms()
            del y  # so that the next forward's peak does not hold this one's graph
            if not spec.accumulate_grads:
                layer.zero_grad(set_to_none=True)
            x.grad = weights.grad = None
        if it >= spec.warmup:
            times.append(elapsed)
        if progress:
            progress.advance(task)
    slowest = _max_over_ranks(times, group)
    peak = _peak_memory(x.device)[0] + _memory_outside_allocator_gib(layer, x.device)
    peak = _max_over_ranks([peak], group)[0]
    return statistics.median(slowest), min(slowest), max(slowest), peak


def _measure(spec, config, layer, rank, ep, inputs, group, progress) -> Measurement:
    """Check `layer` against the reference (raising beyond tolerance), then time both passes."""
    device = inputs[0].device
    is_baseline = isinstance(layer, BaselineMoE)
    if progress:
        check_task = progress.add_task(f"check {BASELINE if is_baseline else 'backend'}", total=1)
    errors = _check_against_reference(spec, config, layer, rank, ep, device)
    if progress:
        progress.advance(check_task)
    name = BASELINE if is_baseline else layer.workspace(device).backend_name
    if not is_baseline and config.precision.value != "bf16":
        name = f"{name} {config.precision.value}"
    clamped = config.swiglu_limit is not None
    failed = {
        error_name: (error, _tolerance(name, error_name, clamped))
        for error_name, error in errors.items()
        if not error <= _tolerance(name, error_name, clamped)
    }
    if failed:
        raise AssertionError(
            f"rank {rank}: {name} differs from the reference backend beyond tolerance "
            f"(relative error, tolerance): {failed}"
        )
    graphed = spec.cuda_graph and not is_baseline
    if graphed:
        name = f"{name}, CUDA graph"
    flops = config.forward_flops(spec.tokens_per_rank)
    timings = {}
    for pass_name, with_backward in PASSES.items():
        ms, ms_min, ms_max, peak = _time_pass(
            spec, layer, inputs, with_backward, group, progress, f"{name} {pass_name}", graphed
        )
        pass_flops = 3 * flops if with_backward else flops
        floor_ms = _floor_ms(pass_flops, spec.dense_tflops)
        timings[pass_name] = PassTiming(
            ms=ms,
            ms_min=ms_min,
            ms_max=ms_max,
            tflops=pass_flops / ms / 1e9,
            floor_ratio=ms / floor_ms if floor_ms else None,
            peak_memory_gib=peak,
        )
    if not is_baseline:
        # What only the device saw (rows dropped for capacity, bad ids) must not pass unnoticed.
        layer.workspace(device).check()
    return Measurement(name, errors, timings["forward"], timings["forward+backward"])


def _floor_ms(flops: int, dense_tflops: float | None) -> float | None:
    return None if dense_tflops is None else flops / dense_tflops / 1e9


def _timing_inputs(spec, config, rank, device):
    """This rank's (x, topk_idx, topk_weights, grad_y) of the timed iterations."""
    x, idx, weights = _rank_inputs(spec, config, rank, spec.tokens_per_rank, device)
    grad_y = _output_gradient(spec, rank, spec.tokens_per_rank, config, device)
    return x.requires_grad_(True), idx, weights.requires_grad_(True), grad_y


def _bench_spec(spec: BenchSpec, rank, ep, device, group, progress) -> BenchResult:
    config = spec.config()
    torch.manual_seed(spec.seed)
    layer = mok.MoE(config, group=group, device=device)
    layer.load_global_weights(global_weights(config, spec.seed, device))
    inputs = _timing_inputs(spec, config, rank, device)
    measure_args = (rank, ep, inputs, group, progress)
    # The baseline is bf16 whatever the backend's precision: checked against the bf16 reference.
    baseline_config = config.replace(precision="bf16")
    baseline = _measure(spec, baseline_config, BaselineMoE.sharing_weights_of(layer), *measure_args)
    backend = _measure(spec, config, layer, *measure_args)
    flops = config.forward_flops(spec.tokens_per_rank)
    return BenchResult(
        spec=spec,
        memory_kind=_peak_memory(device)[1],
        forward_floor_ms=_floor_ms(flops, spec.dense_tflops),
        forward_backward_floor_ms=_floor_ms(3 * flops, spec.dense_tflops),
        backend=backend,
        baseline=baseline,
        forward_speedup=baseline.forward.ms / backend.forward.ms,
        forward_backward_speedup=baseline.forward_backward.ms / backend.forward_backward.ms,
    )


def bench_rank(rank: int, ep: int, specs: Sequence[BenchSpec]) -> list[BenchResult]:
    """One rank's part of the benchmark of `specs`, all at expert-parallel size `ep`; the process
    group (if ep > 1) is already initialized."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if specs[0].device == "cuda"
        else torch.device("cpu")
    )
    group = dist.group.WORLD if ep > 1 else None
    progress = None
    if specs[0].progress and rank == 0:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        progress = Progress(
            TextColumn("{task.description:>30}"), BarColumn(), MofNCompleteColumn(), transient=True
        )
        progress.start()
    try:
        return [_bench_spec(spec, rank, ep, device, group, progress) for spec in specs]
    finally:
        if progress:
            progress.stop()


def _torchrun_world() -> tuple[int, int] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def run_bench(specs: Sequence[BenchSpec]) -> list[BenchResult]:
    """Run the benchmark of every spec: under an existing torchrun job, in this process for ep=1 on
    the CPU, or by spawning ep ranks (gloo on the CPU, NCCL with one GPU per rank; also for ep=1,
    so that each size starts with all of the GPU's memory free), once per expert-parallel size.
    Returns rank 0's results, in the order of `specs`."""
    torchrun = _torchrun_world()
    for spec in specs:
        if spec.device == "cuda" and torch.cuda.device_count() < spec.ep:
            raise ValueError(
                f"ep={spec.ep} needs {spec.ep} GPUs, this machine has {torch.cuda.device_count()}"
            )
        if torchrun is not None and torchrun[1] != spec.ep:
            raise ValueError(f"torchrun started {torchrun[1]} ranks but --ep is {spec.ep}")
    indices_by_ep: dict[int, list[int]] = {}
    for index, spec in enumerate(specs):
        indices_by_ep.setdefault(spec.ep, []).append(index)
    results: list[BenchResult | None] = [None] * len(specs)
    for ep, indices in indices_by_ep.items():
        same_ep = [specs[i] for i in indices]
        backend = "nccl" if same_ep[0].device == "cuda" else "gloo"
        if torchrun is not None:
            if not dist.is_initialized():
                init_from_env(backend)
            done = bench_rank(torchrun[0], ep, same_ep)
        elif ep == 1 and same_ep[0].device == "cpu":
            done = bench_rank(0, 1, same_ep)
        else:
            done = run_ranks(bench_rank, ep, args=(same_ep,), backend=backend)[0]
        for index, result in zip(indices, done, strict=True):
            results[index] = result
    return results


# ------------------------------------------------------------------------------------------------
# Reports
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReportHeader:
    """Where, when and how results were measured: stamped on every report."""

    date: str
    commit: str
    machine: str
    torch: str
    device: str
    dense_tflops: float | None
    command: str
    settings: dict[str, str] = dataclasses.field(default_factory=dict)
    """The environment variables of `mok.env.SETTINGS` that were set (which kernels ran)."""


def report_header(device: str, dense_tflops: float | None, command: str) -> ReportHeader:
    from mok.env import SETTINGS

    now = datetime.datetime.now(datetime.timezone.utc)
    return ReportHeader(
        date=now.strftime("%Y-%m-%d %H:%M UTC"),
        commit=git_commit(),
        machine=_machine(device),
        torch=torch.__version__,
        device=device,
        dense_tflops=dense_tflops,
        command=command,
        settings={name: os.environ[name] for name in SETTINGS if name in os.environ},
    )


def git_commit() -> str:
    """The commit results are recorded under: $MOK_COMMIT when set (a copy of the tree without its
    git history, e.g. on a remote GPU machine), else `git rev-parse --short HEAD` of the checkout
    mok runs from with "+modified" where tracked files differ from it (a copied tree over a stale
    history would otherwise pass for that older commit), else "unknown"."""
    if os.environ.get("MOK_COMMIT"):
        return os.environ["MOK_COMMIT"]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args],
                cwd=Path(__file__).resolve().parent,
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown"
    return commit + ("+modified" if git("status", "--porcelain", "--untracked-files=no") else "")


def _machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores), {platform.platform()}"


def json_report(header: ReportHeader, results: Sequence[BenchResult]) -> dict:
    """The header's fields and "results": one `BenchResult` as a dict per spec."""
    return {
        **dataclasses.asdict(header),
        "results": [dataclasses.asdict(result) for result in results],
    }


def markdown_report(header: ReportHeader, results: Sequence[BenchResult]) -> str:
    """A markdown page: the header, the method, one table row per spec and pass."""
    lines = [
        "# mok bench: backend vs the standard PyTorch path",
        "",
        f"- Date: {header.date}; commit `{header.commit}`; machine: {header.machine}; "
        f"torch {header.torch}",
        f"- Command: `{header.command}`"
        + "".join(f"; {name}={value}" for name, value in header.settings.items()),
        _method_line(header, results),
        "- Baseline: `mok.baseline` (counts exchanged and split sizes copied to the host, rows "
        "permuted by gathers, `all_to_all_single`, `torch._grouped_mm` experts, SwiGLU in "
        "PyTorch, batched-matmul combine; autograd backward).",
        "",
        "| preset | ep | tokens/rank | pass | backend | time ms backend / baseline (min-max) "
        "| speedup "
        "| TFLOP/s backend / baseline | x floor backend / baseline "
        "| peak GiB backend / baseline | max check error backend / baseline |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    if any(result.is_oracle for result in results):
        lines[2:2] = [f"- Note: {REFERENCE_NOTE}"]
    if any(result.noisy(pass_name) for result in results for pass_name in PASSES):
        lines[2:2] = [f"- {NOISY_NOTE}."]
    for result in results:
        lines.extend(_markdown_rows(result))
    return "\n".join(lines) + "\n"


def _method_line(header: ReportHeader, results: Sequence[BenchResult]) -> str:
    """The report's method: how the runs were timed and which options they had."""
    first = results[0].spec
    floor = (
        f"compute floor = FLOPs / {header.dense_tflops:g} TFLOP/s (dense bf16, `--dense-tflops`), "
        "x floor = time / floor"
        if header.dense_tflops is not None
        else "no compute floor (no `--dense-tflops` given)"
    )
    return (
        f"- Method: {first.routing} routing; median over {first.iters} iterations (after "
        f"{first.warmup} warm-up) of the slowest rank's time; TFLOP/s per rank from "
        "2·T·k·3·H·I (+ 2·T·3·H·I_shared), forward+backward 3x; "
        f"{floor}; speedup = baseline time / backend time; peak memory of the largest rank "
        f"({results[0].memory_kind}, plus the symmetric memory of the backend's NVLink "
        "exchange, which the allocator does not count); the backend's receive buffers sized "
        + (
            "by the pairs each call received, read on the host (`--exact-buffers`)"
            if first.exact_buffers
            else "for the worst-case routing"
            if first.pair_capacity_factor is None
            else f"for {first.pair_capacity_factor:g} x the mean pairs per rank "
            "(`--pair-capacity-factor`; overflow raises)"
        )
        + (
            "; weight gradients accumulate across iterations (`--accumulate-grads`)"
            if first.accumulate_grads
            else "; weight gradients set to None between iterations"
        )
        + f"; the backend's input validation {first.validation} (`--validation`)"
        + f"; the backend's own CUDA graphs {first.graphs} (`--graphs`)"
        + (
            f"; MXFP8 weights' casts {first.mx_weight_casts} (`--mx-weight-casts`)"
            if any(result.spec.precision == "mxfp8" for result in results)
            else ""
        )
        + (
            f"; the bf16 experts' activations made again in the backward (`--recompute "
            f"{first.recompute}`)"
            if first.recompute != "none"
            else ""
        )
        + (
            "; the router weights' gradient formed in the down product's backward, no pair "
            f"outputs kept (`--router-gradient {first.router_gradient}`)"
            if first.router_gradient != "saved_outputs"
            else ""
        )
        + (
            "; the backend's passes replayed from CUDA graphs captured on the timed inputs "
            "(`--cuda-graph`; the baseline eager)"
            if first.cuda_graph
            else ""
        )
        + ". Both checked against the reference backend (same group and weights) first."
    )


def _markdown_rows(result: BenchResult) -> list[str]:
    """One table row per pass of one run."""
    rows = []
    ours, base = result.backend, result.baseline
    errors = " / ".join(
        f"{max(m.check_errors.values()):.1e}" if m.check_errors else "oracle" for m in (ours, base)
    )
    for pass_name in PASSES:
        mine, theirs = ours.timing(pass_name), base.timing(pass_name)
        mine_mark, theirs_mark = (NOISY_MARK if t.noisy else "" for t in (mine, theirs))
        cells = [
            result.spec.preset,
            str(result.spec.ep),
            str(result.spec.tokens_per_rank),
            pass_name,
            ours.name,
            f"{mine.ms:.3f} ({mine.ms_min:.3f}-{mine.ms_max:.3f}){mine_mark} / "
            f"{theirs.ms:.3f} ({theirs.ms_min:.3f}-{theirs.ms_max:.3f}){theirs_mark}",
            f"{result.speedup(pass_name):.2f}x" + (NOISY_MARK if result.noisy(pass_name) else ""),
            f"{mine.tflops:.1f} / {theirs.tflops:.1f}",
            f"{_format_ratio(mine.floor_ratio)} / {_format_ratio(theirs.floor_ratio)}",
            f"{mine.peak_memory_gib:.2f} / {theirs.peak_memory_gib:.2f}",
            errors,
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


IMPLEMENTATION_COLOURS = {"backend": "tab:blue", "baseline": "tab:orange"}
PASS_HATCHES = {"forward": "", "forward+backward": "//"}
REFERENCE_NOTE = (
    "The backend here is `reference`, the plain-PyTorch oracle that every fast backend is checked "
    "against: it is built for exactness, not speed. The fast backends need a GPU."
)


def report_figure(header: ReportHeader, results: Sequence[BenchResult]):
    """The report's figure: speedup per preset and EP size (top), then one panel per preset and
    EP size with the four times (backend and baseline, forward and forward+backward: the
    median, min-max whiskers, the value on each bar), all on linear axes from 0. Colour tells the
    implementation, hatching the pass, in both rows."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    backend_names = {r.backend.name for r in results}
    backend_name = backend_names.pop() if len(backend_names) == 1 else "mok"
    names = {"backend": backend_name, "baseline": results[0].baseline.name}
    labels = [
        f"{r.spec.preset}\nep={r.spec.ep}, T={r.spec.tokens_per_rank}"
        + ("" if r.spec.precision == "bf16" else f", {r.spec.precision}")
        for r in results
    ]
    count = len(results)
    figure = Figure(figsize=(max(7.0, 2.6 * count), 9.0), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(2, count, height_ratios=[1.0, 1.1])
    speed_axes = figure.add_subplot(grid[0, :])

    width = 0.38
    for offset, pass_name in ((-width / 2, "forward"), (width / 2, "forward+backward")):
        bars = speed_axes.bar(
            [p + offset for p in range(count)],
            [r.speedup(pass_name) for r in results],
            width,
            color=IMPLEMENTATION_COLOURS["backend"],
            hatch=PASS_HATCHES[pass_name],
            edgecolor="white",
        )
        speed_axes.bar_label(bars, fmt="%.2fx", fontsize=8)
    speed_axes.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    speed_axes.set_xticks(list(range(count)), labels, fontsize=8)
    speed_axes.set_xlim(-0.75, count - 0.25)
    speed_axes.set_ylabel("baseline time / backend time\n(above the dashed line: faster)")
    speed_axes.set_title(
        f"speedup of the {backend_name} backend over the PyTorch baseline", fontsize=10
    )
    speed_axes.legend(
        handles=[
            Patch(facecolor=IMPLEMENTATION_COLOURS["backend"], hatch=h, edgecolor="white", label=p)
            for p, h in PASS_HATCHES.items()
        ],
        fontsize=7,
    )

    series = [(which, pass_name) for pass_name in PASS_HATCHES for which in ("backend", "baseline")]
    for index, (result, label) in enumerate(zip(results, labels, strict=True)):
        axes = figure.add_subplot(grid[1, index])
        timings = [getattr(result, which).timing(pass_name) for which, pass_name in series]
        medians = [t.ms for t in timings]
        whiskers = [[t.ms - t.ms_min for t in timings], [t.ms_max - t.ms for t in timings]]
        bars = axes.bar(
            range(len(series)),
            medians,
            yerr=whiskers,
            capsize=3,
            color=[IMPLEMENTATION_COLOURS[which] for which, _ in series],
            edgecolor="white",
        )
        for bar, (_, pass_name) in zip(bars, series, strict=True):
            bar.set_hatch(PASS_HATCHES[pass_name])
        axes.bar_label(bars, fmt="%.3g", fontsize=7, padding=2)
        axes.set_ylim(0, max(t.ms_max for t in timings) * 1.25)
        axes.set_xticks([])
        axes.set_title(label, fontsize=8)
        if index == 0:
            axes.set_ylabel("time per call, ms\n(median, min-max of the slowest rank)")
    figure.legend(
        handles=[
            Patch(
                facecolor=IMPLEMENTATION_COLOURS[which],
                hatch=PASS_HATCHES[p],
                edgecolor="white",
                label=f"{names[which]} {p}",
            )
            for which, p in series
        ],
        loc="outside lower center",
        ncols=4,
        fontsize=7,
    )
    width_chars = int(figure.get_figwidth() * 12)
    note = "\n" + textwrap.fill(REFERENCE_NOTE, width_chars) if backend_name == "reference" else ""
    figure.suptitle(
        f"mok bench: {header.date}, commit {header.commit}\n{header.machine}{note}", fontsize=9
    )
    return figure


def plot_report(header: ReportHeader, results: Sequence[BenchResult], path: Path) -> None:
    """Write `report_figure` as a PNG."""
    report_figure(header, results).savefig(path, dpi=120)


REPORT_NAME = "mok-bench"


def write_report(out_dir: Path, header: ReportHeader, results: Sequence[BenchResult]) -> list[Path]:
    """Write REPORT_NAME.json, .md and, when matplotlib is installed, .png into out_dir (created
    if missing); returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = out_dir / f"{REPORT_NAME}.json", out_dir / f"{REPORT_NAME}.md"
    json_path.write_text(json.dumps(json_report(header, results), indent=2) + "\n")
    markdown_path.write_text(markdown_report(header, results))
    written = [json_path, markdown_path]
    if matplotlib_available():
        plot_report(header, results, out_dir / f"{REPORT_NAME}.png")
        written.append(out_dir / f"{REPORT_NAME}.png")
    return written


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None
