"""The layer in MXFP8 beside the layer in BF16 (both the `triton` backend, same weights and inputs),
in one run, on one GPU (EP 1).

    python benchmarks/mxfp8.py [--preset deepseek-v3,qwen3-235b-a22b] [--tokens N]
                               [--iters 10] [--warmup 3] [--out results.md]

Per preset, first the checks, on a 16-expert cut of the preset (float64 of every expert does not
fit): the MXFP8 layer against the MXFP8 `reference` backend (its oracle), and the errors against
float64 of three layers: BF16 triton, MXFP8 triton, MXFP8 reference. Then the
timings: forward and forward + backward with CUDA events, the two precisions interleaved
iteration by iteration (median [min, max]); the MXFP8 layer casts its weights once per weight
update (they do not change here), so the casts are timed alone beside it (both layouts of the
three routed weights: what a training step adds once, whatever its micro-batch count); the
memory a forward leaves for its backward (allocated after the forward, graph alive, minus
before; the cached weight casts are not in it); the peak of a forward + backward; the bytes of
one row as the exchange's dispatch receives them (recorded at every call: what crosses NVLink
per token and remote owner at EP > 1).
"""

from __future__ import annotations

import argparse

import torch
from overlap import cell, events_ms, summary

import mok
from mok.kernels.mx import mx_quantized_values_both
from mok.reference.mx import ScaleRounding
from mok.routing import make_routing
from mok.testing import RankInputs, float64_results, global_weights, one_call_results
from mok.testing import relative_error as error


def _inputs(config, tokens, device, seed=0) -> RankInputs:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    idx, w = make_routing("uniform", tokens, config.num_experts, config.top_k, gen)
    grad_y = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    return RankInputs(x.to(device), idx.to(device), w.to(device), grad_y.to(device))


def accuracy(name: str, device) -> dict:
    """Normwise errors against float64 of BF16 triton, MXFP8 triton and MXFP8 reference on a
    16-expert cut of the preset; the largest over y and every gradient, and y's alone."""
    preset = mok.get_preset(name)
    base = preset.config(num_experts=min(16, preset.num_experts), max_tokens_per_rank=512)
    inputs = _inputs(base, 512, device, seed=7)
    weights = global_weights(base, 7, device)
    exact = float64_results(
        inputs.x, inputs.topk_idx, inputs.topk_weights, inputs.grad_y, weights, base.swiglu_limit
    )
    row, results = {}, {}
    for label, backend, precision in (
        ("bf16", "triton", "bf16"),
        ("mxfp8", "triton", "mxfp8"),
        ("mxfp8 reference", "reference", "mxfp8"),
    ):
        layer = mok.MoE(base.replace(backend=backend, precision=precision), device=device)
        layer.load_global_weights(weights)
        results[label] = one_call_results(layer, inputs)
        errors = {key: error(results[label][key], value) for key, value in exact.items()}
        row[label] = {"y": errors["y"], "worst": max(errors.values())}
        row[f"{label} by key"] = errors
        layer.workspace(device).release()
    ours, oracle = results["mxfp8"], results["mxfp8 reference"]
    row["mxfp8 vs reference"] = max(error(ours[key], oracle[key]) for key in oracle)
    return row


def record_dispatched_row_bytes(layer, device) -> set[int]:
    """The bytes per row of every row tensor the layer's exchange dispatches from now on."""
    exchange = layer.workspace(device).backend.exchange
    seen, dispatch = set(), exchange.dispatch

    def recording(routing, x):
        seen.add(x.shape[1] * x.element_size())
        return dispatch(routing, x)

    exchange.dispatch = recording
    return seen


