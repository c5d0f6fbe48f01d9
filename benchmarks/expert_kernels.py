"""Check, then time, the expert products on one GPU: the whole expert MLP against the native
experts' torch._grouped_mm, and each product's kernels (tl and warp-specialized Gluon) side by
side.

    python benchmarks/expert_kernels.py --check --bench --products --out table.md

--check     every preset at reduced token counts (near-uniform and Zipf routing, empty experts,
            capacity padding poisoned with NaN, outputs on NaN-poisoned memory) against the
            reference (`mok.reference.expert`), forward and backward.
--bench     the expert MLP (its default kernels: Gluon on Hopper) at every preset but tiny, 8192
            and 16384 tokens per rank: ours vs the baseline (one fused gate|up torch._grouped_mm,
            SwiGLU in PyTorch, torch._grouped_mm down; backward through autograd), each checked
            against the other on the same inputs before timing.
--products  each expert product (the list, or by default the six below) at four presets and 8192
            tokens: the tl kernel at its default tiles, the Gluon kernel at each of its tilings
            and the product's GEMM through torch._grouped_mm (PyTorch's CUTLASS grouped GEMM,
            what the native experts run, without the epilogue our kernels fuse: its error is of
            the whole product with that epilogue added untimed in fp32, its time a lower bound
            for the native path's). The forward's gate_up (h = swiglu(x @ W_gate[e].T, x @
            W_up[e].T), the pre-activations saved) and down (h @ W_down[e].T); the data
            gradients gate_up_dgrad (grad_gate @ W_gate[e] + grad_up @ W_up[e]) and down_dgrad
            (grad_out @ W_down[e], then the SwiGLU backward against the saved gate | up); the
            weight gradients down_wgrad (grad_out[e].T @ h[e]) and gate_up_wgrad (grad_gate[e].T
            @ x[e], and up), each written fresh in bf16 and added into fp32 buffers (gradient
            accumulation). Not in the default list: gate_up_sources and down_sources, the fused
            layer's building blocks (rows read through a dispatch index; down's peer-store
            epilogue), fp8_block_down and fp8_block_gate, the 128-block FP8 product on the FP8
            tensor cores beside the BF16 product and torch._scaled_grouped_mm on the same shape
            (`fp8_block_product`: x @ W_gate[e].T alone for the gate), and fp8_block_wgrad, the
            recipe's weight gradient of W_down beside the BF16 one and the tl kernel. Results
            are compared first (bitwise against the tl kernel, and with fp32 math); a result off
            raises.
--tune      per-kernel times of candidate tl tiles on four presets (for choosing
            `default_config`).

Every expert of the preset is on this GPU. Routing (--routing): near-uniform (top-k of a softmax
over random logits), Zipf-skewed expert popularity, or balanced (every expert the same rows, as
in the training benchmark's balanced routing). --gpt-oss: gate_up, down and down_dgrad compute
gpt-oss's experts (its activation gate * sigmoid(1.702 gate) * (up + 1) after the clamp at 7,
biases on gate, up and down). --fused-gate-up: W_gate and W_up are the halves of one [E, 2I, H]
tensor, as Hugging Face models hold them. Times: CUDA events around each call, the
implementations interleaved call by call over two input sets, median (and the 10-90 % range);
"% of dense" divides by cuBLAS (torch.mm) at 8192^3 in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys

import torch
import torch.nn.functional as F
import triton

import mok
from mok.bench import git_commit
from mok.kernels import (
    Activation,
    GemmTiles,
    default_config,
    expert_mlp_backward,
    expert_mlp_forward,
    host,
    warp_specialized,
)
from mok.kernels import grouped_gemm as gg
from mok.kernels.grouped_gemm import row_tile_map
from mok.reference.expert import swiglu
from mok.testing import grouped_expert_reference, relative_error

BF16_TOL = 2e-2
PRODUCT_PRESETS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2")
"""--products' default presets."""


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


def group_sizes(routing: str, tokens: int, top_k: int, experts: int, gen) -> list[int]:
    """Rows per expert of a timed problem: `uniform`, top-k of random logits; `zipf`, Zipf-skewed
    popularity with every expert kept (the skew a young router in training can have); `balanced`,
    tokens x top_k split evenly."""
    if routing == "zipf":
        return zipf_sizes(tokens * top_k, experts, gen, empty=0)
    if routing == "balanced":
        share, extra = divmod(tokens * top_k, experts)
        return [share + (e < extra) for e in range(experts)]
    return near_uniform_sizes(tokens, top_k, experts, gen)


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
# Timing
# ------------------------------------------------------------------------------------------------


def time_each(fns: dict, inputs: int, iters: int = 30) -> dict[str, tuple[float, float, float]]:
    """name -> (median, 10th, 90th percentile) ms of fn(input set); the calls interleaved across
    names and input sets, after one warm-up call of each."""
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


def dense_tflops(m, k, n, gen) -> float:
    a = randn(m, k, gen=gen)
    b = randn(k, n, gen=gen)
    ms = time_each({"mm": lambda i: torch.mm(a, b)}, 1)["mm"][0]
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
# --bench: the expert MLP against the baseline
# ------------------------------------------------------------------------------------------------


def baseline_forward(rows, ends, w_gate_up, w_down, inter):
    """ends: [E] int32 cumulative end offsets, as torch._grouped_mm takes them."""
    gate_up = torch._grouped_mm(rows, w_gate_up.transpose(1, 2), offs=ends)
    h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    return torch._grouped_mm(h, w_down.transpose(1, 2), offs=ends)


class Baseline:
    """torch._grouped_mm (one fused gate|up GEMM), SwiGLU in PyTorch, autograd backward."""

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


