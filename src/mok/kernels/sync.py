"""Bounded waits on other GPUs: readiness flags and barriers that give up instead of hanging.

A rank that never arrives (it crashed, skipped a call, or routed with another config) must not
leave the others spinning forever. Every wait here ends after `timeout_ns` at the latest and then
records what it waited for in a *status* tensor on its own device, [4] int64:

    [code, wait id, where, value seen]     code: 0 fine, TIMED_OUT, OUT_OF_STEP

`where` is the peer rank of a barrier or the flag index of a readiness wait. The first failure
wins (compare-and-swap on the code); once the code is set, later waits of the same status return
at once, so a broken exchange costs one timeout, not one per wait, and the rest of the call runs
to its end on whatever the buffers hold (every index is bounded by the buffers' capacities, so
nothing is written out of bounds). The host reads the status where it synchronizes anyway
(`mok.Workspace.check`). No wait executes a trap, so the CUDA context stays usable.

Time comes from the GPU's global timer. The CPU interpreter has no GPU timer and runs kernels
orders of magnitude slower than a GPU (docs/notes/comm-design.md, "Bounded waits"): there time
comes from the host's monotonic clock slowed down INTERPRETER_SLOWDOWN times, so that timeouts
chosen for GPUs do not fire on work that is merely interpreted (a 10 s timeout waits 1000 s on
the CPU).
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from mok.kernels._triton_compat import interpreting, patch_interpreter
from mok.kernels.launch import fast_launch

INTERPRETER_SLOWDOWN = 100
"""How many times slower the interpreter's clock runs than the host's (see the docstring)."""

if interpreting():
    patch_interpreter()

    def clock_ns():
        """The host's monotonic clock in ns, slowed down INTERPRETER_SLOWDOWN times (the
        interpreter runs kernels on the host)."""
        return tl.full([], time.monotonic_ns() // INTERPRETER_SLOWDOWN, tl.int64)

    @triton.jit
    def async_proxy_fence():
        """Nothing to order under the interpreter (no TMA)."""
        pass

else:
    from triton.language.extra.cuda import globaltimer

    @triton.jit
    def clock_ns():
        """The GPU's global timer in ns."""
        return globaltimer()

    @triton.jit
    def async_proxy_fence():
        """Order this thread's earlier (acquiring) loads before its later TMA reads of global
        memory: TMA reads through the async proxy, which an acquire by ordinary loads does not
        order by itself."""
        tl.inline_asm_elementwise(
            "fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], tl.int32, is_pure=False, pack=1
        )


TIMED_OUT = 1
"""The awaited flag or peer did not arrive within the timeout."""
OUT_OF_STEP = 2
"""A peer is further ahead than the protocol allows: the ranks' calls diverged."""

STATUS_FIELDS = 4
# The kernels' copies of the codes (a kernel reads only constexpr globals).
_TIMED_OUT = tl.constexpr(TIMED_OUT)
_OUT_OF_STEP = tl.constexpr(OUT_OF_STEP)
_FAR = tl.constexpr(1 << 62)


def new_status(device: torch.device) -> torch.Tensor:
    """A cleared status tensor ([4] int64) on `device`."""
    return torch.zeros(STATUS_FIELDS, dtype=torch.int64, device=device)


@triton.jit
def record_failure(status_ptr, code, wait_id, where, seen):
    """Record a failure in the status unless one is already recorded (the first one wins)."""
    zero = tl.full([], 0, tl.int64)
    if tl.atomic_cas(status_ptr, zero, tl.full([], code, tl.int64), sem="relaxed") == 0:
        tl.store(status_ptr + 1, tl.cast(wait_id, tl.int64))  # a constant where it is 1
        tl.store(status_ptr + 2, where.to(tl.int64))
        tl.store(status_ptr + 3, seen.to(tl.int64))


