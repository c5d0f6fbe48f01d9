"""The expert MLP in the 128-block FP8 recipe: `mok.reference.fp8_block_expert`'s forward and
backward on rows grouped by expert, with no host synchronization.

    forward   rows -> cast (1 x 128 tiles along H) -> gate, up products (fp32) [+ biases]
              -> activation -> h (the rows' dtype) -> cast along I -> down product [+ bias] -> out
    backward  grad out -> cast along H -> x W_down's transposed blocks -> grad h (rounded)
              -> activation backward on the saved pre-activations -> grad gate, grad up
              -> cast along I -> x W_gate's, W_up's transposed blocks -> grad rows (their sum)
              weight gradients: both operands cast along each group's tokens (the saved casts of
              the rows and of h dequantized first, as the reference does)

The products run on the FP8 tensor cores where `registry.runs_fp8_tensor_cores` (Hopper): the
gate and up products in one pass with the biases and the activation in their epilogue, the down
product with its bias in its epilogue, grad h with the activation's backward in its epilogue,
grad rows as one product over grad gate's and grad up's casts side by side, and the weight
gradients where `registry.runs_fp8_wgrad_tensor_cores`. Elsewhere they run on the recipe's tl
kernels (`mok.kernels.fp8_block`), with the activation, its backward and the biases as the
reference's PyTorch operations, so that the only difference from the reference is the order of
fp32 sums (inside the products' steps, across grad rows' two halves, inside the biases'
gradients, `group_column_sums`); the tensor cores' sums of a step's e4m3 products also round
(within the recipe's error bound).

The weights' 128 x 128 block casts are the reference's (`quantize_blocks`), made with their
transposes (which the backward reads) in one pass by the forward, or kept across calls by a
`BlockWeightCache`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from mok.kernels import registry, warp_specialized
from mok.kernels.fp8_block import (
    BLOCK,
    TILES,
    BlockRows,
    block_quantize_tiles,
    block_quantize_tokens,
    block_quantize_weights,
    block_scaled_grouped_mm,
    block_scaled_grouped_wgrad,
    quantize_side_by_side,
    token_tile_starts,
)
from mok.kernels.grouped_gemm import group_column_sums, row_tile_map
from mok.kernels.host import SWIGLU, Activation, RowTiles
from mok.kernels.weight_casts import WeightCastCache
from mok.reference.expert import activation_gradients, saved_preactivations, swiglu


class FP8BlockSaved(NamedTuple):
    """What the forward keeps for `fp8_block_expert_backward`."""

    x_cast: tuple[torch.Tensor, torch.Tensor]
    """The rows' cast along H: (values [M, H] e4m3, descales [M, cdiv(H, 128)])."""
    h_cast: tuple[torch.Tensor, torch.Tensor]
    """h's cast along I."""
    gate_up: torch.Tensor
    """[M, 2I] the pre-activations gate | up as `saved_preactivations` keeps them, the rows'
    dtype."""
    group_offsets: torch.Tensor
    tiles: RowTiles
    """The forward's row tiles of the groups (`row_tile_map`, TILES.block_m rows)."""
    weight_casts: BlockWeightCasts
    """The forward's."""
    weight_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]
    activation: tuple
    """(limit, alpha, up_offset)."""
    inside: torch.Tensor
    """[M] bool: the rows inside the groups."""
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    """The forward's (b_gate, b_up, b_down), or None."""


def _per_row_biases(biases, offsets: torch.Tensor, inside: torch.Tensor) -> tuple:
    """Each row's expert's biases ((b_gate, b_up, b_down) [E, N] as [M, N] fp32 each; rows
    outside the groups: zeros), found on the device."""
    row_ids = torch.arange(inside.shape[0], device=inside.device, dtype=torch.int32)
    experts = torch.searchsorted(offsets[1:], row_ids, right=True)
    experts = torch.where(inside, experts, offsets.shape[0] - 1)  # E: the zeros' row
    return tuple(
        torch.cat([bias.float(), bias.new_zeros(1, bias.shape[1], dtype=torch.float32)])[experts]
        for bias in biases
    )


