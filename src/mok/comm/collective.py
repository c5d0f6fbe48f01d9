"""The token exchange over `torch.distributed` collectives (NCCL or gloo): the fallback where NVLink
symmetric memory is not available (CPU, no peer access, several nodes).

Same layouts and order as the NVLink exchange (`mok.comm.placement`): each token crosses to each
owner once into the owner's staging rows, the owner expands them into one row per pair grouped by
local expert, and each pair's output returns to its own combine slot on the token's rank. Unlike the
NVLink path, `all_to_all_single` needs its split sizes on the host: `route` synchronizes once per
call.

Gradients follow the same paths backwards; every reduction has a fixed order (pairs of a token on
one owner by ascending grouped row, then owners by ascending rank), so results are deterministic.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from mok.comm.placement import RowPlacement, destination_mask, local_counts, placement_from_counts
from mok.distributed import all_gather_rows, all_to_all, group_rank_and_size
from mok.reference import combine, mx


@dataclasses.dataclass(frozen=True)
class Routing:
    """One call's routing on this rank: the row placement plus what the collectives need."""

    placement: RowPlacement
    top_k: int
    send_token_index: torch.Tensor
    """[sum send_tokens] int64: token sent in each row of the dispatch, by owner then token."""
    send_tokens: list[int]
    recv_tokens: list[int]
    pair_send_order: torch.Tensor
    """[T*k] int64: pairs (p = t*k + j) by owner, then by their grouped row there."""
    send_pairs: list[int]
    recv_pairs: list[int]
    grouped_to_staging: torch.Tensor
    """[R] int64: staging row holding the token of each grouped row on this rank."""
    return_order: torch.Tensor
    """[R] int64: grouped rows in the order they go back (by source, then grouped row)."""
    fan_in: torch.Tensor
    """[S, k] int64: grouped rows of each staging row, ascending, -1 padded."""

    @property
    def group_offsets(self) -> torch.Tensor:
        return self.placement.group_offsets


