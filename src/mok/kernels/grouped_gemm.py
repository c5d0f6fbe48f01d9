"""Grouped GEMMs of the expert MLP: @triton.jit tile functions and the persistent kernels on them.

Rows arrive grouped by local expert: group e is rows[offsets[e]:offsets[e + 1]] of an [M, H] matrix,
with the offsets on the device. Nothing here reads them on the host.

Two families of kernels:
  row-tiled (forward, and the data gradients): an output tile is BLOCK_M rows of one group times
    BLOCK_N output features. `row_tile_map` lists every group's row tiles on the device; a
    persistent kernel walks (row tile, feature tile) tasks up to the device-side count, GROUP_M
    row tiles at a time (`grouped_task`), so that programs running at the same time share both
    the rows and the expert's weights they read in L2.
  weight-gradient: an output tile is BLOCK_M x BLOCK_N of one expert's weight gradient, reduced
    over that expert's rows. Tasks are (expert, tile); the reduction reads the group through tensor
    descriptors whose row extent ends at the group's end (made in the kernel whenever a program
    moves to another group), so the ragged tail is zero-filled by TMA and no other group's rows
    enter the sum.

Loads go through tensor descriptors (TMA on Hopper). Weights [E, R, C] use 3-D descriptors with
block [1, BR, BC]: a tile never reaches into the next expert when R or C is not a multiple of the
tile, since TMA zero-fills past each dimension's end. Row tiles may read rows past their group's
end (those rows only feed output rows that are never stored). Stores go through TMA too: a tile
inside its group through the matrix's descriptor, a group's last, partial tile through one made on
the spot whose rows end where the group does, so nothing outside the group is ever written.

Building blocks, meant to be called from any task loop, including that of a later fused kernel:
an A-row source (`row_block`: TMA tiles, or rows gathered through an index, e.g. dispatched rows
where they landed), the weight operand (`weight_block`), the main loops (`rows_tile`, and its
two-output and two-input forms `rows_two_weights_tile`, `rows_two_products_tile`;
`weight_gradient_tile` for weight gradients), each computing one fp32 accumulator tile, and the
epilogues (`swiglu_tile`, `saved_preactivations`, `swiglu_backward_tile`, `store_row_tile`,
`store_weight_tile` with its accumulation into an existing gradient, and `scatter_row_tile`: the
peer-store epilogue, rows to other ranks' buffers with readiness counts that
`mok.kernels.sync.wait_counts` waits on). The kernels are dtype-generic: on GPUs they run bf16;
the CPU interpreter runs them exactly in fp32 (its bf16 arithmetic is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mok.kernels._triton_compat import interpreting, patch_interpreter
from mok.kernels.host import (
    SWIGLU,
    Activation,
    GemmTiles,
    RowScatter,
    RowsReady,
    RowTiles,
    check_weighting,
    contiguous_biases,
    gather_source,
    gathered_rows,
    launch_options,
    launch_persistent,
    num_programs,
    ready_flags,
    use_scratch_allocator,
)
from mok.kernels.launch import fast_launch
from mok.kernels.sync import async_proxy_fence, wait_ready
from mok.reference.expert import limit_edges

if interpreting():
    patch_interpreter()


# --------------------------------------------------------------------------------------------------
# Row tiles of the groups, on the device
# --------------------------------------------------------------------------------------------------


@fast_launch
@triton.jit(do_not_specialize=["num_rows", "capacity"])
def _row_tile_map_kernel(
    offsets_ptr,  # [E + 1] int32, non-decreasing
    table_ptr,  # [3, capacity] int32 out
    counts_ptr,  # [2] int32 out
    num_rows,  # M
    num_experts,  # E
    capacity,  # cdiv(M, BLOCK_M) + E + 2
    BLOCK_M: tl.constexpr,
    GROUPS: tl.constexpr,  # power of two >= E + 2
    CHUNK: tl.constexpr,  # tiles listed per program
):
    """Grid: cdiv(capacity, CHUNK). Group g < E is expert g; group E holds the rows before the
    first expert's, group E + 1 those after the last expert's (capacity padding)."""
    g = tl.arange(0, GROUPS)
    is_expert = g < num_experts
    lo = tl.load(offsets_ptr + g, mask=is_expert, other=0)
    hi = tl.load(offsets_ptr + g + 1, mask=is_expert, other=0)
    first = tl.load(offsets_ptr)
    last = tl.load(offsets_ptr + num_experts)
    lo = tl.where(g == num_experts + 1, last, lo)
    hi = tl.where(g == num_experts, first, tl.where(g == num_experts + 1, num_rows, hi))
    tiles = (tl.maximum(hi - lo, 0) + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    starts = ends - tiles

    t = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    group = tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), 1)
    sel = g[None, :] == group[:, None]
    first_row = tl.sum(tl.where(sel, lo[None, :], 0), 1)
    first_tile = tl.sum(tl.where(sel, starts[None, :], 0), 1)
    row = first_row + (t - first_tile) * BLOCK_M
    end = tl.sum(tl.where(sel, hi[None, :], 0), 1)
    expert = tl.where(group < num_experts, group, -1)
    in_table = t < capacity
    tl.store(table_ptr + t, expert, mask=in_table)
    tl.store(table_ptr + capacity + t, row, mask=in_table)
    tl.store(table_ptr + 2 * capacity + t, end, mask=in_table)
    if tl.program_id(0) == 0:
        # Offsets that break the contract (decreasing, past M) must not send kernels past the table.
        expert_tiles = tl.minimum(tl.sum(tl.where(is_expert, tiles, 0), 0), capacity)
        tl.store(counts_ptr, expert_tiles)
        tl.store(counts_ptr + 1, tl.minimum(tl.sum(tiles, 0), capacity))


def row_tile_map(group_offsets: torch.Tensor, num_rows: int, block_m: int) -> RowTiles:
    """List the row tiles of the groups given by `group_offsets` ([E + 1] int32, on the device)."""
    num_experts = group_offsets.numel() - 1
    capacity = triton.cdiv(num_rows, block_m) + num_experts + 2
    device = group_offsets.device
    table = torch.empty(3, capacity, dtype=torch.int32, device=device)
    counts = torch.empty(2, dtype=torch.int32, device=device)
    chunk = 64
    _row_tile_map_kernel[(triton.cdiv(capacity, chunk),)](
        group_offsets,
        table,
        counts,
        num_rows,
        num_experts,
        capacity,
        BLOCK_M=block_m,
        GROUPS=triton.next_power_of_2(num_experts + 2),
        CHUNK=chunk,
    )
    return RowTiles(table=table, counts=counts, capacity=capacity, block_m=block_m)


# --------------------------------------------------------------------------------------------------
# Tile functions
# --------------------------------------------------------------------------------------------------


@triton.jit
def load_row_tile(table_ptr, capacity, t):
    """(expert, first row, end row) of row tile t of a `row_tile_map` table."""
    expert = tl.load(table_ptr + t)
    row = tl.load(table_ptr + capacity + t)
    row_end = tl.load(table_ptr + 2 * capacity + t)
    return expert, row, row_end


@triton.jit
def grouped_task(task, num_m, num_n, GROUP_M: tl.constexpr):
    """(m, n) of a task in a num_m x num_n grid of tiles, walked GROUP_M tile rows at a time with
    m fastest inside a group: programs running together read GROUP_M row blocks and few column
    blocks, instead of every column block (all of an expert's weights) for one row block."""
    per_group = GROUP_M * num_n
    first_m = task // per_group * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    local = task % per_group
    return first_m + local % size, local // size


@triton.jit
def row_block(source, row, k, GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The A-row source of the row-tiled products: [BLOCK_M, BLOCK_K] of A at rows row.., columns
    k... source (a_desc,): A[row:+BM, k:+BK] through A's tensor descriptor (rows of one group are
    consecutive). GATHER, source (a_ptr, a_stride, source_rows_ptr, num_rows, K): row i of the block
    is A[source_rows[row + i], k:+BK] by pointer loads (the grouped rows read where they lie, e.g.
    dispatched rows in arrival order), zeros for rows past num_rows, rows of a negative index and
    columns past K (as the Gluon loader's `_gathered_starts`)."""
    if GATHER:
        a_ptr, a_stride, source_rows_ptr, num_rows, K = source
        rows = row + tl.arange(0, BLOCK_M)
        src = tl.load(source_rows_ptr + rows, mask=rows < num_rows, other=-1).to(tl.int64)
        valid = src >= 0
        cols = k + tl.arange(0, BLOCK_K)
        mask = valid[:, None] & (cols < K)[None, :]
        block = tl.load(a_ptr + src[:, None] * a_stride + cols[None, :], mask=mask, other=0.0)
    else:
        block = source[0].load([row, k])
    return block


@triton.jit
def wait_rows_ready(
    ready,  # `RowsReady.args`: flags, epoch, status, timeout, wait id
    row,
    row_end,
    FLAG_ROWS: tl.constexpr,
    FLAGS: tl.constexpr,
):
    """The readiness part of the A-row source: spin (bounded, `mok.kernels.sync.wait_ready`)
    until the flags of rows [row, row_end) carry this call's epoch, then fence so that the
    tile's TMA reads see what the flags published. FLAGS: a power of two >= the flags a tile
    touches."""
    flags_ptr, epoch_ptr, status_ptr, timeout_ns, wait_id = ready
    index = row // FLAG_ROWS + tl.arange(0, FLAGS)
    mask = index <= (row_end - 1) // FLAG_ROWS
    epoch = tl.load(epoch_ptr)
    wait_ready(flags_ptr + index, index.to(tl.int64), epoch, mask, status_ptr, timeout_ns, wait_id)
    async_proxy_fence()


@triton.jit
def weight_block(
    w_desc, expert, n_off, k, N_MAJOR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The [BK, BN] operand W[expert][k:+BK, n_off:+BN] of a product A @ W. N_MAJOR: W is stored
    [E, N, K] (block [1, BN, BK]; the operand is that tile transposed, as in x @ W_gate[e].T),
    else [E, K, N] (block [1, BK, BN])."""
    if N_MAJOR:
        return w_desc.load([expert, n_off, k]).reshape(BLOCK_N, BLOCK_K).T
    return w_desc.load([expert, k, n_off]).reshape(BLOCK_K, BLOCK_N)


@triton.jit
def rows_tile(
    a_source,  # see `row_block`
    w_desc,
    row,
    expert,
    n_off,
    K,
    acc,  # [BM, BN] fp32
    N_MAJOR: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The main loop: acc + A[row:+BM] @ W[expert][:, n_off:+BN] over K in BLOCK_K steps."""
    for k in tl.range(0, K, BLOCK_K):
        a = row_block(a_source, row, k, GATHER, BLOCK_M, BLOCK_K)
        w = weight_block(w_desc, expert, n_off, k, N_MAJOR, BLOCK_N, BLOCK_K)
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def rows_two_weights_tile(
    a_source,  # see `row_block`
    w1_desc,  # [E, N, K]
    w2_desc,  # [E, N, K]
    row,
    expert,
    n_off,
    K,
    GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A[row:+BM] @ W1[expert, n_off:+BN].T and the same with W2: two [BM, BN] fp32 tiles sharing
    each A step (the gate and up projections, so that SwiGLU can run on both in the epilogue)."""
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K):
        # Both weight tiles loaded before either is transposed: so the pipeliner fetches the
        # three tiles of a step behind one barrier (`weight_block` here split them: seen in PTX).
        a = row_block(a_source, row, k, GATHER, BLOCK_M, BLOCK_K)
        w1 = w1_desc.load([expert, n_off, k]).reshape(BLOCK_N, BLOCK_K)
        w2 = w2_desc.load([expert, n_off, k]).reshape(BLOCK_N, BLOCK_K)
        acc1 = tl.dot(a, w1.T, acc1)
        acc2 = tl.dot(a, w2.T, acc2)
    return acc1, acc2


@triton.jit
def rows_two_products_tile(
    a1_desc,
    a2_desc,
    w1_desc,  # [E, K, N]
    w2_desc,  # [E, K, N]
    row,
    expert,
    n_off,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A1[row:+BM] @ W1[expert][:, n_off:+BN] + A2[row:+BM] @ W2[expert][:, n_off:+BN], one
    [BM, BN] fp32 tile (the data gradient through the gate and up projections together), the two
    products interleaved step by step in one accumulator."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K):
        a1 = row_block((a1_desc,), row, k, False, BLOCK_M, BLOCK_K)
        w1 = weight_block(w1_desc, expert, n_off, k, False, BLOCK_N, BLOCK_K)
        a2 = row_block((a2_desc,), row, k, False, BLOCK_M, BLOCK_K)
        w2 = weight_block(w2_desc, expert, n_off, k, False, BLOCK_N, BLOCK_K)
        acc = tl.dot(a1, w1, acc)
        acc = tl.dot(a2, w2, acc)
    return acc


@triton.jit
def weight_gradient_tile(
    a_desc,  # [rows of the group, MA], block [BLOCK_K, BLOCK_M]
    b_source,  # see below
    first,
    m_off,
    n_off,
    num_rows,
    GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A[:, m_off:+BM].T @ B[:, n_off:+BN] over the group's rows, a [BM, BN] fp32 tile (a weight
    gradient). a_desc starts at the group's first row and ends at its last. B, the second
    operand's rows: b_source (b_desc,), a descriptor like a_desc; or with GATHER, b_source (b_ptr,
    b_stride, source_rows_ptr, NB): the group's row i is B[source_rows[first + i]] (`row_block`'s
    gathering source), zeros past the group's end, as the descriptor's."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATHER:
        b_ptr, b_stride, source_rows_ptr, columns = b_source
        gathered = (b_ptr, b_stride, source_rows_ptr, first + num_rows, columns)
    for k in tl.range(0, num_rows, BLOCK_K):
        a = a_desc.load([k, m_off])
        if GATHER:
            b = row_block(gathered, first + k, n_off, True, BLOCK_K, BLOCK_N)
        else:
            b = b_source[0].load([k, n_off])
        acc = tl.dot(a.T, b, acc)
    return acc


@triton.jit
def swiglu_tile(gate, up, limit, alpha, up_offset, HAS_LIMIT: tl.constexpr, PLAIN: tl.constexpr):
    """The experts' activation in fp32: silu(gate) * up when PLAIN, else gate * sigmoid(alpha *
    gate) * (up + up_offset) (gpt-oss: alpha 1.702, offset 1); with a limit L, first gate <= L
    and -L <= up <= L. NaN stays NaN."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(up, limit, propagate_nan=tl.PropagateNan.ALL)
    if PLAIN:
        return gate * tl.sigmoid(gate) * up
    return gate * tl.sigmoid(alpha * gate) * (up + up_offset)


@triton.jit
def saved_preactivations(gate, up, limit, below, above, HAS_LIMIT: tl.constexpr):
    """gate and up (fp32) as they are to be saved for the backward in a narrower dtype, such that
    the clamp decisions made on the saved values equal the forward's on the fp32 ones.

    `below` is the largest value of the saved dtype <= L, `above` the smallest > L. Rounding alone
    could move a value within half an ulp of L across it, flipping its mask in the backward; so a
    clamped value is saved at least as large as `above` and an unclamped one at most `below` (both
    representable, and rounding is monotone). Clamped values are only compared in the backward,
    and an unclamped one moves by less than one ulp. NaN stays NaN."""
    if HAS_LIMIT:
        clamped_gate = tl.maximum(gate, above, propagate_nan=tl.PropagateNan.ALL)
        kept_gate = tl.minimum(gate, below, propagate_nan=tl.PropagateNan.ALL)
        gate = tl.where(gate > limit, clamped_gate, kept_gate)
        high_up = tl.maximum(up, above, propagate_nan=tl.PropagateNan.ALL)
        low_up = tl.minimum(up, -above, propagate_nan=tl.PropagateNan.ALL)
        kept_up = tl.maximum(up, -below, propagate_nan=tl.PropagateNan.ALL)
        kept_up = tl.minimum(kept_up, below, propagate_nan=tl.PropagateNan.ALL)
        up = tl.where(up > limit, high_up, tl.where(up < -limit, low_up, kept_up))
    return gate, up


@triton.jit
def swiglu_backward_tile(
    grad_h, gate, up, limit, alpha, up_offset, HAS_LIMIT: tl.constexpr, PLAIN: tl.constexpr
):
    """Gradients of swiglu_tile with respect to gate and up (pre-clamp), in fp32. Where the clamp
    is active (gate > L, |up| > L) the gradient is zero, as torch.clamp's. The clamp decisions are
    those of the forward when gate and up were saved through `saved_preactivations`."""
    g = gate
    u = up
    if HAS_LIMIT:
        g = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL)
    if PLAIN:
        sig = tl.sigmoid(g)
        grad_up = grad_h * (g * sig)
        grad_gate = grad_h * u * (sig * (1.0 + g * (1.0 - sig)))
    else:
        sig = tl.sigmoid(alpha * g)
        grad_up = grad_h * (g * sig)
        grad_gate = grad_h * (u + up_offset) * (sig * (1.0 + alpha * g * (1.0 - sig)))
    if HAS_LIMIT:
        grad_gate = tl.where(gate <= limit, grad_gate, 0.0)
        grad_up = tl.where((up >= -limit) & (up <= limit), grad_up, 0.0)
    return grad_gate, grad_up


@triton.jit
def router_weighting_tile(
    grad_h,  # [BLOCK_M, BLOCK_N] fp32, the unweighted rows' product with W_down
    weighting,  # (h_desc, h_ptr, row_weights_ptr, dots_ptr, column tiles)
    row,
    row_end,
    n_off,
    n_idx,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The router weights applied after the down product (`down_dgrad_swiglu_weighted`): for the
    tile's rows r in [row, row_end), dots[r, n_idx] = sum over its columns of grad_h * h (the
    router weight's partial gradient, fp32), h's tile overwritten by round(w[r] * h), and
    w[r] * grad_h returned, unrounded."""
    h_desc, h_ptr, row_weights_ptr, dots_ptr, n_tiles = weighting
    rows = row + tl.arange(0, BLOCK_M)
    inside = rows < row_end
    w = tl.load(row_weights_ptr + rows, mask=inside, other=0.0)
    h = h_desc.load([row, n_off]).to(tl.float32)
    # Columns past N are zero in both (TMA fills them so), rows past row_end are never stored.
    dots = tl.sum(grad_h * h, axis=1)
    tl.store(dots_ptr + rows.to(tl.int64) * n_tiles + n_idx, dots, mask=inside)
    store_row_tile(h_desc, h_ptr, N, w[:, None] * h, row, row_end, n_off, N, BLOCK_M, BLOCK_N)
    return w[:, None] * grad_h


@triton.jit
def add_expert_bias(acc, bias_ptr, expert, n_off, columns, BLOCK_N: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 + the expert's bias (bias [E, columns]) over its columns."""
    cols = n_off + tl.arange(0, BLOCK_N)
    bias = tl.load(bias_ptr + expert * columns + cols, mask=cols < columns, other=0.0)
    return acc + bias.to(tl.float32)[None, :]


@triton.jit
def store_row_tile(
    desc,  # [M, N] output, block [BLOCK_M, BLOCK_N]
    ptr,  # the same matrix's first element
    stride,  # its row stride
    tile,  # [BLOCK_M, BLOCK_N] fp32
    row,
    row_end,
    n_off,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Store the tile's rows [row, row_end) at columns [n_off, N), in the matrix's dtype; nothing
    else is written (the rows past row_end belong to the next group)."""
    value = tile.to(desc.dtype)
    if row + BLOCK_M <= row_end:
        desc.store([row, n_off], value)
    else:
        # A group's last tile: a descriptor whose rows end where the group does; TMA drops the rest.
        tail = tl.make_tensor_descriptor(ptr, [row_end, N], [stride, 1], [BLOCK_M, BLOCK_N])
        tail.store([row, n_off], value)


@triton.jit
def scatter_row_tile(
    tile,  # [BLOCK_M, BLOCK_N] fp32
    target,  # `RowScatter.args`: buffers, peer tables, destinations, counts, this rank
    row,
    row_end,
    n_off,
    N,
    EP_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The peer-store epilogue: row r of [row, row_end) goes to row dest_row[r] (skipped when -1)
    of the [R, N] buffer of rank dest_rank[r], columns [n_off, N), in the buffer's dtype, and then
    counts[rank] on each destination rank grows by the rows it received from this tile (one
    release add per destination rank, system scope: the rows are visible there before the count
    says so). A destination whose counts reach (rows it expects) x cdiv(N, BLOCK_N) has every
    piece. Buffers and counts are reached through peer-offset tables (see `mok.kernels.rows`)."""
    out_ptr, out_offsets_ptr, dest_rank_ptr, dest_row_ptr, counts_ptr, counts_offsets_ptr, rank = (
        target
    )
    rows = row + tl.arange(0, BLOCK_M)
    valid = rows < row_end
    dest_rank = tl.load(dest_rank_ptr + rows, mask=valid, other=0)
    dest_row = tl.load(dest_row_ptr + rows, mask=valid, other=-1)
    keep = valid & (dest_row >= 0)
    base = tl.load(out_offsets_ptr + dest_rank, mask=keep, other=0)
    cols = n_off + tl.arange(0, BLOCK_N)
    offsets = base[:, None] + dest_row.to(tl.int64)[:, None] * N + cols[None, :]
    mask = keep[:, None] & (cols < N)[None, :]
    tl.store(out_ptr + offsets, tile.to(out_ptr.dtype.element_ty), mask=mask)
    peers = tl.arange(0, EP_BLOCK)
    landed = tl.sum(((dest_rank[:, None] == peers[None, :]) & keep[:, None]).to(tl.int32), axis=0)
    signal = landed > 0
    counts_offsets = tl.load(counts_offsets_ptr + peers, mask=signal, other=0)
    # Every thread's stores precede the release adds (the barrier), which publish them.
    tl.debug_barrier()
    tl.atomic_add(
        counts_ptr + counts_offsets + rank, landed, mask=signal, sem="release", scope="sys"
    )


@triton.jit
def _store_weight_part(desc, expert, part, m_off, n_off, ACCUMULATE: tl.constexpr):
    if ACCUMULATE:
        part += desc.load([expert, m_off, n_off]).reshape(part.shape).to(tl.float32)
    desc.store([expert, m_off, n_off], part.to(desc.dtype).reshape(desc.block_shape))


@triton.jit
def store_weight_tile(
    desc,  # [E, R, C] fp32 or bf16, block [1, BLOCK_M, BLOCK_N] or [1, BLOCK_M, BLOCK_N // 2]
    expert,
    tile,  # [BLOCK_M, BLOCK_N] fp32
    m_off,
    n_off,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Write (with ACCUMULATE: add, in fp32, then round once) a tile of one expert's [R, C]
    gradient; TMA drops what falls past R or C. A descriptor block half as wide as the tile
    stores it in two halves, halving the shared memory the epilogue stages through."""
    if desc.block_shape[2] == BLOCK_N:
        _store_weight_part(desc, expert, tile, m_off, n_off, ACCUMULATE)
    else:
        left, right = tile.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
        _store_weight_part(desc, expert, left, m_off, n_off, ACCUMULATE)
        _store_weight_part(desc, expert, right, m_off, n_off + BLOCK_N // 2, ACCUMULATE)


# --------------------------------------------------------------------------------------------------
# Persistent kernels: row-tiled
# --------------------------------------------------------------------------------------------------


@triton.jit
def claimed_task(claims_ptr):
    """The launch's next unclaimed task (`TileClaims`): one atomic add on its counter."""
    return tl.atomic_add(claims_ptr, 1, sem="relaxed")


@triton.jit
def _gate_up_swiglu_task(
    task,
    tiles,
    a_source,
    weights,
    outputs,
    activation,
    ready,
    HAS_LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PLAIN: tl.constexpr,
    SAVE_PREACT: tl.constexpr,
    GATHER: tl.constexpr,
    WAIT_ROWS: tl.constexpr,
    FLAG_ROWS: tl.constexpr,
    FLAGS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One output tile of `_gate_up_swiglu_kernel`: h and, with SAVE_PREACT, both
    pre-activations of a row tile and a column tile."""
    table_ptr, capacity, num_m, n_tiles, hidden, inter = tiles
    w_gate_desc, w_up_desc, biases = weights
    h_desc, gate_desc, up_desc, stores = outputs
    h_ptr, gate_up_ptr = stores[0], stores[1]
    limit, limit_below, limit_above, alpha, up_offset = activation
    m_idx, n_idx = grouped_task(task, num_m, n_tiles, GROUP_M)
    expert, row, row_end = load_row_tile(table_ptr, capacity, m_idx)
    n_off = n_idx * BLOCK_N
    if WAIT_ROWS:
        wait_rows_ready(ready, row, row_end, FLAG_ROWS, FLAGS)
    gate, up = rows_two_weights_tile(
        a_source,
        w_gate_desc,
        w_up_desc,
        row,
        expert,
        n_off,
        hidden,
        GATHER,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    if HAS_BIAS:
        gate = add_expert_bias(gate, biases[0], expert, n_off, inter, BLOCK_N)
        up = add_expert_bias(up, biases[1], expert, n_off, inter, BLOCK_N)
    h = swiglu_tile(gate, up, limit, alpha, up_offset, HAS_LIMIT, PLAIN)
    store_row_tile(h_desc, h_ptr, inter, h, row, row_end, n_off, inter, BLOCK_M, BLOCK_N)
    if SAVE_PREACT:
        gate, up = saved_preactivations(gate, up, limit, limit_below, limit_above, HAS_LIMIT)
        store_row_tile(
            gate_desc, gate_up_ptr, 2 * inter, gate, row, row_end, n_off, inter, BLOCK_M, BLOCK_N
        )
        store_row_tile(
            up_desc,
            gate_up_ptr + inter,
            2 * inter,
            up,
            row,
            row_end,
            n_off,
            inter,
            BLOCK_M,
            BLOCK_N,
        )


@fast_launch
@triton.jit(do_not_specialize=["capacity", "num_rows"])
def _gate_up_swiglu_kernel(
    x_desc,  # [M, H] rows, block [BLOCK_M, BLOCK_K] (with gather: unused)
    w_gate_desc,  # [E, I, H], block [1, BLOCK_N, BLOCK_K]
    w_up_desc,  # [E, I, H], block [1, BLOCK_N, BLOCK_K]
    h_desc,  # [M, I] out: swiglu(gate, up), block [BLOCK_M, BLOCK_N]
    gate_desc,  # [M, I] (row stride 2I) out when saving: gate pre-activations
    up_desc,  # [M, I] (row stride 2I) out when saving: up pre-activations
    capacity,  # columns of the row-tile table
    num_rows,  # M
    problem,  # (table_ptr [3, capacity] int32 row tiles, counts_ptr [2] int32, hidden, inter)
    stores,  # (h_ptr: h's first element, gate_up_ptr: None, or [M, 2I] gate | up, the storage
    # of gate_desc and up_desc: the pre-activations saved)
    activation,  # (limit or None (no clamp), the largest value of gate_up's dtype <= limit, the
    # smallest > limit, alpha, up_offset: the activation's (`swiglu_tile`) unless PLAIN)
    biases,  # None, or (gate's, up's) [E, I] added to the products before the activation
    gather,  # None, or x's rows through an index: (x_ptr [S, H], x_stride, source_rows_ptr [M])
    rows_ready,  # None, or the `RowsReady` fields in order: the rows land while this runs
    claims_ptr,  # None, or [1] int32 the launch's task counter (`TileClaims`)
    PLAIN: tl.constexpr,
    READY_FLAGS: tl.constexpr,  # rows_ready's (rows a flag, flags a tile at most)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS (with claims_ptr: any, the tasks claimed from it). h = swiglu(x @
    W_gate[e].T, x @ W_up[e].T) for every group's rows; with gather x's rows through an index
    (`row_block`); with rows_ready a tile first waits for its rows to land
    (`wait_rows_ready`). The parts absent as None are compiled out."""
    table_ptr, counts_ptr, hidden, inter = problem
    HAS_LIMIT: tl.constexpr = activation[0] is not None
    HAS_BIAS: tl.constexpr = biases is not None
    SAVE_PREACT: tl.constexpr = stores[1] is not None
    GATHER: tl.constexpr = gather is not None
    WAIT_ROWS: tl.constexpr = rows_ready is not None
    CLAIM: tl.constexpr = claims_ptr is not None
    FLAG_ROWS: tl.constexpr = READY_FLAGS[0]
    FLAGS: tl.constexpr = READY_FLAGS[1]
    if GATHER:
        a_source = (gather[0], gather[1], gather[2], num_rows, hidden)
    else:
        a_source = (x_desc,)
    n_tiles = tl.cdiv(inter, BLOCK_N)
    num_m = tl.load(counts_ptr)
    num_tasks = num_m * n_tiles
    tiles = (table_ptr, capacity, num_m, n_tiles, hidden, inter)
    # The parts that may be None go into tuples as the arguments themselves (a None bound to
    # another name does not).
    weights = (w_gate_desc, w_up_desc, biases)
    outputs = (h_desc, gate_desc, up_desc, stores)
    # The static grid keeps a `for` loop: a `while` loop compiles it differently.
    if CLAIM:
        task = claimed_task(claims_ptr)
        while task < num_tasks:
            _gate_up_swiglu_task(
                task, tiles, a_source, weights, outputs, activation, rows_ready, HAS_LIMIT,
                HAS_BIAS, PLAIN, SAVE_PREACT, GATHER, WAIT_ROWS, FLAG_ROWS, FLAGS, BLOCK_M,
                BLOCK_N, BLOCK_K, GROUP_M,
            )  # fmt: skip
            task = claimed_task(claims_ptr)
    else:
        for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS):
            _gate_up_swiglu_task(
                task, tiles, a_source, weights, outputs, activation, rows_ready, HAS_LIMIT,
                HAS_BIAS, PLAIN, SAVE_PREACT, GATHER, WAIT_ROWS, FLAG_ROWS, FLAGS, BLOCK_M,
                BLOCK_N, BLOCK_K, GROUP_M,
            )  # fmt: skip


@fast_launch
@triton.jit(do_not_specialize=["capacity", "num_rows"])
def _down_kernel(
    h_desc,  # [M, I], block [BLOCK_M, BLOCK_K] (with gather: unused)
    w_down_desc,  # [E, H, I], block [1, BLOCK_N, BLOCK_K]
    out_desc,  # [M, H] out, block [BLOCK_M, BLOCK_N] (with scatter: unused)
    out_ptr,  # out's first element
    capacity,  # columns of the row-tile table
    num_rows,  # M
    problem,  # (table_ptr [3, capacity] int32 row tiles, counts_ptr [2] int32, hidden, inter)
    bias_ptr,  # None, or [E, H] added to the outputs
    gather,  # None, or h's rows through an index: (h_ptr [S, I], h_stride, source_rows_ptr [M])
    scatter,  # None, or the `RowScatter` fields in order: out's rows to the ranks' buffers
    EP_BLOCK: tl.constexpr,  # scatter's ranks, a power of two >= ep
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS. out = h @ W_down[e].T for every group's rows; with gather h's rows
    through an index (`row_block`); with scatter out's rows to the ranks' buffers
    (`scatter_row_tile`). The parts absent as None are compiled out."""
    table_ptr, counts_ptr, hidden, inter = problem
    GATHER: tl.constexpr = gather is not None
    if GATHER:
        a_source = (gather[0], gather[1], gather[2], num_rows, inter)
    else:
        a_source = (h_desc,)
    n_tiles = tl.cdiv(hidden, BLOCK_N)
    num_tasks = tl.load(counts_ptr) * n_tiles
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS):
        m_idx, n_idx = grouped_task(task, num_tasks // n_tiles, n_tiles, GROUP_M)
        expert, row, row_end = load_row_tile(table_ptr, capacity, m_idx)
        n_off = n_idx * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = rows_tile(
            a_source,
            w_down_desc,
            row,
            expert,
            n_off,
            inter,
            acc,
            True,
            GATHER,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
        if bias_ptr is not None:
            acc = add_expert_bias(acc, bias_ptr, expert, n_off, hidden, BLOCK_N)
        if scatter is not None:
            scatter_row_tile(acc, scatter, row, row_end, n_off, hidden, EP_BLOCK, BLOCK_M, BLOCK_N)
        else:
            store_row_tile(
                out_desc, out_ptr, hidden, acc, row, row_end, n_off, hidden, BLOCK_M, BLOCK_N
            )


@triton.jit
def _down_dgrad_swiglu_task(
    task,
    tiles,
    grad_out_desc,
    w_down_desc,
    saved,
    outputs,
    activation,
    ready,
    weighting,
    HAS_LIMIT: tl.constexpr,
    PLAIN: tl.constexpr,
    WAIT_ROWS: tl.constexpr,
    FLAG_ROWS: tl.constexpr,
    FLAGS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One output tile of `_down_dgrad_swiglu_kernel`: the gate and up gradients of a row tile
    and a column tile."""
    table_ptr, capacity, num_m, n_tiles, hidden, inter = tiles
    gate_desc, up_desc = saved
    grad_gate_desc, grad_up_desc, grad_gate_up_ptr = outputs
    limit, _, _, alpha, up_offset = activation
    m_idx, n_idx = grouped_task(task, num_m, n_tiles, GROUP_M)
    expert, row, row_end = load_row_tile(table_ptr, capacity, m_idx)
    n_off = n_idx * BLOCK_N
    if WAIT_ROWS:
        wait_rows_ready(ready, row, row_end, FLAG_ROWS, FLAGS)
    grad_h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    grad_h = rows_tile(
        (grad_out_desc,),
        w_down_desc,
        row,
        expert,
        n_off,
        hidden,
        grad_h,
        False,
        False,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    # Rows past row_end hold other groups' values: they only reach output rows never stored.
    if WEIGHTED:
        h_desc, parts = weighting
        grad_h = router_weighting_tile(
            grad_h, (h_desc, parts[0], parts[1], parts[2], n_tiles), row, row_end, n_off, n_idx,
            inter, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    # h was rounded to the activation dtype in forward, so its gradient is too (as in autograd).
    grad_h = grad_h.to(grad_gate_desc.dtype).to(tl.float32)
    gate = gate_desc.load([row, n_off]).to(tl.float32)
    up = up_desc.load([row, n_off]).to(tl.float32)
    grad_gate, grad_up = swiglu_backward_tile(
        grad_h, gate, up, limit, alpha, up_offset, HAS_LIMIT, PLAIN
    )
    store_row_tile(
        grad_gate_desc,
        grad_gate_up_ptr,
        2 * inter,
        grad_gate,
        row,
        row_end,
        n_off,
        inter,
        BLOCK_M,
        BLOCK_N,
    )
    store_row_tile(
        grad_up_desc,
        grad_gate_up_ptr + inter,
        2 * inter,
        grad_up,
        row,
        row_end,
        n_off,
        inter,
        BLOCK_M,
        BLOCK_N,
    )


@fast_launch
@triton.jit(do_not_specialize=["capacity"])
def _down_dgrad_swiglu_kernel(
    grad_out_desc,  # [M, H], block [BLOCK_M, BLOCK_K]
    w_down_desc,  # [E, H, I], block [1, BLOCK_K, BLOCK_N]
    gate_desc,  # [M, I] (row stride 2I) saved gate pre-activations, block [BLOCK_M, BLOCK_N]
    up_desc,  # [M, I] (row stride 2I) saved up pre-activations, block [BLOCK_M, BLOCK_N]
    grad_gate_desc,  # [M, I] (row stride 2I) out, block [BLOCK_M, BLOCK_N]
    grad_up_desc,  # [M, I] (row stride 2I) out, block [BLOCK_M, BLOCK_N]
    h_desc,  # None, or with weighting [M, I] the forward's h, block [BLOCK_M, BLOCK_N]
    grad_gate_up_ptr,  # [M, 2I] grad gate | grad up, the storage of the two above
    capacity,  # columns of the row-tile table
    problem,  # (table_ptr [3, capacity] int32 row tiles, counts_ptr [2] int32, hidden, inter)
    activation,  # (limit or None (no clamp), two values unused here, alpha, up_offset: the
    # activation's (`swiglu_tile`) unless PLAIN), as `_gate_up_swiglu_kernel` takes it
    rows_ready,  # None, or the `RowsReady` fields in order: grad_out's rows land while this runs
    claims_ptr,  # None, or [1] int32 the launch's task counter (`TileClaims`)
    weighting,  # None, or (h_ptr: h's first element (contiguous), row_weights_ptr [M] fp32 each
    # grouped row's router weight, dots_ptr [M, cdiv(I, BLOCK_N)] fp32 out: their gradients' parts)
    PLAIN: tl.constexpr,
    READY_FLAGS: tl.constexpr,  # rows_ready's (rows a flag, flags a tile at most)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS (with claims_ptr: any, the tasks claimed from it). grad_h = grad_out @
    W_down[e], then the SwiGLU backward on it. With rows_ready a tile first waits for its
    grad_out rows to land (`wait_rows_ready`); with weighting grad_out's rows are unweighted and
    each row's router weight is applied to grad_h in the epilogue (`router_weighting_tile`). The
    parts absent as None are compiled out."""
    table_ptr, counts_ptr, hidden, inter = problem
    HAS_LIMIT: tl.constexpr = activation[0] is not None
    WAIT_ROWS: tl.constexpr = rows_ready is not None
    WEIGHTED: tl.constexpr = weighting is not None
    CLAIM: tl.constexpr = claims_ptr is not None
    FLAG_ROWS: tl.constexpr = READY_FLAGS[0]
    FLAGS: tl.constexpr = READY_FLAGS[1]
    n_tiles = tl.cdiv(inter, BLOCK_N)
    num_m = tl.load(counts_ptr)
    num_tasks = num_m * n_tiles
    tiles = (table_ptr, capacity, num_m, n_tiles, hidden, inter)
    saved = (gate_desc, up_desc)
    outputs = (grad_gate_desc, grad_up_desc, grad_gate_up_ptr)
    # The parts that may be None go into tuples as the arguments themselves (a None bound to
    # another name does not).
    weighted = (h_desc, weighting)
    # The static grid keeps a `for` loop: a `while` loop compiles it differently.
    if CLAIM:
        task = claimed_task(claims_ptr)
        while task < num_tasks:
            _down_dgrad_swiglu_task(
                task, tiles, grad_out_desc, w_down_desc, saved, outputs, activation, rows_ready,
                weighted, HAS_LIMIT, PLAIN, WAIT_ROWS, FLAG_ROWS, FLAGS, WEIGHTED, BLOCK_M,
                BLOCK_N, BLOCK_K, GROUP_M,
            )  # fmt: skip
            task = claimed_task(claims_ptr)
    else:
        for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS):
            _down_dgrad_swiglu_task(
                task, tiles, grad_out_desc, w_down_desc, saved, outputs, activation, rows_ready,
                weighted, HAS_LIMIT, PLAIN, WAIT_ROWS, FLAG_ROWS, FLAGS, WEIGHTED, BLOCK_M,
                BLOCK_N, BLOCK_K, GROUP_M,
            )  # fmt: skip


@fast_launch
@triton.jit(do_not_specialize=["capacity"])
def _gate_up_dgrad_kernel(
    grad_gate_desc,  # [M, I] (row stride 2I), block [BLOCK_M, BLOCK_K]
    grad_up_desc,  # [M, I] (row stride 2I), block [BLOCK_M, BLOCK_K]
    w_gate_desc,  # [E, I, H], block [1, BLOCK_K, BLOCK_N]
    w_up_desc,  # [E, I, H], block [1, BLOCK_K, BLOCK_N]
    grad_x_desc,  # [M, H] out, block [BLOCK_M, BLOCK_N]
    grad_x_ptr,  # grad_x's first element
    table_ptr,  # [3, capacity] int32 row tiles
    counts_ptr,  # [2] int32
    capacity,
    hidden,
    inter,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS. grad_x = grad_gate @ W_gate[e] + grad_up @ W_up[e]; rows outside every
    group get zeros."""
    n_tiles = tl.cdiv(hidden, BLOCK_N)
    num_tasks = tl.load(counts_ptr + 1) * n_tiles
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS):
        m_idx, n_idx = grouped_task(task, num_tasks // n_tiles, n_tiles, GROUP_M)
        expert, row, row_end = load_row_tile(table_ptr, capacity, m_idx)
        n_off = n_idx * BLOCK_N
        if expert >= 0:
            acc = rows_two_products_tile(
                grad_gate_desc,
                grad_up_desc,
                w_gate_desc,
                w_up_desc,
                row,
                expert,
                n_off,
                inter,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        store_row_tile(
            grad_x_desc, grad_x_ptr, hidden, acc, row, row_end, n_off, hidden, BLOCK_M, BLOCK_N
        )


# --------------------------------------------------------------------------------------------------
# Persistent kernels: weight gradients
# --------------------------------------------------------------------------------------------------


@fast_launch
@triton.jit
def _weight_gradient_kernel(
    a_ptr,  # [M, HALVES * P] the outputs' gradients, rows a_stride apart
    b_ptr,  # [M, Q] rows; with gather [S, Q] read through an index
    gather,  # None, or (b_stride, source_rows_ptr [M] int32): grouped row r is b[source_rows[r]]
    offsets_ptr,  # [E + 1] int32
    first_desc,  # [E, P, Q] out (fp32 or bf16), block [1, BLOCK_M, BLOCK_N or BLOCK_N // 2]
    second_desc,  # HALVES 2: the second half's gradient, as first_desc (else first_desc again)
    sizes,  # (E, P, Q, a_stride)
    ACCUMULATE: tl.constexpr,  # (into first_desc, into second_desc): add, or overwrite
    HALVES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS. For each half j < HALVES, gradient j [e] = A[group e, j * P:+P].T @
    B[group e]: W_down's from grad_out and h (one half), W_gate's and W_up's from the gate | up
    gradients and the rows (two).

    Tasks run expert by expert, and within an expert half by half. With gather the rows are read
    through their index (`weight_gradient_tile`), the same values in the same order."""
    num_experts, p, q, a_stride = sizes
    GATHER: tl.constexpr = gather is not None
    m_tiles = tl.cdiv(p, BLOCK_M)
    n_tiles = tl.cdiv(q, BLOCK_N)
    per_half = m_tiles * n_tiles
    # A program's consecutive tasks are mostly of one expert and half: it makes their
    # descriptors (whose row extent ends at the group's end) only when those change. Only they
    # and the descriptors are carried from task to task: Triton 3.6 lost other integers carried
    # next to descriptors (replaced them by their initial values), so the bounds are loaded
    # every task.
    cached_half = -1
    cached_expert = -1
    a_desc = tl.make_tensor_descriptor(a_ptr, [1, p], [a_stride, 1], [BLOCK_K, BLOCK_M])
    b_desc = tl.make_tensor_descriptor(b_ptr, [1, q], [q, 1], [BLOCK_K, BLOCK_N])
    for task in tl.range(tl.program_id(0), num_experts * HALVES * per_half, NUM_PROGRAMS):
        half = task // per_half
        expert = half // HALVES
        second = half % HALVES == 1
        m_idx, n_idx = grouped_task(task % per_half, m_tiles, n_tiles, GROUP_M)
        first = tl.load(offsets_ptr + expert)
        num_rows = tl.maximum(tl.load(offsets_ptr + expert + 1) - first, 0)
        start = first.to(tl.int64)
        if not GATHER and expert != cached_expert:
            b_desc = tl.make_tensor_descriptor(
                b_ptr + start * q, [num_rows, q], [q, 1], [BLOCK_K, BLOCK_N]
            )
            cached_expert = expert
        if half != cached_half:
            a_desc = tl.make_tensor_descriptor(
                a_ptr + start * a_stride + second.to(tl.int64) * p,
                [num_rows, p],
                [a_stride, 1],
                [BLOCK_K, BLOCK_M],
            )
            cached_half = half
        m_off = m_idx * BLOCK_M
        n_off = n_idx * BLOCK_N
        if GATHER:
            b_source = (b_ptr, gather[0], gather[1], q)
        else:
            b_source = (b_desc,)
        acc = weight_gradient_tile(
            a_desc, b_source, first, m_off, n_off, num_rows, GATHER, BLOCK_M, BLOCK_N, BLOCK_K
        )
        # An expert without rows leaves an accumulation buffer untouched.
        if second:
            if num_rows > 0 or not ACCUMULATE[1]:
                store_weight_tile(
                    second_desc, expert, acc, m_off, n_off, ACCUMULATE[1], BLOCK_M, BLOCK_N
                )
        else:
            if num_rows > 0 or not ACCUMULATE[0]:
                store_weight_tile(
                    first_desc, expert, acc, m_off, n_off, ACCUMULATE[0], BLOCK_M, BLOCK_N
                )


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


@fast_launch
@triton.jit
def _group_column_sums_kernel(
    values_ptr,  # [M, N], unit column stride
    row_stride,
    offsets_ptr,  # [E + 1] int32 group offsets
    out_ptr,  # [E, N] contiguous
    columns,
    row_weights_ptr,  # [M] fp32 (ROW_WEIGHTED)
    ACCUMULATE: tl.constexpr,
    ROW_WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (E, cdiv(N, BLOCK_N)): out[e] = (out[e] +) the sum of group e's rows of values (each
    times its row weight with ROW_WEIGHTED, in fp32), in fp32 and a fixed order (each column of
    BLOCK_M-row chunks summed in row order, then the chunk's rows by `tl.sum`), rounded once to
    out's dtype."""
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = cols < columns
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first in tl.range(start, end, BLOCK_M):
        rows = first + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & live[None, :]
        offsets = rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
        values = tl.load(values_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if ROW_WEIGHTED:
            values *= tl.load(row_weights_ptr + rows, mask=rows < end, other=0.0)[:, None]
        acc += values
    total = tl.sum(acc, axis=0)
    target = out_ptr + expert * columns + cols
    if ACCUMULATE:
        total += tl.load(target, mask=live, other=0.0).to(tl.float32)
    tl.store(target, total.to(out_ptr.dtype.element_ty), mask=live)


def group_column_sums(
    values: torch.Tensor,
    group_offsets: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool = False,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [E, N] (contiguous): row e is the sum over group e's rows of values [M, N] (rows
    group_offsets[e]..group_offsets[e + 1], unit column stride), in fp32, rounded once to out's
    dtype; with `accumulate`, out's old value is added in that fp32 sum; with row_weights [M]
    fp32, each row times its weight in fp32 first. What an expert bias's gradient is.
    Deterministic (a fixed order); empty groups give zeros (or leave out as it is)."""
    num_experts, columns = out.shape
    if values.shape[1] != columns or values.stride(1) != 1 or not out.is_contiguous():
        raise ValueError(
            f"group_column_sums: values [M, {columns}] with unit column stride and a contiguous "
            f"out, got {tuple(values.shape)} strides {values.stride()} into {tuple(out.shape)}"
        )
    weighted = row_weights is not None
    if weighted and (row_weights.shape != values.shape[:1] or row_weights.dtype != torch.float32):
        raise ValueError(
            f"group_column_sums: row_weights must be [{values.shape[0]}] float32, got "
            f"{tuple(row_weights.shape)} {row_weights.dtype}"
        )
    if num_experts and columns:
        block_m, block_n = (8, 32) if interpreting() else (32, 128)
        _group_column_sums_kernel[(num_experts, triton.cdiv(columns, block_n))](
            values,
            values.stride(0),
            group_offsets,
            out,
            columns,
            row_weights.contiguous() if weighted else out,
            ACCUMULATE=accumulate,
            ROW_WEIGHTED=weighted,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
        )
    return out


@fast_launch
@triton.jit
def _group_row_dots_kernel(
    values_ptr,  # [M, N], unit column stride
    row_stride,
    table_ptr,  # `RowTiles.table` of BLOCK_M-row tiles
    counts_ptr,  # `RowTiles.counts`
    capacity,
    vectors_ptr,  # [E, N] contiguous
    out_ptr,  # [M] fp32
    columns,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Persistent over the groups' row tiles: out[r] += <values[r], vectors[e]> for every row r
    of group e, in fp32 and a fixed order (BLOCK_N-column chunks in order, then `tl.sum`)."""
    for tile in range(tl.program_id(0), tl.load(counts_ptr), NUM_PROGRAMS):
        expert, first, end = load_row_tile(table_ptr, capacity, tile)
        rows = first + tl.arange(0, BLOCK_M)
        live = rows < end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, columns, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            in_row = cols < columns
            offsets = rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
            values = tl.load(values_ptr + offsets, mask=live[:, None] & in_row[None, :], other=0.0)
            vector = tl.load(vectors_ptr + expert.to(tl.int64) * columns + cols, mask=in_row)
            acc += values.to(tl.float32) * vector.to(tl.float32)[None, :]
        dots = tl.load(out_ptr + rows, mask=live, other=0.0) + tl.sum(acc, axis=1)
        tl.store(out_ptr + rows, dots, mask=live)


ROW_DOTS_BLOCK_M = 32
"""The row tiles `group_row_dots` takes (`row_tile_map(..., ROW_DOTS_BLOCK_M)`)."""


def group_row_dots(
    values: torch.Tensor, tiles: RowTiles, vectors: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out [M] fp32 += per row r of group e (the groups of `tiles`, a `row_tile_map` of
    ROW_DOTS_BLOCK_M rows) the fp32 dot <values[r], vectors[e]> (values [M, N] with unit column
    stride, vectors [E, N]); rows outside the groups are left as they are. What a down bias adds
    to the router weights' gradient. Deterministic (a fixed order)."""
    rows, columns = values.shape
    if tiles.block_m != ROW_DOTS_BLOCK_M:
        raise ValueError(f"group_row_dots: tiles of {ROW_DOTS_BLOCK_M} rows, got {tiles.block_m}")
    if values.stride(1) != 1 or vectors.shape[1] != columns or not vectors.is_contiguous():
        raise ValueError(
            f"group_row_dots: values [M, N] with unit column stride and contiguous vectors "
            f"[E, N], got {tuple(values.shape)} strides {values.stride()} and "
            f"{tuple(vectors.shape)}"
        )
    if out.shape != (rows,) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"group_row_dots: out must be [{rows}] float32, got {tuple(out.shape)}")
    if rows and columns:
        block_n = 32 if interpreting() else 128
        tiles_per_sm = GemmTiles(ROW_DOTS_BLOCK_M, block_n, block_n, programs_per_sm=4)
        programs = num_programs(values.device, tiles.capacity, tiles_per_sm)
        _group_row_dots_kernel[(programs,)](
            values,
            values.stride(0),
            tiles.table,
            tiles.counts,
            tiles.capacity,
            vectors,
            out,
            columns,
            BLOCK_M=ROW_DOTS_BLOCK_M,
            BLOCK_N=block_n,
            NUM_PROGRAMS=programs,
        )
    return out


def _desc(tensor: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """Descriptor of a tensor (unit last stride) read or written in tiles of shape `block`."""
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), block)


def _epilogue_n(block_n: int, grad: torch.Tensor) -> int:
    """Columns a weight-gradient tile is stored in at once: halves of fp32 tiles wider than 128
    (whose staging buffer would not fit next to the pipeline's)."""
    return block_n // 2 if block_n > 128 and grad.element_size() == 4 else block_n


def _activation_args(swiglu_limit: float | None, activation: Activation, dtype) -> tuple:
    """The kernels' activation: (limit or None, the edges of the limit in `dtype`
    (`limit_edges`), alpha, up_offset)."""
    limit = None if swiglu_limit is None else float(swiglu_limit)
    edges = limit_edges(swiglu_limit, dtype)
    return (limit, *edges, float(activation.alpha), float(activation.up_offset))


def gate_up_swiglu(
    rows: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    tiles: RowTiles,
    swiglu_limit: float | None,
    save_preact: bool,
    cfg: GemmTiles,
    source_rows: torch.Tensor | None = None,
    ready: RowsReady | None = None,
    activation: Activation = SWIGLU,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [M, I] and, when `save_preact`, the pre-activations gate | up [M, 2I], both of the rows'
    dtype; rows outside the groups are left unwritten. With `source_rows`, grouped row r is
    rows[source_rows[r]] (`gathered_rows`). With `ready`, a tile reads its rows only once their
    flags say they landed (`RowsReady`). `biases` (gate, up: [E, I]) are added to the fp32
    pre-activations (the saved ones included) before `activation`."""
    m = gathered_rows(rows, source_rows)
    if ready is not None:
        ready.check(m)
    hidden = rows.shape[1]
    inter = w_gate.shape[1]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    h = torch.empty(m, inter, dtype=rows.dtype, device=rows.device)
    gate_up = torch.empty(m, 2 * inter, dtype=rows.dtype, device=rows.device) if save_preact else h
    gate, up = (gate_up[:, :inter], gate_up[:, inter:]) if save_preact else (h, h)
    if m == 0:
        return h, gate_up if save_preact else None
    use_scratch_allocator(rows.device)

    def launch(programs: int, counter: torch.Tensor | None) -> None:
        _gate_up_swiglu_kernel[(programs,)](
            _desc(rows, [bm, bk]),
            _desc(w_gate, [1, bn, bk]),
            _desc(w_up, [1, bn, bk]),
            _desc(h, [bm, bn]),
            _desc(gate, [bm, bn]),
            _desc(up, [bm, bn]),
            tiles.capacity,
            m,
            (tiles.table, tiles.counts, hidden, inter),
            (h, gate_up if save_preact else None),
            _activation_args(swiglu_limit, activation, gate_up.dtype),
            contiguous_biases(biases),
            gather_source(rows, source_rows),
            None if ready is None else ready.args(),
            counter,
            PLAIN=activation.plain,
            READY_FLAGS=ready_flags(ready, bm),
            **launch_options(cfg, programs if counter is None else 1),
        )

    programs = num_programs(rows.device, tiles.capacity * triton.cdiv(inter, bn), cfg)
    launch_persistent(launch, programs, cfg.claims)
    return h, gate_up if save_preact else None


def _launch_down(
    h, w_down, tiles, cfg, out, source_rows, scatter: RowScatter | None, bias=None
) -> None:
    m = gathered_rows(h, source_rows)
    inter = h.shape[1]
    hidden = w_down.shape[1]
    if scatter is not None:
        scatter.check(m, hidden)
    if m == 0:
        return
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    programs = num_programs(h.device, tiles.capacity * triton.cdiv(hidden, bn), cfg)
    use_scratch_allocator(h.device)
    _down_kernel[(programs,)](
        _desc(h, [bm, bk]),
        _desc(w_down, [1, bn, bk]),
        _desc(out, [bm, bn]),
        out,
        tiles.capacity,
        m,
        (tiles.table, tiles.counts, hidden, inter),
        None if bias is None else bias.contiguous(),
        gather_source(h, source_rows),
        None if scatter is None else scatter.args(),
        EP_BLOCK=scatter.ep_block if scatter else 2,
        **launch_options(cfg, programs),
    )


def down(
    h: torch.Tensor,
    w_down: torch.Tensor,
    tiles: RowTiles,
    cfg: GemmTiles,
    out: torch.Tensor | None = None,
    source_rows: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [M, H] = h @ W_down[e].T (+ bias[e], bias [E, H], added in fp32) per group; rows
    outside the groups are left unwritten. `out` (contiguous, at least M rows): where to write
    (only its first M rows are used). With `source_rows`, grouped row r is h[source_rows[r]]
    (`gathered_rows`)."""
    m = gathered_rows(h, source_rows)
    if out is None:
        out = torch.empty(m, w_down.shape[1], dtype=h.dtype, device=h.device)
    out = out[:m]
    _launch_down(h, w_down, tiles, cfg, out, source_rows, None, bias)
    return out


def down_scatter(
    h: torch.Tensor,
    w_down: torch.Tensor,
    tiles: RowTiles,
    cfg: GemmTiles,
    scatter: RowScatter,
    source_rows: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """`down`'s rows h @ W_down[e].T (+ bias[e]) stored through the peer-store epilogue instead:
    row r to row scatter.dest_row[r] of rank scatter.dest_rank[r]'s buffer, then that rank's
    readiness count of this rank grows (`scatter_row_tile`)."""
    out = scatter.out
    _launch_down(h, w_down, tiles, cfg, out, source_rows, scatter, bias)


def down_dgrad_swiglu(
    grad_out: torch.Tensor,
    w_down: torch.Tensor,
    gate_up: torch.Tensor,
    tiles: RowTiles,
    swiglu_limit: float | None,
    cfg: GemmTiles,
    ready: RowsReady | None = None,
    activation: Activation = SWIGLU,
) -> torch.Tensor:
    """Gradients of the pre-activations, gate | up [M, 2I], through `activation`; rows outside
    the groups unwritten. With `ready`, a tile reads its grad_out rows only once their flags say
    they landed."""
    grad_gate_up, _ = _down_dgrad_swiglu(
        grad_out, w_down, gate_up, tiles, swiglu_limit, cfg, ready, activation, None
    )
    return grad_gate_up


def down_dgrad_swiglu_weighted(
    grad_out: torch.Tensor,
    w_down: torch.Tensor,
    gate_up: torch.Tensor,
    h: torch.Tensor,
    row_weights: torch.Tensor,
    tiles: RowTiles,
    swiglu_limit: float | None,
    cfg: GemmTiles,
    ready: RowsReady | None = None,
    activation: Activation = SWIGLU,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`down_dgrad_swiglu` with each row's router weight applied after the product, so that
    grad_out [M, H] holds the unweighted output gradients (the combine's, one per pair) and the
    router weights' gradient comes out of the same epilogue. Per grouped row r of expert e, with
    acc = grad_out[r] @ W_down[e] in fp32 and w = row_weights[r] (fp32 [M]):
        grad_h = round(w * acc), then the activation's backward as in `down_dgrad_swiglu`;
        dots[r] = <acc, h[r]>, in fp32 over each column tile, then over the tiles (a fixed order);
        h[r] <- round(w * h[r]) in place, what W_down's gradient reads (grad_out.T @ h).
    h [M, I] contiguous: the forward's h. Returns (gate | up gradients [M, 2I], dots [M] fp32);
    rows outside the groups: gradients and h unwritten, dots 0. The rounding points are
    `mok.reference.expert.weighted_down_backward`'s."""
    m, inter = grad_out.shape[0], w_down.shape[2]
    check_weighting(grad_out, h, row_weights, inter)
    if m == 0:
        return grad_out.new_empty(0, 2 * inter), row_weights.new_zeros(0)
    return _down_dgrad_swiglu(
        grad_out, w_down, gate_up, tiles, swiglu_limit, cfg, ready, activation, (h, row_weights)
    )


def _down_dgrad_swiglu(
    grad_out, w_down, gate_up, tiles: RowTiles, swiglu_limit, cfg: GemmTiles, ready, activation,
    weighting: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    m, hidden = grad_out.shape
    if ready is not None:
        ready.check(m)
    inter = w_down.shape[2]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    grad_gate_up = torch.empty(m, 2 * inter, dtype=grad_out.dtype, device=grad_out.device)
    dots = h_desc = weighting_args = None
    if weighting is not None:
        h, row_weights = weighting
        dots = torch.zeros(m, triton.cdiv(inter, bn), dtype=torch.float32, device=h.device)
        h_desc, weighting_args = _desc(h, [bm, bn]), (h, row_weights, dots)
    programs = num_programs(grad_out.device, tiles.capacity * triton.cdiv(inter, bn), cfg)
    use_scratch_allocator(grad_out.device)

    def launch(programs: int, counter: torch.Tensor | None) -> None:
        _down_dgrad_swiglu_kernel[(programs,)](
            _desc(grad_out, [bm, bk]),
            _desc(w_down, [1, bk, bn]),
            _desc(gate_up[:, :inter], [bm, bn]),
            _desc(gate_up[:, inter:], [bm, bn]),
            _desc(grad_gate_up[:, :inter], [bm, bn]),
            _desc(grad_gate_up[:, inter:], [bm, bn]),
            h_desc,
            grad_gate_up,
            tiles.capacity,
            (tiles.table, tiles.counts, hidden, inter),
            _activation_args(swiglu_limit, activation, grad_out.dtype),
            None if ready is None else ready.args(),
            counter,
            weighting_args,
            PLAIN=activation.plain,
            READY_FLAGS=ready_flags(ready, bm),
            **launch_options(cfg, programs if counter is None else 1),
        )

    launch_persistent(launch, programs, cfg.claims)
    return grad_gate_up, None if dots is None else dots.sum(1)


def gate_up_dgrad(
    grad_gate_up: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    tiles: RowTiles,
    cfg: GemmTiles,
) -> torch.Tensor:
    """grad_x [M, H] = grad_gate @ W_gate[e] + grad_up @ W_up[e]; zero outside the groups."""
    m = grad_gate_up.shape[0]
    inter, hidden = w_gate.shape[1], w_gate.shape[2]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    grad_x = torch.empty(m, hidden, dtype=grad_gate_up.dtype, device=grad_gate_up.device)
    programs = num_programs(grad_x.device, tiles.capacity * triton.cdiv(hidden, bn), cfg)
    use_scratch_allocator(grad_x.device)
    _gate_up_dgrad_kernel[(programs,)](
        _desc(grad_gate_up[:, :inter], [bm, bk]),
        _desc(grad_gate_up[:, inter:], [bm, bk]),
        _desc(w_gate, [1, bk, bn]),
        _desc(w_up, [1, bk, bn]),
        _desc(grad_x, [bm, bn]),
        grad_x,
        tiles.table,
        tiles.counts,
        tiles.capacity,
        hidden,
        inter,
        **launch_options(cfg, programs),
    )
    return grad_x


def _launch_weight_gradients(
    a: torch.Tensor,
    b: torch.Tensor,
    group_offsets: torch.Tensor,
    grads: tuple[torch.Tensor, ...],
    accumulate: tuple[bool, ...],
    cfg: GemmTiles,
    source_rows: torch.Tensor | None = None,
) -> None:
    """grads[j][e] (+)= a[group e, j * P:+P].T @ b[group e] in place (`_weight_gradient_kernel`;
    grads [E, P, Q], one or two, laid out alike)."""
    num_experts, p, q = grads[0].shape
    bm, bn = cfg.block_m, cfg.block_n
    tasks = num_experts * len(grads) * triton.cdiv(p, bm) * triton.cdiv(q, bn)
    programs = num_programs(b.device, tasks, cfg)
    use_scratch_allocator(b.device)
    gathered_rows(b, source_rows)
    descs = [_desc(grad, [1, bm, _epilogue_n(bn, grad)]) for grad in grads]
    _weight_gradient_kernel[(programs,)](
        a,
        b,
        None if source_rows is None else (b.stride(0), source_rows),
        group_offsets,
        descs[0],
        descs[-1],
        (num_experts, p, q, a.stride(0)),
        ACCUMULATE=(accumulate[0], accumulate[-1]),
        HALVES=len(grads),
        **launch_options(cfg, programs),
    )


def down_wgrad(
    grad_out: torch.Tensor,
    h: torch.Tensor,
    group_offsets: torch.Tensor,
    grad_w_down: torch.Tensor,
    accumulate: bool,
    cfg: GemmTiles,
) -> None:
    """grad_w_down[e] (+)= grad_out[group e].T @ h[group e], in place ([E, H, I], fp32 or bf16)."""
    _launch_weight_gradients(grad_out, h, group_offsets, (grad_w_down,), (accumulate,), cfg)


def gate_up_wgrad(
    grad_gate_up: torch.Tensor,
    rows: torch.Tensor,
    group_offsets: torch.Tensor,
    grad_w_gate: torch.Tensor,
    grad_w_up: torch.Tensor,
    accumulate_gate: bool,
    accumulate_up: bool,
    cfg: GemmTiles,
    source_rows: torch.Tensor | None = None,
) -> None:
    """grad_w_gate[e] (+)= grad_gate[group e].T @ rows[group e], grad_w_up likewise, in place.
    source_rows: [M] int32, the grouped rows read through it (grouped row r is
    rows[source_rows[r]], rows [S, H] with a unit column stride: e.g. the tokens received, each
    once, rather than a copy per pair); None: rows are the grouped rows [M, H]."""
    _launch_weight_gradients(
        grad_gate_up,
        rows,
        group_offsets,
        (grad_w_gate, grad_w_up),
        (accumulate_gate, accumulate_up),
        cfg,
        source_rows,
    )
