"""Check, then time, the NVLink token exchange against NCCL on the same data (2+ GPUs).

    python benchmarks/exchange.py --out table.md [--presets deepseek-v3,...] [--sms 4,8,...]

Spawns one rank per GPU. For every preset at its default tokens per rank, near-uniform routing
(top-k of a softmax over random logits), three input sets:
  1. checks the symmetric exchange (push and pull dispatch, combine) bit for bit against the
     collective exchange on the first input set;
  2. times, side by side in the same run (CUDA events, warm-up, median over iterations and input
     sets of the slowest rank): the push kernel alone, the pull kernel alone, dispatch (push +
     the expand into grouped rows), the combine loads alone and combine (barrier + loads + sum), the
     copy engine writing the same bytes into the peer, and NCCL `all_to_all_single` moving the
     same rows (dispatch: each token once per owner; combine: one row per pair);
  3. the SM-count curve of the push and combine kernels.
Bandwidth counts remote bytes only (rows that cross NVLink), per rank and direction.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics

import torch
import torch.distributed as dist

from mok.bench import git_commit
from mok.comm.collective import CollectiveExchange
from mok.comm.layout import default_shape
from mok.comm.symmetric import SymmetricExchange
from mok.kernels.rows import COPY_ROWS, COPY_TILE, PUSH_TILE, copy_rows, push_rows
from mok.presets import get_preset
from mok.ranks import run_ranks
from mok.routing import make_routing

PRESETS = ["deepseek-v3", "kimi-k2", "qwen3-235b-a22b", "qwen3-30b-a3b", "mixtral-8x7b"]
SMS = [4, 8, 16, 24, 32, 48, 64, 132]
INPUT_SETS = 3


def timed(fn, iters: int, warmup: int, align) -> list[float]:
    """Milliseconds of each of `iters` calls of fn (after `warmup`), ranks aligned before each."""
    times = []
    for i in range(warmup + iters):
        align()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def slowest_rank_median(times: list[float]) -> float:
    """Median over iterations of the slowest rank's time."""
    local = torch.tensor(times, device="cuda")
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return statistics.median(local.tolist())


def make_inputs(preset, tokens, world, rank, seed):
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(tokens, preset.hidden_size, generator=generator).to(torch.bfloat16)
    idx, w = make_routing("uniform", tokens, preset.num_experts, preset.top_k, generator)
    return x.cuda(), idx.cuda(), w.cuda()


