"""gate and up handed to the layer as the halves of one [E, 2I, H] tensor (`gate_up`, as Hugging
Face models hold `gate_up_proj`): one gradient for that tensor, which the triton backend's
kernels write whole, instead of two views' gradients that autograd scatters into a third."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_grad_accumulation import CONFIG, DEVICE, micro_batch

import mok
from mok import ops
from mok.functional import create_workspace
from mok.testing import global_weights, relative_error
from mok.weights import (
    are_gate_up_halves,
    empty_gate_up_pair,
    gate_up_halves,
    joined_gate_up,
    whole_gate_up,
)

BACKENDS = [
    "reference",
    pytest.param("triton", marks=pytest.mark.interpreter) if DEVICE.type == "cpu" else "triton",
]


def test_joined_gate_up_hands_back_the_tensor_the_halves_view():
    """`empty_gate_up_pair`'s halves join into their own tensor (no copy); anything else is
    concatenated, gate first. Catches a join that hands back the base for halves in the wrong
    order (up, gate) or for unrelated tensors, and one that copies the fused buffer."""
    like = torch.empty(3, 4, 8)
    gate, up = empty_gate_up_pair(like)
    assert are_gate_up_halves(gate, up) and not are_gate_up_halves(up, gate)
    gate.copy_(torch.randn(3, 4, 8))
    up.copy_(torch.randn(3, 4, 8))
    joined = joined_gate_up(gate, up)
    assert joined._base is None and joined.data_ptr() == gate.data_ptr()
    assert torch.equal(joined, torch.cat((gate, up), dim=1))
    swapped = joined_gate_up(up, gate)
    assert swapped.data_ptr() != gate.data_ptr()
    assert torch.equal(swapped, torch.cat((up, gate), dim=1))
    apart = gate.clone(), up.clone()
    assert not are_gate_up_halves(*apart)
    assert torch.equal(joined_gate_up(*apart), joined)
    # Halves of a tensor with more than the two halves' rows (not gate_up's [E, 2I, H]).
    wider = torch.randn(3, 12, 8)
    assert not are_gate_up_halves(wider[:, :4], wider[:, 4:8])


def test_whole_gate_up_is_a_view_of_contiguous_halves_only():
    """`whole_gate_up` (what the MXFP8 weight casts cast in one piece) hands back the [E, 2I, H]
    tensor of two halves that tile it exactly, and None otherwise. Catches a view that takes up
    before gate, joins unrelated tensors, or spans the padding of rows wider than H (its cast
    would read and write memory that is not the weights)."""
    gate_up = torch.randn(3, 8, 32)
    whole = whole_gate_up(*gate_up_halves(gate_up))
    assert whole.data_ptr() == gate_up.data_ptr() and torch.equal(whole, gate_up)
    assert whole_gate_up(*reversed(gate_up_halves(gate_up))) is None
    assert whole_gate_up(*(half.clone() for half in gate_up_halves(gate_up))) is None
    padded = torch.randn(3, 8, 40)[:, :, :32]  # halves of a gate_up whose rows are 40 apart
    assert are_gate_up_halves(*gate_up_halves(padded))
    assert whole_gate_up(*gate_up_halves(padded)) is None


def _inputs(backend: str):
    config = CONFIG.replace(backend=backend)
    x, idx, w, grad_y = micro_batch(1, DEVICE)
    return config, global_weights(config, 0, DEVICE), x.detach(), idx, w, grad_y


def _leaves(weights: mok.MoEWeights) -> mok.MoEWeights:
    return weights.map(lambda t: t.detach().clone().requires_grad_(True))


def _with_gate_up(weights: mok.MoEWeights) -> tuple[mok.MoEWeights, torch.Tensor]:
    """(weights whose gate and up are the halves of a new leaf gate_up, that leaf)."""
    gate_up = torch.cat((weights.gate, weights.up), dim=1).detach().requires_grad_(True)
    gate, up = gate_up_halves(gate_up)
    return dataclasses.replace(_leaves(weights), gate=gate, up=up), gate_up


@pytest.mark.parametrize("backend", BACKENDS)
def test_gate_up_gets_the_gradients_of_gate_and_up_in_one_tensor(backend, monkeypatch):
    """`mok.moe(..., gate_up=)`: the same output, x gradient and weight gradients as separate
    gate and up leaves, bit for bit, with gate_up.grad = [grad gate; grad up]; a second call adds
    into it in place (fused accumulation into its halves). The triton backend
    hands back its gradient buffer itself (no concatenation). Catches gate and up swapped in the
    joined gradient, a gradient lost (None) for gate_up, reading other rows than its halves, and
    a backend that writes the halves into separate tensors (a copy per call; on GPUs: under the
    interpreter the backend computes in fp32 casts of each weight, and
    `test_expert_kernels.py` checks the halves' gradients)."""
    config, weights, x, idx, w, grad_y = _inputs(backend)
    layer = mok.MoE(config, device=DEVICE)
    joins = []

    def spy(gate, up):
        joins.append(are_gate_up_halves(gate, up))
        return joined_gate_up(gate, up)

    monkeypatch.setattr(mok.module, "joined_gate_up", spy)
    separate = _leaves(weights)
    x_separate = x.clone().requires_grad_(True)
    y_separate = mok.moe(x_separate, idx, w, separate, layer.workspace(DEVICE), False)
    y_separate.backward(grad_y)
    fused, gate_up = _with_gate_up(weights)
    x_fused = x.clone().requires_grad_(True)
    y_fused = mok.moe(x_fused, idx, w, fused, layer.workspace(DEVICE), True, gate_up=gate_up)
    y_fused.backward(grad_y)
    assert torch.equal(y_fused, y_separate)
    assert torch.equal(x_fused.grad, x_separate.grad)
    assert torch.equal(gate_up.grad, torch.cat((separate.gate.grad, separate.up.grad), dim=1))
    assert torch.equal(fused.down.grad, separate.down.grad)
    assert torch.equal(fused.shared_gate.grad, separate.shared_gate.grad)
    assert joins == [backend == "triton" and DEVICE.type == "cuda"]
    first, pointer = gate_up.grad.clone(), gate_up.grad.data_ptr()
    mok.moe(x, idx, w, fused, layer.workspace(DEVICE), True, gate_up=gate_up).backward(grad_y)
    # Added into the halves of gate_up.grad in place (fused accumulation): one rounding of the
    # fp32 sum, which under the interpreter's truncating bf16 stores may differ from 2x by a step.
    assert gate_up.grad.data_ptr() == pointer
    assert relative_error(gate_up.grad, first + first) < 1e-2


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_the_custom_op_takes_gate_up_whole(backend):
    """`mok.ops.moe` (what torch.compile traces) with gate_up: the op's weight list holds gate_up
    in place of gate and up, and its gradient equals the separate leaves' bit for bit. Catches
    the names and tensors of the op's weight list out of step (a gradient handed to another
    weight), gate_up's gradient concatenated in the wrong order. (The custom ops run the triton
    backend: the reference backend records an autograd graph inside the layer.)"""
    config, weights, x, idx, w, grad_y = _inputs(backend)
    workspace = create_workspace(config, None, DEVICE)
    workspace_id = ops.register_workspace(workspace)
    separate = _leaves(weights)
    ops.moe(x, idx, w, separate, workspace_id).backward(grad_y)
    fused, gate_up = _with_gate_up(weights)
    ops.moe(x, idx, w, fused, workspace_id, gate_up=gate_up).backward(grad_y)
    assert torch.equal(gate_up.grad, torch.cat((separate.gate.grad, separate.up.grad), dim=1))
    for name in ("down", "shared_gate", "shared_up", "shared_down"):
        assert torch.equal(getattr(fused, name).grad, getattr(separate, name).grad), name


def test_gate_up_that_is_not_the_weights_halves_is_refused():
    """A gate_up whose halves are not weights.gate and weights.up, or of the wrong shape, raises
    MoKInputError naming it (the layer would read one tensor and differentiate another)."""
    config, weights, x, idx, w, _ = _inputs("reference")
    layer = mok.MoE(config, device=DEVICE)
    fused, gate_up = _with_gate_up(weights)
    other = gate_up.detach().clone()
    with pytest.raises(mok.MoKInputError, match="halves of gate_up"):
        mok.moe(x, idx, w, fused, layer.workspace(DEVICE), gate_up=other)
    with pytest.raises(mok.MoKInputError, match=r"gate_up \(4, 16, 32\) must be \[E, 2I, H\]"):
        mok.moe(x, idx, w, fused, layer.workspace(DEVICE), gate_up=gate_up[:, :16])
