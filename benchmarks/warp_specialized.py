"""The warp-specialized Gluon grouped GEMMs against the tl kernels they replace, one GPU.

    PYTHONPATH=src python3 benchmarks/warp_specialized.py [--tokens 8192] [--products ...]
                                                          [--routing balanced] [--gpt-oss]
                                                          [--out F]

Products (--products, default all): the forward's two, gate/up + SwiGLU, h[group e] =
swiglu(x @ W_gate[e].T, x @ W_up[e].T) saving the pre-activations for the backward (x [M, H], W_gate
and W_up [E, I, H]), and down, out[group e] = h[group e] @ W_down[e].T (W_down [E, H, I]); and the
backward's data gradients, gate_up_dgrad (grad_x[group e] = grad_gate @ W_gate[e] + grad_up @
W_up[e]) and down_dgrad (grad_h = grad_out @ W_down[e] then the SwiGLU backward against the saved
gate | up, giving their gradients); and its weight gradients, down_wgrad (grad_W_down[e] =
grad_out[group e].T @ h[group e]) and gate_up_wgrad (grad_W_gate[e] = grad_gate[group e].T @
x[group e], and up), each written fresh in
bf16 and added into existing fp32 buffers (gradient accumulation into a main-gradient buffer).
Not in the default list: gate_up_sources and down_sources, the fused layer's building blocks
(rows gathered through a dispatch index; down's peer-store epilogue), see `bench_sources`. At
each preset's shape with every expert on this GPU and near-uniform top-k routing (rows = tokens x
k; --routing balanced: every expert the same rows, as in the training benchmark). The kernels
get the same inputs; first their results are compared (bitwise on the groups' rows or the fresh
gradients, and with fp32 math), then each is timed: CUDA events around each call,
median and the 10-90 % range over alternating input sets, the kernels interleaved. Beside them
every product's GEMM through torch._grouped_mm (PyTorch's CUTLASS grouped GEMM, what the native
experts run), without the epilogue our kernels fuse: its error is of the whole product with that
epilogue added untimed in fp32, its time a lower bound for the native path's.
"% of dense" divides by cuBLAS (torch.mm) at 8192^3 in the same run.
--gpt-oss: gate_up, down and down_dgrad compute gpt-oss's experts instead (its activation gate *
sigmoid(1.702 gate) * (up + 1) after the clamp at 7, and biases on gate, up and down), in our
kernels and, untimed, after the native GEMM for its error.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys

import torch
import triton
from expert_kernels import dense_tflops, near_uniform_sizes, randn

import mok
from mok.bench import git_commit
from mok.kernels import default_config
from mok.kernels import grouped_gemm as gg
from mok.kernels import warp_specialized as ws
from mok.kernels.grouped_gemm import Activation, GemmTiles, row_tile_map
from mok.reference.expert import swiglu
from mok.testing import relative_error

PRESETS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2")
GLUON_TILES = {
    "down": {
        "gluon 64x256": ws.PING_PONG,
        "gluon 128x128 coop": GemmTiles(128, 128, 64, num_warps=4, num_stages=4),
        "gluon 128x256 coop": ws.COOPERATIVE,
    },
    "gate_up": {
        "gluon 64x128": ws.SWIGLU_PING_PONG,
        "gluon 128x128 coop": ws.SWIGLU_COOPERATIVE,
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
        "gluon 64x256": ws.PING_PONG,
        "gluon 128x256 coop": ws.COOPERATIVE,
    },
    "down_dgrad": {
        "gluon 64x128": ws.DGRAD_SWIGLU_PING_PONG,
        "gluon 128x128 coop": ws.DGRAD_SWIGLU_COOPERATIVE,
    },
}
CUTLASS = "torch._grouped_mm, GEMM alone"
"""The label of PyTorch's grouped GEMM (CUTLASS on Hopper) beside our kernels, every product."""
WGRAD_CHECKED_EXPERTS = 8
"""Experts whose gradients are compared with fp32 math (all are compared with the tl kernel)."""


def time_each(fns: dict, inputs: int, iters: int = 30) -> dict[str, tuple[float, float, float]]:
    """name -> (median, 10th, 90th percentile) ms; calls interleaved across names and inputs."""
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


