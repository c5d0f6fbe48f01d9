"""The functional API: config -> workspace -> schedule -> forward -> backward.

    ws = mok.create_workspace(config, group)          # once per layer shape and group (collective)
    schedule = mok.build_schedule(ws, topk_idx)       # once per routing (collective)
    y, saved = mok.forward(ws, schedule, x, topk_weights, weights)
    # or both at once, with one input agreement: mok.schedule_and_forward(ws, topk_idx, ...)
    grads = mok.backward(ws, schedule, saved, grad_y) # a mok.MoEGradients

Every call is collective over the workspace's expert-parallel group: all ranks make the same calls
in the same order. Inputs are validated on every rank, and a bad input on any rank raises
MoKInputError on all of them (never a hang).
"""

from __future__ import annotations

import dataclasses
import struct
import weakref

import torch
import torch.distributed as dist

from mok.backends import select_backend
from mok.backends.protocol import LayerBackend
from mok.comm.memory import symmetric_memory
from mok.config import MoKConfig, Validation
from mok.distributed import (
    all_gather_int64,
    collective_device,
    expert_parallel_group,
    group_rank_and_size,
    raise_if_any_rank_failed,
)
from mok.errors import MoKInputError
from mok.graphs import GraphCache, GraphedState, call_key, captures
from mok.validation import (
    check_accumulation_buffers,
    check_grad_output,
    check_routing,
    check_tokens,
    check_weights,
)
from mok.weights import MoEGradients, MoEWeights


@dataclasses.dataclass(eq=False)
class Workspace:
    """Everything a layer keeps between calls: config, group, device and the backend's buffers."""

    config: MoKConfig
    group: dist.ProcessGroup | None
    device: torch.device
    rank: int
    ep_size: int
    local_experts: int
    backend: LayerBackend | None = dataclasses.field(repr=False, default=None)
    graphs: GraphCache | None = dataclasses.field(repr=False, default=None)
    """The calls captured in CUDA graphs (`MoKTuning.graphs`); None where nothing is."""
    accepted_inputs: tuple | None = dataclasses.field(repr=False, default=None)
    """The `call_key` of the last call whose inputs passed the host checks."""

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def check(self) -> None:
        """Raise what the backend detected on the device since the last check: a wait on another
        rank that failed (MoKTimeoutError: call `reset()` on every rank), expert ids outside
        [0, E) (MoKInputError) or a receive buffer too small (MoKCapacityError). Synchronizes with
        the host; call it where the training loop synchronizes anyway (e.g. logging the loss).
        Every rank holds the same verdict for capacity; an id error is raised on its own rank."""
        _live(self).backend.check()

    def reset(self) -> None:
        """Make the workspace usable again after `check()` raised MoKTimeoutError. Collective: every
        rank calls it together (it meets the other ranks on the host)."""
        _live(self).backend.reset()

    def release(self) -> None:
        """Free the backend's buffers; the workspace cannot be used afterwards."""
        self.graphs = None  # their kernels read the backend's buffers
        if self.backend is not None:
            self.backend.release()
            self.backend = None


@dataclasses.dataclass(eq=False)
class Schedule:
    """The routing of one call: built from topk_idx, reused by forward and backward."""

    num_tokens: int
    topk_idx: torch.Tensor
    routing: object = dataclasses.field(repr=False)
    """The backend's routing (`LayerBackend.route`)."""


@dataclasses.dataclass(eq=False)
class SavedForward:
    """What forward keeps for backward (backend-specific)."""

    num_tokens: int
    saved: object = dataclasses.field(repr=False)


def resolve_device(device) -> torch.device:
    """torch.device(device), with the current CUDA device filled in for a bare "cuda"."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _config_fields(config) -> list[tuple[str, dataclasses.Field, object]]:
    """(dotted name, field, value) of every leaf field of `config`, `tuning`'s fields included
    ("tuning.comm_sms")."""
    leaves = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            nested = _config_fields(value)
            leaves += [(f"{field.name}.{name}", f, v) for name, f, v in nested]
        else:
            leaves.append((field.name, field, value))
    return leaves


def _config_fingerprint(config: MoKConfig) -> list[tuple[str, int]]:
    """(field, value as int64) for every config field: what ranks compare to agree on it."""
    fields = []
    for name, _, value in _config_fields(config):
        if value is None:
            encoded = -1
        elif isinstance(value, float):
            encoded = struct.unpack("<q", struct.pack("<d", value))[0]
        elif hasattr(value, "value"):  # enums
            encoded = [member for member in type(value)].index(value)
        else:
            encoded = int(value)
        fields.append((name, encoded))
    return fields


def _config_value(config: MoKConfig, name: str, encoded: int):
    """The config value a rank's `_config_fingerprint` entry stands for (to print it)."""
    field, current = next((f, v) for n, f, v in _config_fields(config) if n == name)
    annotation = str(field.type)
    if encoded == -1 and "None" in annotation:
        return None
    if annotation == "bool":
        return bool(encoded)
    if annotation.startswith("float"):
        return struct.unpack("<d", struct.pack("<q", encoded))[0]
    if hasattr(current, "value"):  # enums
        return list(type(current))[encoded].value
    return encoded