def bench_preset(name, tokens, dense_rate, gen, log, routing="uniform"):
    preset = mok.get_preset(name)
    hidden, inter, num_experts = preset.hidden_size, preset.intermediate_size, preset.num_experts
    w_gate_up, w_gate, w_up, w_down = make_weights(num_experts, hidden, inter, gen)
    problems = [
        make_problem(group_sizes(routing, tokens, preset.top_k, num_experts, gen), hidden, gen)
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
        "out": relative_error(out, base_out),
        "grad_rows": relative_error(grads[0], base_grads[0]),
        "grad_w_gate": relative_error(grads[1], base_grads[1][:, :inter]),
        "grad_w_up": relative_error(grads[2], base_grads[1][:, inter:]),
        "grad_w_down": relative_error(grads[3], base_grads[2]),
    }
    del out, saved, grads, base, base_out, base_grads
    agree = max(errors.values()) < BF16_TOL
    log(f"agree {name} T={tokens}: " + " ".join(f"{k}={v:.2e}" for k, v in errors.items()))

    # Timed interleaved, ours and the baseline call by call, forward then backward.
    baselines = [Baseline(p, w_gate_up, w_down, inter) for p in problems]
    forward = {
        "ours": lambda i: expert_mlp_forward(
            problems[i].rows, problems[i].offsets, w_gate, w_up, w_down
        ),
        "base": lambda i: baselines[i].forward(),
    }
    fwd = time_each(forward, len(problems))
    saved = [forward["ours"](i)[1] for i in range(len(problems))]
    for b in baselines:
        b.forward()
    bwd = time_each(
        {
            "ours": lambda i: expert_mlp_backward(problems[i].grad_out, saved[i]),
            "base": lambda i: baselines[i].backward(),
        },
        len(problems),
    )

    def rate(ms, scale=1):
        return scale * flops / ms / 1e9

    row = dict(
        preset=name if routing == "uniform" else f"{name} ({routing})",
        tokens=tokens,
        rows=m,
        agree=agree,
        ours_fwd=fwd["ours"][0],
        base_fwd=fwd["base"][0],
        ours_bwd=bwd["ours"][0],
        base_bwd=bwd["base"][0],
    )
    row.update(
        ours_fwd_tf=rate(row["ours_fwd"]),
        base_fwd_tf=rate(row["base_fwd"]),
        ours_bwd_tf=rate(row["ours_bwd"], 2),
        base_bwd_tf=rate(row["base_bwd"], 2),
    )
    row["fwd_pct"] = 100 * row["ours_fwd_tf"] / dense_rate
    row["bwd_pct"] = 100 * row["ours_bwd_tf"] / dense_rate
    log(f"bench {row}")
    return row


def bench_table(rows, dense_equiv) -> str:
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
        "cuBLAS dense bf16 at each preset's forward size (8192 x top_k rows x H x 3I): "
        + ", ".join(f"{k} {v:.0f}" for k, v in dense_equiv.items())
        + " TFLOP/s."
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# --products: each product's kernels side by side
# ------------------------------------------------------------------------------------------------


GLUON_TILES = {
    "down": {
        "gluon 64x256": warp_specialized.PING_PONG,
        "gluon 128x128 coop": GemmTiles(128, 128, 64, num_warps=4, num_stages=4),
        "gluon 128x256 coop": warp_specialized.COOPERATIVE,
    },
    "gate_up": {
        "gluon 64x128": warp_specialized.SWIGLU_PING_PONG,
        "gluon 128x128 coop": warp_specialized.SWIGLU_COOPERATIVE,
    },
    "wgrad": {
        "gluon 64x128": GemmTiles(64, 128, 64, num_warps=4, num_stages=6),
        "gluon 64x256": GemmTiles(64, 256, 64, num_warps=4, num_stages=4),
        "gluon 128x128 shared": GemmTiles(128, 128, 64, num_warps=4, num_stages=4),
        "gluon 128x256 shared": GemmTiles(128, 256, 64, num_warps=4, num_stages=3),
    },
}
DGRAD_TILES = {
    "gate_up_dgrad": {
        # The tl kernel at the Gluon kernels' BLOCK_K: its results are the bitwise reference (the
        # two products alternate every BLOCK_K columns of the reduction).
        "tl 128x128 bk64": GemmTiles(128, 128, 64, num_warps=8, num_stages=3),
        "gluon 64x256": warp_specialized.PING_PONG,
        "gluon 128x256 coop": warp_specialized.COOPERATIVE,
    },
    "down_dgrad": {
        "gluon 64x128": warp_specialized.DGRAD_SWIGLU_PING_PONG,
        "gluon 128x128 coop": warp_specialized.DGRAD_SWIGLU_COOPERATIVE,
    },
}
CUTLASS = "torch._grouped_mm, GEMM alone"
"""The label of PyTorch's grouped GEMM (CUTLASS on Hopper) beside our kernels, every product."""
WGRAD_CHECKED_EXPERTS = 8
"""Experts whose gradients are compared with fp32 math (all are compared with the tl kernel)."""


def product_line(name, product, tokens, m, label, timing, flops, dense, error, bitwise) -> str:
    """One table row of a product's kernel: its time (median, min-max), TFLOP/s and share of
    `dense`, its error, and whether it equals the tl kernel bitwise (None: n/a)."""
    ms, low, high = timing
    tflops = flops / ms / 1e9
    same = "n/a" if bitwise is None else "yes" if bitwise else "no"
    return (
        f"| {name} | {product} | {tokens} | {m} | {label} | {ms:.3f} ({low:.3f}-{high:.3f}) "
        f"| {tflops:.0f} | {100 * tflops / dense:.0f} % | {error:.2e} | {same} |"
    )


def cutlass_line(name, product, tokens, m, timing, flops, dense, error) -> str:
    """The table row of torch._grouped_mm (PyTorch's CUTLASS grouped GEMM) for a product's GEMM
    alone, as the native experts run it: without the epilogue our kernel fuses (SwiGLU, its
    backward), so its time is a lower bound for theirs."""
    return product_line(name, product, tokens, m, CUTLASS, timing, flops, dense, error, None)


