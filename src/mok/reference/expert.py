"""The expert MLP in plain PyTorch: the numerics every kernel is held to.

Rounding points (shared by every backend, so that the reference models the fused kernels):
  gate, up = x @ W_gate.T, x @ W_up.T        accumulated in fp32
  h        = swiglu(gate, up)                 computed in fp32, rounded once to the input dtype
  out      = h @ W_down.T                     accumulated in fp32, rounded once to the input dtype
Inputs in float64 are computed in float64 (for tests against exact math).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs, the input dtype otherwise."""
    return torch.promote_types(dtype, torch.float32)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with `limit` L, first gate <- min(gate, L) and up <- clamp(up, -L, L)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def expert_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """One expert on rows x [M, H] with w_gate, w_up [I, H] and w_down [H, I]: returns [M, H].

    Differentiable. The output has x's dtype; see the module docstring for the rounding points.
    """
    acc = accumulation_dtype(x.dtype)
    x_acc = x.to(acc)
    gate = x_acc @ w_gate.to(acc).T
    up = x_acc @ w_up.to(acc).T
    h = swiglu(gate, up, swiglu_limit).to(x.dtype)
    return (h.to(acc) @ w_down.to(acc).T).to(x.dtype)


def grouped_expert_mlp(
    rows: torch.Tensor,
    group_sizes: list[int],
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
    expert=expert_mlp,
) -> torch.Tensor:
    """Rows grouped by expert ([M, H], group e holds the next group_sizes[e] rows) through their
    experts (w_gate, w_up [E, I, H], w_down [E, H, I]); returns [M, H]. Empty groups are skipped.
    `expert(rows, w_gate, w_up, w_down, swiglu_limit)` computes one expert (default: bf16)."""
    if len(group_sizes) != w_gate.shape[0]:
        raise ValueError(f"{len(group_sizes)} group sizes for {w_gate.shape[0]} experts")
    if sum(group_sizes) != rows.shape[0]:
        raise ValueError(
            f"group sizes sum to {sum(group_sizes)}, but there are {rows.shape[0]} rows"
        )
    # Unbind once: backward then stacks one gradient buffer per weight tensor. Indexing w[e] per
    # expert would add a full-size [E, ...] gradient per expert, quadratic in E.
    gates, ups, downs = w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0)
    outputs = []
    start = 0
    for index, size in enumerate(group_sizes):
        if size:
            chunk = rows[start : start + size]
            outputs.append(expert(chunk, gates[index], ups[index], downs[index], swiglu_limit))
        start += size
    if not outputs:
        # Keep the result connected to the inputs so autograd still yields (zero) gradients.
        return rows * 0
    return torch.cat(outputs)
