"""The MXFP8 expert MLP reference (`mok.reference.mx_expert`) and the layer on it.

The bitwise tests restate docs/mxfp8.md's table operand by operand with `mok.reference.mx` alone;
they catch an operand quantized along the wrong dimension (a backward reusing the forward's
weight layout, for instance), an operand left in bf16, h or the SwiGLU gradients cast from fp32
instead of from the bf16 tensors the bf16 layer holds, pre-activations saved in fp32 or bf16
instead of their MX cast (or cast under a clamp), token blocks that run past an expert's group.
The accuracy tests catch a quantization that does nothing (errors at bf16 level) or a wrong
scale (errors of O(1)).
"""

from __future__ import annotations

import pytest
import quantized_expert_cases
import torch
from quantized_expert_cases import (
    GPT_OSS,
    assert_fp8_level_accuracy,
    assert_the_layer_computes_in,
    assert_token_blocks_stay_inside_a_group,
    expert_biases,
    run,
    uneven,
)

import mok
from mok.reference import expert, mx
from mok.reference.expert import swiglu
from mok.reference.moe import mx_combine
from mok.reference.mx_expert import mx_grouped_expert_mlp

H, INTER = 64, 96


def q(t: torch.Tensor, dim: int) -> torch.Tensor:
    data, scales = mx.quantize(t, dim=dim)
    return mx.dequantize(data, scales, dim=dim)


