"""The gate/up weight gradient reading its rows through an index (the tokens an owner received,
each once) against reading the grouped rows (a copy per pair), on one GPU, at the shapes one
owner of an EP group sees: what the fused backend's backward pays for not keeping the grouped
rows, which are sized for the worst routing (EP x T x k rows) where the tokens are EP x T.

    python benchmarks/gathered_wgrad.py [--preset deepseek-v3,qwen3-235b-a22b] [--tokens 8192]
                                        [--ep 2] [--held-sms 116] [--iters 20] [--out FILE]

Rank 0's view: every rank's T tokens routed uniformly (`mok.routing.make_routing`), the pairs
of rank 0's E / EP experts grouped by expert, then source rank and token; grad_gate_up random
bf16. Each variant runs the warp-specialized kernel (`warp_specialized.gate_up_wgrad`, bf16
gradients) on every SM and held to --held-sms (the SMs the fused backward leaves it beside the
return of grad x), and the gathered one also held and joined at once by programs on the other
SMs that claim the tiles left (`TileClaims`, as the fused backward's programs join it once the
return is done: here with no return, so its figure is the claims' cost against every SM), after
a bitwise check of every result against the grouped one. CUDA events, warm-up, the variants
interleaved per iteration, median and min-max.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics

import torch

from mok.bench import git_commit
from mok.kernels import warp_specialized as ws
from mok.presets import get_preset
from mok.routing import make_routing

GIB = 2**30


def owner_inputs(preset_name: str, tokens: int, ep: int, device):
    """(tokens [EP x T, H], index [EP x T x k] int32, grouped rows [EP x T x k, H] = tokens[index]
    in the groups, zeros after, grad_gate_up [EP x T x k, 2I], group offsets [E / EP + 1] int32,
    local experts, intermediate size): one owner's operands with worst-case row capacity."""
    preset = get_preset(preset_name)
    hidden, inter, top_k = preset.hidden_size, preset.intermediate_size, preset.top_k
    local = preset.num_experts // ep
    generator = torch.Generator().manual_seed(0)
    experts, sources = [], []
    for rank in range(ep):
        idx, _ = make_routing("uniform", tokens, preset.num_experts, top_k, generator)
        token = torch.arange(tokens).repeat_interleave(top_k)
        mine = idx.flatten() < local
        experts.append(idx.flatten()[mine])
        sources.append(rank * tokens + token[mine])
    expert, source = torch.cat(experts), torch.cat(sources)
    order = torch.argsort(expert * (ep * tokens) + source, stable=True)
    capacity = ep * tokens * top_k
    index = torch.full((capacity,), -1, dtype=torch.int32)
    index[: order.numel()] = source[order].to(torch.int32)
    counts = torch.bincount(expert, minlength=local)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    token_rows = torch.randn(ep * tokens, hidden, generator=generator).bfloat16().to(device)
    index = index.to(device)
    grouped = torch.zeros(capacity, hidden, dtype=torch.bfloat16, device=device)
    grouped[: order.numel()] = token_rows[index[: order.numel()].long()]
    grad = torch.randn(capacity, 2 * inter, generator=generator).bfloat16().to(device)
    return token_rows, index, grouped, grad, offsets.to(device), local, inter


class JoinedAtOnce:
    """`TileClaims` whose extension starts at once: `extra` programs on a side stream behind an
    event recorded before the held launch (not behind the launch), claiming from its counter."""

    def __init__(self, extra: int, device: torch.device) -> None:
        self.extra = extra
        self.counters = torch.zeros(1, dtype=torch.int32, device=device)
        self.stream = torch.cuda.Stream(device)
        self.inputs_ready = None

    def counter(self) -> torch.Tensor:
        self.counters.zero_()
        self.inputs_ready = torch.cuda.current_stream().record_event()
        return self.counters

    def extend(self, relaunch) -> None:
        self.stream.wait_event(self.inputs_ready)
        with torch.cuda.stream(self.stream):
            relaunch(self.extra)
        torch.cuda.current_stream().wait_stream(self.stream)


