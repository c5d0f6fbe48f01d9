"""The reference layer against exact float64 math written independently, one token at a time."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mok.reference import combine, expert_mlp, grouped_expert_mlp, moe_forward, swiglu
from mok.weights import MoEWeights

from sum_order_cases import (
    contraction_sensitive_terms,
    order_sensitive_addends,
    power_of_two_weights,
    sequential_sum,
)


def naive_moe(x, topk_idx, topk_weights, weights, limit=None):
    """y[t] = shared(x[t]) + sum_j w[t, j] * expert(x[t]) in float64, token by token."""

    def mlp(v, w_gate, w_up, w_down):
        gate, up = w_gate @ v, w_up @ v
        if limit is not None:
            gate = torch.minimum(gate, torch.tensor(limit, dtype=gate.dtype))
            up = up.clamp(-limit, limit)
        return w_down @ (gate / (1 + torch.exp(-gate)) * up)

    w = weights.map(lambda t: t.double())
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        v = x[t].double()
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        if w.has_shared_expert:
            acc += mlp(v, w.shared_gate, w.shared_up, w.shared_down)
        for j in range(topk_idx.shape[1]):
            e = int(topk_idx[t, j])
            acc += float(topk_weights[t, j]) * mlp(v, w.gate[e], w.up[e], w.down[e])
        y[t] = acc
    return y


def random_layer(tokens, hidden, inter, experts, top_k, shared, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) / shape[-1] ** 0.5).to(
            dtype
        )

    weights = MoEWeights(
        gate=randn(experts, inter, hidden),
        up=randn(experts, inter, hidden),
        down=randn(experts, hidden, inter),
        shared_gate=randn(shared, hidden) if shared else None,
        shared_up=randn(shared, hidden) if shared else None,
        shared_down=randn(hidden, shared) if shared else None,
    )
    x = (torch.randn(tokens, hidden, generator=gen, dtype=torch.float64) * 2).to(dtype)
    keys = torch.rand(tokens, experts, generator=gen)
    idx = torch.argsort(keys, dim=-1)[:, :top_k]  # k distinct experts per token
    topk_weights = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64)
    return x, idx, topk_weights, weights


@pytest.mark.parametrize("shared", [0, 12], ids=["no-shared", "shared"])
@pytest.mark.parametrize("limit", [None, 0.75], ids=["no-clamp", "clamp"])
def test_float64_reference_is_exact(shared, limit):
    x, idx, w, weights = random_layer(9, 24, 10, 6, 3, shared, torch.float64)
    expected = naive_moe(x, idx, w, weights, limit)
    actual = moe_forward(x, idx, w, weights, limit)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shared", [0, 32], ids=["no-shared", "shared"])
def test_bf16_reference_within_bf16_rounding_of_exact_math(shared):
    x, idx, w, weights = random_layer(64, 96, 48, 8, 2, shared, torch.bfloat16)
    expected = naive_moe(x, idx, w.float(), weights)
    actual = moe_forward(x, idx, w.float(), weights)
    assert actual.dtype == torch.bfloat16
    error = (actual.double() - expected).norm() / expected.norm()
    # Two bf16 roundings (h, expert output) plus the final one: a few 2^-9 at most.
    assert error < 8e-3, error


@pytest.mark.parametrize("variant", ["swiglu", "gpt-oss"])
def test_gradients_match_finite_differences(variant):
    """Autograd through the reference against finite differences, plain SwiGLU and gpt-oss's
    experts (biases, alpha 1.702, up offset 1): catches a term of the activation or a bias that
    autograd does not see (detached, or added outside the graph)."""
    x, idx, w, weights = random_layer(5, 6, 4, 4, 2, 3, torch.float64, seed=3)
    activation = {}
    if variant == "gpt-oss":
        gen = torch.Generator().manual_seed(4)
        biases = {
            "gate_bias": torch.randn(4, 4, generator=gen, dtype=torch.float64),
            "up_bias": torch.randn(4, 4, generator=gen, dtype=torch.float64),
            "down_bias": torch.randn(4, 6, generator=gen, dtype=torch.float64),
        }
        weights = MoEWeights(**{**weights.tensors(), **biases})
        activation = {"swiglu_alpha": 1.702, "swiglu_up_offset": 1.0}
    names = [name for name, t in weights.tensors().items() if t is not None]
    inputs = [x, w] + [getattr(weights, name) for name in names]
    inputs = [t.clone().requires_grad_(True) for t in inputs]

    def fn(x, w, *tensors):
        weights = MoEWeights(**dict(zip(names, tensors, strict=True)))
        return moe_forward(x, idx, w, weights, swiglu_limit=0.9, **activation)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("shared", [False, True], ids=["no-shared", "shared"])
def test_combine_order_decides_the_result_on_order_sensitive_data(shared):
    """Catches a combine that adds the k outputs in another order than j = 0, 1, ..., k-1 after
    the shared output (reversed, pairwise, shared output last): on these addends every other order
    changes the bf16 result, which the test checks too."""
    tokens, top_k, hidden = 16, 4, 64
    addends = order_sensitive_addends(tokens, shared + top_k, hidden, seed=top_k + shared)
    weights = power_of_two_weights(tokens, top_k, seed=1)
    products = addends[:, shared:]
    expert_out = (products / weights[..., None]).to(torch.bfloat16)
    shared_out = addends[:, 0].to(torch.bfloat16) if shared else None
    want = sequential_sum(addends).to(torch.bfloat16)
    assert torch.equal(combine(expert_out, weights, shared_out), want)

    other_orders = [torch.cat([addends[:, :shared], products.flip(1)], 1)]
    if shared:
        other_orders.append(torch.cat([products, addends[:, :1]], 1))
    for addends_in_other_order in other_orders:
        assert not torch.equal(sequential_sum(addends_in_other_order).to(torch.bfloat16), want)


def test_combine_rounds_each_product_before_adding_it():
    """Catches a combine that fuses multiply and add (torch.addcmul, an FMA): the contract rounds
    w * out to fp32 first, which gives 0 here where one rounding gives 2^-24."""
    terms, weights = contraction_sensitive_terms(64)
    result = combine(terms.to(torch.bfloat16), weights)
    assert torch.equal(result, torch.zeros(1, 64, dtype=torch.bfloat16))
    fused = torch.addcmul(weights[:, 0, None] * terms[:, 0], weights[:, 1, None], terms[:, 1])
    assert torch.equal(fused, torch.full((1, 64), 2.0**-24))


def test_grouped_expert_mlp_reaches_each_weight_tensor_through_one_graph_node():
    """Catches a backward that grows with the square of the experts: indexing w[e] inside the loop
    over experts makes autograd build and add a full-size [E, ...] gradient per expert (about 20 s
    of backward at E = 64); unbinding each weight tensor once stacks one buffer."""
    x, _, _, weights = random_layer(12, 16, 8, 6, 1, 0, torch.float32)
    weights = weights.map(lambda t: t.requires_grad_(True))
    out = grouped_expert_mlp(x, [2, 0, 3, 4, 1, 2], weights.gate, weights.up, weights.down)
    edges_into = {name: 0 for name in ("gate", "up", "down")}
    leaves = {id(getattr(weights, name)): name for name in edges_into}
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        for successor, _ in node.next_functions:
            if successor is None:
                continue
            variable = getattr(successor, "variable", None)
            if variable is not None and id(variable) in leaves:
                edges_into[leaves[id(variable)]] += 1
            if successor not in seen:
                seen.add(successor)
                stack.append(successor)
    assert edges_into == {"gate": 1, "up": 1, "down": 1}


@given(limit=st.floats(0.1, 5.0), seed=st.integers(0, 2**16))
def test_swiglu_clamp(limit, seed):
    gen = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(2, 64, generator=gen, dtype=torch.float64) * 4
    expected = torch.where(gate > limit, limit, gate)
    expected = expected * torch.sigmoid(expected) * up.clamp(-limit, limit)
    torch.testing.assert_close(swiglu(gate, up, limit), expected, rtol=1e-12, atol=1e-12)


def test_expert_mlp_rounds_h_and_output_to_input_dtype():
    x, _, _, weights = random_layer(8, 32, 16, 1, 1, 0, torch.bfloat16)
    out = expert_mlp(x, weights.gate[0], weights.up[0], weights.down[0])
    h = swiglu(x.float() @ weights.gate[0].float().T, x.float() @ weights.up[0].float().T)
    expected = (h.to(torch.bfloat16).float() @ weights.down[0].float().T).to(torch.bfloat16)
    assert torch.equal(out, expected)


def test_no_tokens_gives_an_empty_output_and_zero_shared_gradients():
    x, idx, w, weights = random_layer(0, 16, 8, 4, 2, 8, torch.bfloat16)
    weights = weights.map(lambda t: t.requires_grad_(True))
    y = moe_forward(x, idx, w, weights)
    assert y.shape == (0, 16)
    y.float().sum().backward()
    assert torch.count_nonzero(weights.shared_gate.grad) == 0