def create_workspace(
    config: MoKConfig,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> Workspace:
    """A workspace for `config` on `device` over the expert-parallel `group` (None: one process;
    a one-dimensional DeviceMesh: its group).

    Collective over `group`: checks that every rank has the same config. `device` defaults to the
    current CUDA device for NCCL groups and to the CPU otherwise.
    """
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config must be a mok.MoKConfig, got {type(config).__name__}")
    group = expert_parallel_group(group)
    rank, ep_size = group_rank_and_size(group)
    if device is None:
        device = torch.device("cpu") if group is None else collective_device(group)
    device = resolve_device(device)
    problem = None
    try:
        local_experts = config.local_experts(ep_size)
    except ValueError as error:
        problem, local_experts = str(error), 0
    if problem is None and group is not None:
        backend = dist.get_backend(group)
        if backend == "nccl" and device.type != "cuda":
            problem = f"the group uses NCCL, which moves CUDA tensors only, but device is {device}"
        elif backend == "gloo" and not symmetric_memory().carries(backend, device):
            problem = f"the group uses gloo; use an NCCL group for tensors on {device}"
    raise_if_any_rank_failed(problem, group)
    if group is not None:
        fingerprint = _config_fingerprint(config)
        everyone = all_gather_int64(torch.tensor([v for _, v in fingerprint]), group)
        differing = [
            f"{name}: "
            + ", ".join(
                f"rank {r} {_config_value(config, name, v)!r}"
                for r, v in enumerate(everyone[:, i].tolist())
            )
            for i, (name, _) in enumerate(fingerprint)
            if not bool((everyone[:, i] == everyone[0, i]).all())
        ]
        if differing:
            raise MoKInputError(
                "the ranks of the expert-parallel group have different configs ("
                + "; ".join(differing)
                + ")"
            )
    workspace = Workspace(
        config=config,
        group=group,
        device=device,
        rank=rank,
        ep_size=ep_size,
        local_experts=local_experts,
    )
    workspace.backend = select_backend(config, device, group)(workspace)
    if device.type == "cuda" and workspace.backend_name != "reference":
        workspace.graphs = _graph_cache(workspace)
    return workspace


def _graph_cache(ws: Workspace) -> GraphCache:
    """The workspace's captured calls: the unchecked calls below, replayed (`mok.graphs`). It
    refers to the workspace weakly (the workspace holds it)."""
    workspace = weakref.ref(ws)

    def run_forward(*args):
        return _schedule_and_forward(workspace(), *args)

    def run_backward(*args):
        return _backward(workspace(), *args)

    def wanted(num_tokens: int) -> bool:
        live = workspace()
        return captures(live.config, live.local_experts, live.ep_size, num_tokens)

    return GraphCache(run_forward, run_backward, wanted)


def _live(workspace: Workspace) -> Workspace:
    if not isinstance(workspace, Workspace):
        raise TypeError(f"expected a mok.Workspace, got {type(workspace).__name__}")
    if workspace.backend is None:
        raise RuntimeError("this workspace was released")
    return workspace


def _raise_if_rejected(ws: Workspace, problem: str | None) -> None:
    """Raise MoKInputError for a problem with this rank's input: on every rank when the config's
    validation is collective (one agreement of the ranks), on this rank alone when local."""
    if ws.config.validation is Validation.COLLECTIVE:
        raise_if_any_rank_failed(problem, ws.group)
    elif problem is not None:
        if ws.group is not None:
            problem += (
                " (validation='local': only this rank raises; the others' exchange waits for it "
                "until their peer timeout or the process group's)"
            )
        raise MoKInputError(problem)


def _routing_problem(ws: Workspace, topk_idx) -> str | None:
    on_device = ws.backend.checks_ids_on_device
    problem = check_routing(ws.config, topk_idx, ws.device, check_ids=not on_device)
    max_tokens = ws.backend.max_tokens
    if problem is None and max_tokens is not None and topk_idx.shape[0] > max_tokens:
        problem = (
            f"topk_idx has {topk_idx.shape[0]} tokens, more than max_tokens_per_rank={max_tokens} "
            f"that sizes the {ws.backend_name} backend's buffers; raise it in the MoKConfig"
        )
    return problem


def _forward_problem(ws: Workspace, num_tokens: int, x, topk_weights, weights) -> str | None:
    problem = check_tokens(ws.config, x, topk_weights, num_tokens, ws.device)
    return problem or check_weights(ws.config, weights, ws.local_experts, ws.device)


def _schedule(ws: Workspace, topk_idx: torch.Tensor) -> Schedule:
    return Schedule(
        num_tokens=topk_idx.shape[0],
        topk_idx=topk_idx,
        routing=ws.backend.route(topk_idx),
    )


def _compute_precision(ws: Workspace):
    """The context of a backend's forward or backward: autocast off, whatever the caller's (the
    layer's precision is its config's; autocast's casting stops at its inputs, which
    `mok.module.cast_for_autocast` casts)."""
    return torch.autocast(ws.device.type, enabled=False)


def _schedule_and_forward(ws, topk_idx, x, topk_weights, weights, need_backward):
    """(schedule, y, saved) of a call whose inputs were checked."""
    schedule = _schedule(ws, topk_idx)
    return (schedule, *_forward(ws, schedule, x, topk_weights, weights, need_backward))


def _backward(ws, schedule, saved, grad_y, into) -> MoEGradients:
    """The gradients of a call whose inputs were checked, launched (not replayed)."""
    with _compute_precision(ws):
        return ws.backend.backward(schedule.routing, saved.saved, grad_y, into)


def _forward(ws, schedule, x, topk_weights, weights, need_backward):
    with _compute_precision(ws):
        y, saved = ws.backend.forward(
            schedule.routing, schedule.topk_idx, x, topk_weights, weights, need_backward
        )
    return y, None if saved is None else SavedForward(schedule.num_tokens, saved)


def build_schedule(workspace: Workspace, topk_idx: torch.Tensor) -> Schedule:
    """The routing of one call from topk_idx [T, k] (global expert ids). Collective.

    T may differ between ranks and may be 0.
    """
    ws = _live(workspace)
    _raise_if_rejected(ws, _routing_problem(ws, topk_idx))
    return _schedule(ws, topk_idx)


def forward(
    workspace: Workspace,
    schedule: Schedule,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    need_backward: bool = True,
) -> tuple[torch.Tensor, SavedForward | None]:
    """y [T, H] bf16 of the layer on x [T, H] bf16 with router weights topk_weights [T, k].

    `weights` holds this rank's experts (see MoEWeights). Returns (y, saved); saved is None when
    need_backward is False. Collective.
    """
    ws = _live(workspace)
    problem = _forward_problem(ws, schedule.num_tokens, x, topk_weights, weights)
    _raise_if_rejected(ws, problem)
    return _forward(ws, schedule, x, topk_weights, weights, need_backward)


def schedule_and_forward(
    workspace: Workspace,
    topk_idx: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    need_backward: bool = True,
    graphs: bool = False,
) -> tuple[Schedule, torch.Tensor, SavedForward | None]:
    """`build_schedule` then `forward`, with one agreement of the ranks on all inputs instead of
    two (each is a round trip between the hosts). Returns (schedule, y, saved). Collective.

    graphs: the call may replay a CUDA graph where `MoKTuning.graphs` says so (`mok.graphs`;
    `mok.MoE` and `mok.moe` ask for it). The schedule and saved state of a replayed call then
    serve its own backward only: the next replay rewrites them."""
    ws = _live(workspace)
    inputs = call_key(topk_idx, x, topk_weights, weights)
    # The host checks read no values where the device checks the expert ids: inputs like the
    # last accepted call's pass them again.
    if inputs is None or inputs != ws.accepted_inputs or not ws.backend.checks_ids_on_device:
        problem = _routing_problem(ws, topk_idx)
        if problem is None:
            problem = _forward_problem(ws, topk_idx.shape[0], x, topk_weights, weights)
        ws.accepted_inputs = inputs if problem is None else None
    else:
        problem = None
    _raise_if_rejected(ws, problem)
    if graphs and ws.graphs is not None and inputs is not None:
        replayed = ws.graphs.forward(topk_idx, x, topk_weights, weights, need_backward, inputs)
        if replayed is not None:
            return replayed
    return _schedule_and_forward(ws, topk_idx, x, topk_weights, weights, need_backward)


def backward(
    workspace: Workspace,
    schedule: Schedule,
    saved: SavedForward,
    grad_y: torch.Tensor,
    accumulate_into: dict[str, torch.Tensor] | None = None,
) -> MoEGradients:
    """Gradients of sum(y * grad_y) for x, topk_weights and every weight. Collective.

    accumulate_into: weight name -> an existing gradient buffer (contiguous, fp32 or bf16, the
    weight's shape; e.g. a parameter's `.grad` or an fp32 `main_grad`): that weight's gradient is
    ADDED into the buffer in place and the buffer is returned in its place. The triton backend adds
    inside its weight-gradient kernels (fp32 sum of the old value and the fp32 gradient, rounded
    once to the buffer's dtype; no extra pass); the reference backend adds its bf16 gradient
    afterwards (rounded once more)."""
    ws = _live(workspace)
    into = accumulate_into or {}
    if saved is None:
        problem = "backward needs the state of a forward run with need_backward=True"
    else:
        problem = check_grad_output(grad_y, saved.num_tokens, ws.config, ws.device)
    if problem is None:
        problem = check_accumulation_buffers(ws.config, into, ws.local_experts, ws.device)
    _raise_if_rejected(ws, problem)
    if isinstance(saved.saved, GraphedState):
        return ws.graphs.backward(saved.saved, grad_y, into)
    return _backward(ws, schedule, saved, grad_y, into)


__all__ = [
    "SavedForward",
    "Schedule",
    "Workspace",
    "backward",
    "build_schedule",
    "create_workspace",
    "forward",
    "schedule_and_forward",
]
