"""The row placement of the token exchange (where every token and pair lands) in four Triton
kernels: what `mok.comm.placement` computes with a hundred small PyTorch operations (whose
launches, not their work, cost milliseconds of host time per layer), computed in a few launches
with the same results.

    count_blocks    per block of BLOCK_T tokens: pairs per global expert, tokens per rank; the
                    last block stores this rank's totals into row `rank` of every peer's counts
                    table (symmetric memory; a table of zero offsets for one process)
    -- the caller's barrier: every rank now holds the counts of all ranks --
    placement_bases      one program: where each block's rows start on every owner (a scan over
                    blocks on top of the ranks and experts before it), this rank's group offsets,
                    row totals, the overflow flag
    place_pairs     per block: each token's staging slot on each owner, each pair's grouped row
                    and each pair's metadata written to its owner

Layouts and orders are those of `mok.comm.placement` (the reference the tests compare against):
staging by (source rank, token), grouped rows by (local expert, source rank, token, slot j).
Pairs with an expert id outside [0, E) are dropped (row -1), never counted.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from mok.kernels._triton_compat import interpreting, patch_interpreter
from mok.kernels.launch import fast_launch

if interpreting():
    patch_interpreter()

TILE_ELEMENTS = 8192
"""Bound on the tiles of the kernels: [tokens, experts] and [tokens, k, ranks] of the per-block
kernels, [blocks, experts] of the scan."""


@triton.jit
def _owner_mask(experts, valid, local_experts, EP_PAD: tl.constexpr):
    """[BLOCK_T, EP_PAD] int32: 1 where a token has at least one valid pair owned by rank d."""
    owner = tl.where(valid, experts // local_experts, -1)
    ranks = tl.arange(0, EP_PAD)
    hits = (owner[:, :, None] == ranks[None, None, :]).to(tl.int32)
    return tl.max(hits, axis=1)


@triton.jit
def _load_block(idx_ptr, block, tokens, num_experts, TOP_K, BLOCK_T, K_PAD):
    """(token ids [BLOCK_T], slots [K_PAD], expert ids [BLOCK_T, K_PAD], valid pairs)."""
    token = block * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.arange(0, K_PAD)
    live = (token < tokens)[:, None] & (slot < TOP_K)[None, :]
    experts = tl.load(idx_ptr + token[:, None] * TOP_K + slot[None, :], mask=live, other=-1)
    experts = experts.to(tl.int32)
    valid = live & (experts >= 0) & (experts < num_experts)
    return token, slot, experts, valid


@fast_launch
@triton.jit
def count_blocks_kernel(
    idx_ptr,
    tokens,
    num_experts,
    local_experts,
    counts_ptr,
    columns,
    totals_ptr,
    done_ptr,
    table_ptr,
    table_offsets_ptr,
    rank,
    TOP_K: tl.constexpr,
    EP: tl.constexpr,
    EP_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    E_BINS: tl.constexpr,
    C_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """counts[b] = (pairs per global expert [E], tokens per owner rank [EP]) of token block b;
    the last program to finish stores the sums over blocks into row `rank` of every rank's
    counts table (int64). totals [columns] int64 and done [1] int32 are zero on entry and are
    left zero."""
    block = tl.program_id(0)
    _, _, experts, valid = _load_block(idx_ptr, block, tokens, num_experts, TOP_K, BLOCK_T, K_PAD)
    flat_experts = tl.reshape(tl.where(valid, experts, 0), [BLOCK_T * K_PAD])
    histogram = tl.histogram(flat_experts, E_BINS, mask=tl.reshape(valid, [BLOCK_T * K_PAD]))
    bins = tl.arange(0, E_BINS)
    row = counts_ptr + block * columns
    tl.store(row + bins, histogram, mask=bins < num_experts)
    ranks = tl.arange(0, EP_PAD)
    sent = tl.sum(_owner_mask(experts, valid, local_experts, EP_PAD), axis=0)
    tl.store(row + num_experts + ranks, sent, mask=ranks < EP)
    # Integer sums: the same totals whatever order the programs add in.
    tl.atomic_add(totals_ptr + bins, histogram.to(tl.int64), mask=bins < num_experts, sem="relaxed")
    tl.atomic_add(
        totals_ptr + num_experts + ranks, sent.to(tl.int64), mask=ranks < EP, sem="relaxed"
    )
    # Every thread's additions precede the one release below; the last program acquires them.
    tl.debug_barrier()
    finished = tl.atomic_add(done_ptr, 1, sem="acq_rel")
    if finished == tl.num_programs(0) - 1:
        cols = tl.arange(0, C_PAD)
        zeros = tl.zeros((C_PAD,), dtype=tl.int64)
        total = tl.atomic_xchg(totals_ptr + cols, zeros, mask=cols < columns)
        for peer in tl.static_range(EP):
            offset = tl.load(table_offsets_ptr + peer)
            tl.store(table_ptr + offset + rank * columns + cols, total, mask=cols < columns)
        tl.atomic_xchg(done_ptr, 0)


@fast_launch
@triton.jit
def placement_bases_kernel(
    table_ptr,
    block_counts_ptr,
    blocks,
    rank,
    local_experts,
    num_experts,
    columns,
    block_base_ptr,
    group_offsets_ptr,
    received_ptr,
    token_capacity,
    pair_capacity,
    overflowed_ptr,
    most_needed_ptr,
    EP: tl.constexpr,
    EP_PAD: tl.constexpr,
    L_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """One program. From the counts table [EP, E + EP] of all ranks and this rank's block counts:
    block_base[b, e] = grouped row on e's owner of block b's first pair of expert e, and
    block_base[b, E + d] = staging row on rank d of block b's first token sent there;
    group_offsets [L + 1] and received = (staging rows, grouped rows) of this rank as owner,
    clipped to the capacities; overflowed |= any rank needs more; most_needed = running max."""
    src = tl.arange(0, EP_PAD)
    owner = tl.arange(0, EP_PAD)
    local = tl.arange(0, L_PAD)
    expert = owner[:, None] * local_experts + local[None, :]  # [owner, local]
    expert_ok = (owner < EP)[:, None] & (local < local_experts)[None, :]
    src_ok = src < EP
    pairs = tl.load(
        table_ptr + src[:, None, None] * columns + expert[None, :, :],
        mask=src_ok[:, None, None] & expert_ok[None, :, :],
        other=0,
    )  # [src, owner, local]
    expert_totals = tl.sum(pairs, axis=0)
    before_me = (src < rank)[:, None, None]
    pair_base = (
        tl.cumsum(expert_totals, axis=1)
        - expert_totals
        + tl.sum(tl.where(before_me, pairs, 0), axis=0)
    )
    sent = tl.load(
        table_ptr + src[:, None] * columns + num_experts + owner[None, :],
        mask=src_ok[:, None] & (owner < EP)[None, :],
        other=0,
    )  # [src, owner]
    token_totals = tl.sum(sent, axis=0)
    token_base = tl.sum(tl.where((src < rank)[:, None], sent, 0), axis=0)

    mine = tl.sum(tl.where((owner == rank)[:, None], expert_totals, 0), axis=0)  # [local]
    tl.store(group_offsets_ptr, 0)
    tl.store(
        group_offsets_ptr + 1 + local,
        tl.minimum(tl.cumsum(mine, axis=0), pair_capacity).to(tl.int32),
        mask=local < local_experts,
    )
    received_tokens = tl.sum(tl.where(owner == rank, token_totals, 0))
    tl.store(received_ptr, tl.minimum(received_tokens, token_capacity))
    tl.store(received_ptr + 1, tl.minimum(tl.sum(mine), pair_capacity))
    needed_tokens = tl.max(token_totals)
    needed_pairs = tl.max(tl.sum(expert_totals, axis=1))
    over = (needed_tokens > token_capacity) | (needed_pairs > pair_capacity)
    tl.store(overflowed_ptr, (tl.load(overflowed_ptr) != 0) | over)
    tl.store(most_needed_ptr, tl.maximum(tl.load(most_needed_ptr), needed_tokens))
    tl.store(most_needed_ptr + 1, tl.maximum(tl.load(most_needed_ptr + 1), needed_pairs))

    pair_carry = tl.zeros((EP_PAD, L_PAD), dtype=tl.int64)
    token_carry = tl.zeros((EP_PAD,), dtype=tl.int64)
    for start in range(0, blocks, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B)
        row_ok = rows < blocks
        mask = row_ok[:, None, None] & expert_ok[None, :, :]
        cells = rows[:, None, None] * columns + expert[None, :, :]
        counts = tl.load(block_counts_ptr + cells, mask=mask, other=0).to(tl.int64)
        before = tl.cumsum(counts, axis=0) - counts + pair_carry[None, :, :]
        tl.store(block_base_ptr + cells, (pair_base[None, :, :] + before).to(tl.int32), mask=mask)
        pair_carry += tl.sum(counts, axis=0)
        mask = row_ok[:, None] & (owner < EP)[None, :]
        cells = rows[:, None] * columns + num_experts + owner[None, :]
        counts = tl.load(block_counts_ptr + cells, mask=mask, other=0).to(tl.int64)
        before = tl.cumsum(counts, axis=0) - counts + token_carry[None, :]
        tl.store(block_base_ptr + cells, (token_base[None, :] + before).to(tl.int32), mask=mask)
        token_carry += tl.sum(counts, axis=0)


@triton.jit
def _slot_experts(idx_ptr, token, tokens, num_experts, j, TOP_K):
    """(expert ids [BLOCK_T] of slot j, valid) of the block's tokens."""
    experts = tl.load(idx_ptr + token * TOP_K + j, mask=token < tokens, other=-1).to(tl.int32)
    return experts, (token < tokens) & (experts >= 0) & (experts < num_experts)