class BlockWeightCasts(NamedTuple):
    """The weights' 128 x 128 block casts: what the forward reads, and their transposes, what
    the backward's data gradients read (the FP8 products take both operands K-major)."""

    casts: tuple
    """(values [E, N, K] e4m3, descales [E, cdiv(N, 128), cdiv(K, 128)] fp32) of w_gate, w_up
    and w_down (`quantize_blocks`)."""
    down_transposed: tuple
    """w_down's cast as the product's weight for w_down.T: (values [E, I, H], descales [E,
    cdiv(I, 128), cdiv(H, 128)]), W.T's blocks being W's transposed."""
    gate_up_transposed: tuple
    """w_gate's and w_up's transposed casts side by side along I, each from a whole step on
    (`quantize_side_by_side`'s layout): (values [E, H, 2 I'] with I' = I rounded up to a
    multiple of 128 (zeros between), descales [E, cdiv(H, 128), 2 cdiv(I, 128)])."""


def block_weight_casts(w_gate, w_up, w_down) -> BlockWeightCasts:
    """The weights' casts and their transposes, one pass over each weight
    (`block_quantize_weights`)."""
    experts, inter, hidden = w_gate.shape
    steps = triton.cdiv(inter, BLOCK)
    padded, device = steps * BLOCK, w_gate.device
    values = (torch.zeros if inter % BLOCK else torch.empty)(
        experts, hidden, 2 * padded, dtype=torch.uint8, device=device
    ).view(torch.float8_e4m3fn)
    descales = torch.empty(
        experts, triton.cdiv(hidden, BLOCK), 2 * steps, dtype=torch.float32, device=device
    )
    gate_cast, _ = block_quantize_weights(w_gate, (values[..., :inter], descales[..., :steps]))
    up_halves = (values[..., padded : padded + inter], descales[..., steps:])
    up_cast, _ = block_quantize_weights(w_up, up_halves)
    down_cast, down_transposed = block_quantize_weights(w_down)
    return BlockWeightCasts((gate_cast, up_cast, down_cast), down_transposed, (values, descales))


class BlockWeightCache(WeightCastCache):
    """The last `block_weight_casts` made, reused while the weights are unchanged
    (`WeightCastCache`)."""

    def get(self, w_gate, w_up, w_down, dtype: torch.dtype) -> BlockWeightCasts:
        """The casts of the weights converted to `dtype`."""
        weights = (w_gate, w_up, w_down)
        return self.cached(
            weights, (dtype,), lambda: block_weight_casts(*(w.to(dtype) for w in weights))
        )


def _forward_on_tl(
    x_cast, offsets, tiles, weight_casts, dtype, limit, biases, activation, out, inside
) -> tuple:
    """(out, h's cast, the saved gate | up) of the forward on the tl kernels: the products in
    fp32, the biases and the activation as the reference's PyTorch operations, rows outside the
    groups zeros."""
    gate, up = (
        block_scaled_grouped_mm(*x_cast, *cast, offsets, torch.float32, tiles=tiles)
        for cast in weight_casts.casts[:2]
    )
    gate, up = gate.masked_fill(~inside[:, None], 0.0), up.masked_fill(~inside[:, None], 0.0)
    if biases is not None:
        biases = _per_row_biases(biases, offsets, inside)
        gate, up = gate + biases[0], up + biases[1]
    h = swiglu(gate, up, limit, activation.alpha, activation.up_offset).to(dtype)
    h_cast = block_quantize_tiles(h)
    down = block_scaled_grouped_mm(
        *h_cast, *weight_casts.casts[2], offsets, torch.float32, tiles=tiles
    )
    down = down.masked_fill(~inside[:, None], 0.0)
    if biases is not None:
        down = down + biases[2]
    # Rounded to the output's dtype as it is written: one pass.
    out = down.new_empty(down.shape, dtype=dtype) if out is None else out
    out.copy_(down)
    gate_up = torch.cat(saved_preactivations(gate, up, limit, dtype), dim=1)
    return out, h_cast, gate_up


