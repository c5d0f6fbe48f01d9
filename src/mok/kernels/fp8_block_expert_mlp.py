"""The expert MLP's forward in the 128-block FP8 recipe on the recipe's tl kernels
(`mok.kernels.fp8_block`): `mok.reference.fp8_block_expert`'s forward on rows grouped by expert,
with no host synchronization.

    rows -> cast (1 x 128 tiles along H) -> gate, up products (fp32) [+ biases] -> activation
    -> h (the rows' dtype) -> cast along I -> down product (fp32) [+ bias] -> out (rounded once)

The weights' 128 x 128 block casts are the reference's (`quantize_blocks`): weights are cast once
per optimizer step, not per call. The activation and the biases are the reference's PyTorch
operations, so that the only difference from the reference is the order of fp32 sums inside the
products' steps. The backward and the fused gate/up product are not built yet.
"""

from __future__ import annotations

import torch

from mok.kernels.fp8_block import block_quantize_tiles, block_scaled_grouped_mm
from mok.kernels.host import SWIGLU, Activation
from mok.reference.expert import swiglu
from mok.reference.fp8_block import quantize_blocks


def _per_row(bias: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """bias [E, N] fp32 as each row's expert's bias [M, N] (rows outside the groups: zeros)."""
    padded = torch.cat([bias.float(), bias.new_zeros(1, bias.shape[1], dtype=torch.float32)])
    return padded[experts]


def fp8_block_expert_forward(
    rows: torch.Tensor,
    group_offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    activation: Activation = SWIGLU,
) -> torch.Tensor:
    """out [M, H] in the rows' dtype: each group's rows (rows [M, H] bf16, grouped by
    group_offsets [E + 1] int32 on their device) through its expert's w_gate, w_up [E, I, H] and
    w_down [E, H, I] in the 128-block recipe, as `fp8_block_grouped_expert_mlp` computes them;
    biases (b_gate, b_up [E, I], b_down [E, H]) added in fp32. Rows outside the groups: zeros."""
    dtype, m = rows.dtype, rows.shape[0]
    x_values, x_descales = block_quantize_tiles(rows)
    gate = block_scaled_grouped_mm(
        x_values, x_descales, *quantize_blocks(w_gate), group_offsets, torch.float32
    )
    up = block_scaled_grouped_mm(
        x_values, x_descales, *quantize_blocks(w_up), group_offsets, torch.float32
    )
    # Each row's expert, on the device: rows outside the groups get E (their values are dropped).
    row_ids = torch.arange(m, device=rows.device, dtype=torch.int32)
    experts = torch.searchsorted(group_offsets[1:], row_ids, right=True)
    inside = (row_ids >= group_offsets[0]) & (experts < w_gate.shape[0])
    experts = torch.where(inside, experts, w_gate.shape[0])
    gate, up = gate.masked_fill(~inside[:, None], 0.0), up.masked_fill(~inside[:, None], 0.0)
    if biases is not None:
        gate, up = gate + _per_row(biases[0], experts), up + _per_row(biases[1], experts)
    h = swiglu(gate, up, swiglu_limit, activation.alpha, activation.up_offset).to(dtype)
    h_values, h_descales = block_quantize_tiles(h)
    out = block_scaled_grouped_mm(
        h_values, h_descales, *quantize_blocks(w_down), group_offsets, torch.float32
    )
    out = out.masked_fill(~inside[:, None], 0.0)
    if biases is not None:
        out = out + _per_row(biases[2], experts)
    return out.to(dtype)
