"""`grouped_gemm.group_column_sums` (the expert biases' gradients, optionally of rows times their
router weights) and `grouped_gemm.group_row_dots` (the down bias's part of the router weights'
gradient) against PyTorch sums.

Integer-valued inputs make every fp32 sum exact, so the comparison is bitwise. Bugs these catch: a
group's first or last row left out, rows of the next group summed in, a column tail past the last
full block unwritten, empty groups not zeroed, accumulation into the old value skipped or done
after rounding to bf16 (the old value must enter the fp32 sum), a row stride ignored (the gate
and up halves of one [M, 2I] tensor), a row weight applied to another row or not at all, a row's
dot taken with another expert's vector, rows outside the groups overwritten, the dots stored
over out instead of added to it."""

from __future__ import annotations

import pytest
import torch

from mok.kernels.grouped_gemm import (
    ROW_DOTS_BLOCK_M,
    group_column_sums,
    group_row_dots,
    row_tile_map,
)

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


def _grouped_integers(sizes, columns, before, generator):
    """(values [rows, columns] of small integers, with `before` rows ahead of the groups and 3
    after, int32 offsets of the groups, their bounds as Python ints)."""
    rows = before + sum(sizes) + 3
    values = torch.randint(-8, 9, (rows, columns), generator=generator).float()
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()]) + before
    return values, offsets.to(torch.int32), offsets.tolist()


@pytest.mark.parametrize("sizes", [[0, 5, 0, 33, 1], [70], [0, 0]])
def test_weighted_sums_multiply_each_row_by_its_weight(sizes):
    generator = torch.Generator().manual_seed(len(sizes))
    values, offsets, bounds = _grouped_integers(sizes, 40, 2, generator)
    weights = torch.randint(-4, 5, (values.shape[0],), generator=generator).float() / 4
    weighted = weights[:, None] * values
    want = torch.stack([weighted[a:b].sum(0) for a, b in zip(bounds, bounds[1:], strict=False)])
    out = torch.full((len(sizes), 40), 99.0, device=DEVICE)
    group_column_sums(values.to(DEVICE), offsets.to(DEVICE), out, row_weights=weights.to(DEVICE))
    assert torch.equal(out.cpu(), want)
    with pytest.raises(ValueError, match="row_weights must be"):
        group_column_sums(values.to(DEVICE), offsets.to(DEVICE), out, row_weights=weights.double())


@pytest.mark.parametrize("columns", [16, 40, 200])
@pytest.mark.parametrize("sizes", [[0, 5, 0, 33, 1], [70], [0, 0], [3 * ROW_DOTS_BLOCK_M + 1]])
def test_row_dots_add_each_rows_dot_with_its_groups_vector(columns, sizes):
    generator = torch.Generator().manual_seed(columns + len(sizes))
    values, offsets, bounds = _grouped_integers(sizes, columns, 2, generator)
    vectors = torch.randint(-3, 4, (len(sizes), columns), generator=generator).float()
    start = torch.randint(-5, 6, (values.shape[0],), generator=generator).float()
    want = start.clone()
    for expert, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        want[a:b] += values[a:b] @ vectors[expert]
    out = start.to(DEVICE)
    tiles = row_tile_map(offsets.to(DEVICE), values.shape[0], ROW_DOTS_BLOCK_M)
    assert group_row_dots(values.to(DEVICE), tiles, vectors.to(DEVICE), out) is out
    assert torch.equal(out.cpu(), want)  # rows outside the groups keep their value


def test_row_dots_refuse_what_they_cannot_read():
    values = torch.zeros(4, 8, device=DEVICE)
    offsets = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    tiles = row_tile_map(offsets, 4, ROW_DOTS_BLOCK_M)
    out = torch.zeros(4, device=DEVICE)
    with pytest.raises(ValueError, match="tiles of"):
        group_row_dots(values, row_tile_map(offsets, 4, 2 * ROW_DOTS_BLOCK_M), values[:1], out)
    with pytest.raises(ValueError, match="unit column stride"):
        group_row_dots(values, tiles, torch.zeros(1, 9, device=DEVICE), out)
    with pytest.raises(ValueError, match="out must be"):
        group_row_dots(values, tiles, values[:1], out.double())
