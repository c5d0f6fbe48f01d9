"""The row-movement kernels (push, gather, reduce) against plain PyTorch indexing.

Ranks are simulated in one process: rank r's buffer is slice r of one [ep, rows, H] tensor, so a
peer-offset table is (d - r) * rows * H elements, exactly what symmetric memory provides. On the
CPU the kernels run under the Triton interpreter, in fp32 (its bf16 arithmetic is wrong); on a GPU
the same tests run in bf16.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mx_cases import assert_same_bits

from mok.kernels.mx import MXRows, mx_quantize_rows
from mok.kernels.rows import copy_rows, pair_gradients, push_rows, reduce_rows
from mok.kernels.sync import new_status
from mok.reference import mx

from sum_order_cases import (
    contraction_sensitive_terms,
    order_sensitive_addends,
    power_of_two_weights,
    sequential_sum,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32


def peer_offsets(ep: int, rank: int, elements_per_rank: int) -> torch.Tensor:
    return torch.tensor(
        [(d - rank) * elements_per_rank for d in range(ep)], dtype=torch.int64, device=DEVICE
    )


def random_slots(tokens: int, ep: int, capacity: int, generator) -> torch.Tensor:
    """[T, ep]: each token to a random subset of ranks, rows in token order, some past capacity."""
    takes = torch.rand(tokens, ep, generator=generator) < 0.6
    slots = torch.cumsum(takes.long(), 0) - 1 + torch.randint(0, 3, (1, ep), generator=generator)
    return torch.where(takes, slots, torch.full_like(slots, -1)).to(DEVICE)


@given(
    tokens=st.integers(0, 40),
    hidden=st.sampled_from([8, 24, 40, 520]),
    ep=st.integers(1, 3),
    block_rows=st.sampled_from([4, 16]),
    programs=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_push_rows_stores_each_row_at_its_slot_and_sets_flags(
    tokens, hidden, ep, block_rows, programs, seed
):
    generator = torch.Generator().manual_seed(seed)
    capacity = 16
    rank = ep - 1
    src = torch.randn(tokens, hidden, generator=generator).to(DEVICE, DTYPE)
    slots = random_slots(tokens, ep, capacity, generator)
    # One guard row after each rank's buffer: nothing may be stored past the capacity.
    buffers = torch.full((ep, capacity + 1, hidden), -7.0, dtype=DTYPE, device=DEVICE)
    blocks = 12
    flags = torch.zeros(ep, ep * blocks, dtype=torch.int32, device=DEVICE)
    epoch = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    push_rows(
        src,
        slots,
        buffers[rank, :capacity],
        peer_offsets(ep, rank, (capacity + 1) * hidden),
        programs,
        block_rows,
        flags=flags[rank],
        flag_offsets=peer_offsets(ep, rank, ep * blocks),
        flag_base=rank * blocks,
        epoch=epoch,
    )
    expected = torch.full_like(buffers, -7.0)
    for t in range(tokens):
        for d in range(ep):
            slot = int(slots[t, d])
            if 0 <= slot < capacity:
                expected[d, slot] = src[t]
    assert torch.equal(buffers, expected)
    used = -(-tokens // block_rows)
    expected_flags = torch.zeros_like(flags)
    expected_flags[:, rank * blocks : rank * blocks + used] = 5
    assert torch.equal(flags, expected_flags)


@given(
    rows=st.integers(0, 50),
    hidden=st.sampled_from([8, 40, 520]),
    ep=st.integers(1, 3),
    wait=st.booleans(),
    scatter=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_copy_rows_moves_each_row_between_ranks(rows, hidden, ep, wait, scatter, seed):
    """Gather (row r from rank[r], row[r]; zero-filled) or scatter (to rank[r], row[r])."""
    generator = torch.Generator().manual_seed(seed)
    src_rows, dst_rows = 17, 19
    sources = torch.randn(ep, src_rows, hidden, generator=generator).to(DEVICE, DTYPE)
    src_rank = torch.randint(0, ep, (rows,), generator=generator).to(DEVICE)
    src_row = torch.randint(-3, src_rows + 3, (rows,), generator=generator).to(DEVICE)
    # distinct destination rows per rank, some out of range
    dst_row = torch.randperm(max(rows, dst_rows) + 6, generator=generator)[:rows].to(DEVICE) - 3
    dst_rank = torch.randint(0, ep, (rows,), generator=generator).to(DEVICE)
    count = torch.tensor([max(rows - 2, 0)], dtype=torch.int64, device=DEVICE)
    # one guard row after each rank's destination
    out = torch.full((ep, max(rows, dst_rows) + 1, hidden), -7.0, dtype=DTYPE, device=DEVICE)
    out_rows = dst_rows if scatter else rows
    me = 0
    waits = {}
    if wait:  # flags already published: the wait must pass, never hang
        flags = torch.full((6,), 9, dtype=torch.int32, device=DEVICE)
        index = torch.randint(0, 6, (rows,), generator=generator).to(DEVICE)
        waits = {
            "flags": flags,
            "wait": index,
            "epoch": torch.tensor([9], dtype=torch.int32, device=DEVICE),
            "status": new_status(DEVICE),
            "timeout_s": 10.0,
        }
    targets = {}
    if scatter:
        per_rank = out.shape[1] * hidden
        targets = {
            "dst_row": dst_row,
            "dst_offsets": peer_offsets(ep, me, per_rank),
            "dst_rank": dst_rank,
        }
    copy_rows(
        out[me, :out_rows],
        sources[me],
        src_row,
        count,
        programs=2,
        block_rows=8,
        src_offsets=peer_offsets(ep, me, src_rows * hidden),
        src_rank=src_rank,
        **targets,
        **waits,
    )
    expected = torch.full_like(out, -7.0)
    for r in range(int(count)):
        row = int(src_row[r])
        value = sources[src_rank[r], row] if 0 <= row < src_rows else 0.0
        if not scatter:
            expected[me, r] = value
        elif 0 <= int(dst_row[r]) < dst_rows:
            expected[dst_rank[r], dst_row[r]] = value
    assert torch.equal(out, expected)


def reference_reduce(init, terms, weights, tail):
    """The contract: fp32, init first, j ascending, each product rounded, tail last."""
    acc = torch.zeros_like(terms[:, 0], dtype=torch.float32) if init is None else init.float()
    for j in range(terms.shape[1]):
        term = terms[:, j].float()
        acc = acc + (term if weights is None else weights[:, j, None].float() * term)
    if tail is not None:
        acc = acc + tail.float()
    return acc


@given(
    tokens=st.integers(0, 30),
    hidden=st.sampled_from([8, 40, 520]),
    width=st.integers(1, 4),
    ep=st.integers(1, 3),
    mode=st.sampled_from(["local", "column", "table"]),
    weighted=st.booleans(),
    with_init=st.booleans(),
    with_tail=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_reduce_rows_sums_terms_in_order(
    tokens, hidden, width, ep, mode, weighted, with_init, with_tail, seed
):
    generator = torch.Generator().manual_seed(seed)
    if mode == "column":
        width = ep
    src_rows = 13
    sources = torch.randn(ep, src_rows, hidden, generator=generator).to(DEVICE, DTYPE)
    rows = torch.randint(-2, src_rows + 2, (tokens, width), generator=generator).to(DEVICE)
    if mode == "local":
        ranks = torch.zeros_like(rows)
    elif mode == "column":
        ranks = torch.arange(width, device=DEVICE).expand(tokens, width)
    else:
        ranks = torch.randint(0, ep, (tokens, width), generator=generator).to(DEVICE)
    weights = torch.rand(tokens, width, generator=generator).to(DEVICE) if weighted else None
    init = torch.randn(tokens, hidden, generator=generator).to(DEVICE, DTYPE) if with_init else None
    tail = torch.randn(tokens, hidden, generator=generator).to(DEVICE, DTYPE) if with_tail else None
    me = 0
    out = torch.empty(tokens, hidden, dtype=DTYPE, device=DEVICE)
    gathered = torch.empty(tokens, width, hidden, dtype=DTYPE, device=DEVICE)
    reduce_rows(
        out,
        sources[me],
        rows,
        programs=2,
        block_rows=4,
        src_offsets=None if mode == "local" else peer_offsets(ep, me, src_rows * hidden),
        rank=ranks.contiguous() if mode == "table" else None,
        rank_is_column=mode == "column",
        weight=weights,
        init=init,
        tail=tail,
        gathered=gathered,
    )
    valid = (rows >= 0) & (rows < src_rows)
    terms = sources[ranks, rows.clamp(0, src_rows - 1)] * valid[..., None]
    assert torch.equal(gathered, terms)
    assert torch.equal(out, reference_reduce(init, terms, weights, tail).to(DTYPE))


def test_reduce_rows_count_bounds_the_rows_written():
    src = torch.arange(24.0, device=DEVICE).to(DTYPE).view(3, 8)
    rows = torch.tensor([[2], [1], [0], [1]], device=DEVICE)
    out = torch.full((4, 8), -1.0, dtype=DTYPE, device=DEVICE)
    count = torch.tensor([2], device=DEVICE)
    reduce_rows(out, src, rows, programs=1, block_rows=4, count=count)
    assert torch.equal(out[:2], src[[2, 1]])
    assert torch.equal(out[2:], torch.full((2, 8), -1.0, dtype=DTYPE, device=DEVICE))


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("with_init", [False, True], ids=["no-init", "init"])
@pytest.mark.parametrize("with_tail", [False, True], ids=["no-tail", "tail"])
def test_reduce_rows_order_decides_the_result_on_order_sensitive_data(
    weighted, with_init, with_tail
):
    """Catches a reduce that adds init, the terms j = 0 .. W-1 and tail in another order (terms
    reversed or in source-row order, init added last, tail first): on these addends every such
    order changes the result, which the test checks too."""
    tokens, width, hidden = 8, 3, 64
    addends = order_sensitive_addends(tokens, with_init + width + with_tail, hidden, seed=width)
    init = addends[:, 0].contiguous() if with_init else None
    products = addends[:, with_init : with_init + width]
    tail = addends[:, -1].contiguous() if with_tail else None
    weights = power_of_two_weights(tokens, width, seed=2) if weighted else None
    terms = products / weights[..., None] if weighted else products
    # Term (t, j) sits at a shuffled source row: the sum must follow j, not the rows.
    shuffle = torch.randperm(tokens * width, generator=torch.Generator().manual_seed(3))
    src = torch.empty(tokens * width, hidden)
    src[shuffle] = terms.reshape(-1, hidden)
    out = torch.empty(tokens, hidden, dtype=DTYPE, device=DEVICE)
    reduce_rows(
        out,
        src.to(DEVICE, DTYPE),
        shuffle.view(tokens, width).to(DEVICE),
        programs=2,
        block_rows=4,
        weight=None if weights is None else weights.to(DEVICE),
        init=None if init is None else init.to(DEVICE, DTYPE),
        tail=None if tail is None else tail.to(DEVICE, DTYPE),
    )
    want = sequential_sum(addends).to(DTYPE)
    assert torch.equal(out.cpu(), want)

    head, rest = addends[:, :with_init], addends[:, with_init:]
    other_orders = [torch.cat([head, products.flip(1), addends[:, with_init + width :]], 1)]
    if with_init:
        other_orders.append(torch.cat([rest, head], 1))
    if with_tail:
        other_orders.append(torch.cat([addends[:, -1:], addends[:, :-1]], 1))
    for addends_in_other_order in other_orders:
        assert not torch.equal(sequential_sum(addends_in_other_order).to(DTYPE), want)


def test_reduce_rows_rounds_each_product_before_adding_it():
    """Catches a launch with fp fusion on: a multiply-add contracted into an FMA gives 2^-24 here
    where the contract's rounded products give 0. Only a GPU can show it (the interpreter computes
    in numpy, which never contracts)."""
    terms, weights = contraction_sensitive_terms(64)
    out = torch.empty(1, 64, dtype=DTYPE, device=DEVICE)
    rows = torch.tensor([[0, 1]], device=DEVICE)
    reduce_rows(out, terms[0].to(DEVICE, DTYPE), rows, 1, 4, weight=weights.to(DEVICE))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.gpu
def test_reduce_rows_matches_the_reference_combine_bitwise_in_bf16():
    """No multiply-add contraction: the same bits as mok.reference.combine."""
    from mok.reference import combine

    generator = torch.Generator().manual_seed(0)
    tokens, top_k, hidden = 300, 8, 7168
    outputs = torch.randn(tokens, top_k, hidden, generator=generator).to(DEVICE, torch.bfloat16)
    weights = torch.rand(tokens, top_k, generator=generator).to(DEVICE)
    shared = torch.randn(tokens, hidden, generator=generator).to(DEVICE, torch.bfloat16)
    rows = torch.arange(tokens * top_k, device=DEVICE).view(tokens, top_k)
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=DEVICE)
    reduce_rows(out, outputs.view(-1, hidden), rows, 24, 8, weight=weights, init=shared)
    assert torch.equal(out, combine(outputs, weights, shared))


@given(
    tokens=st.integers(0, 20),
    top_k=st.integers(1, 4),
    hidden=st.sampled_from([8, 40, 1100]),
    seed=st.integers(0, 2**16),
    scatter=st.booleans(),
)
def test_pair_gradients_scale_rows_and_dot_outputs(tokens, top_k, hidden, seed, scatter):
    generator = torch.Generator().manual_seed(seed)
    grad_y = torch.randn(tokens, hidden, generator=generator).to(DEVICE, DTYPE)
    weights = torch.rand(tokens, top_k, generator=generator).to(DEVICE)
    pair_out = torch.randn(tokens, top_k, hidden, generator=generator).to(DEVICE, DTYPE)
    rows = tokens * top_k
    grad_pairs = torch.full((rows, hidden), -7.0, dtype=DTYPE, device=DEVICE)
    want_pairs = (weights.float()[..., None] * grad_y.float()[:, None]).to(DTYPE)
    if scatter:  # a permutation, some pairs dropped (-1) or past the end
        dst_row = torch.randperm(rows, generator=generator).view(tokens, top_k)
        dst_row = torch.where(torch.rand(tokens, top_k, generator=generator) < 0.2, -1, dst_row)
        dst_row[:1, :1] = rows  # skipped: outside grad_pairs
        dst_row = dst_row.to(DEVICE)
        grad_w = pair_gradients(grad_y, weights, pair_out, grad_pairs, programs=3, dst_row=dst_row)
        want = torch.full_like(grad_pairs, -7.0)
        kept = (dst_row >= 0) & (dst_row < rows)
        want[dst_row[kept]] = want_pairs[kept]
        assert torch.equal(grad_pairs, want)
        # The outputs read where the pairs' gradients go (the grouped rows, in place): the same
        # bits for every kept pair, zero for the others.
        grouped = torch.full((rows, hidden), float("nan"), dtype=DTYPE, device=DEVICE)
        grouped[dst_row[kept]] = pair_out[kept]
        in_place = torch.full_like(grad_pairs, -7.0)
        grad_w_in_place = pair_gradients(
            grad_y, weights, grouped, in_place, programs=3, dst_row=dst_row, out_at_dst=True
        )
        assert torch.equal(in_place, want)
        assert torch.equal(grad_w_in_place, torch.where(kept, grad_w, 0.0))
    else:
        grad_w = pair_gradients(grad_y, weights, pair_out, grad_pairs, programs=3)
        assert torch.equal(grad_pairs.view(tokens, top_k, hidden), want_pairs)
    want_w = torch.einsum("th,tkh->tk", grad_y.float(), pair_out.float())
    assert torch.allclose(grad_w, want_w, rtol=1e-5, atol=1e-5 * hidden)


def test_pair_gradients_do_not_depend_on_the_program_count():
    """`pair_gradients` runs as many programs as the GPU has SMs (times a constant): its results
    must be the same bits for any count, and the pair gradients (products, rounded once) for any
    launch at all (k = 6 padded to 8 slots, H = 1100: two full column chunks and a partial one,
    scattered rows). Under the interpreter, whose sums take one order whatever the tile, the
    router weights' gradient must not depend on the tokens a tile or the warps either: that
    catches a column chunk that follows the tile. On a GPU a tile's final sum follows its layout
    (its shape and warps, fixed constants of the code), so only the program count is varied there.
    Catches a sum order that follows the program count, which would make a layer's router-weight
    gradients change with the GPU's SM count."""
    generator = torch.Generator().manual_seed(11)
    tokens, top_k, hidden = 37, 6, 1100
    grad_y = torch.randn(tokens, hidden, generator=generator).to(DEVICE, DTYPE)
    weights = torch.rand(tokens, top_k, generator=generator).to(DEVICE)
    pair_out = torch.randn(tokens, top_k, hidden, generator=generator).to(DEVICE, DTYPE)
    dst_row = torch.randperm(tokens * top_k, generator=generator).view(tokens, top_k).to(DEVICE)

    def launched(programs, block_rows, num_warps):
        grad_pairs = torch.full((tokens * top_k, hidden), float("nan"), dtype=DTYPE, device=DEVICE)
        grad_w = pair_gradients(
            grad_y, weights, pair_out, grad_pairs, programs, dst_row, block_rows, num_warps
        )
        return grad_w, grad_pairs

    default = launched(1, 2, 8)
    for programs in (5, 19, 64):
        grad_w, grad_pairs = launched(programs, 2, 8)
        assert torch.equal(grad_w, default[0]) and torch.equal(grad_pairs, default[1])
    for block_rows, num_warps in ((1, 4), (4, 4), (2, 4)):
        grad_w, grad_pairs = launched(3, block_rows, num_warps)
        assert torch.equal(grad_pairs, default[1])
        if torch.device(DEVICE).type == "cpu":
            assert torch.equal(grad_w, default[0])