GPT_OSS = Activation(1.702, 1.0)
GPT_OSS_LIMIT = 7.0


def activation(gate, up, gpt_oss: bool):
    """The experts' activation in fp32: SwiGLU, or gpt-oss's (its clamp, alpha and offset)."""
    if gpt_oss:
        return swiglu(gate, up, GPT_OSS_LIMIT, GPT_OSS.alpha, GPT_OSS.up_offset)
    return torch.nn.functional.silu(gate) * up


def _shape(name: str) -> tuple[int, int, int, int]:
    """(experts, hidden, intermediate, top_k) of a preset (gpt-oss's: the short-group case with a
    hidden size off the tiles, H = I = 2880 = 11.25 x 256; its activation and biases with
    --gpt-oss)."""
    shape = mok.PRESETS[name]
    return shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.top_k


def gate_up_weights(experts, inter, hidden, gen, scale, fused):
    """(W_gate and W_up [E, I, H], the native experts' fused [E, 2I, H] weight). `fused`: the two
    are the halves of that one tensor, as Hugging Face models hold gate_up_proj (what
    `mok.integrations.transformers` hands the kernels), else tensors of their own."""
    if fused:
        both = randn(experts, 2 * inter, hidden, gen=gen, scale=scale)
        return [both[:, :inter], both[:, inter:]], both
    weights = [randn(experts, inter, hidden, gen=gen, scale=scale) for _ in range(2)]
    return weights, torch.cat(weights, 1)


def row_product(
    name: str,
    product: str,
    tokens: int,
    dense: float,
    gen,
    fused=False,
    routing="uniform",
    gpt_oss=False,
) -> list[str]:
    experts, hidden, inter, top_k = _shape(name)
    down = product == "down"
    k_dim = inter if down else hidden
    n_dim = hidden if down else inter
    biases = [randn(experts, n_dim, gen=gen) for _ in range(1 if down else 2)] if gpt_oss else None
    limit = GPT_OSS_LIMIT if gpt_oss else None
    options = {"activation": GPT_OSS, "biases": biases} if gpt_oss else {}
    sets = []
    for _ in range(2):
        sizes = group_sizes(routing, tokens, top_k, experts, gen)
        offsets = torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32)
        sets.append((randn(sum(sizes), k_dim, gen=gen), offsets))
    if down:
        weights = [randn(experts, hidden, inter, gen=gen, scale=inter**-0.5)]
        native_weight = weights[0]
    else:
        weights, native_weight = gate_up_weights(experts, inter, hidden, gen, hidden**-0.5, fused)
    m = sets[0][0].shape[0]
    default = default_config(torch.device("cuda"), hidden, inter, m / experts)
    tl_cfg = default.down if down else default.gate_up
    configs = {f"tl {tl_cfg.block_m}x{tl_cfg.block_n}": tl_cfg, **GLUON_TILES[product]}
    maps = {
        (i, cfg.block_m): row_tile_map(offsets, rows.shape[0], cfg.block_m)
        for i, (rows, offsets) in enumerate(sets)
        for cfg in configs.values()
    }

    def runner(label, cfg):
        tl_kernel = label.startswith("tl")
        if down:
            kernel = gg.down if tl_kernel else warp_specialized.down
            bias = biases[0] if gpt_oss else None
            return lambda i: kernel(sets[i][0], *weights, maps[i, cfg.block_m], cfg, bias=bias)
        kernel = gg.gate_up_swiglu if tl_kernel else warp_specialized.gate_up_swiglu
        return lambda i: kernel(
            sets[i][0], *weights, maps[i, cfg.block_m], limit, True, cfg, **options
        )

    fns = {label: runner(label, cfg) for label, cfg in configs.items()}
    # The native experts' GEMM: one [2I] wide product for gate and up (their fused weight).
    fns[CUTLASS] = lambda i: torch._grouped_mm(
        sets[i][0], native_weight.transpose(1, 2), offs=sets[i][1][1:]
    )
    rows, offsets = sets[0]
    results = {label: fn(0) for label, fn in fns.items()}
    bounds = offsets.tolist()
    pieces = []
    for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        products = [rows[a:b].float() @ w[e].float().T for w in weights]
        if gpt_oss:
            products = [p + bias[e].float() for p, bias in zip(products, biases, strict=True)]
        pieces.append(products[0] if down else activation(*products, gpt_oss))
    expected = torch.cat(pieces)
    tl_label = next(iter(configs))
    lines = []
    times = time_each(fns, len(sets))
    flops = 2 * m * hidden * inter * len(weights)
    for label in configs:
        result = results[label] if down else results[label][0]
        error = relative_error(result, expected)
        bitwise = all(
            torch.equal(a, b)
            for a, b in zip(
                results[label] if not down else [results[label]],
                results[tl_label] if not down else [results[tl_label]],
                strict=True,
            )
        )
        lines.append(
            product_line(
                name, product, tokens, m, label, times[label], flops, dense, error, bitwise
            )
        )
        if error > 4e-3:
            raise AssertionError(f"{name} {product} {label}: relative error {error:.2e}")
    native = results[CUTLASS].float()
    if gpt_oss:  # the biases and the activation after the native GEMM, untimed
        expert = torch.repeat_interleave(torch.arange(experts, device="cuda"), offsets.diff())
        native = native + torch.cat(biases, 1)[expert].float()
    if not down:
        native = activation(native[:, :inter], native[:, inter:], gpt_oss)
    error = relative_error(native, expected)
    lines.append(cutlass_line(name, product, tokens, m, times[CUTLASS], flops, dense, error))
    if error > 4e-3:
        raise AssertionError(f"{name} {product} {CUTLASS}: relative error {error:.2e}")
    return lines


