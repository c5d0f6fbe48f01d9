"""The expert MLP in the 128-block FP8 recipe, in plain PyTorch: the oracle of its kernels.

The bf16 layer with every GEMM run as the recipe's (`mok.reference.fp8_block.scaled_matmul`):
activations and gradients cast in 1 x 128 tiles along the GEMM's reduction dimension, weights in
128 x 128 blocks (one cast serves a weight's forward and backward GEMMs: the blocks of W.T are
W's blocks transposed), the weight gradients' operands in tiles along the tokens of one expert's
group (from the group's first row). Products accumulate in fp32 step by step; every other step
is the bf16 layer's. Per expert, rows r [m, H], weights W_gate, W_up [I, H], W_down [H, I]; T_d(t)
the tile cast of t along d, B(W) the block cast:

    forward    gate, up = T_H(r) x B(W_gate), T_H(r) x B(W_up)                  (fp32)
               h        = bf16(swiglu(gate, up))
               out      = bf16(T_I(h) x B(W_down))
               (gpt-oss: its activation in swiglu; biases added in fp32 to gate, up and out)
               saved    T_H(r), T_I(h) (their e4m3 values and descales), gate and up in bf16
                        (`expert.saved_preactivations`)
    backward   g        = grad out (bf16)
               grad h   = bf16(T_H(g) x B(W_down).T)
               grad gate, grad up = bf16 of the SwiGLU backward of grad h at the saved gate, up
               grad r   = bf16(T_I(grad gate) x B(W_gate).T + T_I(grad up) x B(W_up).T)
               grad W_down = T_m(g).T x T_m(T_I(h)), the reduction over the group's m tokens
               grad W_gate = T_m(grad gate).T x T_m(T_H(r)); grad W_up alike
               grad b_gate = fp32 sum over the rows of grad gate (bf16); b_up, b_down alike

where A x B is `scaled_matmul` of A's rows against B's rows. The saved r and h are their forward
casts (what the kernels keep: about half their bf16 bytes), so the weight gradients cast their
values a second time, along the tokens. The pre-activations stay bf16, so that the SwiGLU
backward and a clamp's decisions read what the forward computed. The weights' gradients are
returned in the weights' dtype.
"""

from __future__ import annotations

import torch

from mok.reference.expert import (
    activation_gradients,
    bias_gradients,
    grouped_with_expert_function,
    saved_preactivations,
    swiglu,
)
from mok.reference.fp8_block import (
    block_rows,
    dequantize_tiles,
    quantize_blocks,
    quantize_tiles,
    scaled_matmul,
)


def _tiles(t: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile cast of t along `dim` as `scaled_matmul` takes an operand whose reduction runs
    along `dim`: (values, descales) with that dimension last."""
    values, descales = quantize_tiles(t, dim)
    if dim % t.dim() == 0:
        return values.T, descales.T
    return values, descales


def _weight(w: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The block cast of w [N, K] as `scaled_matmul`'s B operand: (values, per-row descales) of
    w, or of w.T where `transposed`."""
    values, descales = quantize_blocks(w)
    if transposed:
        values, descales = values.T, descales.T
    return values, block_rows(descales, values.shape[0])


def _tiled_values(values: torch.Tensor, descales: torch.Tensor) -> torch.Tensor:
    """What a saved tile cast (along the last dimension) represents, in fp32."""
    return dequantize_tiles(values, descales)


class _BlockFP8Expert(torch.autograd.Function):
    """One expert in the 128-block recipe (see the module docstring); rows, weights and biases
    in bf16."""

    @staticmethod
    def forward(ctx, rows, w_gate, w_up, w_down, b_gate, b_up, b_down, activation):
        limit, alpha, up_offset = activation
        dtype = rows.dtype
        x_tiles = _tiles(rows)
        gate = scaled_matmul(*x_tiles, *_weight(w_gate))
        up = scaled_matmul(*x_tiles, *_weight(w_up))
        if b_gate is not None:
            gate, up = gate + b_gate.float(), up + b_up.float()
        h_tiles = _tiles(swiglu(gate, up, limit, alpha, up_offset).to(dtype))
        out = scaled_matmul(*h_tiles, *_weight(w_down))
        if b_down is not None:
            out = out + b_down.float()
        gate, up = saved_preactivations(gate, up, limit, dtype)
        ctx.save_for_backward(*x_tiles, *h_tiles, gate, up, w_gate, w_up, w_down)
        ctx.activation, ctx.dtype = activation, dtype
        ctx.bias_dtypes = None if b_gate is None else (b_gate.dtype, b_up.dtype, b_down.dtype)
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x_values, x_descales, h_values, h_descales, gate, up, w_gate, w_up, w_down = (
            ctx.saved_tensors
        )
        dtype = ctx.dtype
        grad_out = grad_out.to(dtype)
        grad_h = scaled_matmul(*_tiles(grad_out), *_weight(w_down, transposed=True))
        grad_h = grad_h.to(dtype).float()
        grad_gate, grad_up = activation_gradients(gate, up, grad_h, ctx.activation, dtype)
        grad_rows = scaled_matmul(*_tiles(grad_gate), *_weight(w_gate, transposed=True))
        grad_rows = grad_rows + scaled_matmul(*_tiles(grad_up), *_weight(w_up, transposed=True))
        x_tokens = _tiles(_tiled_values(x_values, x_descales), 0)
        h_tokens = _tiles(_tiled_values(h_values, h_descales), 0)
        grad_w_down = scaled_matmul(*_tiles(grad_out, 0), *h_tokens)
        grad_w_gate = scaled_matmul(*_tiles(grad_gate, 0), *x_tokens)
        grad_w_up = scaled_matmul(*_tiles(grad_up, 0), *x_tokens)
        grad_biases = bias_gradients(grad_gate, grad_up, grad_out, ctx.bias_dtypes)
        return (
            grad_rows.to(dtype),
            grad_w_gate.to(w_gate.dtype),
            grad_w_up.to(w_up.dtype),
            grad_w_down.to(w_down.dtype),
            *grad_biases,
            None,
        )


def fp8_block_grouped_expert_mlp(
    rows: torch.Tensor,
    group_sizes: list[int],
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
    *,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    alpha: float = 1.0,
    up_offset: float = 0.0,
) -> torch.Tensor:
    """`mok.reference.expert.grouped_expert_mlp` in the 128-block FP8 recipe: rows [M, H] bf16
    grouped by expert through w_gate, w_up [E, I, H] and w_down [E, H, I] (any H and I: a ragged
    last tile or block takes the elements there are), with the activation's `alpha` and
    `up_offset` and the experts' `biases` (b_gate, b_up [E, I], b_down [E, H] or None: added in
    fp32 to the products, never cast). Differentiable with the backward of the module
    docstring."""

    return grouped_with_expert_function(
        _BlockFP8Expert.apply, rows, group_sizes, (w_gate, w_up, w_down), swiglu_limit, biases,
        alpha, up_offset,
    )  # fmt: skip
