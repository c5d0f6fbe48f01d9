"""The layer as `torch.library` custom ops, so that `torch.compile` keeps it in the graph.

    mok::moe_forward(workspace_id, need_backward, topk_idx, x, topk_weights, names, weights)
        -> (y [T, H], ticket [1] int64 on the CPU)
    mok::moe_backward(workspace_id, ticket, grad_y, topk_weights, names, weights)
        -> [grad x, grad topk_weights, grad of each weight]

(`weights`: the MoEWeights fields that are present, named by the comma-separated `names`; or
`gate_up` in place of gate and up: the [E, 2I, H] tensor whose halves they are, which then gets
one gradient)

with autograd registered (`torch.library.register_autograd`) and fake implementations that give
the outputs' shapes from the inputs'. The compiler sees two opaque nodes; what the layer keeps
from forward for backward (routing plans, saved activations: backend objects, not a fixed list of
tensors) stays on the host, in a table keyed by the ticket, a CPU tensor (reading it needs no
device synchronization). The entry lives as long as the ticket: autograd holds the ticket until
backward runs or the graph is freed, and the entry goes with it (`weakref.finalize`).

Both ops carry the `cudagraph_unsafe` tag: under `torch.compile(mode="reduce-overhead")` Inductor
runs them between its CUDA graphs (the host table above cannot live inside a graph replay); a whole
step captured by hand in one CUDA graph (`torch.cuda.graph`) replays them too.

Workspaces are named by an integer id (`register_workspace`): a Python object cannot be an
argument of a custom op. `mok.MoE` calls these ops while `torch.compile` traces it and its
autograd.Function (`mok.moe`) otherwise; both give the same results, and the compiled path hands
weight gradients to autograd (no fused accumulation into existing `.grad`).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch

from mok import functional
from mok.weights import MoEWeights, check_gate_up_halves, gate_up_halves, joined_gate_up

# Weak: a workspace lives as long as its layer holds it (its buffers are freed with it).
_workspaces: weakref.WeakValueDictionary[int, functional.Workspace] = weakref.WeakValueDictionary()
_saved: dict[int, tuple[functional.Schedule, functional.SavedForward]] = {}
_ids = itertools.count(1)
# CUDA-graph trees (`torch.compile(mode="reduce-overhead")`) must run both ops outside their
# graphs: a graph replay would not run the host code that fills and reads `_saved`, and the
# tensors held there are invisible to the trees' liveness tracking, which would hand their
# memory to the next graph while backward still needs them. Inductor partitions its graphs
# around ops with this tag; the rest of a model still replays from graphs.
_TAGS = (torch._C.Tag.cudagraph_unsafe,) if hasattr(torch._C.Tag, "cudagraph_unsafe") else ()


def register_workspace(workspace: functional.Workspace) -> int:
    """A new id the ops know `workspace` by (called once per workspace, when it is made)."""
    key = next(_ids)
    _workspaces[key] = workspace
    return key


@dataclasses.dataclass
class WorkspaceSlot:
    """A module's workspace and the id the ops know it by, held in the module's own attributes
    (what torch.compile reads and guards on). A deep copy or a pickle of the module gets an empty
    slot: a workspace's buffers and group belong to the module it was made for."""

    workspace: functional.Workspace | None = None
    workspace_id: int = 0

    def hold(self, workspace: functional.Workspace) -> functional.Workspace:
        """Keep `workspace` here under a new id; returns it."""
        self.workspace, self.workspace_id = workspace, register_workspace(workspace)
        return workspace

    def __deepcopy__(self, memo) -> WorkspaceSlot:
        return WorkspaceSlot()

    def __getstate__(self) -> dict:
        return {}  # pickled (torch.save of a whole model) empty, as deep-copied

    def __setstate__(self, state: dict) -> None:
        self.workspace, self.workspace_id = None, 0


GATE_UP = "gate_up"
"""The name of a weight list's [E, 2I, H] tensor whose halves are gate and up."""


