"""Moving token rows between the buffers of the ranks: @triton.jit tile functions and launchers.

Another rank's buffer is reached through a *peer-offset table*: an int64 tensor [ep] whose entry r
is the distance, in elements, from this rank's buffer to rank r's mapping of the same buffer
(symmetric memory maps every peer's buffer into this process). Addresses are formed as
`local_pointer + offset`, so Triton can prove the 16-byte alignment it needs for vector accesses
(a pointer loaded from memory would have unknown alignment). A table of zeros is a local buffer.

Readiness flags (`mok.kernels.sync.signal_ready` / `wait_ready`) carry an epoch: a device counter
every rank bumps once per exchange. A flag equal to the current epoch means "written in this
exchange", so flags never need resetting, also under CUDA-graph replay. Waits are bounded: see
`mok.kernels.sync`.

The tile functions are meant to be called from other task loops too (the fused kernel). Launchers
take `programs`, the number of persistent programs (SMs) given to the copy. Under the CPU
interpreter these kernels run too (separate CPU tensors play the ranks); spin-waits there must
only meet flags that are already set, since programs run one after another.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mok.kernels._triton_compat import interpreting, patch_interpreter
from mok.kernels.launch import fast_launch
from mok.kernels.mx import MXRows, mx_dequantize_tile, mx_quantize_tile
from mok.kernels.sync import signal_ready, timeout_ns, wait_ready
from mok.reference.mx import ScaleRounding

if interpreting():
    patch_interpreter()

BLOCK_H = 512
"""Columns one program moves per step."""

# Tiles from a sweep on two H200s (benchmarks/results/2026-11-30-exchange-h200-x2.md): many warps
# keep enough loads and stores in flight to cover the NVLink latency (24 SMs) and feed HBM (all
# SMs).
PUSH_TILE = {"num_warps": 16, "block_h": 512}
"""push_rows at 24 SMs."""
COPY_TILE = {"num_warps": 16, "block_h": 1024}
COPY_ROWS = 32
"""copy_rows, over NVLink and locally."""
LOCAL_SUM = {"block_rows": 16, "num_warps": 16, "block_h": 1024}
"""reduce_rows tiles for sums over local memory beside the exchange's copies (swept for the
combine's sum: benchmarks/results/2026-11-30-exchange-h200-x2.md)."""
LOCAL_EXCHANGE_SUM = {"block_rows": 8, "num_warps": 16, "block_h": 1024}
LOCAL_EXCHANGE_SUM_PROGRAMS_PER_SM = 2
"""reduce_rows tiles and programs per SM for the one-process exchange's sums, which have the GPU to
themselves (no copy kernel beside them): two 8-row programs per SM keep more loads in flight than
one 16-row program (swept with the rows where `LocalExchange` places a uniform routing's pairs:
benchmarks/results/2026-12-03-ep1-gathered-forward-local-sums-h200.md). The tiling does not
change the sums' order, so the results are bitwise the same."""


