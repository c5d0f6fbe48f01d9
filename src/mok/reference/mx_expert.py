"""The expert MLP in MXFP8, in plain PyTorch: the oracle of the MXFP8 kernels (docs/mxfp8.md).

The MXFP8 layer is the bf16 layer with every GEMM operand replaced by its MXFP8 cast along that
GEMM's reduction dimension (`mok.reference.mx`: quantize, then dequantize, which is exact), cast
from the tensor the bf16 layer holds at that point (as torchao's MX training casts its bf16
tensors); products accumulate in fp32, every other step is the bf16 layer's. An operand read by
two GEMMs along different dimensions is cast once for each. Per expert, rows r [m, H], weights
W_gate, W_up [I, H], W_down [H, I], Q_d(t) = dequantize(quantize(t, along d)):

    forward    gate, up = Q_H(r) @ Q_H(W_gate).T, Q_H(r) @ Q_H(W_up).T        (fp32)
               h        = bf16(swiglu(gate, up))                               (the bf16 layer's)
               out      = bf16(Q_I(h) @ Q_I(W_down).T)
               (gpt-oss: its activation in swiglu; biases added in fp32 to gate, up and out)
               saved    Q_H(r), Q_I(h), Q_I(bf16(gate)), Q_I(bf16(up))  (under a clamp L the
                        pre-activations stay bf16, `expert.saved_preactivations`)
    backward   g        = grad out (bf16)
               grad h   = bf16(Q_H(g) @ Q_H(W_down))
               grad gate, grad up = bf16 of the SwiGLU backward of grad h at the saved gate, up
               grad r   = bf16(Q_I(grad gate) @ Q_I(W_gate) + Q_I(grad up) @ Q_I(W_up))
               grad W_down = Q_T(g).T @ Q_T(Q_I(h))
               grad W_gate = Q_T(grad gate).T @ Q_T(Q_H(r)); grad W_up alike
               grad b_gate = fp32 sum over the rows of grad gate (bf16); b_up, b_down alike

Q_T quantizes along the rows (tokens) of one expert's group: blocks of 32 rows from the group's
first, the last one padded with zeros. The saved activations are MX casts (about half their bf16
bytes), so the weight gradients cast x and h a second time, along the tokens, and the SwiGLU
backward reads the pre-activations as e4m3 (that costs about a tenth more error in the
gradients through them, docs/mxfp8.md). Under a clamp the pre-activations stay bf16: an e4m3
block cannot always keep a value on its side of L (FLOOR saturates at 448 x its scale), and the
backward's clamp decisions must be the forward's. The weights' gradients are returned in the
weights' dtype.

The layer's combine (`mok.reference.moe.mx_combine`) sums the bf16 expert outputs as the bf16
layer does; the router weights' gradient reads their MX cast along H, which the layer saves in
their place.
"""

from __future__ import annotations

import torch

from mok.reference import mx
from mok.reference.expert import (
    activation_gradients,
    bias_gradients,
    grouped_with_expert_function,
    saved_preactivations,
    swiglu,
)


def quantized(
    t: torch.Tensor, dim: int, rounding: mx.ScaleRounding | str = mx.ScaleRounding.RCEIL
) -> torch.Tensor:
    """Q_dim(t): t's values as MXFP8 along `dim` represents them, in fp32 (exact)."""
    data, scales = mx.quantize(t, dim=dim, rounding=rounding)
    return mx.dequantize(data, scales, dim=dim)


def quantized_rows(
    t: torch.Tensor, rounding: mx.ScaleRounding | str = mx.ScaleRounding.RCEIL
) -> torch.Tensor:
    """Q_T(t) of one group's rows t [m, C]: blocks of 32 rows from the first, zero-padded."""
    rows = t.shape[0]
    padded = torch.nn.functional.pad(t.float(), (0, 0, 0, -rows % mx.BLOCK))
    return quantized(padded, 0, rounding)[:rows]


class _MXExpert(torch.autograd.Function):
    """One expert in MXFP8 (see the module docstring); rows, weights and biases in bf16."""

    @staticmethod
    def forward(ctx, rows, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, rounding):
        limit, alpha, up_offset = activation
        dtype = rows.dtype
        x_q = quantized(rows, -1, rounding)
        gate = x_q @ quantized(w_gate, -1, rounding).T
        up = x_q @ quantized(w_up, -1, rounding).T
        if b_gate is not None:
            gate, up = gate + b_gate.float(), up + b_up.float()
        h_q = quantized(swiglu(gate, up, limit, alpha, up_offset).to(dtype), -1, rounding)
        out = h_q @ quantized(w_down, -1, rounding).T
        if b_down is not None:
            out = out + b_down.float()
        gate, up = saved_preactivations(gate, up, limit, dtype)
        if limit is None:
            gate, up = quantized(gate, -1, rounding), quantized(up, -1, rounding)
        ctx.save_for_backward(x_q, gate, up, h_q, w_gate, w_up, w_down)
        ctx.activation, ctx.rounding, ctx.dtype = activation, rounding, dtype
        ctx.bias_dtypes = None if b_gate is None else (b_gate.dtype, b_up.dtype, b_down.dtype)
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x_q, gate, up, h_q, w_gate, w_up, w_down = ctx.saved_tensors
        rounding, dtype = ctx.rounding, ctx.dtype
        grad_out = grad_out.to(dtype)
        grad_h = quantized(grad_out, -1, rounding) @ quantized(w_down, 0, rounding)
        grad_h = grad_h.to(dtype).float()
        grad_gate, grad_up = activation_gradients(gate, up, grad_h, ctx.activation, dtype)
        grad_rows = quantized(grad_gate, -1, rounding) @ quantized(w_gate, 0, rounding)
        grad_rows = grad_rows + quantized(grad_up, -1, rounding) @ quantized(w_up, 0, rounding)
        x_t = quantized_rows(x_q, rounding)
        grad_w_down = quantized_rows(grad_out, rounding).T @ quantized_rows(h_q, rounding)
        grad_w_gate = quantized_rows(grad_gate, rounding).T @ x_t
        grad_w_up = quantized_rows(grad_up, rounding).T @ x_t
        grad_biases = bias_gradients(grad_gate, grad_up, grad_out, ctx.bias_dtypes)
        return (
            grad_rows.to(dtype),
            grad_w_gate.to(w_gate.dtype),
            grad_w_up.to(w_up.dtype),
            grad_w_down.to(w_down.dtype),
            *grad_biases,
            None,
            None,
        )


def mx_grouped_expert_mlp(
    rows: torch.Tensor,
    group_sizes: list[int],
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
    rounding: mx.ScaleRounding | str = mx.ScaleRounding.RCEIL,
    *,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    alpha: float = 1.0,
    up_offset: float = 0.0,
) -> torch.Tensor:
    """`mok.reference.expert.grouped_expert_mlp` in MXFP8: rows [M, H] bf16 grouped by expert
    through w_gate, w_up [E, I, H] and w_down [E, H, I] (H and I multiples of 32), with the
    activation's `alpha` and `up_offset` and the experts' `biases` (b_gate, b_up [E, I], b_down
    [E, H] or None: added in fp32 to the MX products, never cast; their gradients are the fp32
    sums of the bf16 gradients of the pre-activations and of the output). Differentiable with
    the MXFP8 backward of the module docstring."""
    return grouped_with_expert_function(
        _MXExpert.apply, rows, group_sizes, (w_gate, w_up, w_down), swiglu_limit, biases, alpha,
        up_offset, mx.ScaleRounding(rounding),
    )  # fmt: skip
