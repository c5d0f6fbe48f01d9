"""The MX forward products (`mok.kernels.mx_grouped_gemm`) against `mok.reference.mx_expert`'s
forward: on the CPU under the interpreter (fp32 MMAs), compiled on a GPU (bf16 MMAs). The MX
products are exact, so the pre-activations may differ from a float64 sum of the same products
only by fp32 accumulation; h must be exactly the MXFP8 cast of the kernel's own fp32 SwiGLU, and
the down product must be its products summed in fp32 and rounded once.

Bugs these catch: a scale applied to the wrong 32-element block or the wrong row (errors of
whole powers of two), the weights of the wrong expert, a ragged group's rows past its end stored
or read from the next group, the quantized h stored at the wrong place or from bf16 instead of
fp32, FLOOR and RCEIL mixed up, W_down quantized along the wrong dimension.
"""

from __future__ import annotations

import pytest
import torch

from mok.kernels.grouped_gemm import GemmTiles, row_tile_map
from mok.kernels.mx_grouped_gemm import (
    mx_down,
    mx_down_dgrad_swiglu,
    mx_gate_up_dgrad,
    mx_gate_up_swiglu,
)
from mok.reference import mx
from mok.reference.expert import swiglu

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CFG = GemmTiles(16, 32, 32, num_warps=4, num_stages=1, group_m=2)
OUT_DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def case(sizes, hidden, inter, seed):
    """Grouped bf16 rows and weights of random magnitudes (scales far from 1), MX-quantized."""
    gen = torch.Generator().manual_seed(seed)
    experts, m = len(sizes), sum(sizes)

    def randn(*shape, spread=8):
        exponent = torch.randint(-spread, spread, shape, generator=gen).float()
        return (torch.randn(*shape, generator=gen) * torch.exp2(exponent)).to(torch.bfloat16)

    rows = randn(m, hidden)
    w_gate, w_up = randn(experts, inter, hidden), randn(experts, inter, hidden)
    w_down = randn(experts, hidden, inter)
    offsets = torch.tensor([0, *sizes]).cumsum(0).to(torch.int32)
    return rows, w_gate, w_up, w_down, offsets


def on_device(pair):
    return tuple(t.to(DEVICE) for t in pair)