def _forward_on_tensor_cores(
    x_cast, offsets, tiles, weight_casts, dtype, limit, biases, activation, out
) -> tuple:
    """(out, h's cast, the saved gate | up) of the forward on the FP8 tensor cores: the gate
    and up products with the biases and the activation in their epilogue (h and the saved
    pre-activations rounded there), the down product with its bias into out. The biases in
    fp32 from their values in `dtype`; rows outside the groups unwritten."""
    if biases is not None:
        biases = tuple(bias.to(dtype) for bias in biases)
    h, gate_up = warp_specialized.block_scaled_gate_up_swiglu(
        *x_cast, *weight_casts.casts[:2], offsets, tiles, limit, True, dtype,
        activation=activation, biases=None if biases is None else biases[:2],
    )  # fmt: skip
    h_cast = block_quantize_tiles(h)
    out = warp_specialized.block_scaled_grouped_mm(
        *h_cast, *weight_casts.casts[2], offsets, tiles, dtype,
        bias=None if biases is None else biases[2], out=out,
    )  # fmt: skip
    return out, h_cast, gate_up


def fp8_block_expert_forward(
    rows: torch.Tensor | BlockRows,
    group_offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    activation: Activation = SWIGLU,
    weight_casts: BlockWeightCasts | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, FP8BlockSaved]:
    """(out [M, H] in the rows' dtype, what the backward needs): each group's rows (rows [M, H]
    bf16, grouped by group_offsets [E + 1] int32 on their device) through its expert's w_gate,
    w_up [E, I, H] and w_down [E, H, I] in the 128-block recipe, as
    `fp8_block_grouped_expert_mlp` computes them; biases (b_gate, b_up [E, I], b_down [E, H])
    added in fp32. Rows outside the groups: unspecified. The rows may come cast already
    (`BlockRows`, as the exchange dispatches them): then out is in w_down's dtype.
    weight_casts: the weights' `block_weight_casts` made ahead (e.g. kept by a
    `BlockWeightCache`), else made here. out: where the outputs go (its first M rows, e.g. the
    exchange's buffer), else a new tensor."""
    if isinstance(rows, BlockRows):
        dtype, m = w_down.dtype, rows.packed.shape[0]
        x_cast = (rows.codes, rows.descales)
    else:
        dtype, m = rows.dtype, rows.shape[0]
        x_cast = block_quantize_tiles(rows)
    if weight_casts is None:
        weight_casts = block_weight_casts(w_gate, w_up, w_down)
    tiles = row_tile_map(group_offsets, m, TILES.block_m)
    row_ids = torch.arange(m, device=group_offsets.device, dtype=torch.int32)
    inside = (row_ids >= group_offsets[0]) & (row_ids < group_offsets[-1])
    out = None if out is None else out[:m]
    weights = (values for values, _ in weight_casts.casts)
    if registry.runs_fp8_tensor_cores(x_cast[0], *weights):
        out, h_cast, gate_up = _forward_on_tensor_cores(
            x_cast, group_offsets, tiles, weight_casts, dtype, swiglu_limit, biases, activation, out
        )
    else:
        out, h_cast, gate_up = _forward_on_tl(
            x_cast, group_offsets, tiles, weight_casts, dtype, swiglu_limit, biases, activation,
            out, inside,
        )  # fmt: skip
    saved = FP8BlockSaved(
        x_cast, h_cast, gate_up, group_offsets, tiles, weight_casts,
        (w_gate.dtype, w_up.dtype, w_down.dtype),
        (swiglu_limit, activation.alpha, activation.up_offset), inside, biases,
    )  # fmt: skip
    return out, saved


def _activation_gradients(grad_out: torch.Tensor, saved: FP8BlockSaved, tiles) -> tuple:
    """(grad gate, grad up) [M, I] in grad_out's dtype: grad h = grad_out's cast times W_down's
    transposed cast, rounded to grad_out's dtype, through the activation's backward on the saved
    pre-activations; on the FP8 tensor cores in the product's epilogue, else the product on the
    tl kernel and the backward as the reference's PyTorch operations. Rows outside the groups:
    unspecified."""
    grad_cast, down_transposed = block_quantize_tiles(grad_out), saved.weight_casts.down_transposed
    offsets, gate_up, activation = saved.group_offsets, saved.gate_up, saved.activation
    inter = gate_up.shape[1] // 2
    if registry.runs_fp8_tensor_cores(grad_cast[0], down_transposed[0]):
        limit, alpha, up_offset = activation
        grad_gate_up = warp_specialized.block_scaled_down_dgrad_swiglu(
            *grad_cast, down_transposed, offsets, tiles, gate_up, limit,
            Activation(alpha, up_offset),
        )  # fmt: skip
        return grad_gate_up[:, :inter], grad_gate_up[:, inter:]
    grad_h = block_scaled_grouped_mm(
        *grad_cast, *down_transposed, offsets, torch.float32, tiles=tiles
    )
    grad_h = grad_h.masked_fill(~saved.inside[:, None], 0.0).to(grad_out.dtype).float()
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    return activation_gradients(gate, up, grad_h, activation, grad_out.dtype)


