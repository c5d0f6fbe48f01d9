"""The warp-specialized Gluon grouped GEMM (Hopper) against its interpretable twin and fp32 math.

Gluon does not run under the interpreter, so these are GPU tests. The twin is `grouped_gemm.down`
(the tl kernel the CPU tests cover); the two walk the same reduction in the same BLOCK_K-step
order with fp32 accumulators, so on a group's rows they must agree bit for bit. Bugs these catch:
a wrong ring slot or barrier phase (stale or mixed operand tiles: O(1) errors, a hang that the
pytest timeout turns into a failure, or a kernel fault), consumers running out of turn, a tile's
tail rows written into the next group, a weight tile read from the wrong expert, columns or
reduction steps past N or K not dropped.
"""

from __future__ import annotations

import pytest
import torch

from mok.kernels import grouped_gemm as gg
from mok.kernels import host
from mok.kernels.grouped_gemm import row_tile_map
from mok.kernels.host import GemmTiles
from mok.testing import relative_error

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


ROWS_TILINGS = {
    # 64-row tiles: the consumers alternate (ping-pong); 128-row tiles: both on each (cooperative).
    "64x256": GemmTiles(64, 256, 64, num_warps=4, num_stages=4),
    "128x128": GemmTiles(128, 128, 64, num_warps=4, num_stages=4),
    "128x256": GemmTiles(128, 256, 64, num_warps=4, num_stages=3),
}

CASES = {
    # name: (group sizes, N (output features), K (reduction))
    "uniform": ([300, 257, 128, 511], 384, 256),
    "empty and one-row groups": ([0, 1, 0, 640, 0, 3], 256, 128),
    "all rows on one expert": ([0, 0, 1000, 0], 256, 192),
    "N and K not tile multiples": ([200, 77, 129], 200, 80),
    "fewer rows than a tile": ([5, 9], 128, 64),
    "many short groups": ([37] * 40, 128, 128),
    # More tasks than programs and more reduction steps than ring slots: both consumers of every
    # program run several tiles, and the ring wraps many times within one tile.
    "several tiles per consumer": ([5000, 0, 7000, 3003, 1], 512, 1024),
}


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("tiles", list(ROWS_TILINGS))
@pytest.mark.parametrize("name", list(CASES))
def test_down_matches_its_twin_bitwise(name, tiles):
    from mok.kernels import warp_specialized

    sizes, n, k = CASES[name]
    cfg = ROWS_TILINGS[tiles]
    bm = cfg.block_m
    gen = torch.Generator(device="cuda").manual_seed(0)
    before, after = 3, 5  # rows outside every group, which must stay untouched
    m = before + sum(sizes) + after
    rows = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    weights = (torch.randn(len(sizes), n, k, generator=gen, device="cuda") * k**-0.5).bfloat16()
    offsets = (torch.tensor([0, *sizes], device="cuda").cumsum(0) + before).to(torch.int32)
    tiles_map = row_tile_map(offsets, m, bm)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    warp_specialized.down(rows, weights, tiles_map, cfg, out=out)
    twin = gg.down(rows, weights, tiles_map, GemmTiles(bm, 128, 64, num_warps=4, num_stages=3))
    inside = slice(before, before + sum(sizes))
    assert torch.equal(out[inside], twin[inside])
    assert out[:before].isnan().all() and out[inside.stop :].isnan().all()
    expected = torch.cat(
        [
            rows[start:end].float() @ weights[e].float().T
            for e, (start, end) in enumerate(
                zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
            )
        ]
    )
    # fp32 accumulation, one bf16 rounding of the result: 2^-9 relative per element at most.
    assert relative_error(out[inside], expected) < 4e-3


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_down_is_repeatable_and_handles_no_rows():
    from mok.kernels import warp_specialized

    gen = torch.Generator(device="cuda").manual_seed(1)
    sizes = [700, 0, 1500, 33]
    m, n, k = sum(sizes), 512, 384
    rows = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    weights = torch.randn(len(sizes), n, k, generator=gen, device="cuda").bfloat16()
    offsets = torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32)
    tiles_map = row_tile_map(offsets, m, warp_specialized.PING_PONG.block_m)
    first = warp_specialized.down(rows, weights, tiles_map)
    assert all(
        torch.equal(first, warp_specialized.down(rows, weights, tiles_map)) for _ in range(3)
    )
    empty = torch.zeros(len(sizes) + 1, dtype=torch.int32, device="cuda")
    none = warp_specialized.down(
        rows[:0], weights, row_tile_map(empty, 0, warp_specialized.PING_PONG.block_m)
    )
    assert none.shape == (0, n)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("tiles", ["ping-pong", "cooperative"])
