"""The `mok` command line: `mok bench` and `mok env` (also `python -m mok ...`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from mok.presets import PRESETS
from mok.routing import ROUTINGS


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mok", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser(
        "bench",
        help="time the MoE layer forward and forward+backward",
        description="Check the layer against the single-process reference, then time forward "
        "and forward+backward at an expert-parallel size, spawning the ranks itself (or joining "
        "a torchrun job).",
    )
    bench.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="layer shape")
    bench.add_argument(
        "--ep",
        type=_positive_int,
        default=None,
        help="expert-parallel size (default: 2 on the CPU, all GPUs on CUDA)",
    )
    bench.add_argument(
        "--tokens",
        type=_non_negative_int,
        default=None,
        help="tokens per rank (default: the preset's)",
    )
    bench.add_argument("--backend", default="auto", help="auto, reference, ...")
    bench.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda when a GPU is present",
    )
    bench.add_argument("--routing", choices=ROUTINGS, default="uniform")
    bench.add_argument("--iters", type=_positive_int, default=20)
    bench.add_argument("--warmup", type=_non_negative_int, default=5)
    bench.add_argument(
        "--check-tokens",
        type=_positive_int,
        default=1024,
        help="tokens per rank of the correctness check before timing",
    )
    bench.add_argument("--swiglu-limit", type=float, default=None)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    bench.add_argument("--no-progress", action="store_true")

    env = commands.add_parser("env", help="what this machine offers and which backends can run")
    env.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return parser


def _bench(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from mok.bench import BenchSpec, run_bench

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    ep = args.ep
    if ep is None:
        ep = max(torch.cuda.device_count(), 1) if device == "cuda" else 2
    spec = BenchSpec(
        preset=args.preset,
        ep=ep,
        tokens=args.tokens,
        backend=args.backend,
        device=device,
        routing=args.routing,
        iters=args.iters,
        warmup=args.warmup,
        check_tokens=args.check_tokens,
        swiglu_limit=args.swiglu_limit,
        seed=args.seed,
        progress=not args.no_progress,
    )
    result = run_bench(spec)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return 0
    console = Console()
    title = (
        f"mok bench: {spec.preset}, ep={spec.ep}, {spec.tokens_per_rank} tokens/rank, "
        f"{spec.routing} routing, backend={result.backend}, {device}"
    )
    table = Table(title=title)
    for column in ("pass", "time (median)", "TFLOP/s per rank", "peak memory per rank"):
        table.add_column(column)
    for row in result.rows():
        table.add_row(*row)
    console.print(table)
    errors = ", ".join(f"{name} {err:.1e}" for name, err in result.check_errors.items())
    console.print(f"checked against the single-process reference (relative error): {errors}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dataclasses.asdict(result), handle, indent=2)
    return 0


def _env(args) -> int:
    from mok.env import collect_env, print_env

    info = collect_env()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print_env(info)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    return _env(args)


if __name__ == "__main__":
    sys.exit(main())
