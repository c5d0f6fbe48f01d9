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

import torch
import triton
import triton.language as tl

from mok.kernels._triton_compat import interpreting, patch_interpreter
from mok.kernels.grouped_gemm import GemmTiles, RowTiles, num_programs
from mok.reference.mx import BLOCK, ScaleRounding

if interpreting():
    patch_interpreter()

HARDWARE_FP8 = tl.constexpr(not interpreting())
"""Decode e4m3 with the GPU's conversion; the interpreter's rounds wrongly, so there integers."""


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
def mx_quantize_tile(tile, ROWS: tl.constexpr, COLS: tl.constexpr, RCEIL: tl.constexpr):
    """(e4m3 bytes [ROWS, COLS], scale bytes [ROWS, COLS // 32]) of an fp32 tile, blocks of 32
    along its columns."""
    blocks = tile.reshape(ROWS, COLS // 32, 32)
    amax = tl.max(tl.abs(blocks), axis=2)
    has_nan = tl.max((blocks != blocks).to(tl.int32), axis=2) > 0
    byte, factor = mx_scale_bytes(amax, has_nan, RCEIL)
    scaled = blocks * factor[:, :, None]
    scaled = tl.minimum(tl.maximum(scaled, -448.0, tl.PropagateNan.ALL), 448.0, tl.PropagateNan.ALL)
    return e4m3_bytes(scaled).reshape(ROWS, COLS), byte


@triton.jit
def mx_quantize_columns(tile, ROWS: tl.constexpr, COLS: tl.constexpr, RCEIL: tl.constexpr):
    """`mx_quantize_tile` for blocks of 32 along the rows: (e4m3 bytes [ROWS, COLS], scale
    bytes [ROWS // 32, COLS]), without a transpose."""
    blocks = tile.reshape(ROWS // 32, 32, COLS)
    amax = tl.max(tl.abs(blocks), axis=1)
    has_nan = tl.max((blocks != blocks).to(tl.int32), axis=1) > 0
    byte, factor = mx_scale_bytes(amax, has_nan, RCEIL)
    scaled = blocks * factor[:, None, :]
    scaled = tl.minimum(tl.maximum(scaled, -448.0, tl.PropagateNan.ALL), 448.0, tl.PropagateNan.ALL)
    return e4m3_bytes(scaled).reshape(ROWS, COLS), byte


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
    return tl.where((codes & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def mx_dequantize_tile(codes, scale_bytes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The fp32 tile [ROWS, COLS] of e4m3 bytes `codes` (int32) x 2^(scale - 127) per block of 32
    along the columns (scale_bytes [ROWS, COLS // 32], int32; 255 is NaN): what an MX operand is
    before a bf16 MMA. Exact, and exactly representable in bf16 whenever the product is normal
    (`docs/mxfp8.md`), so rounding it to bf16 changes nothing there."""
    values = e4m3_values(codes).reshape(ROWS, COLS // 32, 32)
    factor = _power_of_two(tl.minimum(scale_bytes, 254) - 127)
    factor = tl.where(scale_bytes == 255, float("nan"), factor)
    return (values * factor[:, :, None]).reshape(ROWS, COLS)


@triton.jit
def mx_dequantize_columns(codes, scale_bytes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """`mx_dequantize_tile` for blocks of 32 along the rows: codes [ROWS, COLS], scale_bytes
    [ROWS // 32, COLS] (an operand quantized along its first dimension)."""
    values = e4m3_values(codes).reshape(ROWS // 32, 32, COLS)
    factor = _power_of_two(tl.minimum(scale_bytes, 254) - 127)
    factor = tl.where(scale_bytes == 255, float("nan"), factor)
    return (values * factor[:, None, :]).reshape(ROWS, COLS)


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
    (partial tiles in small tests), measured on an H200 for GPUs (benchmarks/mx_casts.py)."""
    return gpu if device.type == "cuda" else interpreted


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
def _store_row_scales(scales_ptr, scales, r, rows, cols, BLOCK_COLS: tl.constexpr):
    """Store a tile's scale bytes [len(r), BLOCK_COLS // 32] (blocks along cols) into the
    contiguous [rows, cols // 32] scales, at the program's column tile."""
    s = tl.program_id(1) * (BLOCK_COLS // 32) + tl.arange(0, BLOCK_COLS // 32)
    scale_mask = (r < rows)[:, None] & (s < cols // 32)[None, :]
    scale_offsets = r.to(tl.int64)[:, None] * (cols // 32) + s[None, :]
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


@triton.jit
def _mx_quantize_kernel(
    x_ptr,
    data_ptr,  # uint8, x's layout (STORE_CODES)
    scales_ptr,  # uint8 [rows, cols // 32], contiguous (STORE_CODES)
    values_ptr,  # [rows, cols] contiguous (STORE_VALUES): the cast's values, fp32 or bf16 bits
    rows,
    cols,
    stride_row,
    stride_col,
    data_stride_row,
    data_stride_col,
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
        _store_row_scales(scales_ptr, scales, r, rows, cols, BLOCK_COLS)
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
    """Cast view [rows, cols] (any strides) along cols into the bytes `data` (view's layout) and
    `scales` [rows, cols // 32], the contiguous `values`, or both."""
    rows, cols = view.shape
    if not view.numel():
        return
    block_rows, block_cols = _cast_tile(view.device, (16, 128), (16, 512))
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(cols, block_cols))
    bf16 = view.dtype == torch.bfloat16
    values_arg, values_bits = (scales, False) if values is None else _values_arg(values)
    codes = data if data is not None else values_arg
    _mx_quantize_kernel[grid](
        view.view(torch.int16) if bf16 else view,
        codes,
        scales if scales is not None else values_arg,
        values_arg,
        rows,
        cols,
        view.stride(0),
        view.stride(1),
        codes.stride(0),
        codes.stride(1),
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
    dimension a multiple of 32. keep_codes: return (values, (data float8_e4m3fn, scales uint8))
    from the same pass."""
    _check_cast(x, -1)
    rows, cols = x.shape
    values = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    if not keep_codes:
        _launch_row_cast(x, rounding, values=values)
        return values
    data = torch.empty(rows, cols, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, cols // BLOCK, dtype=torch.uint8, device=x.device)
    _launch_row_cast(x, rounding, data, scales, values)
    return values, (data.view(torch.float8_e4m3fn), scales)


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
):
    """Grid: (rows // BLOCK_ROWS, cdiv(cols, BLOCK_COLS)). Both MXFP8 casts of x from one read of
    each tile: along cols (a weight's reduction dimension in forward) and along rows (its
    reduction dimension in backward), as e4m3 bytes and scales or, with VALUES, as the values
    they represent (fp32, or bf16 bits when VALUES_BF16_BITS). rows a multiple of BLOCK_ROWS,
    cols of 32."""
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    offsets = r.to(tl.int64)[:, None] * cols + c[None, :]
    tile = _load_fp32(x_ptr + offsets, mask, BF16_BITS)

    data, scales = mx_quantize_tile(tile, BLOCK_ROWS, BLOCK_COLS, RCEIL)
    if VALUES:
        values = mx_dequantize_tile(data, scales, BLOCK_ROWS, BLOCK_COLS)
        _store_values(rowwise_ptr, offsets, values, mask, VALUES_BF16_BITS)
    else:
        tl.store(rowwise_ptr + offsets, data.to(tl.uint8), mask=mask)
        _store_row_scales(rowwise_scales_ptr, scales, r, rows, cols, BLOCK_COLS)

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


def _launch_both(x, rowwise, rowwise_scales, colwise, colwise_scales, rounding, values) -> None:
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
    x: torch.Tensor, rounding: ScaleRounding | str = ScaleRounding.RCEIL
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values of x's MXFP8 cast along its last dimension, along the one before), each of x's
    shape and dtype, from one pass over x: what a weight is to the bf16 GEMMs of the forward and
    of the data gradients. x as in `mx_quantize_both`."""
    _check_both(x)
    rowwise, colwise = torch.empty_like(x), torch.empty_like(x)
    _launch_both(x, rowwise, x, colwise, x, rounding, values=True)
    return rowwise, colwise


@triton.jit(do_not_specialize=["capacity"])
def _mx_group_rows_kernel(
    a_ptr,  # [M, C] contiguous: values (bf16 bits as int16 when BF16_BITS), or e4m3 bytes (MX_IN)
    a_scales_ptr,  # MX_IN: [M, C // 32] scale bytes of a, cast along C
    out_ptr,  # [M, C] contiguous: the values (fp32, or bf16 bits when OUT_BF16_BITS)
    table_ptr,  # RowTiles of BLOCK_ROWS rows
    counts_ptr,
    capacity,
    cols,
    RCEIL: tl.constexpr,
    BF16_BITS: tl.constexpr,
    MX_IN: tl.constexpr,
    OUT_BF16_BITS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS. Every group's rows cast to MXFP8 along the rows in blocks of 32 from
    the group's first (a row tile starts there, BLOCK_ROWS a multiple of 32; rows past the group
    read as zeros), stored as the values they represent. MX_IN: a is itself an MXFP8 tensor cast
    along C, dequantized first (its values cast again)."""
    c_tiles = tl.cdiv(cols, BLOCK_COLS)
    num_tasks = tl.load(counts_ptr) * c_tiles
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS):
        row = tl.load(table_ptr + capacity + task // c_tiles)
        row_end = tl.load(table_ptr + 2 * capacity + task // c_tiles)
        r = row + tl.arange(0, BLOCK_ROWS)
        c = task % c_tiles * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        mask = (r < row_end)[:, None] & (c < cols)[None, :]
        offsets = r.to(tl.int64)[:, None] * cols + c[None, :]
        if MX_IN:
            codes = tl.load(a_ptr + offsets, mask=mask, other=0)
            s = task % c_tiles * (BLOCK_COLS // 32) + tl.arange(0, BLOCK_COLS // 32)
            s_mask = (r < row_end)[:, None] & (s < cols // 32)[None, :]
            s_offsets = r.to(tl.int64)[:, None] * (cols // 32) + s[None, :]
            scale_bytes = tl.load(a_scales_ptr + s_offsets, mask=s_mask, other=127)
            tile = mx_dequantize_tile(codes, scale_bytes.to(tl.int32), BLOCK_ROWS, BLOCK_COLS)
        else:
            tile = _load_fp32(a_ptr + offsets, mask, BF16_BITS)
        data, scales = mx_quantize_columns(tile, BLOCK_ROWS, BLOCK_COLS, RCEIL)
        values = mx_dequantize_columns(data, scales, BLOCK_ROWS, BLOCK_COLS)
        _store_values(out_ptr, offsets, values, mask, OUT_BF16_BITS)


GROUP_ROWS = 64
"""Rows per tile of `mx_group_rows_values` (a multiple of 32): its `RowTiles` block_m."""


def mx_group_rows_values(
    a: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    tiles: RowTiles,
    rounding: ScaleRounding | str = ScaleRounding.RCEIL,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Q_T of every expert group's rows of a [M, C]: the values of the MXFP8 cast along the rows
    in blocks of 32 from each group's first row, the last block padded with zeros
    (`mok.reference.mx_expert.quantized_rows`): the operand a bf16 weight-gradient GEMM reads.
    a: contiguous bf16 or fp32 values, or an MXFP8 tensor cast along C (data, scales), whose
    values are cast (a second cast, in the same pass). Returns a's dtype (`dtype` for an MXFP8
    a). tiles: `grouped_gemm.row_tile_map(offsets, M, GROUP_ROWS)`. Rows outside the groups
    are left unwritten."""
    mx_in = isinstance(a, tuple)
    data, scales = a if mx_in else (a, a)
    if data.dim() != 2 or not data.is_contiguous():
        raise ValueError(f"a must be a contiguous [M, C] tensor, got {tuple(data.shape)}")
    rows, cols = data.shape
    out = torch.empty(rows, cols, dtype=dtype or data.dtype, device=data.device)
    if rows:
        block_cols = 64
        tasks = tiles.capacity * triton.cdiv(cols, block_cols)
        cfg = GemmTiles(GROUP_ROWS, block_cols, 32, programs_per_sm=8)
        programs = num_programs(data.device, tasks, cfg)
        out_arg, out_bits = _values_arg(out)
        bf16 = data.dtype == torch.bfloat16
        _mx_group_rows_kernel[(programs,)](
            data.view(torch.uint8) if mx_in else data.view(torch.int16) if bf16 else data,
            scales,
            out_arg,
            tiles.table,
            tiles.counts,
            tiles.capacity,
            cols,
            RCEIL=ScaleRounding(rounding) is ScaleRounding.RCEIL,
            BF16_BITS=bf16 and not mx_in,
            MX_IN=mx_in,
            OUT_BF16_BITS=out_bits,
            BLOCK_ROWS=GROUP_ROWS,
            BLOCK_COLS=block_cols,
            NUM_PROGRAMS=programs,
        )
    return out
