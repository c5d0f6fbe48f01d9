"""Byte layouts of the kernels' tensors that hosts size without Triton (the NVLink exchange's
buffers, `mok memory`)."""

from __future__ import annotations

import dataclasses

import torch

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


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """A tensor [N, C] cast to e4m3 along its rows, one packed row of bytes per row: its C e4m3
    bytes, then its scales, then padding to a multiple of MX_ROW_ALIGN bytes (left as it is). A
    row is one contiguous run of bytes, so the exchange moves it as it moves a bf16 row
    (`as_rows`). Each format says its scales' bytes (`row_bytes`) and the multiple C keeps."""

    packed: torch.Tensor
    """[N, row_bytes(C)] uint8 with a unit last stride (any row stride)."""
    cols: int
    """C."""

    COLUMNS = 16
    """C is a multiple of this."""

    @staticmethod
    def row_bytes(cols: int) -> int:
        """Bytes of one packed row of `cols` columns."""
        raise NotImplementedError

    def __post_init__(self):
        if self.cols % self.COLUMNS:
            raise ValueError(
                f"{type(self).__name__} need a multiple of {self.COLUMNS} columns, got {self.cols}"
            )
        width = self.row_bytes(self.cols)
        packed = self.packed
        if (
            packed.dtype != torch.uint8
            or packed.dim() != 2
            or packed.shape[1] != width
            or (packed.stride(1) != 1)
        ):
            raise ValueError(
                f"{type(self).__name__} of {self.cols} columns are [N, {width}] uint8 with a "
                f"unit last stride, got {tuple(packed.shape)} {packed.dtype}"
            )

    @classmethod
    def empty(cls, rows: int, cols: int, device: torch.device):
        return cls(torch.empty(rows, cls.row_bytes(cols), dtype=torch.uint8, device=device), cols)

    @classmethod
    def from_rows(cls, rows: torch.Tensor, cols: int):
        """The rows whose bytes `rows` holds (what `as_rows` made, e.g. after an exchange)."""
        return cls(rows.view(torch.uint8), cols)

    def as_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """The same bytes as [N, row_bytes / itemsize] elements of `dtype` (a tensor of the
        exchange's row dtype, to be moved, never computed on)."""
        return self.packed.view(dtype)

    @property
    def codes(self) -> torch.Tensor:
        """[N, C] float8_e4m3fn, the e4m3 bytes (a strided view)."""
        return self.packed[:, : self.cols].view(torch.float8_e4m3fn)
