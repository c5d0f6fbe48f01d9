"""Peak GPU memory of one layer call per rank, by implementation, with the symmetric buffers
counted: the figures of issue 13's memory target.

    python benchmarks/peak_memory.py [--preset deepseek-v3,qwen3-235b-a22b] [--tokens 8192]
                                     [--ep 2] [--backends baseline,triton,fused,...]
                                     [--pair-capacity 1.25 | --exact-buffers]
                                     [--keep-grouped-rows]
                                     [--precision mxfp8]
                                     [--snapshots DIR]
                                     [--out results.md]

One rank per GPU where the machine has EP GPUs (nccl); otherwise the EP ranks share GPU 0 (a gloo
group, the NVLink exchange's symmetric memory stood in for by CUDA IPC, the baseline's
all-to-all through gloo): each process's memory is its own, so the figures hold; times would not
and are not taken. Per implementation, on the same global weights and a rank's random bf16 x
with uniform routing, after one warm-up forward + backward (kernels compiled, buffers made, the
weights' gradients dropped again):

- `weights` the memory allocated before the measured call (the rank's weights and inputs);
- `workspace` what the layer keeps between calls (its exchange's buffers, constants), with this
  rank's symmetric buffer counted whether or not PyTorch's caching allocator made it (symmetric
  memory is mapped outside it; the IPC stand-in puts every rank's buffer on the first rank);
- `saved` what one forward holds until its backward (its output included);
- `forward peak` and `backward peak` the most allocated above `weights` + `workspace` during each
  pass (the backward's includes the weights' gradients it makes);
- `peak` = `weights` + `workspace` + the larger pass peak: what `mok bench`'s peak column means.

--pair-capacity F sizes the backends' receive buffers for F x the mean pairs a rank receives
(T x k) instead of the worst case (every pair of every rank: EP x T x k rows), the
`recv_pair_capacity` option: pairs beyond it would be dropped and reported by `check()`.
--exact-buffers sizes them by the pairs each call received, read on the host (the
`exact_buffers` option: one synchronization per forward).
--keep-grouped-rows keeps the grouped rows for the backward (the option of that name) instead of
the tokens they copy (x at EP 1; the tokens received for the fused backend at EP > 1).

--precision: the backends' (the baseline stays bf16; the fused backend computes bf16 only).

A backend named with `-recompute` (`triton-recompute`, `fused-recompute`) runs with
`recompute="gate_up"`: its experts' h and pre-activations made again in the backward.

--snapshots writes a CUDA memory snapshot of each measured call (`torch.cuda.memory
._dump_snapshot`, viewable at pytorch.org/memory_viz) for finding which tensors make a peak.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os

import torch
import torch.distributed as dist

import mok
from mok.baseline import BaselineMoE
from mok.comm.memory import simulated_symmetric_memory
from mok.ranks import run_ranks
from mok.routing import make_routing
from mok.testing import cuda_ipc_allocator, global_weights

GIB = 2**30


def symmetric_bytes(layer: mok.MoE, device: torch.device, rank: int) -> tuple[int, int]:
    """(this rank's symmetric buffer bytes, of them the bytes this process's caching allocator
    holds) of `layer`'s exchange; (0, 0) without an NVLink exchange."""
    from mok.comm.symmetric import SymmetricExchangeBase
    from mok.testing import SharedBufferHandle

    exchange = getattr(layer.workspace(device).backend, "exchange", None)
    if not isinstance(exchange, SymmetricExchangeBase):
        return 0, 0
    nbytes = exchange.buffer_bytes
    handle = exchange.handle
    if isinstance(handle, SharedBufferHandle):  # the IPC stand-in: rank 0 allocated them all
        return nbytes, handle.whole.numel() if rank == 0 else 0
    return nbytes, 0


