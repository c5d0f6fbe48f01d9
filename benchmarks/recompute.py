"""The layer with a memory option (`MoKConfig.recompute="gate_up"`, the default, or
`router_gradient="epilogue"`) beside the layer without it (the same backend, weights and inputs),
in one run, on one GPU (EP 1).

    python benchmarks/recompute.py [--preset qwen3-30b-a3b,deepseek-v3] [--tokens N]
                                   [--backend triton] [--option recompute=gate_up]
                                   [--iters 10] [--warmup 3] [--out FILE.md]

Per preset: first one call of each on the same inputs, every result compared bit for bit (recompute
must not change them; router_gradient moves the rounding points, so the largest normwise difference
is printed beside); then forward and forward + backward timed with CUDA events, the two layers
interleaved iteration by iteration (median [min, max]) on random bf16 inputs with uniform routing;
then the memory a forward leaves for its backward (allocated after the forward with the autograd
graph alive, minus before, y included) and the peak of a forward + backward above what was
allocated before it.
"""

from __future__ import annotations

import argparse

import torch
from mxfp8 import _inputs, kept_and_peak_gib
from overlap import cell, events_ms, summary

import mok
from mok.testing import global_weights, one_call_results, relative_error

LAYERS = ("without", "with")


def bench_preset(name, backend, device, tokens, iters, warmup, option: dict) -> dict:
    preset = mok.get_preset(name)
    t = tokens or preset.default_tokens
    base = preset.config(backend=backend, max_tokens_per_rank=t, graphs="off")
    inputs = _inputs(base, t, device)
    keeps = mok.MoE(base, device=device)
    keeps.load_global_weights(global_weights(base, 0, device))
    optioned = mok.MoE.sharing_weights_of(keeps, base.replace(**option))
    layers = dict(zip(LAYERS, (keeps, optioned), strict=True))
    want, got = (one_call_results(layer, inputs) for layer in layers.values())
    bitwise = all(torch.equal(got[key], value) for key, value in want.items())
    apart = max(relative_error(got[key], value) for key, value in want.items())
    del want, got

    def call(layer, backward):
        x = inputs.x.detach().requires_grad_(backward)
        w = inputs.topk_weights.detach().requires_grad_(backward)
        y = layer(x, inputs.topk_idx, w)
        if backward:
            y.backward(inputs.grad_y)
        return y

    times = {(p, label): [] for p in ("fwd", "fwd+bwd") for label in layers}
    for step in range(warmup + iters):
        for passes, backward in (("fwd", False), ("fwd+bwd", True)):
            for label, layer in layers.items():
                ms = events_ms(lambda la=layer, b=backward: call(la, b))
                layer.zero_grad(set_to_none=True)
                if step >= warmup:
                    times[(passes, label)].append(ms)
    memory = {label: kept_and_peak_gib(layer, inputs, device) for label, layer in layers.items()}
    keeps.workspace(device).check()
    keeps.workspace(device).release()
    row = {"preset": name, "backend": backend, "tokens": t, "bitwise": bitwise, "apart": apart}
    row["memory"] = memory
    row.update({f"{label} {p}": summary(v) for (p, label), v in times.items()})
    return row


def markdown(rows, option: str) -> str:
    lines = [
        f"Option: `{option}`.",
        "",
        "| preset | backend | tokens | bitwise (largest difference) | pass | without ms "
        "| with ms | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        for p in ("fwd", "fwd+bwd"):
            without, with_option = r[f"without {p}"], r[f"with {p}"]
            ratio = with_option["median"] / without["median"]
            lines.append(
                f"| {r['preset']} | {r['backend']} | {r['tokens']} | {r['bitwise']} "
                f"({r['apart']:.1e}) | {p} | {cell(without)} | {cell(with_option)} "
                f"| {ratio:.3f} |"
            )
    lines += [
        "",
        "| preset | tokens | layer | kept for the backward GiB | peak of fwd+bwd GiB |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        for label in LAYERS:
            m = r["memory"][label]
            lines.append(
                f"| {r['preset']} | {r['tokens']} | {label} | {m['saved GiB']:.3f} "
                f"| {m['peak GiB']:.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b,deepseek-v3")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--backend", default="triton", choices=("triton", "fused"))
    parser.add_argument(
        "--option", default="recompute=gate_up", help="the config field and value compared"
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    args = parser.parse_args()
    device = torch.device("cuda")
    key, value = args.option.split("=", 1)
    option = {key: value}
    rows = [
        bench_preset(name, args.backend, device, args.tokens, args.iters, args.warmup, option)
        for name in args.preset.split(",")
    ]
    text = f"{torch.cuda.get_device_name(0)}, EP 1\n\n" + markdown(rows, args.option)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
