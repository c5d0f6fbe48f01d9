"""What a backend provides to `mok.functional` (checked by type checkers, not at run time)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from mok.config import MoKConfig
    from mok.weights import MoEGradients, MoEWeights


Routing = TypeVar("Routing")
"""A backend's routing of one call (`route`), reused by forward and backward."""
Saved = TypeVar("Saved")
"""What a backend's forward keeps for its backward."""


class LayerBackend(Protocol[Routing, Saved]):
    """One implementation of the layer behind the functional API. Inputs reach it validated by
    `mok.functional`; every method is collective over the workspace's group."""

    name: ClassVar[str]
    checks_ids_on_device: ClassVar[bool]
    """True: expert ids are checked on the device (raised by `check`), not on the host first."""
    max_tokens: int | None
    """Largest T per call its buffers take (checked on every rank before routing); None: any."""

    @staticmethod
    def unavailable_reason(
        config: MoKConfig, device: torch.device, group: dist.ProcessGroup | None
    ) -> str | None:
        """None if it can run when asked for by name, else why not."""

    @staticmethod
    def auto_skip_reason(device: torch.device) -> str | None:
        """Why `auto` passes it over on `device` although it may run there (None: it may)."""

    def route(self, topk_idx: torch.Tensor) -> Routing:
        """The backend's routing of one call, reused by forward and backward."""

    def forward(
        self,
        routing: Routing,
        topk_idx: torch.Tensor,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        weights: MoEWeights,
        need_backward: bool,
    ) -> tuple[torch.Tensor, Saved | None]:
        """(y, what backward needs, or None without need_backward)."""

    def backward(
        self,
        routing: Routing,
        saved: Saved,
        grad_y: torch.Tensor,
        accumulate_into: dict[str, torch.Tensor],
    ) -> MoEGradients:
        """The gradients; a weight named in accumulate_into has its gradient added into that
        buffer in place and the buffer returned in its place."""

    def check(self) -> None:
        """Raise what the device found since the last check (a host synchronization)."""

    def reset(self) -> None:
        """Make it usable again after a failed wait on a peer (collective)."""

    def release(self) -> None:
        """Free its buffers."""

    def memory_outside_allocator(self) -> int:
        """Bytes of its buffers that PyTorch's caching allocator does not count
        (`torch.cuda.max_memory_allocated` misses them): symmetric memory maps its own."""
