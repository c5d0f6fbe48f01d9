"""A peer that never arrives: the NVLink exchange gives up after its timeout, `check()` raises
MoKTimeoutError naming the rank, the peer and the wait, and after `reset()` on every rank the next
call is exact. Two scenarios: a rank skips a call; a rank exits.

Run three ways, with the same rank workers:
  cpu       spawned gloo ranks, one shared file standing in for symmetric memory, the kernels
            under the Triton interpreter (CI);
  one-gpu   gloo ranks simulated on one GPU (buffers shared through CUDA IPC): the kernels
            compiled, with the GPU's timer and real cross-process flags;
  two-gpu   one GPU per rank, NCCL, PyTorch symmetric memory over NVLink.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

import mok
from mok.comm.layout import default_shape
from mok.comm.memory import StandInMemory, simulated_symmetric_memory
from mok.comm.symmetric import SymmetricExchange
from mok.errors import MoKTimeoutError
from mok.kernels.sync import INTERPRETER_SLOWDOWN
from mok.ranks import run_ranks
from mok.routing import make_routing
from mok.testing import (
    RankInputs,
    compare_with_reference,
    cuda_ipc_allocator,
    global_weights,
    shared_file_allocator,
)

WAIT_S = 2.0
"""How long, in seconds of wall time, a wait that times out lasts."""
TIMEOUT_S = WAIT_S if torch.cuda.is_available() else WAIT_S / INTERPRETER_SLOWDOWN
COMPILE_BOUND_S = 120.0
"""The peer timeout of the warm-up call that compiles the kernels on a GPU."""
HIDDEN, TOP_K, LOCAL_EXPERTS, TOKENS = 32, 2, 2, 24

WHERE = [
    pytest.param("cpu", marks=pytest.mark.interpreter),
    pytest.param("one-gpu", marks=[pytest.mark.gpu, pytest.mark.shares_gpu]),
    pytest.param(
        "two-gpu",
        marks=[
            pytest.mark.multigpu,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
        ],
    ),
]


def backend_of(where: str) -> str:
    return "nccl" if where == "two-gpu" else "gloo"


def device_and_allocator(where: str, rank: int, tmp: str):
    """This rank's device and the symmetric-memory allocator for `where` (None: the real one)."""
    if where == "cpu":
        return torch.device("cpu"), shared_file_allocator(tmp)
    if where == "one-gpu":
        return torch.device("cuda", 0), cuda_ipc_allocator
    return torch.device("cuda", rank), None


def make_exchange(
    where: str, rank: int, tmp: str, timeout_s: float = TIMEOUT_S
) -> SymmetricExchange:
    """This rank's exchange of 2 ranks (fp32 rows) for `where` (see the module docstring)."""
    device, allocate = device_and_allocator(where, rank, tmp)
    shape = default_shape(HIDDEN, TOP_K, LOCAL_EXPERTS, 2, TOKENS, dtype=torch.float32)
    return SymmetricExchange(
        dist.group.WORLD,
        shape,
        device,
        programs=2,
        memory=StandInMemory(allocate),
        timeout_s=timeout_s,
    )


def compile_kernels(where: str, rank: int, tmp: str) -> bool:
    """One call of a patient exchange (released after it), so that every kernel is compiled on
    both ranks before a timed call: with many test workers compiling at once, a peer's first call
    outlasts TIMEOUT_S (seen under 12 workers on one GPU). True if the call was clean."""
    patient = make_exchange(where, rank, tmp, timeout_s=COMPILE_BOUND_S)
    one_call(patient, rank, 0)
    clean = raised(patient) is None
    patient.release()
    return clean