def one_call(layer, x, idx, weights, grad_y, record):
    """Forward then backward of `layer`; returns (forward peak, saved, backward peak) bytes above
    the memory allocated before the call."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with record("forward"):
        y = layer(x, idx, weights)
        torch.cuda.synchronize()
    forward_peak = torch.cuda.max_memory_allocated() - before
    saved = torch.cuda.memory_allocated() - before
    torch.cuda.reset_peak_memory_stats()
    with record("backward"):
        y.backward(grad_y)
        torch.cuda.synchronize()
    backward_peak = torch.cuda.max_memory_allocated() - before
    return forward_peak, saved, backward_peak


def measure(name, layer, inputs, device, rank, snapshot_path):
    x, idx, weights, grad_y = inputs

    def drop_gradients():
        layer.zero_grad(set_to_none=True)
        x.grad = weights.grad = None

    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    one_call(layer, *inputs, lambda _: contextlib.nullcontext())
    drop_gradients()
    gc.collect()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - start
    sym_bytes, sym_counted = symmetric_bytes(layer, device, rank) if name != "baseline" else (0, 0)
    workspace = kept - sym_counted + sym_bytes

    @contextlib.contextmanager
    def record(label):
        if snapshot_path is None:
            yield
            return
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=400_000)
        try:
            yield
        finally:
            torch.cuda.memory._dump_snapshot(f"{snapshot_path}-{label}.pickle")
            torch.cuda.memory._record_memory_history(enabled=None)

    forward_peak, saved, backward_peak = one_call(layer, *inputs, record)
    drop_gradients()
    return {
        "weights": start,
        "workspace": workspace,
        "symmetric": sym_bytes,
        "saved": saved,
        "forward peak": forward_peak,
        "backward peak": backward_peak,
        "peak": start + workspace + max(forward_peak, backward_peak),
    }


def rank_inputs(config, rank, tokens, device):
    generator = torch.Generator(device=device).manual_seed(1000 + rank)
    x = torch.randn(tokens, config.hidden_size, generator=generator, device=device)
    idx, weights = make_routing(
        "uniform", tokens, config.num_experts, config.top_k, generator, device
    )
    grad_y = torch.randn(tokens, config.hidden_size, generator=generator, device=device)
    x = x.to(config.activation_dtype).requires_grad_(True)
    return x, idx, weights.requires_grad_(True), grad_y.to(config.activation_dtype)


def memory_rank(
    rank,
    world,
    presets,
    tokens,
    backends,
    shared_gpu,
    snapshots,
    pair_capacity,
    precision,
    exact_buffers,
    keep_grouped_rows,
):
    device = torch.device("cuda", 0 if shared_gpu else rank)
    torch.cuda.set_device(device)
    group = dist.group.WORLD if world > 1 else None
    simulated = (
        simulated_symmetric_memory(cuda_ipc_allocator) if shared_gpu else contextlib.nullcontext()
    )
    rows = []
    with simulated:
        for preset in presets:
            config = mok.PRESETS[preset].config(max_tokens_per_rank=tokens)
            if pair_capacity is not None:
                pairs = math.ceil(pair_capacity * tokens * config.top_k)
                config = config.replace(recv_pair_capacity=pairs)
            config = config.replace(
                exact_buffers=exact_buffers, keep_grouped_rows=keep_grouped_rows
            )
            for backend in backends:
                label = f"{preset}-{backend}-ep{world}-rank{rank}"
                snapshot = None if snapshots is None else os.path.join(snapshots, label)
                name, _, variant = backend.partition("-")
                layer = mok.MoE(
                    config.replace(
                        backend="triton" if name == "baseline" else name,
                        precision="bf16" if name == "baseline" else precision,
                        recompute="gate_up" if variant == "recompute" else "none",
                    ),
                    group=group,
                    device=device,
                )
                layer.load_global_weights(global_weights(config, 0, device))
                if backend == "baseline":
                    layer = BaselineMoE.sharing_weights_of(layer)
                inputs = rank_inputs(config, rank, tokens, device)
                try:
                    figures = measure(backend, layer, inputs, device, rank, snapshot)
                    if backend != "baseline":
                        layer.workspace(device).check()  # raises if pairs were dropped
                except Exception as error:  # noqa: BLE001 - one row says why it did not run
                    figures = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
                rows.append((preset, backend, figures))
                if backend != "baseline":
                    layer.workspace(device).release()  # collective: frees its symmetric buffer
                del layer, inputs
                gc.collect()
                torch.cuda.empty_cache()
                if group is not None:
                    dist.barrier(group)
    return rows


COLUMNS = ("weights", "workspace", "symmetric", "saved", "forward peak", "backward peak", "peak")


def table(per_rank, world, tokens) -> str:
    lines = [
        f"EP {world}, {tokens} tokens a rank; GiB, the largest rank's (each column on its own)",
        "",
        "| preset | implementation | " + " | ".join(COLUMNS) + " | peak / baseline |",
        "| --- | --- | " + " | ".join("---" for _ in COLUMNS) + " | --- |",
    ]
    baseline_peak = {}
    for index, (preset, backend, _) in enumerate(per_rank[0]):
        figures = [rows[index][2] for rows in per_rank]
        if any("error" in f for f in figures):
            error = next(f["error"] for f in figures if "error" in f)
            lines.append(f"| {preset} | {backend} | {error} |")
            continue
        largest = {column: max(f[column] for f in figures) for column in COLUMNS}
        if backend == "baseline":
            baseline_peak[preset] = largest["peak"]
        ratio = largest["peak"] / baseline_peak[preset] if preset in baseline_peak else None
        cells = " | ".join(f"{largest[column] / GIB:.2f}" for column in COLUMNS)
        lines.append(
            f"| {preset} | {backend} | {cells} | {'n/a' if ratio is None else f'{ratio:.3f}'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="deepseek-v3,qwen3-235b-a22b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--backends", default="baseline,triton,fused")
    parser.add_argument("--pair-capacity", type=float, default=None)
    parser.add_argument("--exact-buffers", action="store_true")
    parser.add_argument("--keep-grouped-rows", action="store_true")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "mxfp8"))
    parser.add_argument("--snapshots", default=None, help="folder for CUDA memory snapshots")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    presets = args.preset.split(",")
    backends = args.backends.split(",")
    if args.snapshots:
        os.makedirs(args.snapshots, exist_ok=True)
    shared_gpu = torch.cuda.device_count() < args.ep
    call = (
        presets,
        args.tokens,
        backends,
        shared_gpu,
        args.snapshots,
        args.pair_capacity,
        args.precision,
        args.exact_buffers,
        args.keep_grouped_rows,
    )
    if args.ep == 1:
        per_rank = [memory_rank(0, 1, *call)]
    else:
        backend = "gloo" if shared_gpu else "nccl"
        per_rank = run_ranks(memory_rank, args.ep, args=call, backend=backend)
    where = f"{args.ep} ranks sharing GPU 0" if shared_gpu else f"{args.ep} GPUs"
    where += f"; the backends in {args.precision}"
    if args.pair_capacity is not None:
        where += f"; receive buffers for {args.pair_capacity} x the mean pairs"
    if args.exact_buffers:
        where += "; per-pair tensors sized by the pairs received (exact_buffers)"
    if args.keep_grouped_rows:
        where += "; the grouped rows kept for the backward (keep_grouped_rows)"
    text = f"{torch.cuda.get_device_name(0)}, {where}\n\n" + table(per_rank, args.ep, args.tokens)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
