"""The MXFP8 expert MLP from the kernels (`mok.kernels.mx_expert_mlp`) against the reference's
(`mok.reference.mx_expert`), forward and backward: on the CPU under the interpreter, compiled on a
GPU. The two sum the same exact MX products in different orders (the reference's fp32 GEMMs, the
kernels' K-loops), so they agree to fp32 rounding before each cast and may then differ by one
e4m3 step where a value lies on a rounding boundary: normwise within 2^-10. On the CPU the
kernels compute in fp32 (the interpreter's bf16 is wrong), so there the reference runs in fp32
too: the same contract with fp32 where GPUs round to bf16 (h, the pre-activations, the SwiGLU
gradients before their casts).

Bugs these catch: a wrong quantization point (a tensor cast along the wrong dimension, or left
in bf16: errors of e4m3's 2^-4, far above the tolerance), the weights' two casts swapped, a
gradient of the wrong expert, token blocks that cross an expert's group, grad rows outside the
groups not zero, an empty group's weight gradients not zero, gradient buffers not added into,
a weight cache that serves stale casts after an update.
"""

from __future__ import annotations

import pytest
import torch

from mok.kernels.host import SWIGLU, Activation
from mok.kernels.mx_expert_mlp import (
    MXWeightCache,
    MXWeightsCastPerPass,
    MXWeightValues,
    mx_expert_mlp_backward,
    mx_expert_mlp_forward,
)
from mok.reference.mx import ScaleRounding
from mok.reference.mx_expert import mx_grouped_expert_mlp
from mok.weights import are_gate_up_halves, gate_up_halves

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
TOLERANCE = 2.0**-10


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Normwise, ours rounded to the reference's dtype first."""
    ours, theirs = ours.cpu().to(theirs.dtype).double(), theirs.double().cpu()
    return ((ours - theirs).norm() / theirs.norm().clamp_min(1e-300)).item()


def problem(sizes, hidden=64, inter=96, seed=7):
    gen = torch.Generator().manual_seed(seed)
    experts, m = len(sizes), sum(sizes)
    rows = torch.randn(m + 5, hidden, generator=gen).bfloat16()  # 5 padding rows past the groups
    w_gate = (torch.randn(experts, inter, hidden, generator=gen) / 8).bfloat16()
    w_up = (torch.randn(experts, inter, hidden, generator=gen) / 8).bfloat16()
    w_down = (torch.randn(experts, hidden, inter, generator=gen) / 8).bfloat16()
    grad_out = torch.randn(m + 5, hidden, generator=gen).bfloat16()
    offsets = torch.tensor([0, *sizes]).cumsum(0).to(torch.int32)
    return rows, (w_gate, w_up, w_down), grad_out, offsets


