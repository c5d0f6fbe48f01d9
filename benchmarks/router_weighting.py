"""The down product's backward at EP 1, two ways, on one GPU: what the layer runs today against
the router weights applied in the down data gradient's epilogue.

    today     `pair_gradients` (w * grad_y scattered to each pair's grouped row, and the router
              weights' gradient <grad_y[t], out[t, j]> from the forward's saved pair outputs),
              then the down data gradient + SwiGLU backward, then W_down's gradient
    epilogue  grad_y's rows copied unweighted to the pairs' grouped rows (`LocalExchange.dispatch`),
              then `weighted_down_data_gradient` (w applied to the product's fp32 accumulator,
              the router weights' dots from the same epilogue, h overwritten by round(w h)), the
              dots put in pair order, then W_down's gradient of the unweighted rows and w h

    PYTHONPATH=src python benchmarks/router_weighting.py [--preset qwen3-30b-a3b,deepseek-v3]
                                                          [--tokens 32768,8192] [--iters 20]

The epilogue form keeps no pair outputs from the forward (T x k x H, listed as "saved" below).
Both are checked before timing: the pre-activations' gradients, W_down's gradient and the router
weights' gradient against float64 math on the same bf16 operands (the two forms round at
different points, so each is held to its own distance from exact). CUDA events, warm-up, the two
interleaved call by call, median and min-max; random data, near-uniform routing.
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import torch

from mok.bench import git_commit
from mok.comm.local import LocalExchange
from mok.kernels import (
    default_config,
    down_data_gradient,
    down_weight_gradient,
    expert_mlp_forward,
    weighted_down_data_gradient,
)
from mok.presets import get_preset
from mok.routing import make_routing
from mok.testing import relative_error


def stage_ms(stages) -> list[float]:
    """CUDA-event ms of each callable of `stages`, run in order (each takes the previous one's
    result), and of the whole."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(stages) + 1)]
    events[0].record()
    value = None
    for stage, event in zip(stages, events[1:], strict=True):
        value = stage(value)
        event.record()
    events[-1].synchronize()
    parts = [a.elapsed_time(b) for a, b in zip(events, events[1:], strict=False)]
    return [*parts, events[0].elapsed_time(events[-1])]


def setup(preset_name: str, tokens: int, device):
    """The layer's forward at EP 1 (rows read through x), its saved state and grad_y."""
    preset = get_preset(preset_name)
    gen = torch.Generator().manual_seed(0)
    experts, top_k = preset.num_experts, preset.top_k
    hidden, inter = preset.hidden_size, preset.intermediate_size
    idx, weights = make_routing("uniform", tokens, experts, top_k, gen)
    idx, weights = idx.to(device), weights.to(device).float()
    x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    w_gate, w_up = (
        (torch.randn(experts, inter, hidden, generator=gen) * hidden**-0.5).to(
            device, torch.bfloat16
        )
        for _ in range(2)
    )
    w_down = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(
        device, torch.bfloat16
    )
    exchange = LocalExchange(experts, device)
    routing = exchange.route(idx)
    config = default_config(device, hidden, inter, tokens * top_k / experts)
    expert_out, saved = expert_mlp_forward(
        x,
        routing.group_offsets,
        w_gate,
        w_up,
        w_down,
        config=config,
        source_rows=routing.grouped_token,
    )
    _, pair_out = exchange.combine(routing, expert_out, weights)
    grad_y = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    return exchange, routing, saved, pair_out, weights, grad_y


STAGES = ("output gradients", "down dgrad", "W_down grad")


def today(exchange, routing, saved, pair_out, weights, grad_y):
    """The three stages of today's path (each takes the previous one's result)."""
    return (
        lambda _: exchange.combine_backward(routing, grad_y, weights, pair_out),
        lambda rows_w: (*rows_w, down_data_gradient(rows_w[0], saved)),
        lambda r: (r[2], down_weight_gradient(r[0], saved), r[1]),
    )


