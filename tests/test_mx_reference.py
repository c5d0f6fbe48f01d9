"""The MXFP8 reference cast (`mok.reference.mx`) against torchao's `to_mx`, bit for bit.

Bugs these catch: a scale off by one power of two (RCEIL vs FLOOR mixed up, ceil of an exact power
of two rounded up, the bias), e4m3 rounding other than nearest-even or without saturation, NaN
or infinity in a block not propagated the way torchao does, subnormal inputs and all-zero blocks
mishandled, blocks taken along the wrong dimension.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mx_cases import assert_same_bits, blocks_of_every_kind

from mok.reference import mx

to_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor").to_mx
ScaleCalculationMode = pytest.importorskip(
    "torchao.prototype.mx_formats.config"
).ScaleCalculationMode

MODES = {"rceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR}


def torchao_cast(x: torch.Tensor, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(data as uint8 bits, scale bytes) of torchao's cast along the last dimension."""
    scales, data = to_mx(x.contiguous(), torch.float8_e4m3fn, mx.BLOCK, MODES[rounding])
    return data.view(torch.uint8), scales.view(torch.uint8)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kind_of_block_matches_torchao_bitwise(rounding, dtype):
    x = blocks_of_every_kind(dtype)
    data, scales = mx.quantize(x, rounding=rounding)
    want_data, want_scales = torchao_cast(x, rounding)
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
    assert torch.equal(scales, want_scales)
    assert_same_bits(data.view(torch.uint8), want_data)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_blocks_along_the_first_dimension(rounding):
    """Quantizing along dim 0 is quantizing the transpose along its last dimension."""
    x = blocks_of_every_kind(torch.bfloat16, seed=1)[:, :96]  # [64, 96]: 2 blocks down dim 0
    data, scales = mx.quantize(x, dim=0, rounding=rounding)
    want_data, want_scales = torchao_cast(x.T, rounding)
    assert scales.shape == (2, 96) and data.shape == x.shape
    assert torch.equal(scales, want_scales.T)
    assert_same_bits(data.view(torch.uint8), want_data.T)


@given(
    exponent=st.integers(-149, 127),
    seed=st.integers(0, 2**31 - 1),
    rounding=st.sampled_from(["rceil", "floor"]),
    spread=st.integers(0, 40),
)
def test_random_blocks_match_torchao(exponent, seed, rounding, spread):
    """Blocks around 2^exponent whose elements spread over 2^spread: scales from the bottom of the
    e8m0 range to its top, elements down to e4m3's subnormals and below."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (4, 64), generator=gen) * 2 - 1
    powers = torch.randint(-spread, 1, (4, 64), generator=gen)
    mantissas = 1 + torch.rand(4, 64, generator=gen, dtype=torch.float64)
    x = (signs * mantissas * torch.exp2((powers + exponent).to(torch.float64))).to(torch.float32)
    data, scales = mx.quantize(x, rounding=rounding)
    want_data, want_scales = torchao_cast(x, rounding)
    assert torch.equal(scales, want_scales)
    assert_same_bits(data.view(torch.uint8), want_data)


def test_rceil_takes_the_exact_ceiling_of_log2():
    """Where descale = amax / 448 lies just above a power of two 2^n with |n| large, a float log2
    rounds to n; the exact ceiling is n + 1, so amax maps to 224.00002 (e4m3 224), not past 448."""
    for n in (-20, -100, 60):
        descale = torch.tensor([2.0**n], dtype=torch.float32)
        descale = torch.nextafter(descale, torch.tensor([math.inf]))
        amax = (descale.double() * 448).float()
        assert (amax / 448).item() == descale.item()  # the division lands on descale exactly
        x = torch.zeros(1, 32)
        x[0, 3] = amax
        data, scales = mx.quantize(x, rounding="rceil")
        assert scales.item() == n + 1 + mx.E8M0_BIAS
        assert data.float()[0, 3].item() == 224.0


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_dequantize_is_within_e4m3_rounding(rounding):
    """Every element within half an e4m3 step of its value: 2^-4 relative, or half the block's
    subnormal step (2^-10 x scale) absolute; FLOOR may also saturate a block's largest elements to
    448 x scale, RCEIL never."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 128, generator=gen) * torch.exp2(torch.randint(-20, 20, (16, 1)).float())
    data, scales = mx.quantize(x, rounding=rounding)
    back = mx.dequantize(data, scales)
    scale = torch.exp2(scales.float() - mx.E8M0_BIAS).repeat_interleave(mx.BLOCK, dim=1)
    within = (back - x).abs() <= x.abs() * 2.0**-4 + scale * 2.0**-10
    saturated = (back.abs() == mx.E4M3_MAX * scale) & (x.abs() > mx.E4M3_MAX * scale)
    assert (within | saturated).all()
    assert saturated.any() if rounding == "floor" else not saturated.any()


def test_a_dimension_not_a_multiple_of_32_raises():
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.quantize(torch.ones(4, 48))