@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("name", list(CASES))
def test_gate_up_swiglu_matches_its_twin_bitwise(name, limit, tiles):
    """h and the saved pre-activations (with the clamp-preserving rounding) of the dual kernel
    equal the tl kernel's bit for bit; a swapped gate/up, a clamp applied to the wrong operand or
    a pre-activation saved into the other half of gate | up would not; nor would a cooperative
    consumer computing or storing the other one's rows."""
    from mok.kernels import warp_specialized

    sizes, inter, hidden = CASES[name]
    cfg = (
        warp_specialized.SWIGLU_PING_PONG
        if tiles == "ping-pong"
        else warp_specialized.SWIGLU_COOPERATIVE
    )
    gen = torch.Generator(device="cuda").manual_seed(2)
    before, after = 2, 7
    m = before + sum(sizes) + after
    rows = torch.randn(m, hidden, generator=gen, device="cuda").bfloat16()
    scale = hidden**-0.5 * (4.0 if limit else 1.0)  # pre-activations past the clamp often
    w_gate = (
        torch.randn(len(sizes), inter, hidden, generator=gen, device="cuda") * scale
    ).bfloat16()
    w_up = (torch.randn(len(sizes), inter, hidden, generator=gen, device="cuda") * scale).bfloat16()
    offsets = (torch.tensor([0, *sizes], device="cuda").cumsum(0) + before).to(torch.int32)
    tiles_map = row_tile_map(offsets, m, cfg.block_m)
    h, gate_up = warp_specialized.gate_up_swiglu(rows, w_gate, w_up, tiles_map, limit, True, cfg)
    twin_cfg = GemmTiles(cfg.block_m, 128, 64, num_warps=4, num_stages=3)
    twin_h, twin_gate_up = gg.gate_up_swiglu(rows, w_gate, w_up, tiles_map, limit, True, twin_cfg)
    inside = slice(before, before + sum(sizes))
    assert torch.equal(h[inside], twin_h[inside])
    assert torch.equal(gate_up[inside], twin_gate_up[inside])
    if limit is not None and sum(sizes) > 100:
        assert (gate_up[inside].float().abs() > limit).float().mean() > 0.05  # the clamp is active
    h_only, none = warp_specialized.gate_up_swiglu(rows, w_gate, w_up, tiles_map, limit, False, cfg)
    assert none is None and torch.equal(h_only[inside], h[inside])


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("tiles", ["ping-pong", "cooperative"])
@pytest.mark.parametrize("name", ["N and K not tile multiples", "several tiles per consumer"])
def test_gate_up_products_read_the_halves_of_one_fused_weight(name, tiles):
    """W_gate and W_up as the two halves of one [E, 2I, H] tensor (how Hugging Face models hold
    gate_up_proj) go to the Gluon kernels, forward (gate/up + SwiGLU) and data gradient, equal
    to the tl twins on the same views bit for bit. Catches an expert's weight rows taken at
    e * I instead of e * 2I (the other half's or another expert's weights), a descriptor that
    runs past the fused tensor's storage (the last expert's up half), and a silent copy."""
    from mok.kernels import warp_specialized

    sizes, inter, hidden = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(21)
    m, offsets, inside = _groups(sizes, before=2, after=7)
    rows = torch.randn(m, hidden, generator=gen, device="cuda").bfloat16()
    fused = (
        torch.randn(len(sizes), 2 * inter, hidden, generator=gen, device="cuda") * hidden**-0.5
    ).bfloat16()
    w_gate, w_up = fused[:, :inter], fused[:, inter:]
    assert warp_specialized.supported(rows, w_gate, w_up)
    assert not warp_specialized.supported(
        rows, w_gate, fused[:, :inter].contiguous()
    )  # rows apart differ
    cfg = (
        warp_specialized.SWIGLU_PING_PONG
        if tiles == "ping-pong"
        else warp_specialized.SWIGLU_COOPERATIVE
    )
    tiles_map = row_tile_map(offsets, m, cfg.block_m)
    h, gate_up = warp_specialized.gate_up_swiglu(rows, w_gate, w_up, tiles_map, 0.75, True, cfg)
    twin_cfg = GemmTiles(cfg.block_m, 128, 64, num_warps=4, num_stages=3)
    twin_h, twin_gate_up = gg.gate_up_swiglu(rows, w_gate, w_up, tiles_map, 0.75, True, twin_cfg)
    assert torch.equal(h[inside], twin_h[inside])
    assert torch.equal(gate_up[inside], twin_gate_up[inside])
    dgrad_cfg = (
        warp_specialized.SHORT_DGRAD_TILES if tiles == "ping-pong" else warp_specialized.DGRAD_TILES
    )
    if inter % dgrad_cfg.gate_up.block_k == 0:
        assert warp_specialized.dgrad_supported(gate_up, dgrad_cfg.gate_up, w_gate, w_up)
        bm = dgrad_cfg.gate_up.block_m
        grad_x = warp_specialized.gate_up_dgrad(
            gate_up, w_gate, w_up, row_tile_map(offsets, m, bm), dgrad_cfg.gate_up
        )
        twin_cfg = GemmTiles(128, 128, 64, num_warps=8, num_stages=3)
        twin = gg.gate_up_dgrad(gate_up, w_gate, w_up, row_tile_map(offsets, m, 128), twin_cfg)
        assert torch.equal(grad_x[inside], twin[inside])


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_the_expert_mlp_forward_runs_it_with_the_tl_results():
    """On Hopper the default config sends both forward products to the Gluon kernels, with the
    tl path's results bit for bit (h and the saved pre-activations too), W_gate and W_up as
    views of one [E, 2I, H] tensor included, and W_down as a slice of wider rows (rows spaced
    evenly, read in place); where the experts lie a whole number of rows plus 16 bytes apart (no
    one 2-D view holds their rows), W_down falls back to tl."""
    import dataclasses

    from mok.kernels import default_config, expert_mlp_forward, warp_specialized

    gen = torch.Generator(device="cuda").manual_seed(3)
    sizes, hidden, inter = [400, 0, 129, 700], 256, 192
    m = sum(sizes)
    rows = torch.randn(m, hidden, generator=gen, device="cuda").bfloat16()
    w_gate, w_up = (
        (torch.randn(4, inter, hidden, generator=gen, device="cuda") * hidden**-0.5).bfloat16()
        for _ in range(2)
    )
    padded = torch.randn(4, hidden, inter + 16, generator=gen, device="cuda") * inter**-0.5
    w_down_view = padded.bfloat16()[:, :, :inter]  # rows 416 bytes apart
    w_down = w_down_view.contiguous()
    gap = hidden * inter + 8  # elements from one expert's first row to the next's
    odd_rows = torch.empty(4 * gap, device="cuda").bfloat16()
    odd_rows = odd_rows.as_strided(w_down.shape, (gap, inter, 1))
    odd_rows.copy_(w_down)
    offsets = torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32)
    fused = torch.cat([w_gate, w_up], 1)  # [E, 2I, H]: gate and up as views of one tensor
    cfg = default_config(rows.device, hidden, inter, m / 4)
    assert cfg.gluon.down is not None and cfg.gluon.gate_up is not None
    tl_only = dataclasses.replace(
        cfg, gluon=dataclasses.replace(cfg.gluon, down=None, gate_up=None)
    )
    gluon, saved = expert_mlp_forward(rows, offsets, w_gate, w_up, w_down, config=cfg)
    tl, tl_saved = expert_mlp_forward(rows, offsets, w_gate, w_up, w_down, config=tl_only)
    assert warp_specialized.supported(rows, fused[:, :inter], fused[:, inter:])
    assert warp_specialized.supported(rows, w_down_view) and not warp_specialized.supported(
        rows, odd_rows
    )
    in_place, _ = expert_mlp_forward(
        rows, offsets, fused[:, :inter], fused[:, inter:], w_down_view, config=cfg
    )
    fallback, _ = expert_mlp_forward(rows, offsets, w_gate, w_up, odd_rows, config=cfg)
    assert torch.equal(gluon, tl) and torch.equal(in_place, tl) and torch.equal(fallback, tl)
    assert torch.equal(saved.h, tl_saved.h) and torch.equal(saved.gate_up, tl_saved.gate_up)


DGRAD_CASES = {
    # The data gradients' reductions run over whole BLOCK_K steps of each expert's weights.
    **{name: case for name, case in CASES.items() if case[2] % 64 == 0},
    "N not a tile multiple": ([200, 77, 129], 200, 128),
}


def _groups(sizes, before, after):
    """(M, offsets, the rows inside the groups) for groups after `before` rows, then `after`."""
    m = before + sum(sizes) + after
    offsets = (torch.tensor([0, *sizes], device="cuda").cumsum(0) + before).to(torch.int32)
    return m, offsets, slice(before, before + sum(sizes))


SOURCE_CASES = {
    # name: (group sizes, N, K, source rows S)
    "uniform, repeated sources": ([300, 257, 128, 511], 384, 256, 400),
    "empty and one-row groups": ([0, 1, 0, 640, 0, 3], 256, 136, 700),
    "N and K not tile multiples": ([200, 77, 129], 200, 80, 50),
    "several tiles per consumer": ([5000, 0, 3003, 1], 512, 1024, 9000),
}


def _source_case(name, gen):
    """(rows [S, K], a random index [M] int32 into them with repeats, group offsets, N)."""
    sizes, n, k, sources = SOURCE_CASES[name]
    m = sum(sizes)
    rows = torch.randn(sources, k, generator=gen, device="cuda").bfloat16()
    index = torch.randint(0, sources, (m,), generator=gen, device="cuda", dtype=torch.int32)
    offsets = torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32)
    return rows, index, offsets, n


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("tiles", ["64x256", "128x256"])
@pytest.mark.parametrize("name", list(SOURCE_CASES))
def test_gathered_down_and_gate_up_equal_the_rows_gathered_first(name, tiles):
    """The gathering A source (cp.async through the index, into the ring's swizzled slots) against
    TMA tiles of the rows gathered beforehand, and against the tl twin's gather: bitwise. Bugs
    caught: a cp.async piece in the wrong swizzled place, a slot released before its copies
    landed (the barrier counting of cp.async arrivals), a missing proxy fence (wgmma reading stale
    shared memory), rows past M or columns past K not zero, chunks of 16 rows mixed up."""
    from mok.kernels import warp_specialized

    gen = torch.Generator(device="cuda").manual_seed(5)
    rows, index, offsets, n = _source_case(name, gen)
    m, k = index.shape[0], rows.shape[1]
    cfg = ROWS_TILINGS[tiles]
    tiles_map = row_tile_map(offsets, m, cfg.block_m)
    weights = torch.randn(offsets.numel() - 1, n, k, generator=gen, device="cuda") * k**-0.5
    weights = weights.bfloat16()
    first = rows[index.long()].contiguous()
    gathered = warp_specialized.down(rows, weights, tiles_map, cfg, source_rows=index)
    assert torch.equal(gathered, warp_specialized.down(first, weights, tiles_map, cfg))
    twin_cfg = GemmTiles(cfg.block_m, 128, 64, num_warps=4, num_stages=3)
    twin = gg.down(rows, weights, tiles_map, twin_cfg, source_rows=index)
    assert torch.equal(gathered, twin)
    swiglu_cfg = (
        warp_specialized.SWIGLU_PING_PONG
        if cfg.block_m == 64
        else warp_specialized.SWIGLU_COOPERATIVE
    )
    w_up = weights.flip(0).contiguous()
    swiglu_map = row_tile_map(offsets, m, swiglu_cfg.block_m)
    h, gate_up = warp_specialized.gate_up_swiglu(
        rows, weights, w_up, swiglu_map, None, True, swiglu_cfg, source_rows=index
    )
    h_first, gate_up_first = warp_specialized.gate_up_swiglu(
        first, weights, w_up, swiglu_map, None, True, swiglu_cfg
    )
    assert torch.equal(h, h_first) and torch.equal(gate_up, gate_up_first)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("gather", [False, True], ids=["tma rows", "gathered rows"])
