"""The A-row sources and epilogues the fused kernel is to be built from, in the tl kernels (the
interpretable twins of the Gluon ones): rows gathered through an index, and the peer-store
epilogue with readiness counts and its bounded wait.

Ranks are simulated in one process as in `test_rows_kernels.py`: rank d's buffer is slice d of one
[ep, R, N] tensor, reached through a peer-offset table. On the CPU the kernels run under the
interpreter in fp32; on a GPU the same tests run in bf16. A gathered product must equal the same
product on the rows gathered first bit for bit (only the addresses differ, not the arithmetic).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mok.kernels import grouped_gemm as gg
from mok.kernels.grouped_gemm import GemmTiles, RowScatter, row_tile_map
from mok.kernels.sync import INTERPRETER_SLOWDOWN, OUT_OF_STEP, TIMED_OUT, await_counts, new_status

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
CFG = GemmTiles(32, 32, 32, num_warps=4, num_stages=2)
SENTINEL = -7.0
"""Planted in every destination row: a row the epilogue must not write keeps it."""


def operands(sizes, hidden, inter, source_rows, seed):
    """(rows [S, K], w_down [E, H, I], w_gate, w_up [E, I, H], group offsets) of random data; the
    source holds S rows, S >= every index."""
    gen = torch.Generator().manual_seed(seed)
    experts = len(sizes)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, DTYPE)

    offsets = torch.tensor([0, *sizes]).cumsum(0).to(torch.int32).to(DEVICE)
    return (
        randn(source_rows, inter),
        randn(source_rows, hidden),
        randn(experts, hidden, inter),
        randn(experts, inter, hidden),
        randn(experts, inter, hidden),
        offsets,
    )


def random_index(m: int, source_rows: int, seed: int) -> torch.Tensor:
    """[M] int32 indices into S source rows, with repeats (a token routed to several experts)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, source_rows, (m,), generator=gen, dtype=torch.int32).to(DEVICE)


group_sizes = st.lists(st.integers(0, 70), min_size=1, max_size=4).filter(lambda s: sum(s) > 0)


