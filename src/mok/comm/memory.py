"""Where the NVLink exchange's buffers come from: PyTorch's symmetric memory on the GPUs of one
host (`NVLINK`), or a stand-in that tests install (`simulated_symmetric_memory`): one shared file
mapped by CPU processes, or CUDA IPC for processes sharing one GPU (`mok.testing`'s allocators).
The exchange, the backends and `mok.create_workspace` ask `symmetric_memory()` what it allows and
never check which one they have. No Triton here: hosts without it size and check layers too."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from mok.distributed import host_names

Allocate = Callable[[int, torch.device, "dist.ProcessGroup | None"], tuple[torch.Tensor, object]]
"""(nbytes, device, group) -> (this rank's buffer of nbytes uint8, its handle: `buffer_ptrs`,
every rank's buffer as mapped here). Collective."""


class SymmetricMemory(Protocol):
    """A provider of the exchange's buffers, one per rank, each mapped by every rank."""

    counted_by_allocator: bool
    """Whether PyTorch's caching allocator counts the buffers (`bytes_outside_allocator`)."""

    def allocate(
        self, nbytes: int, device: torch.device, group: dist.ProcessGroup | None
    ) -> tuple[torch.Tensor, object]:
        """This rank's buffer and its handle (`Allocate`). Collective."""
        ...

    def unavailable_reason(
        self, group: dist.ProcessGroup | None, device: torch.device
    ) -> str | None:
        """None if buffers can be made for `group` on `device`, else why not. Collective."""
        ...

    def carries(self, group_backend: str, device: torch.device) -> bool:
        """Whether a process group of this backend may run the layer's collectives beside
        buffers on `device`."""
        ...


class NVLinkMemory:
    """PyTorch's symmetric memory: one GPU per rank, every rank on one host, NCCL beside it."""

    counted_by_allocator = False

    def allocate(self, nbytes, device, group):
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer, symm_mem.rendezvous(buffer, group)

    def unavailable_reason(self, group, device):
        if device.type != "cuda":
            return f"symmetric memory needs CUDA tensors, the device is {device}"
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
        except ImportError as error:
            return f"torch.distributed._symmetric_memory is missing ({error})"
        group = group if group is not None else dist.group.WORLD
        hosts = len(set(host_names(group)))
        if hosts > 1:
            return f"the ranks run on {hosts} hosts: symmetric memory needs one"
        size = dist.get_world_size(group)
        if size > torch.cuda.device_count():
            return f"{size} ranks share {torch.cuda.device_count()} GPUs: one GPU per rank needed"
        return None

    def carries(self, group_backend, device):
        return group_backend == ("nccl" if device.type == "cuda" else "gloo")


@dataclasses.dataclass(frozen=True)
class StandInMemory:
    """Buffers from `allocate` (a shared file, CUDA IPC), wherever the ranks' processes are: CPU
    devices, or several ranks on one GPU over any group."""

    allocate_buffer: Allocate
    counted_by_allocator = True

    def allocate(self, nbytes, device, group):
        return self.allocate_buffer(nbytes, device, group)

    def unavailable_reason(self, group, device):
        return None

    def carries(self, group_backend, device):
        return True


NVLINK = NVLinkMemory()
_current: SymmetricMemory = NVLINK


def symmetric_memory() -> SymmetricMemory:
    """The provider in effect: the innermost `simulated_symmetric_memory`'s, else `NVLINK`."""
    return _current


@contextlib.contextmanager
def simulated_symmetric_memory(allocate: Allocate) -> Iterator[None]:
    """Inside this block, every exchange made without its own provider takes its buffers from
    `allocate` (`StandInMemory`): the whole NVLink protocol runs on CPU processes or on
    processes that share one GPU. For tests."""
    global _current
    previous, _current = _current, StandInMemory(allocate)
    try:
        yield
    finally:
        _current = previous
