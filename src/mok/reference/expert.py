"""The expert MLP in plain PyTorch: the numerics every kernel is held to.

Rounding points (shared by every backend, so that the reference models the fused kernels):
  gate, up = x @ W_gate.T (+ b_gate), x @ W_up.T (+ b_up)    accumulated in fp32, biases added there
  h        = swiglu(gate, up)                 computed in fp32, rounded once to the input dtype
  out      = h @ W_down.T (+ b_down)         accumulated in fp32, rounded once to the input dtype
Inputs in float64 are computed in float64 (for tests against exact math).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs, the input dtype otherwise."""
    return torch.promote_types(dtype, torch.float32)


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    limit: float | None = None,
    alpha: float = 1.0,
    up_offset: float = 0.0,
) -> torch.Tensor:
    """gate * sigmoid(alpha * gate) * (up + up_offset), computed as silu(gate) * up for SwiGLU
    (alpha 1, offset 0); with `limit` L, first gate <- min(gate, L) and up <- clamp(up, -L, L).
    gpt-oss's activation is alpha 1.702, offset 1, L 7."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    if alpha == 1.0 and up_offset == 0.0:
        return F.silu(gate) * up
    return gate * torch.sigmoid(alpha * gate) * (up + up_offset)


def limit_edges(swiglu_limit: float | None, dtype: torch.dtype) -> tuple[float, float]:
    """(largest value of `dtype` <= L, smallest > L) for L = the limit in fp32, as the kernels
    compare it (zeros without a limit): the bounds `saved_preactivations` saves clamped and
    unclamped pre-activations at."""
    if swiglu_limit is None:
        return 0.0, 0.0
    limit = torch.tensor(float(swiglu_limit), dtype=torch.float32)
    below = limit.to(dtype)
    if below.float() > limit:
        below = torch.nextafter(below, torch.zeros_like(below))
    above = torch.nextafter(below, torch.full_like(below, float("inf")))
    return below.item(), above.item()


def saved_preactivations(
    gate: torch.Tensor, up: torch.Tensor, limit: float | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 pre-activations as the kernels save them for the backward in `dtype`: rounded, except
    that under a limit L a clamped value is saved at least at the smallest `dtype` value above L
    and an unclamped one at most at the largest at or below L, so that the backward's clamp
    decisions on the saved values are the forward's on the fp32 ones (NaN stays NaN)."""
    if limit is None:
        return gate.to(dtype), up.to(dtype)
    below, above = limit_edges(limit, dtype)
    gate = torch.where(gate > limit, gate.clamp(min=above), gate.clamp(max=below))
    kept_up = up.clamp(min=-below, max=below)
    up = torch.where(
        up > limit, up.clamp(min=above), torch.where(up < -limit, up.clamp(max=-above), kept_up)
    )
    return gate.to(dtype), up.to(dtype)


def activation_gradients(
    gate: torch.Tensor, up: torch.Tensor, grad_h: torch.Tensor, activation: tuple, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the pre-activations gate and up (as saved) through `swiglu(gate, up,
    *activation)` for grad_h, in fp32 and then rounded to `dtype` once: the quantized experts'
    SwiGLU backward. activation: (limit, alpha, up_offset)."""
    with torch.enable_grad():
        gate_ = gate.float().requires_grad_(True)
        up_ = up.float().requires_grad_(True)
        grad_gate, grad_up = torch.autograd.grad(
            swiglu(gate_, up_, *activation), [gate_, up_], grad_h
        )
    return grad_gate.to(dtype), grad_up.to(dtype)


def bias_gradients(
    grad_gate: torch.Tensor, grad_up: torch.Tensor, grad_out: torch.Tensor, bias_dtypes
) -> tuple:
    """The gradients of b_gate, b_up and b_down: the fp32 sums over the rows of grad_gate, grad_up
    and grad_out, in the biases' dtypes; (None, None, None) where bias_dtypes is None."""
    if bias_dtypes is None:
        return (None, None, None)
    summed = (grad_gate, grad_up, grad_out)
    return tuple(
        grad.float().sum(0).to(dtype) for grad, dtype in zip(summed, bias_dtypes, strict=True)
    )


def expert_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
    *,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    alpha: float = 1.0,
    up_offset: float = 0.0,
) -> torch.Tensor:
    """One expert on rows x [M, H] with w_gate, w_up [I, H] and w_down [H, I]: returns [M, H].
    `biases` (b_gate [I], b_up [I], b_down [H]) and `alpha`, `up_offset`: see `swiglu` (gpt-oss).

    Differentiable. The output has x's dtype; see the module docstring for the rounding points.
    """
    acc = accumulation_dtype(x.dtype)
    x_acc = x.to(acc)
    gate = x_acc @ w_gate.to(acc).T
    up = x_acc @ w_up.to(acc).T
    if biases is not None:
        gate = gate + biases[0].to(acc)
        up = up + biases[1].to(acc)
    h = swiglu(gate, up, swiglu_limit, alpha, up_offset).to(x.dtype)
    out = h.to(acc) @ w_down.to(acc).T
    if biases is not None:
        out = out + biases[2].to(acc)
    return out.to(x.dtype)


