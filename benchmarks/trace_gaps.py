"""The GPU timeline of a Chrome trace written by profile_layer.py --trace: every kernel in order
with its start (ms from the first kernel), duration, the idle gap before it, its stream and grid,
then the total busy and idle time. Shows whether a GPU waits for the host (gaps) or for its peer
(barriers), and which kernels ran beside which (the fused backend's two streams).

    python benchmarks/trace_gaps.py TRACE.json.gz [--min-gap-us 20]
"""

from __future__ import annotations

import argparse
import gzip
import json


def gpu_kernels(path: str) -> list[dict]:
    """The trace's GPU kernel and memcpy/memset events, sorted by start."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as file:
        events = json.load(file)["traceEvents"]
    kinds = {"kernel", "gpu_memcpy", "gpu_memset"}
    return sorted((e for e in events if e.get("cat") in kinds), key=lambda e: e["ts"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--min-gap-us", type=float, default=20.0)
    args = parser.parse_args()
    kernels = gpu_kernels(args.trace)
    if not kernels:
        raise SystemExit("no GPU events in the trace")
    origin, busy, idle, end = kernels[0]["ts"], 0.0, 0.0, kernels[0]["ts"]
    print(f"{'start ms':>9} {'gap us':>8} {'dur us':>9} {'stream':>6} {'grid':>14}  kernel")
    for event in kernels:
        gap = max(0.0, event["ts"] - end)
        idle += gap
        busy += event["dur"]
        name = event["name"][:90]
        if gap >= args.min_gap_us or event["dur"] >= 50 or "barrier" in name:
            start = (event["ts"] - origin) / 1e3
            details = event.get("args", {})
            grid = "x".join(str(n) for n in details.get("grid", [])) or "-"
            stream = details.get("stream", "-")
            print(f"{start:9.3f} {gap:8.1f} {event['dur']:9.1f} {stream:>6} {grid:>14}  {name}")
        end = max(end, event["ts"] + event["dur"])
    print(
        f"span {(end - origin) / 1e3:.3f} ms, kernels {busy / 1e3:.3f} ms, idle {idle / 1e3:.3f} ms"
    )


if __name__ == "__main__":
    main()
