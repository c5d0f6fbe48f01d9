"""Host time of the work a replayed layer call does around its graph launches, two ways each,
interleaved call by call in one process (between processes, the GPU machine's host varies by
10-40 %, more than the differences measured here).

    PYTHONPATH=src python3 benchmarks/replay_host_ops.py [--preset tiny] [--tokens 8192]
                                                         [--iters 2000] [--out FILE.md]

On one GPU, with the layer's own tensors (its weights, random inputs, gradients of the weights'
shapes and dtypes):
- gradients out: the backward graph's gradients (x, topk_weights, every weight) copied into new
  tensors, one `clone()` each against `mok.graphs._fresh_copies` (one foreach call per dtype);
- inputs in: topk_idx, x and topk_weights copied into the graph's own, one `copy_` each against
  one `torch._foreach_copy_`;
- host checks: the input checks of a forward (`_routing_problem`, `_forward_problem`) against
  `mok.graphs.call_key` of the call compared with the last accepted call's.
Each row: median [10th, 90th percentile] host us over --iters calls of each way. Results are
checked equal first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mok
from mok import functional, graphs
from mok.testing import global_weights


def percentiles(values: list[float]) -> str:
    ordered = sorted(values)
    low, high = ordered[len(ordered) // 10], ordered[(9 * len(ordered)) // 10]
    return f"{statistics.median(ordered):.1f} [{low:.1f}, {high:.1f}]"


def interleaved(ways: dict, iters: int) -> dict[str, list[float]]:
    """Host us of each way's call, the ways taking turns (first one, then the other); the GPU
    drained every 16 rounds (so that no call waits on a full launch queue), outside the timed
    calls."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(iters):
        turns = list(ways.items())
        for name, way in turns[::-1] if round_ % 2 else turns:
            start = time.perf_counter()
            way()
            times[name].append((time.perf_counter() - start) * 1e6)
        if round_ % 16 == 15:
            torch.cuda.synchronize()
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    config = mok.get_preset(args.preset).config(backend="triton", max_tokens_per_rank=args.tokens)
    layer = mok.MoE(config, device=device)
    layer.load_global_weights(global_weights(config, 0, device))
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.tokens, config.hidden_size, device=device, generator=generator)
    x = x.bfloat16()
    logits = torch.randn(args.tokens, config.num_experts, device=device, generator=generator)
    topk_weights, topk_idx = logits.softmax(-1).topk(config.top_k, -1)
    weights = layer.weights
    gradients = [torch.randn_like(x), torch.randn_like(topk_weights)]
    gradients += [torch.randn_like(w) for w in weights.astuple() if w is not None]
    sources = [topk_idx, x, topk_weights]
    statics = [torch.empty_like(t) for t in sources]

    def copy_each():
        for static, source in zip(statics, sources, strict=True):
            static.copy_(source)

    ws = layer.workspace(device)
    accepted = graphs.call_key(topk_idx, x, topk_weights, weights)

    def checks():
        problem = functional._routing_problem(ws, topk_idx)
        return problem or functional._forward_problem(ws, args.tokens, x, topk_weights, weights)

    def key_compare():
        return graphs.call_key(topk_idx, x, topk_weights, weights) == accepted

    clones = [t.clone() for t in gradients]
    fresh = graphs._fresh_copies(gradients)
    if not all(torch.equal(a, b) for a, b in zip(clones, fresh, strict=True)):
        raise AssertionError("the foreach copies differ from the clones")
    if checks() is not None or not key_compare():
        raise AssertionError("the inputs should pass the checks and match their own key")
    rows = [
        (
            f"gradients out ({len(gradients)} tensors)",
            "clone() each",
            "_fresh_copies",
            {
                "before": lambda: [t.clone() for t in gradients],
                "now": lambda: graphs._fresh_copies(gradients),
            },
        ),
        (
            "inputs in (3 tensors)",
            "copy_ each",
            "_foreach_copy_",
            {"before": copy_each, "now": lambda: torch._foreach_copy_(statics, sources)},
        ),
        (
            "host checks of a forward",
            "the checks",
            "call_key ==",
            {"before": checks, "now": key_compare},
        ),
    ]
    lines = [
        f"{args.preset}, {args.tokens} tokens, {torch.cuda.get_device_name(device)}, "
        f"{args.iters} calls each, interleaved",
        "",
        "| work | before | host us | now | host us | now / before (medians) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, before, now, ways in rows:
        times = interleaved(ways, args.iters)
        ratio = statistics.median(times["now"]) / statistics.median(times["before"])
        lines.append(
            f"| {label} | {before} | {percentiles(times['before'])} | {now} | "
            f"{percentiles(times['now'])} | {ratio:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