def bench_preset(rank, world, name, sms, iters, warmup):
    preset = get_preset(name)
    tokens, hidden, top_k = preset.default_tokens, preset.hidden_size, preset.top_k
    local = preset.num_experts // world
    device = torch.device("cuda", rank)
    exchanges = {
        pull: SymmetricExchange(
            dist.group.WORLD,
            default_shape(hidden, top_k, local, world, tokens, pull_dispatch=pull),
            device,
            programs=24,
        )
        for pull in (False, True)
    }
    push_ex = exchanges[False]
    collective = CollectiveExchange(dist.group.WORLD, local)
    sets = []
    for seed in range(INPUT_SETS):
        x, idx, w = make_inputs(preset, tokens, world, rank, seed)
        routings = {pull: ex.route(idx) for pull, ex in exchanges.items()}
        want = collective.route(idx)
        sets.append((x, idx, w, routings, want))

    # 1. correctness on the first input set (routed again: the pull metadata is the last route's)
    x, idx, w, routings, want = sets[0]
    routings.update({pull: ex.route(idx) for pull, ex in exchanges.items()})
    grouped_want = collective.dispatch(want, x)
    checks = {}
    for pull, ex in exchanges.items():
        grouped = ex.dispatch(routings[pull], x)
        rows = grouped_want.shape[0]
        checks["pull dispatch" if pull else "push dispatch"] = torch.equal(
            grouped[:rows], grouped_want
        )
    y_want, _ = collective.combine(want, grouped_want, w)
    push_ex.expert_output_buffer()[: grouped_want.shape[0]].copy_(grouped_want)
    y, _ = push_ex.combine(routings[False], push_ex.expert_output_buffer(), w)
    checks["combine"] = torch.equal(y, y_want)
    if not all(checks.values()):
        raise AssertionError(f"rank {rank}, {name}: exchange differs from the reference {checks}")

    # remote rows per rank and direction
    remote = [d for d in range(world) if d != rank]
    remote_tokens = sum(int((s[4].placement.token_slot[:, remote] >= 0).sum()) for s in sets)
    remote_tokens /= INPUT_SETS
    remote_pairs = sum(int((s[1] // local != rank).sum()) for s in sets) / INPUT_SETS
    row_bytes = hidden * 2
    dispatch_bytes, combine_bytes = remote_tokens * row_bytes, remote_pairs * row_bytes

    align = functools.partial(push_ex._barrier, "release: peers done with the buffers")
    results = {}

    def measure(label, make_call):
        times = []
        for s in sets:
            times += timed(make_call(s), iters, warmup, align)
        results[label] = slowest_rank_median(times)

    def push_call(programs):
        def make(s):
            x, _, _, routings, _ = s
            r = routings[False]
            return lambda: push_rows(
                x,
                r.token_slot,
                push_ex.view.staging.local,
                push_ex.view.staging.offsets,
                programs,
                push_ex.shape.block_tokens,
                flags=push_ex.view.flags.local,
                flag_offsets=push_ex.view.flags.offsets,
                flag_base=rank * push_ex.shape.blocks_per_rank,
                epoch=push_ex.view.epoch,
                **PUSH_TILE,
            )

        return make

    def combine_call(programs):
        """The NVLink part of combine: every pair's output loaded from its owner."""

        def make(s):
            r = s[3][False]
            out = torch.empty(r.pair_row.numel(), hidden, dtype=torch.bfloat16, device=device)
            count = torch.tensor([out.shape[0]], device=device)
            return lambda: copy_rows(
                out,
                push_ex.view.expert_out.local,
                r.pair_row.view(-1),
                count,
                programs,
                COPY_ROWS,
                src_offsets=push_ex.view.expert_out.offsets,
                src_rank=r.owner.view(-1),
                **COPY_TILE,
            )

        return make

    pull_ex = exchanges[True]

    def pull_call(s):
        x, _, _, routings, _ = s
        r = routings[True]
        pull_ex.view.x_copy.local[: x.shape[0]].copy_(x)
        source = pull_ex.view.staging_source.local[: pull_ex.shape.token_capacity]
        ranks, rows = source[:, 0].contiguous(), source[:, 1].contiguous()
        return lambda: copy_rows(
            pull_ex.view.staging.local,
            pull_ex.view.x_copy.local,
            rows,
            r.recv_tokens,
            24,
            COPY_ROWS,
            src_offsets=pull_ex.view.x_copy.offsets,
            src_rank=ranks,
            **COPY_TILE,
        )

    # the pull kernels need this rank's routing metadata of each set in place: re-route per set
    def with_route(make_call, ex_pull):
        def make(s):
            s[3][ex_pull] = exchanges[ex_pull].route(s[1])
            return make_call(s)

        return make

    measure("push kernel, 24 SMs", push_call(24))
    measure("dispatch (push + expand)", lambda s: lambda: push_ex.dispatch(s[3][False], s[0]))
    measure("pull kernel, 24 SMs", with_route(pull_call, True))
    measure(
        "dispatch (pull + expand)",
        with_route(lambda s: lambda: pull_ex.dispatch(s[3][True], s[0]), True),
    )
    measure("combine loads, 24 SMs", combine_call(24))
    measure(
        "combine (barrier + loads + sum)",
        lambda s: (
            lambda: push_ex.combine(
                s[3][False], push_ex.expert_output_buffer(), s[2], save_pair_out=False
            )
        ),
    )

    peer = 1 - rank if world == 2 else (rank + 1) % world
    peer_view = push_ex.peer("staging", peer)
    remote_rows = int(remote_tokens)
    source_rows = sets[0][0][: min(remote_rows, tokens)]
    measure(
        "copy engine, same bytes",
        lambda s: lambda: peer_view[: source_rows.shape[0]].copy_(source_rows),
    )
    copy_bytes = source_rows.shape[0] * row_bytes

    def nccl_dispatch(s):
        x, _, _, _, want = s
        send = x[want.send_token_index]
        out = torch.empty(sum(want.recv_tokens), hidden, dtype=x.dtype, device=device)
        return lambda: dist.all_to_all_single(out, send, want.recv_tokens, want.send_tokens)

    def nccl_combine(s):
        _, _, _, _, want = s
        send = torch.randn(sum(want.recv_pairs), hidden, device=device).to(torch.bfloat16)
        out = torch.empty(sum(want.send_pairs), hidden, dtype=torch.bfloat16, device=device)
        return lambda: dist.all_to_all_single(out, send, want.send_pairs, want.recv_pairs)

    measure("NCCL all_to_all_single, dispatch rows", nccl_dispatch)
    measure("NCCL all_to_all_single, combine rows", nccl_combine)

    curve = {}
    for programs in sms:
        curve[programs] = {}
        for label, make in (("push", push_call(programs)), ("combine", combine_call(programs))):
            times = []
            for s in sets:
                times += timed(make(s), iters, warmup, align)
            curve[programs][label] = slowest_rank_median(times)

    for ex in exchanges.values():
        ex.release()
    bytes_of = {
        "push kernel, 24 SMs": dispatch_bytes,
        "dispatch (push + expand)": dispatch_bytes,
        "pull kernel, 24 SMs": dispatch_bytes,
        "dispatch (pull + expand)": dispatch_bytes,
        "combine loads, 24 SMs": combine_bytes,
        "combine (barrier + loads + sum)": combine_bytes,
        "copy engine, same bytes": copy_bytes,
        "NCCL all_to_all_single, dispatch rows": dispatch_bytes,
        "NCCL all_to_all_single, combine rows": combine_bytes,
    }
    return {
        "preset": name,
        "tokens": tokens,
        "hidden": hidden,
        "top_k": top_k,
        "checks": checks,
        "remote_dispatch_bytes": dispatch_bytes,
        "remote_combine_bytes": combine_bytes,
        "ms": results,
        "gbps": {k: bytes_of[k] / results[k] / 1e6 for k in results},
        "curve_gbps": {
            p: {
                "push": dispatch_bytes / v["push"] / 1e6,
                "combine": combine_bytes / v["combine"] / 1e6,
            }
            for p, v in curve.items()
        },
    }


def bench_all(rank, world, presets, sms, iters, warmup):
    return [bench_preset(rank, world, name, sms, iters, warmup) for name in presets]


def markdown(results, world, command) -> str:
    commit = git_commit()
    lines = [
        f"# NVLink token exchange vs NCCL, {world} x {torch.cuda.get_device_name()}",
        "",
        f"Date {datetime.date.today()}, commit {commit}, command `{command}`.",
        "Remote bytes only, per rank and direction; GB/s = 1e9 bytes/s; median over iterations "
        f"and {INPUT_SETS} input sets of the slowest rank. Checked bit for bit against the "
        "collective exchange before timing.",
        "",
    ]
    for r in results:
        lines += [
            f"## {r['preset']}: {r['tokens']} tokens/rank, H={r['hidden']}, top-{r['top_k']}",
            "",
            f"Remote bytes per rank: dispatch {r['remote_dispatch_bytes'] / 1e6:.1f} MB, "
            f"combine {r['remote_combine_bytes'] / 1e6:.1f} MB. Checks: {r['checks']}.",
            "",
            "| operation | time (ms) | GB/s |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {k} | {r['ms'][k]:.3f} | {r['gbps'][k]:.0f} |" for k in r["ms"]]
        lines += ["", "| SMs | push GB/s | combine GB/s |", "| --- | --- | --- |"]
        lines += [
            f"| {p} | {v['push']:.0f} | {v['combine']:.0f} |" for p, v in r["curve_gbps"].items()
        ]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--sms", default=",".join(map(str, SMS)))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", help="markdown file; a .json beside it")
    args = parser.parse_args()
    world = torch.cuda.device_count()
    presets = args.presets.split(",")
    sms = [int(v) for v in args.sms.split(",")]
    results = run_ranks(
        bench_all, world, args=(presets, sms, args.iters, args.warmup), backend="nccl"
    )[0]
    command = "python benchmarks/exchange.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "out"
    )
    table = markdown(results, world, command)
    print(table)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(table)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