def q_tokens(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % 32
    return q(torch.cat([t.float(), t.new_zeros(pad, t.shape[1]).float()]), 0)[: t.shape[0]]


def saved_preactivations(gate, up, limit):
    """The pre-activations as the MX layer saves them: cast along I from their bf16 rounding;
    under a clamp in bf16 as the bf16 layer saves them (clamp decisions kept)."""
    if limit is None:
        return q(gate.bfloat16(), 1), q(up.bfloat16(), 1)
    return expert.saved_preactivations(gate, up, limit, torch.bfloat16)


def problem(sizes, seed=0, scale_rows=None):
    return quantized_expert_cases.problem(sizes, H, INTER, seed, scale_rows)


@pytest.mark.parametrize("limit, gpt_oss", [(None, False), (1.0, False), (None, True), (1.0, True)])
def test_every_gemm_reads_its_operands_as_the_table_says(limit, gpt_oss):
    """gpt_oss: its activation and the experts' biases, added in fp32 to the MX products and
    never cast, their gradients the fp32 sums of the bf16 gradients (caught besides: a bias
    quantized, added after the bf16 rounding, or its gradient summed from fp32 values)."""
    sizes = [40, 0, 7, 33]
    rows, (w_gate, w_up, w_down), grad = problem(sizes)
    activation = GPT_OSS if gpt_oss else {}
    biases = expert_biases(sizes, H, INTER) if gpt_oss else None
    weights = [w_gate, w_up, w_down]
    out, (g_rows, g_gate, g_up, g_down, *g_biases) = run(
        mx_grouped_expert_mlp, rows, weights, grad, sizes, limit, biases, **activation
    )
    act = (limit, activation.get("alpha", 1.0), activation.get("up_offset", 0.0))
    start = 0
    for e, size in enumerate(sizes):
        r, g = rows[start : start + size], grad[start : start + size]
        if size == 0:
            assert not g_gate[e].any() and not g_up[e].any() and not g_down[e].any()
            assert all(not t[e].any() for t in g_biases)
            continue
        x_q = q(r, 1)
        b_gate, b_up, b_down = (0.0,) * 3 if biases is None else (b[e].float() for b in biases)
        gate_f = x_q @ q(w_gate[e], 1).T + b_gate
        up_f = x_q @ q(w_up[e], 1).T + b_up
        h_q = q(swiglu(gate_f, up_f, *act).bfloat16(), 1)
        assert torch.equal(out[start : start + size], (h_q @ q(w_down[e], 1).T + b_down).bfloat16())
        saved = [t.float().requires_grad_(True) for t in saved_preactivations(gate_f, up_f, limit)]
        grad_h = (q(g, 1) @ q(w_down[e], 0)).bfloat16().float()
        grads = torch.autograd.grad(swiglu(*saved, *act), saved, grad_h)
        grad_gate, grad_up = (t.bfloat16() for t in grads)
        want_rows = q(grad_gate, 1) @ q(w_gate[e], 0) + q(grad_up, 1) @ q(w_up[e], 0)
        assert torch.equal(g_rows[start : start + size], want_rows.bfloat16())
        assert torch.equal(g_down[e], (q_tokens(g).T @ q_tokens(h_q)).bfloat16())
        x_t = q_tokens(x_q)
        assert torch.equal(g_gate[e], (q_tokens(grad_gate).T @ x_t).bfloat16())
        assert torch.equal(g_up[e], (q_tokens(grad_up).T @ x_t).bfloat16())
        if biases is not None:
            for ours, summed in zip(g_biases, (grad_gate, grad_up, g), strict=True):
                assert torch.equal(ours[e], summed.float().sum(0).bfloat16())
        start += size


def test_accuracy_against_float64_is_mxfp8_level():
    assert_fp8_level_accuracy(mx_grouped_expert_mlp, H, INTER)


def test_token_blocks_stay_inside_an_expert_group():
    assert_token_blocks_stay_inside_a_group(mx_grouped_expert_mlp, H, INTER)


def test_the_layer_in_mxfp8_on_the_reference_backend():
    assert_the_layer_computes_in("mxfp8", H, INTER)


def test_the_router_weights_gradient_reads_the_outputs_mx_cast():
    """`mx_combine`: y and the gradients of the outputs and the shared expert are the bf16
    combine's bit for bit; the router weights' gradient is <grad y, Q_H(out)> in fp32 (what the
    layer saves in place of the outputs). Catches the cast along the wrong dimension (k or
    tokens instead of H), the bf16 outputs read instead, a cast that changes y."""
    gen = torch.Generator().manual_seed(4)
    tokens, top_k = 40, 3
    out = uneven(torch.randn(tokens, top_k, H, generator=gen), gen).bfloat16()
    weights = torch.rand(tokens, top_k, generator=gen)
    shared = torch.randn(tokens, H, generator=gen).bfloat16()
    grad_y = torch.randn(tokens, H, generator=gen).bfloat16()
    results = []
    for combine in (mok.reference.combine, mx_combine):
        leaves = [t.clone().requires_grad_(True) for t in (out, weights, shared)]
        y = combine(*leaves)
        y.backward(grad_y)
        results.append((y.detach(), *(t.grad for t in leaves)))
    (y, g_out, g_w, g_shared), (mx_y, mx_g_out, mx_g_w, mx_g_shared) = results
    assert torch.equal(mx_y, y) and torch.equal(mx_g_out, g_out)
    assert torch.equal(mx_g_shared, g_shared)
    want = torch.einsum("th,tkh->tk", grad_y.float(), q(out.view(-1, H), 1).view(out.shape))
    assert torch.allclose(mx_g_w, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mx_g_w, g_w, rtol=1e-3, atol=1e-3)


def test_a_rank_without_tokens():
    """T = 0 (a rank that gets no tokens): the MX combine and the cast of an empty tensor give
    empty results instead of failing on a reshape of nothing."""
    out = torch.zeros(0, 2, H, dtype=torch.bfloat16, requires_grad=True)
    weights = torch.zeros(0, 2, requires_grad=True)
    y = mx_combine(out, weights)
    y.backward(torch.zeros(0, H, dtype=torch.bfloat16))
    assert y.shape == (0, H) and out.grad.shape == out.shape and weights.grad.shape == (0, 2)
    for dim in (0, 1):
        data, scales = mx.quantize(torch.zeros(0, H), dim=dim)
        assert data.shape == (0, H) and scales.shape == ((0, H) if dim == 0 else (0, H // 32))