def cutlass_line(name, product, tokens, m, timing, flops, dense, error) -> str:
    """The table row of torch._grouped_mm (PyTorch's CUTLASS grouped GEMM) for a product's GEMM
    alone, as the native experts run it: without the epilogue our kernel fuses (SwiGLU, its
    backward), so its time is a lower bound for theirs."""
    ms, low, high = timing
    tflops = flops / ms / 1e9
    return (
        f"| {name} | {product} | {tokens} | {m} | {CUTLASS} | {ms:.3f} ({low:.3f}-{high:.3f}) "
        f"| {tflops:.0f} | {100 * tflops / dense:.0f} % | {error:.2e} | n/a |"
    )


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


def group_sizes(routing: str, tokens: int, top_k: int, experts: int, gen) -> list[int]:
    """Rows per expert: `uniform`, top-k of random logits (`near_uniform_sizes`); `balanced`,
    tokens x top_k split evenly (what the training benchmark's balanced routing gives)."""
    if routing == "balanced":
        share, extra = divmod(tokens * top_k, experts)
        return [share + (e < extra) for e in range(experts)]
    return near_uniform_sizes(tokens, top_k, experts, gen)


def bench(
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
            kernel = gg.down if tl_kernel else ws.rows_wt
            bias = biases[0] if gpt_oss else None
            return lambda i: kernel(sets[i][0], *weights, maps[i, cfg.block_m], cfg, bias=bias)
        kernel = gg.gate_up_swiglu if tl_kernel else ws.gate_up_swiglu
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
        ms, low, high = times[label]
        tflops = flops / ms / 1e9
        lines.append(
            f"| {name} | {product} | {tokens} | {m} | {label} | {ms:.3f} ({low:.3f}-{high:.3f}) "
            f"| {tflops:.0f} | {100 * tflops / dense:.0f} % | {error:.2e} | "
            f"{'yes' if bitwise else 'no'} |"
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


def bench_dgrad(
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
            kernel = gg.down_dgrad_swiglu if tl_kernel else ws.down_dgrad_swiglu
            limit, options = (GPT_OSS_LIMIT, {"activation": GPT_OSS}) if gpt_oss else (None, {})
            return lambda i: kernel(
                sets[i][0], weights[0], sets[i][1], maps[i, cfg.block_m], limit, cfg, **options
            )
        kernel = gg.gate_up_dgrad if tl_kernel else ws.gate_up_dgrad
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
        ms, low, high = times[label]
        tflops = flops / ms / 1e9
        lines.append(
            f"| {name} | {product} | {tokens} | {m} | {label} | {ms:.3f} ({low:.3f}-{high:.3f}) "
            f"| {tflops:.0f} | {100 * tflops / dense:.0f} % | {error:.2e} | "
            f"{'yes' if bitwise else 'no'} |"
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


def bench_wgrad(
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
    gluon = {label: cfg for label, cfg in GLUON_TILES["wgrad"].items() if p % ws.CONSUMER_ROWS == 0}
    configs = {f"tl {tl_cfg.block_m}x{tl_cfg.block_n}": tl_cfg, **gluon}

    def run(label, cfg, i, grads, accumulate):
        a, b, offsets = sets[i]
        tl_kernel = label.startswith("tl")
        if down:
            kernel = gg.down_wgrad if tl_kernel else ws.down_wgrad
            kernel(a, b, offsets, *grads, accumulate, cfg)
        else:
            kernel = gg.gate_up_wgrad if tl_kernel else ws.gate_up_wgrad
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
            ms, low, high = times[label]
            tflops = flops / ms / 1e9
            lines.append(
                f"| {name} | {product} {mode} | {tokens} | {m} | {label} | {ms:.3f} "
                f"({low:.3f}-{high:.3f}) | {tflops:.0f} | {100 * tflops / dense:.0f} % | "
                f"{errors[label]:.2e} | {'yes' if bitwise[label] else 'no'} |"
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


def bench_sources(
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
        cfg = default.warp_specialized_down
        weights = [randn(experts, hidden, inter, gen=gen, scale=inter**-0.5)]
    else:
        cfg = default.warp_specialized_gate_up
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
        scatter = gg.RowScatter(
            out=buffers[rank],
            out_offsets=torch.arange(ep, device="cuda") * per_rank,
            dest_rank=dest_rank,
            dest_row=dest_row,
            counts=counts[rank],
            counts_offsets=torch.arange(ep, device="cuda") * ep,
            rank=rank,
        )
        fns = {
            f"gluon {tile_label} tma rows": lambda: ws.rows_wt(
                gathered_first, *weights, tiles, cfg
            ),
            f"gluon {tile_label} gathered": lambda: ws.rows_wt(
                source, *weights, tiles, cfg, source_rows=index
            ),
            f"gluon {tile_label} gathered + peer stores": lambda: ws.rows_wt_scatter(
                source, *weights, tiles, scatter, cfg, source_rows=index
            ),
        }
    else:
        fns = {
            f"gluon {tile_label} tma rows": lambda: ws.gate_up_swiglu(
                gathered_first, *weights, tiles, None, True, cfg
            )[0],
            f"gluon {tile_label} gathered": lambda: ws.gate_up_swiglu(
                source, *weights, tiles, None, True, cfg, source_rows=index
            )[0],
        }
    fns["the copy it replaces: rows[index]"] = lambda: source.index_select(0, index)
    results = {label: fn() for label, fn in fns.items()}
    reference = next(iter(results.values()))
    if down:
        counts.zero_()
        ws.rows_wt_scatter(source, *weights, tiles, scatter, cfg, source_rows=index)
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


RUNNERS = {
    "gate_up": bench,
    "down": bench,
    "gate_up_dgrad": bench_dgrad,
    "down_dgrad": bench_dgrad,
    "down_wgrad": bench_wgrad,
    "gate_up_wgrad": bench_wgrad,
    "gate_up_sources": bench_sources,
    "down_sources": bench_sources,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192", help="comma-separated token counts")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument(
        "--products", default="gate_up,down,gate_up_dgrad,down_dgrad,down_wgrad,gate_up_wgrad"
    )
    parser.add_argument(
        "--fused-gate-up",
        action="store_true",
        help="gate_up and gate_up_dgrad read W_gate and W_up as the halves of one [E, 2I, H] "
        "tensor, as Hugging Face models hold them (their rows read 'gate_up (fused W)')",
    )
    parser.add_argument(
        "--routing",
        choices=("uniform", "balanced"),
        default="uniform",
        help="rows per expert: top-k of random logits, or split evenly",
    )
    parser.add_argument(
        "--gpt-oss",
        action="store_true",
        help="gate_up, down and down_dgrad with gpt-oss's activation, clamp and biases",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dense = dense_tflops(8192, 8192, 8192, gen)
    commit = git_commit()
    header = [
        f"# Warp-specialized Gluon grouped GEMMs vs tl ({datetime.date.today()})",
        "",
        f"- commit {commit}; {torch.cuda.get_device_name()}; torch "
        f"{torch.__version__}; routing {args.routing}; command: `{' '.join(sys.argv)}`"
        + ("; gpt-oss's experts" if args.gpt_oss else ""),
        f"- cuBLAS dense 8192^3 in this run: {dense:.0f} TFLOP/s",
        "",
        "| preset | product | tokens | rows | kernel | ms (10-90 %) | TFLOP/s | % of dense | "
        "error vs fp32 | bitwise = tl |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines = list(header)
    print("\n".join(header), flush=True)
    for name in args.presets.split(","):
        for tokens in map(int, args.tokens.split(",")):
            for product in args.products.split(","):
                fused = args.fused_gate_up and product in ("gate_up", "gate_up_dgrad")
                extra = {"fused": True} if fused else {}
                if args.gpt_oss and product in ("gate_up", "down", "down_dgrad"):
                    extra["gpt_oss"] = True
                rows = RUNNERS[product](
                    name, product, tokens, dense, gen, routing=args.routing, **extra
                )
                if fused:
                    rows = [
                        row.replace(f"| {product} |", f"| {product} (fused W) |") for row in rows
                    ]
                print("\n".join(rows), flush=True)
                lines += rows
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
