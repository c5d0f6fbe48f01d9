"""`grouped_gemm.group_column_sums` (the expert biases' gradients) against PyTorch sums.

Integer-valued inputs make every fp32 sum exact, so the comparison is bitwise. Bugs these catch: a
group's first or last row left out, rows of the next group summed in, a column tail past the last
full block unwritten, empty groups not zeroed, accumulation into the old value skipped or done
after rounding to bf16 (the old value must enter the fp32 sum), a row stride ignored (the gate
and up halves of one [M, 2I] tensor)."""

from __future__ import annotations

import pytest
import torch

from mok.kernels.grouped_gemm import group_column_sums

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("columns", [16, 40, 200])
@pytest.mark.parametrize("sizes", [[0, 5, 0, 33, 1], [70], [0, 0]])
def test_sums_each_groups_rows(columns, sizes):
    generator = torch.Generator().manual_seed(columns + len(sizes))
    rows = sum(sizes) + 3  # rows past the last group: never summed
    wide = torch.randint(-8, 9, (rows, 2 * columns), generator=generator).float().to(DEVICE)
    values = wide[:, columns:]  # row stride 2 * columns
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    bounds = offsets.tolist()
    want = torch.stack([values[a:b].sum(0) for a, b in zip(bounds, bounds[1:], strict=False)])
    out = torch.full((len(sizes), columns), 99.0, device=DEVICE)
    got = group_column_sums(values, offsets.to(DEVICE), out)
    assert got is out and torch.equal(out, want)
    old = torch.randint(-4, 5, out.shape, generator=generator).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        into = old.to(dtype).clone()
        group_column_sums(values, offsets.to(DEVICE), into, accumulate=True)
        assert torch.equal(into, (old.float() + want).to(dtype))


def test_refuses_what_it_cannot_read():
    values = torch.zeros(4, 8, device=DEVICE)
    offsets = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="unit column stride"):
        group_column_sums(values.t(), offsets, torch.zeros(1, 4, device=DEVICE))
    with pytest.raises(ValueError, match="unit column stride"):
        group_column_sums(values, offsets, torch.zeros(1, 5, device=DEVICE))
