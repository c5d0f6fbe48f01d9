"""The NVLink exchange's symmetric buffer, as sizes: its shape for a layer and the regions of
one rank's buffer in address order. Plain arithmetic (no Triton, no allocation), so that hosts
without a GPU can size it (`mok memory`, `mok.symmetric_buffer_bytes`)."""

from __future__ import annotations

import dataclasses
import math

import torch

_ALIGN_BYTES = 256
"""Every region starts at a multiple of this many bytes."""


@dataclasses.dataclass(frozen=True)
class ExchangeShape:
    """What sizes the symmetric buffers: equal on every rank."""

    hidden: int
    top_k: int
    local_experts: int
    max_tokens: int
    """Largest T a rank passes in one call."""
    token_capacity: int
    """Staging rows per rank (tokens received, each once per owner)."""
    pair_capacity: int
    """Grouped rows per rank (pairs received)."""
    block_tokens: int = 32
    """Readiness granularity: one flag per block of this many of a sender's tokens (also the
    rows per tile of the push kernel)."""
    pull_dispatch: bool = False
    """Owners load token rows from the senders instead of senders storing them."""
    overlapped: bool = False
    """The layout of the overlapped layer (the `fused` backend): each rank's pair outputs stored
    into it by the owners' down product; the dispatch pulled straight into the grouped rows, or
    pushed into staging and expanded beside the products (pull_dispatch False)."""
    dtype: torch.dtype = torch.bfloat16
    """Token rows and expert outputs (the gradients summed per staging row stay fp32)."""
    dispatch_width: int | None = None
    """Elements of `dtype` per dispatched row (None: hidden). The MXFP8 layer dispatches packed
    e4m3 rows (`MXRows.as_rows`): about half of hidden."""
    router_values: bool = False
    """The backward of `MoKConfig.router_gradient="epilogue"`: two fp32 values per grouped row
    (the router weights in, their gradient's dots out) for `unweighted_combine_backward` and
    `pair_values`, and, unless overlapped, no pair gradients: T x k rows of H fewer. The
    exchanges of this layout (`SymmetricRouterValuesExchange`,
    `OverlappedSymmetricRouterValuesExchange`) have no `combine_backward`."""

    def __post_init__(self):
        if self.overlapped and self.dispatch_width not in (None, self.hidden):
            raise ValueError("the overlapped layout dispatches rows of the hidden width only")

    @property
    def blocks_per_rank(self) -> int:
        return math.ceil(self.max_tokens / self.block_tokens)

    @property
    def dispatch_columns(self) -> int:
        """Elements per dispatched row."""
        return self.hidden if self.dispatch_width is None else self.dispatch_width


def default_shape(
    hidden: int,
    top_k: int,
    local_experts: int,
    ep_size: int,
    max_tokens: int,
    recv_capacity: int | None = None,
    pair_capacity: int | None = None,
    **options,
) -> ExchangeShape:
    """Capacities for `recv_capacity` staging rows (None: the worst case, every token of every
    rank, which never overflows) and `pair_capacity` grouped rows (None: the worst case for those
    staging rows, k pairs each: a token may pick one expert more than once, and the triton backend
    routes a pair with an id out of range to expert 0 with weight 0)."""
    worst = ep_size * max_tokens
    tokens = worst if recv_capacity is None else min(recv_capacity, worst)
    worst_pairs = tokens * top_k
    pairs = worst_pairs if pair_capacity is None else min(pair_capacity, worst_pairs)
    return ExchangeShape(
        hidden=hidden,
        top_k=top_k,
        local_experts=local_experts,
        max_tokens=max_tokens,
        token_capacity=max(tokens, 1),
        pair_capacity=max(pairs, 1),
        **options,
    )


def buffer_layout(
    shape: ExchangeShape, ep_size: int
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, dims, dtype) of every region of one rank's symmetric buffer, in address order."""
    s, experts = shape, ep_size * shape.local_experts
    width = s.dispatch_columns
    x_copy_shared = s.overlapped and s.pull_dispatch
    staging_rows = s.token_capacity
    if x_copy_shared:  # grad_staging's memory holds x's copy too (`SymmetricView.x_copy`)
        x_bytes = s.max_tokens * width * s.dtype.itemsize
        staging_rows = max(staging_rows, -(-x_bytes // (s.hidden * 4)))
    layout = [
        ("signals", (ep_size,), torch.int64),
        ("counts", (ep_size, experts + ep_size), torch.int64),
        ("pair_meta", (s.pair_capacity + 1, 2), torch.int64),
        ("flags", (ep_size * s.blocks_per_rank,), torch.int32),
    ]
    if s.overlapped or not s.router_values:
        layout.append(("grad_pairs", (s.max_tokens * s.top_k, s.hidden), s.dtype))
    layout.append(("grad_staging", (staging_rows, s.hidden), torch.float32))
    # The overlapped layout stores the expert outputs straight into the token ranks' pair
    # slots, and pulls straight into the products' rows (staging only for a push).
    if not (s.overlapped and s.pull_dispatch):
        layout.append(("staging", (s.token_capacity, width), s.dtype))
    if not s.overlapped:
        layout.append(("expert_out", (s.pair_capacity, s.hidden), s.dtype))
    if s.pull_dispatch:
        layout.append(("staging_source", (s.token_capacity + 1, 2), torch.int64))
    if s.pull_dispatch and not x_copy_shared:
        layout.append(("x_copy", (s.max_tokens, width), s.dtype))
    if s.overlapped:  # its pair_out is grad_pairs' memory (`SymmetricView.pair_out`)
        layout.append(("combine_counts", (ep_size,), torch.int32))
    if s.router_values:
        layout.append(("row_weights", (s.pair_capacity, 1), torch.float32))
        layout.append(("row_dots", (s.pair_capacity, 1), torch.float32))
    return layout


def region_bytes(layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, int]:
    """Bytes each region of `layout` takes in the buffer (rounded up to the regions' alignment);
    their sum is the buffer's size."""
    return {
        name: -(-math.prod(dims) * dtype.itemsize // _ALIGN_BYTES) * _ALIGN_BYTES
        for name, dims, dtype in layout
    }
