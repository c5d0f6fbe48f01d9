"""The `mok` command line (also `python -m mok ...`): `mok bench` checks and times the layer
next to the PyTorch baseline, `mok env` reports what this machine can run, `mok memory` sizes the
NVLink exchange's buffers."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from mok import __version__
from mok.backends import BACKENDS
from mok.bench import (
    H200_DENSE_BF16_TFLOPS,
    NOISY_NOTE,
    PASSES,
    REFERENCE_NOTE,
    REPORT_NAME,
    BenchSpec,
    estimated_peak_bytes,
    json_report,
    matplotlib_available,
    report_header,
    run_bench,
    write_report,
)
from mok.config import (
    Backend,
    Graphs,
    MXWeightCasts,
    Precision,
    Recompute,
    RouterGradient,
    Validation,
)
from mok.errors import MoKConfigError
from mok.presets import PRESETS
from mok.ranks import RankFailedError
from mok.routing import ROUTINGS

GPU_DEFAULT_PRESET = "qwen3-235b-a22b"
"""`mok bench`'s layer on GPUs: a real model's shape (128 experts, top 8, H 4096, I 1536, 8192
tokens a rank; 4.8 GB of expert weights at EP 1), where the layer's work, not the host's launches,
sets the time. The `tiny` preset stays the CPU's default: there the backend is the reference."""


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _preset_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no preset named")
    for name in names:
        if name not in PRESETS:
            known = ", ".join(sorted(PRESETS))
            raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {known})")
    return names


def _precisions(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = [p.value for p in Precision]
    for name in names or [""]:
        if name not in known:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {name!r} (choose from {', '.join(known)})"
            )
    return names


def _positive_ints(text: str) -> list[int]:
    try:
        return [_positive_int(item) for item in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected integers >= 1 separated by commas, got {text!r}"
        ) from None


