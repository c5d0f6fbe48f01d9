"""Where the time of one MoE layer call goes: host time, GPU time, and the CUDA kernels by kernel.

    python benchmarks/profile_layer.py [--preset deepseek-v3] [--backend triton] [--tokens N]
                                       [--trace DIR] [--accumulate-grads] [--overlap]
                                       [--precision bf16|mxfp8|fp8_block]

Spawns one rank per GPU (EP = the GPU count), warms up, then on every rank: the host time of the
forward and of the backward call (the time Python takes to enqueue them, median of 5), the GPU
time of forward and of forward + backward (CUDA events, median of 5), and one profiled forward +
backward (torch.profiler). Prints each rank's times and rank 0's kernels sorted by total CUDA
time. With --trace, writes each rank's Chrome trace (CPU and CUDA) to DIR/rank<r>.json.gz (open
it in Perfetto: the GPU's idle gaps, the barriers, the fused backend's two streams side by side).
If the host time of a pass is close to its GPU time, the pass is bound by the host's launches.
With --accumulate-grads the weights' gradients are kept between calls (every backward adds into
them, as in gradient accumulation over micro-batches) instead of being set to None. --overlap
runs the fused backend's overlapped schedule also at EP 1 (`FusedBackend.overlap`). --precision:
the layer's (`MoKConfig.precision`); its weights' casts are kept across calls (`mx_weight_casts=
"keep"`), so that the profile shows one pass's kernels, not the casts of an optimizer step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import mok
from mok.ranks import run_ranks
from mok.routing import make_routing
from mok.testing import global_weights

REPEATS = 5


def profile_rank(
    rank, world, preset_name, backend, tokens, rows, trace_dir, accumulate, overlap, precision
):
    device = torch.device("cuda", rank)
    preset = mok.get_preset(preset_name)
    tokens = tokens or preset.default_tokens
    config = preset.config(backend=backend, max_tokens_per_rank=tokens, precision=precision)
    if precision != "bf16":
        config = config.replace(mx_weight_casts="keep")
    group = dist.group.WORLD if world > 1 else None
    layer = mok.MoE(config, group=group, device=device)
    layer.load_global_weights(global_weights(config, 0, device))
    if overlap:
        layer.workspace(device).backend.overlap = True
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, config.hidden_size, generator=generator).to(device, torch.bfloat16)
    idx, w = make_routing("uniform", tokens, config.num_experts, config.top_k, generator)
    idx, w = idx.to(device), w.to(device)
    grad_y = torch.randn_like(x)

    def forward():
        if not accumulate:
            layer.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_(True)
        ww = w.detach().requires_grad_(True)
        return layer(xx, idx, ww)

    def step():
        forward().backward(grad_y)

    for _ in range(3):
        step()
    torch.cuda.synchronize()

    host = {"forward": [], "backward": []}
    gpu = {"forward": [], "forward+backward": []}
    for _ in range(REPEATS):
        if group is not None:
            dist.barrier()
        torch.cuda.synchronize()
        start, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        t0 = time.perf_counter()
        y = forward()
        t1 = time.perf_counter()
        middle.record()
        t2 = time.perf_counter()
        y.backward(grad_y)
        t3 = time.perf_counter()
        end.record()
        end.synchronize()
        host["forward"].append((t1 - t0) * 1e3)
        host["backward"].append((t3 - t2) * 1e3)
        gpu["forward"].append(start.elapsed_time(middle))
        gpu["forward+backward"].append(start.elapsed_time(end))
    times = {f"host {k}": statistics.median(v) for k, v in host.items()}
    times.update({f"gpu {k}": statistics.median(v) for k, v in gpu.items()})

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace_dir else [])
    if group is not None:
        dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace_dir, f"rank{rank}.json.gz"))
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)
    return times, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--trace", metavar="DIR", help="write each rank's Chrome trace here")
    parser.add_argument("--accumulate-grads", action="store_true")
    parser.add_argument("--overlap", action="store_true", help="fused: the overlap at EP 1")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "mxfp8", "fp8_block"])
    args = parser.parse_args()
    world = torch.cuda.device_count()
    results = run_ranks(
        profile_rank,
        world,
        args=(
            args.preset,
            args.backend,
            args.tokens,
            args.rows,
            args.trace,
            args.accumulate_grads,
            args.overlap,
            args.precision,
        ),
        backend="nccl",
    )
    accumulate = ", gradients accumulated" if args.accumulate_grads else ""
    print(f"{args.preset}, backend {args.backend}, {args.precision}, EP {world}{accumulate}")
    for rank, (times, _) in enumerate(results):
        print(f"rank {rank}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()))
    print("rank 0's kernels:")
    print(results[0][1])


if __name__ == "__main__":
    main()