def weighted_down_backward(
    grad_rows: torch.Tensor,
    group_sizes: list[int],
    h: torch.Tensor,
    w_down: torch.Tensor,
    row_weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The down product's backward with each row's router weight applied after the product: the
    rounding points of `grouped_gemm.down_dgrad_swiglu_weighted`. Rows grouped by expert as in
    `grouped_expert_mlp`; grad_rows [M, H] the unweighted gradients of the rows' outputs, h [M, I]
    the forward's h, w_down [E, H, I], row_weights [M]. Per row r of expert e, with acc =
    grad_rows[r] @ W_down[e] accumulated in fp32 (float64 inputs: float64):
        grad_h[r]     = round(w[r] * acc)      in h's dtype
        dots[r]       = <acc, h[r]>            w[r]'s gradient, less <grad_rows[r], b_down[e]>
        weighted_h[r] = round(w[r] * h[r])     W_down[e]'s gradient: grad_rows[e].T @ weighted_h[e]
    Returns (grad_h, dots, weighted_h)."""
    acc_dtype = accumulation_dtype(h.dtype)
    bounds = [0, *torch.tensor(group_sizes).cumsum(0).tolist()]
    acc = torch.cat(
        [
            grad_rows[a:b].to(acc_dtype) @ w_down[e].to(acc_dtype)
            for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
        ]
        or [h.new_zeros(0, h.shape[1], dtype=acc_dtype)]
    )
    weights = row_weights.to(acc_dtype)[:, None]
    h_acc = h.to(acc_dtype)
    dots = (acc * h_acc).sum(1)
    return (weights * acc).to(h.dtype), dots, (weights * h_acc).to(h.dtype)


def grouped_expert_mlp(
    rows: torch.Tensor,
    group_sizes: list[int],
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
    expert=expert_mlp,
    *,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    alpha: float = 1.0,
    up_offset: float = 0.0,
) -> torch.Tensor:
    """Rows grouped by expert ([M, H], group e holds the next group_sizes[e] rows) through their
    experts (w_gate, w_up [E, I, H], w_down [E, H, I]; `biases`: b_gate, b_up [E, I], b_down
    [E, H] or None); returns [M, H]. Empty groups are skipped. `expert(rows, w_gate, w_up, w_down,
    swiglu_limit)` computes one expert (default: bf16); it is given `biases`, `alpha` and
    `up_offset` only when they are not SwiGLU's."""
    if len(group_sizes) != w_gate.shape[0]:
        raise ValueError(f"{len(group_sizes)} group sizes for {w_gate.shape[0]} experts")
    if sum(group_sizes) != rows.shape[0]:
        raise ValueError(
            f"group sizes sum to {sum(group_sizes)}, but there are {rows.shape[0]} rows"
        )
    # Unbind once: backward then stacks one gradient buffer per weight tensor. Indexing w[e] per
    # expert would add a full-size [E, ...] gradient per expert, quadratic in E.
    gates, ups, downs = w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0)
    per_expert_biases = None if biases is None else [b.unbind(0) for b in biases]
    plain = biases is None and alpha == 1.0 and up_offset == 0.0
    outputs = []
    start = 0
    for index, size in enumerate(group_sizes):
        if size:
            chunk = rows[start : start + size]
            weights = (chunk, gates[index], ups[index], downs[index], swiglu_limit)
            if plain:
                outputs.append(expert(*weights))
            else:
                own = None if per_expert_biases is None else [b[index] for b in per_expert_biases]
                outputs.append(expert(*weights, biases=own, alpha=alpha, up_offset=up_offset))
        start += size
    if not outputs:
        # Keep the result connected to the inputs (and the biases) so that autograd still yields
        # (zero) gradients.
        zero = rows * 0
        if biases is not None:
            zero = zero + sum(b.sum() for b in biases) * 0
        return zero
    return torch.cat(outputs)


