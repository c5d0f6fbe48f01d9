"""MXFP8 (OCP Microscaling) in plain PyTorch: the oracle of the quantizing kernels.

A tensor is cut into blocks of 32 consecutive elements along one dimension (the reduction
dimension of the GEMM that reads it). Each block gets one power-of-two scale, stored as an e8m0
byte (the biased exponent: 2^(byte - 127)), and its elements become e4m3 values with

    x ~= e4m3 * 2^(byte - 127).

The cast follows torchao's `to_mx` (its eager path), bit for bit:

- amax: the largest |x| of the block, in fp32 (NaN if the block holds a NaN).
- RCEIL (the default; cuBLAS's and Transformer Engine's rounding): descale = amax / 448, the byte is
  ceil(log2(descale)) + 127 clamped to [0, 254]; 254 for an infinite amax, 255 (NaN) for a NaN one.
  The elements are x * 2^(127 - byte) (x itself where the byte is 0), clamped to [-448, 448],
  rounded to e4m3 (nearest, ties to even).
- FLOOR: the byte is floor(log2(amax)) - 8 + 127 (8: the exponent of e4m3's largest power of two,
  256), clamped to [0, 255]; 255 for a NaN amax. The elements are x / 2^(byte - 127) (the divisor
  at least 2^-126), clamped and rounded alike.

ceil(log2(descale)) is computed exactly, from the bits of descale. torchao's eager path computes it
with a float log2, which rounds down when descale lies a few ulps above a power of two 2^n with
|n| large (2^-20 (1 + 2^-23), for instance); there it picks the scale one step smaller and
saturates the block's largest element to 448. The exact choice here is what the OCP rule intends
and what Blackwell's `cvt.rp.satfinite.ue8m0` computes.
"""

from __future__ import annotations

import enum

import torch

BLOCK = 32
"""Elements per scale."""
E4M3_MAX = 448.0
"""Largest finite e4m3 value."""
E4M3_MAX_EXPONENT = 8
"""Exponent of the largest power of two e4m3 holds (256)."""
E8M0_BIAS = 127
E8M0_NAN = 255


class ScaleRounding(str, enum.Enum):
    """How a block's scale is chosen from its largest magnitude."""

    RCEIL = "rceil"
    """The smallest power of two that maps amax to at most 448 (amax never saturates)."""
    FLOOR = "floor"
    """amax's own power of two, over 256 (amax may saturate to 448)."""


def _float_exponent(values: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent field of fp32 values (-127 for zeros and subnormals), int32."""
    return ((values.view(torch.int32) >> 23) & 0xFF) - 127


def ceil_log2(values: torch.Tensor) -> torch.Tensor:
    """ceil(log2(v)) of positive finite fp32 values, exactly (int32); subnormals included."""
    bits = values.view(torch.int32)
    exponent = _float_exponent(values)
    mantissa = bits & 0x7FFFFF
    normal = exponent > -127
    # A subnormal m * 2^-149 (m < 2^23) has ceil(log2) = -149 + ceil(log2(m)).
    subnormal = -149 + torch.ceil(torch.log2(mantissa.clamp(min=1).to(torch.float64))).to(
        torch.int32
    )
    return torch.where(normal, exponent + (mantissa != 0).to(torch.int32), subnormal)


def _blocks(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """x in fp32 with `dim` moved last and split into [..., n / 32, 32] blocks."""
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % BLOCK:
        raise ValueError(
            f"MXFP8 needs the quantized dimension ({dim}, size {size}) to be a multiple of {BLOCK}"
        )
    moved = x.movedim(dim, -1).to(torch.float32)
    return moved.reshape(*moved.shape[:-1], size // BLOCK, BLOCK), dim


def quantize(
    x: torch.Tensor, dim: int = -1, rounding: ScaleRounding | str = ScaleRounding.RCEIL
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scales) of x (bf16 or fp32) in blocks of 32 along `dim`.

    data: x's shape, torch.float8_e4m3fn. scales: x's shape with `dim` divided by 32, uint8 e8m0
    biased exponents (the scale of block b along dim is 2^(scales[..., b, ...] - 127))."""
    rounding = ScaleRounding(rounding)
    blocks, dim = _blocks(x, dim)
    amax = blocks.abs().amax(-1, keepdim=True)
    nan = amax.isnan()
    if rounding is ScaleRounding.RCEIL:
        descale = amax / E4M3_MAX
        finite_positive = torch.isfinite(descale) & (descale > 0)
        exponent = ceil_log2(torch.where(finite_positive, descale, 1.0))
        exponent = torch.where(finite_positive, exponent, -E8M0_BIAS)
        byte = (exponent.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.int32)
        byte = torch.where(descale.isinf(), 254, byte)
        byte = torch.where(nan, E8M0_NAN, byte)
        reciprocal = torch.exp2((E8M0_BIAS - byte).to(torch.float32))
        reciprocal = torch.where(byte == 0, 1.0, reciprocal)
        reciprocal = torch.where(byte == 254, 2.0**-127, reciprocal)
        reciprocal = torch.where(nan, float("nan"), reciprocal)
        scaled = blocks * reciprocal
    else:
        exponent = _float_exponent(amax) - E4M3_MAX_EXPONENT
        byte = (exponent.clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS).to(torch.int32)
        byte = torch.where(nan, E8M0_NAN, byte)
        divisor = (byte << 23).view(torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
        scaled = blocks / divisor
    data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    data = data.reshape(*data.shape[:-2], data.shape[-2] * BLOCK).movedim(-1, dim)
    scales = byte.squeeze(-1).to(torch.uint8).movedim(-1, dim)
    return data, scales


def dequantize(
    data: torch.Tensor, scales: torch.Tensor, dim: int = -1, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """data * 2^(scales - 127), each scale repeated over its 32 elements along `dim` (NaN where the
    scale is 255). Exact in fp32 and bf16 for every scale that keeps the product normal."""
    dim = dim % data.dim()
    exponent = scales.to(torch.int32) - E8M0_BIAS
    factor = torch.exp2(exponent.to(torch.float32))
    factor = torch.where(scales == E8M0_NAN, float("nan"), factor)
    factor = factor.repeat_interleave(BLOCK, dim=dim)
    return (data.to(torch.float32) * factor).to(dtype)