@pytest.mark.parametrize("tiles", ["64x256", "128x256"])
@pytest.mark.parametrize("name", list(SOURCE_CASES))
def test_down_scatter_matches_its_twin(name, tiles, gather, bias):
    """The peer-store epilogue against the tl twin's (`grouped_gemm.down_scatter`): the same rows
    in the same places of two simulated ranks' buffers (one GPU), nothing else written, and the
    same readiness counts. Bugs caught: a row to the wrong rank or row, dropped rows (-1) stored,
    a tail tile storing past its group, a count added by every thread of a row instead of once
    per tile and rank, or missing for the second consumer's rows; with an expert bias (gpt-oss),
    the bias lost or taken from another expert before the store."""
    from mok.kernels import warp_specialized

    gen = torch.Generator(device="cuda").manual_seed(6)
    rows, index, offsets, n = _source_case(name, gen)
    m, k = index.shape[0], rows.shape[1]
    if not gather:
        rows = rows[index.long()].contiguous()
    cfg = ROWS_TILINGS[tiles]
    tiles_map = row_tile_map(offsets, m, cfg.block_m)
    weights = torch.randn(offsets.numel() - 1, n, k, generator=gen, device="cuda") * k**-0.5
    weights = weights.bfloat16()
    experts = offsets.numel() - 1
    expert_bias = torch.randn(experts, n, generator=gen, device="cuda").bfloat16() if bias else None
    ep, rank, capacity = 2, 1, m + 8
    dest_rank = torch.randint(0, ep, (m,), generator=gen, device="cuda", dtype=torch.int32)
    order = torch.randperm(2 * capacity, generator=gen, device="cuda")
    dest_row = (order[:m] % capacity).to(torch.int32)  # distinct within a rank, mostly
    dest_row[torch.rand(m, generator=gen, device="cuda") < 0.1] = -1
    results = []
    for kernel in ("gluon", "tl"):
        buffers = torch.full((ep, capacity, n), float("nan"), device="cuda").bfloat16()
        counts = torch.zeros(ep, ep, dtype=torch.int32, device="cuda")
        scatter = host.RowScatter(
            out=buffers[rank],
            out_offsets=torch.tensor([-capacity * n, 0], device="cuda"),
            dest_rank=dest_rank,
            dest_row=dest_row,
            counts=counts[rank],
            counts_offsets=torch.tensor([-ep, 0], device="cuda"),
            rank=rank,
        )
        source = index if gather else None
        if kernel == "gluon":
            warp_specialized.down_scatter(
                rows, weights, tiles_map, scatter, cfg, source_rows=source, bias=expert_bias
            )
        else:
            twin_cfg = GemmTiles(cfg.block_m, cfg.block_n, 64, num_warps=8, num_stages=3)
            gg.down_scatter(
                rows, weights, tiles_map, twin_cfg, scatter, source_rows=source, bias=expert_bias
            )
        results.append((buffers, counts))
    (buffers, counts), (twin_buffers, twin_counts) = results
    # Rows two grouped rows share (an index collision) differ by who wrote last; compare the rest.
    unique = torch.zeros(ep, capacity, dtype=torch.int32, device="cuda")
    kept = dest_row >= 0
    unique.index_put_(
        (dest_rank[kept].long(), dest_row[kept].long()),
        torch.ones_like(dest_row[kept]),
        accumulate=True,
    )
    single = (unique == 1)[..., None].expand_as(buffers)
    assert torch.equal(buffers[single], twin_buffers[single])
    assert buffers[unique == 0].isnan().all()
    n_tiles = -(-n // cfg.block_n)
    sent = torch.bincount(dest_rank[kept].long(), minlength=ep).to(torch.int32) * n_tiles
    assert counts[:, rank].tolist() == sent.tolist() == twin_counts[:, rank].tolist()
    assert not counts[:, 0].any()


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("tiles", ["64x256", "64x128", "128x256"])
@pytest.mark.parametrize("name", list(DGRAD_CASES))
def test_gate_up_dgrad_matches_its_twin_bitwise(name, tiles):
    """grad_x = grad_gate @ W_gate[e] + grad_up @ W_up[e] equals the tl kernel's at the same
    BLOCK_K bit for bit, zeros included in the rows outside every group (NaN there in the input),
    and fp32 math. Catches the two products' steps out of order or paired with the wrong weight,
    a step reading the next expert's weight rows, a ring position that ignores the doubled
    steps, and outside rows skipped or read."""
    from mok.kernels import warp_specialized

    sizes, hidden, inter = DGRAD_CASES[name]
    bm, bn = map(int, tiles.split("x"))
    cfg = GemmTiles(bm, bn, 64, num_warps=4, num_stages=3 if bm * bn > 64 * 256 else 4)
    gen = torch.Generator(device="cuda").manual_seed(8)
    m, offsets, inside = _groups(sizes, before=3, after=5)
    grad_gate_up = torch.randn(m, 2 * inter, generator=gen, device="cuda").bfloat16()
    grad_gate_up[: inside.start] = float("nan")
    grad_gate_up[inside.stop :] = float("nan")
    w_gate, w_up = (
        (
            torch.randn(len(sizes), inter, hidden, generator=gen, device="cuda") * inter**-0.5
        ).bfloat16()
        for _ in range(2)
    )
    assert warp_specialized.dgrad_supported(grad_gate_up, cfg, w_gate, w_up)
    grad_x = warp_specialized.gate_up_dgrad(
        grad_gate_up, w_gate, w_up, row_tile_map(offsets, m, bm), cfg
    )
    twin_cfg = GemmTiles(128, 128, 64, num_warps=8, num_stages=3)
    twin = gg.gate_up_dgrad(grad_gate_up, w_gate, w_up, row_tile_map(offsets, m, 128), twin_cfg)
    assert torch.equal(grad_x, twin)
    assert (grad_x[: inside.start] == 0).all() and (grad_x[inside.stop :] == 0).all()
    bounds = offsets.tolist()
    expected = torch.cat(
        [
            grad_gate_up[a:b, :inter].float() @ w_gate[e].float()
            + grad_gate_up[a:b, inter:].float() @ w_up[e].float()
            for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
        ]
    )
    assert relative_error(grad_x[inside], expected) < 4e-3


def _swiglu_gradients(grad_h, gate, up, limit):
    """fp32 autograd gradients of silu(min(gate, L)) * clamp(up, -L, L) (no clamp: L None)."""
    gate, up = gate.float().requires_grad_(), up.float().requires_grad_()
    g, u = (gate, up) if limit is None else (gate.clamp(max=limit), up.clamp(-limit, limit))
    h = torch.nn.functional.silu(g) * u
    return torch.autograd.grad(h, (gate, up), grad_h.float())


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("tiles", ["ping-pong", "cooperative"])
@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("name", list(DGRAD_CASES))
def test_down_dgrad_swiglu_matches_its_twin_bitwise(name, limit, tiles):
    """The gate | up gradients through W_down and the SwiGLU backward equal the tl kernel's bit
    for bit and autograd's in fp32 (with the clamp active on many elements). Catches the saved
    gate and up tiles fetched for the wrong rows or swapped, a fetch-barrier phase off by one
    (the previous tile's pre-activations), grad_h not rounded like h, a clamp mask flipped, and
    the gradients written into the wrong half of gate | up."""
    from mok.kernels import warp_specialized

    sizes, inter, hidden = DGRAD_CASES[name]
    cfg = (
        warp_specialized.DGRAD_SWIGLU_PING_PONG
        if tiles == "ping-pong"
        else warp_specialized.DGRAD_SWIGLU_COOPERATIVE
    )
    gen = torch.Generator(device="cuda").manual_seed(9)
    m, offsets, inside = _groups(sizes, before=2, after=7)
    grad_out = torch.randn(m, hidden, generator=gen, device="cuda").bfloat16()
    gate_up = torch.randn(m, 2 * inter, generator=gen, device="cuda").bfloat16()
    w_down = (
        torch.randn(len(sizes), hidden, inter, generator=gen, device="cuda") * hidden**-0.5
    ).bfloat16()
    assert warp_specialized.dgrad_supported(grad_out, cfg, w_down)
    ours = warp_specialized.down_dgrad_swiglu(
        grad_out, w_down, gate_up, row_tile_map(offsets, m, cfg.block_m), limit, cfg
    )
    twin_cfg = GemmTiles(128, 128, 64, num_warps=8, num_stages=4)
    twin = gg.down_dgrad_swiglu(
        grad_out, w_down, gate_up, row_tile_map(offsets, m, 128), limit, twin_cfg
    )
    assert torch.equal(ours[inside], twin[inside])
    bounds = offsets.tolist()
    expected = []
    for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        grad_h = (grad_out[a:b].float() @ w_down[e].float()).bfloat16()
        expected.append(torch.cat(_swiglu_gradients(grad_h, *gate_up[a:b].chunk(2, 1), limit), 1))
    assert relative_error(ours[inside], torch.cat(expected)) < 4e-3
    if limit is not None and sum(sizes) > 100:
        assert (gate_up[inside].float().abs() > limit).float().mean() > 0.05  # the clamp is active


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("tiles", ["ping-pong", "cooperative"])
@pytest.mark.parametrize("name", list(DGRAD_CASES))
def test_weighted_down_dgrad_matches_its_twin_and_the_rounding_points(name, tiles):
    """The router weights applied in the down dgrad's epilogue (`down_dgrad_swiglu_weighted`):
    the gradients and the weighted h equal the tl kernel's bit for bit, the dots to fp32
    summation order, and all of them `weighted_down_backward`'s rounding points far inside the
    distance to the other rounding (w applied to rounded rows before the product: ~2e-3).
    Catches w applied after the rounding of grad_h or to the rows, h read or written at another
    tile's rows or columns, a dot stored at the wrong column tile, rows past a group's end
    written, and the dots' rows outside the groups left unzeroed."""
    from mok.kernels import warp_specialized
    from mok.reference.expert import weighted_down_backward

    sizes, inter, hidden = DGRAD_CASES[name]
    cfg = (
        warp_specialized.DGRAD_SWIGLU_PING_PONG
        if tiles == "ping-pong"
        else warp_specialized.DGRAD_SWIGLU_COOPERATIVE
    )
    gen = torch.Generator(device="cuda").manual_seed(17)
    m, offsets, inside = _groups(sizes, before=2, after=7)
    grad_out = torch.randn(m, hidden, generator=gen, device="cuda").bfloat16()
    gate_up = torch.randn(m, 2 * inter, generator=gen, device="cuda").bfloat16()
    h = torch.randn(m, inter, generator=gen, device="cuda").bfloat16()
    w_down = (
        torch.randn(len(sizes), hidden, inter, generator=gen, device="cuda") * hidden**-0.5
    ).bfloat16()
    row_weights = torch.rand(m, generator=gen, device="cuda")
    row_weights[::5] = 0.0
    ours_h, twin_h = h.clone(), h.clone()
    ours, ours_dots = warp_specialized.down_dgrad_swiglu_weighted(
        grad_out, w_down, gate_up, ours_h, row_weights, row_tile_map(offsets, m, cfg.block_m),
        None, cfg,
    )  # fmt: skip
    twin_cfg = GemmTiles(128, 128, 64, num_warps=8, num_stages=4)
    twin, twin_dots = gg.down_dgrad_swiglu_weighted(
        grad_out, w_down, gate_up, twin_h, row_weights, row_tile_map(offsets, m, 128), None,
        twin_cfg,
    )  # fmt: skip
    assert torch.equal(ours[inside], twin[inside])
    assert torch.equal(ours_h, twin_h)
    outside = torch.ones(m, dtype=torch.bool, device="cuda")
    outside[inside] = False
    assert torch.equal(ours_h[outside], h[outside])
    assert not ours_dots[outside].any() and not twin_dots[outside].any()
    grad_h, dots, weighted_h = weighted_down_backward(
        grad_out[inside], sizes, h[inside], w_down, row_weights[inside]
    )
    assert torch.equal(ours_h[inside], weighted_h)
    assert relative_error(ours_dots[inside], dots) < 1e-5
    assert relative_error(twin_dots[inside], dots) < 1e-5
    want = torch.cat(_swiglu_gradients(grad_h, *gate_up[inside].chunk(2, 1), None), 1)
    assert relative_error(ours[inside], want.bfloat16()) < 5e-4
    # The other rounding, for scale: w applied to the rows, rounded, before the product.
    bounds = offsets.tolist()
    rounded_first = torch.cat(
        [
            (row_weights[a:b, None] * grad_out[a:b].float()).bfloat16().float() @ w_down[e].float()
            for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
        ]
    ).bfloat16()
    assert relative_error(rounded_first, grad_h) > 1e-3


GPT_OSS = host.Activation(1.702, 1.0)
GPT_OSS_CASES = ["uniform", "empty and one-row groups", "several tiles per consumer"]


def _gpt_oss_formula(gate, up, limit):
    """gpt-oss's activation on fp32 gate and up, as its model code writes it."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("gather", [False, True], ids=["tma rows", "gathered rows"])
@pytest.mark.parametrize("tiles", ["ping-pong", "cooperative"])
@pytest.mark.parametrize("name", GPT_OSS_CASES)
def test_gpt_oss_forward_products_match_their_twins_bitwise(name, tiles, gather):
    """gpt-oss's experts in the Gluon epilogues: gate/up with its activation (alpha 1.702, up
    offset 1, the clamp at 7 active on many elements) and the gate and up biases, then down with
    its bias, equal to the tl twins bit for bit (h, the saved pre-activations, the outputs) and
    to the formula in fp32. Catches a bias taken from another expert or column tile, added
    after the activation or to the other pre-activation, alpha on the wrong operand, the offset
    added before the clamp, and the plain SwiGLU run in its place."""
    from mok.kernels import warp_specialized

    sizes, inter, hidden = CASES[name]
    cfg = (
        warp_specialized.SWIGLU_PING_PONG
        if tiles == "ping-pong"
        else warp_specialized.SWIGLU_COOPERATIVE
    )
    down_cfg = warp_specialized.PING_PONG if tiles == "ping-pong" else warp_specialized.COOPERATIVE
    gen = torch.Generator(device="cuda").manual_seed(31)
    m, offsets, inside = _groups(sizes, before=2, after=7)
    experts = len(sizes)
    rows = torch.randn(m, hidden, generator=gen, device="cuda").bfloat16()
    source_rows = None
    if gather:
        source_rows = torch.randint(0, m, (m,), generator=gen, device="cuda", dtype=torch.int32)
    w_gate, w_up = (
        (
            torch.randn(experts, inter, hidden, generator=gen, device="cuda") * 4 * hidden**-0.5
        ).bfloat16()
        for _ in range(2)
    )
    w_down = torch.randn(experts, hidden, inter, generator=gen, device="cuda") * inter**-0.5
    w_down = w_down.bfloat16()
    gate_bias, up_bias = (
        torch.randn(experts, inter, generator=gen, device="cuda").bfloat16() for _ in range(2)
    )
    down_bias = torch.randn(experts, hidden, generator=gen, device="cuda").bfloat16()
    tiles_map = row_tile_map(offsets, m, cfg.block_m)
    options = {"source_rows": source_rows, "activation": GPT_OSS, "biases": (gate_bias, up_bias)}
    h, gate_up = warp_specialized.gate_up_swiglu(
        rows, w_gate, w_up, tiles_map, 7.0, True, cfg, **options
    )
    twin_cfg = GemmTiles(cfg.block_m, 128, 64, num_warps=4, num_stages=3)
    twin_h, twin_gate_up = gg.gate_up_swiglu(
        rows, w_gate, w_up, tiles_map, 7.0, True, twin_cfg, **options
    )
    assert torch.equal(h[inside], twin_h[inside])
    assert torch.equal(gate_up[inside], twin_gate_up[inside])
    down_map = row_tile_map(offsets, m, down_cfg.block_m)
    out = warp_specialized.down(h, w_down, down_map, down_cfg, bias=down_bias)
    twin_down_cfg = GemmTiles(down_cfg.block_m, 128, 64, num_warps=4, num_stages=3)
    twin_out = gg.down(h, w_down, down_map, twin_down_cfg, bias=down_bias)
    assert torch.equal(out[inside], twin_out[inside])
    grouped = rows if source_rows is None else rows[source_rows.long()]
    bounds = offsets.tolist()
    want_h, want_out = [], []
    for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        gate = grouped[a:b].float() @ w_gate[e].float().T + gate_bias[e].float()
        up = grouped[a:b].float() @ w_up[e].float().T + up_bias[e].float()
        want_h.append(_gpt_oss_formula(gate, up, 7.0))
        want_out.append(h[a:b].float() @ w_down[e].float().T + down_bias[e].float())
    assert relative_error(h[inside], torch.cat(want_h)) < 4e-3
    assert relative_error(out[inside], torch.cat(want_out)) < 4e-3
    assert (gate_up[inside].float().abs() > 7.0).float().mean() > 0.05  # the clamp is active


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("tiles", ["ping-pong", "cooperative"])
@pytest.mark.parametrize("name", GPT_OSS_CASES)
def test_gpt_oss_down_dgrad_matches_its_twin_bitwise(name, tiles):
    """The gate | up gradients through W_down and gpt-oss's activation backward (clamp at 7)
    equal the tl kernel's bit for bit and autograd's of the formula in fp32. Catches the plain
    SwiGLU backward run in its place, alpha missing from the sigmoid's derivative, the up offset
    missing from the gate's gradient, and the clamp masks of the plain form."""
    from mok.kernels import warp_specialized

    sizes, inter, hidden = DGRAD_CASES[name]
    cfg = (
        warp_specialized.DGRAD_SWIGLU_PING_PONG
        if tiles == "ping-pong"
        else warp_specialized.DGRAD_SWIGLU_COOPERATIVE
    )
    gen = torch.Generator(device="cuda").manual_seed(32)
    m, offsets, inside = _groups(sizes, before=2, after=7)
    grad_out = torch.randn(m, hidden, generator=gen, device="cuda").bfloat16()
    gate_up = (torch.randn(m, 2 * inter, generator=gen, device="cuda") * 6).bfloat16()
    w_down = (
        torch.randn(len(sizes), hidden, inter, generator=gen, device="cuda") * hidden**-0.5
    ).bfloat16()
    ours = warp_specialized.down_dgrad_swiglu(
        grad_out,
        w_down,
        gate_up,
        row_tile_map(offsets, m, cfg.block_m),
        7.0,
        cfg,
        activation=GPT_OSS,
    )
    twin_cfg = GemmTiles(128, 128, 64, num_warps=8, num_stages=4)
    twin = gg.down_dgrad_swiglu(
        grad_out,
        w_down,
        gate_up,
        row_tile_map(offsets, m, 128),
        7.0,
        twin_cfg,
        activation=GPT_OSS,
    )
    assert torch.equal(ours[inside], twin[inside])
    bounds = offsets.tolist()
    expected = []
    for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        grad_h = (grad_out[a:b].float() @ w_down[e].float()).bfloat16().float()
        gate, up = (t.float().requires_grad_() for t in gate_up[a:b].chunk(2, 1))
        h = _gpt_oss_formula(gate, up, 7.0)
        expected.append(torch.cat(torch.autograd.grad(h, (gate, up), grad_h), 1))
    assert relative_error(ours[inside], torch.cat(expected)) < 4e-3
    assert (gate_up[inside].float().abs() > 7.0).float().mean() > 0.05  # the clamp is active


