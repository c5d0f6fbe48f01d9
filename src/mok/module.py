"""Autograd entry point (`mok.moe`) and the `nn.Module` (`mok.MoE`) that owns the weights."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mok import functional, ops, tree
from mok.config import MoKConfig
from mok.distributed import expert_parallel_group, group_rank_and_size
from mok.errors import MoKInputError
from mok.validation import GRADIENT_BUFFER_DTYPES, expected_weight_shapes
from mok.weights import (
    ROUTED_FIELDS,
    WEIGHT_FIELDS,
    MoEWeights,
    check_gate_up_halves,
    gate_up_halves,
    joined_gate_up,
)


def accumulation_target(weight: torch.Tensor | None) -> torch.Tensor | None:
    """Where the layer adds `weight`'s gradient itself in this backward, or None (autograd gets
    it), only if this backward accumulates into the weight at all (not under
    `torch.autograd.grad`, nor for a `backward(inputs=...)` that leaves it out):
    - `weight.main_grad` when set (a Megatron-style buffer): it must be a contiguous fp32 or bf16
      tensor of the weight's shape and device, else the backward raises MoKInputError on every
      rank (handing the gradient to autograd instead would leave main_grad silently stale);
    - else `weight.grad` when it is such a tensor (otherwise autograd adds, as it would anyway)."""
    if weight is None or not weight.requires_grad or not weight.is_leaf:
        return None
    main_grad = getattr(weight, "main_grad", None)
    buffer = main_grad if main_grad is not None else weight.grad
    if main_grad is None and (
        buffer is None
        or buffer.shape != weight.shape
        or not buffer.is_contiguous()
        or buffer.dtype not in GRADIENT_BUFFER_DTYPES
    ):
        return None
    # Asked only where there is a buffer to add into (the query costs ~10 us of host time).
    try:
        accumulates = torch._C._will_engine_execute_node(
            torch.autograd.graph.get_gradient_edge(weight).node
        )
    except RuntimeError:  # torch.autograd.grad(..., inputs=[weight]): it never touches .grad
        accumulates = False
    # A main_grad is checked by functional.backward, which raises on every rank.
    return buffer if accumulates else None


def cast_for_autocast(
    x: torch.Tensor, weights: MoEWeights, dtype: torch.dtype
) -> tuple[torch.Tensor, MoEWeights]:
    """(x, weights) with every floating-point tensor of another dtype cast to `dtype` where
    autocast is on for x's device with `dtype` (as autocast casts a matmul's operands), else as
    given. Mixed precision with fp32 parameters: the layer computes in `dtype`, and autograd
    returns each gradient through the cast in its parameter's or input's dtype."""
    if not isinstance(x, torch.Tensor):
        return x, weights
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type) or torch.get_autocast_dtype(device_type) != dtype:
        return x, weights

    def cast(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            return tensor.to(dtype)
        return tensor

    fields = {name: cast(getattr(weights, name)) for name in WEIGHT_FIELDS}
    return cast(x), MoEWeights(**fields)


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are set (non-reentrant activation checkpointing, offloading
    to the CPU): they then decide what a saved tensor costs until backward."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        workspace,
        fuse_accumulation,
        grad_enabled,
        topk_idx,
        x,
        topk_weights,
        gate_up,
        *weight_tensors,
    ):
        weights = MoEWeights(*weight_tensors)
        if gate_up is not None:
            # gate and up came as None: their gradient goes to gate_up whole.
            gate, up = gate_up_halves(gate_up)
            weights = dataclasses.replace(weights, gate=gate, up=up)
        # needs_input_grad says which inputs require grad even under torch.no_grad(), where no
        # backward can follow: the caller's grad mode decides.
        need_backward = grad_enabled and any(ctx.needs_input_grad[4:])
        hooked = need_backward and _saved_tensor_hooks_active()
        # Under saved-tensor hooks the call launches its kernels: a graph's saved state stays in
        # the graph's memory, out of the hooks' reach.
        schedule, y, saved = functional.schedule_and_forward(
            workspace, topk_idx, x, topk_weights, weights, need_backward, graphs=not hooked
        )
        ctx.workspace, ctx.state = workspace, (schedule, saved)
        ctx.tensors_taken = saved is not None and hooked
        if ctx.tensors_taken:
            # The forward's tensors go through the hooks (non-reentrant checkpointing drops them
            # and recomputes the layer in backward; offloading moves them): held in ctx.state,
            # they would stay in memory until backward whatever the hooks say.
            tensors: list[torch.Tensor] = []
            ctx.state = tree.take_tensors(ctx.state, tensors)
            ctx.save_for_backward(*tensors)
        ctx.weight_tensors = weight_tensors if fuse_accumulation else None
        ctx.gate_up = gate_up if fuse_accumulation else None
        ctx.joined_gate_up = gate_up is not None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        workspace = ctx.workspace
        # Walking the state costs ~0.3 ms of host time: only where the forward took its tensors.
        state = tree.put_tensors(ctx.state, ctx.saved_tensors) if ctx.tensors_taken else ctx.state
        schedule, saved = state
        ctx.state = None  # frees the saved forward as soon as it is used
        into = {}
        if ctx.weight_tensors is not None:
            for name, weight in zip(WEIGHT_FIELDS, ctx.weight_tensors, strict=True):
                buffer = accumulation_target(weight)
                if buffer is not None:
                    into[name] = buffer
            buffer = accumulation_target(ctx.gate_up)
            if buffer is not None:
                # The kernels add gate's and up's gradients into the halves of gate_up's (a
                # main_grad of another shape is passed whole: functional.backward rejects it).
                halves = gate_up_halves(buffer) if buffer.dim() == 3 else (buffer, buffer)
                into["gate"], into["up"] = halves
        grads = functional.backward(workspace, schedule, saved, grad_y, accumulate_into=into)
        # A weight whose gradient went into its buffer gets none from autograd (no extra pass).
        weight_grads = [
            None if name in into else getattr(grads.weights, name) for name in WEIGHT_FIELDS
        ]
        grad_gate_up = None
        if ctx.joined_gate_up:
            if "gate" not in into:
                grad_gate_up = joined_gate_up(grads.weights.gate, grads.weights.up)
            weight_grads[:2] = None, None
        return (None, None, None, None, grads.x, grads.topk_weights, grad_gate_up, *weight_grads)


# Dynamo never traces this call: the layer's host-side Python (its checks, the group's agreement)
# cannot be in a graph, and where torch.compile ran a frame eagerly, tracing into it failed at
# EP > 1. Compiled models reach the layer through `mok.ops` instead.
@torch.compiler.disable
def moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    workspace: functional.Workspace,
    fuse_grad_accumulation: bool = True,
    gate_up: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE layer as one differentiable call: y [T, H] from x [T, H], topk_idx [T, k],
    topk_weights [T, k] and this rank's weights. Collective over the workspace's group; every rank
    must run backward when one does.

    gate_up: the [E, 2I, H] tensor whose halves along dim 1 are weights.gate and weights.up, as
    Hugging Face models hold them (`gate_up_proj`): the layer reads its halves and autograd
    receives one gradient for it, written by the kernels as one tensor (no concatenation, and
    none of autograd's passes that scatter the two halves' gradients into it). Where gate_up
    already has a gradient buffer, the kernels add into its halves, as below.

    fuse_grad_accumulation: where a weight already has a gradient buffer (`main_grad`, else
    `.grad`; see `accumulation_target`), backward adds the new gradient into it in place (inside
    the weight-gradient kernels of the triton backend) instead of handing it to autograd, which
    would add it in a separate pass. The values are autograd's up to rounding (one rounding of the
    fp32 sum instead of two). Autograd receives no gradient for those weights: their tensor hooks
    see None, and their post-accumulate-grad hooks still run, after the layer has added (they see
    the summed `.grad`, as DDP-like wrappers need)."""
    if not isinstance(weights, MoEWeights):
        raise MoKInputError(f"weights must be a mok.MoEWeights, got {type(weights).__name__}")
    if gate_up is not None:
        check_gate_up_halves(gate_up, weights, tracing=torch.compiler.is_compiling())
        weights = dataclasses.replace(weights, gate=None, up=None)
    return _MoEFunction.apply(
        workspace,
        fuse_grad_accumulation,
        torch.is_grad_enabled(),
        topk_idx,
        x,
        topk_weights,
        gate_up,
        *weights.astuple(),
    )