def fp64_products(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per group e: dequantized a[group] @ dequantized w[e].T in float64 (a [M, K] fp32 values)."""
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64)
    for e in range(w.shape[0]):
        lo, hi = offsets[e].item(), offsets[e + 1].item()
        out[lo:hi] = a[lo:hi].double() @ w[e].double().T
    return out


def accumulation_bound(a: torch.Tensor, w: torch.Tensor, offsets, k: int) -> torch.Tensor:
    """|fp32 sum - exact sum| <= k * 2^-24 * sum |products| (a generous form of the bound)."""
    return fp64_products(a.abs(), w.abs(), offsets) * k * 2.0**-24


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("limit", [None, 3.0])
def test_mx_forward_products_are_the_reference_forward(rounding, limit):
    sizes = [37, 0, 16, 53]
    hidden, inter = 96, 64
    rows, w_gate, w_up, w_down, offsets = case(sizes, hidden, inter, seed=1)
    x_q = mx.quantize(rows, rounding=rounding)
    wg_q, wu_q = mx.quantize(w_gate, rounding=rounding), mx.quantize(w_up, rounding=rounding)
    wd_q = mx.quantize(w_down, rounding=rounding)  # along I, its last dimension
    tiles = row_tile_map(offsets.to(DEVICE), sum(sizes), CFG.block_m)
    h_data, h_scales, gate_up = mx_gate_up_swiglu(
        on_device(x_q),
        on_device(wg_q),
        on_device(wu_q),
        tiles,
        limit,
        CFG,
        rounding=rounding,
        save_preact=True,
    )
    x_values = mx.dequantize(*x_q)
    for values, w_q in ((gate_up[:, :inter], wg_q), (gate_up[:, inter:], wu_q)):
        w_values = mx.dequantize(*w_q)
        exact = fp64_products(x_values, w_values, offsets)
        bound = accumulation_bound(x_values, w_values, offsets, hidden)
        assert bool(((values.cpu().double() - exact).abs() <= bound).all())
    h_fp32 = swiglu(gate_up[:, :inter].cpu(), gate_up[:, inter:].cpu(), limit)
    want_data, want_scales = mx.quantize(h_fp32, rounding=rounding)
    assert torch.equal(h_scales.cpu(), want_scales)
    assert torch.equal(h_data.cpu().view(torch.uint8), want_data.view(torch.uint8))
    out = mx_down((h_data, h_scales), on_device(wd_q), tiles, CFG, OUT_DTYPE)
    h_values, wd_values = mx.dequantize(want_data, want_scales), mx.dequantize(*wd_q)
    exact = fp64_products(h_values, wd_values, offsets)
    bound = accumulation_bound(h_values, wd_values, offsets, inter)
    if OUT_DTYPE == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8  # one rounding to bf16
    assert bool(((out.cpu().double() - exact).abs() <= bound).all())


def test_mx_products_refuse_sizes_off_the_blocks():
    rows, w_gate, w_up, _, offsets = case([8], 64, 48, seed=2)
    tiles = row_tile_map(offsets.to(DEVICE), 8, CFG.block_m)
    quantized = [on_device(mx.quantize(t)) for t in (rows, w_gate, w_up)]
    with pytest.raises(ValueError, match="multiple of 32"):
        mx_gate_up_swiglu(*quantized, tiles, None, CFG)
    with pytest.raises(ValueError, match="block_k and block_n"):
        mx_gate_up_swiglu(*quantized, tiles, None, GemmTiles(16, 48, 32))


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours.double().cpu(), theirs.double().cpu()
    return ((ours - theirs).norm() / theirs.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("limit", [None, 3.0])
def test_mx_data_gradients_are_the_reference_backward(limit):
    """grad gate | grad up from grad h = bf16(Q_H(g) @ Q_H(W_down)) and the saved fp32
    pre-activations, their casts along I, and grad x from those casts and Q_I(W_gate), Q_I(W_up)."""
    sizes = [21, 40, 0, 35]
    hidden, inter = 64, 96
    rows, w_gate, w_up, w_down, offsets = case(sizes, hidden, inter, seed=3)
    m = sum(sizes)
    tiles = row_tile_map(offsets.to(DEVICE), m, CFG.block_m)
    quantized = [on_device(mx.quantize(t)) for t in (rows, w_gate, w_up)]
    _, _, gate_up = mx_gate_up_swiglu(*quantized, tiles, limit, CFG, save_preact=True)
    grad_out = (torch.randn(m, hidden, generator=torch.Generator().manual_seed(4))).bfloat16()
    g_q = mx.quantize(grad_out)
    wd_q = tuple(t.contiguous() for t in mx.quantize(w_down, dim=1))  # along H
    grad_gate_q, grad_up_q, grads = mx_down_dgrad_swiglu(
        on_device(g_q), on_device(wd_q), gate_up, tiles, limit, CFG
    )
    # The reference: grad h from the exact products, rounded to bf16; SwiGLU's backward by autograd.
    g_values, wd_values = mx.dequantize(*g_q), mx.dequantize(*wd_q, dim=1)
    grad_h = torch.zeros(m, inter, dtype=torch.float64)
    for e in range(len(sizes)):
        lo, hi = offsets[e].item(), offsets[e + 1].item()
        grad_h[lo:hi] = g_values[lo:hi].double() @ wd_values[e].double()
    grad_h = grad_h.float().bfloat16().float()
    gate = gate_up[:, :inter].cpu().requires_grad_(True)
    up = gate_up[:, inter:].cpu().requires_grad_(True)
    want_gate, want_up = torch.autograd.grad(swiglu(gate, up, limit), [gate, up], grad_h)
    assert relative_error(grads[:, :inter], want_gate) < 2.0**-7
    assert relative_error(grads[:, inter:], want_up) < 2.0**-7
    for (data, scales), want in ((grad_gate_q, want_gate), (grad_up_q, want_up)):
        values = mx.dequantize(data.cpu(), scales.cpu())
        assert relative_error(values, want) < 2.0**-3  # e4m3 keeps 3 mantissa bits
    wg_q = tuple(t.contiguous() for t in mx.quantize(w_gate, dim=1))  # along I
    wu_q = tuple(t.contiguous() for t in mx.quantize(w_up, dim=1))
    grad_x = mx_gate_up_dgrad(
        grad_gate_q, grad_up_q, on_device(wg_q), on_device(wu_q), tiles, CFG, OUT_DTYPE
    )
    exact = torch.zeros(m, hidden, dtype=torch.float64)
    magnitude = torch.zeros(m, hidden, dtype=torch.float64)
    for (data, scales), w_q in ((grad_gate_q, wg_q), (grad_up_q, wu_q)):
        a, w = mx.dequantize(data.cpu(), scales.cpu()).double(), mx.dequantize(*w_q, dim=1).double()
        for e in range(len(sizes)):
            lo, hi = offsets[e].item(), offsets[e + 1].item()
            exact[lo:hi] += a[lo:hi] @ w[e]
            magnitude[lo:hi] += a[lo:hi].abs() @ w[e].abs()
    bound = magnitude * 2 * inter * 2.0**-24
    if OUT_DTYPE == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8
    assert bool(((grad_x.cpu().double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mx_weight_gradients_are_the_reference_ones(rounding):
    """Q_T per group (blocks of 32 rows from each group's first, the last zero-padded): a block
    that straddles two groups, or starts at a multiple of 32 of the whole matrix instead of the
    group's first row, gives other scales and fails; so do an empty group's gradient (zeros) and
    a transposed operand."""
    from mok.kernels.mx_grouped_gemm import mx_group_at_b
    from mok.reference.mx_expert import quantized_rows

    sizes = [45, 0, 32, 7, 70]
    p, q = 64, 96
    gen = torch.Generator().manual_seed(5)
    m = sum(sizes)
    exponent = torch.randint(-6, 6, (m, 1), generator=gen).float()
    a = (torch.randn(m, p, generator=gen) * torch.exp2(exponent)).bfloat16().float()
    b = torch.randn(m, q, generator=gen).bfloat16().float()
    offsets = torch.tensor([0, *sizes]).cumsum(0).to(torch.int32)
    cfg = GemmTiles(32, 32, 64, num_warps=4, num_stages=1)
    out = mx_group_at_b(a.to(DEVICE), b.to(DEVICE), offsets.to(DEVICE), cfg, rounding)
    for e in range(len(sizes)):
        lo, hi = offsets[e].item(), offsets[e + 1].item()
        a_q = quantized_rows(a[lo:hi], rounding).double()
        b_q = quantized_rows(b[lo:hi], rounding).double()
        exact = a_q.T @ b_q
        bound = (a_q.abs().T @ b_q.abs()) * max(hi - lo, 1) * 2.0**-24
        assert bool(((out[e].cpu().double() - exact).abs() <= bound).all()), e
