"""`mok.integrations.torchtitan`: TorchTitan's MoE with its RoutedExperts running through MoK, on a
small layer built from TorchTitan's configs. Against a float64 copy, the MoK layer's output and
gradients must be as close as the native bf16 layer's (bf16 rounding), and the parameter names
stay TorchTitan's. Bugs these catch: w1 and w3 (gate and up) swapped, scores applied to the wrong
(token, slot), ids and scores transposed, gradients not reaching the experts' parameters."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import (  # noqa: E402
    GroupedExperts,
    MoE,
    RoutedExperts,
    TokenChoiceTopKRouter,
)
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

from mok.integrations import torchtitan as mok_torchtitan  # noqa: E402
from mok.testing import relative_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build_layer() -> torch.nn.Module:
    config = MoE.Config(
        num_experts=8,
        load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=64, hidden_dim=32, num_experts=8),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=8, top_k=2),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=8,
            top_k=2,
            gate=Linear.Config(in_features=64, out_features=8, bias=False),
            score_func="softmax",
        ),
    )
    torch.manual_seed(0)
    layer = config.build()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.2)
    return layer.to(DEVICE)


def results(layer, x, grad):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.backward(grad)
    grads = {name: p.grad.double() for name, p in layer.named_parameters()}
    return {"y": y.detach().double(), "grad x": x.grad.double(), **grads}


def test_routed_experts_through_mok_match_float64_to_bf16_rounding():
    base = build_layer()
    native = copy.deepcopy(base).bfloat16()
    ours = copy.deepcopy(base).bfloat16()
    assert mok_torchtitan.use_mok(ours) == 1
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in base.named_parameters()]
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 64, generator=generator).to(DEVICE)
    grad = torch.randn(3, 7, 64, generator=generator).to(DEVICE)
    exact = results(copy.deepcopy(base).double(), x.double(), grad.double())
    theirs = results(native, x.bfloat16(), grad.bfloat16())
    mine = results(ours, x.bfloat16(), grad.bfloat16())
    assert mine["routed_experts.inner_experts.w1_EFD"].abs().sum() > 0
    for name, want in exact.items():
        # bf16 roundings of h and of the outputs: ~5e-3; a swapped gate/up or score is O(1).
        error = relative_error(mine[name], want)
        assert error < 1.5e-2, (name, error)
        assert error <= 2 * relative_error(theirs[name], want) + 5e-3, name
