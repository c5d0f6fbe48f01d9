"""Small device tensors whose values depend only on host integers (a token count, an arange),
made once per value instead of on every call: each costs a kernel launch and an allocation, a
large part of a small layer's host time."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class DeviceConstants:
    """A table key -> tensor, of at most `max_entries` tensors that no CUDA graph reads. The
    tensors are read-only: kernels read them and nothing may write into them.

    Under CUDA graph capture nothing new is remembered (a tensor made there holds its values
    only when the graph replays), and a tensor handed out there is never dropped afterwards (the
    graph reads its memory at every replay)."""

    def __init__(self, max_entries: int = 32) -> None:
        self.max_entries = max_entries
        self._table: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._in_graphs: dict[Hashable, torch.Tensor] = {}

    def get(self, key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tensor for `key`, from `make()` the first time (the least recently used entry
        goes when the table is full)."""
        tensor = self._in_graphs.get(key)
        if tensor is not None:
            return tensor
        tensor = self._table.get(key)
        if tensor is not None:
            if _capturing(tensor):
                self._in_graphs[key] = self._table.pop(key)
            else:
                self._table.move_to_end(key)
            return tensor
        tensor = make()
        if _capturing(tensor):
            return tensor
        self._table[key] = tensor
        if len(self._table) > self.max_entries:
            self._table.popitem(last=False)
        return tensor
