"""What the token exchanges provide: the calls every one has (`ExchangeBase`); the staged
exchange's that the triton backend makes, in this order per layer call (`StagedExchange`), and the
overlapped layer's (`OverlappedExchangeBase`); each with the combine's backward of one router
gradient form, the pair gradients (`Exchange`, `OverlappedExchange`) or the router values
(`RouterValuesExchange`, `OverlappedRouterValuesExchange`). `LocalExchange` and
`CollectiveExchange` provide every one; each NVLink exchange one (`mok.comm.symmetric`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from mok.kernels.host import RowScatter, RowsReady
    from mok.kernels.mx import MXRows
    from mok.reference.mx import ScaleRounding


@dataclasses.dataclass(frozen=True)
class GroupedPairOutputs:
    """The pairs' outputs kept where the expert product wrote them, for the combine's backward:
    pair (t, j)'s output is row pair_row[t, j] of `rows` [T * k, H] (the local exchange, whose
    grouped rows are exactly the pairs), so the forward writes no copy of them in token order."""

    rows: torch.Tensor


class ExchangeRouting(Protocol):
    """One call's routing, made by `route`; each exchange keeps its own fields besides."""

    group_offsets: torch.Tensor
    """[E_loc + 1] int32: the grouped rows of each local expert, on the device."""


