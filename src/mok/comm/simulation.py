"""Symmetric memory stood in for by other shared memory, for tests: the whole NVLink protocol on
CPU processes (a shared file, kernels under the Triton interpreter) or on processes that share one
GPU (CUDA IPC). See `mok.testing.shared_file_allocator` and `mok.testing.cuda_ipc_allocator`."""

from __future__ import annotations

import contextlib

_allocator = None


@contextlib.contextmanager
def simulated_symmetric_memory(allocate):
    """Inside this block, every `SymmetricExchange` made without its own `allocate` takes its
    buffer from `allocate` (the signature of `mok.comm.symmetric.allocate_symmetric`), and the
    exchange runs wherever the ranks' processes are: CPU devices, or several ranks on one GPU over
    a gloo group (the triton backend and `mok.create_workspace` accept both there)."""
    global _allocator
    previous, _allocator = _allocator, allocate
    try:
        yield
    finally:
        _allocator = previous


def simulated_allocator():
    """The allocator of the innermost `simulated_symmetric_memory` block, or None."""
    return _allocator