def epilogue(exchange, routing, saved, weights, grad_y):
    """The three stages of the epilogue form."""

    def weighted_dgrad(grad_rows):
        row_weights = weights.view(-1)[routing.grouped_pair]
        grad_gate_up, dots = weighted_down_data_gradient(grad_rows, saved, row_weights)
        grad_w = torch.empty_like(weights).view(-1)
        grad_w[routing.grouped_pair.long()] = dots
        return grad_rows, grad_w.view_as(weights), grad_gate_up

    return (
        lambda _: exchange.dispatch(routing, grad_y),
        weighted_dgrad,
        lambda r: (r[2], down_weight_gradient(r[0], saved), r[1]),
    )


def result(stages):
    value = None
    for stage in stages:
        value = stage(value)
    return value


def exact(routing, saved, h, weights, grad_y, experts_checked: int):
    """float64 math on the bf16 operands for the first experts' rows: (their pairs, the router
    weights' gradient there, W_down's gradient of the first expert)."""
    offsets = saved.group_offsets.tolist()
    pairs, router = [], []
    for e in range(experts_checked):
        a, b = offsets[e], offsets[e + 1]
        out = h[a:b].double() @ saved.w_down[e].double().T
        grad = grad_y[routing.grouped_token[a:b].long()].double()
        pairs.append(routing.grouped_pair[a:b].long())
        router.append((grad * out).sum(1))
    a, b = offsets[0], offsets[1]
    w_row = weights.view(-1)[routing.grouped_pair[a:b].long()].double()
    grad = grad_y[routing.grouped_token[a:b].long()].double()
    w_down_grad = (w_row[:, None] * grad).T @ h[a:b].double()
    return torch.cat(pairs), torch.cat(router), w_down_grad


def dgrad_alone(saved, grad_rows, row_weights, fresh_h, iters: int, warmup: int) -> dict:
    """The down dgrad + SwiGLU backward's Gluon kernel alone, interleaved, with ping-pong and
    cooperative tiles, each three ways: plain with its ring, plain with the ring the weighted
    kernel keeps beside its third epilogue buffer, and weighted. Median (min-max) ms."""
    from mok.kernels import warp_specialized as ws
    from mok.kernels.expert_mlp import cached_row_tiles

    if not ws.dgrad_supported(grad_rows, ws.DGRAD_SWIGLU_PING_PONG, saved.w_down):
        return {}
    m = grad_rows.shape[0]
    args = (grad_rows, saved.w_down, saved.gate_up)
    options = {"activation": saved.activation}
    limit = saved.swiglu_limit
    variants = {}
    for cfg in (ws.DGRAD_SWIGLU_PING_PONG, ws.DGRAD_SWIGLU_COOPERATIVE):
        fewer = ws._with_epilogue_buffers(cfg, 3)
        tiles = cached_row_tiles(saved.row_tiles, saved.group_offsets, m, cfg.block_m)
        label = f"{cfg.block_m}x{cfg.block_n}"
        variants[f"{label} plain, {cfg.num_stages} slots"] = lambda t=tiles, c=cfg: (
            ws.down_dgrad_swiglu(*args, t, limit, c, **options)
        )
        variants[f"{label} plain, {fewer.num_stages} slots"] = lambda t=tiles, c=fewer: (
            ws.down_dgrad_swiglu(*args, t, limit, c, **options)
        )
        variants[f"{label} weighted, {fewer.num_stages} slots"] = lambda t=tiles, c=cfg: (
            ws.down_dgrad_swiglu_weighted(*args, saved.h, row_weights, t, limit, c, **options)
        )
    times = {name: [] for name in variants}
    for step in range(warmup + iters):
        for name, fn in variants.items():
            fresh_h()
            torch.cuda.synchronize()
            ms = stage_ms([lambda _, fn=fn: fn()])[-1]
            if step >= warmup:
                times[name].append(ms)
    return {name: (statistics.median(t), min(t), max(t)) for name, t in times.items()}