def bench(preset_name: str, tokens: int, ep: int, held_sms: int, iters: int, warmup: int):
    device = torch.device("cuda")
    token_rows, index, grouped, grad, offsets, local, inter = owner_inputs(
        preset_name, tokens, ep, device
    )
    hidden = token_rows.shape[1]
    tiles = ws.WGRAD_TILES.for_grad(torch.bfloat16)
    held = dataclasses.replace(tiles, max_sms=held_sms)
    variants = {
        "grouped rows (TMA), every SM": (grouped, None, tiles),
        "tokens (gathered), every SM": (token_rows, index, tiles),
        f"grouped rows (TMA), {held_sms} SMs": (grouped, None, held),
        f"tokens (gathered), {held_sms} SMs": (token_rows, index, held),
    }
    others = torch.cuda.get_device_properties(device).multi_processor_count - held_sms
    if others > 0:
        claimed = dataclasses.replace(held, claims=JoinedAtOnce(others, device))
        variants[f"tokens (gathered), {held_sms} SMs + {others} claiming"] = (
            token_rows,
            index,
            claimed,
        )
    outputs = {}

    def call(name):
        rows, source_rows, cfg = variants[name]
        grads = outputs.setdefault(
            name, torch.empty(2, local, inter, hidden, dtype=torch.bfloat16, device=device)
        )
        ws.gate_up_wgrad(
            grad, rows, offsets, grads[0], grads[1], False, False, cfg, source_rows=source_rows
        )

    for name in variants:
        call(name)
    reference = outputs[next(iter(variants))]
    bitwise = {name: torch.equal(out, reference) for name, out in outputs.items()}
    times = {name: [] for name in variants}
    for i in range(warmup + iters):
        for name in variants:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call(name)
            end.record()
            end.synchronize()
            if i >= warmup:
                times[name].append(start.elapsed_time(end))
    pairs = int(offsets[-1])
    flops = 2 * pairs * 2 * inter * hidden
    rows_gib = grouped.numel() * 2 / GIB
    tokens_gib = token_rows.numel() * 2 / GIB
    base = statistics.median(times[next(iter(variants))])
    result = []
    for name, ms in times.items():
        median = statistics.median(ms)
        result.append(
            {
                "preset": preset_name,
                "variant": name,
                "bitwise": bitwise[name],
                "ms": median,
                "min": min(ms),
                "max": max(ms),
                "tflops": flops / median / 1e9,
                "vs_first": median / base,
                "rows_gib": rows_gib,
                "tokens_gib": tokens_gib,
                "pairs": pairs,
            }
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v3,qwen3-235b-a22b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--held-sms", type=int, default=116)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for name in args.preset.split(","):
        rows += bench(name, args.tokens, args.ep, args.held_sms, args.iters, args.warmup)
    lines = [
        f"# gathered gate/up weight gradient, {datetime.date.today()}, commit {git_commit()}, "
        f"{torch.cuda.get_device_name()}",
        "",
        f"T = {args.tokens} a rank, EP {args.ep} (rank 0's experts), bf16 gradients; median "
        f"(min-max) of {args.iters}",
        "",
        "| preset | pairs | rows kept GiB (grouped / tokens) | variant | bitwise | ms | TFLOP/s "
        "| vs first |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['pairs']} | {r['rows_gib']:.3f} / {r['tokens_gib']:.3f} "
            f"| {r['variant']} | {r['bitwise']} | {r['ms']:.3f} ({r['min']:.3f}-{r['max']:.3f}) "
            f"| {r['tflops']:.0f} | {r['vs_first']:.3f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if not all(r["bitwise"] for r in rows):
        raise SystemExit("a gathered weight gradient differs from the grouped rows' one")


if __name__ == "__main__":
    main()