@fast_launch
@triton.jit
def place_pairs_kernel(
    idx_ptr,
    tokens,
    num_experts,
    local_experts,
    columns,
    block_base_ptr,
    rank,
    token_capacity,
    pair_capacity,
    return_base,
    token_slot_ptr,
    pair_row_ptr,
    owner_ptr,
    meta,  # None, or (meta_ptr, meta_offsets_ptr)
    source,  # None, or (source_ptr, source_offsets_ptr)
    grouped,  # None, or (grouped_pair_ptr, grouped_token_ptr)
    TOP_K: tl.constexpr,
    EP: tl.constexpr,
    EP_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    E_BINS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """For token block b: token_slot[t, d] (staging row on rank d, -1 if none or past the
    capacity), pair_row[t, j] (grouped row on the owner, -1 if dropped) and owner[t, j].
    With meta: the owner's meta[pair_row] = (staging row, return address return_base +
    t * TOP_K + j, -1 if dropped) for pairs within its capacity. With source: rank d's
    source[token_slot[t, d]] = (rank, t) (pull dispatch). With grouped (EP 1, where the owner's
    rows are this rank's): grouped_pair[pair_row] = t * TOP_K + j and grouped_token[pair_row] =
    t (int32) for the pairs delivered. Each absent part (None) is compiled out."""
    block = tl.program_id(0)
    token, _, experts, valid = _load_block(
        idx_ptr, block, tokens, num_experts, TOP_K, BLOCK_T, K_PAD
    )
    ranks = tl.arange(0, EP_PAD)
    sends = _owner_mask(experts, valid, local_experts, EP_PAD)
    first = tl.load(block_base_ptr + block * columns + num_experts + ranks, mask=ranks < EP)
    staging = first[None, :] + tl.cumsum(sends, axis=0) - sends
    staging = tl.where((sends > 0) & (staging < token_capacity), staging, -1).to(tl.int64)
    token_rank_ok = (token < tokens)[:, None] & (ranks < EP)[None, :]
    tl.store(token_slot_ptr + token[:, None] * EP + ranks[None, :], staging, mask=token_rank_ok)
    if source is not None:
        source_ptr, source_offsets_ptr = source
        landed = token_rank_ok & (staging >= 0)
        target = source_ptr + tl.load(source_offsets_ptr + ranks, mask=ranks < EP, other=0)
        target = target[None, :] + staging * 2
        tl.store(target, tl.zeros_like(staging) + rank, mask=landed)
        tl.store(target + 1, (tl.zeros_like(staging) + token[:, None]).to(tl.int64), mask=landed)
    # The pairs below read token_slot entries this program stored (from other threads).
    tl.debug_barrier()

    # A pair's place inside its expert counts the block's pairs of that expert before it in
    # (t, j) order: those of earlier tokens (a scan over per-token expert counts) and those of
    # earlier slots of the same token.
    bins = tl.arange(0, E_BINS)
    per_token = tl.zeros((BLOCK_T, E_BINS), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        expert, ok = _slot_experts(idx_ptr, token, tokens, num_experts, j, TOP_K)
        per_token += ((expert[:, None] == bins[None, :]) & ok[:, None]).to(tl.int32)
    earlier_tokens = tl.cumsum(per_token, axis=0) - per_token
    for j in tl.static_range(TOP_K):
        expert, ok = _slot_experts(idx_ptr, token, tokens, num_experts, j, TOP_K)
        hit = expert[:, None] == bins[None, :]
        place = tl.sum(tl.where(hit, earlier_tokens, 0), axis=1)
        for i in tl.static_range(j):
            other, other_ok = _slot_experts(idx_ptr, token, tokens, num_experts, i, TOP_K)
            place += (other_ok & (other == expert)).to(tl.int32)
        row = tl.load(block_base_ptr + block * columns + expert, mask=ok, other=0).to(tl.int64)
        row += place
        owner = tl.where(ok, expert // local_experts, 0)
        pair_slot = tl.load(token_slot_ptr + token * EP + owner, mask=ok, other=-1)
        in_capacity = ok & (row < pair_capacity)
        delivered = in_capacity & (pair_slot >= 0)
        live = token < tokens
        tl.store(pair_row_ptr + token * TOP_K + j, tl.where(delivered, row, -1), mask=live)
        tl.store(owner_ptr + token * TOP_K + j, owner.to(tl.int64), mask=live)
        if grouped is not None:
            tl.store(grouped[0] + row, token * TOP_K + j, mask=delivered)
            tl.store(grouped[1] + row, token, mask=delivered)
        if meta is not None:
            back = tl.where(delivered, return_base + token.to(tl.int64) * TOP_K + j, -1)
            meta_offset = tl.load(meta[1] + owner, mask=in_capacity, other=0)
            target = meta[0] + meta_offset + row * 2
            tl.store(target, pair_slot, mask=in_capacity)
            tl.store(target + 1, back, mask=in_capacity)


@fast_launch
@triton.jit
def checked_ids_kernel(
    idx_ptr, safe_ptr, valid_ptr, bad_ptr, numel, num_experts, BLOCK: tl.constexpr
):
    """safe = the id where it is in [0, num_experts), else 0; valid says which; bad[0] set to
    True if any id is out of range (every program that finds one stores the same value)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offsets < numel
    experts = tl.load(idx_ptr + offsets, mask=live, other=0)
    valid = (experts >= 0) & (experts < num_experts)
    tl.store(safe_ptr + offsets, tl.where(valid, experts, 0).to(tl.int64), mask=live)
    tl.store(valid_ptr + offsets, valid, mask=live)
    if tl.max((live & ~valid).to(tl.int32), axis=0) > 0:
        tl.store(bad_ptr, True)


def checked_ids(
    topk_idx: torch.Tensor, num_experts: int, bad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(safe [T, k] int64: the ids with every one outside [0, num_experts) replaced by 0, valid
    [T, k] bool: the ids that were inside), with bad ([1] bool) set on the device if any was
    outside (never cleared here). One launch where PyTorch takes eight."""
    topk_idx = topk_idx.contiguous()
    safe = torch.empty(topk_idx.shape, dtype=torch.int64, device=topk_idx.device)
    valid = torch.empty(topk_idx.shape, dtype=torch.bool, device=topk_idx.device)
    numel = topk_idx.numel()
    if numel:
        block = 1024
        checked_ids_kernel[(triton.cdiv(numel, block),)](
            topk_idx, safe, valid, bad, numel, num_experts, BLOCK=block
        )
    return safe, valid


@fast_launch
@triton.jit
def owner_rows_kernel(
    meta_ptr,
    count_ptr,
    rows,
    per_rank,
    blocks_per_rank,
    grouped_to_staging_ptr,
    return_rank_ptr,
    return_row_ptr,
    flag_index_ptr,
    TOP_K: tl.constexpr,
    FLAG_TOKENS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The owner's view of its grouped rows r < count[0] from meta [rows, 2] = (staging row,
    return address): the staging row, the rank and row (address // per_rank, % per_rank) its
    output returns to, and the readiness flag of its token block on that rank. Rows past the
    count and dropped pairs get staging / return row -1, rank and flag 0."""
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = row < tl.minimum(tl.load(count_ptr), rows)
    staging = tl.load(meta_ptr + row * 2, mask=live, other=-1)
    address = tl.load(meta_ptr + row * 2 + 1, mask=live, other=-1)
    back = address >= 0
    rank = tl.where(back, address // per_rank, 0)
    pair = tl.where(back, address % per_rank, -1)
    block = tl.where(back, pair // TOP_K // FLAG_TOKENS, 0)
    keep = row < rows
    tl.store(grouped_to_staging_ptr + row, staging, mask=keep)
    tl.store(return_rank_ptr + row, rank, mask=keep)
    tl.store(return_row_ptr + row, pair, mask=keep)
    tl.store(flag_index_ptr + row, rank * blocks_per_rank + block, mask=keep)


@dataclasses.dataclass(frozen=True)
class OwnerRows:
    """Per grouped row of the owner ([rows] int64 each): see owner_rows_kernel."""

    grouped_to_staging: torch.Tensor
    return_rank: torch.Tensor
    return_row: torch.Tensor
    flag_index: torch.Tensor


def owner_rows(
    meta: torch.Tensor,
    recv_pairs: torch.Tensor,
    per_rank: int,
    top_k: int,
    flag_tokens: int,
    blocks_per_rank: int,
) -> OwnerRows:
    """OwnerRows of the grouped rows from the pair metadata meta [rows, 2] int64 that the senders
    wrote (the first recv_pairs rows are this call's; recv_pairs is [1] on the device). A return
    address is rank * per_rank + t * top_k + j; flags cover flag_tokens tokens each."""
    rows = meta.shape[0]
    out = torch.empty(4, rows, dtype=torch.int64, device=meta.device)
    block = 1024
    if rows:
        owner_rows_kernel[(triton.cdiv(rows, block),)](
            meta,
            recv_pairs,
            rows,
            per_rank,
            blocks_per_rank,
            out[0],
            out[1],
            out[2],
            out[3],
            TOP_K=top_k,
            FLAG_TOKENS=flag_tokens,
            BLOCK=block,
        )
    return OwnerRows(*out)


@dataclasses.dataclass(frozen=True)
class DevicePlacement:
    """The placement of one call (device tensors), as `mok.comm.placement.RowPlacement` plus the
    owner of each pair and the received row counts (recv_tokens / recv_pairs: [1] int64,
    clipped)."""

    token_slot: torch.Tensor  # [T, ep] int64
    pair_row: torch.Tensor  # [T, k] int64, -1 dropped
    owner: torch.Tensor  # [T, k] int64
    group_offsets: torch.Tensor  # [E_loc + 1] int32
    recv_tokens: torch.Tensor
    recv_pairs: torch.Tensor


class PlacementKernels:
    """The launches of one call's placement for a rank of an `ep`-rank group with `local_experts`
    experts each: `count` (before the counts barrier) and `place` (after it)."""

    def __init__(self, ep: int, local_experts: int, top_k: int, device: torch.device) -> None:
        self.ep, self.local_experts, self.top_k = ep, local_experts, top_k
        self.num_experts = ep * local_experts
        self.columns = self.num_experts + ep
        self.device = device
        self.ep_pad = triton.next_power_of_2(ep)
        self.k_pad = triton.next_power_of_2(top_k)
        self.e_bins = triton.next_power_of_2(self.num_experts)
        per_block = TILE_ELEMENTS // max(self.e_bins, self.k_pad * self.ep_pad)
        self.block_tokens = max(1, per_block)
        self.l_pad = triton.next_power_of_2(local_experts)
        self.scan_rows = max(1, TILE_ELEMENTS // (self.ep_pad * self.l_pad))
        # Scratch of count_blocks_kernel, which leaves it zeroed for the next call.
        self._totals = torch.zeros(self.columns, dtype=torch.int64, device=device)
        self._done = torch.zeros(1, dtype=torch.int32, device=device)

    def blocks(self, tokens: int) -> int:
        return triton.cdiv(tokens, self.block_tokens)

    def count(self, topk_idx: torch.Tensor, table: torch.Tensor, table_offsets, rank: int):
        """Count topk_idx [T, k] and store this rank's totals into row `rank` of every rank's
        counts table (int64 [ep, E + ep]; `table_offsets` its peer-offset table). Returns the
        block counts for `place`."""
        tokens = topk_idx.shape[0]
        blocks = max(self.blocks(tokens), 1)  # with T = 0, one program publishes zeros
        block_counts = torch.empty(blocks, self.columns, dtype=torch.int32, device=self.device)
        count_blocks_kernel[(blocks,)](
            topk_idx,
            tokens,
            self.num_experts,
            self.local_experts,
            block_counts,
            self.columns,
            self._totals,
            self._done,
            table,
            table_offsets,
            rank,
            TOP_K=self.top_k,
            EP=self.ep,
            EP_PAD=self.ep_pad,
            K_PAD=self.k_pad,
            E_BINS=self.e_bins,
            C_PAD=triton.next_power_of_2(self.columns),
            BLOCK_T=self.block_tokens,
        )
        return block_counts

    def place(
        self,
        topk_idx: torch.Tensor,
        block_counts: torch.Tensor,
        table: torch.Tensor,
        rank: int,
        token_capacity: int,
        pair_capacity: int,
        overflowed: torch.Tensor,
        most_needed: torch.Tensor,
        max_tokens: int = 0,
        meta: tuple[torch.Tensor, torch.Tensor] | None = None,
        source: tuple[torch.Tensor, torch.Tensor] | None = None,
        grouped: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> DevicePlacement:
        """The placement from the counts table of all ranks (local, after the barrier).
        meta / source: (this rank's buffer, its peer-offset table) of the owners' pair metadata
        [pair_capacity, 2] and pull sources [token_capacity, 2] (int64) to fill. grouped (EP 1
        only): (grouped_pair, grouped_token), [pair_capacity] int32 each, to fill with each
        grouped row's pair t * k + j and token t (the inverse of pair_row, made in the same
        pass). overflowed ([1] bool) and most_needed ([2] int64) are updated on the device."""
        if grouped is not None and self.ep != 1:
            raise ValueError("PlacementKernels.place: grouped rows are this rank's only at EP 1")
        tokens = topk_idx.shape[0]
        blocks = self.blocks(tokens)
        ints = torch.empty(
            tokens * (self.ep + 2 * self.top_k) + 2, dtype=torch.int64, device=self.device
        )
        token_slot = ints[: tokens * self.ep].view(tokens, self.ep)
        pairs = tokens * self.top_k
        pair_row = ints[tokens * self.ep :][:pairs].view(tokens, self.top_k)
        owner = ints[tokens * self.ep + pairs :][:pairs].view(tokens, self.top_k)
        received = ints[-2:]
        block_base = torch.empty_like(block_counts)
        group_offsets = torch.empty(self.local_experts + 1, dtype=torch.int32, device=self.device)
        placement_bases_kernel[(1,)](
            table,
            block_counts,
            blocks,
            rank,
            self.local_experts,
            self.num_experts,
            self.columns,
            block_base,
            group_offsets,
            received,
            token_capacity,
            pair_capacity,
            overflowed,
            most_needed,
            EP=self.ep,
            EP_PAD=self.ep_pad,
            L_PAD=self.l_pad,
            BLOCK_B=self.scan_rows,
        )
        if blocks:
            place_pairs_kernel[(blocks,)](
                topk_idx,
                tokens,
                self.num_experts,
                self.local_experts,
                self.columns,
                block_base,
                rank,
                token_capacity,
                pair_capacity,
                rank * max_tokens * self.top_k,
                token_slot,
                pair_row,
                owner,
                None if meta is None else tuple(meta),
                None if source is None else tuple(source),
                None if grouped is None else tuple(grouped),
                TOP_K=self.top_k,
                EP=self.ep,
                EP_PAD=self.ep_pad,
                K_PAD=self.k_pad,
                E_BINS=self.e_bins,
                BLOCK_T=self.block_tokens,
            )
        return DevicePlacement(
            token_slot=token_slot,
            pair_row=pair_row,
            owner=owner,
            group_offsets=group_offsets,
            recv_tokens=received[0:1],
            recv_pairs=received[1:2],
        )
