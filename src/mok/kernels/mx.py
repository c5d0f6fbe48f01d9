"""The MXFP8 cast as Triton tile functions and a kernel: `mok.reference.mx.quantize`, bit for bit.

The tile functions take an fp32 tile whose last dimension is cut into 32-element blocks and return
its e4m3 bytes and e8m0 scale bytes; they are meant for epilogues too (a GEMM that quantizes its
output). The scales are integer or exact fp32 arithmetic (no log2, no division). The e4m3
rounding and decoding (`e4m3_bytes`, `e4m3_values`) use the GPU's conversions on GPUs (a few
instructions instead of a dozen per element: the casts are ALU-bound otherwise) and integer
arithmetic under the interpreter, whose fp8 conversions round wrongly; the GPU tests hold the
first to the reference bit for bit, the CPU tests the second.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from mok.kernels._triton_compat import interpreting, patch_interpreter
from mok.kernels.formats import PackedRows, mx_row_bytes
from mok.kernels.host import GemmTiles, RowTiles, num_programs
from mok.kernels.launch import fast_launch
from mok.reference.mx import BLOCK, ScaleRounding

if interpreting():
    patch_interpreter()

HARDWARE_FP8 = tl.constexpr(not interpreting())
"""Decode e4m3 with the GPU's conversion; the interpreter's rounds wrongly, so there integers."""


@dataclasses.dataclass(frozen=True)
class MXRows(PackedRows):
    """An MXFP8 tensor [N, C] cast along its rows (blocks of 32 columns), packed (`PackedRows`):
    its C e4m3 bytes, then its C / 32 e8m0 scale bytes, at (C + C / 32) / 2C = 0.52x the bytes of
    a bf16 row; a kernel finds a row's scales `cols` bytes into it."""

    COLUMNS = BLOCK

    @staticmethod
    def row_bytes(cols: int) -> int:
        """Bytes of one packed row of `cols` columns."""
        return mx_row_bytes(cols)

    @property
    def scales(self) -> torch.Tensor:
        """[N, C / 32] uint8 e8m0 scale bytes (a strided view)."""
        return self.packed[:, self.cols : self.cols + self.cols // BLOCK]

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.cols

    def __getitem__(self, rows: slice) -> MXRows:
        """A slice of the rows (a view)."""
        if not isinstance(rows, slice):
            raise TypeError("MXRows are indexed by a slice of rows")
        return MXRows(self.packed[rows], self.cols)


@triton.jit
def _exponent_field(values):
    """Biased exponent bits of fp32 values (0 for zeros and subnormals), int32."""
    return (values.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def _power_of_two(exponent):
    """2^exponent as fp32 for exponent in [-127, 127] (2^-127 is subnormal), exactly."""
    normal = (exponent + 127).to(tl.int32) << 23
    bits = tl.where(exponent == -127, 0x400000, normal)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mx_scale_bytes(amax, has_nan, RCEIL: tl.constexpr):
    """e8m0 scale bytes (int32) of blocks with largest magnitude amax (fp32) and whether they hold
    a NaN, and the fp32 factor their elements are multiplied by before the e4m3 rounding (the
    rules are in `mok.reference.mx`)."""
    if RCEIL:
        descale = tl.math.div_rn(amax, 448.0)  # IEEE division: `/` is approximate on GPUs
        field = _exponent_field(descale)
        mantissa = descale.to(tl.int32, bitcast=True) & 0x7FFFFF
        # ceil(log2(descale)), exactly; a subnormal above 2^-127 has ceiling -126.
        ceiling = tl.where(field > 0, field - 127 + (mantissa != 0).to(tl.int32), -127)
        ceiling = tl.where((field == 0) & (mantissa > 0x400000), -126, ceiling)
        byte = tl.minimum(tl.maximum(ceiling, -127), 127) + 127
        byte = tl.where(field == 0xFF, 254, byte)  # an infinite amax
        byte = tl.where(has_nan, 255, byte)
        factor = _power_of_two(127 - tl.minimum(tl.maximum(byte, 1), 254))
        factor = tl.where(byte == 0, 1.0, factor)
        factor = tl.where(byte == 255, float("nan"), factor)
    else:
        unbiased = _exponent_field(amax) - 127 - 8
        byte = tl.minimum(tl.maximum(unbiased, -127), 128) + 127
        byte = tl.where(has_nan, 255, byte)
        # Multiplying by 2^-k is torchao's division by 2^k exactly (the divisor at least 2^-126;
        # for a NaN block, by infinity: 0, or NaN for the NaN and infinite elements).
        factor = _power_of_two(127 - tl.minimum(tl.maximum(byte, 1), 254))
        factor = tl.where(byte == 255, 0.0, factor)
    return byte, factor


@triton.jit
def e4m3_bytes(values):
    """e4m3fn bytes (int32) of fp32 values in [-448, 448] or NaN: round to nearest, ties to even;
    NaN to 0x7F with its sign; -0 to 0x80. On GPUs by the hardware conversion (round to nearest
    even, the same bytes), under the interpreter by integer arithmetic."""
    if HARDWARE_FP8:
        return values.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    bits = values.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    is_nan = values != values
    magnitude = tl.where(is_nan, 0.0, tl.abs(values))
    mbits = magnitude.to(tl.int32, bitcast=True)
    # Normal e4m3 (>= 2^-6): round the fp32 mantissa to 3 bits in place (ties to even), then
    # rebias the exponent from 127 to 7.
    rounded = (mbits + 0x7FFFF + ((mbits >> 20) & 1)) >> 20
    normal = rounded - ((127 - 7) << 3)
    # Subnormal e4m3 (m x 2^-9, m < 8; m = 8 is 2^-6, the smallest normal, byte 8): adding 2^23
    # rounds to an integer, ties to even, in fp32.
    subnormal = ((magnitude * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(magnitude >= 0.015625, normal, subnormal)
    code = tl.where(is_nan, 0x7F, code)
    return sign | code


@triton.jit
def e4m3_saturated_bytes(scaled):
    """`e4m3_bytes` of fp32 values clamped to [-448, 448] first, NaN kept: a scaled block's
    codes (under FLOOR's scale a block's largest magnitudes reach up to 512)."""
    clamped = tl.minimum(
        tl.maximum(scaled, -448.0, tl.PropagateNan.ALL), 448.0, tl.PropagateNan.ALL
    )
    return e4m3_bytes(clamped)


@triton.jit
def _block_amax(blocks, axis: tl.constexpr):
    """(largest magnitude, whether any element is NaN) of fp32 blocks along `axis`, from one
    integer reduction: |x|'s bits order as |x| does, and every NaN's lie above infinity's."""
    magnitude_bits = blocks.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax_bits = tl.max(magnitude_bits, axis=axis)
    return amax_bits.to(tl.float32, bitcast=True), amax_bits > 0x7F800000


@triton.jit
def mx_quantize_tile(tile, ROWS: tl.constexpr, COLS: tl.constexpr, RCEIL: tl.constexpr):
    """(e4m3 bytes [ROWS, COLS], scale bytes [ROWS, COLS // 32]) of an fp32 tile, blocks of 32
    along its columns."""
    blocks = tile.reshape(ROWS, COLS // 32, 32)
    amax, has_nan = _block_amax(blocks, 2)
    byte, factor = mx_scale_bytes(amax, has_nan, RCEIL)
    scaled = blocks * factor[:, :, None]
    return e4m3_saturated_bytes(scaled).reshape(ROWS, COLS), byte


@triton.jit
def mx_quantize_columns(tile, ROWS: tl.constexpr, COLS: tl.constexpr, RCEIL: tl.constexpr):
    """`mx_quantize_tile` for blocks of 32 along the rows: (e4m3 bytes [ROWS, COLS], scale
    bytes [ROWS // 32, COLS]), without a transpose."""
    blocks = tile.reshape(ROWS // 32, 32, COLS)
    amax, has_nan = _block_amax(blocks, 1)
    byte, factor = mx_scale_bytes(amax, has_nan, RCEIL)
    scaled = blocks * factor[:, None, :]
    return e4m3_saturated_bytes(scaled).reshape(ROWS, COLS), byte


@triton.jit
def e4m3_values(codes):
    """fp32 values of e4m3fn bytes (any integer type, values in [0, 256)): sign, 4 exponent bits
    (bias 7), 3 mantissa bits; exponent 0 is m x 2^-9; 0x7F and 0xFF are NaN. On GPUs by the
    hardware conversion, under the interpreter (whose fp8 conversion rounds wrongly) by integer
    arithmetic; both exact."""
    if HARDWARE_FP8:
        return codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    codes = codes.to(tl.int32)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    magnitude = tl.where(exponent == 0, 0, normal).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, magnitude)
    magnitude = tl.where((exponent == 15) & (mantissa == 7), float("nan"), magnitude)
    # The sign by its bit: Triton 3.6's interpreter negates as 0 - x, which turns -0 into +0.
    sign = (codes & 0x80) << 24
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def mx_quantize_along(tile, AXIS: tl.constexpr, RCEIL: tl.constexpr):
    """(e4m3 bytes of tile's shape, scale bytes of its shape without AXIS) of an fp32 tile whose
    AXIS is one block of 32: each line along AXIS cast as one MX block. No reshape, so that a
    caller's layout (a Gluon one too) decides which threads a block's reduction crosses."""
    amax, has_nan = _block_amax(tile, AXIS)
    byte, factor = mx_scale_bytes(amax, has_nan, RCEIL)
    return e4m3_saturated_bytes(tile * tl.expand_dims(factor, AXIS)), byte


@triton.jit
def mx_dequantize_along(codes, scale_bytes, AXIS: tl.constexpr):
    """The fp32 values of `mx_quantize_along`'s (codes, scale bytes) along AXIS."""
    return e4m3_values(codes) * tl.expand_dims(mx_scale_factor(scale_bytes), AXIS)


@triton.jit
def mx_scale_factor(scale_bytes):
    """2^(scale - 127) of e8m0 scale bytes (int32), NaN for 255: what a block's e4m3 values are
    multiplied by."""
    factor = _power_of_two(tl.minimum(scale_bytes, 254) - 127)
    return tl.where(scale_bytes == 255, float("nan"), factor)


@triton.jit
def mx_dequantize_tile(codes, scale_bytes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The fp32 tile [ROWS, COLS] of e4m3 bytes `codes` (int32) x 2^(scale - 127) per block of 32
    along the columns (scale_bytes [ROWS, COLS // 32], int32; 255 is NaN): what an MX operand is
    before a bf16 MMA. Exact, and exactly representable in bf16 whenever the product is normal
    (`docs/mxfp8.md`), so rounding it to bf16 changes nothing there."""
    values = e4m3_values(codes).reshape(ROWS, COLS // 32, 32)
    return (values * mx_scale_factor(scale_bytes)[:, :, None]).reshape(ROWS, COLS)


@triton.jit
def mx_dequantize_columns(codes, scale_bytes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """`mx_dequantize_tile` for blocks of 32 along the rows: codes [ROWS, COLS], scale_bytes
    [ROWS // 32, COLS] (an operand quantized along its first dimension)."""
    values = e4m3_values(codes).reshape(ROWS // 32, 32, COLS)
    return (values * mx_scale_factor(scale_bytes)[:, None, :]).reshape(ROWS, COLS)


@triton.jit
def bf16_rounded(values):
    """fp32 values rounded to bf16 precision (nearest, ties to even), still fp32: by integer
    arithmetic, so that the interpreter (whose bf16 casts flush subnormals) rounds as GPUs do."""
    bits = values.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    rounded = tl.where(values != values, bits | 0x400000, rounded)  # NaN: quiet, in the top bits
    return rounded.to(tl.float32, bitcast=True)


def _cast_tile(
    device: torch.device, interpreted: tuple[int, int], gpu: tuple[int, int] = (32, 256)
) -> tuple[int, int]:
    """(rows, columns) of one program's tile in the cast kernels: small under the interpreter
    (partial tiles in small tests), the caller's swept tile on GPUs (measured:
    benchmarks/results/2026-12-02-issue14-mxfp8-h200.md, "Cast kernels by tile")."""
    return gpu if device.type == "cuda" else interpreted


@fast_launch
@triton.jit
def _mx_dequantize_kernel(
    data_ptr,  # uint8 [rows, cols], contiguous
    scales_ptr,  # uint8 [rows, cols // 32], contiguous
    out_ptr,  # [rows, cols], contiguous: fp32, or bf16 bit patterns (int16) when BF16_BITS
    rows,
    cols,
    BF16_BITS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """Grid: (cdiv(rows, BLOCK_ROWS), cdiv(cols, BLOCK_COLS)); cols a multiple of 32."""
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    offsets = r.to(tl.int64)[:, None] * cols + c[None, :]
    codes = tl.load(data_ptr + offsets, mask=mask, other=0).to(tl.int32)
    s = tl.program_id(1) * (BLOCK_COLS // 32) + tl.arange(0, BLOCK_COLS // 32)
    scale_mask = (r < rows)[:, None] & (s < cols // 32)[None, :]
    scale_offsets = r.to(tl.int64)[:, None] * (cols // 32) + s[None, :]
    scale_bytes = tl.load(scales_ptr + scale_offsets, mask=scale_mask, other=127).to(tl.int32)
    values = mx_dequantize_tile(codes, scale_bytes, BLOCK_ROWS, BLOCK_COLS)
    if BF16_BITS:
        bits = bf16_rounded(values).to(tl.int32, bitcast=True) >> 16
        tl.store(out_ptr + offsets, bits.to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offsets, values, mask=mask)


def mx_dequantize(
    data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`mok.reference.mx.dequantize` on the device for blocks along the last dimension: data
    [rows, cols] float8_e4m3fn and scales [rows, cols // 32] uint8 (both contiguous) -> [rows,
    cols] of `dtype` (fp32 or bf16): the inverse of `mx_quantize`, and the test kernel of
    `mx_dequantize_tile` (every e4m3 code at every kind of scale)."""
    if data.dim() != 2 or data.dtype != torch.float8_e4m3fn or data.shape[1] % BLOCK:
        raise ValueError(
            f"mx_dequantize: data must be [rows, cols] float8_e4m3fn with cols a multiple of "
            f"{BLOCK}, got {tuple(data.shape)} {data.dtype}"
        )
    rows, cols = data.shape
    if tuple(scales.shape) != (rows, cols // BLOCK) or scales.dtype != torch.uint8:
        raise ValueError(
            f"mx_dequantize: scales must be [{rows}, {cols // BLOCK}] uint8, got "
            f"{tuple(scales.shape)} {scales.dtype}"
        )
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"mx_dequantize: dtype must be float32 or bfloat16, got {dtype}")
    out = torch.empty(rows, cols, dtype=dtype, device=data.device)
    if data.numel():
        block_rows, block_cols = _cast_tile(data.device, (16, 128))
        grid = (triton.cdiv(rows, block_rows), triton.cdiv(cols, block_cols))
        bf16 = dtype == torch.bfloat16
        _mx_dequantize_kernel[grid](
            data.contiguous().view(torch.uint8),
            scales.contiguous(),
            out.view(torch.int16) if bf16 else out,
            rows,
            cols,
            BF16_BITS=bf16,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
        )
    return out


@triton.jit
def _load_fp32(pointers, mask, BF16_BITS: tl.constexpr):
    """A tile as fp32; BF16_BITS: the pointers hold bf16 bit patterns (int16), widened here
    exactly (the interpreter's own bf16 conversion flushes subnormals)."""
    if BF16_BITS:
        raw = tl.load(pointers, mask=mask, other=0).to(tl.int32)
        return (raw << 16).to(tl.float32, bitcast=True)
    return tl.load(pointers, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_row_scales(scales_ptr, scales, r, rows, cols, stride_row, BLOCK_COLS: tl.constexpr):
    """Store a tile's scale bytes [len(r), BLOCK_COLS // 32] (blocks along cols) into the
    [rows, cols // 32] scales (rows stride_row bytes apart), at the program's column tile."""
    s = tl.program_id(1) * (BLOCK_COLS // 32) + tl.arange(0, BLOCK_COLS // 32)
    scale_mask = (r < rows)[:, None] & (s < cols // 32)[None, :]
    scale_offsets = r.to(tl.int64)[:, None] * stride_row + s[None, :]
    tl.store(scales_ptr + scale_offsets, scales.to(tl.uint8), mask=scale_mask)


@triton.jit
def _store_values(ptr, offsets, values, mask, BF16_BITS: tl.constexpr):
    """Store fp32 values that bf16 represents exactly (dequantized MX values) into fp32 storage,
    or as bf16 bit patterns (int16) when BF16_BITS (exact on the interpreter too)."""
    if BF16_BITS:
        bits = bf16_rounded(values).to(tl.int32, bitcast=True) >> 16
        tl.store(ptr + offsets, bits.to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offsets, values, mask=mask)


@fast_launch
@triton.jit
def _mx_quantize_kernel(
    x_ptr,
    data_ptr,  # uint8 [rows, cols], rows data_stride_row apart (STORE_CODES)
    scales_ptr,  # uint8 [rows, cols // 32], rows scales_stride_row apart (STORE_CODES)
    values_ptr,  # [rows, cols] contiguous (STORE_VALUES): the cast's values, fp32 or bf16 bits
    rows,
    cols,
    stride_row,
    stride_col,
    data_stride_row,
    data_stride_col,
    scales_stride_row,
    RCEIL: tl.constexpr,
    BF16_BITS: tl.constexpr,
    STORE_CODES: tl.constexpr,
    STORE_VALUES: tl.constexpr,
    VALUES_BF16_BITS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """Grid: (cdiv(rows, BLOCK_ROWS), cdiv(cols, BLOCK_COLS)). Quantizes x [rows, cols] (any
    strides; cols a multiple of 32) along cols; stores the e4m3 bytes and scales, the values
    they represent (dequantized), or both. BF16_BITS: x holds bf16 bit patterns (int16), widened
    here to fp32 exactly (the interpreter's own bf16 conversion flushes subnormals)."""
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    offsets = r.to(tl.int64)[:, None] * stride_row + c[None, :] * stride_col
    tile = _load_fp32(x_ptr + offsets, mask, BF16_BITS)
    data, scales = mx_quantize_tile(tile, BLOCK_ROWS, BLOCK_COLS, RCEIL)
    if STORE_CODES:
        data_offsets = r.to(tl.int64)[:, None] * data_stride_row + c[None, :] * data_stride_col
        tl.store(data_ptr + data_offsets, data.to(tl.uint8), mask=mask)
        _store_row_scales(scales_ptr, scales, r, rows, cols, scales_stride_row, BLOCK_COLS)
    if STORE_VALUES:
        values = mx_dequantize_tile(data, scales, BLOCK_ROWS, BLOCK_COLS)
        value_offsets = r.to(tl.int64)[:, None] * cols + c[None, :]
        _store_values(values_ptr, value_offsets, values, mask, VALUES_BF16_BITS)


def _check_cast(x: torch.Tensor, dim: int) -> int:
    if x.dim() != 2:
        raise ValueError(f"the MXFP8 cast takes a 2-D tensor, got shape {tuple(x.shape)}")
    dim = dim % 2
    if x.shape[dim] % BLOCK:
        raise ValueError(
            f"MXFP8 needs the quantized dimension ({dim}, size {x.shape[dim]}) to be a multiple "
            f"of {BLOCK}"
        )
    return dim


def _values_arg(values: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the kernel's view of a values output, whether it takes bf16 bit patterns)."""
    if values.dtype == torch.bfloat16:
        return values.view(torch.int16), True
    if values.dtype != torch.float32:
        raise ValueError(f"MX values are stored as float32 or bfloat16, not {values.dtype}")
    return values, False


def _launch_row_cast(view, rounding, data=None, scales=None, values=None) -> None:
    """Cast view [rows, cols] (any strides) along cols into the bytes `data` [rows, cols] and
    `scales` [rows, cols // 32] (any row strides), the contiguous `values`, or both."""
    rows, cols = view.shape
    if not view.numel():
        return
    block_rows, block_cols = _cast_tile(view.device, (16, 128), (16, 512))
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(cols, block_cols))
    bf16 = view.dtype == torch.bfloat16
    values_arg, values_bits = (scales, False) if values is None else _values_arg(values)
    codes = data if data is not None else values_arg
    scales = scales if scales is not None else values_arg
    _mx_quantize_kernel[grid](
        view.view(torch.int16) if bf16 else view,
        codes,
        scales,
        values_arg,
        rows,
        cols,
        view.stride(0),
        view.stride(1),
        codes.stride(0),
        codes.stride(1),
        scales.stride(0),
        RCEIL=ScaleRounding(rounding) is ScaleRounding.RCEIL,
        BF16_BITS=bf16,
        STORE_CODES=data is not None,
        STORE_VALUES=values is not None,
        VALUES_BF16_BITS=values_bits,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
    )


def mx_quantized_values(
    x: torch.Tensor,
    rounding: ScaleRounding | str = ScaleRounding.RCEIL,
    keep_codes: bool = False,
):
    """The values of x's MXFP8 cast along its last dimension, `mok.reference.mx` quantize then
    dequantize, as a contiguous tensor of x's dtype (exact: every MX value is a bf16 value): the
    operand a bf16 GEMM reads to compute the MX product exactly. x: 2-D bf16 or fp32, the last
    dimension a multiple of 32. keep_codes: return (values, the cast's `MXRows`) from the same
    pass."""
    _check_cast(x, -1)
    rows, cols = x.shape
    values = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    if not keep_codes:
        _launch_row_cast(x, rounding, values=values)
        return values
    codes = MXRows.empty(rows, cols, x.device)
    _launch_row_cast(x, rounding, codes.codes.view(torch.uint8), codes.scales, values)
    return values, codes


def mx_quantize_rows(
    x: torch.Tensor, rounding: ScaleRounding | str = ScaleRounding.RCEIL
) -> MXRows:
    """x [N, C] (bf16 or fp32, any strides, C a multiple of 32) cast along its rows into packed
    `MXRows`: the bytes of `mok.reference.mx.quantize(x, dim=-1)` one row at a time (what the
    MXFP8 layer dispatches and saves). The padding bytes are left as they are."""
    _check_cast(x, -1)
    out = MXRows.empty(*x.shape, x.device)
    _launch_row_cast(x, rounding, out.codes.view(torch.uint8), out.scales)
    return out


def mx_quantize(
    x: torch.Tensor, dim: int = -1, rounding: ScaleRounding | str = ScaleRounding.RCEIL
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mok.reference.mx.quantize` on the device: (data float8_e4m3fn of x's shape, contiguous;
    scales uint8 of x's shape with `dim` divided by 32) of a 2-D x (bf16 or fp32)."""
    dim = _check_cast(x, dim)
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    view, out = (x, data) if dim == 1 else (x.T, data.T)
    rows, cols = view.shape
    scales = torch.empty(rows, cols // BLOCK, dtype=torch.uint8, device=x.device)
    _launch_row_cast(view, rounding, out, scales)
    return data.view(torch.float8_e4m3fn), scales if dim == 1 else scales.T


@fast_launch
@triton.jit
def _mx_quantize_both_kernel(
    x_ptr,  # [rows, cols] contiguous (bf16 bit patterns as int16 when BF16_BITS)
    rowwise_ptr,  # [rows, cols]: blocks of 32 along cols (uint8 codes, or VALUES)
    rowwise_scales_ptr,  # uint8 [rows, cols // 32] (not VALUES)
    colwise_ptr,  # [rows, cols]: blocks of 32 along rows (uint8 codes, or VALUES)
    colwise_scales_ptr,  # uint8 [rows // 32, cols] (not VALUES)
    rows,
    cols,
    RCEIL: tl.constexpr,
    BF16_BITS: tl.constexpr,
    VALUES: tl.constexpr,
    VALUES_BF16_BITS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    ROWWISE: tl.constexpr = True,
    COLWISE: tl.constexpr = True,
):
    """Grid: (rows // BLOCK_ROWS, cdiv(cols, BLOCK_COLS)). Both MXFP8 casts of x from one read of
    each tile (or the one of ROWWISE, COLWISE asked for): along cols (a weight's reduction
    dimension in forward) and along rows (its reduction dimension in backward), as e4m3 bytes
    and scales or, with VALUES, as the values they represent (fp32, or bf16 bits when
    VALUES_BF16_BITS). rows a multiple of BLOCK_ROWS, cols of 32."""
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    offsets = r.to(tl.int64)[:, None] * cols + c[None, :]
    tile = _load_fp32(x_ptr + offsets, mask, BF16_BITS)

    if ROWWISE:
        data, scales = mx_quantize_tile(tile, BLOCK_ROWS, BLOCK_COLS, RCEIL)
        if VALUES:
            values = mx_dequantize_tile(data, scales, BLOCK_ROWS, BLOCK_COLS)
            _store_values(rowwise_ptr, offsets, values, mask, VALUES_BF16_BITS)
        else:
            tl.store(rowwise_ptr + offsets, data.to(tl.uint8), mask=mask)
            _store_row_scales(rowwise_scales_ptr, scales, r, rows, cols, cols // 32, BLOCK_COLS)

    if COLWISE:
        data_t, scales_t = mx_quantize_columns(tile, BLOCK_ROWS, BLOCK_COLS, RCEIL)
        if VALUES:
            values_t = mx_dequantize_columns(data_t, scales_t, BLOCK_ROWS, BLOCK_COLS)
            _store_values(colwise_ptr, offsets, values_t, mask, VALUES_BF16_BITS)
        else:
            tl.store(colwise_ptr + offsets, data_t.to(tl.uint8), mask=mask)
            b = tl.program_id(0) * (BLOCK_ROWS // 32) + tl.arange(0, BLOCK_ROWS // 32)
            block_mask = (b < rows // 32)[:, None] & (c < cols)[None, :]
            block_offsets = b.to(tl.int64)[:, None] * cols + c[None, :]
            tl.store(colwise_scales_ptr + block_offsets, scales_t.to(tl.uint8), mask=block_mask)


def _check_both(x: torch.Tensor) -> None:
    if x.dim() < 2 or not x.is_contiguous():
        raise ValueError(
            f"the MXFP8 cast along both dimensions takes a contiguous tensor of >= 2 dimensions, "
            f"got shape {tuple(x.shape)}"
        )
    if x.shape[-1] % BLOCK or x.shape[-2] % BLOCK:
        raise ValueError(
            f"MXFP8 along both of the last two dimensions needs them to be multiples of {BLOCK}, "
            f"got {tuple(x.shape[-2:])}"
        )


def _launch_both(
    x, rowwise, rowwise_scales, colwise, colwise_scales, rounding, values, layouts=(True, True)
) -> None:
    cols = x.shape[-1]
    flat = x.reshape(-1, cols)
    rows = flat.shape[0]
    if not x.numel():
        return
    block_rows, block_cols = _cast_tile(x.device, (32, 64), (32, 128))
    grid = (rows // block_rows, triton.cdiv(cols, block_cols))
    bf16 = x.dtype == torch.bfloat16
    values_bits = False
    if values:
        rowwise, values_bits = _values_arg(rowwise)
        colwise, _ = _values_arg(colwise)
    _mx_quantize_both_kernel[grid](
        flat.view(torch.int16) if bf16 else flat,
        rowwise,
        rowwise_scales,
        colwise,
        colwise_scales,
        rows,
        cols,
        RCEIL=ScaleRounding(rounding) is ScaleRounding.RCEIL,
        BF16_BITS=bf16,
        VALUES=values,
        VALUES_BF16_BITS=values_bits,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        ROWWISE=layouts[0],
        COLWISE=layouts[1],
    )


def mx_quantize_both(
    x: torch.Tensor, rounding: ScaleRounding | str = ScaleRounding.RCEIL
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Both casts of `mx_quantize` from one pass over x: ((data, scales) along the last dimension,
    (data, scales) along the one before), each bit for bit `mok.reference.mx.quantize` of x along
    that dimension. x: contiguous bf16 or fp32, [..., R, C] with R and C multiples of 32; leading
    dimensions (experts) are batched, so a block never mixes two experts' rows."""
    _check_both(x)
    *lead, rows_per, cols = x.shape
    rowwise = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    colwise = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    rowwise_scales = torch.empty(*lead, rows_per, cols // BLOCK, dtype=torch.uint8, device=x.device)
    colwise_scales = torch.empty(*lead, rows_per // BLOCK, cols, dtype=torch.uint8, device=x.device)
    _launch_both(x, rowwise, rowwise_scales, colwise, colwise_scales, rounding, values=False)
    fp8 = torch.float8_e4m3fn
    return (rowwise.view(fp8), rowwise_scales), (colwise.view(fp8), colwise_scales)


def mx_quantized_values_both(
    x: torch.Tensor,
    rounding: ScaleRounding | str = ScaleRounding.RCEIL,
    rowwise: bool = True,
    colwise: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(values of x's MXFP8 cast along its last dimension, along the one before), each of x's
    shape and dtype, from one pass over x: what a weight is to the bf16 GEMMs of the forward and
    of the data gradients; rowwise or colwise False: that cast is not made (None). x as in
    `mx_quantize_both`."""
    _check_both(x)
    along_last = torch.empty_like(x) if rowwise else None
    along_previous = torch.empty_like(x) if colwise else None
    # A cast not asked for is never stored: x stands in for its output.
    _launch_both(
        x,
        x if along_last is None else along_last,
        x,
        x if along_previous is None else along_previous,
        x,
        rounding,
        values=True,
        layouts=(rowwise, colwise),
    )
    return along_last, along_previous


@fast_launch
@triton.jit(do_not_specialize=["capacity"])
def _mx_group_cast_kernel(
    a_ptr,  # [M, C], rows a_stride elements apart: values (bf16 bits as int16 when BF16_BITS)
    #         or, MX_IN, packed MX rows (uint8: C e4m3 bytes, then C // 32 scale bytes)
    a_stride,
    values_ptr,  # VALUES: [M, C] contiguous, the values of the cast along C
    codes_ptr,  # CODES: packed MX rows (uint8) of that cast, rows codes_stride bytes apart
    codes_stride,
    tokens_ptr,  # TOKENS: [M, C] contiguous, the values of the cast along the group's rows
    table_ptr,  # RowTiles of BLOCK_ROWS rows
    counts_ptr,
    capacity,
    cols,
    RCEIL: tl.constexpr,
    BF16_BITS: tl.constexpr,
    MX_IN: tl.constexpr,
    VALUES: tl.constexpr,
    CODES: tl.constexpr,
    TOKENS: tl.constexpr,
    OUT_BF16_BITS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS. Every row tile of the groups (BLOCK_ROWS rows from a group's first or
    further on by whole tiles, BLOCK_ROWS a multiple of 32; rows past the group read as zeros)
    and column tile of a, read once: its MXFP8 cast along C as values and/or packed bytes (of an
    MX_IN a: its values, the cast being exact), and its cast along the rows in blocks of 32 from
    the group's first (TOKENS; of an MX_IN a, a second cast of its values). Values are stored as
    fp32, or as bf16 bits when OUT_BF16_BITS (exact either way). Rows outside the groups are
    never touched."""
    c_tiles = tl.cdiv(cols, BLOCK_COLS)
    num_tasks = tl.load(counts_ptr) * c_tiles
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS):
        row = tl.load(table_ptr + capacity + task // c_tiles)
        row_end = tl.load(table_ptr + 2 * capacity + task // c_tiles)
        c = task % c_tiles * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        s = task % c_tiles * (BLOCK_COLS // 32) + tl.arange(0, BLOCK_COLS // 32)
        # One MX block of rows at a time: a block's reduction along the tokens is then a whole
        # axis of the tile, with no reshape along the rows.
        for block in tl.static_range(BLOCK_ROWS // 32):
            r = row + block * 32 + tl.arange(0, 32)
            rows = r.to(tl.int64)[:, None]
            mask = (r < row_end)[:, None] & (c < cols)[None, :]
            s_mask = (r < row_end)[:, None] & (s < cols // 32)[None, :]
            if MX_IN:
                data = tl.load(a_ptr + rows * a_stride + c[None, :], mask=mask, other=0)
                scales_at = a_ptr + rows * a_stride + cols + s[None, :]
                scales = tl.load(scales_at, mask=s_mask, other=127).to(tl.int32)
                tile = mx_dequantize_tile(data.to(tl.int32), scales, 32, BLOCK_COLS)
            else:
                tile = _load_fp32(a_ptr + rows * a_stride + c[None, :], mask, BF16_BITS)
                if VALUES or CODES:
                    data, scales = mx_quantize_tile(tile, 32, BLOCK_COLS, RCEIL)
            dense = rows * cols + c[None, :]
            # The bytes are stored before the values: the other order miscompiles with Triton
            # 3.6 on sm_90 (wrong values on an H200, bytes right; docs/notes/mxfp8-casts.md).
            if CODES:
                tl.store(codes_ptr + rows * codes_stride + c[None, :], data.to(tl.uint8), mask=mask)
                scales_to = codes_ptr + rows * codes_stride + cols + s[None, :]
                tl.store(scales_to, scales.to(tl.uint8), mask=s_mask)
            if VALUES:
                if MX_IN:
                    _store_values(values_ptr, dense, tile, mask, OUT_BF16_BITS)
                else:
                    values = mx_dequantize_tile(data, scales, 32, BLOCK_COLS)
                    _store_values(values_ptr, dense, values, mask, OUT_BF16_BITS)
            if TOKENS:
                data_t, scales_t = mx_quantize_along(tile, 0, RCEIL)
                values_t = mx_dequantize_along(data_t, scales_t, 0)
                _store_values(tokens_ptr, dense, values_t, mask, OUT_BF16_BITS)


@gluon.constexpr_function
def group_cast_layout(vector, row_lanes, blocks_per_thread, warps):
    """Registers of the Gluon cast's [32 rows, blocks, 32 columns] tile: each thread holds
    `vector` consecutive columns (one load or store instruction) of 32 / row_lanes rows in each
    of its blocks, so that a block's reduction along the rows is mostly inside a thread and
    crosses row_lanes lanes of one warp, and the one along the columns crosses 32 / vector lanes;
    a warp's other lanes and the warps take further blocks of 32 columns."""
    col_lanes = 32 // vector
    block_lanes = 32 // (row_lanes * col_lanes)
    return gl.BlockedLayout(
        [32 // row_lanes, blocks_per_thread, vector],
        [row_lanes, block_lanes, col_lanes],
        [1, warps, 1],
        [2, 1, 0],
    )


@gluon.constexpr_function
def group_cast_blocks(vector, row_lanes, blocks_per_thread, warps):
    """Blocks of 32 columns in one tile of `group_cast_layout`."""
    return blocks_per_thread * 32 // (row_lanes * (32 // vector)) * warps


@fast_launch
@gluon.jit(do_not_specialize=["capacity"])
def _mx_group_cast_gluon_kernel(
    a_ptr,
    a_stride,
    values_ptr,
    codes_ptr,
    codes_stride,
    tokens_ptr,
    table_ptr,
    counts_ptr,
    capacity,
    cols,
    RCEIL: gl.constexpr,
    BF16_BITS: gl.constexpr,
    MX_IN: gl.constexpr,
    VALUES: gl.constexpr,
    CODES: gl.constexpr,
    TOKENS: gl.constexpr,
    OUT_BF16_BITS: gl.constexpr,
    BLOCK_ROWS: gl.constexpr,
    VECTOR: gl.constexpr,
    ROW_LANES: gl.constexpr,
    BLOCKS_PER_THREAD: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
):
    """`_mx_group_cast_kernel` (its twin: the same arguments, bit for bit the same results) with
    an explicit register layout (`group_cast_layout`): a tile is [32 rows, blocks, 32 columns],
    so both casts reduce along an axis of their own without a reshape, and the cast along the
    rows stays inside a warp, where the tl kernel's crosses warps through shared memory."""
    layout: gl.constexpr = group_cast_layout(VECTOR, ROW_LANES, BLOCKS_PER_THREAD, gl.num_warps())
    blocks_layout: gl.constexpr = gl.SliceLayout(2, layout)  # [rows, blocks]: scales along C
    BLOCKS: gl.constexpr = group_cast_blocks(VECTOR, ROW_LANES, BLOCKS_PER_THREAD, gl.num_warps())
    col_blocks = cols // 32
    c_tiles = (col_blocks + BLOCKS - 1) // BLOCKS
    num_tasks = gl.load(counts_ptr) * c_tiles
    j = gl.arange(0, 32, gl.SliceLayout(0, gl.SliceLayout(1, layout)))[None, None, :]
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        row = gl.load(table_ptr + capacity + task // c_tiles)
        row_end = gl.load(table_ptr + 2 * capacity + task // c_tiles)
        b = task % c_tiles * BLOCKS + gl.arange(0, BLOCKS, gl.SliceLayout(0, blocks_layout))
        for half in gl.static_range(BLOCK_ROWS // 32):
            r = row + half * 32 + gl.arange(0, 32, gl.SliceLayout(1, blocks_layout))
            rows = r.to(gl.int64)[:, None]
            s_mask = (r < row_end)[:, None] & (b < col_blocks)[None, :]
            mask = s_mask[:, :, None] & (j < 32)
            c = b[None, :, None] * 32 + j
            if MX_IN:
                data = gl.load(a_ptr + rows[:, :, None] * a_stride + c, mask=mask, other=0)
                scales = gl.load(
                    a_ptr + rows * a_stride + cols + b[None, :], mask=s_mask, other=127
                )
                tile = mx_dequantize_along(data.to(gl.int32), scales.to(gl.int32), 2)
            else:
                tile = _load_fp32(a_ptr + rows[:, :, None] * a_stride + c, mask, BF16_BITS)
                if VALUES or CODES:
                    data, scales = mx_quantize_along(tile, 2, RCEIL)
            dense = rows[:, :, None] * cols + c
            # Bytes before values, as in the twin (the other order miscompiled there).
            if CODES:
                gl.store(
                    codes_ptr + rows[:, :, None] * codes_stride + c, data.to(gl.uint8), mask=mask
                )
                scales_to = codes_ptr + rows * codes_stride + cols + b[None, :]
                gl.store(scales_to, scales.to(gl.uint8), mask=s_mask)
            if VALUES:
                if MX_IN:
                    _store_values(values_ptr, dense, tile, mask, OUT_BF16_BITS)
                else:
                    values = mx_dequantize_along(data, scales, 2)
                    _store_values(values_ptr, dense, values, mask, OUT_BF16_BITS)
            if TOKENS:
                data_t, scales_t = mx_quantize_along(tile, 0, RCEIL)
                values_t = mx_dequantize_along(data_t, scales_t, 0)
                _store_values(tokens_ptr, dense, values_t, mask, OUT_BF16_BITS)


GROUP_ROWS = 64
"""Rows per tile of `mx_group_casts` (a multiple of 32): its `RowTiles` block_m."""
GROUP_CAST_TILES = {
    "from values": {"block_cols": 128, "programs_per_sm": 4, "num_warps": 4},
    "from bytes": {"block_cols": 256, "programs_per_sm": 4, "num_warps": 8},
    "from bytes, tokens": {"block_cols": 256, "programs_per_sm": 4, "num_warps": 4},
}
"""Columns per tile, programs per SM and warps of `mx_group_casts` on GPUs, by what it reads
(bf16 values, or packed MX bytes whose values it casts along the tokens or not). The cast from
bytes along the tokens is the slowest: its 32-row reductions cross warps in tl (swept:
benchmarks/results/2026-12-04-mxfp8-token-casts-gluon-h200.md)."""


GLUON_GROUP_CAST_TILES = {
    "from values": {"vector": 8, "row_lanes": 8, "blocks_per_thread": 1, "num_warps": 4},
    "from bytes": {"vector": 8, "row_lanes": 4, "blocks_per_thread": 1, "num_warps": 4},
}
"""The Gluon kernel's layout (`group_cast_layout`) and warps by what it reads; 4 programs an SM.
A block's 32 rows stay inside one warp, so the casts along the rows (the tokens) beat tl's; the
casts along C alone run as fast or faster in tl, so "auto" takes the Gluon kernel only where a
cast along the rows is asked for (nine layouts swept per use:
benchmarks/results/2026-12-04-mxfp8-token-casts-gluon-h200.md)."""


@dataclasses.dataclass(frozen=True)
class GroupCasts:
    """What `mx_group_casts` made (None where not asked for); rows outside the groups unwritten."""

    values: torch.Tensor | None
    """[M, C] the values of the cast along C: the operand of a GEMM reducing over C."""
    codes: MXRows | None
    """[M, C] that cast's bytes (the form the MXFP8 layer saves)."""
    token_values: torch.Tensor | None
    """[M, C] the values of the cast along each group's rows (Q_T): the operand of a weight
    gradient, which reduces over the tokens of one expert."""


def mx_group_casts(
    a: torch.Tensor | MXRows,
    tiles: RowTiles,
    rounding: ScaleRounding | str = ScaleRounding.RCEIL,
    *,
    values: bool = False,
    codes: bool = False,
    token_values: bool = False,
    dtype: torch.dtype | None = None,
    kernel: str = "auto",
) -> GroupCasts:
    """The MXFP8 casts of the expert groups' rows of a [M, C] asked for, from one read of a:
    along C (`values`, `codes`: `mok.reference.mx.quantize` along the last dimension), and along
    the rows of each group in blocks of 32 from its first row, the last block padded with zeros
    (`token_values`: `mok.reference.mx_expert.quantized_rows`). a: bf16 or fp32 values with a
    unit last stride, or `MXRows` (an MX tensor cast along C, whose values are exact: `values`
    then dequantizes, `token_values` casts them again). Values come in a's dtype (`dtype` for
    `MXRows`). tiles: `grouped_gemm.row_tile_map(offsets, M, GROUP_ROWS)`; only rows inside
    the groups are read or written. kernel: "gluon" (Hopper and later), "tl", or "auto" (the
    Gluon kernel where it runs and `token_values` is asked for, the tl twin otherwise); the
    results are the same bit for bit.
    Never synchronizes with the host."""
    mx_in = isinstance(a, MXRows)
    if mx_in and (codes or dtype is None):
        raise ValueError("mx_group_casts of MXRows: no codes (they are a's), and a dtype is due")
    if tiles.block_m != GROUP_ROWS:
        raise ValueError(f"mx_group_casts needs row tiles of {GROUP_ROWS} rows")
    source = a.packed if mx_in else a
    if source.dim() != 2 or source.stride(1) != 1:
        raise ValueError(f"a must be a 2-D tensor with a unit last stride, got {tuple(a.shape)}")
    rows, cols = a.shape
    if cols % BLOCK:
        raise ValueError(f"MXFP8 casts need a multiple of {BLOCK} columns, got {cols}")
    dtype = dtype or a.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"MX values are stored as float32 or bfloat16, not {dtype}")
    device = source.device
    gluon_kernel = _group_cast_kernel_is_gluon(kernel, device, token_values)
    out_values = torch.empty(rows, cols, dtype=dtype, device=device) if values else None
    out_codes = MXRows.empty(rows, cols, device) if codes else None
    out_tokens = torch.empty(rows, cols, dtype=dtype, device=device) if token_values else None
    if not rows or not (values or codes or token_values):
        return GroupCasts(out_values, out_codes, out_tokens)
    unused = tiles.table  # pointer arguments of outputs not asked for are never touched
    bf16 = source.dtype == torch.bfloat16
    args = (
        source.view(torch.int16) if bf16 else source,
        source.stride(0),
        _values_arg(out_values)[0] if values else unused,
        out_codes.packed if codes else unused,
        out_codes.packed.stride(0) if codes else 0,
        _values_arg(out_tokens)[0] if token_values else unused,
        tiles.table,
        tiles.counts,
        tiles.capacity,
        cols,
    )
    flags = {
        "RCEIL": ScaleRounding(rounding) is ScaleRounding.RCEIL,
        "BF16_BITS": bf16,
        "MX_IN": mx_in,
        "VALUES": values,
        "CODES": codes,
        "TOKENS": token_values,
        "OUT_BF16_BITS": dtype == torch.bfloat16,
        "BLOCK_ROWS": GROUP_ROWS,
    }
    if gluon_kernel:
        _launch_gluon_group_cast(args, flags, device, tiles.capacity, cols, mx_in)
    else:
        _launch_tl_group_cast(args, flags, device, tiles.capacity, cols, mx_in, token_values)
    return GroupCasts(out_values, out_codes, out_tokens)


def _launch_gluon_group_cast(
    args: tuple, flags: dict, device, row_tiles: int, cols: int, mx_in: bool
) -> None:
    """`mx_group_casts`'s Gluon kernel on `row_tiles` row tiles of `cols` columns."""
    tile = GLUON_GROUP_CAST_TILES["from bytes" if mx_in else "from values"]
    blocks = group_cast_blocks(
        tile["vector"], tile["row_lanes"], tile["blocks_per_thread"], tile["num_warps"]
    )
    cfg = GemmTiles(GROUP_ROWS, blocks * BLOCK, 32, programs_per_sm=4)
    programs = num_programs(device, row_tiles * triton.cdiv(cols, cfg.block_n), cfg)
    _mx_group_cast_gluon_kernel[(programs,)](
        *args,
        **flags,
        VECTOR=tile["vector"],
        ROW_LANES=tile["row_lanes"],
        BLOCKS_PER_THREAD=tile["blocks_per_thread"],
        NUM_PROGRAMS=programs,
        num_warps=tile["num_warps"],
    )


def _launch_tl_group_cast(
    args: tuple, flags: dict, device, row_tiles: int, cols: int, mx_in: bool, token_values: bool
) -> None:
    """`mx_group_casts`'s tl kernel on `row_tiles` row tiles of `cols` columns."""
    reads = "from values"
    if mx_in:
        reads = "from bytes, tokens" if token_values else "from bytes"
    tile = GROUP_CAST_TILES[reads] if device.type == "cuda" else {"block_cols": 64, "num_warps": 4}
    cfg = GemmTiles(
        GROUP_ROWS,
        tile["block_cols"],
        32,
        num_warps=tile["num_warps"],
        programs_per_sm=tile.get("programs_per_sm", 1),
    )
    programs = num_programs(device, row_tiles * triton.cdiv(cols, cfg.block_n), cfg)
    _mx_group_cast_kernel[(programs,)](
        *args,
        **flags,
        BLOCK_COLS=cfg.block_n,
        NUM_PROGRAMS=programs,
        num_warps=cfg.num_warps,
    )


def _group_cast_kernel_is_gluon(kernel: str, device: torch.device, token_values: bool) -> bool:
    """Whether `mx_group_casts` runs its Gluon kernel on `device` (`kernel` as it takes it): under
    "auto", on Hopper and later GPUs where a cast along the rows is asked for."""
    if kernel not in ("auto", "tl", "gluon"):
        raise ValueError(f"mx_group_casts' kernel is 'auto', 'tl' or 'gluon', not {kernel!r}")
    runs = device.type == "cuda" and not interpreting()
    runs = runs and torch.cuda.get_device_capability(device) >= (9, 0)
    if kernel == "gluon" and not runs:
        raise ValueError(f"the Gluon cast kernel needs a Hopper or later GPU, not {device}")
    return kernel == "gluon" or (kernel == "auto" and runs and token_values)
