"""`mok.kernels.constants.DeviceConstants`: made once per key, bounded, and safe around CUDA
graphs. Bugs these catch: a table that grows with every new token count, an entry rebuilt on
every call (the launches it exists to save), a tensor made during capture handed out to eager
calls (its values exist only at replay), a tensor a captured graph reads freed by eviction."""

from __future__ import annotations

import pytest
import torch

from mok.kernels.constants import DeviceConstants

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_made_once_per_key_and_bounded():
    made = []
    table = DeviceConstants(max_entries=3)

    def make(n):
        made.append(n)
        return torch.arange(n, device=DEVICE)

    for n in (4, 5, 4, 6, 4, 7):  # 4 stays recent; 5 is the least recently used when 7 comes
        assert torch.equal(table.get(n, lambda n=n: make(n)).cpu(), torch.arange(n))
    assert made == [4, 5, 6, 7]
    table.get(5, lambda: make(5))
    assert made == [4, 5, 6, 7, 5]  # evicted, made again


@pytest.mark.gpu
def test_capture_neither_remembers_nor_evicts_what_a_graph_reads():
    table = DeviceConstants(max_entries=1)
    before = table.get("before", lambda: torch.full((4,), 3.0, device=DEVICE))
    out = torch.zeros(4, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.add_(before)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inside = table.get("inside", lambda: torch.full((4,), 5.0, device=DEVICE))
        used = table.get("before", lambda: pytest.fail("made again"))
        out.add_(inside + used)
    assert used is before
    assert "inside" not in table._table  # made during capture: not remembered
    for n in range(3):  # evicts everything it may; "before" must survive (the graph reads it)
        table.get(n, lambda n=n: torch.full((4,), float(n), device=DEVICE))
    out.zero_()
    graph.replay()
    assert torch.equal(out.cpu(), torch.full((4,), 8.0))
    assert table.get("before", lambda: pytest.fail("made again")) is before
