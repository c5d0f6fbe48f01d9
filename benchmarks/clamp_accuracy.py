"""Accuracy of the layer under an active SwiGLU clamp against float64, and what the clamp costs.

    python benchmarks/clamp_accuracy.py [--preset qwen3-30b-a3b] [--tokens 8192] [--limit 7]
                                        [--std 4] [--experts 128] [--iters 10] [--out F]

One GPU (EP 1). The gate and up weights are scaled so that the pre-activations have standard
deviation `--std` (models trained with a clamp reach it often). Per backend: the normwise error of
y and of every gradient against the same layer computed in float64 (`mok.reference` on float64
copies), and, for the weight gradients, the largest single-entry error relative to the largest
entry. Then the triton layer's forward + backward time with the clamp and without it (CUDA
events, median and spread over iterations after warm-up, random data).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import mok
from mok.routing import make_routing
from mok.testing import (
    RankInputs,
    clamped_share,
    float64_results,
    one_call_results,
    relative_error,
    weights_of_preactivation_std,
)


def layer_results(config, weights, x, idx, w, grad_y):
    """y and every gradient of the layer of `config` (one GPU) on these inputs."""
    layer = mok.MoE(config, device=x.device)
    layer.load_global_weights(weights)
    results = one_call_results(layer, RankInputs(x, idx, w, grad_y))
    layer.workspace(x.device).check()
    return results


def largest_entry_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return float((actual.double() - expected).abs().max() / expected.abs().max())


def time_ms(config, weights, x, idx, w, grad_y, iters, warmup):
    layer = mok.MoE(config, device=x.device)
    layer.load_global_weights(weights)
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    times = []
    for it in range(warmup + iters):
        layer.zero_grad(set_to_none=True)
        x.grad = w.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        layer(x, idx, w).backward(grad_y)
        end.record()
        end.synchronize()
        if it >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times), min(times), max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--limit", type=float, default=7.0)
    parser.add_argument("--std", type=float, default=4.0)
    parser.add_argument("--experts", type=int, default=None, help="cut the routed experts")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the markdown table here too")
    args = parser.parse_args()

    device = torch.device("cuda")
    preset = mok.get_preset(args.preset)
    changes = {"max_tokens_per_rank": args.tokens, "swiglu_limit": args.limit}
    if args.experts:
        changes["num_experts"] = args.experts
    config = preset.config(**changes)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, config.hidden_size, generator=generator)
    idx, w = make_routing("uniform", args.tokens, config.num_experts, config.top_k, generator)
    grad_y = torch.randn(args.tokens, config.hidden_size, generator=generator)
    x, grad_y = (t.to(device, torch.bfloat16) for t in (x, grad_y))
    idx, w = idx.to(device), w.to(device)
    weights = weights_of_preactivation_std(config, args.std, device)

    exact = float64_results(x, idx, w, grad_y, weights, args.limit)
    fraction = clamped_share(x, idx, weights, args.limit)
    lines = [
        f"{args.preset} (E={config.num_experts}), {args.tokens} tokens, one GPU, L={args.limit}, "
        f"pre-activation std {args.std}: the clamp changes {fraction:.1%} of the routed gate/up "
        "elements",
        "",
        "| backend | " + " | ".join(exact) + " | largest weight-gradient entry error |",
        "| --- | " + " | ".join("---" for _ in exact) + " | --- |",
    ]
    for backend in ("triton", "reference"):
        got = layer_results(config.replace(backend=backend), weights, x, idx, w, grad_y)
        errors = [relative_error(got[key], exact[key]) for key in exact]
        weight_keys = [key for key in exact if key not in ("y", "grad x", "grad topk_weights")]
        entry = max(largest_entry_error(got[key], exact[key]) for key in weight_keys)
        lines.append(
            f"| {backend} | " + " | ".join(f"{e:.2e}" for e in errors) + f" | {entry:.2e} |"
        )
    lines += ["", "| triton fwd+bwd | median ms | min | max |", "| --- | --- | --- | --- |"]
    for label, limit in (("no clamp", None), (f"clamp L={args.limit}", args.limit)):
        cfg = config.replace(backend="triton", swiglu_limit=limit)
        median, low, high = time_ms(cfg, weights, x, idx, w, grad_y, args.iters, args.warmup)
        lines.append(f"| {label} | {median:.3f} | {low:.3f} | {high:.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(table + "\n")


if __name__ == "__main__":
    main()