@given(
    sizes=group_sizes,
    hidden=st.sampled_from([32, 48, 72]),
    inter=st.sampled_from([32, 40, 96]),
    extra_sources=st.integers(0, 9),
    seed=st.integers(0, 2**16),
)
def test_gathered_rows_give_the_product_of_the_rows_gathered_first(
    sizes, hidden, inter, extra_sources, seed
):
    """Bugs caught: a gathered row read from the wrong source row or column (an index off by one,
    a stride in elements mistaken for rows), columns past K not masked, a tail tile's rows past M
    reading out of bounds, and gate/up and down disagreeing on which source they read."""
    m = sum(sizes)
    s = max(1, m // 2) + extra_sources
    h_src, x_src, w_down, w_gate, w_up, offsets = operands(sizes, hidden, inter, s, seed)
    index = random_index(m, s, seed)
    tiles = row_tile_map(offsets, m, CFG.block_m)
    gathered = gg.down(h_src, w_down, tiles, CFG, source_rows=index)
    first = gg.down(h_src[index.long()].contiguous(), w_down, tiles, CFG)
    assert torch.equal(gathered, first)
    h, gate_up = gg.gate_up_swiglu(x_src, w_gate, w_up, tiles, None, True, CFG, source_rows=index)
    h_first, gate_up_first = gg.gate_up_swiglu(
        x_src[index.long()].contiguous(), w_gate, w_up, tiles, None, True, CFG
    )
    assert torch.equal(h, h_first) and torch.equal(gate_up, gate_up_first)


def scatter_case(m: int, ep: int, rank: int, hidden: int, capacity: int, seed: int):
    """A RowScatter of M rows to `ep` simulated ranks: distinct destination rows per rank (some
    rows dropped with -1), every destination buffer full of SENTINEL, counts zero."""
    gen = torch.Generator().manual_seed(seed + 2)
    dest_rank = torch.randint(0, ep, (m,), generator=gen, dtype=torch.int32)
    dest_row = torch.full((m,), -1, dtype=torch.int32)
    for d in range(ep):
        mine = (dest_rank == d).nonzero().flatten()
        slots = torch.randperm(capacity, generator=gen)[: mine.numel()].to(torch.int32)
        dest_row[mine] = slots
    dropped = torch.rand(m, generator=gen) < 0.1
    dest_row[dropped] = -1
    buffers = torch.full((ep, capacity, hidden), SENTINEL, dtype=DTYPE, device=DEVICE)
    counts = torch.zeros(ep, ep, dtype=torch.int32, device=DEVICE)

    def table(per_rank: int) -> torch.Tensor:
        offsets = [(d - rank) * per_rank for d in range(ep)]
        return torch.tensor(offsets, dtype=torch.int64, device=DEVICE)

    scatter = RowScatter(
        out=buffers[rank],
        out_offsets=table(capacity * hidden),
        dest_rank=dest_rank.to(DEVICE),
        dest_row=dest_row.to(DEVICE),
        counts=counts[rank],
        counts_offsets=table(ep),
        rank=rank,
    )
    return scatter, buffers, counts


def expected_scatter(values, scatter, buffers_shape, n_tiles):
    """The buffers and counts the peer-store epilogue must leave, from a locally stored result."""
    ep, capacity, hidden = buffers_shape
    buffers = torch.full(buffers_shape, SENTINEL, dtype=DTYPE, device=DEVICE)
    counts = torch.zeros(ep, ep, dtype=torch.int32, device=DEVICE)
    for r in range(values.shape[0]):
        d, row = int(scatter.dest_rank[r]), int(scatter.dest_row[r])
        if row >= 0:
            buffers[d, row] = values[r]
            counts[d, scatter.rank] += n_tiles
    return buffers, counts


@given(
    sizes=group_sizes,
    ep=st.integers(1, 3),
    hidden=st.sampled_from([32, 72]),
    seed=st.integers(0, 2**16),
    gather=st.booleans(),
)
def test_down_scatter_stores_each_row_at_its_destination_and_counts_it(
    sizes, ep, hidden, seed, gather
):
    """Bugs caught: a row sent to the wrong rank or row (peer-offset or index mix-up), a dropped
    row (-1) stored anyway, a tail tile writing rows past its group, columns past N written into
    the next row, a count that misses a column tile, counts one rank's rows under another's, or
    adds rows it skipped."""
    inter = 40
    m = sum(sizes)
    rank = ep - 1
    h, _, w_down, _, _, offsets = operands(sizes, hidden, inter, m, seed)
    tiles = row_tile_map(offsets, m, CFG.block_m)
    index = random_index(m, m, seed) if gather else None
    values = gg.down(h, w_down, tiles, CFG, source_rows=index)
    scatter, buffers, counts = scatter_case(m, ep, rank, hidden, m + 5, seed)
    gg.down_scatter(h, w_down, tiles, CFG, scatter, source_rows=index)
    n_tiles = -(-hidden // CFG.block_n)
    want_buffers, want_counts = expected_scatter(values, scatter, buffers.shape, n_tiles)
    assert torch.equal(buffers, want_buffers)
    assert torch.equal(counts, want_counts)


WAIT_S = 0.2
TIMEOUT_S = WAIT_S if DEVICE.type == "cuda" else WAIT_S / INTERPRETER_SLOWDOWN


def test_await_counts_passes_once_every_count_is_complete():
    """Bug caught: a wait that passes before its counts are complete, or never passes."""
    counts = torch.tensor([6, 0, 3], dtype=torch.int32, device=DEVICE)
    status = new_status(DEVICE)
    await_counts(counts, counts.clone(), status, 1000.0, wait_id=4)
    assert status.tolist() == [0, 0, 0, 0]


def test_await_counts_gives_up_on_a_short_count_and_names_it():
    """Bug caught: an unbounded wait on rows that never come (a peer that skipped its call)."""
    counts = torch.tensor([6, 2, 3], dtype=torch.int32, device=DEVICE)
    expected = torch.tensor([6, 5, 3], dtype=torch.int32, device=DEVICE)
    status = new_status(DEVICE)
    await_counts(counts, expected, status, TIMEOUT_S, wait_id=4)
    assert status.tolist() == [TIMED_OUT, 4, 1, 3]


def test_await_counts_finds_a_count_past_its_expected_value_at_once():
    """Bug caught: more rows arriving than routed (diverged calls) mistaken for completeness."""
    counts = torch.tensor([6, 9, 3], dtype=torch.int32, device=DEVICE)
    expected = torch.tensor([6, 5, 2], dtype=torch.int32, device=DEVICE)
    status = new_status(DEVICE)
    await_counts(counts, expected, status, 1000.0, wait_id=2)
    assert status.tolist() == [OUT_OF_STEP, 2, 1, 4]


def test_bad_scatter_and_index_arguments_raise_naming_the_field():
    """Bug caught: a mis-shaped destination table reaching the kernel (out-of-bounds stores)."""
    sizes = [20, 12]
    h, _, w_down, _, _, offsets = operands(sizes, 32, 40, 32, 0)
    tiles = row_tile_map(offsets, 32, CFG.block_m)
    scatter, _, _ = scatter_case(32, 2, 0, 32, 40, 0)
    short = RowScatter(**{**scatter.__dict__, "dest_row": scatter.dest_row[:-1]})
    with pytest.raises(ValueError, match="dest_row"):
        gg.down_scatter(h, w_down, tiles, CFG, short)
    with pytest.raises(ValueError, match="source_rows"):
        gg.down(
            h, w_down, tiles, CFG, source_rows=torch.zeros(32, dtype=torch.int64, device=DEVICE)
        )
    with pytest.raises(ValueError, match="await_counts"):
        await_counts(scatter.counts, scatter.dest_row[:3], new_status(DEVICE), 1.0, wait_id=0)
