"""The MXFP8 cast kernel against the reference cast (`mok.reference.mx`, itself bit for bit
torchao's), byte for byte: under the interpreter on the CPU, compiled on the GPU.

Bugs these catch: the e4m3 rounding done by bit arithmetic off at ties, at the normal/subnormal
boundary (2^-6) or for -0 and NaN; an exact-ceiling scale off for subnormal or infinite block
maxima; a NaN in a block not making its scale 255; the FLOOR factor taken from the wrong byte; a
tile's partial rows or columns written; the strided (dim 0) path reading or writing the wrong
layout. The dequantization (the A-row source of MX products on Hopper): an e4m3 code decoded
wrongly (subnormals, the sign of zero, NaN), a scale applied to the wrong block, a bf16 rounding
off at ties or for subnormal products.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mx_cases import assert_same_bits, blocks_of_every_kind

from mok.kernels.grouped_gemm import row_tile_map
from mok.kernels.mx import (
    GROUP_ROWS,
    mx_dequantize,
    mx_group_rows_values,
    mx_quantize,
    mx_quantize_both,
    mx_quantized_values,
    mx_quantized_values_both,
)
from mok.reference import mx
from mok.reference.mx_expert import quantized_rows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check(x: torch.Tensor, dim: int, rounding: str) -> None:
    data, scales = mx_quantize(x.to(DEVICE), dim=dim, rounding=rounding)
    want_data, want_scales = mx.quantize(x, dim=dim, rounding=rounding)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    assert torch.equal(scales.cpu(), want_scales)
    assert_same_bits(data.cpu().view(torch.uint8), want_data.view(torch.uint8))


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kind_of_block(rounding, dtype):
    """Zeros, NaN, inf, subnormals, powers of two, e4m3 ties, saturation, 2^-140 .. 2^120; the
    partial tiles of 50 rows and 224 columns."""
    x = blocks_of_every_kind(dtype)[:50, :224]
    check(x, -1, rounding)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_along_the_first_dimension_of_a_strided_view(rounding):
    x = blocks_of_every_kind(torch.bfloat16, seed=2)[:, 16:112]  # [64, 96], row stride 256
    check(x, 0, rounding)


def test_every_e4m3_value_and_the_midpoints_between_them():
    """All 126 positive finite e4m3 values, each midpoint to the next (a tie: to even), just
    below and above each midpoint, negated too; in blocks whose scale is 1 (amax 448)."""
    values = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (values[:-1] + values[1:]) / 2
    below, above = torch.nextafter(mid, values[:-1]), torch.nextafter(mid, values[1:])
    probes = torch.cat([values, mid, below, above])
    probes = torch.cat([probes, -probes, torch.tensor([0.0, -0.0])])
    pad = (-probes.numel()) % 31
    probes = torch.cat([probes, torch.zeros(pad)]).view(-1, 31)
    x = torch.cat([torch.full((probes.shape[0], 1), 448.0), probes], dim=1)
    for rounding in ("rceil", "floor"):
        check(x, -1, rounding)


@given(
    exponent=st.integers(-149, 127),
    seed=st.integers(0, 2**31 - 1),
    rounding=st.sampled_from(["rceil", "floor"]),
    rows=st.integers(1, 40),
    blocks=st.integers(1, 6),
)
def test_random_shapes_and_magnitudes(exponent, seed, rounding, rows, blocks):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 32 * blocks, generator=gen) * 2.0 ** min(exponent, 100)
    x *= torch.exp2(torch.randint(-20, 1, (rows, 32 * blocks), generator=gen).float())
    check(x, -1, rounding)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="multiple of 32"):
        mx_quantize(torch.ones(4, 48, device=DEVICE))
    with pytest.raises(ValueError, match="2-D"):
        mx_quantize(torch.ones(2, 4, 32, device=DEVICE))


def check_both(x: torch.Tensor, rounding: str) -> None:
    """`mx_quantize_both` equals the reference cast along each of the last two dimensions."""
    (rowwise, rowwise_scales), (colwise, colwise_scales) = mx_quantize_both(
        x.to(DEVICE), rounding=rounding
    )
    for (data, scales), dim in (((rowwise, rowwise_scales), -1), ((colwise, colwise_scales), -2)):
        want_data, want_scales = mx.quantize(x, dim=dim, rounding=rounding)
        assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
        assert torch.equal(scales.cpu(), want_scales), dim
        assert_same_bits(data.cpu().view(torch.uint8), want_data.view(torch.uint8))


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_layouts_in_one_pass(rounding, dtype):
    """A weight's forward (along K) and backward (along N) casts from one read: every kind of
    block along both dimensions, a partial column tile (224 = 3.5 tiles of 64), and experts
    stacked in front ([2, 32, 96]: a block along N must not mix two experts' rows). Catches a
    transposed tile stored untransposed, the column-wise scales laid out along the wrong
    dimension, blocks straddling experts."""
    check_both(blocks_of_every_kind(dtype)[:, :224].contiguous(), rounding)
    experts = blocks_of_every_kind(dtype, seed=3)[:, :96].reshape(2, 32, 96).contiguous()
    check_both(experts, rounding)


def test_both_layouts_refuse_bad_shapes():
    with pytest.raises(ValueError, match="multiples of 32"):
        mx_quantize_both(torch.ones(48, 64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        mx_quantize_both(torch.ones(64, 64, device=DEVICE).T[:, :32])


def assert_same_values(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Bit for bit, any NaN matching any NaN."""
    nan = theirs.isnan()
    assert torch.equal(ours.isnan(), nan)
    bits = torch.int32 if ours.dtype == torch.float32 else torch.int16
    assert torch.equal(ours.view(bits)[~nan], theirs.view(bits)[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_every_e4m3_code_at_every_kind_of_scale(dtype):
    """All 256 codes (zeros, subnormals, NaN, both signs) under scales from 2^-127 (products
    subnormal in fp32) through 2^127 and the NaN scale."""
    scale_bytes = [0, 1, 3, 60, 118, 127, 128, 200, 254, 255]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(len(scale_bytes), 1)
    data = codes.view(torch.float8_e4m3fn)
    scales = torch.tensor(scale_bytes, dtype=torch.uint8)[:, None].repeat(1, 256 // 32)
    got = mx_dequantize(data.to(DEVICE), scales.to(DEVICE), dtype)
    assert_same_values(got.cpu(), mx.dequantize(data, scales, dtype=dtype))


@given(seed=st.integers(0, 2**16), rows=st.integers(1, 40), blocks=st.integers(1, 9))
def test_dequantize_what_the_cast_quantized(seed, rows, blocks):
    """The round trip of random data of every magnitude: the reference's values exactly."""
    gen = torch.Generator().manual_seed(seed)
    exponent = torch.randint(-60, 60, (rows, blocks * 32), generator=gen).float()
    x = torch.randn(rows, blocks * 32, generator=gen) * torch.exp2(exponent)
    data, scales = mx.quantize(x)
    got = mx_dequantize(data.to(DEVICE), scales.to(DEVICE), torch.bfloat16)
    assert_same_values(got.cpu(), mx.dequantize(data, scales, dtype=torch.bfloat16))


def test_dequantize_refuses_bad_operands():
    data = torch.zeros(4, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="scales must be"):
        mx_dequantize(data, torch.zeros(4, 3, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of 32"):
        mx_dequantize(data[:, :48], torch.zeros(4, 1, dtype=torch.uint8, device=DEVICE))


def reference_values(x: torch.Tensor, dim: int, rounding: str, dtype: torch.dtype) -> torch.Tensor:
    data, scales = mx.quantize(x, dim=dim, rounding=rounding)
    return mx.dequantize(data, scales, dim=dim).to(dtype)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_values_are_the_reference_cast_dequantized(rounding, dtype):
    """The values a bf16 GEMM reads in place of an MX operand, with the bytes from the same pass.
    Catches values not rounded to the cast (an identity), a cast along the wrong dimension, codes
    and values from different passes, bf16 stores that truncate."""
    x = blocks_of_every_kind(dtype)
    values, (data, scales) = mx_quantized_values(x.to(DEVICE), rounding, keep_codes=True)
    assert values.dtype == dtype
    assert_same_values(values.cpu(), reference_values(x, -1, rounding, dtype))
    want_data, want_scales = mx.quantize(x, dim=-1, rounding=rounding)
    assert torch.equal(scales.cpu(), want_scales)
    assert_same_bits(data.cpu().view(torch.uint8), want_data.view(torch.uint8))
    assert_same_values(mx_quantized_values(x.to(DEVICE), rounding).cpu(), values.cpu())


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_cast_values_in_one_pass(rounding, dtype):
    """A weight's forward and backward operand values from one read (experts stacked: a block
    along N never mixes two experts' rows). Catches the two layouts swapped or transposed."""
    x = blocks_of_every_kind(dtype, seed=5)[:, :96].reshape(2, 32, 96).contiguous()
    along_k, along_n = mx_quantized_values_both(x.to(DEVICE), rounding)
    for ours, dim in ((along_k, -1), (along_n, -2)):
        want = torch.stack([reference_values(e, dim, rounding, dtype) for e in x])
        assert_same_values(ours.cpu(), want)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_along_the_tokens_of_each_group(rounding, dtype):
    """Q_T per expert group (blocks of 32 rows from each group's first, zero-padded), from values
    and from an MX tensor cast along C (dequantized, then cast again). Groups of 5, 0, 70 and 53
    rows: blocks that start mid-group, a group shorter than a block, a partial last tile. Catches
    blocks aligned to the tensor instead of the group, padding read from the next group."""
    x = torch.cat([blocks_of_every_kind(dtype, seed=1), blocks_of_every_kind(dtype, seed=2)])
    sizes = [5, 0, 70, 53]
    offsets = torch.tensor([0, *sizes]).cumsum(0).to(torch.int32).to(DEVICE)
    tiles = row_tile_map(offsets, x.shape[0], GROUP_ROWS)
    codes = mx_quantize(x.to(DEVICE), dim=-1, rounding=rounding)
    from_values = mx_group_rows_values(x.to(DEVICE), tiles, rounding).cpu()
    from_codes = mx_group_rows_values(codes, tiles, rounding, dtype).cpu()
    dequantized = mx.dequantize(codes[0].cpu(), codes[1].cpu(), dim=-1)
    start = 0
    for size in sizes:
        if size:
            rows = slice(start, start + size)
            want = quantized_rows(x[rows], rounding).to(dtype)
            assert_same_values(from_values[rows], want)
            assert_same_values(
                from_codes[rows], quantized_rows(dequantized[rows], rounding).to(dtype)
            )
        start += size