def uneven_rows(rows: int, hidden: int, generator) -> torch.Tensor:
    """Random rows whose 32-column blocks span 2^-8 .. 2^8: every block gets its own MX scale."""
    scale = torch.exp2(torch.randint(-8, 9, (rows, hidden // 32, 1), generator=generator).float())
    return (torch.randn(rows, hidden // 32, 32, generator=generator) * scale).view(rows, hidden)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_reduce_rows_saves_the_gathered_rows_as_mx(rounding):
    """The combine's saved pair outputs in MXFP8: every term's row cast along H (zeros for a
    skipped term) from the sum's own pass, bit for bit the reference's cast of the bf16 rows the
    plain gather saves; the sum unchanged. Two column chunks of 64, the second partial (96 =
    1.5 chunks). Catches scales stored at the wrong offset of a packed row or of the wrong
    chunk, a cast along the wrong dimension, a skipped term's row left unwritten."""
    generator = torch.Generator().manual_seed(5)
    tokens, width, hidden, src_rows = 11, 3, 96, 13
    src = uneven_rows(src_rows, hidden, generator).to(DEVICE, DTYPE)
    rows = torch.randint(-2, src_rows + 2, (tokens, width), generator=generator).to(DEVICE)
    weights = torch.rand(tokens, width, generator=generator).to(DEVICE)
    plain = torch.empty(tokens, width, hidden, dtype=DTYPE, device=DEVICE)
    packed = MXRows.empty(tokens * width, hidden, DEVICE)
    sums = []
    for gathered in (plain, packed):
        out = torch.empty(tokens, hidden, dtype=DTYPE, device=DEVICE)
        reduce_rows(
            out,
            src,
            rows,
            programs=2,
            block_rows=4,
            weight=weights,
            gathered=gathered,
            gathered_rounding=rounding,
            block_h=64,
        )
        sums.append(out)
    assert torch.equal(sums[0], sums[1])
    data, scales = mx.quantize(plain.view(-1, hidden).float().cpu(), dim=-1, rounding=rounding)
    assert torch.equal(packed.scales.cpu(), scales)
    assert_same_bits(packed.codes.cpu().view(torch.uint8), data.view(torch.uint8))


@pytest.mark.parametrize("scatter", [False, True])
def test_pair_gradients_read_mx_pair_outputs(scatter):
    """The router weights' gradient from pair outputs saved in MXFP8 (`MXRows`): the dot
    products with the values the bytes hold (blocks of every scale, a partial column chunk:
    H = 1056 over chunks of 1024); the pair gradients as with bf16 outputs. Catches a scale
    ignored or read from another block or row."""
    generator = torch.Generator().manual_seed(2)
    tokens, top_k, hidden = 9, 3, 1056
    grad_y = torch.randn(tokens, hidden, generator=generator).to(DEVICE, DTYPE)
    weights = torch.rand(tokens, top_k, generator=generator).to(DEVICE)
    packed = mx_quantize_rows(uneven_rows(tokens * top_k, hidden, generator).to(DEVICE, DTYPE))
    values = mx.dequantize(packed.codes.cpu().contiguous(), packed.scales.cpu().contiguous())
    dst_row = torch.randperm(tokens * top_k, generator=generator).view(tokens, top_k).to(DEVICE)
    grad_pairs = torch.zeros(tokens * top_k, hidden, dtype=DTYPE, device=DEVICE)
    grad_w = pair_gradients(
        grad_y, weights, packed, grad_pairs, programs=2, dst_row=dst_row if scatter else None
    )
    want_w = torch.einsum("th,tkh->tk", grad_y.float().cpu(), values.view(tokens, top_k, hidden))
    assert torch.allclose(grad_w.cpu(), want_w, rtol=1e-5, atol=1e-5 * hidden)
    want_pairs = (weights.float()[..., None] * grad_y.float()[:, None]).to(DTYPE)
    order = dst_row.view(-1) if scatter else torch.arange(tokens * top_k, device=DEVICE)
    assert torch.equal(grad_pairs[order], want_pairs.view(-1, hidden))


def test_reduce_rows_refuses_strided_operands():
    """Catches: a strided init or tail read as if dense (silently wrong sums)."""
    out = torch.empty(4, 8, dtype=DTYPE, device=DEVICE)
    src = torch.randn(6, 8, dtype=DTYPE, device=DEVICE)
    row = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)
    strided = torch.randn(8, 4, dtype=DTYPE, device=DEVICE).T
    with pytest.raises(ValueError, match="init must be contiguous"):
        reduce_rows(out, src, row, programs=1, block_rows=4, init=strided)
