"""The expert MLP in MXFP8 on rows grouped by local expert, forward and backward, composed from the
casts (`mok.kernels.mx`) and the MX products (`mok.kernels.mx_grouped_gemm`): the semantics of
`mok.reference.mx_expert` (its quantization points and rounding), no host synchronization.

Each weight is cast once per call in both layouts (`mx_quantize_both`: along its last dimension
for the forward, along the one before for the data gradients, kept for the backward); x once
along H; h in the gate/up epilogue; grad out along H; the SwiGLU gradients along I in the down
data gradient's epilogue; the weight gradients' operands along the tokens inside their kernel.
Saved for backward: x and h as MXFP8 (bytes and scales), the weights' backward casts, and the
fp32 pre-activations (the reference's backward reads them in fp32; what a production layout
keeps instead is an open point of issue 14).
"""

from __future__ import annotations

import dataclasses

import torch

from mok.kernels.grouped_gemm import GemmTiles, RowTiles, row_tile_map
from mok.kernels.mx import mx_dequantize, mx_quantize, mx_quantize_both
from mok.kernels.mx_grouped_gemm import (
    mx_down,
    mx_down_dgrad_swiglu,
    mx_gate_up_dgrad,
    mx_gate_up_swiglu,
    mx_group_at_b,
)
from mok.reference.mx import ScaleRounding

MXPair = tuple[torch.Tensor, torch.Tensor]
"""(e4m3 data, e8m0 scale bytes) of an MXFP8 tensor."""


@dataclasses.dataclass(frozen=True)
class MXExpertTiles:
    """Tiles of the MX products; the defaults are the interpreter's (small tiles everywhere),
    `for_device` gives a GPU's."""

    rows: GemmTiles = GemmTiles(16, 32, 32, num_warps=4, num_stages=1, group_m=2)
    """The row-tiled products with one accumulator (down, both data gradients)."""
    gate_up: GemmTiles = GemmTiles(16, 32, 32, num_warps=4, num_stages=1, group_m=2)
    """gate/up + SwiGLU (two accumulators per tile)."""
    weights: GemmTiles = GemmTiles(32, 32, 32, num_warps=4, num_stages=1)
    """The weight gradients: block_m x block_n of a weight, block_k rows per step."""

    def __post_init__(self):
        if self.gate_up.block_m != self.rows.block_m:
            raise ValueError(
                f"the row-tiled MX products share one row-tile map: block_m {self.gate_up.block_m}"
                f" (gate/up) and {self.rows.block_m} (the others) must be equal"
            )

    @classmethod
    def for_device(cls, device: torch.device) -> MXExpertTiles:
        """The tiles for `device`: the defaults off GPUs, tensor-core-sized tiles on GPUs."""
        if device.type != "cuda":
            return cls()
        return cls(
            rows=GemmTiles(128, 128, 64, num_warps=8, num_stages=3),
            gate_up=GemmTiles(128, 64, 64, num_warps=8, num_stages=3),
            weights=GemmTiles(128, 128, 64, num_warps=8, num_stages=3),
        )


@dataclasses.dataclass(frozen=True)
class MXExpertSaved:
    """What `mx_expert_mlp_backward` needs from a forward call."""

    x: MXPair
    """The rows along H, [M, H] and [M, H / 32]."""
    h: MXPair
    """h along I, [M, I] and [M, I / 32]."""
    gate_up: torch.Tensor
    """[M, 2I] fp32 pre-activations."""
    group_offsets: torch.Tensor
    row_tiles: RowTiles
    w_down_along_h: MXPair
    """W_down cast along H, its dim 1 (for grad h), made with the forward's cast."""
    w_gate_along_i: MXPair
    """W_gate cast along I, its dim 1 (for grad x)."""
    w_up_along_i: MXPair
    swiglu_limit: float | None
    rounding: ScaleRounding
    tiles: MXExpertTiles


