"""The token "exchange" of a single process (EP = 1): the API of the NVLink exchange with nothing
to send. Tokens are expanded into one row per pair grouped by expert, and the pairs' outputs are
summed back in the reference's order. No host synchronization; deterministic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mok.comm.exchange import GroupedPairOutputs
from mok.errors import MoKTimeoutError
from mok.kernels.constants import DeviceConstants
from mok.kernels.host import RowScatter, RowsReady
from mok.kernels.mx import MXRows
from mok.kernels.placement import PlacementKernels
from mok.kernels.rows import (
    COPY_ROWS,
    COPY_TILE,
    LOCAL_EXCHANGE_SUM,
    LOCAL_EXCHANGE_SUM_PROGRAMS_PER_SM,
    PAIR_GRADIENT_PROGRAMS_PER_SM,
    copy_rows,
    pair_gradients,
    reduce_rows,
)
from mok.kernels.sync import await_counts, new_status
from mok.reference.mx import ScaleRounding


@dataclasses.dataclass(frozen=True)
class LocalRouting:
    """One call's routing: pair (t, j) is grouped row pair_row[t, j]; grouped row r holds pair
    grouped_pair[r] = t * k + j of token grouped_token[r] = t (int32 [T * k] each, the inverse of
    pair_row, written by the placement kernel in the same pass)."""

    top_k: int
    group_offsets: torch.Tensor
    pair_row: torch.Tensor
    recv_pairs: torch.Tensor
    grouped_pair: torch.Tensor
    grouped_token: torch.Tensor


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
        self._constants = DeviceConstants()
        self._counts = torch.zeros(1, num_experts + 1, dtype=torch.int64, device=self.device)
        self._no_offsets = torch.zeros(1, dtype=torch.int64, device=self.device)
        # Nothing overflows in one process; the placement kernels still want somewhere to say so.
        self._overflowed = torch.zeros(1, dtype=torch.bool, device=self.device)
        self._most_needed = torch.zeros(2, dtype=torch.int64, device=self.device)
        # The overlapped path's readiness: flags stamped with a per-call epoch (never reset), the
        # combine's count, and the status its bounded waits record failures in.
        self.epoch = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.status = new_status(self.device)
        self._landed = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._combined = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._zero_offsets = torch.zeros(1, dtype=torch.int64, device=self.device)

    def route(self, topk_idx: torch.Tensor, exact_rows: bool = False) -> LocalRouting:
        """Where every pair of topk_idx [T, k] goes: T * k grouped rows, exact without reading
        anything on the host (exact_rows changes nothing)."""
        tokens, top_k = topk_idx.shape
        if top_k not in self._placement_kernels:
            self._placement_kernels[top_k] = PlacementKernels(
                1, self.num_experts, top_k, self.device
            )
        kernels = self._placement_kernels[top_k]
        topk_idx = topk_idx.contiguous()
        block_counts = kernels.count(topk_idx, self._counts, self._no_offsets, 0)
        pairs = max(tokens * top_k, 1)
        grouped = torch.empty(2, tokens * top_k, dtype=torch.int32, device=self.device)
        placement = kernels.place(
            topk_idx,
            block_counts,
            self._counts,
            0,
            tokens,
            pairs,
            self._overflowed,
            self._most_needed,
            grouped=(grouped[0], grouped[1]),
        )
        return LocalRouting(
            top_k=top_k,
            group_offsets=placement.group_offsets,
            pair_row=placement.pair_row,
            recv_pairs=placement.recv_pairs,
            grouped_pair=grouped[0],
            grouped_token=grouped[1],
        )

    def _pairs(self, routing: LocalRouting) -> torch.Tensor:
        """[T * k]: the token of each pair (t * k + j -> t)."""
        count, top_k = routing.pair_row.numel(), routing.top_k
        return self._constants.get(
            ("token of pair", count, top_k),
            lambda: torch.arange(count, device=self.device) // top_k,
        )

    def _count(self, rows: int) -> torch.Tensor:
        """A [1] int64 device tensor holding `rows`."""
        return self._constants.get(
            ("count", rows), lambda: torch.full((1,), rows, dtype=torch.int64, device=self.device)
        )

    def dispatch(self, routing: LocalRouting, x: torch.Tensor) -> torch.Tensor:
        """x [T, W] -> grouped rows [T * k, W] (row pair_row[t, j] holds x[t])."""
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

    def received_tokens(self, routing: LocalRouting, programs: int) -> None:
        """None: the grouped rows here are exactly the pairs (`OverlappedExchangeBase`)."""
        return None

    def dispatch_overlapped(
        self, routing: LocalRouting, x: torch.Tensor, programs: int, timeout_s: float
    ) -> tuple[torch.Tensor, Callable[[], None], RowsReady]:
        """`dispatch`'s grouped rows [T * k, H] and `pull`, which, run on the caller's
        communication stream, has `programs` programs copy them in grouped order, each block of
        COPY_ROWS rows flagged once written: the RowsReady that the gate/up product waits on
        beside the copy. x must stay unchanged until the copy is done."""
        pairs = routing.pair_row.numel()
        x = x.contiguous()
        self.epoch.add_(1)  # this call's flags: stamped with a value no earlier call used
        grouped = torch.empty(pairs, x.shape[1], dtype=x.dtype, device=x.device)
        blocks = -(-pairs // COPY_ROWS)
        if self._landed.numel() < blocks:
            self._landed = torch.zeros(blocks, dtype=torch.int32, device=self.device)
        count, landed = self._count(pairs), self._landed

        def pull() -> None:
            copy_rows(
                grouped,
                x,
                routing.grouped_token.long(),
                count,
                programs,
                COPY_ROWS,
                epoch=self.epoch,
                landed=landed,
                **COPY_TILE,
            )

        ready = RowsReady(landed, COPY_ROWS, self.epoch, self.status, timeout_s, 0)
        return grouped, pull, ready

    def combine_backward_overlapped(
        self,
        routing: LocalRouting,
        grad_y: torch.Tensor,
        topk_weights: torch.Tensor,
        pair_out: torch.Tensor,
        programs: int,
        timeout_s: float,
    ) -> tuple[torch.Tensor, Callable[[], None], None, torch.Tensor]:
        """`combine_backward` in the overlapped layer's form: one process writes the grouped
        rows' gradients in place (one kernel, nothing to copy), so `pull` does nothing and no
        product needs to wait (RowsReady None)."""
        grad_grouped, grad_w = self.combine_backward(routing, grad_y, topk_weights, pair_out)
        return grad_grouped, lambda: None, None, grad_w

    def unweighted_combine_backward_overlapped(
        self,
        routing: LocalRouting,
        grad_y: torch.Tensor,
        topk_weights: torch.Tensor,
        programs: int,
        timeout_s: float,
    ) -> tuple[torch.Tensor, Callable[[], None], None, torch.Tensor]:
        """`unweighted_combine_backward` in the overlapped layer's form: the rows copied now,
        `pull` does nothing and no product needs to wait (RowsReady None)."""
        grad_rows, weights = self.unweighted_combine_backward(routing, grad_y, topk_weights)
        return grad_rows, lambda: None, None, weights

    def combine_target(self, routing: LocalRouting, hidden: int, dtype: torch.dtype) -> RowScatter:
        """Where the down product's peer-store epilogue puts each grouped row's output: the
        pair's row of a fresh [T * k, H] matrix (this rank's; the pairs' outputs that
        `combine_landed` sums and backward keeps). Zeroes the count it adds to."""
        pairs = routing.pair_row.numel()
        self._combined.zero_()
        return RowScatter(
            out=torch.empty(pairs, hidden, dtype=dtype, device=self.device),
            out_offsets=self._zero_offsets,
            dest_rank=torch.zeros(pairs, dtype=torch.int32, device=self.device),
            dest_row=routing.grouped_pair,
            counts=self._combined,
            counts_offsets=self._zero_offsets,
            rank=0,
        )

    def combine_landed(
        self,
        routing: LocalRouting,
        target: RowScatter,
        column_tiles: int,
        topk_weights: torch.Tensor,
        shared_out: torch.Tensor | None,
        timeout_s: float,
        save_pair_out: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y [T, H], the pairs' outputs [T, k, H] when save_pair_out) once every pair's output
        landed in `target` (column_tiles adds per row): `combine`'s values, in its order."""
        tokens, top_k = routing.pair_row.shape
        expected = torch.full(
            (1,), tokens * top_k * column_tiles, dtype=torch.int32, device=self.device
        )
        await_counts(target.counts, expected, self.status, timeout_s, 0)
        pair_out = target.out.view(tokens, top_k, target.out.shape[1])
        y = torch.empty(tokens, pair_out.shape[2], dtype=pair_out.dtype, device=self.device)
        own_rows = self._constants.get(
            ("own rows", tokens, top_k),
            lambda: torch.arange(tokens * top_k, device=self.device).view(tokens, top_k),
        )
        reduce_rows(
            y,
            target.out,
            own_rows,
            LOCAL_EXCHANGE_SUM_PROGRAMS_PER_SM * self.sms,
            weight=topk_weights.contiguous(),
            init=None if shared_out is None else shared_out.contiguous(),
            **LOCAL_EXCHANGE_SUM,
        )
        return y, pair_out if save_pair_out else None

    def expert_output_buffer(self) -> None:
        """The expert outputs stay where the kernels write them."""
        return None

    def tokens_of_grouped_rows(self, routing: LocalRouting) -> torch.Tensor:
        """[T * k] int32: the token each grouped row copies (`LocalRouting.grouped_token`)."""
        return routing.grouped_token

    def combine(
        self,
        routing: LocalRouting,
        expert_out: torch.Tensor,
        topk_weights: torch.Tensor,
        shared_out: torch.Tensor | None = None,
        save_pair_out: bool = True,
        pair_out_mx: ScaleRounding | None = None,
    ) -> tuple[torch.Tensor, MXRows | GroupedPairOutputs | None]:
        """(y [T, H] in the reference's combine order, the pairs' outputs when save_pair_out):
        expert_out itself (`GroupedPairOutputs`: the backward reads each pair's row in place),
        or with pair_out_mx the outputs' MXFP8 cast along H, `MXRows` [T * k, H], written by the
        same pass."""
        tokens, top_k = routing.pair_row.shape
        hidden = expert_out.shape[1]
        y = torch.empty(tokens, hidden, dtype=expert_out.dtype, device=self.device)
        pair_out = None
        if save_pair_out and pair_out_mx is not None:
            pair_out = MXRows.empty(tokens * top_k, hidden, self.device)
        reduce_rows(
            y,
            expert_out,
            routing.pair_row,
            LOCAL_EXCHANGE_SUM_PROGRAMS_PER_SM * self.sms,
            weight=topk_weights.contiguous(),
            init=None if shared_out is None else shared_out.contiguous(),
            gathered=pair_out,
            gathered_rounding=pair_out_mx or ScaleRounding.RCEIL,
            **LOCAL_EXCHANGE_SUM,
        )
        if save_pair_out and pair_out_mx is None:
            pair_out = GroupedPairOutputs(expert_out)
        return y, pair_out

    def combine_backward(self, routing, grad_y, topk_weights, pair_out):
        """(grads of the grouped outputs [T * k, H] in grad_y's dtype, grad of topk_weights
        [T, k]); pair_out as `combine` (or `combine_landed`: [T, k, H]) saved it."""
        grad_grouped = torch.empty(
            routing.pair_row.numel(), grad_y.shape[1], dtype=grad_y.dtype, device=self.device
        )
        in_place = isinstance(pair_out, GroupedPairOutputs)
        grad_w = pair_gradients(
            grad_y.contiguous(),
            topk_weights.contiguous(),
            pair_out.rows if in_place else pair_out,
            grad_grouped,
            PAIR_GRADIENT_PROGRAMS_PER_SM * self.sms,
            dst_row=routing.pair_row,
            out_at_dst=in_place,
        )
        return grad_grouped, grad_w

    def unweighted_combine_backward(self, routing, grad_y, topk_weights):
        """(grad_y's row of each grouped row's token [T * k, H], each grouped row's weight
        [T * k] fp32)."""
        weights = topk_weights.float().reshape(-1)[routing.grouped_pair.long()]
        return self.dispatch(routing, grad_y), weights

    def pair_values(self, routing, row_values):
        """[T, k] fp32: pair (t, j)'s value, row_values[pair_row[t, j]]."""
        values = torch.empty(routing.pair_row.numel(), dtype=torch.float32, device=self.device)
        values[routing.grouped_pair.long()] = row_values
        return values.view(routing.pair_row.shape)

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
            LOCAL_EXCHANGE_SUM_PROGRAMS_PER_SM * self.sms,
            tail=None if extra is None else extra.contiguous(),
            **LOCAL_EXCHANGE_SUM,
        )
        return grad_x

    def dispatch_backward_overlapped(self, routing, grad_grouped, extra, programs):
        """`dispatch_backward` now, on every SM (nothing travels, so nothing is left to run
        beside the products); returns a callable that returns grad x."""
        grad_x = self.dispatch_backward(routing, grad_grouped, extra)
        return lambda: grad_x

    def check(self) -> None:
        """Raise what a bounded wait of the overlapped path recorded (nothing can overflow in one
        process)."""
        code, _, where, seen = self.status.tolist()
        if code:
            self.status.zero_()
            raise MoKTimeoutError(
                f"the overlapped layer gave up waiting (code {code}) on rows or outputs of block "
                f"{where} (seen {seen}): the copy beside the expert kernels never finished it "
                "(another kernel held the SMs it needed?); the results of that call are undefined"
            )

    def reset(self) -> None:
        """Nothing waits on another rank in one process."""

    def release(self) -> None:
        """Nothing to free."""
