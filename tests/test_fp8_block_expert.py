"""The expert MLP in the 128-block FP8 recipe (`mok.reference.fp8_block_expert`).

The bitwise test restates the module docstring's table operand by operand with
`mok.reference.fp8_block` alone; it catches an operand cast along the wrong dimension, a weight's
block cast used untransposed in the backward, h or the SwiGLU gradients cast from fp32 instead of
from their bf16 rounding, the weight gradients reading r or h instead of their saved casts, and
token tiles that run past an expert's group. The accuracy tests catch a cast that does nothing
(errors at bf16 level) and a wrong descale (errors of O(1)).
"""

from __future__ import annotations

import pytest
import torch

import mok
from mok.reference.expert import grouped_expert_mlp, saved_preactivations, swiglu
from mok.reference.fp8_block import (
    block_rows,
    dequantize_tiles,
    quantize_blocks,
    quantize_tiles,
    scaled_matmul,
)
from mok.reference.fp8_block_expert import fp8_block_grouped_expert_mlp
from mok.testing import relative_error

H, INTER = 320, 192  # neither a multiple of 128: ragged last tiles and blocks


def along_last(t):
    """T_last(t): the tile cast along t's last dimension, as scaled_matmul's operand."""
    return quantize_tiles(t, -1)


def along_tokens(t):
    """T_m(t) of one group's rows t [m, C], as scaled_matmul's operand [C, m]."""
    values, descales = quantize_tiles(t, 0)
    return values.T, descales.T


def block(w, transposed=False):
    values, descales = quantize_blocks(w)
    if transposed:
        values, descales = values.T, descales.T
    return values, block_rows(descales, values.shape[0])


def uneven(t: torch.Tensor, gen) -> torch.Tensor:
    """t with every row and column scaled by its own power of two in [2^-6, 2^6], so that tiles
    along rows and along columns get different descales."""
    rows = torch.exp2(torch.randint(-6, 7, (*t.shape[:-1], 1), generator=gen).float())
    cols = torch.exp2(torch.randint(-6, 7, (*t.shape[:-2], 1, t.shape[-1]), generator=gen).float())
    return t * rows * cols


def problem(sizes, seed=0, scale_rows=None):
    gen = torch.Generator().manual_seed(seed)
    experts = len(sizes)
    rows = torch.randn(sum(sizes), H, generator=gen)
    if scale_rows is not None:
        rows = rows * scale_rows[:, None]
    weights = [
        torch.randn(experts, INTER, H, generator=gen) * H**-0.5,
        torch.randn(experts, INTER, H, generator=gen) * H**-0.5,
        torch.randn(experts, H, INTER, generator=gen) * INTER**-0.5,
    ]
    grad = torch.randn(sum(sizes), H, generator=gen)
    if scale_rows is None:
        rows, grad = uneven(rows, gen), uneven(grad, gen)
        weights = [uneven(w, gen) for w in weights]
    return rows.bfloat16(), [w.bfloat16() for w in weights], grad.bfloat16()


def run(fn, rows, weights, grad, sizes, limit=None, biases=None, **activation):
    """(out, gradients of rows, the weights and the biases, in that order) of one call."""
    leaves = [t.clone().requires_grad_(True) for t in (rows, *weights, *(biases or ()))]
    bias_leaves = tuple(leaves[4:]) if biases is not None else None
    out = fn(leaves[0], sizes, *leaves[1:4], limit, biases=bias_leaves, **activation)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


GPT_OSS = {"alpha": 1.702, "up_offset": 1.0}


def expert_biases(sizes, seed=5):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(len(sizes), INTER), (len(sizes), INTER), (len(sizes), H)]
    return [(torch.randn(shape, generator=gen) / 4).bfloat16() for shape in shapes]


@pytest.mark.parametrize("limit, gpt_oss", [(None, False), (1.0, True)])
def test_every_gemm_reads_its_operands_as_the_table_says(limit, gpt_oss):
    """Bit for bit, with an empty expert and a group of more than 128 rows (two token tiles);
    gpt-oss's activation and biases (added in fp32, never cast) with a clamp."""
    sizes = [150, 0, 7, 33]
    rows, (w_gate, w_up, w_down), grad = problem(sizes)
    activation = GPT_OSS if gpt_oss else {}
    biases = expert_biases(sizes) if gpt_oss else None
    out, (g_rows, g_gate, g_up, g_down, *g_biases) = run(
        fp8_block_grouped_expert_mlp, rows, [w_gate, w_up, w_down], grad, sizes, limit, biases,
        **activation,
    )  # fmt: skip
    act = (limit, activation.get("alpha", 1.0), activation.get("up_offset", 0.0))
    start = 0
    for e, size in enumerate(sizes):
        r, g = rows[start : start + size], grad[start : start + size]
        if size == 0:
            assert not g_gate[e].any() and not g_up[e].any() and not g_down[e].any()
            continue
        x_t = along_last(r)
        b_gate, b_up, b_down = (0.0,) * 3 if biases is None else (b[e].float() for b in biases)
        gate_f = scaled_matmul(*x_t, *block(w_gate[e])) + b_gate
        up_f = scaled_matmul(*x_t, *block(w_up[e])) + b_up
        h_t = along_last(swiglu(gate_f, up_f, *act).bfloat16())
        want_out = (scaled_matmul(*h_t, *block(w_down[e])) + b_down).bfloat16()
        assert torch.equal(out[start : start + size], want_out)
        saved = saved_preactivations(gate_f, up_f, limit, torch.bfloat16)
        saved = [t.float().requires_grad_(True) for t in saved]
        grad_h = scaled_matmul(*along_last(g), *block(w_down[e], True)).bfloat16().float()
        grads = torch.autograd.grad(swiglu(*saved, *act), saved, grad_h)
        grad_gate, grad_up = (t.bfloat16() for t in grads)
        want_rows = scaled_matmul(*along_last(grad_gate), *block(w_gate[e], True))
        want_rows = want_rows + scaled_matmul(*along_last(grad_up), *block(w_up[e], True))
        assert torch.equal(g_rows[start : start + size], want_rows.bfloat16())
        x_tokens = along_tokens(dequantize_tiles(*x_t))
        h_tokens = along_tokens(dequantize_tiles(*h_t))
        assert torch.equal(g_down[e], scaled_matmul(*along_tokens(g), *h_tokens).bfloat16())
        assert torch.equal(g_gate[e], scaled_matmul(*along_tokens(grad_gate), *x_tokens).bfloat16())
        assert torch.equal(g_up[e], scaled_matmul(*along_tokens(grad_up), *x_tokens).bfloat16())
        if biases is not None:
            for ours, summed in zip(g_biases, (grad_gate, grad_up, g), strict=True):
                assert torch.equal(ours[e], summed.float().sum(0).bfloat16())
        start += size