@triton.jit
def signal_ready(flag_pointer, epoch):
    """Publish this program's earlier stores (to any GPU) by setting one flag to `epoch`.

    The barrier makes every thread's stores precede the one release by the thread that signals;
    system scope because the flag and the data may live on another GPU."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_pointer, epoch, sem="release", scope="sys")


@triton.jit
def wait_ready(
    flag_pointers,  # [N] pointers to int32 flags
    flag_index,  # [N] int64: each flag's index, reported on failure
    epoch,  # int32: the value that means "written in this exchange"
    mask,  # [N] bool: the flags to wait for
    status_ptr,  # [4] int64 status (see the module docstring)
    timeout_ns,
    wait_id,
):
    """Spin until every flag under `mask` equals `epoch`, then acquire what they publish.

    Gives up after timeout_ns (TIMED_OUT), at once when a flag is past `epoch` (OUT_OF_STEP: its
    writer is in a later exchange, which a correct protocol never allows before this wait is
    done), or without waiting when the status already holds a failure. Volatile loads poll
    without caching; one acquire per flag orders the later loads after the producer's release;
    the barrier extends that to every thread of the program."""
    failed = tl.load(status_ptr, volatile=True)
    start = clock_ns()
    late = start < 0
    seen = tl.load(flag_pointers, mask=mask, other=epoch, volatile=True)
    while (tl.min(seen - epoch) < 0) & (tl.max(seen - epoch) <= 0) & (failed == 0) & ~late:
        seen = tl.load(flag_pointers, mask=mask, other=epoch, volatile=True)
        late = clock_ns() - start > timeout_ns
    if failed == 0:
        if tl.max(seen - epoch) > 0:
            where = tl.min(tl.where(seen > epoch, flag_index, _FAR))
            record_failure(status_ptr, _OUT_OF_STEP, wait_id, where, tl.max(seen))
        elif tl.min(seen - epoch) < 0:
            where = tl.min(tl.where(seen < epoch, flag_index, _FAR))
            record_failure(status_ptr, _TIMED_OUT, wait_id, where, tl.min(seen))
    tl.atomic_add(flag_pointers, 0, mask=mask, sem="acquire", scope="sys")
    tl.debug_barrier()


@triton.jit
def wait_counts(
    count_pointers,  # [N] pointers to int32 readiness counts
    count_index,  # [N] int64: each count's index, reported on failure
    expected,  # [N] int32: the value each count reaches once everything it counts has landed
    mask,  # [N] bool: the counts to wait for
    status_ptr,  # [4] int64 status (see the module docstring)
    timeout_ns,
    wait_id,
):
    """Spin until every count under `mask` equals its expected value, then acquire what the
    release adds that made it so publish (the peer-store epilogue's counts: a count grows by the
    rows that landed, `grouped_gemm.scatter_row_tile`).

    Bounded like `wait_ready`: TIMED_OUT after timeout_ns with a count still short, OUT_OF_STEP
    at once when one is past its expected value (more rows arrived than this rank's routing
    sends: the ranks' calls diverged), no wait when the status already holds a failure."""
    failed = tl.load(status_ptr, volatile=True)
    start = clock_ns()
    late = start < 0
    seen = tl.load(count_pointers, mask=mask, other=0, volatile=True)
    gap = tl.where(mask, seen - expected, 0)
    while (tl.min(gap) < 0) & (tl.max(gap) <= 0) & (failed == 0) & ~late:
        seen = tl.load(count_pointers, mask=mask, other=0, volatile=True)
        gap = tl.where(mask, seen - expected, 0)
        late = clock_ns() - start > timeout_ns
    if failed == 0:
        if tl.max(gap) > 0:
            where = tl.min(tl.where(gap > 0, count_index, _FAR))
            record_failure(status_ptr, _OUT_OF_STEP, wait_id, where, tl.max(gap))
        elif tl.min(gap) < 0:
            where = tl.min(tl.where(gap < 0, count_index, _FAR))
            record_failure(status_ptr, _TIMED_OUT, wait_id, where, -tl.min(gap))
    tl.atomic_add(count_pointers, 0, mask=mask, sem="acquire", scope="sys")
    tl.debug_barrier()


@fast_launch
@triton.jit(do_not_specialize=["timeout_ns", "wait_id"])
def _wait_counts_kernel(
    counts_ptr, expected_ptr, num_counts, status_ptr, timeout_ns, wait_id, BLOCK: tl.constexpr
):
    index = tl.arange(0, BLOCK)
    live = index < num_counts
    expected = tl.load(expected_ptr + index, mask=live, other=0)
    wait_counts(
        counts_ptr + index, index.to(tl.int64), expected, live, status_ptr, timeout_ns, wait_id
    )


def await_counts(
    counts: torch.Tensor,
    expected: torch.Tensor,
    status: torch.Tensor,
    timeout_s: float,
    wait_id: int,
) -> None:
    """Hold this stream until every readiness count (counts [N] int32, this rank's) equals
    expected [N] int32, or the status records why not within timeout_s (`wait_counts`): the
    waiting side of the peer-store epilogue, as one small kernel in stream order."""
    if (
        counts.shape != expected.shape
        or counts.dtype != torch.int32
        or expected.dtype != counts.dtype
    ):
        raise ValueError(
            f"await_counts: counts and expected must be [N] int32 alike, got "
            f"{tuple(counts.shape)} {counts.dtype} and {tuple(expected.shape)} {expected.dtype}"
        )
    n = counts.shape[0]
    _wait_counts_kernel[(1,)](
        counts,
        expected,
        n,
        status,
        timeout_ns(timeout_s),
        wait_id,
        BLOCK=max(2, triton.next_power_of_2(n)),
        num_warps=1,
    )


@fast_launch
@triton.jit(do_not_specialize=["rank", "ep", "timeout_ns", "wait_id"])
def barrier_kernel(
    signals_ptr,  # [ep] int64, this rank's: slot r holds the last barrier rank r signalled here
    offsets_ptr,  # [ep] int64 peer-offset table of the signals (see mok.kernels.rows)
    sequence_ptr,  # [1] int64: barriers this rank has entered; incremented here
    status_ptr,  # [4] int64 status
    rank,
    ep,
    timeout_ns,
    wait_id,
    EP_BLOCK: tl.constexpr,  # power of two >= ep
):
    """Grid: 1. Barrier number s = sequence + 1: write s into slot `rank` of every rank's signals
    (release, system scope: the earlier kernels' stores on this stream precede it), then wait
    until every slot here holds s or s + 1 (a peer one barrier ahead has passed s, so it saw this
    rank's signal; two or more ahead is OUT_OF_STEP), bounded by timeout_ns (TIMED_OUT)."""
    sequence = tl.load(sequence_ptr) + 1
    tl.store(sequence_ptr, sequence)
    peers = tl.arange(0, EP_BLOCK)
    is_peer = peers < ep
    offsets = tl.load(offsets_ptr + peers, mask=is_peer, other=0)
    mine = tl.zeros((EP_BLOCK,), dtype=tl.int64) + sequence
    tl.atomic_xchg(signals_ptr + offsets + rank, mine, mask=is_peer, sem="release", scope="sys")

    failed = tl.load(status_ptr, volatile=True)
    start = clock_ns()
    late = start < 0
    seen = tl.load(signals_ptr + peers, mask=is_peer, other=sequence, volatile=True)
    while (tl.min(seen) < sequence) & (tl.max(seen) <= sequence + 1) & (failed == 0) & ~late:
        seen = tl.load(signals_ptr + peers, mask=is_peer, other=sequence, volatile=True)
        late = clock_ns() - start > timeout_ns
    if failed == 0:
        if tl.max(seen) > sequence + 1:
            peer = tl.argmax(seen, 0)
            record_failure(status_ptr, _OUT_OF_STEP, wait_id, peer, tl.max(seen) - sequence)
        elif tl.min(seen) < sequence:
            peer = tl.argmin(seen, 0)
            record_failure(status_ptr, _TIMED_OUT, wait_id, peer, sequence - tl.min(seen))
    tl.atomic_add(signals_ptr + peers, 0, mask=is_peer, sem="acquire", scope="sys")


def timeout_ns(seconds: float) -> int:
    """A wait bound in nanoseconds, as the kernels take it."""
    return int(seconds * 1e9)


def barrier(
    signals: torch.Tensor,
    signal_offsets: torch.Tensor,
    sequence: torch.Tensor,
    status: torch.Tensor,
    rank: int,
    timeout_s: float,
    wait_id: int,
) -> None:
    """Every rank of the signals' group meets here (on the device, in stream order), or the
    status records why not within timeout_s. signals [ep] int64 (a symmetric region, zeroed on
    every rank before first use), signal_offsets its peer table, sequence [1] int64 (zero on
    every rank at first), status [4] int64."""
    ep = signals.shape[0]
    barrier_kernel[(1,)](
        signals,
        signal_offsets,
        sequence,
        status,
        rank,
        ep,
        timeout_ns(timeout_s),
        wait_id,
        EP_BLOCK=max(2, triton.next_power_of_2(ep)),
        num_warps=1,
    )
