"""The whole MoE layer in plain PyTorch, single process or expert-parallel: the oracle.

    y[t] = shared(x[t]) + sum_j topk_weights[t, j] * expert_{topk_idx[t, j]}(x[t])

Combine order (part of the determinism contract of every backend): in fp32, start from the shared
expert's output (or zero), then add w[t, j] * out[t, j] for j = 0, 1, ..., k-1, then round once
to x's dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mok.distributed import all_to_all
from mok.reference.expert import (
    accumulation_dtype,
    expert_mlp,
    grouped_expert_mlp,
    weighted_grouped_expert_mlp,
)
from mok.reference.fp8_block_expert import fp8_block_grouped_expert_mlp
from mok.reference.mx import ScaleRounding
from mok.reference.mx_expert import mx_grouped_expert_mlp, quantized
from mok.reference.routing import ReferenceRouting
from mok.weights import MoEWeights


def combine(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    shared_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum of the k expert outputs of each token, in the contract's order.

    expert_out [T, k, H], topk_weights [T, k], shared_out [T, H] or None -> [T, H] in expert_out's
    dtype. Differentiable.
    """
    acc_dtype = accumulation_dtype(expert_out.dtype)
    tokens, top_k, hidden = expert_out.shape
    if shared_out is None:
        acc = expert_out.new_zeros((tokens, hidden), dtype=acc_dtype)
    else:
        acc = shared_out.to(acc_dtype)
    weights = topk_weights.to(acc_dtype)
    for j in range(top_k):
        acc = acc + weights[:, j, None] * expert_out[:, j].to(acc_dtype)
    return acc.to(expert_out.dtype)


class _MXCombine(torch.autograd.Function):
    """`mok.reference.combine` whose backward reads the expert outputs' MXFP8 cast along H for
    the router weights' gradient (what the MXFP8 layer saves in their place); the output and the
    other gradients are the bf16 combine's, rounded at the same points."""

    @staticmethod
    def forward(ctx, expert_out, topk_weights, shared_out, rounding):
        tokens, top_k, hidden = expert_out.shape
        saved = quantized(expert_out.reshape(tokens * top_k, hidden), -1, rounding)
        ctx.save_for_backward(saved.view(tokens, top_k, hidden), topk_weights)
        ctx.out_dtype = expert_out.dtype
        ctx.shared_dtype = None if shared_out is None else shared_out.dtype
        return combine(expert_out, topk_weights, shared_out)

    @staticmethod
    def backward(ctx, grad_y):
        saved_out, topk_weights = ctx.saved_tensors
        acc = accumulation_dtype(ctx.out_dtype)
        grad = grad_y.to(acc)
        grad_out = (topk_weights.to(acc)[:, :, None] * grad[:, None, :]).to(ctx.out_dtype)
        grad_weights = (grad[:, None, :] * saved_out.to(acc)).sum(-1).to(topk_weights.dtype)
        grad_shared = None if ctx.shared_dtype is None else grad.to(ctx.shared_dtype)
        return grad_out, grad_weights, grad_shared, None


class _CombineOfWeightedOutputs(torch.autograd.Function):
    """`combine` whose backward hands each pair grad_y[t] unweighted and nothing to the router
    weights: for outputs from `weighted_grouped_expert_mlp`, whose backward applies the weights
    and forms their gradient (router_gradient="epilogue")."""

    @staticmethod
    def forward(ctx, expert_out, topk_weights, shared_out):
        ctx.top_k = expert_out.shape[1]
        ctx.out_dtype = expert_out.dtype
        ctx.shared_dtype = None if shared_out is None else shared_out.dtype
        return combine(expert_out, topk_weights, shared_out)

    @staticmethod
    def backward(ctx, grad_y):
        grad_out = grad_y.to(ctx.out_dtype).unsqueeze(1).expand(-1, ctx.top_k, -1)
        grad_shared = None if ctx.shared_dtype is None else grad_y.to(ctx.shared_dtype)
        return grad_out, None, grad_shared


def mx_combine(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    shared_out: torch.Tensor | None = None,
    rounding: ScaleRounding | str = ScaleRounding.RCEIL,
) -> torch.Tensor:
    """The MXFP8 layer's combine: `mok.reference.combine` (expert_out [T, k, H], H a multiple of
    32), differentiable, with the router weights' gradient <grad y[t], Q_H(out[t, j])> in fp32."""
    return _MXCombine.apply(expert_out, topk_weights, shared_out, ScaleRounding(rounding))