def biases_of(experts, hidden=64, inter=96, seed=11):
    """gate, up [E, I] and down [E, H] biases, bf16."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(experts, inter), (experts, inter), (experts, hidden)]
    return [(torch.randn(shape, generator=gen) / 4).bfloat16() for shape in shapes]


GPT_OSS = Activation(alpha=1.702, up_offset=1.0)


@pytest.mark.parametrize(
    "limit, rounding, gpt_oss",
    [
        (None, "rceil", False),
        (2.0, "rceil", False),
        (None, "floor", False),
        (2.0, "floor", False),
        (2.0, "rceil", True),
    ],
)
def test_mx_expert_mlp_is_the_reference_forward_and_backward(limit, rounding, gpt_oss):
    """gpt_oss: its activation and the experts' biases (caught besides: the activation or a bias
    dropped on the MX path, a bias gradient missing or summed over another expert's rows)."""
    sizes = [29, 0, 48, 11]
    rows, weights, grad_out, offsets = problem(sizes)
    m, experts = sum(sizes), len(sizes)
    biases = biases_of(experts) if gpt_oss else []
    activation = GPT_OSS if gpt_oss else SWIGLU
    leaves = [t.to(DTYPE).requires_grad_(True) for t in (rows[:m], *weights, *biases)]
    want = mx_grouped_expert_mlp(
        leaves[0],
        sizes,
        *leaves[1:4],
        limit,
        rounding,
        biases=tuple(leaves[4:]) if gpt_oss else None,
        alpha=activation.alpha,
        up_offset=activation.up_offset,
    )
    want.backward(grad_out[:m].to(DTYPE))

    on_device = [w.to(DEVICE, DTYPE) for w in weights]
    casts = MXWeightValues.of(*on_device, ScaleRounding(rounding))
    out, saved = mx_expert_mlp_forward(
        rows.to(DEVICE, DTYPE),
        offsets.to(DEVICE),
        casts,
        limit,
        rounding,
        activation=activation,
        biases=tuple(b.to(DEVICE, DTYPE) for b in biases) if gpt_oss else None,
    )
    assert relative_error(out[:m], want.detach()) < TOLERANCE
    grads = mx_expert_mlp_backward(grad_out.to(DEVICE, DTYPE), saved)
    grad_rows = grads.rows
    assert relative_error(grad_rows[:m], leaves[0].grad) < TOLERANCE
    assert bool((grad_rows[m:] == 0).all())
    assert (grads.biases is not None) == gpt_oss
    routed = (grads.gate, grads.up, grads.down, *(grads.biases or ()))
    for ours, leaf in zip(routed, leaves[1:], strict=True):
        for e in range(experts):
            if sizes[e]:
                assert relative_error(ours[e], leaf.grad[e]) < TOLERANCE, e
            else:
                assert bool((ours[e] == 0).all()) and bool((leaf.grad[e] == 0).all())


def test_gradient_buffers_are_added_into():
    """The weights' and the biases' buffers (gradient accumulation)."""
    rows, weights, grad_out, offsets = problem([40, 24])
    on_device = [w.to(DEVICE, DTYPE) for w in weights]
    biases = tuple(b.to(DEVICE, DTYPE) for b in biases_of(2))
    casts = MXWeightValues.of(*on_device, ScaleRounding.RCEIL)
    rows, grad_out, offsets = rows.to(DEVICE, DTYPE), grad_out.to(DEVICE, DTYPE), offsets.to(DEVICE)

    def backward(*buffers):
        _, saved = mx_expert_mlp_forward(rows, offsets, casts, activation=GPT_OSS, biases=biases)
        grads = mx_expert_mlp_backward(
            grad_out, saved, *buffers[:3], grad_bias_buffers=buffers[3:] or (None,) * 3
        )
        return (grads.gate, grads.up, grads.down, *grads.biases)

    fresh = backward()
    buffers = [torch.ones_like(w, dtype=torch.float32) for w in (*on_device, *biases)]
    added = backward(*buffers)
    for total, buffer, alone in zip(added, buffers, fresh, strict=True):
        assert total is buffer
        assert relative_error(total - 1, alone.float()) < 2.0**-8


def test_the_weight_cache_casts_once_per_weight_update():
    weights = [w.to(DEVICE, DTYPE) for w in problem([8])[1]]
    cache = MXWeightCache()
    first = cache.get(*weights, ScaleRounding.RCEIL)
    assert cache.get(*weights, ScaleRounding.RCEIL) is first and cache.casts == 1
    with torch.no_grad():
        weights[2].mul_(2)  # an optimizer step: in place, the version counter moves
    second = cache.get(*weights, ScaleRounding.RCEIL)
    assert cache.casts == 2 and torch.equal(second.down, first.down * 2)
    assert cache.get(*weights, ScaleRounding.FLOOR) is not second and cache.casts == 3
    copies = [w.clone() for w in weights]  # equal values, other tensors: never served old casts
    cache.get(*copies, ScaleRounding.FLOOR)
    assert cache.casts == 4
    # The forward's layout alone (a call with no backward), then a call that needs both.
    cache.clear()
    forward_only = cache.get(*weights, ScaleRounding.RCEIL, backward=False)
    assert not forward_only.has_backward and cache.casts == 5
    assert torch.equal(forward_only.down, second.down)
    assert cache.get(*weights, ScaleRounding.RCEIL).has_backward and cache.casts == 6
    assert cache.get(*weights, ScaleRounding.RCEIL, backward=False).has_backward
    assert cache.casts == 6