def _swiglu_grads(grad_h, gate, up, gpt_oss=False):
    """fp32 gradients of the activation (`activation`) through autograd."""
    gate, up = gate.float().requires_grad_(), up.float().requires_grad_()
    h = activation(gate, up, gpt_oss)
    return torch.autograd.grad(h, (gate, up), grad_h.float())


def data_gradient(
    name: str,
    product: str,
    tokens: int,
    dense: float,
    gen,
    fused=False,
    routing="uniform",
    gpt_oss=False,
) -> list[str]:
    """gate_up_dgrad: grad_x = grad_gate @ W_gate[e] + grad_up @ W_up[e]; down_dgrad: the gate |
    up gradients from grad_out through W_down[e] and the SwiGLU backward."""
    experts, hidden, inter, top_k = _shape(name)
    down = product == "down_dgrad"
    sets = []
    for _ in range(2):
        sizes = group_sizes(routing, tokens, top_k, experts, gen)
        offsets = torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32)
        m = sum(sizes)
        if down:
            sets.append((randn(m, hidden, gen=gen), randn(m, 2 * inter, gen=gen), offsets))
        else:
            sets.append((randn(m, 2 * inter, gen=gen), None, offsets))
    if down:
        weights = [randn(experts, hidden, inter, gen=gen, scale=hidden**-0.5)]
        native_weight = weights[0]
    else:
        weights, native_weight = gate_up_weights(experts, inter, hidden, gen, inter**-0.5, fused)
    m = sets[0][0].shape[0]
    default = default_config(torch.device("cuda"), hidden, inter, m / experts)
    tl_cfg = default.down_dgrad if down else default.gate_up_dgrad
    tl_label = f"tl {tl_cfg.block_m}x{tl_cfg.block_n} bk{tl_cfg.block_k}"
    configs = {tl_label: tl_cfg, **DGRAD_TILES[product]}
    bitwise_label = next(label for label, cfg in configs.items() if cfg.block_k == 64)
    maps = {
        (i, cfg.block_m): row_tile_map(offsets, a.shape[0], cfg.block_m)
        for i, (a, _, offsets) in enumerate(sets)
        for cfg in configs.values()
    }

    def runner(label, cfg):
        tl_kernel = label.startswith("tl")
        if down:
            kernel = gg.down_dgrad_swiglu if tl_kernel else warp_specialized.down_dgrad_swiglu
            limit, options = (GPT_OSS_LIMIT, {"activation": GPT_OSS}) if gpt_oss else (None, {})
            return lambda i: kernel(
                sets[i][0], weights[0], sets[i][1], maps[i, cfg.block_m], limit, cfg, **options
            )
        kernel = gg.gate_up_dgrad if tl_kernel else warp_specialized.gate_up_dgrad
        return lambda i: kernel(sets[i][0], *weights, maps[i, cfg.block_m], cfg)

    fns = {label: runner(label, cfg) for label, cfg in configs.items()}
    # The native experts' GEMM: grad_h = grad_out @ W_down[e], or grad_x from the fused [2I] weight.
    fns[CUTLASS] = lambda i: torch._grouped_mm(sets[i][0], native_weight, offs=sets[i][2][1:])
    results = {label: fn(0) for label, fn in fns.items()}
    a, saved, offsets = sets[0]
    bounds = offsets.tolist()
    pieces = []
    for e, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        if down:
            grad_h = (a[lo:hi].float() @ weights[0][e].float()).bfloat16()
            pieces.append(torch.cat(_swiglu_grads(grad_h, *saved[lo:hi].chunk(2, 1), gpt_oss), 1))
        else:
            pieces.append(
                a[lo:hi, :inter].float() @ weights[0][e].float()
                + a[lo:hi, inter:].float() @ weights[1][e].float()
            )
    expected = torch.cat(pieces)
    times = time_each(fns, len(sets))
    flops = 2 * m * hidden * inter * (1 if down else 2)
    lines = []
    for label in configs:
        error = relative_error(results[label], expected)
        bitwise = torch.equal(results[label], results[bitwise_label])
        lines.append(
            product_line(
                name, product, tokens, m, label, times[label], flops, dense, error, bitwise
            )
        )
        if error > 4e-3 or (configs[label].block_k == 64 and not bitwise):
            raise AssertionError(f"{name} {product} {label}: error {error:.2e}, {bitwise=}")
    native = results[CUTLASS]
    if down:  # the SwiGLU backward the native path runs after its GEMM (untimed here)
        native = torch.cat(_swiglu_grads(native, *saved.chunk(2, 1), gpt_oss), 1)
    error = relative_error(native, expected)
    lines.append(cutlass_line(name, product, tokens, m, times[CUTLASS], flops, dense, error))
    if error > 4e-3:
        raise AssertionError(f"{name} {product} {CUTLASS}: relative error {error:.2e}")
    return lines


