"""The MXFP8 expert MLP from the kernels (`mok.kernels.mx_expert_mlp`) against the reference's
(`mok.reference.mx_expert`), forward and backward: on the CPU under the interpreter, compiled on a
GPU. The two sum the same exact MX products in different orders (the reference's fp32 GEMMs, the
kernels' K-loops), so they agree to fp32 rounding before each cast and may then differ by one
e4m3 step where a value lies on a rounding boundary: normwise within 2^-10 once the kernels'
results are rounded to the reference's bf16 (on the CPU they come out bit for bit equal).

Bugs these catch: a wrong quantization point (a tensor cast along the wrong dimension, or
from bf16 where the contract says fp32: errors of e4m3's 2^-4, far above the tolerance), the
weights' two casts swapped, a gradient of the wrong expert, grad rows outside the groups not
zero, an empty group's weight gradients not zero.
"""

from __future__ import annotations

import pytest
import torch

from mok.kernels.mx_expert_mlp import mx_expert_mlp_backward, mx_expert_mlp_forward
from mok.reference.mx_expert import mx_grouped_expert_mlp

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = 2.0**-10


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Normwise, ours rounded to the reference's dtype first (bf16 results, fp32 on the CPU)."""
    ours, theirs = ours.cpu().to(theirs.dtype).double(), theirs.double().cpu()
    return ((ours - theirs).norm() / theirs.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("limit", [None, 2.0])
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mx_expert_mlp_is_the_reference_forward_and_backward(limit, rounding):
    sizes, hidden, inter = [29, 0, 48, 11], 64, 96
    gen = torch.Generator().manual_seed(7)
    experts, m = len(sizes), sum(sizes)
    rows = torch.randn(m + 5, hidden, generator=gen).bfloat16()  # 5 padding rows past the groups
    w_gate = (torch.randn(experts, inter, hidden, generator=gen) / 8).bfloat16()
    w_up = (torch.randn(experts, inter, hidden, generator=gen) / 8).bfloat16()
    w_down = (torch.randn(experts, hidden, inter, generator=gen) / 8).bfloat16()
    grad_out = torch.randn(m + 5, hidden, generator=gen).bfloat16()
    offsets = torch.tensor([0, *sizes]).cumsum(0).to(torch.int32)

    leaves = [t.clone().requires_grad_(True) for t in (rows[:m], w_gate, w_up, w_down)]
    want = mx_grouped_expert_mlp(*leaves[:1], sizes, *leaves[1:], limit, rounding)
    want.backward(grad_out[:m])

    out, saved = mx_expert_mlp_forward(
        rows.to(DEVICE),
        offsets.to(DEVICE),
        w_gate.to(DEVICE),
        w_up.to(DEVICE),
        w_down.to(DEVICE),
        limit,
        rounding,
    )
    assert relative_error(out[:m], want.detach()) < TOLERANCE
    grad_rows, grad_gate, grad_up, grad_down = mx_expert_mlp_backward(grad_out.to(DEVICE), saved)
    assert relative_error(grad_rows[:m], leaves[0].grad) < TOLERANCE
    assert bool((grad_rows[m:] == 0).all())
    for ours, leaf in zip((grad_gate, grad_up, grad_down), leaves[1:], strict=True):
        for e in range(experts):
            if sizes[e]:
                assert relative_error(ours[e], leaf.grad[e]) < TOLERANCE, e
            else:
                assert bool((ours[e] == 0).all()) and bool((leaf.grad[e] == 0).all())