class CollectiveExchange:
    """Dispatch and combine of one expert-parallel group over `all_to_all_single`."""

    def __init__(self, group: dist.ProcessGroup | None, local_experts: int) -> None:
        self.group = group
        self.rank, self.ep_size = group_rank_and_size(group)
        self.local_experts = local_experts

    def route(self, topk_idx: torch.Tensor, exact_rows: bool = False) -> Routing:
        """Exchange the counts and pair addresses of topk_idx [T, k]. Collective; one host sync,
        which sizes every buffer exactly (exact_rows changes nothing)."""
        ep, local, rank = self.ep_size, self.local_experts, self.rank
        experts = ep * local
        tokens, top_k = topk_idx.shape
        counts = all_gather_rows(local_counts(topk_idx, ep, local), self.group)
        placement = placement_from_counts(topk_idx, counts, rank, local)
        pairs_per_owner = counts[:, :experts].view(ep, ep, local).sum(2)  # [src, owner]
        sizes = torch.stack([counts[:, experts:], pairs_per_owner]).cpu()  # the host sync
        send_tokens, recv_tokens = sizes[0][rank].tolist(), sizes[0][:, rank].tolist()
        send_pairs, recv_pairs = sizes[1][rank].tolist(), sizes[1][:, rank].tolist()

        mask = destination_mask(topk_idx, ep, local)
        send_token_index = mask.T.nonzero()[:, 1]
        owner = topk_idx.reshape(-1).to(torch.int64) // local
        pair_row = placement.pair_row.reshape(-1)
        rows_per_owner_bound = int(sizes[1].sum(0).max()) + 1
        pair_send_order = torch.sort(owner * rows_per_owner_bound + pair_row).indices
        token_of_pair = pair_send_order // top_k
        slot = placement.token_slot[token_of_pair, owner[pair_send_order]]
        meta = torch.stack([pair_row[pair_send_order], slot], dim=1)
        received = all_to_all(meta, recv_pairs, send_pairs, self.group)
        total = received.shape[0]
        grouped_to_staging = torch.empty(total, dtype=torch.int64, device=topk_idx.device)
        grouped_to_staging[received[:, 0]] = received[:, 1]
        return Routing(
            placement=placement,
            top_k=top_k,
            send_token_index=send_token_index,
            send_tokens=send_tokens,
            recv_tokens=recv_tokens,
            pair_send_order=pair_send_order,
            send_pairs=send_pairs,
            recv_pairs=recv_pairs,
            grouped_to_staging=grouped_to_staging,
            return_order=received[:, 0],
            fan_in=_fan_in(grouped_to_staging, sum(recv_tokens), top_k),
        )

    def dispatch(self, routing: Routing, x: torch.Tensor) -> torch.Tensor:
        """Rows x [T, W] -> this rank's grouped rows [R, W] (one per pair, by local expert)."""
        staging = all_to_all(
            x[routing.send_token_index], routing.recv_tokens, routing.send_tokens, self.group
        )
        return staging[routing.grouped_to_staging]

    def gather_outputs(self, routing: Routing, expert_out: torch.Tensor) -> torch.Tensor:
        """Grouped expert outputs [R, H] -> each of this rank's pairs' output, [T, k, H]."""
        back = all_to_all(
            expert_out[routing.return_order], routing.send_pairs, routing.recv_pairs, self.group
        )
        out = torch.empty_like(back)
        out[routing.pair_send_order] = back
        return out.view(-1, routing.top_k, expert_out.shape[1])

    def expert_output_buffer(self) -> None:
        """The expert outputs are sent back from wherever the kernels write them."""
        return None

    def tokens_of_grouped_rows(self, routing: Routing) -> None:
        """None: the grouped rows are the tokens other ranks sent."""
        return None

    def combine(
        self,
        routing: Routing,
        expert_out: torch.Tensor,
        topk_weights: torch.Tensor,
        shared_out: torch.Tensor | None = None,
        save_pair_out: bool = True,
        pair_out_mx: mx.ScaleRounding | None = None,
    ):
        """y [T, H] from the grouped expert outputs [R, H], in the reference's combine order.
        Also returns the gathered pair outputs [T, k, H], which combine_backward needs (None
        unless save_pair_out; with pair_out_mx, their MXFP8 cast along H, `MXRows` [T * k, H])."""
        pair_out = self.gather_outputs(routing, expert_out)
        y = combine(pair_out, topk_weights, shared_out)
        if not save_pair_out:
            return y, None
        if pair_out_mx is not None:
            # Triton is optional: imported where an MXFP8 layer (the triton backend's) runs.
            from mok.kernels.mx import mx_quantize_rows

            return y, mx_quantize_rows(pair_out.view(-1, pair_out.shape[2]), pair_out_mx)
        return y, pair_out

    def combine_backward(
        self,
        routing: Routing,
        grad_y: torch.Tensor,
        topk_weights: torch.Tensor,
        pair_out,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(grad of the grouped expert outputs [R, H] on this rank, grad of topk_weights [T, k]).

        grad of pair (t, j)'s output = w[t, j] * grad_y[t], rounded to grad_y's dtype;
        grad of w[t, j] = <grad_y[t], out[t, j]> in fp32 (out: pair_out as `combine` saved it, an
        `MXRows` read as the values it holds). The shared expert's output gradient is grad_y
        itself."""
        grad = grad_y.float()
        tokens, top_k = topk_weights.shape
        if isinstance(pair_out, torch.Tensor):
            out = pair_out.float()
        else:
            values = mx.dequantize(pair_out.codes.contiguous(), pair_out.scales.contiguous())
            out = values.view(tokens, top_k, -1)
        grad_w = torch.einsum("th,tkh->tk", grad, out).to(topk_weights.dtype)
        grad_pairs = (topk_weights.float().unsqueeze(-1) * grad.unsqueeze(1)).to(grad_y.dtype)
        return self._to_owners(routing, grad_pairs.reshape(-1, grad_pairs.shape[-1])), grad_w

    def _to_owners(self, routing: Routing, pairs: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's pairs, [T * k, W] in pair order, -> the grouped rows' [R, W] on
        their owners (the inverse of `gather_outputs`)."""
        received = all_to_all(
            pairs[routing.pair_send_order], routing.recv_pairs, routing.send_pairs, self.group
        )
        grouped = torch.empty_like(received)
        grouped[routing.return_order] = received
        return grouped

    def unweighted_combine_backward(
        self, routing: Routing, grad_y: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(grad_y's row of each grouped row's token [R, H], sent as `dispatch` sends x; each
        grouped row's pair's weight [R] fp32)."""
        weights = self._to_owners(routing, topk_weights.float().reshape(-1, 1))
        return self.dispatch(routing, grad_y), weights.view(-1)

    def pair_values(self, routing: Routing, row_values: torch.Tensor) -> torch.Tensor:
        """[T, k] fp32: each pair's value of row_values [R] fp32 (one per grouped row), sent back
        by `gather_outputs`."""
        return self.gather_outputs(routing, row_values.float().reshape(-1, 1)).view(
            -1, routing.top_k
        )

    def dispatch_backward(
        self, routing: Routing, grad_grouped: torch.Tensor, extra: torch.Tensor | None = None
    ) -> torch.Tensor:
        """grad of x [T, H] from the grads of the grouped rows [R, H]: summed in fp32 per staging
        row (ascending grouped row), sent back, summed per token over owners (ascending rank),
        plus `extra` (e.g. the shared expert's input gradient) last; rounded once."""
        hidden = grad_grouped.shape[1]
        fan_in = routing.fan_in
        grad_staging = torch.zeros(fan_in.shape[0], hidden, device=grad_grouped.device)
        for column in fan_in.T:
            present = column >= 0
            grad_staging[present] += grad_grouped[column[present]].float()
        back = all_to_all(grad_staging, routing.send_tokens, routing.recv_tokens, self.group)
        tokens = routing.placement.token_slot.shape[0]
        parts = torch.zeros(self.ep_size, tokens, hidden, device=grad_grouped.device)
        owners = torch.repeat_interleave(
            torch.arange(self.ep_size, device=back.device),
            torch.tensor(routing.send_tokens, device=back.device),
        )
        parts[owners, routing.send_token_index] = back
        acc = torch.zeros(tokens, hidden, device=grad_grouped.device)
        for owner in range(self.ep_size):
            acc += parts[owner]
        if extra is not None:
            acc += extra.float()
        return acc.to(grad_grouped.dtype)

    def check(self) -> None:
        """Nothing is found on the device: the collectives' split sizes are checked on the host."""

    def reset(self) -> None:
        """Nothing waits on the device (the collectives are bounded by the group's timeout)."""

    def release(self) -> None:
        """Nothing to free."""


def _fan_in(grouped_to_staging: torch.Tensor, staging_rows: int, width: int) -> torch.Tensor:
    """[staging_rows, width]: the grouped rows reading each staging row, ascending, -1 padded."""
    device = grouped_to_staging.device
    order = torch.sort(grouped_to_staging, stable=True).indices  # grouped rows by staging row
    rows = grouped_to_staging[order]
    counts = torch.zeros(staging_rows, dtype=torch.int64, device=device)
    counts.scatter_add_(0, rows, torch.ones_like(rows))
    start = torch.cumsum(counts, 0) - counts
    position = torch.arange(order.numel(), device=device) - start[rows]
    fan_in = torch.full((staging_rows, max(width, 1)), -1, dtype=torch.int64, device=device)
    fan_in[rows, position] = order
    return fan_in