def kept_and_peak_gib(layer, inputs: RankInputs, device) -> dict:
    """One forward + backward of `layer`: the GiB its forward leaves allocated for the backward
    (autograd graph alive, y included) and the peak above what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    x = inputs.x.detach().requires_grad_(True)
    w = inputs.topk_weights.detach().requires_grad_(True)
    y = layer(x, inputs.topk_idx, w)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated(device) - before
    y.backward(inputs.grad_y)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - before
    layer.zero_grad(set_to_none=True)
    return {"saved GiB": saved / 2**30, "peak GiB": peak / 2**30}


def bench_preset(name, device, tokens, iters, warmup) -> dict:
    preset = mok.get_preset(name)
    t = tokens or preset.default_tokens
    base = preset.config(backend="triton", max_tokens_per_rank=t)
    inputs = _inputs(base, t, device)
    bf16 = mok.MoE(base, device=device)
    bf16.load_global_weights(global_weights(base, 0, device))
    mx_config = base.replace(precision="mxfp8")
    layers = {"bf16": bf16, "mxfp8": mok.MoE.sharing_weights_of(bf16, mx_config)}

    def call(layer, backward):
        layer.zero_grad(set_to_none=True)
        x = inputs.x.detach().requires_grad_(backward)
        w = inputs.topk_weights.detach().requires_grad_(backward)
        y = layer(x, inputs.topk_idx, w)
        if backward:
            y.backward(inputs.grad_y)
        return y

    def casts():
        # One weight's casts, counted three times (the three weights have one size): casting
        # all three beside the layer's cached casts would not fit in memory at deepseek-v3 EP 1.
        mx_quantized_values_both(bf16.gate.detach(), ScaleRounding.RCEIL)

    times = {(p, label): [] for p in ("fwd", "fwd+bwd") for label in (*layers, "casts")}
    row_bytes = {}
    for label, layer in layers.items():
        call(layer, False)
        row_bytes[label] = record_dispatched_row_bytes(layer, device)
    for step in range(warmup + iters):
        for passes, backward in (("fwd", False), ("fwd+bwd", True)):
            for label, layer in layers.items():
                ms = events_ms(lambda la=layer, b=backward: call(la, b))
                layer.zero_grad(set_to_none=True)
                if step >= warmup:
                    times[(passes, label)].append(ms)
        ms = 3 * events_ms(casts)
        if step >= warmup:
            times[("fwd", "casts")].append(ms)
    memory = {label: kept_and_peak_gib(layer, inputs, device) for label, layer in layers.items()}
    for layer in layers.values():
        layer.workspace(device).check()
    bf16.workspace(device).release()
    row = {"preset": name, "tokens": t, "memory": memory}
    row["dispatched row bytes"] = {label: sorted(seen) for label, seen in row_bytes.items()}
    row.update({f"{label} {p}": summary(v) for (p, label), v in times.items() if v})
    return row


def profile(name, device, tokens) -> str:
    """The CUDA kernels of one MXFP8 forward + backward, by total time (torch.profiler)."""
    preset = mok.get_preset(name)
    t = tokens or preset.default_tokens
    config = preset.config(backend="triton", precision="mxfp8", max_tokens_per_rank=t)
    layer = mok.MoE(config, device=device)
    layer.load_global_weights(global_weights(config, 0, device))
    inputs = _inputs(config, t, device)

    def step():
        x = inputs.x.detach().requires_grad_(True)
        w = inputs.topk_weights.detach().requires_grad_(True)
        layer(x, inputs.topk_idx, w).backward(inputs.grad_y)
        layer.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    layer.workspace(device).release()
    return prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=16, max_name_column_width=60
    )


def markdown(rows, accuracies) -> str:
    lines = [
        "| preset | tokens | pass | bf16 ms | mxfp8 ms | mxfp8 / bf16 time | weight casts ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        for p in ("fwd", "fwd+bwd"):
            b, m = r[f"bf16 {p}"], r[f"mxfp8 {p}"]
            casts = cell(r["casts fwd"]) if p == "fwd" else ""
            lines.append(
                f"| {r['preset']} | {r['tokens']} | {p} | {cell(b)} | {cell(m)} "
                f"| {m['median'] / b['median']:.3f} | {casts} |"
            )
    lines += [
        "",
        "| preset | bf16 saved GiB | mxfp8 saved GiB | ratio | bf16 peak GiB | mxfp8 peak GiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        b, m = r["memory"]["bf16"], r["memory"]["mxfp8"]
        lines.append(
            f"| {r['preset']} | {b['saved GiB']:.2f} | {m['saved GiB']:.2f} "
            f"| {m['saved GiB'] / b['saved GiB']:.3f} | {b['peak GiB']:.2f} | {m['peak GiB']:.2f} |"
        )
    lines += [
        "",
        "| preset | bf16 bytes per dispatched row | mxfp8 bytes per dispatched row | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        b, m = r["dispatched row bytes"]["bf16"], r["dispatched row bytes"]["mxfp8"]
        ratio = f"{max(m) / max(b):.3f}" if b and m else "— (EP 1 gathers its rows: no dispatch)"
        lines.append(f"| {r['preset']} | {b} | {m} | {ratio} |")
    lines += [
        "",
        "| preset (16 experts, 512 tokens) | error vs float64: bf16 y / worst | mxfp8 y / worst "
        "| MX reference y / worst | mxfp8 / MX reference (worst) | mxfp8 / bf16 (y) "
        "| mxfp8 vs MX reference |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, a in accuracies.items():
        b, m, r = a["bf16"], a["mxfp8"], a["mxfp8 reference"]
        lines.append(
            f"| {name} | {b['y']:.2e} / {b['worst']:.2e} | {m['y']:.2e} / {m['worst']:.2e} "
            f"| {r['y']:.2e} / {r['worst']:.2e} | {m['worst'] / r['worst']:.3f} "
            f"| {m['y'] / b['y']:.2f} | {a['mxfp8 vs reference']:.2e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v3,qwen3-235b-a22b")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--profile", action="store_true", help="print the kernels of one MXFP8 step per preset"
    )
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    presets = args.preset.split(",")
    if args.profile:
        for name in presets:
            print(name, profile(name, device, args.tokens), sep="\n", flush=True)
            torch.cuda.empty_cache()
    accuracies = {name: accuracy(name, device) for name in presets}
    for name, a in accuracies.items():
        print(name, {k: v for k, v in a.items() if k.endswith("by key")}, flush=True)
    rows = []
    for name in presets:
        rows.append(bench_preset(name, device, args.tokens, args.iters, args.warmup))
        print(markdown(rows[-1:], {}), flush=True)
        torch.cuda.empty_cache()
    table = markdown(rows, accuracies)
    print(table)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(table + "\n")


if __name__ == "__main__":
    main()
