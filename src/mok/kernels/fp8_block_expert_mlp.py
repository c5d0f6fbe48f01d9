"""The expert MLP in the 128-block FP8 recipe on the recipe's tl kernels (`mok.kernels.fp8_block`):
`mok.reference.fp8_block_expert`'s forward and backward on rows grouped by expert, with no host
synchronization.

    forward   rows -> cast (1 x 128 tiles along H) -> gate, up products (fp32) [+ biases]
              -> activation -> h (the rows' dtype) -> cast along I -> down product [+ bias] -> out
    backward  grad out -> cast along H -> x W_down's transposed blocks -> grad h (rounded)
              -> activation backward on the saved pre-activations -> grad gate, grad up
              -> cast along I -> x W_gate's, W_up's transposed blocks -> grad rows (their sum)
              weight gradients: both operands cast along each group's tokens (the saved casts of
              the rows and of h dequantized first, as the reference does)

The weights' 128 x 128 block casts are the reference's (`quantize_blocks`), made once by the
forward and kept for the backward, which reads them transposed. The activation, its backward and
the biases are the reference's PyTorch operations, so that the only difference from the reference
is the order of fp32 sums inside the products' steps (and inside the biases' gradients,
`group_column_sums`). The weights' casts may come made ahead, kept across calls by a
`BlockWeightCache`. Not built yet: the fused gate/up product.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mok.kernels.fp8_block import (
    BLOCK,
    TILES,
    BlockRows,
    block_quantize_tiles,
    block_quantize_tokens,
    block_scaled_grouped_mm,
    block_scaled_grouped_wgrad,
)
from mok.kernels.grouped_gemm import group_column_sums, row_tile_map
from mok.kernels.host import SWIGLU, Activation
from mok.kernels.weight_casts import WeightCastCache
from mok.reference.expert import activation_gradients, saved_preactivations, swiglu
from mok.reference.fp8_block import dequantize_tiles, quantize_blocks


class FP8BlockSaved(NamedTuple):
    """What the forward keeps for `fp8_block_expert_backward`."""

    x_cast: tuple[torch.Tensor, torch.Tensor]
    """The rows' cast along H: (values [M, H] e4m3, descales [M, cdiv(H, 128)])."""
    h_cast: tuple[torch.Tensor, torch.Tensor]
    """h's cast along I."""
    gate: torch.Tensor
    """[M, I] the pre-activations as `saved_preactivations` keeps them, the rows' dtype."""
    up: torch.Tensor
    group_offsets: torch.Tensor
    weight_casts: tuple
    """The block casts (values, descales) of w_gate, w_up and w_down, the forward's."""
    weight_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]
    activation: tuple
    """(limit, alpha, up_offset)."""
    inside: torch.Tensor
    """[M] bool: the rows inside the groups."""
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    """The forward's (b_gate, b_up, b_down), or None."""