@triton.jit
def push_rows_tile(
    src_ptr,
    src_stride,
    first_row,
    num_rows,
    slot_ptr,
    dst_ptr,
    dst_offsets_ptr,
    dst_capacity,
    hidden,
    EP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Copy rows first_row .. first_row + BLOCK_ROWS of src [num_rows, hidden] into rank d's
    dst [dst_capacity, hidden] at row slot[t, d] (slot [num_rows, EP]; < 0 or >= capacity: skip).
    Each source row is read once and stored to every rank that takes it."""
    rows = first_row + tl.arange(0, BLOCK_ROWS)
    live = rows < num_rows
    src_rows = src_ptr + rows.to(tl.int64)[:, None] * src_stride
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        cols_ok = (cols < hidden)[None, :]
        values = tl.load(src_rows + cols[None, :], mask=live[:, None] & cols_ok)
        for d in tl.static_range(EP):
            slot = tl.load(slot_ptr + rows * EP + d, mask=live, other=-1)
            keep = (slot >= 0) & (slot < dst_capacity)
            offset = tl.load(dst_offsets_ptr + d) + slot * hidden
            offset = tl.multiple_of(offset, ALIGN)
            tl.store(
                dst_ptr + offset[:, None] + cols[None, :], values, mask=keep[:, None] & cols_ok
            )


@fast_launch
@triton.jit
def push_rows_kernel(
    src_ptr,
    src_stride,
    num_rows,
    slot_ptr,
    dst_ptr,
    dst_offsets_ptr,
    dst_capacity,
    flags_ptr,
    flag_offsets_ptr,
    flag_base,
    epoch_ptr,
    hidden,
    EP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ALIGN: tl.constexpr,
    SIGNAL: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Persistent push: every block of BLOCK_ROWS source rows goes to its ranks, then (SIGNAL)
    flag flag_base + block on every rank is set to the epoch."""
    epoch = tl.load(epoch_ptr)
    for block in range(tl.program_id(0), tl.cdiv(num_rows, BLOCK_ROWS), NUM_PROGRAMS):
        push_rows_tile(
            src_ptr,
            src_stride,
            block * BLOCK_ROWS,
            num_rows,
            slot_ptr,
            dst_ptr,
            dst_offsets_ptr,
            dst_capacity,
            hidden,
            EP,
            BLOCK_ROWS,
            BLOCK_H,
            ALIGN,
        )
        if SIGNAL:
            for d in tl.static_range(EP):
                flag = flags_ptr + tl.load(flag_offsets_ptr + d) + flag_base + block
                signal_ready(flag, epoch)


@triton.jit
def copy_rows_tile(
    dst,  # (dst_ptr, dst_capacity, dst_row_ptr or None, peers or None): rows' destinations
    src,  # (src_ptr, src_capacity, src_row_ptr, peers or None): rows' sources
    first_row,
    count,
    hidden,
    waits,  # None, or (flags_ptr, wait_ptr, status_ptr, timeout_ns, wait_id)
    epoch,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """For the tile's rows r below count: value = src_{src_rank[r]}[src_row[r]] (zeros where
    src_row is < 0 or >= src_capacity); stored to dst row r, or with a dst_row_ptr to
    dst_{dst_rank[r]}[dst_row[r]], skipped where dst_row is < 0 or >= dst_capacity. A buffer's
    peers, (offsets_ptr, rank_ptr): its peer-offset table and each row's rank; None: the buffer
    is local. With waits: first spin until flags[wait[r]] equals the epoch for every row that
    has a source (bounded: a failure goes to the status, see mok.kernels.sync.wait_ready)."""
    DST_ROWS: tl.constexpr = dst[2] is not None
    DST_PEERS: tl.constexpr = dst[3] is not None
    SRC_PEERS: tl.constexpr = src[3] is not None
    dst_ptr, dst_capacity, dst_row_ptr, dst_peers = dst
    src_ptr, src_capacity, src_row_ptr, src_peers = src
    rows = first_row + tl.arange(0, BLOCK_ROWS)
    live = rows < count
    src_row = tl.load(src_row_ptr + rows, mask=live, other=-1)
    valid = live & (src_row >= 0) & (src_row < src_capacity)
    if waits is not None:
        flags_ptr, wait_ptr, status_ptr, timeout_ns, wait_id = waits
        wait_index = tl.load(wait_ptr + rows, mask=valid, other=0)
        wait_ready(
            flags_ptr + wait_index,
            wait_index,
            epoch,
            valid,
            status_ptr,
            timeout_ns,
            wait_id,
        )
    src_offset = src_row * hidden
    if SRC_PEERS:
        rank = tl.load(src_peers[1] + rows, mask=valid, other=0)
        src_offset += tl.load(src_peers[0] + rank, mask=valid, other=0)
    src_offset = tl.multiple_of(src_offset, ALIGN)
    if DST_ROWS:
        dst_row = tl.load(dst_row_ptr + rows, mask=live, other=-1)
        keep = live & (dst_row >= 0) & (dst_row < dst_capacity)
    else:
        dst_row = rows.to(tl.int64)
        keep = live
    dst_offset = dst_row * hidden
    if DST_PEERS:
        rank = tl.load(dst_peers[1] + rows, mask=keep, other=0)
        dst_offset += tl.load(dst_peers[0] + rank, mask=keep, other=0)
    dst_offset = tl.multiple_of(dst_offset, ALIGN)
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        cols_ok = (cols < hidden)[None, :]
        values = tl.load(
            src_ptr + src_offset[:, None] + cols[None, :], mask=valid[:, None] & cols_ok, other=0.0
        )
        tl.store(
            dst_ptr + dst_offset[:, None] + cols[None, :], values, mask=keep[:, None] & cols_ok
        )


@fast_launch
@triton.jit
def copy_rows_kernel(
    dst,  # `copy_rows_tile`'s
    src,  # `copy_rows_tile`'s
    count_ptr,
    max_rows,
    hidden,
    waits,  # `copy_rows_tile`'s
    epoch_ptr,  # None, or [1] int32 (with waits or landed_ptr)
    landed_ptr,  # None, or this rank's flags of the tiles landed
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ALIGN: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Persistent copy of min(count, max_rows) rows (count read on the device). With landed_ptr:
    after tile b, landed[b] (this rank's) is set to the epoch."""
    count = tl.minimum(tl.load(count_ptr).to(tl.int64), max_rows)
    epoch = 0
    if epoch_ptr is not None:
        epoch = tl.load(epoch_ptr)
    for tile in range(tl.program_id(0), tl.cdiv(count, BLOCK_ROWS), NUM_PROGRAMS):
        copy_rows_tile(
            dst, src, tile * BLOCK_ROWS, count, hidden, waits, epoch, BLOCK_ROWS, BLOCK_H, ALIGN
        )
        if landed_ptr is not None:
            signal_ready(landed_ptr + tile, epoch)


@triton.jit
def reduce_rows_tile(
    out_ptr,
    first_row,
    count,
    hidden,
    terms,  # (src_ptr, src_capacity, src_offsets_ptr or None, rank_ptr or None, row_ptr,
    # weight_ptr or None)
    init_ptr,  # None, or [N, H]
    tail_ptr,  # None, or [N, H]
    gathered,  # None, or (gathered_ptr, gathered_stride)
    WIDTH: tl.constexpr,
    RANK_MODE: tl.constexpr,
    GATHER_MX: tl.constexpr,
    RCEIL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """out[t] = round(init[t] + sum_j weight[t, j] * src_{rank(t, j)}[row[t, j]] + tail[t]) for
    the tile's rows t below count, the sum in fp32 over j = 0 .. WIDTH-1 in order, each term
    rounded before it is added (launch with fp fusion off so no multiply-add is contracted); a
    None init, tail or weight is left out. Terms with row < 0 or >= src_capacity are skipped.
    rank(t, j): 0 = local source (RANK_MODE 0), j (1), rank[t, j] (2). With gathered: also row
    t * WIDTH + j of gathered (rows gathered_stride elements apart) = the term's row, zeros where
    skipped; GATHER_MX: as packed MX rows (`MXRows`, blocks of 32 along H, BLOCK_H a multiple of
    32) of its MXFP8 cast along H."""
    HAS_WEIGHT: tl.constexpr = terms[5] is not None
    SAVE_GATHERED: tl.constexpr = gathered is not None
    src_ptr, src_capacity, src_offsets_ptr, rank_ptr, row_ptr, weight_ptr = terms
    rows = first_row + tl.arange(0, BLOCK_ROWS)
    live = rows < count
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * hidden
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        cols_ok = (cols < hidden)[None, :]
        here = live[:, None] & cols_ok
        token_cols = rows.to(tl.int64)[:, None] * hidden + cols[None, :]
        if init_ptr is not None:
            acc = tl.load(init_ptr + token_cols, mask=here, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_ROWS, BLOCK_H), dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            row = tl.load(row_ptr + rows * WIDTH + j, mask=live, other=-1)
            valid = live & (row >= 0) & (row < src_capacity)
            offset = row * hidden
            if RANK_MODE == 1:
                offset += tl.load(src_offsets_ptr + j)
            if RANK_MODE == 2:
                rank = tl.load(rank_ptr + rows * WIDTH + j, mask=valid, other=0)
                offset += tl.load(src_offsets_ptr + rank, mask=valid, other=0)
            offset = tl.multiple_of(offset, ALIGN)
            term = tl.load(src_ptr + offset[:, None] + cols[None, :], mask=valid[:, None] & cols_ok)
            if SAVE_GATHERED:
                gathered_rows = (rows.to(tl.int64) * WIDTH + j)[:, None] * gathered[1]
                gathered_at = gathered[0] + gathered_rows
                if GATHER_MX:
                    kept = tl.where(valid[:, None] & cols_ok, term.to(tl.float32), 0.0)
                    codes, scales = mx_quantize_tile(kept, BLOCK_ROWS, BLOCK_H, RCEIL)
                    tl.store(gathered_at + cols[None, :], codes.to(tl.uint8), mask=here)
                    s = start // 32 + tl.arange(0, BLOCK_H // 32)
                    s_here = live[:, None] & (s < hidden // 32)[None, :]
                    tl.store(gathered_at + hidden + s[None, :], scales.to(tl.uint8), mask=s_here)
                else:
                    kept = tl.where(valid[:, None], term, 0.0)
                    tl.store(gathered_at + cols[None, :], kept, mask=here)
            term = term.to(tl.float32)
            if HAS_WEIGHT:
                weight = tl.load(weight_ptr + rows * WIDTH + j, mask=valid, other=0.0)
                term = weight.to(tl.float32)[:, None] * term
            acc += tl.where(valid[:, None], term, 0.0)
        if tail_ptr is not None:
            acc += tl.load(tail_ptr + token_cols, mask=here, other=0.0).to(tl.float32)
        tl.store(out_rows + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=here)


@fast_launch
@triton.jit
def reduce_rows_kernel(
    out_ptr,
    count_ptr,  # None, or a device scalar bounding the rows
    max_rows,
    hidden,
    terms,  # `reduce_rows_tile`'s
    init_ptr,  # `reduce_rows_tile`'s
    tail_ptr,  # `reduce_rows_tile`'s
    gathered,  # `reduce_rows_tile`'s
    WIDTH: tl.constexpr,
    RANK_MODE: tl.constexpr,
    GATHER_MX: tl.constexpr,
    RCEIL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ALIGN: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Persistent reduce over min(count, max_rows) output rows (max_rows without count_ptr)."""
    count = max_rows
    if count_ptr is not None:
        count = tl.minimum(tl.load(count_ptr).to(tl.int64), max_rows)
    for tile in range(tl.program_id(0), tl.cdiv(count, BLOCK_ROWS), NUM_PROGRAMS):
        reduce_rows_tile(
            out_ptr, tile * BLOCK_ROWS, count, hidden, terms, init_ptr, tail_ptr, gathered, WIDTH,
            RANK_MODE, GATHER_MX, RCEIL, BLOCK_ROWS, BLOCK_H, ALIGN,
        )  # fmt: skip


def _alignment(hidden: int) -> int:
    """Largest of 8, 4, 2, 1 elements that divides every row start (for vector accesses)."""
    for align in (8, 4, 2):
        if hidden % align == 0:
            return align
    return 1


def _row_options(hidden: int, block_rows: int, block_h: int, programs: int, num_warps: int) -> dict:
    """Tile meta-parameters and launch options shared by the row kernels' launchers."""
    return {
        "BLOCK_ROWS": block_rows,
        "BLOCK_H": min(block_h, triton.next_power_of_2(hidden)),
        "ALIGN": _alignment(hidden),
        "NUM_PROGRAMS": programs,
        "num_warps": num_warps,
    }


@functools.cache
def placeholder(device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A one-element tensor for pointer arguments a kernel variant never touches (made once:
    a fresh one per launch cost a fill kernel each)."""
    return torch.zeros(1, dtype=dtype, device=device)


def push_rows(
    src: torch.Tensor,
    slot: torch.Tensor,
    dst: torch.Tensor,
    dst_offsets: torch.Tensor,
    programs: int,
    block_rows: int,
    flags: torch.Tensor | None = None,
    flag_offsets: torch.Tensor | None = None,
    flag_base: int = 0,
    epoch: torch.Tensor | None = None,
    num_warps: int = 4,
    block_h: int = BLOCK_H,
) -> None:
    """Push src [T, H] row t to row slot[t, d] of rank d's dst [C, H] for every d with
    0 <= slot[t, d] < C (slot [T, ep] int64). With flags (int32, this rank's flag buffer) and
    flag_offsets (its peer table): after each block b of block_rows rows, flags[flag_base + b] on
    every rank is set to epoch[0] (int32, device)."""
    tokens, hidden = src.shape
    ep = slot.shape[1]
    signal = flags is not None
    device = src.device
    if tokens == 0:
        return
    programs = max(1, min(programs, triton.cdiv(tokens, block_rows)))
    push_rows_kernel[(programs,)](
        src,
        src.stride(0),
        tokens,
        slot,
        dst,
        dst_offsets,
        dst.shape[0],
        flags if signal else placeholder(device, torch.int32),
        flag_offsets if signal else placeholder(device),
        flag_base,
        epoch if signal else placeholder(device, torch.int32),
        hidden,
        EP=ep,
        SIGNAL=signal,
        **_row_options(hidden, block_rows, block_h, programs, num_warps),
    )


def copy_rows(
    dst: torch.Tensor,
    src: torch.Tensor,
    src_row: torch.Tensor,
    count: torch.Tensor,
    programs: int,
    block_rows: int,
    src_offsets: torch.Tensor | None = None,
    src_rank: torch.Tensor | None = None,
    dst_row: torch.Tensor | None = None,
    dst_offsets: torch.Tensor | None = None,
    dst_rank: torch.Tensor | None = None,
    flags: torch.Tensor | None = None,
    wait: torch.Tensor | None = None,
    epoch: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    timeout_s: float = 0.0,
    wait_id: int = 0,
    landed: torch.Tensor | None = None,
    num_warps: int = 4,
    block_h: int = BLOCK_H,
) -> None:
    """Row r (r < count, a device scalar, and r < len(src_row)) of src_{src_rank[r]} at row
    src_row[r] (zeros if outside src) goes to dst row r, or with dst_row to row dst_row[r] of
    dst_{dst_rank[r]} (skipped if outside dst). Without offsets/rank tables a buffer is this
    rank's own. With flags/wait/epoch/status: row r is read only once flags[wait[r]] equals
    epoch[0], waiting timeout_s at most (a failure is recorded in status, [4] int64, with
    wait_id; see mok.kernels.sync). With landed ([>= cdiv(len(src_row), block_rows)] int32, this
    rank's; needs epoch and no dst_row): once rows [b * block_rows, (b + 1) * block_rows) of dst
    are written, landed[b] is set to epoch[0] by a release (what a product running beside the
    copy waits on, `host.RowsReady`); tiles past count are never flagged."""
    rows = src_row.shape[0]
    dst_capacity, hidden = dst.shape
    src_peers, dst_peers = src_offsets is not None, dst_offsets is not None
    waits = flags is not None
    if waits and (wait is None or epoch is None or status is None):
        raise ValueError("waiting on flags needs wait, epoch and status")
    signal = landed is not None
    if signal and (epoch is None or dst_row is not None or dst_offsets is not None):
        raise ValueError("flagging landed tiles needs epoch, and dst rows in order (no dst_row)")
    if signal and (landed.dtype != torch.int32 or landed.numel() < triton.cdiv(rows, block_rows)):
        raise ValueError(
            f"landed: expected >= {triton.cdiv(rows, block_rows)} int32 flags, got "
            f"{landed.numel()} {landed.dtype}"
        )
    if rows == 0:
        return
    programs = max(1, min(programs, triton.cdiv(rows, block_rows)))
    copy_rows_kernel[(programs,)](
        (dst, dst_capacity, dst_row, (dst_offsets, dst_rank) if dst_peers else None),
        (src, src.shape[0], src_row, (src_offsets, src_rank) if src_peers else None),
        count,
        rows,
        hidden,
        (flags, wait, status, timeout_ns(timeout_s), wait_id) if waits else None,
        epoch if waits or signal else None,
        landed,
        **_row_options(hidden, block_rows, block_h, programs, num_warps),
    )


def reduce_rows(
    out: torch.Tensor,
    src: torch.Tensor,
    row: torch.Tensor,
    programs: int,
    block_rows: int,
    src_offsets: torch.Tensor | None = None,
    rank: torch.Tensor | None = None,
    rank_is_column: bool = False,
    weight: torch.Tensor | None = None,
    init: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    gathered: torch.Tensor | MXRows | None = None,
    gathered_rounding: ScaleRounding = ScaleRounding.RCEIL,
    num_warps: int = 4,
    block_h: int = BLOCK_H,
) -> None:
    """out [N, H] = round(init + sum_j weight[:, j] * src_{rank}[row[:, j]] + tail) in fp32 with
    j ascending (row [N, W] int64; terms with row < 0 or >= src's rows skipped). The source of
    term (t, j): this rank's src (no src_offsets), rank j (rank_is_column) or rank[t, j]. count: a
    device scalar bounding the rows computed (the rest of out is left as it is). gathered [N, W, H]:
    also store every term's row; or, `MXRows` [N * W, H], its MXFP8 cast along H rounded by
    `gathered_rounding` (H a multiple of 32)."""
    rows, hidden = out.shape
    width = row.shape[1]
    gather_mx = isinstance(gathered, MXRows)
    if gather_mx and (gathered.shape != (rows * width, hidden) or gathered.packed.stride(0) % 16):
        raise ValueError(f"reduce_rows: MX gathered rows must be [{rows * width}, {hidden}]")
    tensors = {"out": out, "src": src, "row": row, "weight": weight, "init": init, "tail": tail}
    if not gather_mx:
        tensors["gathered"] = gathered
    for name, tensor in tensors.items():
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(f"reduce_rows: {name} must be contiguous (rows are addressed densely)")
    if rows == 0:
        return
    if src_offsets is None:
        rank_mode = 0
    elif rank_is_column:
        rank_mode = 1
    else:
        rank_mode = 2
    programs = max(1, min(programs, triton.cdiv(rows, block_rows)))
    if gather_mx:
        gathered = (gathered.packed, gathered.packed.stride(0))
    elif gathered is not None:
        gathered = (gathered, hidden)
    reduce_rows_kernel[(programs,)](
        out,
        count,
        rows,
        hidden,
        (src, src.shape[0], src_offsets, rank if rank_mode == 2 else None, row, weight),
        init,
        tail,
        gathered,
        WIDTH=width,
        RANK_MODE=rank_mode,
        GATHER_MX=gather_mx,
        RCEIL=ScaleRounding(gathered_rounding) is ScaleRounding.RCEIL,
        **_row_options(hidden, block_rows, block_h, programs, num_warps),
        enable_fp_fusion=False,
    )


@fast_launch
@triton.jit
def pair_gradients_kernel(
    grad_y_ptr,
    weight_ptr,
    pair_out_ptr,
    grad_pairs_ptr,
    grad_weight_ptr,
    dst_row_ptr,
    dst_capacity,
    num_tokens,
    hidden,
    out_stride,
    TOP_K: tl.constexpr,
    K_SLOTS: tl.constexpr,
    SCATTER: tl.constexpr,
    OUT_AT_DST: tl.constexpr,
    MX_OUT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """For every pair (t, j): grad_pairs[t * TOP_K + j] (SCATTER: grad_pairs[dst_row[t, j]],
    skipped outside [0, dst_capacity)) = round(w[t, j] * grad_y[t]) and grad_weight[t, j] =
    sum_h grad_y[t, h] * pair_out[t, j, h] in fp32: column c of every chunk of BLOCK_H columns
    summed into slot c in column order, then the BLOCK_H slots summed (one reduction per tile).
    A tile is BLOCK_ROWS tokens x K_SLOTS (TOP_K rounded up to a power of two) pairs, all moved
    at once (one pass over pair_out; grad_y's row is read per pair, from cache after the first).
    pair_out's rows are out_stride elements apart, or MX_OUT: packed MX rows, `MXRows`,
    dequantized exactly. OUT_AT_DST (with SCATTER): pair (t, j)'s output is pair_out's row
    dst_row[t, j], as its gradient goes (zero outside [0, dst_capacity))."""
    BLOCK_PAIRS: tl.constexpr = BLOCK_ROWS * K_SLOTS
    lanes = tl.arange(0, BLOCK_PAIRS)
    slot = lanes % K_SLOTS
    for tile in range(tl.program_id(0), tl.cdiv(num_tokens, BLOCK_ROWS), NUM_PROGRAMS):
        token = tile * BLOCK_ROWS + lanes // K_SLOTS
        live = (token < num_tokens) & (slot < TOP_K)
        pair = token.to(tl.int64) * TOP_K + slot
        grad_rows = token.to(tl.int64)[:, None] * hidden
        out_rows = pair[:, None] * out_stride
        weight = tl.load(weight_ptr + pair, mask=live, other=0.0).to(tl.float32)
        keep = live
        dst_rows = pair[:, None] * hidden
        if SCATTER:
            dst = tl.load(dst_row_ptr + pair, mask=live, other=-1)
            keep = live & (dst >= 0) & (dst < dst_capacity)
            dst_rows = dst.to(tl.int64)[:, None] * hidden
            if OUT_AT_DST:
                out_rows = dst.to(tl.int64)[:, None] * out_stride
        read = keep if OUT_AT_DST else live
        products = tl.zeros((BLOCK_PAIRS, BLOCK_H), dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            cols_ok = (cols < hidden)[None, :]
            here = live[:, None] & cols_ok
            grad = tl.load(grad_y_ptr + grad_rows + cols[None, :], mask=here, other=0.0)
            grad = grad.to(tl.float32)
            if MX_OUT:
                codes = tl.load(pair_out_ptr + out_rows + cols[None, :], mask=here, other=0)
                s = start // 32 + tl.arange(0, BLOCK_H // 32)
                s_here = live[:, None] & (s < hidden // 32)[None, :]
                at = pair_out_ptr + out_rows + hidden + s[None, :]
                scales = tl.load(at, mask=s_here, other=127).to(tl.int32)
                out = mx_dequantize_tile(codes.to(tl.int32), scales, BLOCK_PAIRS, BLOCK_H)
            else:
                at = pair_out_ptr + out_rows + cols[None, :]
                out = tl.load(at, mask=read[:, None] & cols_ok, other=0.0)
            products += grad * out.to(tl.float32)
            scaled = (weight[:, None] * grad).to(grad_pairs_ptr.dtype.element_ty)
            target = grad_pairs_ptr + dst_rows + cols[None, :]
            tl.store(target, scaled, mask=keep[:, None] & cols_ok)
        dots = tl.sum(products, axis=1)
        tl.store(grad_weight_ptr + pair, dots.to(grad_weight_ptr.dtype.element_ty), mask=live)


PAIR_GRADIENT_BLOCK_H = 512
"""`pair_gradients`' column chunk: fixed by H alone, since the router weights' gradient sums in
slots of it (an order that does not follow the program count or the tokens a tile)."""
PAIR_GRADIENT_PROGRAMS_PER_SM = 4
"""`pair_gradients`' programs per SM of the pass (with 2 tokens a tile, 8 warps): many loads in
flight, so that HBM sets the pace (measured:
benchmarks/results/2026-12-03-pair-gradients-one-reduction-h200.md,
2026-12-03-pair-gradients-launch-h200.md)."""


def pair_gradients(
    grad_y: torch.Tensor,
    weights: torch.Tensor,
    pair_out: torch.Tensor | MXRows,
    grad_pairs: torch.Tensor,
    programs: int,
    dst_row: torch.Tensor | None = None,
    block_rows: int = 2,
    num_warps: int = 8,
    out_at_dst: bool = False,
) -> torch.Tensor:
    """The token side of combine's backward, in one pass: grad_pairs [T * k, H] (written, e.g. into
    a communication buffer) = w[t, j] * grad_y[t] rounded to grad_pairs' dtype, and the returned
    grad of the router weights [T, k] (weights' dtype) = <grad_y[t], pair_out[t, j]> in fp32.
    grad_y [T, H], weights [T, k], pair_out [T, k, H] (or `MXRows` [T * k, H], read as the values
    it holds); all contiguous. With dst_row [T, k] int64, pair (t, j) goes to row dst_row[t, j]
    of grad_pairs [R, H] instead (skipped outside [0, R)); with `out_at_dst` too, pair_out [R, H]
    holds pair (t, j)'s output at that row (the grouped rows the expert product wrote, read in
    place: no copy in token order). `programs` persistent programs of
    `num_warps` warps take `block_rows` tokens at a time. The results do not depend on
    `programs` (the SM count); the router weights' gradient may change in its last bits with
    `block_rows` or `num_warps` (a tile's final sum follows its layout), fixed per call site."""
    tokens, top_k = weights.shape
    hidden = grad_y.shape[1]
    mx_out = isinstance(pair_out, MXRows)
    if out_at_dst and (dst_row is None or mx_out):
        raise ValueError("pair_gradients: out_at_dst reads bf16 or fp32 rows through dst_row")
    if out_at_dst:
        expected = (grad_pairs.shape[0], hidden)
    else:
        expected = (tokens * top_k, hidden) if mx_out else (tokens, top_k, hidden)
    if tuple(pair_out.shape) != expected:
        raise ValueError(
            f"pair_gradients: pair_out of shape {tuple(pair_out.shape)}, expected {expected}"
        )
    grad_weights = torch.empty(tokens, top_k, dtype=weights.dtype, device=weights.device)
    if tokens == 0:
        return grad_weights
    programs = max(1, min(programs, triton.cdiv(tokens, block_rows)))
    scatter = dst_row is not None
    pair_gradients_kernel[(programs,)](
        grad_y,
        weights,
        pair_out.packed if mx_out else pair_out,
        grad_pairs,
        grad_weights,
        dst_row if scatter else placeholder(grad_y.device),
        grad_pairs.shape[0],
        tokens,
        hidden,
        pair_out.packed.stride(0) if mx_out else hidden,
        TOP_K=top_k,
        K_SLOTS=triton.next_power_of_2(top_k),
        SCATTER=scatter,
        OUT_AT_DST=out_at_dst,
        MX_OUT=mx_out,
        BLOCK_ROWS=block_rows,
        BLOCK_H=min(PAIR_GRADIENT_BLOCK_H, triton.next_power_of_2(hidden)),
        NUM_PROGRAMS=programs,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
    return grad_weights