class _HelpFormatter(argparse.HelpFormatter):
    """Help that ends with each option's default where it has one and its text does not name it
    already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" not in text
            and not any(default is absent for absent in (None, False, argparse.SUPPRESS))
            and action.option_strings
        ):
            shown = ",".join(map(str, default)) if isinstance(default, list) else default
            text += f" (default: {shown})"
        return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mok", description=__doc__, formatter_class=_HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_bench(commands)
    _add_env_and_memory(commands)
    return parser


def _add_bench(commands) -> None:
    """`mok bench` and its options, in groups: what runs, the layer's options, how it is timed,
    where the results go."""
    bench = commands.add_parser(
        "bench",
        formatter_class=_HelpFormatter,
        help="time the MoE layer forward and forward+backward next to the PyTorch baseline",
        description="Check the layer and the standard PyTorch path (mok.baseline) against the "
        "reference backend (same group and weights), then time both forward and forward+backward "
        "on the same inputs, for every preset and expert-parallel size given, spawning the ranks "
        "itself (or joining a torchrun job).",
    )
    _add_workload_options(bench.add_argument_group("what runs"))
    _add_layer_options(bench.add_argument_group("the layer's options"))
    _add_timing_options(bench.add_argument_group("timing"))
    _add_output_options(bench.add_argument_group("output"))
    bench.set_defaults(command_parser=bench)


def _add_workload_options(workload) -> None:
    """`mok bench`: the shapes, sizes, routing and device that run."""
    workload.add_argument(
        "--preset",
        type=_preset_names,
        default=None,
        metavar="NAME[,NAME...]",
        help=f"layer shapes, comma-separated: {', '.join(sorted(PRESETS))} (default: "
        f"{GPU_DEFAULT_PRESET} on GPUs, tiny on the CPU)",
    )
    workload.add_argument(
        "--ep",
        type=_positive_ints,
        default=None,
        metavar="N[,N...]",
        help="expert-parallel sizes, comma-separated (default: 2 on the CPU, all GPUs on CUDA)",
    )
    workload.add_argument(
        "--tokens",
        type=_positive_int,
        default=None,
        help="tokens per rank (default: each preset's)",
    )
    workload.add_argument(
        "--routing",
        choices=ROUTINGS,
        default="uniform",
        help="how tokens pick experts: uniform (top-k of a softmax over random logits), zipf "
        "(skewed popularity), one-expert, half-empty, first-experts",
    )
    workload.add_argument(
        "--seed", type=int, default=0, help="seed of the weights, inputs and routing"
    )
    workload.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda when a GPU is present",
    )


def _add_layer_options(layer) -> None:
    """`mok bench`: the layer's `MoKConfig` options."""
    layer.add_argument(
        "--backend",
        choices=[b.value for b in Backend],
        default="auto",
        help="the implementation timed: auto (the fastest that runs here: triton on CUDA GPUs, "
        "the reference on the CPU), triton, fused, or reference (the plain-PyTorch oracle)",
    )
    layer.add_argument(
        "--precision",
        type=_precisions,
        default=["bf16"],
        metavar="P[,P...]",
        help="the layer's precisions, comma-separated: bf16, mxfp8, fp8_block (the 128-block "
        "recipe), each beside the bf16 baseline; bf16,mxfp8 times both in one run",
    )
    layer.add_argument(
        "--swiglu-limit",
        type=_positive_float,
        default=None,
        metavar="L",
        help="clamp the experts' pre-activations at L (default: the preset's; gpt-oss's 7)",
    )
    layer.add_argument(
        "--pair-capacity-factor",
        type=_positive_float,
        default=None,
        metavar="C",
        help="size the backend's per-rank expert buffers for C x the mean pairs (T x k) "
        "instead of the worst case, the default (less memory; a routing that needs more raises "
        "MoKCapacityError after timing)",
    )
    layer.add_argument(
        "--exact-buffers",
        action="store_true",
        help="size the backend's per-pair tensors by the pairs each call received, read on the "
        "host (one synchronization per forward; the memory of an exact all-to-all)",
    )
    layer.add_argument(
        "--validation",
        choices=[v.value for v in Validation],
        default=Validation.COLLECTIVE.value,
        help="how the ranks check each call's inputs: agreeing on them (one host round trip a "
        "call) or each its own (local)",
    )
    layer.add_argument(
        "--graphs",
        choices=[g.value for g in Graphs],
        default=Graphs.AUTO.value,
        help="whether the backend's layer replays its calls from its own CUDA graphs (auto: small "
        "layers, bound by the host; on; off: every call launches its kernels)",
    )
    layer.add_argument(
        "--mx-weight-casts",
        choices=[c.value for c in MXWeightCasts],
        default=MXWeightCasts.AUTO.value,
        help="with --precision mxfp8: when the layer casts its weights (auto: in every timed "
        "pass, as a training step does; keep: once, the weights being fixed between iterations; "
        "per_pass)",
    )
    layer.add_argument(
        "--recompute",
        choices=[r.value for r in Recompute],
        default=Recompute.NONE.value,
        help="with bf16 experts: gate_up makes the experts' h and pre-activations again in the "
        "backward (one more gate/up product) instead of keeping them from the forward",
    )
    layer.add_argument(
        "--router-gradient",
        choices=[r.value for r in RouterGradient],
        default=RouterGradient.SAVED_OUTPUTS.value,
        help="with bf16 experts: epilogue forms the router weights' "
        "gradient in the down product's backward, so that the forward keeps no pair outputs "
        "(T x k x H a layer)",
    )


def _add_timing_options(timing) -> None:
    """`mok bench`: how the passes are checked and timed."""
    timing.add_argument("--iters", type=_positive_int, default=20, help="timed iterations per pass")
    timing.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=5,
        help="untimed iterations before them (compiling kernels, filling caches)",
    )
    timing.add_argument(
        "--check-tokens",
        type=_positive_int,
        default=1024,
        help="tokens per rank of the correctness check before timing",
    )
    timing.add_argument(
        "--accumulate-grads",
        action="store_true",
        help="keep the weights' gradients between iterations, as gradient accumulation over "
        "micro-batches does (every backward adds into existing .grad), instead of setting them to "
        "None",
    )
    timing.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time the backend's layer replayed from one CUDA graph per pass, captured on the "
        "timed inputs after checking that a replay equals the eager pass bit for bit (the layer "
        "never synchronizes with the host, so it can be captured; the baseline reads its split "
        "sizes on the host and stays eager)",
    )
    timing.add_argument(
        "--dense-tflops",
        type=_positive_float,
        default=None,
        help="dense bf16 TFLOP/s of one device, which defines the compute floor (FLOPs / rate) "
        f"that times are compared with (default on CUDA: {H200_DENSE_BF16_TFLOPS:g}, cuBLAS on "
        "an H200; on the CPU: no floor unless given)",
    )