def weight_gradient(
    name: str, product: str, tokens: int, dense: float, gen, routing="uniform"
) -> list[str]:
    experts, hidden, inter, top_k = _shape(name)
    down = product == "down_wgrad"
    # A [M, halves * P] and B [M, Q] -> gradients [E, P, Q] per half.
    p, q, halves = (hidden, inter, 1) if down else (inter, hidden, 2)
    sets = []
    for _ in range(2):
        sizes = group_sizes(routing, tokens, top_k, experts, gen)
        offsets = torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32)
        m = sum(sizes)
        sets.append((randn(m, halves * p, gen=gen), randn(m, q, gen=gen), offsets))
    m = sets[0][0].shape[0]
    default = default_config(torch.device("cuda"), hidden, inter, m / experts)
    tl_cfg = default.down_wgrad if down else default.gate_up_wgrad
    # The Gluon kernel takes gradients whose P is a multiple of 64 rows (`wgrad_supported`).
    gluon = {
        label: cfg
        for label, cfg in GLUON_TILES["wgrad"].items()
        if p % warp_specialized.CONSUMER_ROWS == 0
    }
    configs = {f"tl {tl_cfg.block_m}x{tl_cfg.block_n}": tl_cfg, **gluon}

    def run(label, cfg, i, grads, accumulate):
        a, b, offsets = sets[i]
        tl_kernel = label.startswith("tl")
        if down:
            kernel = gg.down_wgrad if tl_kernel else warp_specialized.down_wgrad
            kernel(a, b, offsets, *grads, accumulate, cfg)
        else:
            kernel = gg.gate_up_wgrad if tl_kernel else warp_specialized.gate_up_wgrad
            kernel(a, b, offsets, *grads, accumulate, accumulate, cfg)

    def buffers(dtype):
        return [torch.empty(experts, p, q, dtype=dtype, device="cuda") for _ in range(halves)]

    def native(i):
        """The native experts' weight gradient: [E, halves * P, Q], gate and up stacked."""
        a, b, offsets = sets[i]
        return torch._grouped_mm(a.t(), b, offs=offsets[1:])

    fresh = {}
    for label, cfg in configs.items():
        fresh[label] = buffers(torch.bfloat16)
        run(label, cfg, 0, fresh[label], False)
    fresh[CUTLASS] = native(0).split(p, 1)
    a, b, offsets = sets[0]
    bounds = offsets.tolist()
    tl_label = next(iter(configs))
    errors = {}
    for label in fresh:
        error_sq = scale_sq = 0.0
        for e in range(WGRAD_CHECKED_EXPERTS):
            rows = slice(bounds[e], bounds[e + 1])
            for j in range(halves):
                expected = a[rows, j * p : (j + 1) * p].float().T @ b[rows].float()
                error_sq += (fresh[label][j][e].float() - expected).square().sum().item()
                scale_sq += expected.square().sum().item()
        errors[label] = (error_sq / scale_sq) ** 0.5
    bitwise = {
        label: all(torch.equal(x, y) for x, y in zip(fresh[label], fresh[tl_label], strict=True))
        for label in configs
    }
    del fresh
    if errors[CUTLASS] > 4e-3:
        raise AssertionError(f"{name} {product} {CUTLASS}: error {errors[CUTLASS]:.2e}")
    flops = 2 * m * hidden * inter * halves
    lines = []
    for mode, dtype, accumulate in (
        ("bf16", torch.bfloat16, False),
        ("+= fp32", torch.float32, True),
    ):
        grads = buffers(dtype)  # shared by the kernels: only the timing is of interest here
        # fp32 epilogue buffers 256 wide do not fit beside the ring: bf16 gradients only.
        timed = {
            label: cfg
            for label, cfg in configs.items()
            if not accumulate or label.startswith("tl") or cfg.block_n <= 128
        }
        fns = {
            label: (
                lambda i, label=label, cfg=cfg, grads=grads, accumulate=accumulate: run(
                    label, cfg, i, grads, accumulate
                )
            )
            for label, cfg in timed.items()
        }
        if not accumulate:  # torch._grouped_mm writes fresh gradients only
            fns[CUTLASS] = native
        times = time_each(fns, len(sets))
        for label in timed:
            lines.append(
                product_line(
                    name,
                    f"{product} {mode}",
                    tokens,
                    m,
                    label,
                    times[label],
                    flops,
                    dense,
                    errors[label],
                    bitwise[label],
                )
            )
        if CUTLASS in fns:
            product_mode = f"{product} {mode}"
            timing = times[CUTLASS]
            error = errors[CUTLASS]
            lines.append(cutlass_line(name, product_mode, tokens, m, timing, flops, dense, error))
        del grads
    for label in configs:
        if errors[label] > 4e-3 or not bitwise[label]:
            raise AssertionError(
                f"{name} {product} {label}: error {errors[label]:.2e}, bitwise {bitwise[label]}"
            )
    return lines


