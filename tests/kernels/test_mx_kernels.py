"""The MXFP8 cast kernel against the reference cast (`mok.reference.mx`, itself bit for bit
torchao's), byte for byte: under the interpreter on the CPU, compiled on the GPU.

Bugs these catch: the e4m3 rounding done by bit arithmetic off at ties, at the normal/subnormal
boundary (2^-6) or for -0 and NaN; an exact-ceiling scale off for subnormal or infinite block
maxima; a NaN in a block not making its scale 255; the FLOOR factor taken from the wrong byte; a
tile's partial rows or columns written; the strided (dim 0) path reading or writing the wrong
layout; packed MX rows with their scales at the wrong offset or the padding in the wrong place.
The dequantization (the A-row source of MX products on Hopper): an e4m3 code decoded wrongly
(subnormals, the sign of zero, NaN), a scale applied to the wrong block, a bf16 rounding off at
ties or for subnormal products.
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
    MXRows,
    mx_dequantize,
    mx_group_casts,
    mx_quantize,
    mx_quantize_both,
    mx_quantize_rows,
    mx_quantized_values,
    mx_quantized_values_both,
)
from mok.reference import mx
from mok.reference.mx_expert import quantized_rows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GROUP_CAST_KERNELS = ["gluon", "tl"] if DEVICE.type == "cuda" else ["auto"]
"""`mx_group_casts`' kernels to hold to the reference: on GPUs the Gluon kernel and its tl twin,
under the interpreter the twin alone."""


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
    values, codes = mx_quantized_values(x.to(DEVICE), rounding, keep_codes=True)
    assert values.dtype == dtype
    assert_same_values(values.cpu(), reference_values(x, -1, rounding, dtype))
    assert_same_rows(codes, x, rounding)
    assert_same_values(mx_quantized_values(x.to(DEVICE), rounding).cpu(), values.cpu())


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_cast_values_in_one_pass(rounding, dtype):
    """A weight's forward and backward operand values from one read (experts stacked: a block
    along N never mixes two experts' rows), or one of them alone. Catches the two layouts
    swapped or transposed, a layout asked for alone left unwritten."""
    x = blocks_of_every_kind(dtype, seed=5)[:, :96].reshape(2, 32, 96).contiguous()
    along_k, along_n = mx_quantized_values_both(x.to(DEVICE), rounding)
    for ours, dim in ((along_k, -1), (along_n, -2)):
        want = torch.stack([reference_values(e, dim, rounding, dtype) for e in x])
        assert_same_values(ours.cpu(), want)
    # One layout alone (a pass that casts what it reads): the same values, the other not made.
    only_k, none = mx_quantized_values_both(x.to(DEVICE), rounding, colwise=False)
    assert none is None
    assert_same_values(only_k.cpu(), along_k.cpu())
    none, only_n = mx_quantized_values_both(x.to(DEVICE), rounding, rowwise=False)
    assert none is None
    assert_same_values(only_n.cpu(), along_n.cpu())


def assert_same_rows(rows: MXRows, x: torch.Tensor, rounding: str) -> None:
    """Packed MX rows hold the reference cast of x along its rows, bytes then scales."""
    want_data, want_scales = mx.quantize(x, dim=-1, rounding=rounding)
    assert rows.shape == tuple(x.shape)
    assert torch.equal(rows.scales.cpu(), want_scales)
    assert_same_bits(rows.codes.cpu().view(torch.uint8), want_data.view(torch.uint8))


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("cols", [32, 224, 256])
def test_packed_rows_hold_the_cast_and_travel_as_rows(rounding, cols):
    """`mx_quantize_rows` from a strided view: each packed row is the reference's bytes, then
    its scales, padded to 16 bytes (32 columns: 33 bytes in a 48-byte row; 256: 264 in 272); as
    bf16 or fp32 rows and back (what the exchange moves) the bytes are unchanged. Catches scales
    stored at the row's start or into the next row, a row length that is not the padded one."""
    x = blocks_of_every_kind(torch.bfloat16, seed=4)[:, :cols]
    rows = mx_quantize_rows(x.to(DEVICE), rounding)
    assert rows.packed.shape == (64, MXRows.row_bytes(cols))
    assert MXRows.row_bytes(cols) % 16 == 0 and MXRows.row_bytes(cols) - cols - cols // 32 < 16
    assert_same_rows(rows, x, rounding)
    for dtype in (torch.bfloat16, torch.float32):
        moved = rows.as_rows(dtype).clone()
        assert torch.equal(MXRows.from_rows(moved, cols).packed, rows.packed)