class MoE(nn.Module):
    """An expert-parallel MoE layer that owns this rank's expert weights.

    On a group of `ep` ranks, this rank holds experts [rank * E_loc, (rank + 1) * E_loc) with
    E_loc = E / ep, plus a full copy of the shared expert if the config has one. `group=None`
    means one process holding all experts; `group` may also be a one-dimensional DeviceMesh, the
    expert dimension of a larger mesh (`mesh["ep"]`).

        layer = mok.MoE(config, group=ep_group, device="cuda")
        y = layer(x, topk_idx, topk_weights)      # x [..., H] bf16, topk_* [..., k]

    Gradient accumulation over micro-batches costs no extra pass: once a weight has a `.grad` (or
    an fp32 `main_grad` attribute, Megatron-style, which then takes the gradient instead of
    `.grad`), backward adds into it in place (`fuse_grad_accumulation`, see `mok.moe`). Set
    `fuse_grad_accumulation=False` where a tensor hook on these weights must see each
    micro-batch's gradient.
    """

    def __init__(
        self,
        config: MoKConfig,
        group: dist.ProcessGroup | DeviceMesh | None = None,
        device: torch.device | str | None = None,
        fuse_grad_accumulation: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.fuse_grad_accumulation = fuse_grad_accumulation
        self.group = group = expert_parallel_group(group)
        self.rank, self.ep_size = group_rank_and_size(group)
        self.local_experts = config.local_experts(self.ep_size)
        for name, shape in expected_weight_shapes(config, self.local_experts).items():
            if shape is not None:
                param = torch.empty(shape, device=device, dtype=config.activation_dtype)
                self.register_parameter(name, nn.Parameter(param))
            else:
                self.register_parameter(name, None)
        self._slot = ops.WorkspaceSlot()
        self.reset_parameters()

    @property
    def first_expert(self) -> int:
        """Global id of this rank's first expert."""
        return self.rank * self.local_experts

    def reset_parameters(self) -> None:
        """Normal init with std 1/sqrt(fan_in), so that outputs stay O(1) for unit-scale inputs."""
        with torch.no_grad():
            for param in self.parameters(recurse=False):
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))

    @property
    def weights(self) -> MoEWeights:
        # Read from the parameter dict, where setattr, FSDP2 and functional_call put them
        # (nn.Module's __getattr__ per name costs a microsecond at every call).
        return MoEWeights(*map(self._parameters.get, WEIGHT_FIELDS))

    @torch.no_grad()
    def load_global_weights(self, weights: MoEWeights) -> None:
        """Copy this rank's slice from weights of all E experts ([E, I, H] etc., any device)."""
        local = slice(self.first_expert, self.first_expert + self.local_experts)
        for name in WEIGHT_FIELDS:
            source, target = getattr(weights, name), getattr(self, name)
            if (source is None) != (target is None):
                raise MoKInputError(f"weights.{name} is {'missing' if source is None else 'extra'}")
            if target is None:
                continue
            if name in ROUTED_FIELDS:
                if source.shape[0] != self.config.num_experts:
                    raise MoKInputError(
                        f"weights.{name} holds {source.shape[0]} experts, expected all "
                        f"{self.config.num_experts}"
                    )
                source = source[local]
            if source.shape != target.shape:
                raise MoKInputError(
                    f"weights.{name} slice has shape {tuple(source.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(source)

    @classmethod
    def sharing_weights_of(cls, layer: MoE, config: MoKConfig | None = None) -> MoE:
        """A layer of this class on the parameters of `layer` (the same tensors, not copies), with
        `layer`'s config or `config` (e.g. another backend)."""
        twin = cls(config or layer.config, layer.group, device="meta")
        for name, param in layer.named_parameters(recurse=False):
            setattr(twin, name, param)
        return twin

    def workspace(self, device: torch.device) -> functional.Workspace:
        """The workspace for `device`, created on first use (a collective over the group)."""
        ws = self._slot.workspace
        if ws is not None and ws.device == device:  # a tensor's device, as at every call
            return ws
        if ws is None or ws.device != functional.resolve_device(device):
            if ws is not None:
                ws.release()
            ws = self._slot.hold(functional.create_workspace(self.config, self.group, device))
        return ws

    def forward(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """y [..., H] from x [..., H], topk_idx [..., k], topk_weights [..., k]."""
        hidden, top_k = self.config.hidden_size, self.config.top_k
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        operand, weights = cast_for_autocast(x, self.weights, self.config.activation_dtype)
        # Inputs of a wrong shape go on unflattened: the collective checks downstream name the
        # problem on every rank, where raising here would leave the other ranks waiting.
        inputs = (
            _flatten_leading(operand, hidden),
            _flatten_leading(topk_idx, top_k),
            _flatten_leading(topk_weights, top_k),
            weights,
        )
        if torch.compiler.is_compiling():
            # The custom ops, which the compiler keeps as nodes of its graph. The workspace is
            # made outside the trace (a collective): by an eager call or `layer.workspace(device)`.
            if self._slot.workspace is None:
                raise MoKInputError(
                    "torch.compile of mok.MoE needs its workspace made first: call the layer once "
                    "eagerly, or layer.workspace(device), before compiling"
                )
            y = ops.moe(*inputs, self._slot.workspace_id)
        else:
            y = moe(*inputs, self.workspace(x.device), self.fuse_grad_accumulation)
        # No view for [T, H] inputs: FSDP2 hooks the module's output, which an in-place op on a
        # view would bypass. Under autocast y stays in the layer's dtype, as a matmul's would.
        return y if y.shape == x.shape else y.view(x.shape)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"hidden={c.hidden_size}, intermediate={c.intermediate_size}, experts={c.num_experts} "
            f"(local {self.local_experts} of ep={self.ep_size}), top_k={c.top_k}, "
            f"shared={c.shared_intermediate_size}, backend={c.backend.value}"
        )


def _flatten_leading(tensor, last: int):
    """[..., last] -> [N, last]; anything else is returned unchanged for the checks to report."""
    if isinstance(tensor, torch.Tensor) and tensor.dim() != 2 and tensor.dim() >= 1:
        return tensor.reshape(-1, last) if tensor.shape[-1] == last else tensor
    return tensor
