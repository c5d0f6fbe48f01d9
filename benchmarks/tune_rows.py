"""Tile and warp choices of the NVLink row-copy kernels on 2 GPUs, at a fixed SM budget.

    python benchmarks/tune_rows.py [--preset deepseek-v3] [--programs 24]

Times, for one preset at its default tokens per rank and near-uniform routing, every
(num_warps, rows per tile, columns per step) candidate of three access patterns, both GPUs at once:
  push      dispatch: each token row stored into the staging rows of the ranks that need it;
  pull      combine by loading: each pair's output loaded from its owner into [T * k, H];
  scatter   combine by storing: the owner stores each output row into its token's pair slot;
and (--local-sum [--tokens T]) the one-process combine's sum, y[t] = sum_j w[t, j] * out[row[t, j]]
with the rows where the local exchange places the pairs, also over programs per SM (1 GPU too).
Remote bytes only, per rank and direction (local sum: bytes read and written, GB/s of HBM);
median over iterations of the slowest rank.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.distributed as dist

from mok.comm.layout import default_shape
from mok.comm.local import LocalExchange
from mok.comm.symmetric import SymmetricExchange
from mok.kernels.rows import copy_rows, push_rows, reduce_rows
from mok.launch import run_ranks
from mok.presets import get_preset
from mok.routing import make_routing

from exchange import make_inputs, slowest_rank_median, timed

LOCAL_SUM_PROGRAMS_PER_SM = [1, 2, 4]
TILES = [(8, 2048), (16, 1024), (16, 2048), (32, 512), (32, 1024), (64, 512), (64, 1024)]
WARPS = [8, 16, 32]


def tune(rank, world, preset_name, programs, iters, local_sum, tokens_override):
    """This rank's table rows (see the module docstring)."""
    preset = get_preset(preset_name)
    tokens, hidden, top_k = preset.default_tokens, preset.hidden_size, preset.top_k
    local = preset.num_experts // world
    device = torch.device("cuda", rank)
    shape = default_shape(hidden, top_k, local, world, tokens)
    ex = SymmetricExchange(dist.group.WORLD, shape, device, programs=programs)
    x, idx, _ = make_inputs(preset, tokens, world, rank, 0)
    routing = ex.route(idx)
    align = functools.partial(ex._barrier, "release: peers done with the buffers")
    remote_tokens = int((routing.token_slot[:, [d for d in range(world) if d != rank]] >= 0).sum())
    remote_pairs = int((routing.owner != rank).sum())
    pairs_out = torch.empty(tokens * top_k, hidden, dtype=torch.bfloat16, device=device)
    recv_pairs = routing.recv_pairs
    all_rows = torch.tensor([tokens * top_k], device=device)
    identity = torch.arange(shape.pair_capacity, device=device)

    def push(warps, rows, cols):
        return lambda: push_rows(
            x,
            routing.token_slot,
            ex.view.staging.local,
            ex.view.staging.offsets,
            programs,
            rows,
            flags=ex.view.flags.local,
            flag_offsets=ex.view.flags.offsets,
            flag_base=rank * shape.blocks_per_rank,
            epoch=ex.view.epoch,
            num_warps=warps,
            block_h=cols,
        )

    def pull(warps, rows, cols):
        return lambda: copy_rows(
            pairs_out,
            ex.view.expert_out.local,
            routing.pair_row.view(-1),
            all_rows,
            programs,
            rows,
            src_offsets=ex.view.expert_out.offsets,
            src_rank=routing.owner.view(-1),
            num_warps=warps,
            block_h=cols,
        )

    def scatter(warps, rows, cols):
        return lambda: copy_rows(
            ex.view.grad_pairs.local,
            ex.view.expert_out.local,
            identity,
            recv_pairs,
            programs,
            rows,
            dst_row=routing.return_row,
            dst_offsets=ex.view.grad_pairs.offsets,
            dst_rank=routing.return_rank,
            num_warps=warps,
            block_h=cols,
        )

    table = []
    if local_sum:
        sum_tokens = tokens_override or tokens
        table = _tune_local_sum(preset, device, sum_tokens, iters, align)
        ex.release()
        return table
    for name, make, remote in (
        ("push", push, remote_tokens),
        ("pull", pull, remote_pairs),
        ("scatter", scatter, remote_pairs),
    ):
        for warps, (rows, cols) in itertools.product(WARPS, TILES):
            ms = slowest_rank_median(timed(make(warps, rows, cols), iters, 3, align))
            table.append((name, warps, rows, cols, ms, remote * hidden * 2 / ms / 1e6))
    ex.release()
    return table


def _tune_local_sum(preset, device, tokens, iters, barrier):
    """The one-process combine's sum y[t] = sum_j w[t, j] * out[pair_row[t, j]], with pair_row
    as `LocalExchange` places a uniform routing's pairs, for every (programs per SM, warps, rows
    per tile, columns per step) candidate; GB/s of HBM traffic (rows read, y written)."""
    hidden, top_k = preset.hidden_size, preset.top_k
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    generator = torch.Generator().manual_seed(0)
    idx, weights = make_routing("uniform", tokens, preset.num_experts, top_k, generator)
    rows = LocalExchange(preset.num_experts, device).route(idx.to(device)).pair_row
    weights = weights.to(device)
    pairs = torch.randn(tokens * top_k, hidden, device=device).to(torch.bfloat16)
    y = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=device)
    moved = (pairs.numel() + y.numel()) * 2
    table = []
    for per_sm, warps, block_rows, cols in itertools.product(
        LOCAL_SUM_PROGRAMS_PER_SM, [8, 16], [8, 16], [1024, 2048]
    ):
        call = functools.partial(
            reduce_rows,
            *(y, pairs, rows, per_sm * sms, block_rows),
            weight=weights,
            num_warps=warps,
            block_h=cols,
        )
        ms = slowest_rank_median(timed(call, iters, 3, barrier))
        table.append((f"local-sum x{per_sm}/SM", warps, block_rows, cols, ms, moved / ms / 1e6))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--programs", type=int, default=24)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--local-sum", action="store_true", help="tune the local sum of combine")
    parser.add_argument("--tokens", type=int, help="tokens per rank (default: the preset's)")
    args = parser.parse_args()
    world = torch.cuda.device_count()
    table = run_ranks(
        tune,
        world,
        args=(args.preset, args.programs, args.iters, args.local_sum, args.tokens),
        backend="nccl",
    )[0]
    print(f"{args.preset}, {args.programs} programs, {world} GPUs")
    print("| pattern | warps | rows | cols | ms | GB/s |\n| --- | --- | --- | --- | --- | --- |")
    for name, warps, rows, cols, ms, gbps in table:
        print(f"| {name} | {warps} | {rows} | {cols} | {ms:.3f} | {gbps:.0f} |")
    for name in sorted({row[0] for row in table}):
        best = max((r for r in table if r[0] == name), key=lambda r: r[5])
        print(f"best {name}: warps={best[1]} rows={best[2]} cols={best[3]} {best[5]:.0f} GB/s")


if __name__ == "__main__":
    main()
