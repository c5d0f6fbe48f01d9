"""The 128-block FP8 recipe in plain PyTorch: the oracle of its casts and of its GEMMs.

The recipe of DeepSeek-V3's training (and of Transformer Engine's block scaling): e4m3 values,
each tile of them with one fp32 scale.

- Activations and gradients: 1 x 128 tiles along the GEMM's reduction dimension (`quantize_tiles`);
  the weight gradient's operands, whose reduction runs over the tokens, in tiles along the tokens.
- Weights: 128 x 128 blocks (`quantize_blocks`).
- GEMM (`scaled_matmul`): each 128-element step of the reduction is a product of e4m3
  values; its fp32 partial sums are scaled by the two operands' descales and added, in fp32, to
  the output, step by step (what the tensor cores' FP8 MMA and the promotion to the CUDA cores
  compute, up to the order of the fp32 sums inside a step and the rounding of each step's add).

The cast of a tile follows torchao's eager blockwise cast (`torch_blockwise_scale_act_quant_lhs`,
`torch_blockwise_scale_weight_quant`), bit for bit:

- amax: the tile's largest |x| in x's dtype, widened to fp64 and clamped to at least 1e-12 (a tile
  of zeros gets the descale 1e-12 / 448 and zero values; NaN stays NaN).
- scale = fp32(448 / amax) (the division in fp64); values = e4m3(clamp(x * scale, -448, 448)),
  the product in fp32, rounded to nearest, ties to even.
- descale = 1 / scale in fp32 (what the GEMM multiplies the partial sums by).

A tile at the end of a dimension that is not a multiple of 128 holds the remaining elements and
takes its amax over them (torchao's eager cast needs multiples of 128).
"""

from __future__ import annotations

import torch

BLOCK = 128
"""Elements of a tile along the quantized dimension, and the side of a weight block."""
E4M3_MAX = 448.0
"""Largest finite e4m3 value."""
AMAX_FLOOR = 1e-12
"""Smallest amax a scale is computed from (torchao's EPS): tiles of zeros get finite scales."""


def _scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, descale) fp32 of tiles with the largest magnitudes `amax` (any float dtype)."""
    amax = amax.to(torch.float64).clamp(min=AMAX_FLOOR)
    scale = (E4M3_MAX / amax).to(torch.float32)
    return scale, 1.0 / scale


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x * scale)), the product in fp32."""
    scaled = x.to(torch.float32) * scale
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _tiles_last(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [..., ceil(K / 128), 128], the last tile padded with zeros (which never
    raise an amax)."""
    size = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, -size % BLOCK))
    return padded.reshape(*x.shape[:-1], -1, BLOCK)


def quantize_tiles(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, descales) of x (bf16 or fp32) in 1 x 128 tiles along `dim`.

    values: x's shape, torch.float8_e4m3fn. descales: x's shape with `dim` of ceil(size / 128),
    fp32: x ~= values * descales[tile], tile b of dim holding its elements [128 b, 128 b + 128)."""
    dim = dim % x.dim()
    moved = x.movedim(dim, -1)
    tiles = _tiles_last(moved)
    scale, descale = _scales(tiles.abs().amax(-1, keepdim=True))
    values = _cast(tiles, scale).flatten(-2)[..., : moved.shape[-1]]
    return values.movedim(-1, dim), descale.squeeze(-1).movedim(-1, dim)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, descales) of w [..., N, K] (bf16 or fp32; leading dims: experts) in 128 x 128
    blocks over its last two dimensions.

    values: w's shape, torch.float8_e4m3fn. descales: [..., ceil(N / 128), ceil(K / 128)] fp32."""
    rows, cols = w.shape[-2:]
    padded = torch.nn.functional.pad(w, (0, -cols % BLOCK, 0, -rows % BLOCK))
    n_blocks, k_blocks = padded.shape[-2] // BLOCK, padded.shape[-1] // BLOCK
    blocks = padded.reshape(*w.shape[:-2], n_blocks, BLOCK, k_blocks, BLOCK).transpose(-3, -2)
    amax = blocks.abs().amax((-2, -1), keepdim=True)
    scale, descale = _scales(amax)
    values = _cast(blocks, scale).transpose(-3, -2).reshape(padded.shape)[..., :rows, :cols]
    return values, descale.squeeze(-1).squeeze(-1)


def dequantize_tiles(
    values: torch.Tensor, descales: torch.Tensor, dim: int = -1, dtype=torch.float32
) -> torch.Tensor:
    """values * descales, each descale repeated over its tile's elements along `dim`, in fp32
    (then `dtype`)."""
    dim = dim % values.dim()
    factor = descales.repeat_interleave(BLOCK, dim=dim).narrow(dim, 0, values.shape[dim])
    return (values.to(torch.float32) * factor).to(dtype)


def dequantize_blocks(values: torch.Tensor, descales: torch.Tensor, dtype=torch.float32):
    """values [..., N, K] * the descale of each one's 128 x 128 block, in fp32 (then `dtype`)."""
    rows, cols = values.shape[-2:]
    factor = descales.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return (values.to(torch.float32) * factor[..., :rows, :cols]).to(dtype)


def block_rows(descales: torch.Tensor, rows: int) -> torch.Tensor:
    """The descales [..., ceil(N / 128), S] of 128 x 128 blocks repeated for each of their rows:
    [..., N, S] (a block cast's descales as `scaled_matmul` takes them)."""
    return descales.repeat_interleave(BLOCK, dim=-2)[..., :rows, :]


def scaled_matmul(
    a_values: torch.Tensor,
    a_descales: torch.Tensor,
    b_values: torch.Tensor,
    b_descales: torch.Tensor,
) -> torch.Tensor:
    """A @ B.T [M, N] fp32 of A [M, K] and B [N, K] e4m3 scaled per row and 128-element step of K
    (descales [M, S] and [N, S], S = ceil(K / 128): 1 x 128 tiles along K, or a block cast's
    descales through `block_rows`), as the recipe's GEMM forms it: for each step s in ascending
    order, the fp32 partial sums of the step's e4m3 products times the product of A's and B's
    descales of the step, added to the fp32 output. A kernel that fuses the multiply and the add
    (an FMA) rounds once where this rounds twice."""
    m, k = a_values.shape
    out = torch.zeros(m, b_values.shape[0], dtype=torch.float32, device=a_values.device)
    for step, start in enumerate(range(0, k, BLOCK)):
        a_step = a_values[:, start : start + BLOCK].to(torch.float32)
        b_step = b_values[:, start : start + BLOCK].to(torch.float32)
        partial = a_step @ b_step.T
        out = out + partial * (a_descales[:, step, None] * b_descales[None, :, step])
    return out
