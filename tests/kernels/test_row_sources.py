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
from mok.kernels import host
from mok.kernels.grouped_gemm import row_tile_map
from mok.kernels.host import GemmTiles, RowScatter
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


@given(
    sizes=st.lists(st.integers(0, 70), min_size=1, max_size=4),
    hidden=st.sampled_from([32, 48, 72]),
    inter=st.sampled_from([32, 40]),
    padding=st.integers(0, 5),
    accumulate=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gathered_weight_gradient_equals_it_on_the_rows_gathered_first(
    sizes, hidden, inter, padding, accumulate, seed
):
    """The gate/up weight gradient reading its rows through an index (the tokens each owner
    received, once each) equals it on the grouped rows copied out first, bit for bit, zeros for
    a negative index included. Bugs caught: a step's rows taken from the tile's or the buffer's
    first row instead of the group's (an offset lost in the tile function's new argument), rows
    past a group's end or outside the groups read (NaN in the source and in the index's padding
    would reach the sum), a negative index read out of bounds instead of as zeros, the gate and
    up halves reading different rows, and an empty expert's accumulation buffer touched."""
    m = padding + sum(sizes) + padding
    s = max(1, sum(sizes) // 2) + 3
    gen = torch.Generator().manual_seed(seed)
    source = torch.randn(s, hidden, generator=gen).to(DEVICE, DTYPE)
    source[-1] = float("nan")  # a token no grouped row points at
    index = torch.randint(0, s - 1, (m,), generator=gen, dtype=torch.int32)
    index[torch.rand(m, generator=gen) < 0.1] = -1  # a pair whose token was dropped: zeros
    index[:padding] = s - 1  # rows outside the groups: never read
    index[m - padding :] = s - 1
    index = index.to(DEVICE)
    grad_gate_up = torch.randn(m, 2 * inter, generator=gen).to(DEVICE, DTYPE)
    offsets = (torch.tensor([0, *sizes]).cumsum(0) + padding).to(torch.int32).to(DEVICE)
    grouped = torch.where(
        (index >= 0)[:, None], source[index.clamp(min=0).long()], torch.zeros((), dtype=DTYPE)
    ).to(DEVICE)
    experts = len(sizes)
    initial = torch.randn(2, experts, inter, hidden, generator=gen).to(DEVICE, DTYPE)
    results = []
    for rows, source_rows in ((source, index), (grouped.contiguous(), None)):
        grads = initial.clone()
        gg.gate_up_wgrad(
            grad_gate_up,
            rows,
            offsets,
            grads[0],
            grads[1],
            accumulate,
            accumulate,
            CFG,
            source_rows=source_rows,
        )
        results.append(grads)
    gathered, first = results
    assert not gathered.isnan().any()
    assert torch.equal(gathered, first)


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


def landed_flags(rows: int, block_rows: int, epoch: int, missing: int | None = None):
    """Flags of `rows` rows in blocks, all carrying `epoch` except block `missing` (one behind)."""
    flags = torch.full((-(-rows // block_rows),), epoch, dtype=torch.int32, device=DEVICE)
    if missing is not None:
        flags[missing] = epoch - 1
    return flags


@pytest.mark.parametrize("block_rows", [8, 32, 48])
def test_gate_up_waiting_on_landed_rows_computes_what_it_computes_without(block_rows):
    """Bug caught: the readiness wait reading the wrong flags (a tile never starting, or the
    wait reaching past the flags of the last block) or disturbing the product."""
    sizes = [37, 0, 61, 5]
    m = sum(sizes)
    _, x, _, w_gate, w_up, offsets = operands(sizes, 48, 32, m, seed=3)
    tiles = row_tile_map(offsets, m, CFG.block_m)
    epoch = torch.full((1,), 5, dtype=torch.int32, device=DEVICE)
    status = new_status(DEVICE)
    ready = host.RowsReady(landed_flags(m, block_rows, 5), block_rows, epoch, status, 1000.0, 9)
    h, gate_up = gg.gate_up_swiglu(x, w_gate, w_up, tiles, 2.0, True, CFG, ready=ready)
    h_plain, gate_up_plain = gg.gate_up_swiglu(x, w_gate, w_up, tiles, 2.0, True, CFG)
    assert torch.equal(h, h_plain) and torch.equal(gate_up, gate_up_plain)
    assert status.tolist() == [0, 0, 0, 0]


def test_gate_up_gives_up_on_rows_that_never_land_and_names_their_block():
    """Bug caught: a tile waiting forever on a block that never lands (no bound), or a failure
    recorded under the wrong wait or block."""
    sizes = [40, 30]
    m = sum(sizes)
    _, x, _, w_gate, w_up, offsets = operands(sizes, 48, 32, m, seed=4)
    tiles = row_tile_map(offsets, m, CFG.block_m)
    epoch = torch.full((1,), 3, dtype=torch.int32, device=DEVICE)
    status = new_status(DEVICE)
    ready = host.RowsReady(landed_flags(m, 16, 3, missing=2), 16, epoch, status, TIMEOUT_S, 9)
    gg.gate_up_swiglu(x, w_gate, w_up, tiles, None, False, CFG, ready=ready)
    assert status.tolist() == [TIMED_OUT, 9, 2, 2]


def test_rows_ready_checks_its_flags():
    """Bug caught: flags too few for the rows (a tile waiting on memory past them)."""
    epoch = torch.ones(1, dtype=torch.int32, device=DEVICE)
    ready = host.RowsReady(landed_flags(40, 16, 1), 16, epoch, new_status(DEVICE), 1.0, 0)
    with pytest.raises(ValueError, match="RowsReady.flags"):
        ready.check(49)


@pytest.mark.parametrize("count", [0, 1, 31, 32, 70])
def test_copy_rows_flags_exactly_the_tiles_it_wrote(count):
    """Bug caught: a tile flagged before (or without) its rows, a flag for rows past the count
    (a product would read rows never written), flags of another epoch."""
    from mok.kernels.rows import copy_rows

    rows, hidden, block = 80, 24, 16
    gen = torch.Generator().manual_seed(count)
    src = torch.randn(50, hidden, generator=gen).to(DEVICE, DTYPE)
    src_row = torch.randint(0, 50, (rows,), generator=gen).to(DEVICE)
    dst = torch.full((rows, hidden), SENTINEL, dtype=DTYPE, device=DEVICE)
    landed = torch.full((rows // block,), -1, dtype=torch.int32, device=DEVICE)
    epoch = torch.full((1,), 11, dtype=torch.int32, device=DEVICE)
    total = torch.full((1,), count, dtype=torch.int64, device=DEVICE)
    copy_rows(dst, src, src_row, total, 3, block, epoch=epoch, landed=landed)
    written = -(-count // block)
    assert landed[:written].tolist() == [11] * written
    assert landed[written:].tolist() == [-1] * (rows // block - written)
    assert torch.equal(dst[:count], src[src_row[:count]])
    assert bool((dst[count:] == SENTINEL).all())


def _hopper() -> bool:
    return DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE)[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernels need a Hopper GPU")
@pytest.mark.parametrize("cooperative", [False, True], ids=["ping-pong", "cooperative"])
def test_warp_specialized_gate_up_waits_like_its_twin(cooperative):
    """The Gluon loader's readiness wait: with every block landed, the tl twin's result bit for
    bit; with one block missing, a bounded wait that names it (no hang, no trap)."""
    from mok.kernels import warp_specialized

    cfg = warp_specialized.SWIGLU_COOPERATIVE if cooperative else warp_specialized.SWIGLU_PING_PONG
    sizes = [300, 0, 77, 129]
    m = sum(sizes)
    _, x, _, w_gate, w_up, offsets = operands(sizes, 256, 128, m, seed=5)
    tiles = row_tile_map(offsets, m, cfg.block_m)
    epoch = torch.full((1,), 7, dtype=torch.int32, device=DEVICE)
    status = new_status(DEVICE)
    ready = host.RowsReady(landed_flags(m, 32, 7), 32, epoch, status, 1000.0, 9)
    h, gate_up = warp_specialized.gate_up_swiglu(
        x, w_gate, w_up, tiles, 3.0, True, cfg, ready=ready
    )
    twin_cfg = GemmTiles(cfg.block_m, cfg.block_n, cfg.block_k, num_warps=4, num_stages=3)
    twin_tiles = row_tile_map(offsets, m, twin_cfg.block_m)
    h_twin, gate_up_twin = gg.gate_up_swiglu(x, w_gate, w_up, twin_tiles, 3.0, True, twin_cfg)
    assert torch.equal(h, h_twin) and torch.equal(gate_up, gate_up_twin)
    assert status.tolist() == [0, 0, 0, 0]
    missing = host.RowsReady(landed_flags(m, 32, 7, missing=12), 32, epoch, status, 0.05, 9)
    warp_specialized.gate_up_swiglu(x, w_gate, w_up, tiles, 3.0, False, cfg, ready=missing)
    assert status.tolist() == [TIMED_OUT, 9, 12, 6]
