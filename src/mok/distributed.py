"""Small `torch.distributed` helpers shared by the reference, the communication layer and the tests.

Every helper accepts `group=None` for a single process (no communication at all).
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from mok.errors import MoKInputError


def expert_parallel_group(group) -> dist.ProcessGroup | None:
    """The process group of `group`: a ProcessGroup or None as is, a one-dimensional DeviceMesh
    (e.g. `mesh["ep"]` of a data x expert mesh) as its group."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise MoKInputError(
                f"the expert-parallel mesh must have one dimension, got {group.ndim} "
                f"({group.mesh_dim_names}): pass the expert dimension, e.g. mesh['ep']"
            )
        return group.get_group()
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a ProcessGroup, a one-dimensional DeviceMesh or None, got "
            f"{type(group).__name__}"
        )
    return group


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank in group, group size); (0, 1) without a group."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where the group's backend wants the tensors of small control collectives."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_rows(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Stack the equally long 1-D vectors of all ranks: returns [ep, n] on values' device.

    Runs on the group's device (no host synchronization when values already live there). The
    vectors must have equal length on every rank; callers exchange a fixed-size header first when
    that is not certain.
    """
    values = values.reshape(-1)
    if group is None:
        return values.unsqueeze(0)
    local = values.to(collective_device(group))
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return torch.stack(gathered).to(values.device)


def all_gather_int64(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`all_gather_rows` of integer vectors, as [ep, n] int64 on the CPU (a host synchronization:
    the result is needed on the host)."""
    return all_gather_rows(values.to(torch.int64), group).cpu()


_GLOO_TWINS: dict[str, dist.ProcessGroup] = {}


def gloo_twin(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo process group of the same ranks as `group`, built from the default store under a
    prefix of its own, so that only the group's ranks take part (`dist.new_group` would need every
    rank of the world). Collective over `group` the first time; cached per group."""
    name = group.group_name
    if name not in _GLOO_TWINS:
        store = dist.PrefixStore(f"mok-gloo/{name}", dist.distributed_c10d._get_default_store())
        _GLOO_TWINS[name] = dist.ProcessGroupGloo(
            store, dist.get_rank(group), dist.get_world_size(group)
        )
    return _GLOO_TWINS[name]


def control_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """Where host-side agreements (which rank rejected its input) run: `group` when it is gloo,
    else its gloo twin, so that agreeing never synchronizes the host with a GPU."""
    if group is None or group.name() == "gloo":  # name(): also for groups c10d does not list
        return group
    return gloo_twin(group)


def host_names(group: dist.ProcessGroup | None) -> list[str]:
    """The host name of every rank of `group` (collective, on the CPU over `control_group`)."""
    name = socket.gethostname()
    if group is None:
        return [name]
    control = control_group(group)
    encoded = torch.zeros(_HOST_NAME_BYTES, dtype=torch.uint8)
    raw = name.encode()[:_HOST_NAME_BYTES]
    encoded[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    gathered = [torch.empty_like(encoded) for _ in range(control.size())]
    control.allgather([gathered], [encoded]).wait()
    return [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in gathered]


_HOST_NAME_BYTES = 256


def raise_if_any_rank_failed(problem: str | None, group: dist.ProcessGroup | None) -> None:
    """Collective: every rank raises MoKInputError if any rank found a problem with its input.

    Ranks must reach every later collective together or not at all; a rank that raised alone would
    leave the others waiting forever. The rank with the problem raises its own message; the others
    name the ranks that failed. Runs on the CPU over `control_group(group)`: no GPU sync.
    """
    if group is None:
        if problem is not None:
            raise MoKInputError(problem)
        return
    agree_or_raise(problem, control_group(group))


def agree_or_raise(problem: str | None, control: dist.ProcessGroup) -> None:
    """`raise_if_any_rank_failed` over a CPU (gloo) process group, e.g. a `gloo_twin`."""
    flag = torch.tensor([int(problem is not None)])
    flags = [torch.empty_like(flag) for _ in range(control.size())]
    control.allgather([flags], [flag]).wait()
    if problem is not None:
        raise MoKInputError(problem)
    failed = [rank for rank, value in enumerate(flags) if int(value)]
    if failed:
        raise MoKInputError(
            f"rank(s) {failed} of the expert-parallel group rejected their input (their error says "
            "why); this rank stops too, so that no rank waits for the others forever"
        )


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` of rows with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return _all_to_all_rows(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad_rows):
        output_splits, input_splits = ctx.splits
        grad = _all_to_all_rows(grad_rows, input_splits, output_splits, ctx.group)
        return grad, None, None, None


def _all_to_all_rows(rows, output_splits, input_splits, group):
    output = rows.new_empty((sum(output_splits),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(
        output, rows.contiguous(), list(output_splits), list(input_splits), group=group
    )
    return output


def all_to_all(
    rows: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Send rows[sum(input_splits[:r]) : ...] to rank r; receive output_splits[r] rows from rank r.

    rows: [sum(input_splits), ...]; returns [sum(output_splits), ...] ordered by source rank.
    Differentiable. Without a group the rows are returned as they are.
    """
    if group is None:
        return rows
    return _AllToAll.apply(rows, list(output_splits), list(input_splits), group)
