"""`warp_specialized._expert_rows`: the 2-D view through which the Gluon kernels read expert
weights (a TMA descriptor over its rows, expert e's first row at e * per_expert). Host code: runs
on the CPU. Bugs caught: a per-expert distance that ignores the fused tensor's other half (gate
read as up, or another expert's rows), a view whose rows run past the storage, a transposed
weight taken as rows or spaced rows read as adjacent (the kernels would read the wrong elements),
a silent copy."""

import pytest
import torch

from mok.kernels import warp_specialized


def _rows_match(w: torch.Tensor) -> None:
    rows, per_expert = warp_specialized._expert_rows(w)
    assert rows.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()  # a view
    assert rows.data_ptr() == w.data_ptr()
    end = rows.storage_offset() + (rows.shape[0] - 1) * rows.stride(0) + rows.shape[1]
    assert end * rows.element_size() <= w.untyped_storage().nbytes()
    for expert in range(w.shape[0]):
        first = expert * per_expert
        assert torch.equal(rows[first : first + w.shape[1]], w[expert])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_contiguous_experts_are_one_row_block_each(dtype):
    w = torch.randn(3, 40, 64).to(dtype)
    rows, per_expert = warp_specialized._expert_rows(w)
    assert per_expert == 40 and rows.shape == (120, 64)
    _rows_match(w)


def test_the_halves_of_a_fused_gate_up_tensor_keep_its_expert_distance():
    fused = torch.randn(4, 2 * 24, 32).bfloat16()  # [E, 2I, H]
    gate, up = fused[:, :24], fused[:, 24:]
    for half in (gate, up):
        rows, per_expert = warp_specialized._expert_rows(half)
        assert per_expert == 48 and rows.shape == (3 * 48 + 24, 32)
        _rows_match(half)


def test_interleaved_gate_and_up_are_rows_twice_their_width_apart():
    """gpt-oss's gate_up_proj interleaves gate and up along 2I: with H as its unit-stride
    dimension (how the transformers adapter stores it), gate and up are every other row."""
    fused = torch.randn(4, 2 * 24, 32).bfloat16()  # [E, 2I, H], gate and up interleaved
    gate, up = fused[:, ::2], fused[:, 1::2]
    for half in (gate, up):
        rows, per_expert = warp_specialized._expert_rows(half)
        assert per_expert == 24 and rows.shape == (4 * 24, 32) and rows.stride() == (64, 1)
        _rows_match(half)


def test_weights_not_laid_out_as_rows_are_refused():
    w = torch.randn(2, 16, 64).bfloat16()
    assert (
        warp_specialized._expert_rows(w.transpose(1, 2)) is None
    )  # gpt-oss's [E, H, 2I] read along H
    assert warp_specialized._expert_rows(w[:, :, ::2]) is None  # every other column
    assert (
        warp_specialized._expert_rows(torch.randn(2, 16, 20).bfloat16()[..., :16]) is None
    )  # 40-byte rows
    assert warp_specialized._expert_rows(w[:0]) is None  # no experts
    assert (
        warp_specialized._expert_rows(torch.randn(2, 16, 12).bfloat16()) is None
    )  # 24-byte rows (TMA: 16)
    overlapping = w.as_strided((2, 16, 64), (8 * 64, 64, 1))  # experts sharing rows
    assert warp_specialized._expert_rows(overlapping) is None


def test_a_launch_on_weights_it_cannot_read_raises_before_anything_runs():
    """Direct callers of the launcher (the library asks `supported` first) get the weight's
    layout named, not a copy made behind their back nor a wrong descriptor."""
    from mok.kernels import host

    m, hidden, inter, experts = 128, 64, 32, 2
    cfg = warp_specialized.PING_PONG
    capacity = m // cfg.block_m + experts + 2
    tiles = host.RowTiles(
        torch.zeros(3, capacity, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        capacity,
        cfg.block_m,
    )
    rows, out = torch.zeros(m, hidden).bfloat16(), torch.zeros(m, inter).bfloat16()
    wide = torch.zeros(experts, inter, hidden + 4).bfloat16()  # 136-byte rows: not for TMA
    sliced = warp_specialized._RowsProblem(
        warp_specialized.DOWN.value, rows, wide[:, :, :hidden], out
    )
    with pytest.raises(ValueError, match="rows of one 2-D view"):
        warp_specialized._launch(sliced, tiles, cfg)
    fused = torch.zeros(experts, 2 * inter, hidden).bfloat16()
    mixed = warp_specialized._RowsProblem(
        warp_specialized.GATE_UP_SWIGLU.value,
        rows,
        fused[:, :inter],
        out,
        w2=fused[:, inter:].contiguous(),
        gate_up=torch.zeros(m, 2 * inter).bfloat16(),
    )
    with pytest.raises(ValueError, match="rows apart"):
        warp_specialized._launch(mixed, tiles, cfg)
