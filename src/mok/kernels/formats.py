"""Byte layouts of the kernels' tensors that hosts size without Triton (the NVLink exchange's
buffers, `mok memory`)."""

from __future__ import annotations

from mok.reference.fp8_block import BLOCK as FP8_BLOCK
from mok.reference.mx import BLOCK

MX_ROW_ALIGN = 16
"""Bytes a packed MX row is padded to a multiple of (16-byte vector accesses, any row dtype)."""


def mx_row_bytes(cols: int) -> int:
    """Bytes of one packed MX row of `cols` columns (`mok.kernels.mx.MXRows`): its e4m3 bytes,
    its e8m0 scales (one per BLOCK columns), zero padding to a multiple of MX_ROW_ALIGN."""
    return -(-(cols + cols // BLOCK) // MX_ROW_ALIGN) * MX_ROW_ALIGN


def fp8_block_row_bytes(cols: int) -> int:
    """Bytes of one packed row of `cols` columns in the 128-block recipe
    (`mok.kernels.fp8_block.BlockRows`): its e4m3 bytes, its fp32 descales (one per FP8_BLOCK
    columns), zero padding to a multiple of MX_ROW_ALIGN."""
    raw = cols + 4 * -(-cols // FP8_BLOCK)
    return -(-raw // MX_ROW_ALIGN) * MX_ROW_ALIGN