def building_block(
    name: str, product: str, tokens: int, dense: float, gen, routing="uniform"
) -> list[str]:
    """The building blocks of the fused layer inside the Gluon kernels, with the default tiles:
    gate/up and down with A rows gathered through a dispatch index (token t's rows, top_k times)
    against TMA tiles of rows gathered beforehand, beside the copy that gathering replaces; and
    down's peer-store epilogue (rows scattered to two simulated ranks' buffers on this GPU, with
    readiness counts) against local stores. Results must equal the TMA kernel's bit for bit."""
    experts, hidden, inter, top_k = _shape(name)
    sizes = group_sizes(routing, tokens, top_k, experts, gen)
    offsets = torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32)
    m = sum(sizes)
    index = torch.randint(0, tokens, (m,), generator=gen, device="cuda", dtype=torch.int32)
    default = default_config(torch.device("cuda"), hidden, inter, m / experts)
    down = product == "down_sources"
    k_dim = inter if down else hidden
    source = randn(tokens, k_dim, gen=gen)
    gathered_first = source[index.long()].contiguous()
    if down:
        cfg = default.gluon.down
        weights = [randn(experts, hidden, inter, gen=gen, scale=inter**-0.5)]
    else:
        cfg = default.gluon.gate_up
        weights = [randn(experts, inter, hidden, gen=gen, scale=hidden**-0.5) for _ in range(2)]
    tiles = row_tile_map(offsets, m, cfg.block_m)
    tile_label = f"{cfg.block_m}x{cfg.block_n}"
    if down:
        ep, rank = 2, 0
        per_rank = (m // ep + 1024) * hidden
        buffers = torch.empty(ep, per_rank // hidden, hidden, dtype=torch.bfloat16, device="cuda")
        dest_rank = torch.randint(0, ep, (m,), generator=gen, device="cuda", dtype=torch.int32)
        dest_row = torch.zeros(m, dtype=torch.int32, device="cuda")
        for d in range(ep):
            mine = (dest_rank == d).nonzero().flatten()
            dest_row[mine] = torch.randperm(mine.numel(), device="cuda", generator=gen).int()
        counts = torch.zeros(ep, ep, dtype=torch.int32, device="cuda")
        scatter = host.RowScatter(
            out=buffers[rank],
            out_offsets=torch.arange(ep, device="cuda") * per_rank,
            dest_rank=dest_rank,
            dest_row=dest_row,
            counts=counts[rank],
            counts_offsets=torch.arange(ep, device="cuda") * ep,
            rank=rank,
        )
        fns = {
            f"gluon {tile_label} tma rows": lambda: warp_specialized.down(
                gathered_first, *weights, tiles, cfg
            ),
            f"gluon {tile_label} gathered": lambda: warp_specialized.down(
                source, *weights, tiles, cfg, source_rows=index
            ),
            f"gluon {tile_label} gathered + peer stores": lambda: warp_specialized.down_scatter(
                source, *weights, tiles, scatter, cfg, source_rows=index
            ),
        }
    else:
        fns = {
            f"gluon {tile_label} tma rows": lambda: warp_specialized.gate_up_swiglu(
                gathered_first, *weights, tiles, None, True, cfg
            )[0],
            f"gluon {tile_label} gathered": lambda: warp_specialized.gate_up_swiglu(
                source, *weights, tiles, None, True, cfg, source_rows=index
            )[0],
        }
    fns["the copy it replaces: rows[index]"] = lambda: source.index_select(0, index)
    results = {label: fn() for label, fn in fns.items()}
    reference = next(iter(results.values()))
    if down:
        counts.zero_()
        warp_specialized.down_scatter(source, *weights, tiles, scatter, cfg, source_rows=index)
        landed = torch.cat([buffers[d][dest_row[dest_rank == d].long()] for d in range(ep)])
        order = torch.cat([(dest_rank == d).nonzero().flatten() for d in range(ep)])
        results[f"gluon {tile_label} gathered + peer stores"] = torch.empty_like(reference)
        results[f"gluon {tile_label} gathered + peer stores"][order] = landed
        sent = torch.bincount(dest_rank.long(), minlength=ep) * triton.cdiv(hidden, cfg.block_n)
        if counts[:, rank].tolist() != sent.tolist():
            raise AssertionError(f"{name}: readiness counts {counts[:, rank]} != {sent}")
    times = time_each({label: (lambda i, fn=fn: fn()) for label, fn in fns.items()}, 1)
    flops = 2 * m * hidden * inter * len(weights)
    lines = []
    for label in fns:
        ms, low, high = times[label]
        copy = label.startswith("the copy")
        same = copy or torch.equal(results[label], reference)
        tflops = "" if copy else f"{flops / ms / 1e9:.0f}"
        share = "" if copy else f"{100 * flops / ms / 1e9 / dense:.0f} %"
        lines.append(
            f"| {name} | {product} | {tokens} | {m} | {label} | {ms:.3f} ({low:.3f}-{high:.3f}) "
            f"| {tflops} | {share} | | {'yes' if same else 'no'} |"
        )
        if not same:
            raise AssertionError(f"{name} {product} {label}: differs from the TMA rows' result")
    return lines


def _rowwise_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t's e4m3 cast with one fp32 scale per row along its last dimension (the rowwise recipe
    of torch._scaled_grouped_mm): (values, scales), t ~= values * scales[..., None]."""
    scales = t.float().abs().amax(-1).clamp(min=1e-12) / 448.0
    return (t.float() / scales.unsqueeze(-1)).to(torch.float8_e4m3fn), scales


def _beside_bf16(name, product, tokens, m, errors, times, bf16_label, flops, dense) -> list[str]:
    """The table's rows of kernels timed beside a BF16 one (`time_each`'s times), each within its
    error against fp32 (BF16 4e-3, FP8 8e-2: e4m3's rounding), else AssertionError; each FP8
    label carries its speed over the BF16 kernel's."""
    lines = []
    for label, error in errors.items():
        if error > (4e-3 if label == bf16_label else 8e-2):
            raise AssertionError(f"{name} {product} {label}: relative error {error:.2e}")
        speed = times[bf16_label][0] / times[label][0]
        shown = label if label == bf16_label else f"{label} ({speed:.2f}x bf16)"
        lines.append(
            product_line(name, product, tokens, m, shown, times[label], flops, dense, error, None)
        )
    return lines


def fp8_block_product(name, product, tokens, dense, gen, routing="uniform") -> list[str]:
    """The 128-block FP8 product on the FP8 tensor cores
    (`warp_specialized.block_scaled_grouped_mm`) beside the BF16 product (`warp_specialized.down`)
    on the same grouped shape: down's (h @ W_down[e].T, fp8_block_down) or the gate projection's
    (x @ W_gate[e].T, fp8_block_gate), plain products with bf16 outputs, the operands cast by the
    recipe's kernels beforehand (untimed); and PyTorch's rowwise FP8 grouped GEMM
    (torch._scaled_grouped_mm) on the same shape, as an anchor, where this PyTorch runs it.
    Errors against the fp32 product of the unquantized operands; the FP8 kernel is checked first
    against the fp32 product of its own dequantized operands. The label of each FP8 kernel
    carries its speed over the BF16 product's."""
    from mok.kernels.fp8_block import block_quantize_tiles
    from mok.reference.fp8_block import dequantize_blocks, dequantize_tiles, quantize_blocks

    experts, hidden, inter, top_k = _shape(name)
    k_dim, n_dim = (inter, hidden) if product == "fp8_block_down" else (hidden, inter)
    weight = randn(experts, n_dim, k_dim, gen=gen, scale=k_dim**-0.5)
    w_cast = [t.contiguous() for t in quantize_blocks(weight)]
    w_rowwise, w_scales = _rowwise_fp8(weight)
    sets = []
    for _ in range(2):
        sizes = group_sizes(routing, tokens, top_k, experts, gen)
        offsets = torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32)
        rows = randn(sum(sizes), k_dim, gen=gen)
        tiles = row_tile_map(offsets, rows.shape[0], warp_specialized.CONSUMER_ROWS)
        sets.append((rows, offsets, tiles, block_quantize_tiles(rows), _rowwise_fp8(rows)))
    bf16_label, fp8_label, rowwise_label = "gluon bf16 64x256", "gluon fp8 64x128", "torch fp8"
    fns = {
        bf16_label: lambda i: warp_specialized.down(
            sets[i][0], weight, sets[i][2], warp_specialized.PING_PONG
        ),
        fp8_label: lambda i: warp_specialized.block_scaled_grouped_mm(
            *sets[i][3], *w_cast, sets[i][1], sets[i][2]
        ),
        rowwise_label: lambda i: torch._scaled_grouped_mm(
            sets[i][4][0], w_rowwise.transpose(1, 2), sets[i][4][1], w_scales,
            offs=sets[i][1][1:], out_dtype=torch.bfloat16,
        ),
    }  # fmt: skip
    rows, offsets, _, a_cast, _ = sets[0]
    results, unavailable = {}, {}
    for label, fn in fns.items():
        try:
            results[label] = fn(0)
        except (RuntimeError, NotImplementedError) as error:  # the anchor on this PyTorch
            if label != rowwise_label:
                raise
            unavailable[label] = str(error).splitlines()[0][:80]
    for label in unavailable:
        del fns[label]
    bounds = offsets.tolist()
    a_dequantized = dequantize_tiles(*a_cast)
    expected, dequantized = [], []
    for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        expected.append(rows[a:b].float() @ weight[e].float().T)
        dequantized.append(a_dequantized[a:b] @ dequantize_blocks(w_cast[0][e], w_cast[1][e]).T)
    expected, dequantized = torch.cat(expected), torch.cat(dequantized)
    own_error = relative_error(results[fp8_label], dequantized)
    if own_error > 1e-2:
        raise AssertionError(f"{name} {product} {fp8_label}: {own_error:.2e} off its own operands")
    times = time_each(fns, len(sets))
    m = rows.shape[0]
    errors = {label: relative_error(result, expected) for label, result in results.items()}
    lines = _beside_bf16(
        name, product, tokens, m, errors, times, bf16_label, 2 * m * k_dim * n_dim, dense
    )
    lines += [f"| {name} | {product} | {tokens} | {m} | {label}: {why} | | | | | |"
              for label, why in unavailable.items()]  # fmt: skip
    return lines


