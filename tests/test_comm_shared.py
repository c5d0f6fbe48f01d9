"""Layers of one shape share one NVLink exchange: the registry's bookkeeping (no GPU needed)."""

import dataclasses

import torch

from mok.comm import symmetric
from mok.comm.layout import default_shape
from mok.comm.symmetric import acquire_exchange, release_exchange


@dataclasses.dataclass(eq=False)
class FakeExchange:
    """Stands in for the NVLink exchanges (whose buffers need CUDA and a process group)."""

    group: object
    shape: object
    device: object
    programs: int
    timeout_s: float = 10.0
    released: int = 0

    def release(self):
        self.released += 1


@dataclasses.dataclass(frozen=True)
class FakeGroup:
    group_name: str


def test_one_exchange_per_key_freed_by_its_last_user(monkeypatch):
    monkeypatch.setattr(symmetric, "symmetric_exchange", FakeExchange)
    monkeypatch.setattr(symmetric, "_SHARED_EXCHANGES", {})
    group, device = FakeGroup("ep"), torch.device("cuda", 0)
    shape = default_shape(64, 2, 4, 2, 128)
    first = acquire_exchange(group, shape, device, 24)
    second = acquire_exchange(group, shape, device, 24)
    other_shape = acquire_exchange(group, default_shape(64, 2, 4, 2, 256), device, 24)
    other_group = acquire_exchange(FakeGroup("other"), shape, device, 24)
    other_timeout = acquire_exchange(group, shape, device, 24, timeout_s=3.0)
    assert first is second
    assert len({id(first), id(other_shape), id(other_group), id(other_timeout)}) == 4
    assert other_timeout.timeout_s == 3.0

    release_exchange(first)
    assert first.released == 0
    release_exchange(second)
    assert first.released == 1
    assert acquire_exchange(group, shape, device, 24) is not first  # a fresh one after the last

    stray = FakeExchange(group, shape, device, 24)
    release_exchange(stray)  # not shared: released directly
    assert stray.released == 1
