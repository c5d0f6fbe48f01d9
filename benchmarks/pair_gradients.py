"""The combine's backward on the token side (`mok.kernels.rows.pair_gradients`) by launch shape,
on one GPU: grad_pairs [T * k, H] = w * grad_y scattered to each pair's grouped row, and the
router weights' gradient <grad_y[t], pair_out[t, j]> in fp32. A memory-bound pass (pair_out read,
grad_pairs written: 2 * T * k * H * 2 bytes, plus grad_y), so the figure is GB/s of HBM against
the time; the exchanges launch it with `PAIR_GRADIENT_PROGRAMS_PER_SM` programs of 8 warps per SM
and 2 tokens a tile, the fastest shape here (one program of 4 tokens per SM before: 0.83 ms at
qwen3-235b-a22b, 8192 tokens, in a profile of the layer).

    python benchmarks/pair_gradients.py [--preset qwen3-235b-a22b,deepseek-v3] [--out FILE]

Every candidate is checked bit for bit against the first (the results do not depend on the
launch shape) before timing; the PyTorch expression of the same pass is timed beside it. CUDA
events, warm-up, median and min-max of --iters, random data, near-uniform routing.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import statistics

import torch

from mok.bench import git_commit
from mok.kernels.rows import pair_gradients
from mok.presets import get_preset
from mok.routing import make_routing

from exchange import timed

PROGRAMS_PER_SM = (1, 2, 4)
BLOCK_ROWS = (2, 4, 8)
WARPS = (4, 8)


def alone() -> None:
    """One GPU: nothing to align with before a timed call."""


def inputs(preset_name: str, tokens: int, device):
    """grad_y [T, H], router weights [T, k], pair_out [T, k, H], dst_row [T, k] (the pairs'
    grouped rows: by expert, then token) and the grad_pairs buffer [T * k, H]."""
    preset = get_preset(preset_name)
    generator = torch.Generator().manual_seed(0)
    top_k, hidden = preset.top_k, preset.hidden_size
    idx, weights = make_routing("uniform", tokens, preset.num_experts, top_k, generator)
    order = torch.argsort(idx.flatten() * tokens + torch.arange(tokens).repeat_interleave(top_k))
    dst_row = torch.empty(tokens * top_k, dtype=torch.int64)
    dst_row[order] = torch.arange(tokens * top_k)
    grad_y = torch.randn(tokens, hidden, generator=generator).bfloat16()
    pair_out = torch.randn(tokens, top_k, hidden, generator=generator).bfloat16()
    grad_pairs = torch.empty(tokens * top_k, hidden, dtype=torch.bfloat16)
    tensors = (grad_y, weights, pair_out, dst_row.view(tokens, top_k), grad_pairs)
    return [t.to(device) for t in tensors]


def torch_pass(grad_y, weights, pair_out, dst_row, grad_pairs):
    """The same pass in PyTorch (its own order of the fp32 sums)."""
    scaled = (weights.float()[..., None] * grad_y.float()[:, None]).bfloat16()
    grad_pairs[dst_row.flatten()] = scaled.flatten(0, 1)
    return torch.einsum("th,tkh->tk", grad_y.float(), pair_out.float())


def bench(preset_name: str, tokens: int, iters: int, warmup: int) -> list[dict]:
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    grad_y, weights, pair_out, dst_row, grad_pairs = inputs(preset_name, tokens, device)
    top_k, hidden = weights.shape[1], grad_y.shape[1]
    moved = (2 * tokens * top_k * hidden + tokens * hidden) * 2
    rows, first = [], None
    for per_sm, block_rows, warps in itertools.product(PROGRAMS_PER_SM, BLOCK_ROWS, WARPS):

        def run(per_sm=per_sm, block_rows=block_rows, warps=warps):
            return pair_gradients(
                grad_y, weights, pair_out, grad_pairs, per_sm * sms, dst_row, block_rows, warps
            )

        grad_pairs.fill_(float("nan"))
        result = (run(), grad_pairs.clone())
        if first is None:
            first = result
        elif not (torch.equal(result[0], first[0]) and torch.equal(result[1], first[1])):
            raise AssertionError(f"{per_sm} per SM, {block_rows} rows, {warps} warps differ")
        label = f"{per_sm} x {sms} programs, {block_rows} tokens a tile, {warps} warps"
        rows.append((label, timed(run, iters, warmup, alone)))
    want_w = torch_pass(grad_y, weights, pair_out, dst_row, grad_pairs)
    if not torch.allclose(first[0].float(), want_w, rtol=1e-3, atol=1e-3 * hidden**0.5):
        raise AssertionError("pair_gradients' router-weight gradients differ from PyTorch's")
    if not torch.equal(first[1], grad_pairs):
        raise AssertionError("pair_gradients' pair gradients differ from PyTorch's")
    torch_times = timed(
        lambda: torch_pass(grad_y, weights, pair_out, dst_row, grad_pairs), iters, warmup, alone
    )
    rows.append(("PyTorch (scale, index-put, einsum)", torch_times))
    return [
        {
            "preset": preset_name,
            "tokens": tokens,
            "launch": label,
            "ms": statistics.median(times),
            "min": min(times),
            "max": max(times),
            "gb_s": moved / statistics.median(times) / 1e6,
        }
        for label, times in rows
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args()
    lines = [
        f"# pair_gradients by launch shape ({datetime.date.today()}, commit `{git_commit()}`, "
        f"{torch.cuda.get_device_name()})",
        "",
        "| preset | tokens | launch | ms median (min-max) | GB/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in args.preset.split(","):
        for row in bench(name, args.tokens, args.iters, args.warmup):
            lines.append(
                f"| {row['preset']} | {row['tokens']} | {row['launch']} | {row['ms']:.3f} "
                f"({row['min']:.3f}-{row['max']:.3f}) | {row['gb_s']:.0f} |"
            )
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
