"""The overlapped layer (`fused` backend) against the `triton` backend, and both against the same
expert work alone (no communication, every SM), in one run.

    python benchmarks/overlap.py [--preset deepseek-v3,qwen3-235b-a22b] [--tokens N] [--ep N]
                                 [--comm-sms 16] [--dispatch pull] [--iters 20] [--overlap]
                                 [--out results.md]

One rank per GPU (EP = the GPU count unless --ep). Per preset: both layers get the same weights
and inputs (random bf16 x, uniform routing); their outputs and gradients are compared bit for bit
first (the fused backend's contract), then forward and forward + backward are timed with CUDA
events, the two backends interleaved iteration by iteration (median, min, max over the ranks'
maximum). --dispatch: the fused layer's (pull or push; the triton layer keeps its own, push).
--overlap runs the fused backend's overlapped schedule also at EP 1 (its default
there is the copy first on every SM): what the SMs given to the copies cost. "experts alone" is
the routed and shared experts' kernels on this rank's grouped rows with every SM and nothing
else running: the denominator of the issue's exposed-exchange ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
import torch.distributed as dist

import mok
from mok.kernels import expert_mlp_backward, expert_mlp_forward
from mok.launch import run_ranks
from mok.routing import make_routing
from mok.testing import global_weights


def events_ms(fn, group=None) -> float:
    """CUDA-event ms of fn(), the largest over the group's ranks (None: this process)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if group is not None:
        dist.barrier(group)
    start.record()
    fn()
    end.record()
    end.synchronize()
    ms = torch.tensor([start.elapsed_time(end)], device="cuda")
    if group is not None:
        dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return ms.item()


def summary(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def bench_rank(rank, world, presets, tokens, comm_sms, iters, warmup, overlap, dispatch):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = dist.group.WORLD if world > 1 else None
    rows = []
    for name in presets:
        rows.append(
            bench_preset(
                name, rank, world, group, device, tokens, comm_sms, iters, warmup, overlap, dispatch
            )
        )
        if rank == 0:
            print(markdown(rows[-1:]), flush=True)
        torch.cuda.empty_cache()
    return rows


def bench_preset(
    name, rank, world, group, device, tokens, comm_sms, iters, warmup, overlap, dispatch
) -> dict:
    preset = mok.get_preset(name)
    t = tokens or preset.default_tokens
    base = preset.config(max_tokens_per_rank=t, comm_sms=comm_sms)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(t, base.hidden_size, generator=gen).to(device, torch.bfloat16)
    idx, w = make_routing("uniform", t, base.num_experts, base.top_k, gen)
    idx, w = idx.to(device), w.to(device)
    grad_y = torch.randn(t, base.hidden_size, generator=gen).to(device, torch.bfloat16)
    layers = {}
    for backend in ("triton", "fused"):
        config = dataclasses.replace(base, backend=backend)
        if backend == "fused":
            config = dataclasses.replace(config, dispatch=dispatch)
        layer = mok.MoE(config, group=group, device=device)
        layer.load_global_weights(global_weights(config, 0, device))
        if backend == "fused" and overlap:
            layer.workspace(device).backend.overlap = True
        layers[backend] = layer

    def forward(layer, backward):
        layer.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_(backward)
        ww = w.detach().requires_grad_(backward)
        y = layer(xx, idx, ww)
        if backward:
            y.backward(grad_y)
        return y, xx, ww

    results = {}
    for backend, layer in layers.items():
        y, xx, ww = forward(layer, True)
        grads = [p.grad.clone() for p in layer.parameters()]
        results[backend] = [y.detach(), xx.grad, ww.grad, *grads]
        layer.zero_grad(set_to_none=True)
    bitwise = all(torch.equal(a, b) for a, b in zip(*results.values(), strict=True))
    del results
    # The same expert work alone: this rank's grouped rows through the expert kernels.
    weights = layers["triton"]
    backend = weights.workspace(device).backend
    routing = backend.route(idx)
    grouped = backend.exchange.dispatch(routing.exchange, x)

    def experts_alone(backward):
        out, saved = expert_mlp_forward(
            grouped,
            routing.exchange.group_offsets,
            weights.gate.detach(),
            weights.up.detach(),
            weights.down.detach(),
            base.swiglu_limit,
            save_for_backward=backward,
        )
        shared = None
        if base.shared_intermediate_size:
            offsets = torch.tensor([0, t], dtype=torch.int32, device=device)
            _, shared = expert_mlp_forward(
                x,
                offsets,
                weights.shared_gate.detach().unsqueeze(0),
                weights.shared_up.detach().unsqueeze(0),
                weights.shared_down.detach().unsqueeze(0),
                base.swiglu_limit,
                save_for_backward=backward,
            )
        if backward:
            expert_mlp_backward(out, saved)
            if shared is not None:
                expert_mlp_backward(grad_y, shared)

    labels = ("triton", "fused", "experts alone")
    times = {(b, p): [] for b in labels for p in ("fwd", "fwd+bwd")}
    for step in range(warmup + iters):
        for passes, backward in (("fwd", False), ("fwd+bwd", True)):
            for label in labels:
                if label == "experts alone":
                    ms = events_ms(lambda b=backward: experts_alone(b), group)
                else:
                    ms = events_ms(lambda la=layers[label], b=backward: forward(la, b), group)
                    layers[label].zero_grad(set_to_none=True)  # one layer's gradients at a time
                if step >= warmup:
                    times[(label, passes)].append(ms)
    for layer in layers.values():
        layer.workspace(device).check()
        layer.workspace(device).release()
    row = {"preset": f"{name} ({dispatch})", "tokens": t, "ep": world, "bitwise": bitwise}
    row.update({f"{b} {p}": summary(v) for (b, p), v in times.items()})
    return row


def cell(s: dict) -> str:
    """A `summary` as "median [min, max]"."""
    return f"{s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]"


def markdown(rows) -> str:
    lines = [
        "| preset | tokens/rank | EP | bitwise | pass | triton ms | fused ms | experts alone ms "
        "| fused / triton | triton / alone | fused / alone |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    for r in rows:
        for p in ("fwd", "fwd+bwd"):
            tr, fu, al = (r[f"{b} {p}"] for b in ("triton", "fused", "experts alone"))
            lines.append(
                f"| {r['preset']} | {r['tokens']} | {r['ep']} | {r['bitwise']} | {p} | {cell(tr)} "
                f"| {cell(fu)} | {cell(al)} | {fu['median'] / tr['median']:.3f} "
                f"| {tr['median'] / al['median']:.3f} | {fu['median'] / al['median']:.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v3,qwen3-235b-a22b")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--ep", type=int, default=None)
    parser.add_argument("--comm-sms", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--dispatch", choices=("pull", "push"), default="pull")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    world = args.ep or torch.cuda.device_count()
    presets = args.preset.split(",")
    call = (
        presets,
        args.tokens,
        args.comm_sms,
        args.iters,
        args.warmup,
        args.overlap,
        args.dispatch,
    )
    if world > 1:
        rows = run_ranks(bench_rank, world, args=call, backend="nccl")[0]
    else:
        rows = bench_rank(0, 1, *call)
    table = markdown(rows)
    print(table)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(table + "\n")


if __name__ == "__main__":
    main()
