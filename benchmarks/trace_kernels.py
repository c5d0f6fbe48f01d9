"""Per-call times of chosen kernels in a profiled step's Chrome trace, grouped by position.

`train_e2e.py --profile N --trace DIR` writes one trace per implementation. This lists the kernels
whose names match a pattern (default: the expert products, ours and CUTLASS's) in the order they
ran, and, with `--period P` (the kernels of one layer, e.g. 2 forward or 4 backward products),
the mean of each position over the repeats: one product's time per layer inside the model, to set
beside the same product timed alone (`warp_specialized.py`).

    python benchmarks/trace_kernels.py DIR/trace-mok.json [--pattern REGEX] [--period P --skip S]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

from trace_gaps import gpu_kernels

PRODUCTS = r"enable_3x_kernel|_rows_wt_kernel|_group_at_b_kernel"
"""The expert products: CUTLASS's grouped GEMM (`torch._grouped_mm`) and our Gluon kernels."""


def matching_kernels(path: str, pattern: str) -> list[tuple[str, float]]:
    """(name, milliseconds) of every GPU kernel of the trace at `path` whose name matches, in the
    order they started."""
    return [
        (e["name"], e["dur"] / 1e3)
        for e in gpu_kernels(path)
        if e["cat"] == "kernel" and re.search(pattern, e["name"])
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--pattern", default=PRODUCTS, help="regular expression on kernel names")
    parser.add_argument("--skip", type=int, default=0, help="matching kernels before the periods")
    parser.add_argument("--period", type=int, default=0, help="kernels a repeat (a layer)")
    args = parser.parse_args(argv)
    for path in args.traces:
        kernels = matching_kernels(path, args.pattern)
        print(f"## {path}: {len(kernels)} kernels, {sum(ms for _, ms in kernels):.3f} ms")
        for i, (name, ms) in enumerate(kernels):
            print(f"{i:4d} {ms:8.3f} ms  {name[:100]}")
        if args.period:
            body = [ms for _, ms in kernels[args.skip :]]
            repeats = len(body) // args.period
            print(f"mean over {repeats} repeats of {args.period}, after {args.skip}:")
            for position in range(args.period):
                times = body[position : repeats * args.period : args.period]
                print(f"  position {position}: {statistics.mean(times):.3f} ms  {times}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