def fp8_block_wgrad(name, product, tokens, dense, gen, routing="uniform") -> list[str]:
    """The 128-block recipe's weight gradient of W_down on the FP8 tensor cores
    (`warp_specialized.block_scaled_grouped_wgrad`: grad_out [M, H].T @ h [M, I] per expert, both
    cast along the group's tokens, stored tokens-contiguous, untimed) beside the BF16 one
    (`warp_specialized.down_wgrad`) and the recipe's tl kernel, bf16 gradients [E, H, I]. Checked
    first against the fp32 product of its own dequantized operands on the first experts, then
    every kernel against the fp32 product of the unquantized ones."""
    from mok.kernels.fp8_block import (
        block_quantize_tokens,
        block_scaled_grouped_wgrad,
        token_tile_starts,
    )
    from mok.reference.fp8_block import dequantize_tiles

    experts, hidden, inter, top_k = _shape(name)
    sets = []
    for _ in range(2):
        sizes = group_sizes(routing, tokens, top_k, experts, gen)
        offsets = torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32)
        grad, h = randn(sum(sizes), hidden, gen=gen), randn(sum(sizes), inter, gen=gen)
        tiles = row_tile_map(offsets, grad.shape[0], 128)
        casts = [block_quantize_tokens(t, tiles) for t in (grad, h)]
        transposed = [block_quantize_tokens(t, tiles, transposed=True) for t in (grad, h)]
        sets.append((grad, h, offsets, casts, transposed, token_tile_starts(offsets)))
    bf16_label, fp8_label, tl_label = "gluon bf16", "gluon fp8 64x128", "tl fp8"
    # 64-column tiles: no spills (the 128-column ones spill X's per-column descales), twice the
    # G tiles read per product.
    narrow = dataclasses.replace(
        warp_specialized.BLOCK_SCALED_WGRAD_TILES, block_n=64, num_stages=8
    )

    def bf16(i):
        grad, h, offsets = sets[i][:3]
        out = torch.empty(experts, hidden, inter, dtype=torch.bfloat16, device="cuda")
        warp_specialized.down_wgrad(grad, h, offsets, out, False)  # the layer's tiles
        return out

    fns = {
        bf16_label: bf16,
        fp8_label: lambda i: warp_specialized.block_scaled_grouped_wgrad(
            *sets[i][4], sets[i][2], sets[i][5], torch.bfloat16
        ),
        "gluon fp8 64x64": lambda i: warp_specialized.block_scaled_grouped_wgrad(
            *sets[i][4], sets[i][2], sets[i][5], torch.bfloat16, narrow
        ),
        tl_label: lambda i: block_scaled_grouped_wgrad(
            *sets[i][3][0], *sets[i][3][1], sets[i][2], torch.bfloat16
        ),
    }
    results = {label: fn(0) for label, fn in fns.items()}
    grad, h, offsets, casts = sets[0][:4]
    bounds = offsets.tolist()
    g_exact, h_exact = (dequantize_tiles(*cast, dim=0) for cast in casts)
    checked = range(min(WGRAD_CHECKED_EXPERTS, experts))
    groups = [slice(bounds[e], bounds[e + 1]) for e in checked]
    expected = torch.stack([grad[rows].float().T @ h[rows].float() for rows in groups])
    own = torch.stack([g_exact[rows].T @ h_exact[rows] for rows in groups])
    errors = {}
    for label, result in results.items():
        got = torch.stack([result[e].float() for e in checked])
        if label != bf16_label and relative_error(got, own) > 1e-2:
            raise AssertionError(f"{name} {product} {label}: off its own operands")
        errors[label] = relative_error(got, expected)
    times = time_each(fns, len(sets))
    m = grad.shape[0]
    flops = 2 * m * hidden * inter
    return _beside_bf16(name, product, tokens, m, errors, times, bf16_label, flops, dense)


