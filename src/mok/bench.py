"""`mok bench`: time the layer forward and forward+backward at a chosen expert-parallel size.

Every rank builds the same global weights and every rank's inputs from seeded generators, so that
each rank can check its expert-parallel results against the single-process reference on the inputs
of all ranks before anything is timed. Times are per iteration the slowest rank's, then the median
over iterations.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

import mok
from mok.distributed import all_gather_int64
from mok.launch import init_from_env, run_ranks
from mok.presets import get_preset
from mok.routing import make_routing
from mok.testing import RankInputs, compare_with_reference, global_weights

# Relative Frobenius error allowed between the backend and the single-process reference.
# The reference computes in fp32; bf16 outputs round at ~4e-3 relative per element.
CHECK_TOLERANCE = {"reference": 1e-2}
DEFAULT_CHECK_TOLERANCE = 2e-2


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
    seed: int = 0
    progress: bool = True

    @property
    def tokens_per_rank(self) -> int:
        return self.tokens if self.tokens is not None else get_preset(self.preset).default_tokens

    def config(self) -> mok.MoKConfig:
        return get_preset(self.preset).config(
            backend=self.backend,
            swiglu_limit=self.swiglu_limit,
            max_tokens_per_rank=max(self.tokens_per_rank, 1),
        )


@dataclasses.dataclass
class BenchResult:
    spec: BenchSpec
    backend: str
    check_errors: dict[str, float]
    forward_ms: float
    forward_backward_ms: float
    forward_tflops: float
    forward_backward_tflops: float
    peak_memory_gib: float
    memory_kind: str

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(pass, time, TFLOP/s, peak memory) table rows."""
        memory = f"{self.peak_memory_gib:.2f} GiB ({self.memory_kind})"
        return [
            ("forward", f"{self.forward_ms:.3f} ms", f"{self.forward_tflops:.2f}", memory),
            (
                "forward+backward",
                f"{self.forward_backward_ms:.3f} ms",
                f"{self.forward_backward_tflops:.2f}",
                memory,
            ),
        ]


def _rank_inputs(spec: BenchSpec, config: mok.MoKConfig, rank: int, tokens: int, device):
    """x [T, H] bf16, topk_idx, topk_weights of `rank`, identical wherever they are rebuilt."""
    generator = torch.Generator(device=device).manual_seed(spec.seed * 1000 + 1 + rank)
    x = torch.randn(tokens, config.hidden_size, generator=generator, device=device)
    idx, weights = make_routing(
        spec.routing, tokens, config.num_experts, config.top_k, generator, device
    )
    return x.to(torch.bfloat16), idx, weights


def _output_gradient(spec: BenchSpec, rank: int, tokens: int, config, device) -> torch.Tensor:
    """The gradient fed to backward on `rank`, identical wherever it is rebuilt."""
    generator = torch.Generator(device=device).manual_seed(spec.seed * 1000 + 500 + rank)
    shape = (tokens, config.hidden_size)
    return torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)


def _check_against_reference(spec, config, layer, rank, ep, device) -> dict[str, float]:
    """Relative errors against the single-process reference (`spec.check_tokens` per rank)."""
    tokens = min(spec.check_tokens, spec.tokens_per_rank)
    everyone = [
        RankInputs(
            *_rank_inputs(spec, config, r, tokens, device),
            _output_gradient(spec, r, tokens, config, device),
        )
        for r in range(ep)
    ]
    return compare_with_reference(layer, global_weights(config, spec.seed, device), everyone, rank)


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