@pytest.mark.parametrize("limit", [None, 2.0], ids=["casts saved", "bf16 pre-activations"])
def test_backward_that_releases_the_saved_casts_matches(limit):
    """`release=True` drops x's, h's and the pre-activations' saved casts once their values are
    made: the same gradients bit for bit, the saved state emptied. Bug caught: a saved cast
    released before the cast of it that a later product reads was made (the order of
    mx_expert_mlp_backward changed), or a product reading another operand's cast."""
    rows, weights, grad_out, offsets = problem([29, 0, 48, 11])
    on_device = [w.to(DEVICE, DTYPE) for w in weights]
    casts = MXWeightValues.of(*on_device, ScaleRounding.RCEIL)
    rows, grad_out, offsets = rows.to(DEVICE, DTYPE), grad_out.to(DEVICE, DTYPE), offsets.to(DEVICE)
    _, kept = mx_expert_mlp_forward(rows, offsets, casts, limit)
    _, released = mx_expert_mlp_forward(rows, offsets, casts, limit)
    expected = mx_expert_mlp_backward(grad_out, kept)
    got = mx_expert_mlp_backward(grad_out, released, release=True)
    assert all(torch.equal(a, b) for a, b in zip(got[:4], expected[:4], strict=True))
    assert got.biases is None and expected.biases is None
    assert (released.x, released.h, released.gate_up) == (None, None, None)
    with pytest.raises(ValueError, match="'rows' is not a saved cast"):
        kept.release("rows")


@pytest.mark.parametrize("casts_of", ["made ahead", "per pass"])
def test_gate_and_up_halves_of_one_tensor_are_cast_whole(casts_of):
    """W_gate and W_up as the halves of one [E, 2I, H] tensor (a model's gate_up_proj) are cast
    as that one tensor, their casts halves of one tensor too (no copy of each half), and the
    layer gives the same results bit for bit as with separate contiguous weights. Bugs caught: a
    block along I straddling the halves, the halves' casts swapped or taken from the wrong
    layout, a product misreading the casts' expert stride (2I rows)."""
    sizes = [29, 0, 48, 11]
    rows, weights, grad_out, offsets = problem(sizes)
    separate = [w.to(DEVICE, DTYPE) for w in weights]
    gate_up = torch.cat(separate[:2], dim=1)
    halves = (*gate_up_halves(gate_up), separate[2])
    assert are_gate_up_halves(*halves[:2])
    rows, grad_out, offsets = rows.to(DEVICE, DTYPE), grad_out.to(DEVICE, DTYPE), offsets.to(DEVICE)

    def casts(w_gate, w_up, w_down):
        if casts_of == "per pass":
            return MXWeightsCastPerPass(w_gate, w_up, w_down, ScaleRounding.FLOOR)
        return MXWeightValues.of(w_gate, w_up, w_down, ScaleRounding.FLOOR)

    whole, apart = casts(*halves), casts(*separate)
    for layout in ("forward_values", "backward_values"):
        got, want = getattr(whole, layout)(), getattr(apart, layout)()
        assert are_gate_up_halves(*got[:2])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), layout
    results = []
    for weight_casts in (whole, apart):
        out, saved = mx_expert_mlp_forward(rows, offsets, weight_casts, rounding="floor")
        results.append((out[: sum(sizes)], *mx_expert_mlp_backward(grad_out, saved)[:4]))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