def test_packed_rows_refuse_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 32"):
        MXRows(torch.zeros(2, 48, dtype=torch.uint8), 40)
    with pytest.raises(ValueError, match="uint8"):
        MXRows(torch.zeros(2, 32, dtype=torch.uint8), 32)


def groups_with_padding(dtype: torch.dtype):
    """(x, group sizes, offsets on the device): groups of 5, 0, 70 and 53 rows starting at row 3,
    3 rows before and 9 after them that are NaN (never read into a group's result)."""
    x = torch.cat([blocks_of_every_kind(dtype, seed=1), blocks_of_every_kind(dtype, seed=2)])
    x = torch.cat([x, x[:12]])  # [140, 256]
    sizes = [5, 0, 70, 53]
    offsets = (torch.tensor([0, *sizes]).cumsum(0) + 3).to(torch.int32)
    x[:3] = float("nan")
    x[int(offsets[-1]) :] = float("nan")
    return x, sizes, offsets.to(DEVICE)


def group_rows(offsets: torch.Tensor, sizes: list[int]):
    start = int(offsets[0])
    for size in sizes:
        yield slice(start, start + size)
        start += size


@pytest.mark.parametrize("kernel", GROUP_CAST_KERNELS)
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_cast_of_the_groups_from_one_pass(rounding, dtype, kernel):
    """`mx_group_casts` from values: along C (values and packed bytes) and Q_T per expert group
    (blocks of 32 rows from each group's first, zero-padded), all from one pass; groups that
    start mid-tensor, one shorter than a block, an empty one, a partial last tile, NaN rows
    outside them. Catches blocks aligned to the tensor instead of the group, padding read from
    the next group or the rows outside the groups, the two casts swapped."""
    x, sizes, offsets = groups_with_padding(dtype)
    tiles = row_tile_map(offsets, x.shape[0], GROUP_ROWS)
    cast = mx_group_casts(
        x.to(DEVICE), tiles, rounding, values=True, codes=True, token_values=True, kernel=kernel
    )
    along_c = reference_values(x, -1, rounding, dtype)
    for rows in group_rows(offsets, sizes):
        if rows.stop > rows.start:
            assert_same_values(cast.values[rows].cpu(), along_c[rows])
            assert_same_rows(cast.codes[rows], x[rows], rounding)
            want = quantized_rows(x[rows], rounding).to(dtype)
            assert_same_values(cast.token_values[rows].cpu(), want)
    inside = slice(int(offsets[0]), int(offsets[-1]))
    # Each output alone and the pairs the layer asks for: the same bits. (Values stored before
    # the bytes in one kernel came out wrong on an H200 with Triton 3.6: this pins the fix.)
    for asks in ({"token_values": True}, {"values": True, "codes": True}, {"codes": True}):
        alone = mx_group_casts(x.to(DEVICE), tiles, rounding, **asks, kernel=kernel)
        for name in ("values", "token_values"):
            got = getattr(alone, name)
            assert (got is None) == (name not in asks)
            if got is not None:
                assert_same_values(got[inside].cpu(), getattr(cast, name)[inside].cpu())
        if alone.codes is not None:
            ours, theirs = alone.codes[inside], cast.codes[inside]
            assert torch.equal(ours.codes.view(torch.uint8), theirs.codes.view(torch.uint8))
            assert torch.equal(ours.scales, theirs.scales)


