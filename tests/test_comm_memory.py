"""`mok.comm.memory`: who provides the NVLink exchange's buffers and what each provider allows.
Bugs caught: the stand-in left installed after its block (every later exchange in the process on
a shared file), a nested block restoring the wrong provider, PyTorch's symmetric memory offered
for CPU tensors or with a gloo group beside CUDA tensors (the exchange would fail later, deep in a
collective), a stand-in that refuses the gloo groups its tests run on, and buffers of the caching
allocator reported as outside it (`mok memory` and the peak-memory figures would count them
twice)."""

from __future__ import annotations

import torch

from mok.comm.memory import (
    NVLINK,
    NVLinkMemory,
    StandInMemory,
    simulated_symmetric_memory,
    symmetric_memory,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


def _allocate(nbytes, device, group):
    return torch.zeros(nbytes, dtype=torch.uint8, device=device), None


def _other_allocate(nbytes, device, group):
    return torch.ones(nbytes, dtype=torch.uint8, device=device), None


def test_the_default_is_pytorch_symmetric_memory_and_a_block_stands_in_for_it_only_inside():
    assert symmetric_memory() is NVLINK
    with simulated_symmetric_memory(_allocate):
        outer = symmetric_memory()
        assert isinstance(outer, StandInMemory) and outer.allocate_buffer is _allocate
        with simulated_symmetric_memory(_other_allocate):
            assert symmetric_memory().allocate_buffer is _other_allocate
        assert symmetric_memory() is outer
    assert symmetric_memory() is NVLINK


def test_the_block_restores_the_provider_when_its_body_raises():
    try:
        with simulated_symmetric_memory(_allocate):
            raise RuntimeError("a failing test body")
    except RuntimeError:
        pass
    assert symmetric_memory() is NVLINK


def test_nvlink_memory_takes_cuda_tensors_beside_nccl_only():
    memory = NVLinkMemory()
    assert "needs CUDA tensors" in memory.unavailable_reason(None, CPU)
    assert memory.carries("nccl", CUDA) and not memory.carries("gloo", CUDA)
    assert memory.carries("gloo", CPU) and not memory.carries("nccl", CPU)
    assert not memory.counted_by_allocator


def test_a_stand_in_runs_anywhere_on_any_group_with_its_own_buffers():
    memory = StandInMemory(_allocate)
    assert memory.unavailable_reason(None, CPU) is None
    assert memory.unavailable_reason(None, CUDA) is None
    assert memory.carries("gloo", CUDA) and memory.carries("gloo", CPU)
    buffer, handle = memory.allocate(48, CPU, None)
    assert buffer.shape == (48,) and buffer.dtype == torch.uint8 and handle is None
    assert memory.counted_by_allocator