def _time_passes(spec, config, layer, rank, device, group, progress) -> tuple[float, float]:
    """Median over iterations of the slowest rank's time: (forward ms, forward+backward ms)."""
    x, idx, weights = _rank_inputs(spec, config, rank, spec.tokens_per_rank, device)
    x.requires_grad_(True)
    weights.requires_grad_(True)
    grad_y = _output_gradient(spec, rank, spec.tokens_per_rank, config, device)
    medians = []
    for name, with_backward in (("forward", False), ("forward+backward", True)):
        task = progress.add_task(name, total=spec.warmup + spec.iters) if progress else None
        times = []
        for it in range(spec.warmup + spec.iters):
            if group is not None:
                dist.barrier(group)
            with _Timer(device) as timer:
                y = layer(x, idx, weights)
                if with_backward:
                    y.backward(grad_y)
            elapsed = timer.ms()
            layer.zero_grad(set_to_none=True)
            x.grad = weights.grad = None
            if it >= spec.warmup:
                times.append(elapsed)
            if progress:
                progress.advance(task)
        slowest = torch.tensor(times, dtype=torch.float64)
        if group is not None:
            gathered = all_gather_int64((slowest * 1e6).round().to(torch.int64), group)
            slowest = gathered.max(0).values.double() / 1e6
        medians.append(statistics.median(slowest.tolist()))
    return medians[0], medians[1]


def _peak_memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "CUDA allocated"
    # ru_maxrss is in KiB on Linux: the whole process, so an upper bound on the layer's memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "process RSS"


def bench_rank(rank: int, ep: int, spec: BenchSpec) -> BenchResult:
    """One rank's part of the benchmark; the process group (if ep > 1) is already initialized."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if spec.device == "cuda"
        else (torch.device("cpu"))
    )
    group = dist.group.WORLD if ep > 1 else None
    config = spec.config()
    torch.manual_seed(spec.seed)
    layer = mok.MoE(config, group=group, device=device)
    layer.load_global_weights(global_weights(config, spec.seed, device))

    progress = None
    if spec.progress and rank == 0:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        progress = Progress(
            TextColumn("{task.description:>18}"), BarColumn(), MofNCompleteColumn(), transient=True
        )
        progress.start()
    try:
        if progress:
            check_task = progress.add_task("check", total=1)
        errors = _check_against_reference(spec, config, layer, rank, ep, device)
        if progress:
            progress.advance(check_task)
        backend = layer.workspace(device).backend_name
        tolerance = CHECK_TOLERANCE.get(backend, DEFAULT_CHECK_TOLERANCE)
        failed = {name: err for name, err in errors.items() if not err <= tolerance}
        if failed:
            raise AssertionError(
                f"rank {rank}: {backend} differs from the single-process reference beyond "
                f"{tolerance:g} (relative error): {failed}"
            )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        fwd_ms, fwd_bwd_ms = _time_passes(spec, config, layer, rank, device, group, progress)
    finally:
        if progress:
            progress.stop()
    peak, memory_kind = _peak_memory(device)
    if group is not None:
        peaks = all_gather_int64(torch.tensor([round(peak * 2**20)]), group)
        peak = peaks.max().item() / 2**20
    flops = config.forward_flops(spec.tokens_per_rank)
    return BenchResult(
        spec=spec,
        backend=backend,
        check_errors=errors,
        forward_ms=fwd_ms,
        forward_backward_ms=fwd_bwd_ms,
        forward_tflops=flops / fwd_ms / 1e9,
        forward_backward_tflops=3 * flops / fwd_bwd_ms / 1e9,
        peak_memory_gib=peak,
        memory_kind=memory_kind,
    )


def _torchrun_world() -> tuple[int, int] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def run_bench(spec: BenchSpec) -> BenchResult:
    """Run the benchmark: in this process for ep=1, under an existing torchrun job, or by spawning
    `spec.ep` ranks (gloo on the CPU, NCCL with one GPU per rank). Returns rank 0's result."""
    if spec.device == "cuda" and torch.cuda.device_count() < spec.ep:
        raise ValueError(
            f"ep={spec.ep} needs {spec.ep} GPUs, this machine has {torch.cuda.device_count()}"
        )
    backend = "nccl" if spec.device == "cuda" else "gloo"
    torchrun = _torchrun_world()
    if torchrun is not None:
        rank, world = torchrun
        if world != spec.ep:
            raise ValueError(f"torchrun started {world} ranks but --ep is {spec.ep}")
        if not dist.is_initialized():
            init_from_env(backend)
        return bench_rank(rank, world, spec)
    if spec.ep == 1:
        if spec.device == "cuda":
            torch.cuda.set_device(0)
        return bench_rank(0, 1, spec)
    return run_ranks(bench_rank, spec.ep, args=(spec,), backend=backend)[0]
