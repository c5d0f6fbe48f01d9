"""Containers for the weights of an MoE layer and for the gradients of one call."""

from __future__ import annotations

import dataclasses

import torch

from mok.errors import MoKInputError

EXPERT_BIAS_FIELDS = ("gate_bias", "up_bias", "down_bias")
ROUTED_FIELDS = ("gate", "up", "down", *EXPERT_BIAS_FIELDS)
"""The fields of MoEWeights split over the expert-parallel ranks (leading dimension: experts)."""


@dataclasses.dataclass(frozen=True)
class MoEWeights:
    """The weights one rank holds: its local routed experts and, optionally, the shared expert.

    Layout (the rows of each matrix are its output features, as in `nn.Linear`):
      gate, up:   [E_loc, I, H]   (expert e computes x @ gate[e].T)
      down:       [E_loc, H, I]
      shared_gate, shared_up: [I_s, H];  shared_down: [H, I_s]  (None without a shared expert)
      gate_bias, up_bias: [E_loc, I];  down_bias: [E_loc, H]    (None without expert biases)
    The reduction dimension of every GEMM is the innermost one, which is what TMA tiles and
    `tl.dot(a, b.T)` want in forward.
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    shared_gate: torch.Tensor | None = None
    shared_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_gate is not None

    def expert_biases(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(gate_bias, up_bias, down_bias) of the routed experts, or None without them."""
        if self.gate_bias is None:
            return None
        return (self.gate_bias, self.up_bias, self.down_bias)

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """Field name -> tensor (None where absent), in declaration order."""
        return dict(zip(WEIGHT_FIELDS, self.astuple(), strict=True))

    def astuple(self) -> tuple[torch.Tensor | None, ...]:
        """Every field's tensor (None where absent), in declaration order (`WEIGHT_FIELDS`),
        without copying: the layer reads them at every call."""
        return (
            self.gate,
            self.up,
            self.down,
            self.shared_gate,
            self.shared_up,
            self.shared_down,
            self.gate_bias,
            self.up_bias,
            self.down_bias,
        )

    def map(self, fn) -> MoEWeights:
        """A new MoEWeights with `fn` applied to every tensor that is present."""
        return MoEWeights(**{k: None if v is None else fn(v) for k, v in self.tensors().items()})


WEIGHT_FIELDS = tuple(MoEWeights.__dataclass_fields__)
"""The fields of MoEWeights, in declaration order."""


@dataclasses.dataclass(frozen=True)
class MoEGradients:
    """Gradients of one layer call: for its input rows, its router weights and every weight."""

    x: torch.Tensor
    """[T, H], the dtype of x."""
    topk_weights: torch.Tensor
    """[T, k], the dtype of topk_weights."""
    weights: MoEWeights
    """Same shapes and dtypes as the layer's weights."""


def gate_up_halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) [E, I, H]: the two halves of gate_up [E, 2I, H] along dim 1, as views (the
    layout of Hugging Face models' `gate_up_proj`)."""
    inter = gate_up.shape[1] // 2
    return gate_up[:, :inter], gate_up[:, inter:]


def are_gate_up_halves(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether gate and up [E, I, H] are, element for element, the halves of one [E, 2I, H]
    tensor along dim 1 (up's rows right after gate's in every expert)."""
    return (
        gate.dim() == 3
        and gate.shape == up.shape
        and gate.stride() == up.stride()
        and gate.dtype == up.dtype
        and gate.device == up.device
        and gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
        and gate.stride(0) == 2 * gate.shape[1] * gate.stride(1)
        and up.data_ptr() == gate.data_ptr() + gate.shape[1] * gate.stride(1) * gate.element_size()
    )


def whole_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """The contiguous [E, 2I, H] tensor whose halves along dim 1 gate and up [E, I, H] are
    (`gate_up_halves`), as a view of their storage; None where they are not such halves."""
    if not are_gate_up_halves(gate, up):
        return None
    experts, inter, hidden = gate.shape
    whole_strides = (2 * inter * hidden, hidden, 1)
    if gate.stride() != whole_strides:
        return None
    return gate.as_strided((experts, 2 * inter, hidden), whole_strides)


def check_gate_up_halves(gate_up: torch.Tensor, weights: MoEWeights, tracing: bool = False) -> None:
    """Raise MoKInputError unless weights.gate and weights.up are gate_up's halves along dim 1
    (`gate_up_halves`); while tracing (fake tensors, no addresses), their shapes only."""
    gate, up = weights.gate, weights.up
    expected = (gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])
    if gate_up.dim() != 3 or tuple(gate_up.shape) != expected or up.shape != gate.shape:
        raise MoKInputError(
            f"gate_up {tuple(gate_up.shape)} must be [E, 2I, H] for gate and up "
            f"{tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if not tracing and not (gate.data_ptr() == gate_up.data_ptr() and are_gate_up_halves(gate, up)):
        raise MoKInputError("weights.gate and weights.up must be the halves of gate_up (views)")


def has_contiguous_expert_rows(tensor: torch.Tensor) -> bool:
    """Whether tensor [E, P, Q] has a unit column stride, rows Q apart, and experts a whole
    number of rows apart, at least P, from a 16-byte aligned start: a contiguous tensor, or
    either half of a contiguous [E, 2P, Q] one (`gate_up_halves`). The weight-gradient kernels
    write and add into such a tensor in place."""
    if tensor.dim() != 3:
        return False
    _, p, q = tensor.shape
    return (
        tensor.stride(2) == 1
        and tensor.stride(1) == q
        and tensor.stride(0) % q == 0
        and tensor.stride(0) >= p * q
        and tensor.data_ptr() % 16 == 0
    )


def empty_gate_up_pair(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up): uninitialised [E, I, H] tensors of like's shape and dtype, the halves of one
    contiguous [E, 2I, H] tensor (`joined_gate_up` gives it back without a copy)."""
    experts, inter, hidden = like.shape
    return gate_up_halves(
        torch.empty(experts, 2 * inter, hidden, dtype=like.dtype, device=like.device)
    )


def joined_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H]: gate and up [E, I, H] one after the other along dim 1. Where they are the
    halves of one contiguous tensor (`empty_gate_up_pair`), that tensor itself, no copy; else a
    concatenation."""
    base = gate._base
    if (
        base is not None
        and base is up._base
        and base.is_contiguous()
        and base.shape == (gate.shape[0], 2 * gate.shape[1], gate.shape[2])
        and gate.data_ptr() == base.data_ptr()
        and are_gate_up_halves(gate, up)
    ):
        return base
    return torch.cat((gate, up), dim=1)