def _weight_casts(w: torch.Tensor, rounding) -> tuple[MXPair, MXPair]:
    """(w along its last dimension, w along the one before) of [E, R, C] weights."""
    return mx_quantize_both(w.contiguous(), rounding)


def _values_dtype(device: torch.device) -> torch.dtype:
    # The interpreter's bf16 arithmetic is wrong: outputs stay fp32 there (cast at the API).
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def mx_expert_mlp_forward(
    rows: torch.Tensor,
    group_offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
    rounding: ScaleRounding | str = ScaleRounding.RCEIL,
    tiles: MXExpertTiles | None = None,
) -> tuple[torch.Tensor, MXExpertSaved]:
    """out [M, H] of `mok.reference.mx_expert.mx_grouped_expert_mlp` for rows [M, H] (bf16, or
    fp32 holding bf16 values under the interpreter) grouped by `group_offsets` ([E + 1] int32
    on the device), weights [E, I, H], [E, I, H], [E, H, I]; H and I multiples of 32. Returns
    (out in bf16 on GPUs, fp32 on the CPU; rows outside the groups unwritten, saved)."""
    rounding = ScaleRounding(rounding)
    tiles = tiles or MXExpertTiles.for_device(rows.device)
    m = rows.shape[0]
    row_tiles = row_tile_map(group_offsets, m, tiles.rows.block_m)
    x_q = mx_quantize(rows, dim=-1, rounding=rounding)
    (wg_q, wg_k), (wu_q, wu_k) = _weight_casts(w_gate, rounding), _weight_casts(w_up, rounding)
    wd_q, wd_k = _weight_casts(w_down, rounding)
    h_data, h_scales, gate_up = mx_gate_up_swiglu(
        x_q, wg_q, wu_q, row_tiles, swiglu_limit, tiles.gate_up, rounding, save_preact=True
    )
    out = mx_down((h_data, h_scales), wd_q, row_tiles, tiles.rows, _values_dtype(rows.device))
    saved = MXExpertSaved(
        x=x_q,
        h=(h_data, h_scales),
        gate_up=gate_up,
        group_offsets=group_offsets,
        row_tiles=row_tiles,
        w_down_along_h=wd_k,
        w_gate_along_i=wg_k,
        w_up_along_i=wu_k,
        swiglu_limit=swiglu_limit,
        rounding=rounding,
        tiles=tiles,
    )
    return out, saved


def mx_expert_mlp_backward(
    grad_out: torch.Tensor, saved: MXExpertSaved
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad rows [M, H], grad W_gate, grad W_up, grad W_down in fp32) of `mx_expert_mlp_forward`
    given grad_out [M, H] (bf16 values): the reference's MXFP8 backward. grad rows is zero
    outside the groups; an expert without rows gets zero weight gradients."""
    rounding, tiles = saved.rounding, saved.tiles
    inter = saved.h[0].shape[1]
    g_q = mx_quantize(grad_out, dim=-1, rounding=rounding)
    grad_gate_q, grad_up_q, grads = mx_down_dgrad_swiglu(
        g_q,
        saved.w_down_along_h,
        saved.gate_up,
        saved.row_tiles,
        saved.swiglu_limit,
        tiles.rows,
        rounding,
    )
    grad_rows = mx_gate_up_dgrad(
        grad_gate_q,
        grad_up_q,
        saved.w_gate_along_i,
        saved.w_up_along_i,
        saved.row_tiles,
        tiles.rows,
        _values_dtype(grad_out.device),
    )
    offsets = saved.group_offsets
    h_values = mx_dequantize(*saved.h)
    x_values = mx_dequantize(*saved.x)
    grad_w_down = mx_group_at_b(grad_out, h_values, offsets, tiles.weights, rounding)
    grad_w_gate = mx_group_at_b(grads[:, :inter], x_values, offsets, tiles.weights, rounding)
    grad_w_up = mx_group_at_b(grads[:, inter:], x_values, offsets, tiles.weights, rounding)
    return grad_rows, grad_w_gate, grad_w_up, grad_w_down