def inputs(rank: int, call: int, device):
    generator = torch.Generator().manual_seed(10 * call + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    idx, w = make_routing("uniform", TOKENS, 2 * LOCAL_EXPERTS, TOP_K, generator)
    return x.to(device), idx.to(device), w.to(device)


def one_call(exchange: SymmetricExchange, rank: int, call: int):
    """(y, the exact y) of one exchange call whose 'expert' doubles its rows: y[t] must be the fp32
    sum over j, in order, of w[t, j] * 2 x[t], whichever rank computed each term."""
    x, idx, w = inputs(rank, call, exchange.device)
    routing = exchange.route(idx)
    grouped = exchange.dispatch(routing, x)
    exchange.expert_output_buffer().copy_(grouped * 2)
    y, _ = exchange.combine(routing, exchange.expert_output_buffer(), w, save_pair_out=False)
    want = torch.zeros_like(x)
    for j in range(TOP_K):
        want = want + w[:, j, None] * (2 * x)
    return y, want


def raised(exchange: SymmetricExchange) -> str | None:
    try:
        exchange.check()
    except MoKTimeoutError as error:
        return str(error)
    return None


def skip_a_call(rank, world, where, tmp):
    """Both make call 0; rank 1 skips call 1; both make call 2; both reset; both make call 3."""
    outcome = {"clean compiling call": compile_kernels(where, rank, tmp)}
    exchange = make_exchange(where, rank, tmp)
    one_call(exchange, rank, 0)
    outcome["clean first call"] = raised(exchange) is None
    dist.barrier()
    if rank == 0:
        start = time.monotonic()
        one_call(exchange, rank, 1)
        outcome["skipped"] = raised(exchange)
        outcome["seconds"] = time.monotonic() - start
    dist.barrier()  # rank 1 holds back until rank 0 has given up on call 1
    one_call(exchange, rank, 2)
    outcome["after"] = raised(exchange)
    exchange.reset()
    y, want = one_call(exchange, rank, 3)
    outcome["exact after reset"] = torch.equal(y, want)
    outcome["clean after reset"] = raised(exchange) is None
    return outcome


def exit_early(rank, world, where, tmp):
    """Rank 1 exits after creating the exchange; rank 0 makes two calls."""
    compile_kernels(where, rank, tmp)
    exchange = make_exchange(where, rank, tmp)
    if rank == 1:
        return None
    first = time.monotonic()
    one_call(exchange, rank, 1)
    message = raised(exchange)
    second = time.monotonic()
    y, _ = one_call(exchange, rank, 2)
    raised(exchange)
    third = time.monotonic()
    usable = bool(torch.isfinite(y).all()) and float(torch.ones(8, device=y.device).sum()) == 8
    return {"message": message, "first": second - first, "second": third - second, "usable": usable}


@pytest.mark.parametrize("where", WHERE)
def test_a_rank_that_skips_a_call(where, tmp_path):
    """Catches: a wait without a bound (the test would hang), a timeout not raised or naming the
    wrong rank or wait, a diverged peer not noticed on the other rank, a reset that leaves stale
    flags or sequence numbers (the call after it would fail or be wrong)."""
    first, second = run_ranks(
        skip_a_call, 2, args=(where, str(tmp_path)), backend=backend_of(where), timeout_s=300
    )
    for outcome in (first, second):
        assert outcome["clean compiling call"] and outcome["clean first call"], outcome
    assert (
        "rank 0 gave up waiting for rank 1 at 'route: every rank's counts written'"
        in (first["skipped"])
    )
    assert first["seconds"] >= WAIT_S
    assert first["after"] == first["skipped"]  # kept until reset
    assert "rank 1 found rank 0 out of step" in second["after"]
    for outcome in (first, second):
        assert outcome["exact after reset"] and outcome["clean after reset"], outcome


@pytest.mark.parametrize("where", WHERE)
def test_a_rank_that_exits(where, tmp_path):
    """Catches: a survivor hanging on a dead peer, paying a full timeout on every later wait, or
    losing its device (a trap would kill the CUDA context)."""
    survivor, _ = run_ranks(
        exit_early, 2, args=(where, str(tmp_path)), backend=backend_of(where), timeout_s=300
    )
    assert "rank 0 gave up waiting for rank 1" in survivor["message"]
    assert survivor["first"] >= WAIT_S
    assert survivor["second"] < survivor["first"]
    assert survivor["usable"]


@contextlib.contextmanager
def warm_layer(where: str, rank: int, world: int, tmp: str, **options):
    """The triton backend's layer on this rank over the NVLink exchange of `where` (peer timeout
    TIMEOUT_S; MoKConfig `options` added), its weights of all experts and every rank's inputs,
    after one healthy call has compiled every kernel on both ranks (a peer compiling for seconds
    while the other waits is not what the timeout is about). Yields (layer, weights, inputs,
    the healthy call's errors against the reference)."""
    device, allocate = device_and_allocator(where, rank, tmp)
    simulated = (
        contextlib.nullcontext() if allocate is None else simulated_symmetric_memory(allocate)
    )
    config = mok.MoKConfig(
        hidden_size=32,
        intermediate_size=16,
        num_experts=4,
        top_k=2,
        backend="triton",
        max_tokens_per_rank=TOKENS,
        peer_timeout_s=TIMEOUT_S,
        **options,
    )
    with simulated:
        full = global_weights(config, 0, device)
        everyone = []
        for r in range(world):
            x, idx, w = inputs(r, 7, device)
            grad_y = torch.randn(TOKENS, 32, generator=torch.Generator().manual_seed(r))
            everyone.append(RankInputs(x.to(torch.bfloat16), idx, w, grad_y.to(device).bfloat16()))
        if device.type == "cuda":
            # Compile on both ranks first under a bound no compile outlasts: with many test
            # workers compiling at once, a peer's first call can take longer than TIMEOUT_S.
            patient = config.replace(peer_timeout_s=COMPILE_BOUND_S)
            compiling = mok.MoE(patient, group=dist.group.WORLD, device=device)
            compiling.load_global_weights(full)
            compare_with_reference(compiling, full, everyone, rank)
            compiling.workspace(device).check()
        layer = mok.MoE(config, group=dist.group.WORLD, device=device)
        layer.load_global_weights(full)
        warm_up = compare_with_reference(layer, full, everyone, rank)
        layer.workspace(device).check()
        yield layer, full, everyone, warm_up


def reset_through_the_workspace(rank, world, where, tmp):
    """The layer's path: a wait that failed in the triton backend's exchange is raised by
    Workspace.check(), Workspace.reset() on every rank recovers it, and the layer's next call
    matches the reference."""
    with warm_layer(where, rank, world, tmp, shared_intermediate_size=16) as warm:
        layer, full, everyone, warm_up = warm
        workspace = layer.workspace(everyone[rank].x.device)
        dist.barrier()
        if rank == 0:  # a routing rank 1 never takes part in
            workspace.backend.exchange.route(everyone[0].topk_idx)
        dist.barrier()
        try:
            workspace.check()
            message = None
        except MoKTimeoutError as error:
            message = str(error)
        workspace.reset()
        errors = compare_with_reference(layer, full, everyone, rank)
        workspace.check()
    return message, errors, warm_up


@pytest.mark.parametrize("where", WHERE)
def test_workspace_check_and_reset(where, tmp_path):
    """Catches: a backend whose check() does not reach the exchange's status, a reset that does not
    reach the exchange (the call after it would fail or differ from the reference)."""
    first, second = run_ranks(
        reset_through_the_workspace,
        2,
        args=(where, str(tmp_path)),
        backend=backend_of(where),
        timeout_s=300,
    )
    assert "rank 0 gave up waiting for rank 1" in first[0]
    assert second[0] is None
    for _, errors, warm_up in (first, second):
        assert max(errors.values()) < 2e-2, errors
        assert max(warm_up.values()) < 2e-2, warm_up
