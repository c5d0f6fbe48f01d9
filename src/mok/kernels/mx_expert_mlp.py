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

The weights' casts (both layouts from one pass, `MXWeightValues`) are made once per weight
update when the caller keeps an `MXWeightCache`. Saved for the backward: x and h as MXFP8 bytes
and scales (about half their bf16 bytes), the bf16 pre-activations as the bf16 layer saves them.
Measured against a tl design that dequantizes e4m3 tiles inside the GEMMs' main loops:
docs/mxfp8.md.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from mok.kernels.expert_mlp import (
    ExpertKernelConfig,
    ExpertMLPSaved,
    cached_row_tiles,
    expert_mlp_data_gradients,
    expert_mlp_forward,
    expert_mlp_weight_gradients,
)
from mok.kernels.mx import (
    GROUP_ROWS,
    mx_group_rows_values,
    mx_quantized_values,
    mx_quantized_values_both,
)
from mok.reference.mx import ScaleRounding

MXPair = tuple[torch.Tensor, torch.Tensor]
"""(e4m3 data, e8m0 scale bytes) of an MXFP8 tensor."""


@dataclasses.dataclass(frozen=True)
class MXWeightValues:
    """The routed weights' MXFP8 casts as values (the weights' dtype and shapes)."""

    gate: torch.Tensor
    """W_gate [E, I, H] cast along H: the forward's."""
    up: torch.Tensor
    down: torch.Tensor
    """W_down [E, H, I] cast along I."""
    gate_along_i: torch.Tensor
    """W_gate cast along I (its dim 1): grad x's."""
    up_along_i: torch.Tensor
    down_along_h: torch.Tensor
    """W_down cast along H (its dim 1): grad h's."""

    @classmethod
    def of(cls, w_gate, w_up, w_down, rounding: ScaleRounding) -> MXWeightValues:
        """Both casts of each weight, one pass per weight."""
        gate, gate_t = mx_quantized_values_both(w_gate.contiguous(), rounding)
        up, up_t = mx_quantized_values_both(w_up.contiguous(), rounding)
        down, down_t = mx_quantized_values_both(w_down.contiguous(), rounding)
        return cls(gate, up, down, gate_t, up_t, down_t)


class MXWeightCache:
    """The last `MXWeightValues` made, reused while the weights are unchanged: the same tensor
    objects (held weakly) with the same storage, shape, strides and version counter. Every
    in-place update through PyTorch (an optimizer step, `load_state_dict`, `copy_`) bumps the
    version; a write through `.data` does not, and calls for `clear()`. Never used while a CUDA
    graph is captured: a replay must cast the weights it finds then."""

    def __init__(self):
        self._key: tuple | None = None
        self._refs: tuple = ()
        self._values: MXWeightValues | None = None
        self.casts = 0
        """How many times the weights were cast (tests, benchmarks)."""

    def get(self, w_gate, w_up, w_down, rounding: ScaleRounding, dtype=None) -> MXWeightValues:
        """The casts of the weights converted to `dtype` (None: as they are)."""
        weights = (w_gate, w_up, w_down)
        if w_gate.is_cuda and torch.cuda.is_current_stream_capturing():
            return MXWeightValues.of(*(w.to(dtype or w.dtype) for w in weights), rounding)
        key = (rounding, dtype) + tuple(
            (w.data_ptr(), w._version, tuple(w.shape), w.stride(), w.dtype) for w in weights
        )
        same = len(self._refs) == 3 and all(
            ref() is w for ref, w in zip(self._refs, weights, strict=True)
        )
        if not same or key != self._key:
            self._values = None  # the old casts' memory first
            self._values = MXWeightValues.of(*(w.to(dtype or w.dtype) for w in weights), rounding)
            self._key, self._refs = key, tuple(weakref.ref(w) for w in weights)
            self.casts += 1
        return self._values

    def clear(self) -> None:
        self._key, self._refs, self._values = None, (), None


@dataclasses.dataclass(frozen=True)
class MXExpertSaved:
    """What `mx_expert_mlp_backward` needs from a forward call."""

    x: MXPair
    """The rows cast along H, [M, H] and [M, H / 32]."""
    h: MXPair
    """h cast along I, [M, I] and [M, I / 32]."""
    gate_up: torch.Tensor
    """[M, 2I] pre-activations, saved as the bf16 layer saves them."""
    group_offsets: torch.Tensor
    row_tiles: dict
    weights: MXWeightValues
    swiglu_limit: float | None
    rounding: ScaleRounding
    config: ExpertKernelConfig