def _add_output_options(output) -> None:
    """`mok bench`: where the results go."""
    output.add_argument(
        "--json", metavar="PATH", help="also write the results as JSON (as in --out)"
    )
    output.add_argument(
        "--out",
        metavar="DIR",
        help=f"write {REPORT_NAME}.json, {REPORT_NAME}.md and {REPORT_NAME}.png (needs "
        "matplotlib: pip install 'mok[bench]') into DIR, stamped with date, commit and machine",
    )
    output.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_env_and_memory(commands) -> None:
    """`mok env` and `mok memory`."""
    env = commands.add_parser(
        "env",
        help="what this machine offers and which backends can run",
        formatter_class=_HelpFormatter,
    )
    env.add_argument("--json", action="store_true", help="print JSON instead of tables")

    memory = commands.add_parser(
        "memory",
        help="the symmetric buffer each rank allocates for a layer shape, without allocating it",
        description="Bytes per region of the NVLink exchange's symmetric buffer that each rank "
        "allocates on GPUs for layers of a preset's shape (one buffer shared by all layers of "
        "that shape), for each EP size: what --pair-capacity-factor and the backend change.",
        formatter_class=_HelpFormatter,
    )
    memory.add_argument(
        "--preset",
        type=_preset_names,
        default=["deepseek-v3"],
        metavar="P[,P]",
        help="layer shapes, comma-separated",
    )
    memory.add_argument(
        "--ep",
        type=_positive_ints,
        default=[2, 8],
        metavar="N[,N...]",
        help="expert-parallel sizes, comma-separated",
    )
    memory.add_argument(
        "--tokens",
        type=_positive_int,
        default=None,
        help="tokens per rank (default: each preset's)",
    )
    memory.add_argument(
        "--backend",
        choices=("triton", "fused"),
        default="triton",
        help="whose buffer layout: triton or fused",
    )
    memory.add_argument(
        "--pair-capacity-factor",
        type=_positive_float,
        default=None,
        metavar="C",
        help="expert rows per rank for C x the mean pairs (T x k) instead of the worst case",
    )
    memory.add_argument(
        "--router-gradient",
        choices=[r.value for r in RouterGradient],
        default=RouterGradient.SAVED_OUTPUTS.value,
        help="epilogue: the layout of router_gradient='epilogue' (the triton backend's holds no "
        "pair gradients)",
    )
    memory.set_defaults(command_parser=memory)


def _bench(args, parser: argparse.ArgumentParser, command: str) -> int:
    """`mok bench`: the options checked (a one-line error before anything runs), the runs, their
    tables, and the reports asked for."""
    from rich.console import Console

    device, eps = _bench_device_and_eps(args, parser)
    dense_tflops = args.dense_tflops
    if dense_tflops is None and device == "cuda":
        dense_tflops = H200_DENSE_BF16_TFLOPS
    specs = _bench_specs(args, device, eps, dense_tflops)
    _check_bench_specs(args, parser, specs, device)
    console = Console()
    if args.out and not matplotlib_available():
        console.print("matplotlib is not installed: --out writes no PNG (pip install 'mok[bench]')")
    try:
        results = run_bench(specs)
    except (torch.OutOfMemoryError, RankFailedError) as error:
        # A spawned rank's failure arrives as the text of its traceback.
        if not isinstance(error, torch.OutOfMemoryError) and "OutOfMemoryError" not in str(error):
            raise
        largest = max(specs, key=estimated_peak_bytes)
        need, have = _memory_need_and_size(largest)
        message = _memory_message(largest, need, have, ran_out=True)
        parser.exit(1, f"mok bench: error: {message}\n")
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return 0
    for result in results:
        _print_bench_result(console, result, device, dense_tflops)
    header = report_header(device, dense_tflops, command)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(json_report(header, results), handle, indent=2)
    if args.out:
        for path in write_report(Path(args.out), header, results):
            console.print(f"wrote {path}")
    return 0