class _WeightedDown(torch.autograd.Function):
    """out = h @ W_down[e].T (+ b_down[e]) per group (fp32 accumulation, one rounding), whose
    backward takes the rows' unweighted output gradients g and applies `row_weights` after the
    product (`weighted_down_backward`): h's gradient round(w * acc), the weights' gradient the
    dots (+ <g[r], b_down[e]>), W_down[e]'s gradient g[e].T @ round(w * h[e]), b_down[e]'s the
    sum of w * g[e] over its rows (in the accumulation dtype, rounded once)."""

    @staticmethod
    def forward(ctx, h, w_down, row_weights, group_sizes, b_down):
        acc = accumulation_dtype(h.dtype)
        bounds = [0, *torch.tensor(group_sizes, dtype=torch.int64).cumsum(0).tolist()]
        pairs = list(enumerate(zip(bounds, bounds[1:], strict=False)))
        products = [h[a:b].to(acc) @ w_down[e].to(acc).T for e, (a, b) in pairs]
        if b_down is not None:
            products = [p + b_down[e].to(acc) for p, (e, _) in zip(products, pairs, strict=True)]
        out = torch.cat([p.to(h.dtype) for p in products])
        ctx.save_for_backward(h, w_down, row_weights, b_down)
        ctx.group_sizes, ctx.bounds = group_sizes, bounds
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, w_down, row_weights, b_down = ctx.saved_tensors
        grad_h, dots, weighted_h = weighted_down_backward(
            grad_out, ctx.group_sizes, h, w_down, row_weights
        )
        acc = accumulation_dtype(h.dtype)
        groups = list(zip(ctx.bounds, ctx.bounds[1:], strict=False))
        grad_w_down = torch.stack(
            [grad_out[a:b].to(acc).T @ weighted_h[a:b].to(acc) for a, b in groups]
        ).to(w_down.dtype)
        grad_b_down = None
        if b_down is not None:
            grad = grad_out.to(acc)
            weighted = row_weights.to(acc)[:, None] * grad
            grad_b_down = torch.stack([weighted[a:b].sum(0) for a, b in groups]).to(b_down.dtype)
            bias_rows = torch.cat(
                [b_down[e].to(acc).expand(b - a, -1) for e, (a, b) in enumerate(groups)]
            )
            dots = dots + (grad * bias_rows).sum(1)
        return grad_h, grad_w_down, dots.to(row_weights.dtype), None, grad_b_down


def weighted_grouped_expert_mlp(
    rows: torch.Tensor,
    group_sizes: list[int],
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    row_weights: torch.Tensor,
    swiglu_limit: float | None = None,
    *,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    alpha: float = 1.0,
    up_offset: float = 0.0,
) -> torch.Tensor:
    """`grouped_expert_mlp`'s outputs [M, H], unweighted, whose backward applies each row's
    router weight row_weights [M] after the down product: the gradient a caller passes is the
    rows' unweighted one (the combine's grad_y per pair), and row_weights gets
    <grad_out[r] @ W_down[e], h[r]> (+ <grad_out[r], b_down[e]> with biases;
    `weighted_down_backward`'s rounding points, the `router_gradient="epilogue"` layer's).
    Differentiable in rows, the weights, the biases and row_weights."""
    acc = accumulation_dtype(rows.dtype)
    bounds = [0, *torch.tensor(group_sizes, dtype=torch.int64).cumsum(0).tolist()]
    h_rows = []
    for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        gate = rows[a:b].to(acc) @ w_gate[e].to(acc).T
        up = rows[a:b].to(acc) @ w_up[e].to(acc).T
        if biases is not None:
            gate, up = gate + biases[0][e].to(acc), up + biases[1][e].to(acc)
        h_rows.append(swiglu(gate, up, swiglu_limit, alpha, up_offset).to(rows.dtype))
    b_down = None if biases is None else biases[2]
    return _WeightedDown.apply(torch.cat(h_rows), w_down, row_weights, list(group_sizes), b_down)


def grouped_with_expert_function(
    apply,
    rows: torch.Tensor,
    group_sizes: list[int],
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    swiglu_limit: float | None,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    alpha: float,
    up_offset: float,
    *extra,
) -> torch.Tensor:
    """`grouped_expert_mlp` with each expert `apply(rows, w_gate, w_up, w_down, b_gate, b_up,
    b_down, (limit, alpha, up_offset), *extra)` (an autograd Function's `apply`; the biases None
    without them): the quantized experts' grouping."""

    def expert(chunk, gate, up, down, limit, biases=None, alpha=1.0, up_offset=0.0):
        own = (None, None, None) if biases is None else biases
        return apply(chunk, gate, up, down, *own, (limit, alpha, up_offset), *extra)

    return grouped_expert_mlp(
        rows, group_sizes, *weights, swiglu_limit, expert, biases=biases, alpha=alpha,
        up_offset=up_offset,
    )  # fmt: skip