def test_accuracy_against_float64_is_fp8_level():
    """e4m3 (3 mantissa bits) is ~8x coarser than bf16 (7 bits): the recipe's error against
    unquantized float64 math lies well above the bf16 reference's and well below O(1), for the
    output and every gradient."""
    sizes = [64, 160, 32]
    rows, weights, grad = problem(sizes, seed=1)
    fp8_out, fp8_grads = run(fp8_block_grouped_expert_mlp, rows, weights, grad, sizes)
    bf_out, bf_grads = run(grouped_expert_mlp, rows, weights, grad, sizes)
    exact_out, exact_grads = run(
        grouped_expert_mlp, rows.double(), [w.double() for w in weights], grad.double(), sizes
    )
    for fp8_t, bf_t, exact in zip(
        [fp8_out, *fp8_grads], [bf_out, *bf_grads], [exact_out, *exact_grads], strict=True
    ):
        fp8_error, bf_error = relative_error(fp8_t, exact), relative_error(bf_t, exact)
        assert 2 * bf_error < fp8_error < 0.1, (fp8_error, bf_error)


def test_token_tiles_stay_inside_an_expert_group():
    """Expert 0's rows are 2^20 times larger than expert 1's: a 128-row tile shared by the two
    groups would flush expert 1's rows to zero in its weight gradients."""
    sizes = [5, 27]
    scale = torch.cat([torch.full((5,), 2.0**20), torch.ones(27)])
    rows, weights, grad = problem(sizes, seed=2, scale_rows=scale)
    _, fp8_grads = run(fp8_block_grouped_expert_mlp, rows, weights, grad, sizes)
    _, exact = run(
        grouped_expert_mlp, rows.double(), [w.double() for w in weights], grad.double(), sizes
    )
    assert relative_error(fp8_grads[1][1], exact[1][1]) < 0.1  # grad W_gate of expert 1


def test_the_layer_in_the_128_block_recipe_on_the_reference_backend():
    """mok.MoE with precision="fp8_block": the routed experts in the recipe (outputs within FP8
    accuracy of the bf16 layer's, but not equal to them), repeatable bit for bit; the kernel
    backends say they cannot run it instead of computing bf16. Catches the precision dropped on
    the way to the reference's experts (the bf16 layer's results) and a kernel backend taking a
    precision it would compute in bf16."""
    config = mok.MoKConfig(
        hidden_size=H, intermediate_size=INTER, num_experts=4, top_k=2, shared_intermediate_size=32
    )
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(48, H, generator=gen).bfloat16()
    idx = torch.argsort(torch.rand(48, 4, generator=gen), -1)[:, :2]
    w = torch.softmax(torch.randn(48, 2, generator=gen), -1)
    results = []
    for precision in ("bf16", "fp8_block", "fp8_block"):
        layer = mok.MoE(config.replace(precision=precision, backend="reference"))
        layer.load_global_weights(mok.testing.global_weights(config, 0, torch.device("cpu")))
        x_leaf = x.clone().requires_grad_(True)
        layer(x_leaf, idx, w).float().square().sum().backward()
        results.append((x_leaf.grad, layer.gate.grad))
    (bf_x, bf_gate), (fp8_x, fp8_gate), (again_x, again_gate) = results
    assert torch.equal(fp8_x, again_x) and torch.equal(fp8_gate, again_gate)
    assert 0 < relative_error(fp8_x, bf_x) < 0.1
    assert 0 < relative_error(fp8_gate, bf_gate) < 0.1
    fp8 = config.replace(precision="fp8_block")
    assert mok.create_workspace(fp8).backend_name == "reference"
    from mok.backends.fused import FusedBackend
    from mok.backends.triton import TritonBackend

    for backend in (TritonBackend, FusedBackend):
        reason = backend.unavailable_reason(fp8, torch.device("cuda", 0), None)
        assert reason is not None and "fp8_block" in reason
