"""What every token exchange provides (`LocalExchange`, `CollectiveExchange`, `SymmetricExchange`):
the calls the triton backend makes, in this order per layer call (checked by type checkers)."""

from __future__ import annotations

from typing import Protocol

import torch


class ExchangeRouting(Protocol):
    """One call's routing, made by `route`; each exchange keeps its own fields besides."""

    group_offsets: torch.Tensor
    """[E_loc + 1] int32: the grouped rows of each local expert, on the device."""


class Exchange(Protocol):
    def route(self, topk_idx: torch.Tensor) -> ExchangeRouting:
        """Where every (token, slot) pair of topk_idx [T, k] (valid global ids) goes."""

    def dispatch(self, routing: ExchangeRouting, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the rows this rank's experts take, grouped by local expert."""

    def expert_output_buffer(self) -> torch.Tensor | None:
        """Where the expert outputs may be written so that combine copies nothing, or None."""

    def combine(
        self,
        routing: ExchangeRouting,
        expert_out: torch.Tensor,
        topk_weights: torch.Tensor,
        shared_out: torch.Tensor | None = None,
        save_pair_out: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y [T, H] in the contract's combine order, the pairs' outputs [T, k, H] or None)."""

    def combine_backward(
        self,
        routing: ExchangeRouting,
        grad_y: torch.Tensor,
        topk_weights: torch.Tensor,
        pair_out: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gradients of the grouped expert outputs, gradient of topk_weights [T, k])."""

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