WGRAD_CASES = {
    # name: (group sizes, P (gradient rows, a multiple of 64), Q (gradient columns))
    "uniform": ([300, 257, 128, 511], 128, 384),
    "empty and one-row groups": ([0, 1, 0, 640, 0, 3], 64, 256),
    "all rows on one expert, Q not a tile multiple": ([0, 0, 1000, 0], 192, 200),
    "fewer rows than a step": ([5, 9], 64, 128),
    "many short groups": ([37] * 40, 128, 128),
    # Many tasks per consumer, reductions many times longer than the ring, and each program
    # moving from expert to expert (the loader remakes its descriptors mid-ring).
    "long reductions": ([5000, 0, 7000, 3003, 1], 256, 512),
}


def _wgrad_operands(sizes, p, q, halves, gen):
    """A [M, halves * P] and B [M, Q] with NaN in the rows outside the groups (a read past a
    group's end would poison the sum), group offsets, and the float64 products per half."""
    before, after = 3, 5
    m = before + sum(sizes) + after
    a = torch.randn(m, halves * p, generator=gen, device="cuda").bfloat16()
    b = torch.randn(m, q, generator=gen, device="cuda").bfloat16()
    for t in (a, b):
        t[:before] = float("nan")
        t[before + sum(sizes) :] = float("nan")
    offsets = (torch.tensor([0, *sizes], device="cuda").cumsum(0) + before).to(torch.int32)
    bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))
    exact = [
        torch.stack([a[s:e, j * p : (j + 1) * p].double().T @ b[s:e].double() for s, e in bounds])
        for j in range(halves)
    ]
    return a, b, offsets, exact


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("accumulate", [False, True], ids=["fresh", "accumulate"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("product", ["down", "gate_up"])
@pytest.mark.parametrize("name", list(WGRAD_CASES))
def test_wgrad_matches_its_twin_bitwise(name, product, out_dtype, accumulate):
    """Both weight gradients, fresh or added into an existing bf16 or fp32 buffer, equal the tl
    kernels' bit for bit and float64 math to the output's rounding. Catches: a ring position
    miscounted across the other consumer's tasks of another group size (stale or mixed tiles),
    a descriptor remade while copies with the old one were in flight, rows past a group's end
    entering the sum (NaN), a tail step not zero-filled, gate and up swapped, a gradient tile
    stored into the next expert, an empty expert's accumulation buffer overwritten, and with
    shared tiles a slot released before both consumers read it or their rows swapped; where P is
    not a multiple of the 128-row tile (64, 192), the second consumer's rows past P fetched or
    stored (into the next expert's gradient)."""
    from mok.kernels import warp_specialized

    sizes, p, q = WGRAD_CASES[name]
    halves = 2 if product == "gate_up" else 1
    gen = torch.Generator(device="cuda").manual_seed(4)
    a, b, offsets, exact = _wgrad_operands(sizes, p, q, halves, gen)
    if accumulate:
        initial = [torch.randn(len(sizes), p, q, generator=gen, device="cuda").to(out_dtype)]
        initial.append(torch.randn_like(initial[0]))
    else:
        initial = [torch.full((len(sizes), p, q), float("nan"), dtype=out_dtype, device="cuda")]
        initial.append(initial[0].clone())
    twin = [t.clone() for t in initial[:halves]]
    twin_cfg = GemmTiles(128, 256, 32, num_warps=8, num_stages=4)
    if product == "down":
        gg.down_wgrad(a, b, offsets, twin[0], accumulate, twin_cfg)
    else:
        gg.gate_up_wgrad(a, b, offsets, *twin, accumulate, accumulate, twin_cfg)
    # The default tiles (128 rows, shared by both consumers) and 64-row ones (ping-pong).
    fp32 = out_dtype == torch.float32
    ping_pong = GemmTiles(64, 128 if fp32 else 256, 64, 4, num_stages=6 if fp32 else 4)
    for cfg in (warp_specialized.WGRAD_TILES.for_grad(out_dtype), ping_pong):
        assert warp_specialized.wgrad_supported(a, b, initial[0], cfg)
        ours = [t.clone() for t in initial[:halves]]
        if product == "down":
            warp_specialized.down_wgrad(a, b, offsets, ours[0], accumulate, cfg)
        else:
            warp_specialized.gate_up_wgrad(a, b, offsets, *ours, accumulate, accumulate, cfg)
        _check_wgrad(ours, twin, initial, exact, sizes, accumulate, f"{cfg.block_m}x{cfg.block_n}")


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", ["empty and one-row groups", "uniform"])
def test_gate_up_wgrad_adds_into_the_halves_of_one_gradient(name, out_dtype):
    """gate's and up's gradients added into the halves of one [E, 2P, Q] buffer (a model's
    `gate_up_proj.grad` under fused accumulation), by the Gluon kernel and by its tl twin: bit
    for bit what each adds into two separate buffers. Catches a half's tiles stored or read at
    the other half's rows (the experts taken as P rows apart instead of 2P), an empty expert's
    rows overwritten."""
    from mok.kernels import warp_specialized

    sizes, p, q = WGRAD_CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(8)
    a, b, offsets, _ = _wgrad_operands(sizes, p, q, 2, gen)
    joined = torch.randn(len(sizes), 2 * p, q, generator=gen, device="cuda").to(out_dtype)
    twin_cfg = GemmTiles(128, 256, 32, num_warps=8, num_stages=4)
    kernels = {
        "gluon": lambda gate, up: warp_specialized.gate_up_wgrad(
            a, b, offsets, gate, up, True, True
        ),
        "tl": lambda gate, up: gg.gate_up_wgrad(a, b, offsets, gate, up, True, True, twin_cfg),
    }
    for kernel_name, kernel in kernels.items():
        separate = [joined[:, :p].clone(), joined[:, p:].clone()]
        kernel(*separate)
        halves = joined.clone()
        assert warp_specialized.wgrad_supported(
            a, b, halves[:, :p], warp_specialized.WGRAD_TILES.for_grad(out_dtype)
        )
        kernel(halves[:, :p], halves[:, p:])
        assert torch.equal(halves[:, :p], separate[0]), kernel_name
        assert torch.equal(halves[:, p:], separate[1]), kernel_name
        assert not torch.equal(halves, joined), kernel_name  # something was added


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("accumulate", [False, True], ids=["fresh", "accumulate"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(WGRAD_CASES))
def test_gathered_gate_up_wgrad_matches_its_twin_bitwise(name, out_dtype, accumulate):
    """The gate/up weight gradient with its rows read through an index by the four-warp cp.async
    loader (the received tokens, once each, in place of the grouped rows) equals the tl twin's
    gathered product and its own TMA product on the rows gathered first, bit for bit. Catches: a
    step's rows taken from the wrong place in the index (the tile's row instead of the group's),
    a slot completing before its gathered rows landed (the arrival after the expect), a missing
    proxy fence before wgmma (stale shared memory), rows past a group's end or a negative index
    read instead of zeros, and with shared tiles the consumers reading different B rows."""
    from mok.kernels import warp_specialized

    sizes, p, q = WGRAD_CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(6)
    a, _, offsets, _ = _wgrad_operands(sizes, p, q, 2, gen)
    m = a.shape[0]
    tokens = max(1, m // 3)
    source = torch.randn(tokens + 1, q, generator=gen, device="cuda").bfloat16()
    source[-1] = float("nan")  # only the index's padding points here
    index = torch.randint(0, tokens, (m,), generator=gen, device="cuda", dtype=torch.int32)
    index[torch.rand(m, generator=gen, device="cuda") < 0.05] = -1
    first_row, end_row = int(offsets[0]), int(offsets[-1])
    index[:first_row] = tokens
    index[end_row:] = tokens
    grouped = torch.where((index >= 0)[:, None], source[index.clamp(min=0).long()], 0.0)
    initial = torch.randn(2, len(sizes), p, q, generator=gen, device="cuda").to(out_dtype)
    twin = initial.clone()
    twin_cfg = GemmTiles(128, 256, 32, num_warps=8, num_stages=4)
    gg.gate_up_wgrad(a, source, offsets, *twin, accumulate, accumulate, twin_cfg, source_rows=index)
    assert not twin.isnan().any()
    fp32 = out_dtype == torch.float32
    ping_pong = GemmTiles(64, 128 if fp32 else 256, 64, 4, num_stages=6 if fp32 else 4)
    for cfg in (warp_specialized.WGRAD_TILES.for_grad(out_dtype), ping_pong):
        assert warp_specialized.wgrad_supported(a, source, initial[0], cfg, gather=True)
        gathered, first = initial.clone(), initial.clone()
        warp_specialized.gate_up_wgrad(
            a, source, offsets, *gathered, accumulate, accumulate, cfg, source_rows=index
        )
        warp_specialized.gate_up_wgrad(a, grouped, offsets, *first, accumulate, accumulate, cfg)
        label = f"{cfg.block_m}x{cfg.block_n}"
        assert torch.equal(gathered, twin), label
        assert torch.equal(gathered, first), label


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("accumulate", [False, True], ids=["fresh", "accumulate"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", ["uniform", "empty and one-row groups", "long reductions"])
def test_gate_up_wgrad_writes_the_halves_of_one_fused_gradient(name, out_dtype, accumulate):
    """The gate/up weight gradients into the halves of one [E, 2P, Q] tensor (as a Hugging Face
    model's `gate_up_proj` gradient; experts 2P rows apart) equal those into two contiguous
    [E, P, Q] tensors bit for bit, fresh (the fused tensor NaN before: every element written)
    or added into what it holds, with the Gluon kernel and the tl twin. Catches tiles stored at
    the contiguous layout's rows (expert e at e * P: into the other half or the wrong expert),
    a half left unwritten, and the fused layout refused (the slower tl kernel, silently)."""
    from mok.kernels import warp_specialized
    from mok.weights import gate_up_halves

    sizes, p, q = WGRAD_CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(6)
    a, b, offsets, exact = _wgrad_operands(sizes, p, q, 2, gen)
    shape = (len(sizes), 2 * p, q)
    if accumulate:
        initial = torch.randn(shape, generator=gen, device="cuda").to(out_dtype)
    else:
        initial = torch.full(shape, float("nan"), dtype=out_dtype, device="cuda")
    separate = [half.contiguous() for half in gate_up_halves(initial)]
    twin_cfg = GemmTiles(128, 256, 32, num_warps=8, num_stages=4)
    gg.gate_up_wgrad(a, b, offsets, *separate, accumulate, accumulate, twin_cfg)
    twin_fused = initial.clone()
    gg.gate_up_wgrad(a, b, offsets, *gate_up_halves(twin_fused), accumulate, accumulate, twin_cfg)
    assert torch.equal(twin_fused, torch.cat(separate, dim=1)), "tl"
    fp32 = out_dtype == torch.float32
    ping_pong = GemmTiles(64, 128 if fp32 else 256, 64, 4, num_stages=6 if fp32 else 4)
    for cfg in (warp_specialized.WGRAD_TILES.for_grad(out_dtype), ping_pong):
        fused = initial.clone()
        halves = gate_up_halves(fused)
        assert all(warp_specialized.wgrad_supported(a, b, half, cfg) for half in halves)
        warp_specialized.gate_up_wgrad(a, b, offsets, *halves, accumulate, accumulate, cfg)
        label = f"{cfg.block_m}x{cfg.block_n}"
        assert torch.equal(fused, twin_fused), label
        initial_halves = [half.contiguous() for half in gate_up_halves(initial)]
        _check_wgrad(halves, separate, initial_halves, exact, sizes, accumulate, label)


def _check_wgrad(ours, twin, initial, exact, sizes, accumulate, label):
    empty = [e for e, size in enumerate(sizes) if size == 0]
    for j, (mine, theirs) in enumerate(zip(ours, twin, strict=True)):
        assert torch.equal(mine, theirs), f"{label}: half {j}"
        expected = exact[j] + (initial[j].double() if accumulate else 0)
        # fp32 accumulation, one rounding to the output dtype.
        tolerance = 4e-3 if mine.dtype == torch.bfloat16 else 1e-5
        assert relative_error(mine, expected) < tolerance, label
        if accumulate and empty:
            assert torch.equal(mine[empty], initial[j][empty]), label


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_wgrad_tilings_agree_and_calls_repeat():
    """Other tilings (128 x 128 shared, 64 x 256 ping-pong) equal the default 128 x 256 one bit
    for bit, and repeated calls are bitwise equal (no race between the consumers' epilogues and
    the loader)."""
    from mok.kernels import warp_specialized

    gen = torch.Generator(device="cuda").manual_seed(5)
    sizes, p, q = [900, 0, 1300, 77], 128, 640
    a, b, offsets, _ = _wgrad_operands(sizes, p, q, 2, gen)
    narrow = warp_specialized.WGRAD_TILES.single
    ping_pong = GemmTiles(64, 256, 64, num_warps=4, num_stages=4)
    results = []
    for cfg in (None, narrow, ping_pong, None, None):
        grads = [torch.empty(len(sizes), p, q, dtype=torch.bfloat16, device="cuda") for _ in "gu"]
        warp_specialized.gate_up_wgrad(a, b, offsets, *grads, False, False, cfg)
        results.append(grads)
    for grads in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(grads, results[0], strict=True))


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("main_grad", [False, True], ids=["bf16 grads", "fp32 buffers"])
@pytest.mark.parametrize("hidden", [384, 192], ids=["H 384", "H 192 (off the wgrad tile)"])
def test_the_expert_mlp_backward_runs_it_with_the_tl_results(main_grad, hidden):
    """On Hopper the default config sends both data gradients and both weight gradients to the
    Gluon kernels, fresh or accumulated into fp32 buffers, with the tl path's results bit for bit
    (its gate/up data gradient at the Gluon kernel's BLOCK_K). With H = 192, W_down's gradient
    (H rows) is not a whole number of the Gluon kernel's 128-row tiles: it must go to the tl
    kernel (the Gluon one would spill a tile's last rows into the next expert's gradient)."""
    import dataclasses

    from mok.kernels import (
        default_config,
        expert_mlp_backward,
        expert_mlp_forward,
        warp_specialized,
    )

    gen = torch.Generator(device="cuda").manual_seed(6)
    sizes, inter = [400, 0, 129, 700], 256
    m = sum(sizes)
    rows = torch.randn(m, hidden, generator=gen, device="cuda").bfloat16()
    w_gate, w_up = (
        (torch.randn(4, inter, hidden, generator=gen, device="cuda") * hidden**-0.5).bfloat16()
        for _ in range(2)
    )
    w_down = (torch.randn(4, hidden, inter, generator=gen, device="cuda") * inter**-0.5).bfloat16()
    grad_out = torch.randn(m, hidden, generator=gen, device="cuda").bfloat16()
    offsets = torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32)
    cfg = default_config(rows.device, hidden, inter, m / 4)
    assert cfg.gluon.wgrad is not None and cfg.gluon.dgrad is not None
    wgrad_rows = cfg.gluon.wgrad.for_grad(torch.bfloat16).block_m
    assert (hidden % wgrad_rows == 0) == (hidden == 384)  # H 192: W_down's gradient goes to tl
    dgrad = cfg.gluon.dgrad
    assert warp_specialized.dgrad_supported(rows, dgrad.gate_up, w_gate, w_up)
    assert warp_specialized.dgrad_supported(grad_out, dgrad.down, w_down)
    tl_only = dataclasses.replace(
        cfg,
        gluon=dataclasses.replace(cfg.gluon, wgrad=None, dgrad=None),
        gate_up_dgrad=GemmTiles(128, 128, 64, num_warps=8, num_stages=3),
    )
    results = []
    for config in (cfg, tl_only):
        _, saved = expert_mlp_forward(rows, offsets, w_gate, w_up, w_down, config=config)
        buffers = {}
        if main_grad:
            gen.manual_seed(7)  # both configs add into the same buffers
            buffers = {
                f"grad_{name}": torch.randn(w.shape, generator=gen, device="cuda")
                for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))
            }
        results.append(expert_mlp_backward(grad_out, saved, **buffers))
    for gluon, tl in zip(*results, strict=True):
        assert torch.equal(gluon, tl)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_the_wgrad_kernel_refuses_gradients_off_its_tiles():
    """Bug caught: a direct call with P not a multiple of a consumer's 64 rows writing a tile's
    last rows into the next expert's gradient instead of raising."""
    from mok.kernels import warp_specialized

    a = torch.randn(300, 160, device="cuda").bfloat16()
    b = torch.randn(300, 128, device="cuda").bfloat16()
    offsets = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    grad = torch.zeros(2, 160, 128, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="wgrad_supported"):
        warp_specialized.down_wgrad(a, b, offsets, grad, False, warp_specialized.WGRAD_TILES.single)
    assert not grad.any()


def test_the_environment_can_keep_the_tl_kernels(monkeypatch):
    """MOK_WARP_SPECIALIZED=0: the default config has no Gluon tiles (every product on the tl
    kernels) and the whole layer gives the Gluon path's output bit for bit (the forward kernels
    are twins) and its gradients to bf16 rounding (the backward ones tile differently). Catches
    the switch ignored (the comparison it exists for would time Gluon twice) or a product that
    calls a Gluon kernel whatever its config."""
    import mok
    from mok.kernels import default_config
    from mok.routing import make_routing
    from mok.testing import RankInputs, global_weights, one_call_results

    config = mok.get_preset("qwen3-30b-a3b").config(max_tokens_per_rank=512, backend="triton")
    generator = torch.Generator().manual_seed(0)
    idx, weights = make_routing("uniform", 300, config.num_experts, config.top_k, generator)
    x = torch.randn(300, config.hidden_size, generator=generator).bfloat16()
    grad_y = torch.randn(300, config.hidden_size, generator=generator).bfloat16()
    case = RankInputs(x.cuda(), idx.cuda(), weights.cuda(), grad_y.cuda())
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("MOK_WARP_SPECIALIZED", switch)
        cfg = default_config(torch.device("cuda"), config.hidden_size, config.intermediate_size)
        assert (cfg.gluon.down is None) == (switch == "0")
        layer = mok.MoE(config, device="cuda")
        layer.load_global_weights(global_weights(config, 0, "cuda"))
        results[switch] = one_call_results(layer, case)
    assert torch.equal(results["0"].pop("y"), results["1"].pop("y"))
    for name, value in results["1"].items():
        assert relative_error(results["0"][name], value) < 1e-2, name


class _JoinedOnAnotherStream:
    """`TileClaims` for the tests: every claiming launch is joined by `extra` more programs on a
    second stream, started while the first launch still runs (`during`: behind an event recorded
    before that launch, as the fused backend's join is, not behind the launch itself) or once it
    finished (they then find every task taken). Keeps each launch's counter."""

    def __init__(self, extra: int, during: bool) -> None:
        self.extra, self.during = extra, during
        self.stream = torch.cuda.Stream()
        self.counters: list[torch.Tensor] = []
        self.inputs_ready: torch.cuda.Event | None = None

    def counter(self) -> torch.Tensor:
        self.counters.append(torch.zeros(1, dtype=torch.int32, device="cuda"))
        self.inputs_ready = torch.cuda.current_stream().record_event()
        return self.counters[-1]

    def extend(self, relaunch) -> None:
        if self.during:
            self.stream.wait_event(self.inputs_ready)
        else:
            torch.cuda.current_stream().synchronize()
        with torch.cuda.stream(self.stream):
            relaunch(self.extra)
        torch.cuda.current_stream().wait_stream(self.stream)


CLAIM_JOINS = {"joined while running": True, "joined after": False}


def _claiming(cfg: GemmTiles, programs: int, claims) -> GemmTiles:
    import dataclasses

    return dataclasses.replace(cfg, max_sms=programs, claims=claims)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("join", list(CLAIM_JOINS))
@pytest.mark.parametrize(
    "tiles", ["ping-pong", "cooperative", "tl twins", "ping-pong gathered", "cooperative gathered"]
)
@pytest.mark.parametrize("name", ["several tiles per consumer", "empty and one-row groups"])
def test_claimed_row_tiles_equal_the_static_grid_bitwise(name, tiles, join):
    """The gate/up + SwiGLU and down dgrad + SwiGLU products with their tasks claimed (a held
    grid of 3 programs, joined by 5 more on another stream) equal the static grid's results bit
    for bit, and each launch's counter ends at tasks + programs: every program claimed until it
    drew one id past the end, once. Catches a consumer reading another slot's task id (a tile
    computed twice and another never: garbage rows), an id slot rewritten before its consumer
    read it, the second ping-pong consumer never told that the tasks ran out (a hang the pytest
    timeout turns into a failure), a loader claiming per lane instead of once per task (the
    counter far past the end), and late programs that recompute taken tiles. The tl twins claim
    per program, compiled (the CPU tests run them under the interpreter, one program at a
    time). "gathered": gate/up reads its rows through an index (`source_rows`), its four-warp
    loader claiming once for all its warps (a claim per warp would skip tasks: rows never
    computed, and the counter past tasks + programs)."""
    from mok.kernels import warp_specialized

    sizes, inter, hidden = DGRAD_CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(12)
    m, offsets, inside = _groups(sizes, before=2, after=7)
    rows = torch.randn(m, hidden, generator=gen, device="cuda").bfloat16()
    w_gate, w_up = (
        (torch.randn(len(sizes), inter, hidden, generator=gen, device="cuda") * hidden**-0.5)
        .bfloat16()
        .contiguous()
        for _ in range(2)
    )
    w_down = (
        torch.randn(len(sizes), hidden, inter, generator=gen, device="cuda") * inter**-0.5
    ).bfloat16()
    grad_out = torch.randn(m, hidden, generator=gen, device="cuda").bfloat16()
    source_rows = None
    if tiles.endswith(" gathered"):
        tiles = tiles.removesuffix(" gathered")
        sources = torch.randn(m + 5, hidden, generator=gen, device="cuda").bfloat16()
        source_rows = torch.randint(0, m + 5, (m,), generator=gen, device="cuda").int()
        rows = sources
    kernels = (gg.gate_up_swiglu, gg.down_dgrad_swiglu)
    if tiles == "tl twins":
        swiglu_cfg = dgrad_cfg = GemmTiles(128, 128, 64, num_warps=8, num_stages=3)
    elif tiles == "ping-pong":
        swiglu_cfg, dgrad_cfg = (
            warp_specialized.SWIGLU_PING_PONG,
            warp_specialized.DGRAD_SWIGLU_PING_PONG,
        )
        kernels = (warp_specialized.gate_up_swiglu, warp_specialized.down_dgrad_swiglu)
    else:
        swiglu_cfg, dgrad_cfg = (
            warp_specialized.SWIGLU_COOPERATIVE,
            warp_specialized.DGRAD_SWIGLU_COOPERATIVE,
        )
        kernels = (warp_specialized.gate_up_swiglu, warp_specialized.down_dgrad_swiglu)
    gate_up_swiglu, down_dgrad_swiglu = kernels
    claims = _JoinedOnAnotherStream(extra=5, during=CLAIM_JOINS[join])
    held = 3
    results = {}
    for label, swiglu, dgrad in (
        ("static", swiglu_cfg, dgrad_cfg),
        ("claimed", _claiming(swiglu_cfg, held, claims), _claiming(dgrad_cfg, held, claims)),
    ):
        swiglu_tiles = row_tile_map(offsets, m, swiglu.block_m)
        h, gate_up = gate_up_swiglu(
            rows, w_gate, w_up, swiglu_tiles, 0.75, True, swiglu, source_rows=source_rows
        )
        dgrad_tiles = row_tile_map(offsets, m, dgrad.block_m)
        grads = down_dgrad_swiglu(grad_out, w_down, gate_up, dgrad_tiles, 0.75, dgrad)
        torch.cuda.synchronize()
        results[label] = (h[inside], gate_up[inside], grads[inside])
        tasks = [
            int(swiglu_tiles.counts[0]) * -(-inter // swiglu.block_n),
            int(dgrad_tiles.counts[0]) * -(-inter // dgrad.block_n),
        ]
    for static, claimed in zip(results["static"], results["claimed"], strict=True):
        assert torch.equal(static, claimed)
    assert [int(c) for c in claims.counters] == [t + held + claims.extra for t in tasks]


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("join", list(CLAIM_JOINS))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", ["long reductions", "empty and one-row groups"])
def test_claimed_weight_gradients_equal_the_static_grid_bitwise(name, out_dtype, join):
    """Both weight gradients (added into fp32 or bf16 buffers) with their tasks claimed, a held
    grid of 3 programs joined by 5 more, equal the static grid's bit for bit, shared 128-row
    tiles and 64-row ping-pong ones, and every program drew one id past the end. Catches the
    consumers miscounting ring positions across claimed tasks of other group sizes (stale
    tiles), empty experts' tasks (no reduction steps) letting the loader overwrite ids not yet
    read, and an empty expert's accumulation buffer written by a late program. The gate/up one
    also with its rows read through an index (the four-warp gathering loader): equal to the
    grouped rows' product, and one claim per task for the whole loader, not one per warp (the
    counter would end far past the end)."""
    from mok.kernels import warp_specialized

    sizes, p, q = WGRAD_CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(13)
    a, b, offsets, _ = _wgrad_operands(sizes, p, q, 2, gen)
    index = torch.randperm(b.shape[0], generator=torch.Generator().manual_seed(13))
    source = torch.empty_like(b)
    source[index.to(b.device)] = b
    index = index.to(device=b.device, dtype=torch.int32)
    initial = [torch.randn(len(sizes), p, q, generator=gen, device="cuda").to(out_dtype)]
    initial.append(torch.randn_like(initial[0]))
    fp32 = out_dtype == torch.float32
    ping_pong = GemmTiles(64, 128 if fp32 else 256, 64, 4, num_stages=6 if fp32 else 4)
    for cfg in (warp_specialized.WGRAD_TILES.for_grad(out_dtype), ping_pong):
        claims = _JoinedOnAnotherStream(extra=5, during=CLAIM_JOINS[join])
        results = []
        for tiles in (cfg, _claiming(cfg, 3, claims)):
            grads = [t.clone() for t in initial]
            warp_specialized.gate_up_wgrad(a, b, offsets, *grads, True, True, tiles)
            down = initial[0].clone()
            warp_specialized.down_wgrad(a[:, :p], b, offsets, down, True, tiles)
            gathered = [t.clone() for t in initial]
            warp_specialized.gate_up_wgrad(
                a, source, offsets, *gathered, True, True, tiles, source_rows=index
            )
            torch.cuda.synchronize()
            results.append([*grads, down, *gathered])
        label = f"{cfg.block_m}x{cfg.block_n}"
        for static, claimed in zip(*results, strict=True):
            assert torch.equal(static, claimed), label
        grouped_rows, gathered = results[0][:2], results[1][3:]
        assert all(torch.equal(g, r) for g, r in zip(gathered, grouped_rows, strict=True)), label
        per_half = len(sizes) * -(-p // cfg.block_m) * -(-q // cfg.block_n)
        tasks = [2 * per_half, per_half, 2 * per_half]
        assert [int(c) for c in claims.counters] == [t + 3 + claims.extra for t in tasks]
