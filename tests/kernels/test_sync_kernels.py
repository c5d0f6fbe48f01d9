"""Bounded waits (`mok.kernels.sync`): a barrier or a readiness wait whose peer never arrives gives
up after its timeout and records why; a peer too far ahead is caught at once; nothing hangs.

Ranks are simulated in one process: one tensor holds every rank's signals (or flags) and a
peer-offset table reaches them, as in `test_rows_kernels.py`. Only rank 0 runs, so its peers
"never arrive" unless a test writes their signals first. Under the interpreter (CI) a poll counts
as INTERPRETER_POLL_NS; compiled on a GPU the bound is the global timer's.
"""

from __future__ import annotations

import time

import pytest
import torch

from mok.kernels.rows import copy_rows
from mok.kernels.sync import INTERPRETER_SLOWDOWN, OUT_OF_STEP, TIMED_OUT, barrier, new_status

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WAIT_S = 0.2
"""How long, in seconds of wall time, a wait that times out lasts."""
TIMEOUT_S = WAIT_S if DEVICE.type == "cuda" else WAIT_S / INTERPRETER_SLOWDOWN
NEVER_S = 1000.0
"""For waits that must end without waiting: had they waited, the test would outlast its limit."""


def signal_table(ep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(signals [ep, ep] int64: row r is rank r's signals, rank 0's peer-offset table)."""
    signals = torch.zeros(ep, ep, dtype=torch.int64, device=DEVICE)
    offsets = torch.arange(ep, dtype=torch.int64, device=DEVICE) * ep
    return signals, offsets


def run_barrier(signals, offsets, sequence, status, wait_id=3, timeout_s=TIMEOUT_S):
    start = time.monotonic()
    barrier(signals[0], offsets, sequence, status, 0, timeout_s, wait_id)
    status_now = status.tolist()  # synchronizes
    return status_now, time.monotonic() - start


@pytest.mark.parametrize("ep", [2, 3])
def test_barrier_passes_when_every_peer_signalled(ep):
    """Catches: a barrier that waits for the wrong slot or value (it would time out here), or one
    that forgets to signal the peers."""
    signals, offsets = signal_table(ep)
    signals[0, 1:] = 1  # the peers reached barrier 1 before rank 0
    sequence = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    status = new_status(DEVICE)
    got, _ = run_barrier(signals, offsets, sequence, status)
    assert got == [0, 0, 0, 0]
    assert int(sequence) == 1
    assert signals[:, 0].tolist() == [1] * ep  # rank 0 signalled every rank, itself included


def test_barrier_accepts_a_peer_one_barrier_ahead():
    """A peer at s + 1 has passed barrier s (it saw this rank's signal): not a failure. Catches an
    equality test where the protocol allows one barrier of lead."""
    signals, offsets = signal_table(2)
    signals[0, 1] = 5
    sequence = torch.tensor([3], dtype=torch.int64, device=DEVICE)
    status = new_status(DEVICE)
    got, _ = run_barrier(signals, offsets, sequence, status)
    assert got == [0, 0, 0, 0]


@pytest.mark.parametrize("ep", [2, 3])
def test_barrier_gives_up_on_a_peer_that_never_arrives(ep):
    """Catches: an unbounded spin (the test would hang; pytest's timeout ends it), a failure that
    names the wrong peer or wait, a timeout that is not recorded."""
    signals, offsets = signal_table(ep)
    if ep == 3:
        signals[0, 1] = 1  # rank 1 arrived, rank 2 did not
    sequence = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    status = new_status(DEVICE)
    got, elapsed = run_barrier(signals, offsets, sequence, status, wait_id=5)
    assert got == [TIMED_OUT, 5, ep - 1, 1]  # waited at wait 5 for rank ep-1, 1 barrier behind
    if DEVICE.type == "cuda":
        assert WAIT_S <= elapsed < WAIT_S + 5


@pytest.mark.parametrize("ep", [2, 3])
def test_barrier_finds_a_peer_out_of_step_at_once(ep):
    """A peer two barriers ahead cannot have followed the protocol (the calls diverged): recorded
    at once, not after the timeout, even while another peer is still missing (ep = 3). Catches
    a `>=` test that would let it pass, and a wait that keeps spinning for the missing peer."""
    signals, offsets = signal_table(ep)
    signals[0, 1] = 9
    sequence = torch.tensor([6], dtype=torch.int64, device=DEVICE)
    status = new_status(DEVICE)
    got, elapsed = run_barrier(signals, offsets, sequence, status, wait_id=2, timeout_s=NEVER_S)
    assert got == [OUT_OF_STEP, 2, 1, 2]  # rank 1 is 2 barriers past barrier 7
    assert elapsed < 60


def test_a_recorded_failure_ends_later_waits_at_once_and_is_kept():
    """After a failure every later wait returns without waiting, and the first failure stays.
    Catches: one full timeout per wait after a peer died, a later failure overwriting the first."""
    signals, offsets = signal_table(2)
    sequence = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    status = torch.tensor([TIMED_OUT, 1, 1, 1], dtype=torch.int64, device=DEVICE)
    got, elapsed = run_barrier(signals, offsets, sequence, status, wait_id=4, timeout_s=NEVER_S)
    assert got == [TIMED_OUT, 1, 1, 1]
    assert int(sequence) == 1 and int(signals[1, 0]) == 1  # it still signals its peers
    assert elapsed < 60


def copy_waiting(flags, epoch, status):
    """copy_rows of 6 rows, row r waiting on flag r % 3."""
    src = torch.arange(6 * 8, dtype=torch.float32, device=DEVICE).view(6, 8)
    out = torch.full_like(src, -1.0)
    copy_rows(
        out,
        src,
        torch.arange(6, device=DEVICE),
        torch.tensor([6], device=DEVICE),
        programs=2,
        block_rows=4,
        flags=flags,
        wait=torch.arange(6, device=DEVICE) % 3,
        epoch=torch.tensor([epoch], dtype=torch.int32, device=DEVICE),
        status=status,
        timeout_s=TIMEOUT_S,
        wait_id=2,
    )
    return out, src


def test_flag_wait_gives_up_on_a_flag_never_set_and_the_copy_completes():
    """Catches: an unbounded flag wait, a failure naming the wrong flag, a copy that stops
    half-way after a timeout (later kernels would read stale rows without any record)."""
    flags = torch.tensor([4, 4, 3], dtype=torch.int32, device=DEVICE)  # flag 2 still at 3
    status = new_status(DEVICE)
    out, src = copy_waiting(flags, 4, status)
    assert status.tolist() == [TIMED_OUT, 2, 2, 3]
    assert torch.equal(out, src)


def test_flag_wait_passes_on_set_flags_and_finds_a_writer_ahead():
    """Flags at the epoch pass; a flag past it (its writer is in a later exchange) is out of step.
    Catches: a `>=` test on flags (a writer ahead would pass unnoticed)."""
    status = new_status(DEVICE)
    copy_waiting(torch.tensor([4, 4, 4], dtype=torch.int32, device=DEVICE), 4, status)
    assert status.tolist() == [0, 0, 0, 0]
    copy_waiting(torch.tensor([4, 5, 4], dtype=torch.int32, device=DEVICE), 4, status)
    assert status.tolist() == [OUT_OF_STEP, 2, 1, 5]
