"""The local combine (EP 1) with the pairs' outputs kept where the expert product wrote them,
against copying them in token order for the backward, on one GPU: what `LocalExchange.combine`
saves by keeping `GroupedPairOutputs` (no T x k x H write in the forward) and what its backward
(`pair_gradients` reading each pair's row through pair_row) pays for it.

    python benchmarks/pair_outputs_in_place.py [--preset qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3]
                                               [--tokens 8192,32768] [--iters 20] [--out FILE]

Per preset and token count: uniform routing placed by the local exchange, random bf16 expert
outputs, router weights and grad_y. The two variants' y, pair gradients and router-weight
gradients are checked bit for bit against each other before timing; then the forward sum (with
and without the copy) and the backward pass (reading the copy, or the grouped rows in place),
interleaved per iteration, CUDA events, median and min-max.
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import torch
from pair_gradients import alone

from mok.bench import git_commit
from mok.comm.local import LocalExchange
from mok.kernels.rows import (
    LOCAL_EXCHANGE_SUM,
    LOCAL_EXCHANGE_SUM_PROGRAMS_PER_SM,
    PAIR_GRADIENT_PROGRAMS_PER_SM,
    pair_gradients,
    reduce_rows,
)
from mok.presets import get_preset
from mok.routing import make_routing

from exchange import timed


def operands(preset_name: str, tokens: int, device):
    """(pair_row [T, k], expert outputs [T * k, H] in grouped order, router weights [T, k],
    grad_y [T, H])."""
    preset = get_preset(preset_name)
    generator = torch.Generator().manual_seed(0)
    idx, weights = make_routing("uniform", tokens, preset.num_experts, preset.top_k, generator)
    routing = LocalExchange(preset.num_experts, device).route(idx.to(device))
    hidden = preset.hidden_size
    expert_out = torch.randn(tokens * preset.top_k, hidden, generator=generator).bfloat16()
    grad_y = torch.randn(tokens, hidden, generator=generator).bfloat16()
    return routing.pair_row, expert_out.to(device), weights.to(device), grad_y.to(device)


def variants(pair_row, expert_out, weights, grad_y, sms: int):
    """{name: (forward, backward)}: callables of the combine's sum and its backward pass, the
    pairs' outputs copied in token order or read in place."""
    tokens, top_k = pair_row.shape
    hidden = expert_out.shape[1]
    y = torch.empty(tokens, hidden, dtype=expert_out.dtype, device=expert_out.device)
    copy = torch.empty(tokens, top_k, hidden, dtype=expert_out.dtype, device=expert_out.device)
    grad_pairs = torch.empty_like(expert_out)
    programs = PAIR_GRADIENT_PROGRAMS_PER_SM * sms

    def forward(gathered):
        reduce_rows(
            y,
            expert_out,
            pair_row,
            LOCAL_EXCHANGE_SUM_PROGRAMS_PER_SM * sms,
            weight=weights,
            gathered=gathered,
            **LOCAL_EXCHANGE_SUM,
        )
        return y

    def backward(pair_out, in_place):
        grad_w = pair_gradients(
            grad_y, weights, pair_out, grad_pairs, programs, pair_row, out_at_dst=in_place
        )
        return grad_pairs, grad_w

    return {
        "copied in token order": (lambda: forward(copy), lambda: backward(copy, False)),
        "in place (grouped)": (lambda: forward(None), lambda: backward(expert_out, True)),
    }


def results(forward, backward) -> list[torch.Tensor]:
    y = forward().clone()
    grad_pairs, grad_w = backward()
    return [y, grad_pairs.clone(), grad_w]


def spread(times: list[float]) -> str:
    return f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3")
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    lines = [
        f"# The local combine's pair outputs, copied or in place ({datetime.date.today()}, "
        f"commit `{git_commit()}`, {torch.cuda.get_device_name()})",
        "",
        f"Median (min-max) ms of {args.iters} interleaved iterations.",
        "",
        "| preset | tokens | pair outputs | bitwise | forward sum ms | backward pass ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in args.preset.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            runs = variants(*operands(name, tokens, device), sms)
            first = None
            times = {label: ([], []) for label in runs}
            same = {}
            for label, (forward, backward) in runs.items():
                got = results(forward, backward)
                first = got if first is None else first
                same[label] = all(torch.equal(a, b) for a, b in zip(got, first, strict=True))
            for index in range(args.warmup + args.iters):
                for label, (forward, backward) in runs.items():
                    kept = times[label] if index >= args.warmup else ([], [])
                    kept[0].extend(timed(forward, 1, 0, alone))
                    kept[1].extend(timed(backward, 1, 0, alone))
            for label, (forward_ms, backward_ms) in times.items():
                lines.append(
                    f"| {name} | {tokens} | {label} | {same[label]} | {spread(forward_ms)} "
                    f"| {spread(backward_ms)} |"
                )
                print(lines[-1], flush=True)
            del runs
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    if not all("| True |" in line for line in lines[6:]):
        raise AssertionError("the two variants' results differ")


if __name__ == "__main__":
    main()
