"""The reference routing: which (token, slot) pairs a rank sends where, and in what order the
owner sees them.

Pairs are numbered p = t * k + j. The reference exchange sends one row per pair (simple, not
bandwidth-optimal: a token routed to two experts of one rank crosses twice). On the owner, rows are
grouped by local expert, and inside an expert ordered by (source rank, t, j): the order the fused
backends also use, so their results can be compared row for row.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from mok.distributed import all_gather_int64, group_rank_and_size


def expert_counts(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs routed to each expert: [E] int64 on topk_idx's device."""
    return torch.bincount(topk_idx.reshape(-1).to(torch.int64), minlength=num_experts)


def exchange_expert_counts(
    topk_idx: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Collective: counts[s, e] = pairs rank s routes to expert e; [ep, E] int64 on the CPU."""
    return all_gather_int64(expert_counts(topk_idx, num_experts), group)


def _segment_gather_index(starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(starts[i], starts[i] + sizes[i]) over i."""
    total = int(sizes.sum())
    offsets = torch.cumsum(sizes, 0) - sizes
    within = torch.arange(total) - torch.repeat_interleave(offsets, sizes)
    return torch.repeat_interleave(starts, sizes) + within


@dataclasses.dataclass(frozen=True)
class ReferenceRouting:
    """How one rank's pairs travel through the reference exchange, and how the owner groups them.

    Index tensors live on the routing's device; split and group sizes are host lists (the reference
    synchronizes with the host; the fused backends do not).
    """

    rank: int
    ep_size: int
    local_experts: int
    pair_order: torch.Tensor
    """[T*k] int64: pair ids sorted by global expert id, stable (so by p inside an expert)."""
    pair_order_inverse: torch.Tensor
    """[T*k] int64: position of pair p in pair_order."""
    send_splits: list[int]
    """[ep]: rows this rank sends to each rank (its pairs, by owner)."""
    recv_splits: list[int]
    """[ep]: rows this rank receives from each rank."""
    recv_to_grouped: torch.Tensor
    """[R] int64: received-row index of each row of the grouped layout."""
    grouped_to_recv: torch.Tensor
    """[R] int64: inverse of recv_to_grouped."""
    group_sizes: list[int]
    """[E_loc]: rows each local expert receives, from all ranks together."""

    @classmethod
    def build(cls, topk_idx: torch.Tensor, counts: torch.Tensor, rank: int) -> ReferenceRouting:
        """The routing of `rank` from its topk_idx [T, k] and the counts [ep, E] of all ranks."""
        ep_size, num_experts = counts.shape
        local_experts = num_experts // ep_size
        device = topk_idx.device
        flat = topk_idx.reshape(-1).to(torch.int64)
        pair_order = torch.sort(flat, stable=True).indices
        pair_order_inverse = torch.empty_like(pair_order)
        pair_order_inverse[pair_order] = torch.arange(pair_order.numel(), device=device)

        per_owner = counts.view(ep_size, ep_size, local_experts)  # [src, owner, local expert]
        send_splits = per_owner[rank].sum(1).tolist()
        mine = per_owner[:, rank, :]  # [src, local expert]: rows arriving here
        recv_splits = mine.sum(1).tolist()
        # Received rows come as (src, local expert) segments; the grouped layout wants them as
        # (local expert, src) segments.
        segment_starts = (torch.cumsum(mine.reshape(-1), 0) - mine.reshape(-1)).view_as(mine)
        recv_to_grouped = _segment_gather_index(segment_starts.T.reshape(-1), mine.T.reshape(-1))
        grouped_to_recv = torch.empty_like(recv_to_grouped)
        grouped_to_recv[recv_to_grouped] = torch.arange(recv_to_grouped.numel())
        return cls(
            rank=rank,
            ep_size=ep_size,
            local_experts=local_experts,
            pair_order=pair_order,
            pair_order_inverse=pair_order_inverse,
            send_splits=send_splits,
            recv_splits=recv_splits,
            recv_to_grouped=recv_to_grouped.to(device),
            grouped_to_recv=grouped_to_recv.to(device),
            group_sizes=mine.sum(0).tolist(),
        )

    @classmethod
    def exchange(
        cls, topk_idx: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None
    ) -> ReferenceRouting:
        """Collective: exchange the expert counts and build this rank's routing."""
        rank, _ = group_rank_and_size(group)
        return cls.build(topk_idx, exchange_expert_counts(topk_idx, num_experts, group), rank)