def _per_row(bias: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """bias [E, N] fp32 as each row's expert's bias [M, N] (rows outside the groups: zeros)."""
    padded = torch.cat([bias.float(), bias.new_zeros(1, bias.shape[1], dtype=torch.float32)])
    return padded[experts]


def block_weight_casts(w_gate, w_up, w_down) -> tuple:
    """The weights' 128 x 128 block casts ((values, descales) of each, `quantize_blocks`): what
    the forward reads, and, transposed, the backward."""
    return tuple(quantize_blocks(w) for w in (w_gate, w_up, w_down))


class BlockWeightCache(WeightCastCache):
    """The last `block_weight_casts` made, reused while the weights are unchanged
    (`WeightCastCache`)."""

    def get(self, w_gate, w_up, w_down, dtype: torch.dtype) -> tuple:
        """The casts of the weights converted to `dtype`."""
        weights = (w_gate, w_up, w_down)
        return self.cached(
            weights, (dtype,), lambda: block_weight_casts(*(w.to(dtype) for w in weights))
        )


def fp8_block_expert_forward(
    rows: torch.Tensor | BlockRows,
    group_offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    activation: Activation = SWIGLU,
    weight_casts: tuple | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, FP8BlockSaved]:
    """(out [M, H] in the rows' dtype, what the backward needs): each group's rows (rows [M, H]
    bf16, grouped by group_offsets [E + 1] int32 on their device) through its expert's w_gate,
    w_up [E, I, H] and w_down [E, H, I] in the 128-block recipe, as
    `fp8_block_grouped_expert_mlp` computes them; biases (b_gate, b_up [E, I], b_down [E, H])
    added in fp32. Rows outside the groups: zeros. The rows may come cast already (`BlockRows`,
    as the exchange dispatches them): then out is in w_down's dtype. weight_casts: the weights'
    `block_weight_casts` made ahead (e.g. kept by a `BlockWeightCache`), else made here. out:
    where the outputs go (its first M rows, e.g. the exchange's buffer), else a new tensor."""
    if isinstance(rows, BlockRows):
        dtype, m = w_down.dtype, rows.packed.shape[0]
        x_cast = (rows.codes, rows.descales)
    else:
        dtype, m = rows.dtype, rows.shape[0]
        x_cast = block_quantize_tiles(rows)
    if weight_casts is None:
        weight_casts = block_weight_casts(w_gate, w_up, w_down)
    tiles = row_tile_map(group_offsets, m, TILES.block_m)
    gate, up = (
        block_scaled_grouped_mm(*x_cast, *cast, group_offsets, torch.float32, tiles=tiles)
        for cast in weight_casts[:2]
    )
    # Each row's expert, on the device: rows outside the groups get E (their values are dropped).
    row_ids = torch.arange(m, device=group_offsets.device, dtype=torch.int32)
    experts = torch.searchsorted(group_offsets[1:], row_ids, right=True)
    inside = (row_ids >= group_offsets[0]) & (experts < w_gate.shape[0])
    experts = torch.where(inside, experts, w_gate.shape[0])
    gate, up = gate.masked_fill(~inside[:, None], 0.0), up.masked_fill(~inside[:, None], 0.0)
    if biases is not None:
        gate, up = gate + _per_row(biases[0], experts), up + _per_row(biases[1], experts)
    h = swiglu(gate, up, swiglu_limit, activation.alpha, activation.up_offset).to(dtype)
    h_cast = block_quantize_tiles(h)
    down = block_scaled_grouped_mm(
        *h_cast, *weight_casts[2], group_offsets, torch.float32, tiles=tiles
    )
    down = down.masked_fill(~inside[:, None], 0.0)
    if biases is not None:
        down = down + _per_row(biases[2], experts)
    # Rounded to the output's dtype as it is written: one pass.
    out = down.new_empty(m, down.shape[1], dtype=dtype) if out is None else out[:m]
    out.copy_(down)
    gate, up = saved_preactivations(gate, up, swiglu_limit, dtype)
    saved = FP8BlockSaved(
        x_cast, h_cast, gate, up, group_offsets, weight_casts,
        (w_gate.dtype, w_up.dtype, w_down.dtype),
        (swiglu_limit, activation.alpha, activation.up_offset), inside, biases,
    )  # fmt: skip
    return out, saved


def _transposed(cast: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The block cast (values [E, N, K], descales) of w as the product's weight for w.T:
    (values [E, K, N] contiguous, descales [E, cdiv(K, 128), cdiv(N, 128)]): W.T's blocks are
    W's transposed."""
    values, descales = cast
    return values.transpose(1, 2).contiguous(), descales.transpose(1, 2).contiguous()


def fp8_block_expert_backward(grad_out: torch.Tensor, saved: FP8BlockSaved) -> tuple:
    """(grad rows [M, H], grad w_gate, grad w_up [E, I, H], grad w_down [E, H, I], grad b_gate,
    grad b_up [E, I], grad b_down [E, H]) of the forward that made `saved`, for grad_out [M, H]
    (the rows' dtype), as the reference's backward forms them: the weights' and biases'
    gradients in their dtypes (the biases' None without biases; zeros for an expert without
    rows), grad rows zeros outside the groups."""
    gate_cast, up_cast, down_cast = (_transposed(cast) for cast in saved.weight_casts)
    offsets, inside, dtype = saved.group_offsets, saved.inside, grad_out.dtype
    fp32 = torch.float32
    tiles = row_tile_map(offsets, grad_out.shape[0], TILES.block_m)
    grad_h = block_scaled_grouped_mm(
        *block_quantize_tiles(grad_out), *down_cast, offsets, fp32, tiles=tiles
    )
    grad_h = grad_h.masked_fill(~inside[:, None], 0.0).to(dtype).float()
    grad_gate, grad_up = activation_gradients(saved.gate, saved.up, grad_h, saved.activation, dtype)
    grad_rows = block_scaled_grouped_mm(
        *block_quantize_tiles(grad_gate), *gate_cast, offsets, fp32, tiles=tiles
    )
    grad_rows = grad_rows + block_scaled_grouped_mm(
        *block_quantize_tiles(grad_up), *up_cast, offsets, fp32, tiles=tiles
    )
    grad_rows = grad_rows.masked_fill(~inside[:, None], 0.0).to(dtype)
    token_tiles = row_tile_map(offsets, grad_out.shape[0], BLOCK)
    x_tokens = block_quantize_tokens(dequantize_tiles(*saved.x_cast), token_tiles)
    h_tokens = block_quantize_tokens(dequantize_tiles(*saved.h_cast), token_tiles)
    grad_w_down = block_scaled_grouped_wgrad(
        *block_quantize_tokens(grad_out, token_tiles), *h_tokens, offsets
    )
    grad_w_gate = block_scaled_grouped_wgrad(
        *block_quantize_tokens(grad_gate, token_tiles), *x_tokens, offsets
    )
    grad_w_up = block_scaled_grouped_wgrad(
        *block_quantize_tokens(grad_up, token_tiles), *x_tokens, offsets
    )
    grad_biases = (None, None, None)
    if saved.biases is not None:
        # Summed into fp32 and rounded here: the interpreter's cast to bf16 truncates.
        grad_biases = tuple(
            group_column_sums(grad, offsets, torch.empty_like(bias, dtype=fp32)).to(bias.dtype)
            for grad, bias in zip((grad_gate, grad_up, grad_out), saved.biases, strict=True)
        )
    weight_grads = (grad_w_gate, grad_w_up, grad_w_down)
    return (
        grad_rows,
        *(grad.to(kind) for grad, kind in zip(weight_grads, saved.weight_dtypes, strict=True)),
        *grad_biases,
    )