class ExchangeBase(Protocol):
    """What every exchange provides, whichever layer calls it."""

    def route(self, topk_idx: torch.Tensor, exact_rows: bool = False) -> ExchangeRouting:
        """Where every (token, slot) pair of topk_idx [T, k] (valid global ids) goes.
        exact_rows: size the call's tensors with a row per received pair by the pairs received,
        read on the host, where the exchange would size them for a capacity otherwise."""

    def tokens_of_grouped_rows(self, routing: ExchangeRouting) -> torch.Tensor | None:
        """[M] int32: the row of this rank's x that each grouped row of `dispatch` copies (EP 1),
        so that a backward can read x through it instead of keeping the grouped rows (k copies
        of x's rows); None where grouped rows hold other ranks' tokens."""

    def dispatch_backward(
        self,
        routing: ExchangeRouting,
        grad_grouped: torch.Tensor,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Gradient of x [T, H] from the grouped rows' gradients, plus `extra`, in fixed order."""

    def check(self) -> None:
        """Raise what the device found since the last check (a host synchronization)."""

    def reset(self) -> None:
        """Make the exchange usable again after a failed wait on a peer (collective)."""

    def release(self) -> None:
        """Free the exchange's buffers."""


class StagedExchange(ExchangeBase, Protocol):
    """The staged exchange (the triton backend's): each copy runs before or after the expert
    products, on the caller's stream."""

    def dispatch(self, routing: ExchangeRouting, x: torch.Tensor) -> torch.Tensor:
        """x [T, W] -> the rows this rank's experts take, grouped by local expert. W is the
        dispatched row's width: H, or the elements holding a packed MXFP8 row (`MXRows.as_rows`),
        which the exchange moves without reading."""

    def expert_output_buffer(self) -> torch.Tensor | None:
        """Where the expert outputs may be written so that combine copies nothing, or None."""

    def combine(
        self,
        routing: ExchangeRouting,
        expert_out: torch.Tensor,
        topk_weights: torch.Tensor,
        shared_out: torch.Tensor | None = None,
        save_pair_out: bool = True,
        pair_out_mx: ScaleRounding | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | MXRows | GroupedPairOutputs | None]:
        """(y [T, H] in the contract's combine order, the pairs' outputs [T, k, H] or None; with
        pair_out_mx, their MXFP8 cast along H rounded so, `MXRows` [T * k, H]; or, where the
        exchange reads them in place, `GroupedPairOutputs`): what `combine_backward` takes."""


class Exchange(StagedExchange, Protocol):
    """The staged exchange with the pair gradients (`router_gradient="saved_outputs"`)."""

    def combine_backward(
        self,
        routing: ExchangeRouting,
        grad_y: torch.Tensor,
        topk_weights: torch.Tensor,
        pair_out: torch.Tensor | MXRows | GroupedPairOutputs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gradients of the grouped expert outputs, gradient of topk_weights [T, k])."""


class RouterValues(Protocol):
    """What the router values' backward (`router_gradient="epilogue"`) adds in either layout."""

    def pair_values(self, routing: ExchangeRouting, row_values: torch.Tensor) -> torch.Tensor:
        """[T, k] fp32: pair (t, j)'s value from row_values [rows] fp32, one per grouped row
        (the router weights' dots), back on the token's rank; 0 for pairs dropped for capacity."""


class RouterValuesExchange(StagedExchange, RouterValues, Protocol):
    """The staged exchange with the router values (`router_gradient="epilogue"`)."""

    def unweighted_combine_backward(
        self, routing: ExchangeRouting, grad_y: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The combine's backward with the router weights left for the down product's epilogue
        (`MoKConfig.router_gradient="epilogue"`): (grad_y's row of each grouped row's token,
        unweighted, [rows, H]; each grouped row's pair's weight, [rows] fp32). A token's row
        crosses to each owner once, as x's does in `dispatch`."""


@dataclasses.dataclass(frozen=True)
class ReceivedTokens:
    """The tokens an owner received, each once, and where each grouped row is among them: what
    the gate/up weight gradient reads instead of the grouped rows where those hold a copy per pair
    and are sized for the worst routing (k times the rows, and EP x T x k of them)."""

    rows: torch.Tensor
    """[S, H]: received tokens (rows no grouped row points at are left unwritten)."""
    source_rows: torch.Tensor
    """[M] int32, M the grouped rows: grouped row r is rows[source_rows[r]] (negative: a row of
    zeros, as the dispatch wrote it)."""
    pull: Callable[[], None]
    """Fills `rows`; run on the communication stream after the dispatch's copy and before that
    stream joins (the senders' copies of x are valid until then)."""


class OverlappedExchangeBase(ExchangeBase, Protocol):
    """What the overlapped layer (`mok.backends.fused`) calls besides: copies that run on the
    caller's communication stream while the products wait per tile for their rows, and the
    combine stored by the down product's epilogue (`LocalExchange`, `OverlappedSymmetricExchange`).

    A returned copy (`pull`) makes the tensors only it reads when it runs, on the stream it runs
    on: the caller may drop it once it is queued, keeping only the tensors returned beside it
    (and marking those used on the communication stream for it, `Tensor.record_stream`). A
    tensor made on the caller's stream and held only by the copy would go back to that stream's
    memory pool when the copy is dropped, and be rewritten there while the copy still reads it."""

    def dispatch_overlapped(
        self, routing: ExchangeRouting, x: torch.Tensor, programs: int, timeout_s: float
    ) -> tuple[torch.Tensor, Callable[[], None], RowsReady | None]:
        """(grouped rows, the copy to run beside the products, their readiness flags)."""

    def received_tokens(self, routing: ExchangeRouting, programs: int) -> ReceivedTokens | None:
        """The tokens received, each once, to keep for the backward instead of the grouped rows
        (their copy loaded on `programs` programs), or None where the grouped rows are sized
        exactly or would take fewer rows."""

    def combine_target(
        self, routing: ExchangeRouting, hidden: int, dtype: torch.dtype
    ) -> RowScatter:
        """Where the down product's peer-store epilogue stores each grouped row's output."""

    def combine_landed(
        self,
        routing: ExchangeRouting,
        target: RowScatter,
        column_tiles: int,
        topk_weights: torch.Tensor,
        shared_out: torch.Tensor | None,
        timeout_s: float,
        save_pair_out: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y [T, H], the pairs' outputs [T, k, H] or None) once every output landed."""

    def dispatch_backward_overlapped(
        self,
        routing: ExchangeRouting,
        grad_grouped: torch.Tensor,
        extra: torch.Tensor | None,
        programs: int,
    ) -> Callable[[], torch.Tensor]:
        """`Exchange.dispatch_backward` in two parts: what reads grad_grouped, now, on the current
        stream (the caller may drop it after); returned, the rest, to run on the caller's
        communication stream on `programs` SMs, which returns grad x [T, H]."""


class OverlappedExchange(OverlappedExchangeBase, Protocol):
    """The overlapped exchange with the pair gradients."""

    def combine_backward_overlapped(
        self,
        routing: ExchangeRouting,
        grad_y: torch.Tensor,
        topk_weights: torch.Tensor,
        pair_out: torch.Tensor,
        programs: int,
        timeout_s: float,
    ) -> tuple[torch.Tensor, Callable[[], None], RowsReady | None, torch.Tensor]:
        """(grouped rows' gradients, the copy to run beside the products, their readiness
        flags, the router weights' gradient)."""


class OverlappedRouterValuesExchange(OverlappedExchangeBase, RouterValues, Protocol):
    """The overlapped exchange with the router values."""

    def unweighted_combine_backward_overlapped(
        self,
        routing: ExchangeRouting,
        grad_y: torch.Tensor,
        topk_weights: torch.Tensor,
        programs: int,
        timeout_s: float,
    ) -> tuple[torch.Tensor, Callable[[], None], RowsReady | None, torch.Tensor]:
        """(grad_y's rows of the grouped rows, unweighted, the copy to run beside the products,
        their readiness flags, each grouped row's router weight [rows] fp32): the epilogue
        form's combine backward (`MoKConfig.router_gradient="epilogue"`)."""
