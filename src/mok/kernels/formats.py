"""Byte layouts of the kernels' tensors that hosts size without Triton (the NVLink exchange's
buffers, `mok memory`)."""

from __future__ import annotations

from mok.reference.mx import BLOCK

MX_ROW_ALIGN = 16
"""Bytes a packed MX row is padded to a multiple of (16-byte vector accesses, any row dtype)."""


def mx_row_bytes(cols: int) -> int:
    """Bytes of one packed MX row of `cols` columns (`mok.kernels.mx.MXRows`): its e4m3 bytes,
    its e8m0 scales (one per BLOCK columns), zero padding to a multiple of MX_ROW_ALIGN."""
    return -(-(cols + cols // BLOCK) // MX_ROW_ALIGN) * MX_ROW_ALIGN
