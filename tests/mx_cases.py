"""Inputs and comparisons shared by the MXFP8 tests of the reference cast and of the kernel."""

from __future__ import annotations

import torch


def assert_same_bits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """e4m3 bytes equal, any NaN (0x7F / 0xFF) matching any NaN."""
    nan_ours, nan_theirs = (ours & 0x7F) == 0x7F, (theirs & 0x7F) == 0x7F
    assert torch.equal(nan_ours, nan_theirs)
    mismatch = (ours != theirs) & ~nan_ours
    assert not mismatch.any(), (ours[mismatch][:8].tolist(), theirs[mismatch][:8].tolist())


def blocks_of_every_kind(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[64, 256]: random blocks over magnitudes 2^-140 .. 2^120, and blocks with zeros only, a
    NaN, an infinity, subnormals only, exact powers of two, values at e4m3's rounding ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 256, generator=gen, dtype=torch.float64)
    magnitude = torch.randint(-140, 121, (64, 8, 1), generator=gen).to(torch.float64)
    x = (x.view(64, 8, 32) * torch.exp2(magnitude)).view(64, 256)
    x[0, :32] = 0
    x[1, 5] = float("nan")
    x[1, 6] = 2.0**120  # in a NaN block: FLOOR divides it by infinity (0), RCEIL makes it NaN
    x[2, 40] = float("inf")
    x[3, 64:96] = -float("inf")
    x[4, :32] = torch.randn(32, generator=gen, dtype=torch.float64) * 2.0**-140  # subnormal
    x[5, :32] = torch.exp2(torch.randint(-30, 30, (32,), generator=gen).to(torch.float64))
    # Ties of e4m3 after scaling: 1 + 1/16 (rounds to 1), 1 + 3/16 (to 1.25), 17 (to 16), 19.
    x[6, :32] = torch.tensor([1.0625, 1.1875, 17.0, 19.0] * 8, dtype=torch.float64) * 0.5
    x[6, 0] = 256.0  # the block's amax: FLOOR scale 1 (elements taken as they are)
    x[7, :32] = 448.0 * 2.0 ** torch.arange(32, dtype=torch.float64).div(32)  # FLOOR saturates
    return x.to(dtype)