def _weight_gradients(grad_out, grad_gate, grad_up, saved: FP8BlockSaved) -> tuple:
    """(grad w_gate, grad w_up, grad w_down), each rounded once into its weight's dtype as it is
    written: grad.T @ inputs per group, both cast along the group's tokens (the inputs from their
    saved tile casts), on the FP8 tensor cores where `registry.runs_fp8_wgrad_tensor_cores` (the
    casts then stored tokens-contiguous), else on the tl kernel."""
    offsets = saved.group_offsets
    token_tiles = row_tile_map(offsets, grad_out.shape[0], BLOCK)
    tile_starts = token_tile_starts(offsets)
    gate_dtype, up_dtype, down_dtype = saved.weight_dtypes
    hidden, inter, device = grad_out.shape[1], grad_gate.shape[1], grad_out.device

    def product(grad, input_tokens, out_dtype, tensor_cores: bool) -> torch.Tensor:
        grad_tokens = block_quantize_tokens(grad, token_tiles, transposed=tensor_cores)
        if tensor_cores:
            return warp_specialized.block_scaled_grouped_wgrad(
                grad_tokens, input_tokens, offsets, tile_starts, out_dtype
            )
        return block_scaled_grouped_wgrad(*grad_tokens, *input_tokens, offsets, out_dtype)

    cores = registry.runs_fp8_wgrad_tensor_cores(hidden, inter, device)
    h_tokens = block_quantize_tokens(saved.h_cast, token_tiles, transposed=cores)
    grad_w_down = product(grad_out, h_tokens, down_dtype, cores)
    cores = registry.runs_fp8_wgrad_tensor_cores(inter, hidden, device)
    x_tokens = block_quantize_tokens(saved.x_cast, token_tiles, transposed=cores)
    grad_w_gate = product(grad_gate, x_tokens, gate_dtype, cores)
    grad_w_up = product(grad_up, x_tokens, up_dtype, cores)
    return grad_w_gate, grad_w_up, grad_w_down


def fp8_block_expert_backward(grad_out: torch.Tensor, saved: FP8BlockSaved) -> tuple:
    """(grad rows [M, H], grad w_gate, grad w_up [E, I, H], grad w_down [E, H, I], grad b_gate,
    grad b_up [E, I], grad b_down [E, H]) of the forward that made `saved`, for grad_out [M, H]
    (the rows' dtype), as the reference's backward forms them: the weights' and biases'
    gradients in their dtypes (the biases' None without biases; zeros for an expert without
    rows), grad rows zeros outside the groups."""
    casts, offsets, inside = saved.weight_casts, saved.group_offsets, saved.inside
    dtype, fp32 = grad_out.dtype, torch.float32
    tiles = saved.tiles
    grad_gate, grad_up = _activation_gradients(grad_out, saved, tiles)
    # grad_gate @ W_gate + grad_up @ W_up as one product along K = gate's steps, then up's.
    grad_rows = registry.block_scaled_grouped_mm(
        quantize_side_by_side([grad_gate, grad_up]), casts.gate_up_transposed, offsets, tiles, dtype
    )
    grad_rows.masked_fill_(~inside[:, None], 0.0)
    grad_w_gate, grad_w_up, grad_w_down = _weight_gradients(grad_out, grad_gate, grad_up, saved)
    grad_biases = (None, None, None)
    if saved.biases is not None:
        # Summed into fp32 and rounded here: the interpreter's cast to bf16 truncates.
        grad_biases = tuple(
            group_column_sums(grad, offsets, torch.empty_like(bias, dtype=fp32)).to(bias.dtype)
            for grad, bias in zip((grad_gate, grad_up, grad_out), saved.biases, strict=True)
        )
    return (grad_rows, grad_w_gate, grad_w_up, grad_w_down, *grad_biases)
