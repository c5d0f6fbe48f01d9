"""The expert MLP in MXFP8 on rows grouped by local expert, forward and backward: the semantics of
`mok.reference.mx_expert` on the bf16 expert kernels (`mok.kernels.expert_mlp`, warp-specialized
on Hopper), fed with MX operands.

Hopper has no block-scaled MMA, and every MXFP8 value is a bf16 value: a bf16 GEMM whose operands
hold the values of MX casts computes the MX product exactly (fp32 accumulation). So each GEMM
operand goes through a cast kernel (`mok.kernels.mx`) that writes the values of its cast along the
GEMM's reduction dimension, and the bf16 kernels run unchanged:

    forward    Q_H(rows) -> gate/up + SwiGLU (bf16 h) -> Q_I(h) -> down
    backward   Q_H(grad out) -> down dgrad + SwiGLU backward (bf16 grads) -> Q_I(grads)
               -> gate/up dgrad;  Q_T of grad out, Q_I(h), grads, Q_H(rows) -> weight gradients

gpt-oss's activation and expert biases go to the bf16 kernels as they are: the biases, never
cast, added in fp32 in the epilogues; their gradients summed from the bf16 gradients.

The weights' casts come from an `MXWeightCasts`: made ahead (`MXWeightValues`, both layouts
from one pass), once per weight update when the caller keeps an `MXWeightCache`; or by each pass
in the layout it reads, dropped after it (`MXWeightsCastPerPass`). The casts of the grouped rows
(`mx_group_casts`) touch only the rows inside the groups and make every cast of a tensor in one
pass. Saved for the backward, as MXFP8 bytes and scales (about half their bf16 bytes): x, h and
the pre-activations (bf16 under a clamp). Why not a tl design that dequantizes e4m3 tiles
inside the GEMMs' main loops (the one this replaced): docs/mxfp8.md.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import torch

from mok.errors import MoKInputError
from mok.kernels.expert_mlp import (
    ExpertKernelConfig,
    ExpertMLPSaved,
    cached_row_tiles,
    down_data_gradient,
    down_weight_gradient,
    expert_bias_gradients,
    expert_mlp_forward,
    gate_up_data_gradient,
    gate_up_weight_gradients,
)
from mok.kernels.host import SWIGLU, Activation
from mok.kernels.mx import GROUP_ROWS, MXRows, mx_group_casts, mx_quantized_values_both
from mok.kernels.weight_casts import WeightCastCache
from mok.reference.mx import ScaleRounding
from mok.weights import gate_up_halves, whole_gate_up


class MXWeightCasts(Protocol):
    """Where the MXFP8 products get the routed weights' casts (as values: the weights' dtype and
    shapes) that each pass reads."""

    def forward_values(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W_gate [E, I, H], W_up cast along H; W_down [E, H, I] cast along I): the forward's."""
        ...

    def backward_values(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W_gate, W_up cast along I (their dim 1): grad x's; W_down cast along H: grad h's)."""
        ...


def _weight_values(weights, rounding: ScaleRounding, forward: bool, backward: bool) -> list:
    """[(values along the last dimension or None, along dim 1 or None)] per weight (gate, up,
    down), one pass per weight. Gate and up that are the halves of one contiguous [E, 2I, H]
    tensor (a model's fused gate_up_proj) are cast whole, in place of a copy of each half: a
    block of 32 along dim 1 never straddles the halves (I is a multiple of 32), so the casts'
    halves are the halves' casts, and the products read them as views."""
    w_gate, w_up, w_down = weights

    def cast(w):
        return mx_quantized_values_both(w, rounding, rowwise=forward, colwise=backward)

    whole = whole_gate_up(w_gate, w_up)
    if whole is None:
        return [cast(w.contiguous()) for w in (w_gate, w_up, w_down)]
    halves = [(None, None) if c is None else gate_up_halves(c) for c in cast(whole)]
    return [(halves[0][0], halves[1][0]), (halves[0][1], halves[1][1]), cast(w_down.contiguous())]


@dataclasses.dataclass(frozen=True)
class MXWeightValues:
    """The routed weights' MXFP8 casts as values (the weights' dtype and shapes), made ahead:
    the forward's layout and, unless made for the forward only, the backward's."""

    gate: torch.Tensor
    """W_gate [E, I, H] cast along H: the forward's."""
    up: torch.Tensor
    down: torch.Tensor
    """W_down [E, H, I] cast along I."""
    gate_along_i: torch.Tensor | None
    """W_gate cast along I (its dim 1): grad x's."""
    up_along_i: torch.Tensor | None
    down_along_h: torch.Tensor | None
    """W_down cast along H (its dim 1): grad h's."""

    @classmethod
    def of(
        cls, w_gate, w_up, w_down, rounding: ScaleRounding, backward: bool = True
    ) -> MXWeightValues:
        """Both casts of each weight (backward False: the forward's only), one pass per weight."""
        casts = _weight_values((w_gate, w_up, w_down), rounding, True, backward)
        return cls(*(c[0] for c in casts), *(c[1] for c in casts))

    @property
    def has_backward(self) -> bool:
        return self.gate_along_i is not None

    def forward_values(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate, self.up, self.down

    def backward_values(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.has_backward:
            raise ValueError("these weight casts were made for the forward only")
        return self.gate_along_i, self.up_along_i, self.down_along_h


class MXWeightsCastPerPass:
    """The routed weights, cast by each pass that reads them, in the layout it reads, and
    dropped after it: no cast outlives a pass (`MoKTuning.mx_weight_casts`). The backward casts
    the weights the forward read; one changed in place in between raises MoKInputError, as
    autograd refuses a saved tensor changed in place."""

    def __init__(self, w_gate, w_up, w_down, rounding: ScaleRounding, dtype=None) -> None:
        self.weights = (w_gate, w_up, w_down)
        self.rounding, self.dtype = rounding, dtype
        self.versions = tuple(w._version for w in self.weights)

    def _values(self, forward: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weights = (w.to(self.dtype or w.dtype) for w in self.weights)
        casts = _weight_values(weights, self.rounding, forward, not forward)
        return tuple(c[0 if forward else 1] for c in casts)

    def forward_values(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._values(forward=True)

    def backward_values(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        names = ("gate", "up", "down")
        for name, w, version in zip(names, self.weights, self.versions, strict=True):
            if w._version != version:
                raise MoKInputError(
                    f"weights.{name} was changed in place between the MXFP8 forward and its "
                    "backward: the backward would cast other weights than the forward read"
                )
        return self._values(forward=False)


class MXWeightCache(WeightCastCache):
    """The last `MXWeightValues` made, reused while the weights are unchanged
    (`WeightCastCache`)."""

    def get(
        self, w_gate, w_up, w_down, rounding: ScaleRounding, dtype=None, backward: bool = True
    ) -> MXWeightValues:
        """The casts of the weights converted to `dtype` (None: as they are); backward False:
        the forward's layout is enough (the backward's too where kept already)."""
        weights = (w_gate, w_up, w_down)

        def make() -> MXWeightValues:
            converted = (w.to(dtype or w.dtype) for w in weights)
            return MXWeightValues.of(*converted, rounding, backward)

        return self.cached(
            weights, (rounding, dtype), make, lambda casts: not backward or casts.has_backward
        )


@dataclasses.dataclass
class MXExpertSaved:
    """What `mx_expert_mlp_backward` needs from a forward call. A backward that is the only one
    of its forward may `release` each saved cast once it no longer needs it."""

    x: MXRows
    """The rows cast along H, [M, H]."""
    h: MXRows
    """h cast along I, [M, I]."""
    gate_up: MXRows | torch.Tensor
    """[M, 2I] pre-activations gate | up: without a clamp their cast along I (`MXRows`); under a
    clamp bf16 as the bf16 layer saves them (an e4m3 block cannot always keep a value on its
    side of the limit, and the backward's clamp decisions must be the forward's)."""
    group_offsets: torch.Tensor
    row_tiles: dict
    weights: MXWeightCasts
    swiglu_limit: float | None
    rounding: ScaleRounding
    config: ExpertKernelConfig
    activation: Activation = SWIGLU
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """The experts' biases (gate, up [E, I]; down [E, H]; never cast), or None."""

    def release(self, *names: str) -> None:
        """Drop the saved casts `names` ("x", "h", "gate_up"; None afterwards), as
        `ExpertMLPSaved.release` does."""
        for name in names:
            if name not in ("x", "h", "gate_up"):
                raise ValueError(f"{name!r} is not a saved cast (x, h, gate_up)")
            setattr(self, name, None)


def mx_expert_mlp_forward(
    rows: torch.Tensor | MXRows,
    group_offsets: torch.Tensor,
    weights: MXWeightCasts,
    swiglu_limit: float | None = None,
    rounding: ScaleRounding | str = ScaleRounding.RCEIL,
    save_for_backward: bool = True,
    out: torch.Tensor | None = None,
    activation: Activation = SWIGLU,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, MXExpertSaved | None]:
    """out [M, H] of `mok.reference.mx_expert.mx_grouped_expert_mlp` for rows [M, H] grouped by
    `group_offsets` ([E + 1] int32 on the device) through the weights' casts (`MXWeightValues`;
    H and I multiples of 32). rows: bf16 values (fp32 under the interpreter), cast here, or
    their cast along H already made (`MXRows`, as the layer dispatches them). out: as in
    `expert_mlp_forward`. activation, biases (gate, up [E, I], down [E, H] in the weights' dtype):
    as in `expert_mlp_forward`, the biases added in fp32 to the MX products. Returns (out in the
    weights' dtype, rows outside the groups unwritten; saved or None). Only rows inside the
    groups are cast. Never synchronizes with the host."""
    rounding = ScaleRounding(rounding)
    w_gate, w_up, w_down = weights.forward_values()
    dtype = w_gate.dtype
    m = rows.shape[0]
    tiles: dict = {}
    cast_tiles = cached_row_tiles(tiles, group_offsets, m, GROUP_ROWS)
    if isinstance(rows, MXRows):
        x = mx_group_casts(rows, cast_tiles, rounding, values=True, dtype=dtype)
        x_values, x_codes = x.values, rows
    else:
        x = mx_group_casts(rows, cast_tiles, rounding, values=True, codes=save_for_backward)
        x_values, x_codes = x.values, x.codes
    h_codes = []

    def down_operand(h: torch.Tensor) -> torch.Tensor:
        cast = mx_group_casts(h, cast_tiles, rounding, values=True, codes=save_for_backward)
        h_codes.append(cast.codes)
        return cast.values

    out, bf16_saved = expert_mlp_forward(
        x_values,
        group_offsets,
        w_gate,
        w_up,
        w_down,
        swiglu_limit,
        save_for_backward=save_for_backward,
        out=out,
        down_operand=down_operand,
        activation=activation,
        biases=biases,
    )
    inter = w_gate.shape[1]
    del w_gate, w_up, w_down  # casts made for this pass go with it
    if not save_for_backward:
        return out, None
    h = h_codes[0] if h_codes else MXRows.empty(0, inter, x_values.device)  # no rows: no products
    gate_up = bf16_saved.gate_up
    if swiglu_limit is None:
        gate_up = mx_group_casts(gate_up, cast_tiles, rounding, codes=True).codes
    saved = MXExpertSaved(
        x=x_codes,
        h=h,
        gate_up=gate_up,
        group_offsets=group_offsets,
        row_tiles={**bf16_saved.row_tiles, **tiles},
        weights=weights,
        swiglu_limit=swiglu_limit,
        rounding=rounding,
        config=bf16_saved.config,
        activation=activation,
        biases=biases,
    )
    return out, saved


class MXExpertGradients(NamedTuple):
    """The gradients `mx_expert_mlp_backward` returns."""

    rows: torch.Tensor
    """[M, H], zero outside the groups."""
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    """The biases' (gate, up, down) when the forward had biases, else None."""


def mx_expert_mlp_backward(
    grad_out: torch.Tensor,
    saved: MXExpertSaved,
    grad_w_gate: torch.Tensor | None = None,
    grad_w_up: torch.Tensor | None = None,
    grad_w_down: torch.Tensor | None = None,
    release: bool = False,
    grad_bias_buffers: tuple[torch.Tensor | None, ...] = (None, None, None),
) -> MXExpertGradients:
    """The gradients of `mx_expert_mlp_forward` given grad_out [M, H] (bf16 values): the
    reference's MXFP8 backward. The weight-gradient buffers as in `expert_mlp_backward` (added
    into when given), the biases' (gate, up, down) as in `expert_bias_gradients`: fp32 sums of
    the bf16 gradients (grad_out's and the pre-activations', never cast). grad rows is zero
    outside the groups; an expert without rows gets zero weight and bias gradients. Each operand
    is cast in one pass that makes every cast of it the backward reads (grad_out and the SwiGLU
    gradients: along their columns for the data gradients, along the tokens for the weight
    gradients). The products go in `expert_mlp_backward`'s order, each cast dropped after its
    last product; release: `saved` serves this backward only, each saved cast released once its
    values are made."""
    rounding = saved.rounding
    w_gate, w_up, w_down = saved.weights.backward_values()
    m = grad_out.shape[0]
    dtype = grad_out.dtype
    tiles = cached_row_tiles(saved.row_tiles, saved.group_offsets, m, GROUP_ROWS)
    g = mx_group_casts(grad_out, tiles, rounding, values=True, token_values=True)
    gate_up = saved.gate_up
    if isinstance(gate_up, MXRows):
        gate_up = mx_group_casts(gate_up, tiles, rounding, values=True, dtype=dtype).values
    if release:
        saved.release("gate_up")
    # The bf16 products' saved state, holding each operand's cast only while a product reads it.
    through = ExpertMLPSaved(
        rows=None,
        group_offsets=saved.group_offsets,
        w_gate=w_gate,
        w_up=w_up,
        w_down=w_down,
        h=None,
        gate_up=gate_up,
        row_tiles=saved.row_tiles,
        swiglu_limit=saved.swiglu_limit,
        config=saved.config,
        activation=saved.activation,
        biases=saved.biases,
    )
    del gate_up
    grads = down_data_gradient(g.values, through)
    through.release("gate_up")
    grad_biases = None
    if saved.biases is not None:
        grad_biases = expert_bias_gradients(grad_out, grads, through, *grad_bias_buffers)
    through.h = mx_group_casts(
        saved.h, tiles, rounding, token_values=True, dtype=dtype
    ).token_values
    if release:
        saved.release("h")
    grad_w_down = down_weight_gradient(g.token_values, through, grad_w_down)
    through.release("h")
    del g
    grads_cols = grads_tokens = grads  # without rows there is nothing to cast
    if m:
        cast = mx_group_casts(grads, tiles, rounding, values=True, token_values=True)
        grads_cols, grads_tokens = cast.values, cast.token_values
        del cast
    del grads
    through.rows = mx_group_casts(
        saved.x, tiles, rounding, token_values=True, dtype=dtype
    ).token_values
    if release:
        saved.release("x")
    grad_w_gate, grad_w_up = gate_up_weight_gradients(grads_tokens, through, grad_w_gate, grad_w_up)
    through.release("rows")
    del grads_tokens
    grad_rows = gate_up_data_gradient(grads_cols, through)
    return MXExpertGradients(grad_rows, grad_w_gate, grad_w_up, grad_w_down, grad_biases)
