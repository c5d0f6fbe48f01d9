"""Check, then time, the Triton expert MLP kernels against torch._grouped_mm on one GPU.

    python benchmarks/expert_kernels.py --check --bench --out table.md

--check   every preset at reduced token counts (near-uniform and Zipf routing, empty experts,
          capacity padding poisoned with NaN, outputs on NaN-poisoned memory) against the
          reference (`mok.reference.expert`), forward and backward.
--bench   every preset at 8192 and 16384 tokens per rank (x top_k rows, near-uniform routing,
          or Zipf-skewed with --routing zipf):
          ours vs the baseline (one fused gate|up torch._grouped_mm, SwiGLU in PyTorch,
          torch._grouped_mm down; backward through autograd), each checked against the other
          on the same inputs before timing, and the cuBLAS dense bf16 rate measured in the same run.
--tune    per-kernel times of candidate tiles on two presets (for choosing `default_config`).

The whole layer's routed experts are on this one GPU (E = the preset's expert count).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys

import torch
import torch.nn.functional as F

import mok
from mok.bench import git_commit
from mok.kernels import GemmTiles, default_config, expert_mlp_backward, expert_mlp_forward
from mok.kernels import grouped_gemm as gg
from mok.testing import grouped_expert_reference, relative_error

BF16_TOL = 2e-2


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Problem:
    rows: torch.Tensor  # [M, H] bf16
    grad_out: torch.Tensor  # [M, H] bf16
    offsets: torch.Tensor  # [E + 1] int32
    sizes: list[int]


def near_uniform_sizes(tokens: int, top_k: int, num_experts: int, gen) -> list[int]:
    """Group sizes of top-k over a softmax of random logits (what the benchmarks call uniform)."""
    logits = torch.randn(tokens, num_experts, generator=gen, device="cuda")
    idx = torch.topk(torch.softmax(logits, -1), top_k, dim=-1).indices
    return torch.bincount(idx.flatten(), minlength=num_experts).tolist()


def zipf_sizes(rows: int, num_experts: int, gen, empty: int) -> list[int]:
    popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
    popularity[torch.randperm(num_experts)[:empty]] = 0
    experts = torch.multinomial(popularity, rows, replacement=True)
    return torch.bincount(experts, minlength=num_experts).tolist()


def randn(*shape, gen, scale=1.0):
    values = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    return values.mul_(scale)


def make_weights(num_experts, hidden, inter, gen):
    """w_gate and w_up as views of one [E, 2I, H] tensor (the baseline's fused gate|up weight)."""
    w_gate_up = randn(num_experts, 2 * inter, hidden, gen=gen, scale=hidden**-0.5)
    w_down = randn(num_experts, hidden, inter, gen=gen, scale=inter**-0.5)
    return w_gate_up, w_gate_up[:, :inter], w_gate_up[:, inter:], w_down


def make_problem(sizes, hidden, gen, padding=0) -> Problem:
    m = sum(sizes) + padding
    rows = randn(m, hidden, gen=gen)
    grad_out = randn(m, hidden, gen=gen)
    if padding:
        rows[-padding:] = float("nan")
        grad_out[-padding:] = float("nan")
    offsets = torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32)
    return Problem(rows, grad_out, offsets, sizes)


def poison_allocator() -> None:
    block = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    block.fill_(float("nan"))
    del block


# ------------------------------------------------------------------------------------------------
# The baseline: torch._grouped_mm (one fused gate|up GEMM), SwiGLU in PyTorch, autograd backward
# ------------------------------------------------------------------------------------------------


def baseline_forward(rows, ends, w_gate_up, w_down, inter):
    """ends: [E] int32 cumulative end offsets, as torch._grouped_mm takes them."""
    gate_up = torch._grouped_mm(rows, w_gate_up.transpose(1, 2), offs=ends)
    h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    return torch._grouped_mm(h, w_down.transpose(1, 2), offs=ends)


