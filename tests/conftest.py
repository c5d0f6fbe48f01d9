"""Shared test set-up: GPU tests are skipped without CUDA; hypothesis profiles (HYPOTHESIS_PROFILE:
ci, the default; dev; long)."""

import os
import time

import torch

# Without a GPU, Triton kernels run under the interpreter. It must be chosen before triton is
# imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from filelock import FileLock, Timeout  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=20, deadline=None)
# A fuzzing run to start by hand: fresh random examples each time, many of them.
settings.register_profile("long", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    """Under pytest-xdist, each worker's PyTorch (and the ranks it spawns) takes its share of the
    cores: by default every process takes them all, and a dozen workers then run the CPU-bound
    tests at a fraction of their speed."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = str(share)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        reason, marks = (
            "an interpreter test (TRITON_INTERPRET is set only without a GPU)",
            ["interpreter"],
        )
    else:
        reason, marks = "needs a CUDA GPU", ["gpu", "multigpu"]
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if any(mark in item.keywords for mark in marks):
            item.add_marker(skip)


def cached_gpu_bytes_kept() -> int:
    """What a worker's caching allocator may keep between tests: 4 GiB, or less where the
    workers' share of the GPU is smaller (a third of it: 14 workers on an 80 GB H100 kept 56 GiB
    at 4 GiB each, and three tests ran out of memory beside them)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = torch.cuda.get_device_properties(0).total_memory // (3 * workers)
    return min(4 << 30, share)


@pytest.fixture(autouse=True)
def release_cached_gpu_memory():
    """Under pytest-xdist on a GPU machine, hand the caching allocator's free blocks back to the
    driver after each test: a dozen workers each keeping the high-water mark of its largest test
    (10-27 GiB seen) left the ranks of a `shares_gpu` test no room to allocate their weights.
    Only a cache above `cached_gpu_bytes_kept()` is released: emptying it after every test made
    the next test allocate everything again from the driver."""
    yield
    if (
        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
        and torch.cuda.is_initialized()
        and torch.cuda.memory_reserved() > cached_gpu_bytes_kept()
    ):
        torch.cuda.empty_cache()


def gpu_sharing_slots() -> int:
    """How many `shares_gpu` tests may run at once across pytest-xdist's workers: 3 on an H200,
    2 on a GPU of less than 100 GiB. Their ranks hold 4-8 GiB of GPU memory each: a dozen workers
    running four such tests beside the others filled an H200's 140 GiB, and their kernels' first
    compiles outlasted the ranks' peer timeouts."""
    return 3 if torch.cuda.get_device_properties(0).total_memory >= 100 << 30 else 2


@pytest.fixture(autouse=True)
def gpu_sharing_slot(request, tmp_path_factory):
    """For a `shares_gpu` test on a GPU machine: hold one of `gpu_sharing_slots()` file locks, in
    the folder every xdist worker of this session shares, while the test runs."""
    if request.node.get_closest_marker("shares_gpu") is None or not torch.cuda.is_available():
        yield
        return
    folder = tmp_path_factory.getbasetemp().parent
    locks = [FileLock(folder / f"gpu-sharing-slot-{n}.lock") for n in range(gpu_sharing_slots())]
    while True:
        for lock in locks:
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue
            try:
                yield
            finally:
                lock.release()
            return
        time.sleep(0.5)