def mx_expert_mlp_forward(
    rows: torch.Tensor,
    group_offsets: torch.Tensor,
    weights: MXWeightValues,
    swiglu_limit: float | None = None,
    rounding: ScaleRounding | str = ScaleRounding.RCEIL,
    save_for_backward: bool = True,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, MXExpertSaved | None]:
    """out [M, H] of `mok.reference.mx_expert.mx_grouped_expert_mlp` for rows [M, H] (bf16, or
    fp32 under the interpreter) grouped by `group_offsets` ([E + 1] int32 on the device) through
    the weights' casts (`MXWeightValues`; H and I multiples of 32). out: as in
    `expert_mlp_forward`. Returns (out in the rows' dtype, rows outside the groups unwritten;
    saved or None). Never synchronizes with the host."""
    rounding = ScaleRounding(rounding)
    if save_for_backward:
        x_values, x_codes = mx_quantized_values(rows, rounding, keep_codes=True)
    else:
        x_values, x_codes = mx_quantized_values(rows, rounding), None
    h_codes = []

    def down_operand(h: torch.Tensor) -> torch.Tensor:
        if not save_for_backward:
            return mx_quantized_values(h, rounding)
        values, codes = mx_quantized_values(h, rounding, keep_codes=True)
        h_codes.append(codes)
        return values

    out, bf16_saved = expert_mlp_forward(
        x_values,
        group_offsets,
        weights.gate,
        weights.up,
        weights.down,
        swiglu_limit,
        save_for_backward=save_for_backward,
        out=out,
        down_operand=down_operand,
    )
    if not save_for_backward:
        return out, None
    if not h_codes:  # no rows: the products never ran
        inter = weights.gate.shape[1]
        h_codes.append(_no_codes(rows, inter))
    saved = MXExpertSaved(
        x=x_codes,
        h=h_codes[0],
        gate_up=bf16_saved.gate_up,
        group_offsets=group_offsets,
        row_tiles=bf16_saved.row_tiles,
        weights=weights,
        swiglu_limit=swiglu_limit,
        rounding=rounding,
        config=bf16_saved.config,
    )
    return out, saved


def _no_codes(rows: torch.Tensor, cols: int) -> MXPair:
    data = torch.empty(0, cols, dtype=torch.float8_e4m3fn, device=rows.device)
    return data, torch.empty(0, cols // 32, dtype=torch.uint8, device=rows.device)


def mx_expert_mlp_backward(
    grad_out: torch.Tensor,
    saved: MXExpertSaved,
    grad_w_gate: torch.Tensor | None = None,
    grad_w_up: torch.Tensor | None = None,
    grad_w_down: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad rows [M, H], grad W_gate, grad W_up, grad W_down) of `mx_expert_mlp_forward` given
    grad_out [M, H] (bf16 values): the reference's MXFP8 backward. The weight-gradient buffers
    as in `expert_mlp_backward` (added into when given). grad rows is zero outside the groups;
    an expert without rows gets zero weight gradients."""
    rounding, w = saved.rounding, saved.weights
    m = grad_out.shape[0]
    dtype = grad_out.dtype
    g_values = mx_quantized_values(grad_out, rounding)
    through = ExpertMLPSaved(
        rows=g_values,  # only its shape and dtype are read by the data gradients
        group_offsets=saved.group_offsets,
        w_gate=w.gate_along_i,
        w_up=w.up_along_i,
        w_down=w.down_along_h,
        h=g_values,
        gate_up=saved.gate_up,
        row_tiles=saved.row_tiles,
        swiglu_limit=saved.swiglu_limit,
        config=saved.config,
    )
    grad_rows, grads = expert_mlp_data_gradients(
        g_values,
        through,
        gate_up_operand=lambda grads: mx_quantized_values(grads, rounding),
    )
    del g_values
    tiles = cached_row_tiles(saved.row_tiles, saved.group_offsets, m, GROUP_ROWS)

    def along_tokens(values: torch.Tensor) -> torch.Tensor:
        return mx_group_rows_values(values, tiles, rounding)

    x_tokens = mx_group_rows_values(saved.x, tiles, rounding, dtype)
    h_tokens = mx_group_rows_values(saved.h, tiles, rounding, dtype)
    wgrad = dataclasses.replace(through, rows=x_tokens, h=h_tokens)
    grad_w_gate, grad_w_up, grad_w_down = expert_mlp_weight_gradients(
        along_tokens(grad_out.contiguous()),
        along_tokens(grads),
        wgrad,
        grad_w_gate,
        grad_w_up,
        grad_w_down,
    )
    return grad_rows, grad_w_gate, grad_w_up, grad_w_down
