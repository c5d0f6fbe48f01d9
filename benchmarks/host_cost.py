"""Host cost per layer call in a many-layer model, by validation mode: does the GPU ever wait for
the host?

    PYTHONPATH=src python3 benchmarks/host_cost.py [--preset tiny] [--layers 24] [--tokens 4096]
                                                   [--ep 2] [--validations collective,local]
                                                   [--compiled] [--graphed]

A stack of --layers blocks, each x + MoE(proj(x)) with a softmax-over-top-k router (the shape of an
MoE transformer without attention), runs forward+backward steps on one rank per GPU (or gloo ranks
on the CPU with --ep). Per validation mode: the host time to enqueue a step's forward and backward
(perf_counter around the Python calls) divided by the layers, and the step's time on the device
(CUDA events; wall time on the CPU). When the host time per step is close to the device time, the
step is bound by the host's launches and checks; when it is far below, the host runs ahead and the
GPU never waits for it. Median over --steps after --warmup. --compiled adds, per validation mode,
the same stack under `torch.compile(mode="reduce-overhead")` (GPUs): CUDA graphs replay the
blocks' other operations and the layer's ops run between them (their host time stays; the
others' goes). --graphed adds the whole eager step captured in one CUDA graph (GPUs): a replay
is all the host does (the layer's checks ran at capture, not in a replay).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import mok
from mok.launch import run_ranks
from mok.testing import global_weights


class Block(nn.Module):
    def __init__(self, config: mok.MoKConfig, group, device):
        super().__init__()
        hidden = config.hidden_size
        self.proj = nn.Linear(hidden, hidden, device=device, dtype=torch.bfloat16)
        self.router = nn.Linear(hidden, config.num_experts, device=device, dtype=torch.bfloat16)
        self.moe = mok.MoE(config, group=group, device=device)
        self.top_k = config.top_k

    def forward(self, x):
        h = self.proj(x)
        values, idx = self.router(h).float().topk(self.top_k, dim=-1)
        return x + self.moe(h, idx, values.softmax(-1))


def measure(rank: int, world: int, args) -> dict:
    cuda = torch.cuda.is_available() and args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    group = dist.group.WORLD if world > 1 else None
    results = {}
    for validation in args.validations.split(","):
        config = mok.get_preset(args.preset).config(
            validation=validation, max_tokens_per_rank=args.tokens
        )
        if args.graphed and cuda:
            # A stack of its own: autograd nodes kept alive from eager or compiled steps (the
            # CUDA-graph trees keep their last outputs) were made on another stream than the
            # capture's, and a capture cannot wait on them.
            x, grad, graphed = stack(config, group, device, args)
            results[f"{validation}, one graph"] = graphed_steps(graphed, x, grad, args)
            del graphed
        x, grad, blocks = stack(config, group, device, args)
        results[validation] = steps(blocks, x, grad, args, cuda, group, device)
        if args.compiled and cuda:
            # The eager steps above made every layer's workspace, which compiling needs.
            compiled = torch.compile(blocks, mode="reduce-overhead", dynamic=False)
            warmed = argparse.Namespace(**{**vars(args), "warmup": max(args.warmup, 3)})
            results[f"{validation}, compiled"] = steps(
                compiled, x, grad, warmed, cuda, group, device, mark_steps=True
            )
    return results


def stack(config, group, device, args) -> tuple:
    """(x, the gradient of the output, --layers blocks of `config`), seeded the same each time."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*(Block(config, group, device) for _ in range(args.layers)))
    for block in blocks:
        block.moe.load_global_weights(global_weights(config, 0, device))
    x = torch.randn(args.tokens, config.hidden_size, device=device, dtype=torch.bfloat16)
    return x, torch.randn_like(x), blocks


def graphed_steps(blocks, x, grad, args) -> dict:
    """`steps`'s figures for the step captured in one CUDA graph: host time = one replay's."""
    from mok.testing import capture_in_graph

    for param in blocks.parameters():
        param.grad = torch.zeros_like(param)
    x = x.detach().clone().requires_grad_(True)

    def step():
        for param in blocks.parameters():
            param.grad.zero_()
        x.grad = None
        blocks(x).backward(grad)

    graph, _ = capture_in_graph(step)
    host, device = [], []
    for it in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        wall = time.perf_counter()
        graph.replay()
        enqueued = time.perf_counter()
        end.record()
        end.synchronize()
        if it >= args.warmup:
            host.append((enqueued - wall) * 1e3)
            device.append(start.elapsed_time(end))
    blocks.zero_grad(set_to_none=True)
    return {
        "host ms per layer": statistics.median(host) / args.layers,
        "host ms per step": statistics.median(host),
        "device ms per step": statistics.median(device),
    }


def steps(blocks, x, grad, args, cuda, group, device, mark_steps=False) -> dict:
    """Host and device time of --warmup + --steps forward+backward steps of `blocks`.
    mark_steps: tell CUDA-graph trees where each step begins (compiled stacks)."""
    host, step = [], []
    for it in range(args.warmup + args.steps):
        if mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        if group is not None:
            dist.barrier(group)
        if cuda:
            torch.cuda.synchronize(device)
            start, end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            start.record()
        wall = time.perf_counter()
        y = blocks(x.requires_grad_(True))
        y.backward(grad)
        enqueued = time.perf_counter()
        if cuda:
            end.record()
            end.synchronize()
            device_ms = start.elapsed_time(end)
        else:
            device_ms = (time.perf_counter() - wall) * 1e3
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        if it >= args.warmup:
            host.append((enqueued - wall) * 1e3)
            step.append(device_ms)
    return {
        "host ms per layer": statistics.median(host) / args.layers,
        "host ms per step": statistics.median(host),
        "device ms per step": statistics.median(step),
    }


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=4096 if cuda else 64)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--validations", default="collective,local")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--graphed", action="store_true")
    args = parser.parse_args(argv)
    if args.ep > 1:
        backend = "nccl" if args.device == "cuda" else "gloo"
        results = run_ranks(measure, args.ep, args=(args,), backend=backend)[0]
    else:
        results = measure(0, 1, args)
    print(
        f"{args.preset}, {args.layers} layers, {args.tokens} tokens a rank, EP {args.ep}, "
        f"{args.device} (rank 0, median of {args.steps} steps)"
    )
    print(
        "| validation | host ms per layer | host ms per step | device ms per step | host / device |"
    )
    print("| --- | --- | --- | --- | --- |")
    for validation, r in results.items():
        ratio = r["host ms per step"] / r["device ms per step"]
        print(
            f"| {validation} | {r['host ms per layer']:.3f} | {r['host ms per step']:.2f} | "
            f"{r['device ms per step']:.2f} | {ratio:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
