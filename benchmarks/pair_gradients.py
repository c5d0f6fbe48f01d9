"""The combine's backward on the token side (`mok.kernels.rows.pair_gradients`) by launch shape,
on one GPU: grad_pairs [T * k, H] = w * grad_y scattered to each pair's grouped row, and the
router weights' gradient <grad_y[t], pair_out[t, j]> in fp32. A memory-bound pass (pair_out read,
grad_pairs written: 2 * T * k * H * 2 bytes, plus grad_y), so the figure is GB/s of HBM against
the time. Each launch is timed twice: on an idle GPU, and right behind ~6 ms of bf16 GEMMs
(`--load-ms`), as it runs in a training step, between the products.

    python benchmarks/pair_gradients.py [--preset qwen3-235b-a22b,deepseek-v3] [--tokens 8192,32768]
                                        [--load-ms 6] [--programs-per-sm 1,2,4]
                                        [--block-rows 1,2,4,8] [--warps 4,8] [--out FILE]

Every candidate is checked bit for bit against the first (the results do not depend on the
launch shape) before timing, a mismatch reported in the table and raised at the end; the
PyTorch expression of the same pass is timed beside it. CUDA events, warm-up, median and min-max
of --iters, random data, near-uniform routing.
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


def alone() -> None:
    """One GPU: nothing to align with before a timed call."""


def gemm_load(milliseconds: float, device):
    """A callable that queues about `milliseconds` of 8192^3 bf16 GEMMs (random operands, ~1.4 ms
    each on an H200) ahead of the timed call."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    count = max(1, round(milliseconds / 1.4))

    def load() -> None:
        for _ in range(count):
            torch.mm(a, b)

    return load


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


def bench(preset_name: str, tokens: int, launches, iters: int, warmup: int, load) -> list[dict]:
    """Rows of the table for one preset and token count; launches: (programs per SM, tokens a
    tile, warps) triples."""
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    grad_y, weights, pair_out, dst_row, grad_pairs = inputs(preset_name, tokens, device)
    top_k, hidden = weights.shape[1], grad_y.shape[1]
    moved = (2 * tokens * top_k * hidden + tokens * hidden) * 2
    rows, first = [], None
    for per_sm, block_rows, warps in launches:

        def run(per_sm=per_sm, block_rows=block_rows, warps=warps):
            return pair_gradients(
                grad_y, weights, pair_out, grad_pairs, per_sm * sms, dst_row, block_rows, warps
            )

        grad_pairs.fill_(float("nan"))
        result = (run(), grad_pairs.clone())
        if first is None:
            first = result
        same = torch.equal(result[0], first[0]) and torch.equal(result[1], first[1])
        label = f"{per_sm} x {sms} programs, {block_rows} tokens a tile, {warps} warps"
        times = (timed(run, iters, warmup, alone), timed(run, iters, warmup, load))
        rows.append((label, same, *times))
    want_w = torch_pass(grad_y, weights, pair_out, dst_row, grad_pairs)
    if not torch.allclose(first[0].float(), want_w, rtol=1e-3, atol=1e-3 * hidden**0.5):
        raise AssertionError("pair_gradients' router-weight gradients differ from PyTorch's")
    if not torch.equal(first[1], grad_pairs):
        raise AssertionError("pair_gradients' pair gradients differ from PyTorch's")

    def torch_run():
        return torch_pass(grad_y, weights, pair_out, dst_row, grad_pairs)

    torch_times = (timed(torch_run, iters, warmup, alone), timed(torch_run, iters, warmup, load))
    rows.append(("PyTorch (scale, index-put, einsum)", None, *torch_times))
    return [
        {
            "preset": preset_name,
            "tokens": tokens,
            "launch": label,
            "bitwise": same,
            "idle": (statistics.median(idle), min(idle), max(idle)),
            "loaded": (statistics.median(loaded), min(loaded), max(loaded)),
            "gb_s": moved / statistics.median(loaded) / 1e6,
        }
        for label, same, idle, loaded in rows
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3")
    parser.add_argument("--tokens", default="8192", help="comma-separated token counts")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--load-ms", type=float, default=6.0, help="GEMMs ahead of a loaded call")
    parser.add_argument("--programs-per-sm", default="1,2,4")
    parser.add_argument("--block-rows", default="1,2,4,8", help="tokens a tile")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args()
    lines = [
        f"# pair_gradients by launch shape ({datetime.date.today()}, commit `{git_commit()}`, "
        f"{torch.cuda.get_device_name()})",
        "",
        "| preset | tokens | launch | bitwise = first | idle ms median (min-max) "
        "| loaded ms median (min-max) | loaded GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    load = gemm_load(args.load_ms, torch.device("cuda"))
    sweep = (args.programs_per_sm, args.block_rows, args.warps)
    launches = list(itertools.product(*([int(v) for v in arg.split(",")] for arg in sweep)))
    differ = []
    for name in args.preset.split(","):
        for token_count in (int(t) for t in args.tokens.split(",")):
            for row in bench(name, token_count, launches, args.iters, args.warmup, load):
                same = {None: "n/a", True: "yes", False: "**no**"}[row["bitwise"]]
                if row["bitwise"] is False:
                    differ.append(f"{name} {token_count}: {row['launch']}")
                idle, loaded = row["idle"], row["loaded"]
                lines.append(
                    f"| {row['preset']} | {row['tokens']} | {row['launch']} | {same} "
                    f"| {idle[0]:.3f} ({idle[1]:.3f}-{idle[2]:.3f}) "
                    f"| {loaded[0]:.3f} ({loaded[1]:.3f}-{loaded[2]:.3f}) | {row['gb_s']:.0f} |"
                )
                print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    if differ:
        raise AssertionError("results differ from the first launch's: " + "; ".join(differ))


if __name__ == "__main__":
    main()