@pytest.mark.parametrize("kernel", GROUP_CAST_KERNELS)
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_casts_of_packed_rows(rounding, dtype, kernel):
    """`mx_group_casts` of `MXRows` (x and h as the layer saves them): the values along C are
    the dequantized bytes, Q_T casts those values again. Catches scales read from the wrong
    offset of a packed row, a second cast skipped."""
    x, sizes, offsets = groups_with_padding(dtype)
    tiles = row_tile_map(offsets, x.shape[0], GROUP_ROWS)
    packed = mx_quantize_rows(x.to(DEVICE), rounding)
    cast = mx_group_casts(
        packed, tiles, rounding, values=True, token_values=True, dtype=dtype, kernel=kernel
    )
    dequantized = mx.dequantize(*mx.quantize(x, dim=-1, rounding=rounding), dim=-1)
    for rows in group_rows(offsets, sizes):
        if rows.stop > rows.start:
            assert_same_values(cast.values[rows].cpu(), dequantized[rows].to(dtype))
            want = quantized_rows(dequantized[rows], rounding).to(dtype)
            assert_same_values(cast.token_values[rows].cpu(), want)
    with pytest.raises(ValueError, match="dtype"):
        mx_group_casts(packed, tiles, rounding, values=True)


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [224, 2048])
def test_gluon_group_casts_equal_their_tl_twin(cols):
    """The Gluon kernel of `mx_group_casts` against its tl twin, bit for bit, in every use the
    MXFP8 layer makes of it, on random rows with a few special values, ragged groups (one of 7
    rows, an empty one, a long one) and column counts that end in a partial column tile of
    both kernels (7 blocks) or fill many (64). Catches a block's reduction over the wrong lanes,
    a column tile's blocks misnumbered, scales stored beside the wrong row, a mask that lets a
    partial tile write past C or past the group."""
    generator = torch.Generator().manual_seed(cols)
    sizes = [7, 0, 300, 65, 131]
    m = sum(sizes) + 20
    x = torch.randn(m, cols, generator=generator) * torch.logspace(-30, 30, cols, base=2.0)
    x[5, 3], x[100, 200 % cols], x[250, 31] = float("nan"), float("inf"), 0.0
    x = x.bfloat16().to(DEVICE)
    offsets = (torch.tensor([0, *sizes]).cumsum(0) + 9).to(torch.int32).to(DEVICE)
    tiles = row_tile_map(offsets, m, GROUP_ROWS)
    packed = mx_quantize_rows(x)
    inside = slice(int(offsets[0]), int(offsets[-1]))
    for rounding in ("rceil", "floor"):
        for a, asks in (
            (x, {"values": True, "token_values": True}),
            (x, {"values": True, "codes": True}),
            (x, {"codes": True}),
            (x.float(), {"values": True, "token_values": True}),
            (packed, {"values": True, "dtype": torch.bfloat16}),
            (packed, {"token_values": True, "dtype": torch.bfloat16}),
        ):
            gluon = mx_group_casts(a, tiles, rounding, **asks, kernel="gluon")
            twin = mx_group_casts(a, tiles, rounding, **asks, kernel="tl")
            for name in ("values", "token_values"):
                if getattr(twin, name) is not None:
                    ours, theirs = getattr(gluon, name)[inside], getattr(twin, name)[inside]
                    assert_same_values(ours.cpu(), theirs.cpu())
            if twin.codes is not None:
                ours, theirs = gluon.codes[inside], twin.codes[inside]
                assert torch.equal(ours.codes.view(torch.uint8), theirs.codes.view(torch.uint8))
                assert torch.equal(ours.scales, theirs.scales)


def test_group_casts_name_their_kernel():
    """A misspelt kernel, or the Gluon kernel where it cannot run, is a clear error."""
    x, sizes, offsets = groups_with_padding(torch.bfloat16)
    tiles = row_tile_map(offsets, x.shape[0], GROUP_ROWS)
    with pytest.raises(ValueError, match="'auto', 'tl' or 'gluon'"):
        mx_group_casts(x.to(DEVICE), tiles, values=True, kernel="triton")
    if DEVICE.type != "cuda":
        with pytest.raises(ValueError, match="Gluon cast kernel needs"):
            mx_group_casts(x, tiles, values=True, kernel="gluon")