def moe_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    swiglu_limit: float | None = None,
    group: dist.ProcessGroup | None = None,
    routing: ReferenceRouting | None = None,
    precision: str = "bf16",
    mx_rounding: str = "rceil",
    swiglu_alpha: float = 1.0,
    swiglu_up_offset: float = 0.0,
    router_gradient: str = "saved_outputs",
) -> torch.Tensor:
    """The MoE layer on this rank's tokens. Differentiable; collective when `group` is given.

    x [T, H]; topk_idx [T, k] global expert ids; topk_weights [T, k]; weights holds this rank's
    E_loc experts (all E without a group). Returns y [T, H] in x's dtype. `routing` may be passed
    when already built (`ReferenceRouting.exchange`), else it is built here (a collective).
    precision "mxfp8": the routed experts in MXFP8 (`mok.reference.mx_expert`, scales rounded by
    `mx_rounding`); the shared expert and the combine stay bf16, the router weights' gradient
    reads the expert outputs' MX cast (`mx_combine`); "fp8_block": the routed experts in the
    128-block FP8 recipe (`mok.reference.fp8_block_expert`), the rest as in bf16.
    `swiglu_alpha`, `swiglu_up_offset`: the activation of every expert, the shared one included
    (`mok.reference.expert.swiglu`); the routed experts' biases come with `weights` (gate_bias,
    up_bias, down_bias).
    router_gradient "epilogue" (bf16): each pair's router weight travels with its row
    and the expert's backward applies it after the down product (`weighted_grouped_expert_mlp`);
    "saved_outputs": autograd's rounding points through the combine.
    """
    tokens, top_k = topk_idx.shape
    hidden = x.shape[1]
    if router_gradient == "epilogue" and precision != "bf16":
        raise ValueError("router_gradient='epilogue' takes bf16 experts")
    local_experts = weights.gate.shape[0]
    if routing is None:
        ep_size = 1 if group is None else dist.get_world_size(group)
        routing = ReferenceRouting.exchange(topk_idx, local_experts * ep_size, group)

    # One row per pair, in the order of pair_order. expand + reshape (not x[order // k]) keeps the
    # backward a plain sum over j instead of a scatter-add with repeated indices.
    pair_rows = x.unsqueeze(1).expand(tokens, top_k, hidden).reshape(tokens * top_k, hidden)
    sent = pair_rows[routing.pair_order]
    received = all_to_all(sent, routing.recv_splits, routing.send_splits, group)
    grouped = received[routing.recv_to_grouped]
    activation = {"alpha": swiglu_alpha, "up_offset": swiglu_up_offset}
    sizes = routing.group_sizes
    if router_gradient == "epilogue":
        return _moe_with_weighted_outputs(
            x, grouped, topk_weights, weights, swiglu_limit, group, routing, activation
        )
    experts, options = grouped_expert_mlp, {}
    if precision == "mxfp8":
        experts, options = mx_grouped_expert_mlp, {"rounding": mx_rounding}
    elif precision == "fp8_block":
        experts = fp8_block_grouped_expert_mlp
    expert_rows = experts(
        grouped,
        sizes,
        weights.gate,
        weights.up,
        weights.down,
        swiglu_limit,
        biases=weights.expert_biases(),
        **activation,
        **options,
    )
    expert_out = _returned(expert_rows, routing, group, (tokens, top_k, hidden))
    shared_out = _shared_out(x, weights, swiglu_limit, activation)
    if precision == "mxfp8":
        return mx_combine(expert_out, topk_weights, shared_out, mx_rounding)
    return combine(expert_out, topk_weights, shared_out)


def _returned(expert_rows, routing: ReferenceRouting, group, shape) -> torch.Tensor:
    """The grouped expert outputs sent back to their tokens' ranks: [T, k, H] (`shape`)."""
    returned = all_to_all(
        expert_rows[routing.grouped_to_recv], routing.send_splits, routing.recv_splits, group
    )
    return returned[routing.pair_order_inverse].view(shape)


def _shared_out(x, weights: MoEWeights, swiglu_limit, activation: dict) -> torch.Tensor | None:
    if not weights.has_shared_expert:
        return None
    return expert_mlp(
        x, weights.shared_gate, weights.shared_up, weights.shared_down, swiglu_limit, **activation
    )


def _moe_with_weighted_outputs(
    x, grouped, topk_weights, weights: MoEWeights, swiglu_limit, group, routing, activation
) -> torch.Tensor:
    """`moe_forward`'s router_gradient="epilogue" form: the pairs' router weights go with their
    rows (fp32) to the experts, whose backward applies them; the combine's backward hands grad_y
    to every pair unweighted."""
    pair_weights = topk_weights.float().reshape(-1, 1)[routing.pair_order]
    received = all_to_all(pair_weights, routing.recv_splits, routing.send_splits, group)
    row_weights = received[routing.recv_to_grouped].view(-1)
    expert_rows = weighted_grouped_expert_mlp(
        grouped,
        routing.group_sizes,
        weights.gate,
        weights.up,
        weights.down,
        row_weights,
        swiglu_limit,
        biases=weights.expert_biases(),
        **activation,
    )
    expert_out = _returned(expert_rows, routing, group, topk_weights.shape + x.shape[1:])
    shared_out = _shared_out(x, weights, swiglu_limit, activation)
    return _CombineOfWeightedOutputs.apply(expert_out, topk_weights, shared_out)
