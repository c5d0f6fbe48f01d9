"""Start expert-parallel ranks on one machine: used by `mok bench` and the multi-rank tests.

`run_ranks(fn, world_size, args)` spawns one process per rank, initializes `torch.distributed` in
each (gloo on the CPU, NCCL with one GPU per rank), calls `fn(rank, world_size, *args)` and returns
the results by rank. A failing rank's traceback is raised in the caller; ranks still running are
stopped, so a failure never leaves the caller waiting.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Keep NVLink multicast off in every process (see docs: it can take a shared host's GPUs down).
MULTI_GPU_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1",
}


class RankFailedError(RuntimeError):
    """A rank raised or died; the message holds its traceback."""


def host_store(timeout_s: float) -> dist.TCPStore:
    """A rendezvous store listening on a free port of 127.0.0.1, served by this process.

    The caller holds the listening socket before any rank starts. Choosing a free port and letting
    rank 0 bind it later races: a rank retrying its connection to the not-yet-open port can be
    given that very port as its own source port and take it (seen as EADDRINUSE on rank 0).
    """
    return dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def init_rank(rank: int, world_size: int, backend: str, port: int, timeout_s: float) -> None:
    """Join the process group of `world_size` ranks through the store at 127.0.0.1:port."""
    for key, value in MULTI_GPU_ENV.items():
        os.environ.setdefault(key, value)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    else:
        # Ranks share the cores: one intra-op thread each avoids oversubscription.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs
    )


def init_from_env(backend: str, timeout_s: float = 600.0) -> None:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_*)."""
    for key, value in MULTI_GPU_ENV.items():
        os.environ.setdefault(key, value)
    kwargs = {}
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def _rank_main(rank, world_size, backend, port, timeout_s, fn, args, results):
    try:
        init_rank(rank, world_size, backend, port, timeout_s)
        # Gloo's mesh connects pair by pair: a rank whose pairs are up could finish a short `fn`
        # and close its sockets while another still handshakes ("Connection closed by peer").
        dist.barrier()
        # Plain pickle serializes tensors by value; torch's queue pickler would pass shared-memory
        # handles that die with this process.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn,
    world_size: int,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = 600.0,
) -> list:
    """Run fn(rank, world_size, *args) on `world_size` new processes; returns [result of rank r].

    `fn` and `args` must be picklable (a module-level function). Raises RankFailedError if a rank
    raises or dies, TimeoutError after `timeout_s` seconds.
    """
    for key, value in MULTI_GPU_ENV.items():
        os.environ.setdefault(key, value)
    context = mp.get_context("spawn")
    results = context.Queue()
    store = host_store(timeout_s)
    port = store.port
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, backend, port, timeout_s, fn, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    values: dict[int, object] = {}
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [
                    r
                    for r, p in enumerate(processes)
                    if r not in values and p.exitcode not in (None, 0)
                ]
                if dead:
                    raise RankFailedError(
                        f"rank {dead[0]} died with exit code {processes[dead[0]].exitcode}"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world_size)) - set(values))} did not finish "
                        f"within {timeout_s:.0f} s"
                    ) from None
                continue
            if not ok:
                raise RankFailedError(f"rank {rank} failed:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        # After a failure the others may wait in a collective for the failed rank: stop them now.
        for process in processes:
            process.join(timeout=10 if len(values) == world_size else 0)
            if process.is_alive():
                process.kill()
                process.join()
    return [values[rank] for rank in range(world_size)]
