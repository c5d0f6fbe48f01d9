"""The token "exchange" of a single process (EP = 1): the API of the NVLink exchange with nothing
to send. Tokens are expanded into one row per pair grouped by expert, and the pairs' outputs are
summed back in the reference's order. No host synchronization; deterministic.
"""

from __future__ import annotations

import dataclasses

import torch

from mok.kernels.placement import PlacementKernels
from mok.kernels.rows import COPY_ROWS, COPY_TILE, LOCAL_SUM, copy_rows, pair_gradients, reduce_rows


@dataclasses.dataclass(frozen=True)
class LocalRouting:
    """One call's routing: pair (t, j) is grouped row pair_row[t, j]."""

    top_k: int
    group_offsets: torch.Tensor
    pair_row: torch.Tensor
    recv_pairs: torch.Tensor


class LocalExchange:
    """Dispatch and combine when one process holds every expert. On the CPU the kernels run under
    the Triton interpreter (tests only)."""

    def __init__(self, num_experts: int, device: torch.device) -> None:
        self.num_experts = num_experts
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if on_gpu else 4
        )
        self._placement_kernels: dict[int, PlacementKernels] = {}
        self._counts = torch.zeros(1, num_experts + 1, dtype=torch.int64, device=self.device)
        self._no_offsets = torch.zeros(1, dtype=torch.int64, device=self.device)
        # Nothing overflows in one process; the placement kernels still want somewhere to say so.
        self._overflowed = torch.zeros(1, dtype=torch.bool, device=self.device)
        self._most_needed = torch.zeros(2, dtype=torch.int64, device=self.device)

    def route(self, topk_idx: torch.Tensor) -> LocalRouting:
        tokens, top_k = topk_idx.shape
        if top_k not in self._placement_kernels:
            self._placement_kernels[top_k] = PlacementKernels(
                1, self.num_experts, top_k, self.device
            )
        kernels = self._placement_kernels[top_k]
        topk_idx = topk_idx.contiguous()
        block_counts = kernels.count(topk_idx, self._counts, self._no_offsets, 0)
        pairs = max(tokens * top_k, 1)
        placement = kernels.place(
            topk_idx,
            block_counts,
            self._counts,
            0,
            tokens,
            pairs,
            self._overflowed,
            self._most_needed,
        )
        return LocalRouting(
            top_k=top_k,
            group_offsets=placement.group_offsets,
            pair_row=placement.pair_row,
            recv_pairs=placement.recv_pairs,
        )

    def _pairs(self, routing: LocalRouting) -> torch.Tensor:
        """[T * k]: the token of each pair (t * k + j -> t)."""
        count = routing.pair_row.numel()
        return torch.arange(count, device=self.device) // routing.top_k

    def _count(self, rows: int) -> torch.Tensor:
        return torch.full((1,), rows, dtype=torch.int64, device=self.device)

    def dispatch(self, routing: LocalRouting, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> grouped rows [T * k, H] (row pair_row[t, j] holds x[t])."""
        pairs = routing.pair_row.numel()
        grouped = torch.empty(pairs, x.shape[1], dtype=x.dtype, device=x.device)
        copy_rows(
            grouped,
            x.contiguous(),
            self._pairs(routing),
            self._count(pairs),
            self.sms,
            COPY_ROWS,
            dst_row=routing.pair_row.view(-1),
            **COPY_TILE,
        )
        return grouped

    def expert_output_buffer(self) -> None:
        """The expert outputs stay where the kernels write them."""
        return None

    def combine(self, routing, expert_out, topk_weights, shared_out=None, save_pair_out=True):
        """(y [T, H], the pairs' outputs [T, k, H] or None), in the reference's combine order."""
        tokens, top_k = routing.pair_row.shape
        hidden = expert_out.shape[1]
        y = torch.empty(tokens, hidden, dtype=expert_out.dtype, device=self.device)
        pair_out = None
        if save_pair_out:
            pair_out = torch.empty(
                tokens, top_k, hidden, dtype=expert_out.dtype, device=self.device
            )
        reduce_rows(
            y,
            expert_out,
            routing.pair_row,
            self.sms,
            weight=topk_weights.contiguous(),
            init=None if shared_out is None else shared_out.contiguous(),
            gathered=pair_out,
            **LOCAL_SUM,
        )
        return y, pair_out

    def combine_backward(self, routing, grad_y, topk_weights, pair_out):
        """(grads of the grouped outputs [T * k, H], grad of topk_weights [T, k])."""
        grad_grouped = torch.empty(
            routing.pair_row.numel(), grad_y.shape[1], dtype=pair_out.dtype, device=self.device
        )
        grad_w = pair_gradients(
            grad_y.contiguous(),
            topk_weights.contiguous(),
            pair_out,
            grad_grouped,
            self.sms,
            dst_row=routing.pair_row,
        )
        return grad_grouped, grad_w

    def dispatch_backward(self, routing, grad_grouped, extra=None):
        """grad x [T, H]: per token, its pairs' row gradients in fp32, j ascending, then `extra`."""
        tokens = routing.pair_row.shape[0]
        grad_x = torch.empty(
            tokens, grad_grouped.shape[1], dtype=grad_grouped.dtype, device=self.device
        )
        reduce_rows(
            grad_x,
            grad_grouped,
            routing.pair_row,
            self.sms,
            tail=None if extra is None else extra.contiguous(),
            **LOCAL_SUM,
        )
        return grad_x

    def check(self) -> None:
        """Nothing can overflow in one process."""

    def reset(self) -> None:
        """Nothing waits on another rank in one process."""

    def release(self) -> None:
        """Nothing to free."""