def _bench_device_and_eps(args, parser: argparse.ArgumentParser) -> tuple[str, list[int]]:
    """(the device, the EP sizes) of a `mok bench` run, its presets filled in where not given;
    `parser.error` for options that cannot run here."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA GPU")
    if args.cuda_graph and args.exact_buffers:
        parser.error(
            "--cuda-graph with --exact-buffers: the exact sizes are read on the host at every "
            "call, which a CUDA graph cannot capture"
        )
    if args.graphs == Graphs.ON.value and device != "cuda":
        parser.error(
            "--graphs on: the layer's CUDA graphs need a CUDA GPU (the layer runs on the CPU here)"
        )
    if args.cuda_graph and device != "cuda":
        parser.error("--cuda-graph: CUDA graphs need a CUDA GPU (the layer runs on the CPU here)")
    if args.preset is None:
        args.preset = [GPU_DEFAULT_PRESET if device == "cuda" else "tiny"]
    eps = args.ep
    if eps is None:
        eps = [max(torch.cuda.device_count(), 1) if device == "cuda" else 2]
    for name in args.preset:
        experts = PRESETS[name].num_experts
        for ep in eps:
            if experts % ep:
                parser.error(
                    f"--ep {ep}: preset {name}'s {experts} experts cannot be split evenly over "
                    f"{ep} ranks"
                )
            if device == "cuda" and ep > torch.cuda.device_count():
                parser.error(
                    f"--ep {ep} needs {ep} GPUs (one per rank); this machine has "
                    f"{torch.cuda.device_count()}"
                )
    return device, eps


def _bench_specs(args, device: str, eps: list[int], dense_tflops: float | None) -> list[BenchSpec]:
    """One run per preset, EP size and precision asked for."""
    return [
        BenchSpec(
            preset=preset,
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
            dense_tflops=dense_tflops,
            pair_capacity_factor=args.pair_capacity_factor,
            exact_buffers=args.exact_buffers,
            accumulate_grads=args.accumulate_grads,
            validation=args.validation,
            graphs=args.graphs,
            mx_weight_casts=args.mx_weight_casts,
            recompute=args.recompute,
            router_gradient=args.router_gradient,
            precision=precision,
            cuda_graph=args.cuda_graph,
        )
        for preset in args.preset
        for ep in eps
        for precision in args.precision
    ]


def _check_bench_specs(args, parser: argparse.ArgumentParser, specs, device: str) -> None:
    """`parser.error` for a run that cannot start: a config the options make invalid, a backend
    that cannot run it here, memory it would not fit in, a report path that cannot be written."""
    for spec in specs:
        try:
            config = spec.config()
        except MoKConfigError as error:
            parser.error(f"{spec.preset} in {spec.precision}: {error}")
        if args.backend != "auto":
            backend = BACKENDS[Backend(args.backend)]
            reason = backend.unavailable_reason(config, torch.device(device), None)
            if reason is not None:
                parser.error(
                    f"--backend {args.backend} cannot run {spec.preset} in {spec.precision} "
                    f"here: {reason}"
                )
        need, have = _memory_need_and_size(spec)
        if need > have:
            parser.error(_memory_message(spec, need, have))
    for option, path in (("--out", args.out), ("--json", args.json)):
        if path is not None:
            problem = _unwritable(Path(path) if option == "--out" else Path(path).parent)
            if problem:
                parser.error(f"{option} {path}: {problem}")


def _print_bench_result(console, result, device: str, dense_tflops: float | None) -> None:
    """One run's table (forward and forward+backward beside the baseline) and its check."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    floor = (
        f"x floor: time / (FLOPs / {dense_tflops:g} TFLOP/s dense bf16, --dense-tflops)"
        if dense_tflops is not None
        else "no compute floor (pass --dense-tflops)"
    )
    spec = result.spec
    title = (
        f"mok bench: {spec.preset}, ep={spec.ep}, {spec.tokens_per_rank} tokens/rank, "
        f"{spec.routing} routing, backend={result.backend.name}"
        + (" (the oracle, not a fast path)" if result.is_oracle else "")
        + f", {device}"
    )
    caption = (
        "per rank; time: median over iterations of the slowest rank, min-max: its fastest "
        f"and slowest iteration; {floor}; peak memory: "
        f"{result.memory_kind}; speedup: baseline time / backend time"
    )
    if any(result.noisy(pass_name) for pass_name in PASSES):
        caption += f"; {NOISY_NOTE}"
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD)
    columns, rows = result.table()
    for index, column in enumerate(columns):
        # Headers on three lines: the table fits 80 columns (a pipe's width) uncut.
        header = column.replace("forward+backward", "forward+\nbackward")
        table.add_column(header, justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if result.is_oracle:
        console.print(f"[bold]Note:[/bold] {escape(REFERENCE_NOTE)}")
    console.print("checked against the reference backend (relative error):")
    for measurement in (result.backend, result.baseline):
        errors = ", ".join(f"{n} {e:.1e}" for n, e in measurement.check_errors.items())
        console.print(f"  {measurement.name}: {errors or 'the oracle itself, not checked'}")


def _memory_need_and_size(spec: BenchSpec) -> tuple[int, int]:
    """(bytes the run of `spec` needs at least, about, bytes it has): per GPU, one rank each; on
    the CPU all its ranks share the host's memory."""
    need = estimated_peak_bytes(spec)
    if spec.device == "cuda":
        return need, torch.cuda.get_device_properties(0).total_memory
    return spec.ep * need, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _memory_message(spec: BenchSpec, need: int, have: int, ran_out: bool = False) -> str:
    """One line: the run of `spec` does not fit its device's memory (`ran_out`: it ran out of it,
    past the estimate), and what to change."""
    where = "per GPU" if spec.device == "cuda" else f"for its {spec.ep} ranks on the CPU"
    device = "the GPU" if spec.device == "cuda" else "this host"
    needs = "ran out of memory: it needs" if ran_out else "needs"
    return (
        f"{spec.preset} at {spec.tokens_per_rank} tokens/rank, EP {spec.ep}, {needs} at least "
        f"about {need / 2**30:.1f} GiB {where} (weights, "
        f"their gradients, the activations kept for backward, the exchange's buffers); {device} "
        f"has {have / 2**30:.1f} GiB: lower --tokens, or use more GPUs (--ep), or "
        "--pair-capacity-factor / --exact-buffers"
    )


def _unwritable(folder: Path) -> str | None:
    """Why results cannot be written into `folder` (created if missing), or None; checked before
    the run so that a long benchmark does not end in an error."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        return f"cannot write there ({error.strerror or error})"
    return None


def _env(args) -> int:
    from mok.env import collect_env, print_env

    info = collect_env()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print_env(info)
    return 0


def _memory(args, parser: argparse.ArgumentParser) -> int:
    """`mok memory`: the symmetric buffer's regions in GiB, one table per preset with a column
    per EP size (narrow enough for 80 columns and pipes)."""
    from rich.console import Console
    from rich.table import Table

    import mok

    options = f"{args.backend} backend"
    if args.router_gradient != RouterGradient.SAVED_OUTPUTS.value:
        options += f", router_gradient={args.router_gradient}"
    console = Console()
    for name in args.preset:
        regions_by_ep = {}
        for ep in args.ep:
            if PRESETS[name].num_experts % ep:
                parser.error(
                    f"--ep {ep}: preset {name}'s {PRESETS[name].num_experts} experts cannot be "
                    f"split evenly over {ep} ranks"
                )
            spec = BenchSpec(
                preset=name,
                ep=ep,
                tokens=args.tokens,
                backend=args.backend,
                pair_capacity_factor=args.pair_capacity_factor,
                router_gradient=args.router_gradient,
            )
            regions_by_ep[ep] = mok.symmetric_buffer_bytes(spec.config(), ep)
        table = Table(
            title=f"{name}, {spec.tokens_per_rank} tokens/rank",
            caption=f"symmetric buffer per rank, GiB ({options}); none at EP 1",
        )
        table.add_column("region")
        for ep in regions_by_ep:
            table.add_column(f"EP {ep}", justify="right")
        names = dict.fromkeys(region for regions in regions_by_ep.values() for region in regions)
        for region in names:
            table.add_row(
                region,
                *(
                    f"{regions[region] / 2**30:.3f}" if region in regions else "-"
                    for regions in regions_by_ep.values()
                ),
            )
        table.add_row(
            "total",
            *(f"{sum(regions.values()) / 2**30:.3f}" for regions in regions_by_ep.values()),
            end_section=False,
            style="bold",
        )
        console.print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args, args.command_parser, shlex.join(["mok", *argv]))
    if args.command == "memory":
        return _memory(args, args.command_parser)
    return _env(args)


if __name__ == "__main__":
    sys.exit(main())
