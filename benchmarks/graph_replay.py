"""The triton backend's layer eager vs captured in a CUDA graph: how much of its time is the host's.

    python benchmarks/graph_replay.py [--presets qwen3-30b-a3b,deepseek-v3] [--iters 10] [--out F]

One rank per GPU (EP = the GPU count). Per preset, at its default tokens per rank and uniform
routing: the forward (inputs requiring grad, as in training) and the forward + backward, each run
eagerly and replayed from a CUDA graph captured once; the replay's y and gradients are first
checked bit for bit against the eager call on the same inputs. Times: CUDA events around each
call after a barrier, median over iterations of the slowest rank. The eager time includes what
the host adds (launches, the ranks' input agreement); the replay is the GPU's work alone, what a
training step captured in a CUDA graph would see. The baseline cannot be captured (it reads split
sizes on the host).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import mok
from mok.launch import run_ranks
from mok.routing import make_routing
from mok.testing import capture_in_graph, global_weights


def _inputs(config, tokens, rank, device):
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, config.hidden_size, generator=generator).to(device, torch.bfloat16)
    idx, w = make_routing("uniform", tokens, config.num_experts, config.top_k, generator)
    grad_y = torch.randn(tokens, config.hidden_size, generator=generator).to(device, torch.bfloat16)
    return x.requires_grad_(True), idx.to(device), w.to(device).requires_grad_(True), grad_y


def _median_ms(call, iters, warmup, group):
    times = []
    for it in range(warmup + iters):
        if group is not None:
            dist.barrier(group)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        if it >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _step(layer, x, idx, w, grad_y, backward):
    """One call of the layer as a training step makes it (fresh gradients)."""

    def call():
        layer.zero_grad(set_to_none=True)
        x.grad = w.grad = None
        y = layer(x, idx, w)
        if backward:
            y.backward(grad_y)
        return y

    return call


def _measure_preset(name, rank, device, group, iters, warmup):
    preset = mok.get_preset(name)
    config = preset.config(backend="triton", max_tokens_per_rank=preset.default_tokens)
    layer = mok.MoE(config, group=group, device=device)
    layer.load_global_weights(global_weights(config, 0, device))
    x, idx, w, grad_y = _inputs(config, preset.default_tokens, rank, device)
    row = {"preset": name, "tokens": preset.default_tokens}
    for pass_name, backward in (("forward", False), ("forward+backward", True)):
        call = _step(layer, x, idx, w, grad_y, backward)
        eager_y = call().detach().clone()
        eager_grad = x.grad.clone() if backward else None
        graph, graph_y = capture_in_graph(call)
        graph.replay()
        same = torch.equal(graph_y, eager_y) and (not backward or torch.equal(x.grad, eager_grad))
        row[pass_name] = {
            "eager_ms": _median_ms(call, iters, warmup, group),
            "graph_ms": _median_ms(graph.replay, iters, warmup, group),
            "bitwise": same,
        }
    layer.workspace(device).check()
    return row


def measure_rank(rank, world, presets, iters, warmup):
    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD if world > 1 else None
    rows = []
    for name in presets:
        rows.append(_measure_preset(name, rank, device, group, iters, warmup))
        torch.cuda.empty_cache()
    if group is not None:
        for row in rows:
            for pass_name in ("forward", "forward+backward"):
                for key in ("eager_ms", "graph_ms"):
                    value = torch.tensor([row[pass_name][key]], device=device)
                    dist.all_reduce(value, op=dist.ReduceOp.MAX)
                    row[pass_name][key] = value.item()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args()
    world = torch.cuda.device_count()
    presets = args.presets.split(",")
    rows = run_ranks(measure_rank, world, args=(presets, args.iters, args.warmup), backend="nccl")[
        0
    ]
    lines = [
        f"EP {world}, {torch.cuda.get_device_name()}; median of {args.iters} after {args.warmup} "
        "warm-up, slowest rank; replay checked bitwise against eager first",
        "",
        "| preset | tokens/rank | pass | eager ms | graph replay ms | host share | bitwise |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        for pass_name in ("forward", "forward+backward"):
            cell = row[pass_name]
            share = 1 - cell["graph_ms"] / cell["eager_ms"]
            lines.append(
                f"| {row['preset']} | {row['tokens']} | {pass_name} | {cell['eager_ms']:.3f} | "
                f"{cell['graph_ms']:.3f} | {share:.0%} | {cell['bitwise']} |"
            )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text + "\n")


if __name__ == "__main__":
    main()