PRODUCTS = {
    "gate_up": row_product,
    "down": row_product,
    "gate_up_dgrad": data_gradient,
    "down_dgrad": data_gradient,
    "down_wgrad": weight_gradient,
    "gate_up_wgrad": weight_gradient,
    "gate_up_sources": building_block,
    "down_sources": building_block,
    "fp8_block_down": fp8_block_product,
    "fp8_block_gate": fp8_block_product,
    "fp8_block_wgrad": fp8_block_wgrad,
}
"""Each product's runner; the first six are the default list of --products."""


def products_header(routing: str, gpt_oss: bool) -> list[str]:
    return [
        f"## Each product's kernels (routing {routing}"
        + (", gpt-oss's experts" if gpt_oss else "")
        + ")",
        "",
        "| preset | product | tokens | rows | kernel | ms (10-90 %) | TFLOP/s | % of dense | "
        "error vs fp32 | bitwise = tl |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]


def product_rows(args, dense, gen, log) -> list[str]:
    lines = products_header(args.routing, args.gpt_oss)
    log("\n".join(lines))
    for name in args.presets or PRODUCT_PRESETS:
        for tokens in args.tokens or [8192]:
            for product in args.products or list(PRODUCTS)[:6]:
                fused = args.fused_gate_up and product in ("gate_up", "gate_up_dgrad")
                extra = {"fused": True} if fused else {}
                if args.gpt_oss and product in ("gate_up", "down", "down_dgrad"):
                    extra["gpt_oss"] = True
                rows = PRODUCTS[product](
                    name, product, tokens, dense, gen, routing=args.routing, **extra
                )
                if fused:
                    rows = [
                        row.replace(f"| {product} |", f"| {product} (fused W) |") for row in rows
                    ]
                log("\n".join(rows))
                lines += rows
                torch.cuda.empty_cache()
    return lines


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
                ms = time_each({label: lambda i, c=c, run=run: run(c)}, 1, iters=10)[label][0]
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument(
        "--products",
        nargs="*",
        choices=list(PRODUCTS),
        default=None,
        metavar="PRODUCT",
        help=f"time each product's kernels (default the first six of: {', '.join(PRODUCTS)})",
    )
    parser.add_argument("--tune", action="store_true")
    parser.add_argument(
        "--presets",
        nargs="*",
        default=None,
        help="default: every preset but tiny for --bench, "
        f"{', '.join(PRODUCT_PRESETS)} for --products",
    )
    parser.add_argument(
        "--tokens",
        nargs="*",
        type=int,
        default=None,
        help="tokens per rank (rows = tokens x top_k); default 8192 16384 for --bench, 8192 for "
        "--products",
    )
    parser.add_argument(
        "--routing",
        choices=("uniform", "zipf", "balanced"),
        default="uniform",
        help="the timed problems' rows per expert",
    )
    parser.add_argument(
        "--gpt-oss",
        action="store_true",
        help="--products' gate_up, down and down_dgrad with gpt-oss's activation, clamp, biases",
    )
    parser.add_argument(
        "--fused-gate-up",
        action="store_true",
        help="--products' gate_up and gate_up_dgrad read W_gate and W_up as the halves of one "
        "[E, 2I, H] tensor (their rows read 'gate_up (fused W)')",
    )
    parser.add_argument("--out", help="write the markdown tables here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2

    def log(message):
        print(message, flush=True)

    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    ok = True
    if args.check:
        ok = check(log)
        log(f"check: {'all OK' if ok else 'FAILURES'}")
    if args.tune:
        tune(log)
    sections = []
    if args.bench or args.products is not None:
        gen = torch.Generator(device="cuda").manual_seed(1)
        dense = dense_tflops(8192, 8192, 8192, gen)
        log(f"dense bf16 8192^3: {dense:.0f} TFLOP/s")
    if args.bench:
        rows, dense_equiv = [], {}
        for name in args.presets or [n for n in mok.PRESETS if n != "tiny"]:
            preset = mok.get_preset(name)
            m = 8192 * preset.top_k
            dense_equiv[name] = dense_tflops(
                m, preset.hidden_size, 3 * preset.intermediate_size, gen
            )
            for tokens in args.tokens or [8192, 16384]:
                rows.append(bench_preset(name, tokens, dense, gen, log, args.routing))
                torch.cuda.empty_cache()  # the preset's inputs and saved tensors
        ok &= all(r["agree"] for r in rows)
        text = bench_table(rows, dense_equiv)
        sections.append(f"## The expert MLP against torch._grouped_mm (routing {args.routing})")
        sections.append(text)
        log(text)
    if args.products is not None:
        sections.append("\n".join(product_rows(args, dense, gen, log)))
    if args.out and sections:
        header = [
            f"# Expert products on one GPU ({datetime.date.today()})",
            "",
            f"- commit {git_commit()}; {torch.cuda.get_device_name()}; torch {torch.__version__}; "
            f"triton {triton.__version__}",
            f"- command: `{' '.join(['python', *sys.argv])}`",
            f"- cuBLAS dense bf16 8192^3 in this run: {dense:.0f} TFLOP/s",
        ]
        with open(args.out, "w") as handle:
            handle.write("\n\n".join(["\n".join(header), *sections]) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