def _weights(names: str, weights: list[torch.Tensor]) -> MoEWeights:
    named = dict(zip(names.split(","), weights, strict=True))
    if GATE_UP in named:
        named["gate"], named["up"] = gate_up_halves(named.pop(GATE_UP))
    return MoEWeights(**named)


def _weight_gradient(grads: MoEWeights, name: str) -> torch.Tensor:
    if name == GATE_UP:
        return joined_gate_up(grads.gate, grads.up)
    return getattr(grads, name)


@torch.library.custom_op("mok::moe_forward", mutates_args=(), tags=_TAGS)
def moe_forward(
    workspace_id: int,
    need_backward: bool,
    topk_idx: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    names: str,
    weights: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """y [T, H] of the layer, and a ticket that names what forward kept for backward. `names`:
    the MoEWeights fields `weights` holds, comma-separated (the others are absent)."""
    workspace = _workspaces[workspace_id]
    schedule, y, saved = functional.schedule_and_forward(
        workspace, topk_idx, x, topk_weights, _weights(names, weights), need_backward, graphs=True
    )
    key = next(_ids)
    ticket = torch.tensor([key], dtype=torch.int64)
    if saved is not None:
        _saved[key] = (schedule, saved)
        weakref.finalize(ticket, _saved.pop, key, None)
    return y, ticket


@moe_forward.register_fake
def _(workspace_id, need_backward, topk_idx, x, topk_weights, names, weights):
    return torch.empty_like(x), torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("mok::moe_backward", mutates_args=(), tags=_TAGS)
def moe_backward(
    workspace_id: int,
    ticket: torch.Tensor,
    grad_y: torch.Tensor,
    topk_weights: torch.Tensor,
    names: str,
    weights: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Gradients of x, topk_weights and of the weights `names`, from the forward of `ticket`."""
    schedule, saved = _saved.pop(int(ticket.item()))
    grads = functional.backward(_workspaces[workspace_id], schedule, saved, grad_y)
    named = (_weight_gradient(grads.weights, name) for name in names.split(","))
    return [grads.x, grads.topk_weights, *named]


@moe_backward.register_fake
def _(workspace_id, ticket, grad_y, topk_weights, names, weights):
    return [torch.empty_like(grad_y), torch.empty_like(topk_weights)] + [
        torch.empty_like(w) for w in weights
    ]


def _setup_context(ctx, inputs, output):
    workspace_id, _, _, _, topk_weights, names, weights = inputs
    _, ticket = output
    ctx.workspace_id = workspace_id
    ctx.names = names
    ctx.save_for_backward(ticket, topk_weights, *weights)
    ctx.mark_non_differentiable(ticket)


def _backward(ctx, grad_y, _grad_ticket):
    ticket, topk_weights, *weights = ctx.saved_tensors
    grads = moe_backward(
        ctx.workspace_id, ticket, grad_y.contiguous(), topk_weights, ctx.names, weights
    )
    grad_x, grad_topk_weights, *weight_grads = grads
    return None, None, None, grad_x, grad_topk_weights, None, weight_grads


torch.library.register_autograd("mok::moe_forward", _backward, setup_context=_setup_context)


def moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    workspace_id: int,
    gate_up: torch.Tensor | None = None,
) -> torch.Tensor:
    """`mok.moe` through the custom ops (what `torch.compile` traces): y [T, H]; gate_up as in
    `mok.moe` (while tracing, only its shapes are checked)."""
    present = {name: t for name, t in weights.tensors().items() if t is not None}
    if gate_up is not None:
        check_gate_up_halves(gate_up, weights, tracing=torch.compiler.is_compiling())
        del present["gate"], present["up"]
        present = {GATE_UP: gate_up, **present}
    need_backward = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, topk_weights, *present.values())
    )
    y, _ = moe_forward(
        workspace_id,
        need_backward,
        topk_idx,
        x,
        topk_weights,
        ",".join(present),
        list(present.values()),
    )
    return y
