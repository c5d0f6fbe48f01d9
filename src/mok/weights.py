"""Containers for the weights of an MoE layer and for the gradients of one call."""

from __future__ import annotations

import dataclasses

import torch

ROUTED_FIELDS = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")
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