def run(preset_name: str, tokens: int, iters: int, warmup: int, device) -> dict:
    exchange, routing, saved, pair_out, weights, grad_y = setup(preset_name, tokens, device)
    h, gate_up = saved.h, saved.gate_up
    pristine_h = h.clone()

    def fresh_h():
        saved.h = h
        h.copy_(pristine_h)

    pair, router, w_down_grad = exact(routing, saved, pristine_h, weights, grad_y, 4)
    errors = {}
    fresh_h()
    variants = {
        "today": today(exchange, routing, saved, pair_out, weights, grad_y),
        "epilogue": epilogue(exchange, routing, saved, weights, grad_y),
    }
    results = {}
    for name, stages in variants.items():
        fresh_h()
        results[name] = result(stages)
    first = slice(saved.group_offsets[0].item(), saved.group_offsets[1].item())
    for name, (_, grad_w_down, grad_w) in results.items():
        errors[name] = {
            "router": relative_error(grad_w.view(-1)[pair], router),
            "w_down": relative_error(grad_w_down[0], w_down_grad),
        }
    errors["gate_up_apart"] = relative_error(
        results["today"][0][first], results["epilogue"][0][first]
    )
    del results
    times = {name: [] for name in variants}
    for step in range(warmup + iters):
        for name, stages in variants.items():
            fresh_h()
            torch.cuda.synchronize()
            ms = stage_ms(stages)
            if step >= warmup:
                times[name].append(ms)
    grad_rows = exchange.dispatch(routing, grad_y)
    row_weights = weights.view(-1)[routing.grouped_pair]
    alone = dgrad_alone(saved, grad_rows, row_weights, fresh_h, iters, warmup)
    preset = get_preset(preset_name)
    pair_bytes = tokens * preset.top_k * preset.hidden_size * 2
    return {
        "preset": preset_name,
        "tokens": tokens,
        "times": {
            name: [(statistics.median(c), min(c), max(c)) for c in zip(*samples, strict=True)]
            for name, samples in times.items()
        },
        "errors": errors,
        "dgrad_alone": alone,
        "saved_pair_out_gib": pair_bytes / 2**30,
        "gate_up": gate_up.shape,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b,deepseek-v3")
    parser.add_argument("--tokens", default="32768,8192")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    presets = args.preset.split(",")
    token_counts = [int(t) for t in args.tokens.split(",")]
    print(
        f"{datetime.date.today()} commit {git_commit()} {torch.cuda.get_device_name()} "
        f"torch {torch.__version__}\n"
    )
    print(
        "| preset | tokens | path | output gradients ms | down dgrad ms | W_down grad ms "
        "| total ms | total / today's | router grad error | W_down grad error |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    notes = []
    for preset_name, tokens in zip(presets, token_counts, strict=True):
        r = run(preset_name, tokens, args.iters, args.warmup, device)
        base = r["times"]["today"][-1][0]
        for path, parts in r["times"].items():
            err = r["errors"][path]
            cells = " | ".join(f"{m:.3f} ({lo:.3f}-{hi:.3f})" for m, lo, hi in parts)
            print(
                f"| {preset_name} | {tokens} | {path} | {cells} | {parts[-1][0] / base:.3f} "
                f"| {err['router']:.1e} | {err['w_down']:.1e} |",
                flush=True,
            )
        for variant, (med, lo, hi) in r["dgrad_alone"].items():
            notes.append(
                f"{preset_name} {tokens}: down dgrad alone, {variant}: {med:.3f} "
                f"({lo:.3f}-{hi:.3f}) ms"
            )
        apart = r["errors"]["gate_up_apart"]
        notes.append(
            f"{preset_name} {tokens}: the two paths' gate/up gradients {apart:.1e} "
            f"apart; today keeps {r['saved_pair_out_gib']:.2f} GiB of pair outputs for this"
        )
        torch.cuda.empty_cache()
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
