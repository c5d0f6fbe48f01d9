"""The warp-specialized Gluon grouped GEMM against the tl kernel it would replace, one GPU.

    PYTHONPATH=src python3 benchmarks/warp_specialized.py [--tokens 8192] [--out F]

The product timed is the down projection of the expert MLP, out[group e] = h[group e] @ W_down[e].T
(h [M, I], W_down [E, H, I]), at each preset's shape with every expert on this GPU and near-uniform
top-k routing (rows = tokens x k). Both kernels get the same inputs; first their results are
compared (bitwise on the groups' rows, and with fp32 math), then each is timed: CUDA events around
each call, median and the 10-90 % range over alternating input sets, the two kernels interleaved.
"% of dense" divides by cuBLAS (torch.mm) at 8192^3 in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys

import torch
from expert_kernels import dense_tflops, near_uniform_sizes, randn

import mok
from mok.bench import git_commit
from mok.kernels import default_config
from mok.kernels import grouped_gemm as gg
from mok.kernels import warp_specialized as ws
from mok.kernels.grouped_gemm import GemmTiles, row_tile_map
from mok.testing import relative_error

PRESETS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2")
GLUON_TILES = {
    "gluon 128x128": GemmTiles(128, 128, 64, num_warps=4, num_stages=4),
    "gluon 64x256": GemmTiles(64, 256, 64, num_warps=4, num_stages=4),
}


def time_each(fns: dict, inputs: int, iters: int = 30) -> dict[str, tuple[float, float, float]]:
    """name -> (median, 10th, 90th percentile) ms; calls interleaved across names and inputs."""
    for fn in fns.values():
        for i in range(inputs):
            fn(i)
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    for it in range(iters):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(it % inputs)
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    result = {}
    for name, pairs in events.items():
        times = sorted(a.elapsed_time(b) for a, b in pairs)
        deciles = statistics.quantiles(times, n=10)
        result[name] = (statistics.median(times), deciles[0], deciles[-1])
    return result


def bench(name: str, tokens: int, dense: float, gen) -> list[str]:
    shape = mok.PRESETS[name]
    experts, hidden, inter, top_k = (
        shape.num_experts,
        shape.hidden_size,
        shape.intermediate_size,
        shape.top_k,
    )
    sets = []
    for _ in range(2):
        sizes = near_uniform_sizes(tokens, top_k, experts, gen)
        m = sum(sizes)
        offsets = torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32)
        h = randn(m, inter, gen=gen)
        sets.append((h, offsets))
    w_down = randn(experts, hidden, inter, gen=gen, scale=inter**-0.5)
    m = sets[0][0].shape[0]
    tl_cfg = default_config(torch.device("cuda"), hidden, inter, m / experts).down
    configs = {f"tl {tl_cfg.block_m}x{tl_cfg.block_n}": tl_cfg, **GLUON_TILES}
    maps = {
        (i, cfg.block_m): row_tile_map(offsets, h.shape[0], cfg.block_m)
        for i, (h, offsets) in enumerate(sets)
        for cfg in configs.values()
    }

    def runner(label, cfg):
        kernel = gg.down if label.startswith("tl") else ws.rows_wt
        return lambda i: kernel(sets[i][0], w_down, maps[i, cfg.block_m], cfg)

    fns = {label: runner(label, cfg) for label, cfg in configs.items()}
    h, offsets = sets[0]
    results = {label: fn(0) for label, fn in fns.items()}
    bounds = offsets.tolist()
    expected = torch.cat(
        [
            h[a:b].float() @ w_down[e].float().T
            for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
        ]
    )
    tl_label = next(iter(configs))
    lines = []
    times = time_each(fns, len(sets))
    flops = 2 * m * hidden * inter
    for label in configs:
        error = relative_error(results[label], expected)
        bitwise = torch.equal(results[label], results[tl_label])
        ms, low, high = times[label]
        tflops = flops / ms / 1e9
        lines.append(
            f"| {name} | {tokens} | {m} | {label} | {ms:.3f} ({low:.3f}-{high:.3f}) | "
            f"{tflops:.0f} | {100 * tflops / dense:.0f} % | {error:.2e} | "
            f"{'yes' if bitwise else 'no'} |"
        )
        if error > 4e-3:
            raise AssertionError(f"{name} {label}: relative error {error:.2e} against fp32")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192", help="comma-separated token counts")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dense = dense_tflops(8192, 8192, 8192, gen)
    commit = git_commit()
    header = [
        f"# Warp-specialized Gluon grouped GEMM vs tl, down projection ({datetime.date.today()})",
        "",
        f"- commit {commit}; {torch.cuda.get_device_name()}; torch "
        f"{torch.__version__}; command: `{' '.join(sys.argv)}`",
        f"- cuBLAS dense 8192^3 in this run: {dense:.0f} TFLOP/s",
        "",
        "| preset | tokens | rows | kernel | ms (10-90 %) | TFLOP/s | % of dense | "
        "error vs fp32 | bitwise = tl |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines = list(header)
    print("\n".join(header), flush=True)
    for name in args.presets.split(","):
        for tokens in map(int, args.tokens.split(",")):
            rows = bench(name, tokens, dense, gen)
            print("\n".join(rows), flush=True)
            lines += rows
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