class Baseline:
    def __init__(self, problem: Problem, w_gate_up, w_down, inter):
        self.rows = problem.rows.detach().requires_grad_(True)
        self.w_gate_up = w_gate_up.detach().requires_grad_(True)
        self.w_down = w_down.detach().requires_grad_(True)
        self.ends = problem.offsets[1:]
        self.grad_out = problem.grad_out
        self.inter = inter
        self.out = None

    def forward(self):
        self.out = baseline_forward(self.rows, self.ends, self.w_gate_up, self.w_down, self.inter)
        return self.out

    def backward(self):
        return torch.autograd.grad(
            self.out, [self.rows, self.w_gate_up, self.w_down], self.grad_out, retain_graph=True
        )


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def time_ms(fns, budget_ms=400.0, min_iters=5, max_iters=50) -> float:
    """Median of per-call CUDA-event times, cycling through `fns` (one per input set)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fns[0]()
    end.record()
    torch.cuda.synchronize()
    iters = int(min(max_iters, max(min_iters, budget_ms / max(start.elapsed_time(end), 1e-3))))
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for i, (a, b) in enumerate(events):
        a.record()
        fns[i % len(fns)]()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def dense_tflops(m, k, n, gen) -> float:
    a = randn(m, k, gen=gen)
    b = randn(k, n, gen=gen)
    ms = time_ms([lambda: torch.mm(a, b)])
    return 2 * m * k * n / ms / 1e9


# ------------------------------------------------------------------------------------------------
# --check
# ------------------------------------------------------------------------------------------------


def check(log) -> bool:
    ok = True
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, preset in mok.PRESETS.items():
        num_experts = min(preset.num_experts, 32)
        hidden, inter = preset.hidden_size, preset.intermediate_size
        _, w_gate, w_up, w_down = make_weights(num_experts, hidden, inter, gen)
        for routing in ("uniform", "zipf"):
            tokens = 512
            if routing == "uniform":
                sizes = near_uniform_sizes(tokens, preset.top_k, num_experts, gen)
            else:
                sizes = zipf_sizes(tokens * preset.top_k, num_experts, gen, empty=3)
            limit = 7.0 if routing == "zipf" else None
            problem = make_problem(sizes, hidden, gen, padding=29)
            poison_allocator()
            out, saved = expert_mlp_forward(
                problem.rows, problem.offsets, w_gate, w_up, w_down, swiglu_limit=limit
            )
            grad_rows, *grad_w = expert_mlp_backward(problem.grad_out, saved)
            ref_out, ref_grad_rows, ref_grad_w = grouped_expert_reference(
                problem.rows, problem.sizes, w_gate, w_up, w_down, problem.grad_out, limit
            )
            n = sum(sizes)
            errors = {
                "out": relative_error(out[:n], ref_out),
                "grad_rows": relative_error(grad_rows[:n], ref_grad_rows),
                "grad_w_gate": relative_error(grad_w[0], ref_grad_w[0]),
                "grad_w_up": relative_error(grad_w[1], ref_grad_w[1]),
                "grad_w_down": relative_error(grad_w[2], ref_grad_w[2]),
            }
            padding_zero = bool((grad_rows[n:] == 0).all())
            good = max(errors.values()) < BF16_TOL and padding_zero
            ok &= good
            shown = " ".join(f"{k}={v:.2e}" for k, v in errors.items())
            log(
                f"check {name:16s} {routing:7s} E={num_experts:3d} rows={n:6d} {shown} "
                f"padding-grad-zero={padding_zero} {'OK' if good else 'FAIL'}"
            )
    return ok


# ------------------------------------------------------------------------------------------------
# --bench
# ------------------------------------------------------------------------------------------------


def chunked_relative_error(actual, expected, chunk=2**26) -> float:
    """relative_error for tensors too large to upcast whole: float64 sums over slices of dim 0."""
    step = max(1, chunk // max(1, actual[0].numel()))
    error = scale = 0.0
    for i in range(0, actual.shape[0], step):
        a, b = actual[i : i + step].double(), expected[i : i + step].double()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            return float("inf")
        error += (a - b).square().sum().item()
        scale += b.square().sum().item()
    return (error / scale) ** 0.5 if scale > 0 else error**0.5


def bench_sizes(routing: str, tokens: int, top_k: int, num_experts: int, gen) -> list[int]:
    """Group sizes of a timed problem: near-uniform, or Zipf-skewed (every expert kept; the
    skew a young router in training can have, `benchmarks/train_e2e.py` reports its own)."""
    if routing == "zipf":
        return zipf_sizes(tokens * top_k, num_experts, gen, empty=0)
    return near_uniform_sizes(tokens, top_k, num_experts, gen)


def bench_preset(name, tokens, dense_rate, gen, log, routing="uniform"):
    preset = mok.get_preset(name)
    hidden, inter, num_experts = preset.hidden_size, preset.intermediate_size, preset.num_experts
    w_gate_up, w_gate, w_up, w_down = make_weights(num_experts, hidden, inter, gen)
    problems = [
        make_problem(bench_sizes(routing, tokens, preset.top_k, num_experts, gen), hidden, gen)
        for _ in range(2)
    ]
    m = problems[0].rows.shape[0]
    flops = 2 * m * 3 * hidden * inter

    # Correctness on these very inputs first: ours against the baseline.
    out, saved = expert_mlp_forward(problems[0].rows, problems[0].offsets, w_gate, w_up, w_down)
    grads = expert_mlp_backward(problems[0].grad_out, saved)
    base = Baseline(problems[0], w_gate_up, w_down, inter)
    base_out = base.forward()
    base_grads = base.backward()
    errors = {
        "out": chunked_relative_error(out, base_out),
        "grad_rows": chunked_relative_error(grads[0], base_grads[0]),
        "grad_w_gate": chunked_relative_error(grads[1], base_grads[1][:, :inter]),
        "grad_w_up": chunked_relative_error(grads[2], base_grads[1][:, inter:]),
        "grad_w_down": chunked_relative_error(grads[3], base_grads[2]),
    }
    del out, saved, grads, base, base_out, base_grads
    agree = max(errors.values()) < BF16_TOL
    log(f"agree {name} T={tokens}: " + " ".join(f"{k}={v:.2e}" for k, v in errors.items()))

    def ours_forward(p):
        return lambda: expert_mlp_forward(p.rows, p.offsets, w_gate, w_up, w_down)

    saved = [expert_mlp_forward(p.rows, p.offsets, w_gate, w_up, w_down)[1] for p in problems]
    ours_fwd = time_ms([ours_forward(p) for p in problems])
    ours_bwd = time_ms(
        [
            lambda p=p, s=s: expert_mlp_backward(p.grad_out, s)
            for p, s in zip(problems, saved, strict=True)
        ]
    )
    del saved
    baselines = [Baseline(p, w_gate_up, w_down, inter) for p in problems]
    base_fwd = time_ms([b.forward for b in baselines])
    for b in baselines:
        b.forward()
    base_bwd = time_ms([b.backward for b in baselines])
    del baselines
    torch.cuda.empty_cache()

    def rate(ms, scale=1):
        return scale * flops / ms / 1e9

    row = dict(
        preset=name if routing == "uniform" else f"{name} ({routing})",
        tokens=tokens,
        rows=m,
        agree=agree,
        ours_fwd=ours_fwd,
        base_fwd=base_fwd,
        ours_bwd=ours_bwd,
        base_bwd=base_bwd,
        ours_fwd_tf=rate(ours_fwd),
        base_fwd_tf=rate(base_fwd),
        ours_bwd_tf=rate(ours_bwd, 2),
        base_bwd_tf=rate(base_bwd, 2),
    )
    row["fwd_pct"] = 100 * row["ours_fwd_tf"] / dense_rate
    row["bwd_pct"] = 100 * row["ours_bwd_tf"] / dense_rate
    log(f"bench {row}")
    return row


def table(rows, dense_rate, dense_equiv) -> str:
    lines = [
        "| preset | tokens | rows | fwd ms ours / base | fwd TFLOP/s ours / base | fwd speedup "
        "| bwd ms ours / base | bwd TFLOP/s ours / base | bwd speedup | ours % of dense fwd / bwd "
        "| checked |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['tokens']} | {r['rows']} "
            f"| {r['ours_fwd']:.3f} / {r['base_fwd']:.3f} "
            f"| {r['ours_fwd_tf']:.0f} / {r['base_fwd_tf']:.0f} "
            f"| {r['base_fwd'] / r['ours_fwd']:.2f}x "
            f"| {r['ours_bwd']:.3f} / {r['base_bwd']:.3f} "
            f"| {r['ours_bwd_tf']:.0f} / {r['base_bwd_tf']:.0f} "
            f"| {r['base_bwd'] / r['ours_bwd']:.2f}x "
            f"| {r['fwd_pct']:.0f} % / {r['bwd_pct']:.0f} % "
            f"| {'yes' if r['agree'] else 'NO'} |"
        )
    lines.append("")
    lines.append(
        f"cuBLAS dense bf16 (torch.mm 8192 x 8192 x 8192) in the same run: {dense_rate:.0f} "
        "TFLOP/s; "
        "at each preset's forward size (rows x H x 3I): "
        + ", ".join(f"{k} {v:.0f}" for k, v in dense_equiv.items())
        + " TFLOP/s."
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# --tune
# ------------------------------------------------------------------------------------------------


def _tiles(bm, bn, bk, warps, stages, group_m=8, per_sm=1):
    return GemmTiles(bm, bn, bk, warps, stages, group_m=group_m, programs_per_sm=per_sm)


# Alternatives timed beside each preset's default tiles by --tune.
CANDIDATES = {
    "gate_up": [_tiles(128, 128, 64, 8, 3), _tiles(64, 128, 64, 4, 4)],
    "down": [_tiles(128, 256, 64, 8, 3), _tiles(64, 256, 64, 8, 4), _tiles(128, 256, 32, 8, 5)],
    "down_dgrad": [_tiles(128, 128, 64, 8, 4), _tiles(64, 256, 64, 8, 3)],
    "gate_up_dgrad": [_tiles(128, 256, 32, 8, 3), _tiles(128, 128, 32, 8, 4)],
    "down_wgrad": [
        _tiles(128, 256, 32, 8, 3),
        _tiles(128, 256, 32, 8, 4),
        _tiles(128, 256, 64, 8, 3),
        _tiles(128, 128, 64, 8, 2, per_sm=2),
    ],
    "gate_up_wgrad": [
        _tiles(128, 256, 32, 8, 3),
        _tiles(128, 256, 32, 8, 4),
        _tiles(128, 256, 64, 8, 3),
        _tiles(128, 128, 64, 8, 2, per_sm=2),
    ],
}


def tune_preset(name, tokens, gen, log):
    preset = mok.get_preset(name)
    hidden, inter = preset.hidden_size, preset.intermediate_size
    _, w_gate, w_up, w_down = make_weights(preset.num_experts, hidden, inter, gen)
    sizes = near_uniform_sizes(tokens, preset.top_k, preset.num_experts, gen)
    p = make_problem(sizes, hidden, gen)
    m = p.rows.shape[0]
    flops = 2 * m * hidden * inter
    cfg = default_config(p.rows.device, hidden, inter, m / preset.num_experts)
    maps = {}

    def t(c):
        if c.block_m not in maps:
            maps[c.block_m] = gg.row_tile_map(p.offsets, m, c.block_m)
        return maps[c.block_m]

    h, gate_up = gg.gate_up_swiglu(p.rows, w_gate, w_up, t(cfg.gate_up), None, True, cfg.gate_up)
    grad_gate_up = gg.down_dgrad_swiglu(
        p.grad_out, w_down, gate_up, t(cfg.down_dgrad), None, cfg.down_dgrad
    )
    grad_w_down = torch.empty_like(w_down)
    grad_w_gate = torch.empty(w_gate.shape, dtype=w_gate.dtype, device="cuda")
    grad_w_up = torch.empty_like(grad_w_gate)
    runs = {
        "gate_up": (2, lambda c: gg.gate_up_swiglu(p.rows, w_gate, w_up, t(c), None, True, c)),
        "down": (1, lambda c: gg.down(h, w_down, t(c), c)),
        "down_dgrad": (
            1,
            lambda c: gg.down_dgrad_swiglu(p.grad_out, w_down, gate_up, t(c), None, c),
        ),
        "gate_up_dgrad": (2, lambda c: gg.gate_up_dgrad(grad_gate_up, w_gate, w_up, t(c), c)),
        "down_wgrad": (
            1,
            lambda c: gg.down_wgrad(p.grad_out, h, p.offsets, grad_w_down, False, c),
        ),
        "gate_up_wgrad": (
            2,
            lambda c: gg.gate_up_wgrad(
                grad_gate_up, p.rows, p.offsets, grad_w_gate, grad_w_up, False, False, c
            ),
        ),
    }
    for kernel, (gemms, run) in runs.items():
        default = getattr(cfg, kernel)
        for c in [default] + [c for c in CANDIDATES[kernel] if c != default]:
            mark = "default" if c == default else "       "
            label = f"tune {name} T={tokens} {kernel:14s} {mark} {c}"
            try:
                ms = time_ms([lambda c=c, run=run: run(c)], budget_ms=150)
            except Exception as error:  # noqa: BLE001 (a candidate may not fit: report it)
                log(f"{label}: failed {type(error).__name__}: {str(error)[:200]}")
                continue
            log(f"{label}: {ms:.3f} ms {gemms * flops / ms / 1e9:.0f} TFLOP/s")


TUNE_PRESETS = (
    ("qwen3-30b-a3b", 16384),
    ("deepseek-v3", 8192),
    ("kimi-k2", 8192),
    ("mixtral-8x7b", 8192),
)


def tune(log, presets=TUNE_PRESETS):
    gen = torch.Generator(device="cuda").manual_seed(2)
    for name, tokens in presets:
        tune_preset(name, tokens, gen, log)
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--presets", nargs="*", default=[n for n in mok.PRESETS if n != "tiny"])
    parser.add_argument("--tokens", nargs="*", type=int, default=[8192, 16384])
    parser.add_argument(
        "--routing",
        choices=("uniform", "zipf"),
        default="uniform",
        help="the timed problems' group sizes (--bench): near-uniform or Zipf-skewed",
    )
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2

    def log(message):
        print(message, flush=True)

    log(
        f"{torch.cuda.get_device_name()} torch {torch.__version__} "
        f"triton {__import__('triton').__version__}"
    )
    ok = True
    if args.check:
        ok = check(log)
        log(f"check: {'all OK' if ok else 'FAILURES'}")
    if args.tune:
        tune(log)
    if args.bench:
        gen = torch.Generator(device="cuda").manual_seed(1)
        dense_rate = dense_tflops(8192, 8192, 8192, gen)
        log(f"dense bf16 8192^3: {dense_rate:.0f} TFLOP/s")
        rows, dense_equiv = [], {}
        for name in args.presets:
            preset = mok.get_preset(name)
            m = 8192 * preset.top_k
            dense_equiv[name] = dense_tflops(
                m, preset.hidden_size, 3 * preset.intermediate_size, gen
            )
            for tokens in args.tokens:
                rows.append(bench_preset(name, tokens, dense_rate, gen, log, args.routing))
        text = table(rows, dense_rate, dense_equiv)
        ok &= all(r["agree"] for r in rows)
        print(text)
        if args.out:
            header = (
                f"{datetime.date.today()} {torch.cuda.get_device_name()}, "
                f"torch {torch.__version__}, "
                f"triton {__import__('triton').__version__}, commit {git_commit()}\n\n"
                f"`{' '.join(['python', *sys.argv])}`\n\n"
            )
            with open(args.out, "w") as f:
                f.write(header + text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
