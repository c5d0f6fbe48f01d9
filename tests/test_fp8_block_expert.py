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
import quantized_expert_cases
import torch
from quantized_expert_cases import (
    GPT_OSS,
    assert_fp8_level_accuracy,
    assert_the_layer_computes_in,
    assert_token_blocks_stay_inside_a_group,
    expert_biases,
    run,
)

import mok
from mok.reference.expert import saved_preactivations, swiglu
from mok.reference.fp8_block import (
    block_rows,
    dequantize_tiles,
    quantize_blocks,
    quantize_tiles,
    scaled_matmul,
)
from mok.reference.fp8_block_expert import fp8_block_grouped_expert_mlp

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


def problem(sizes, seed=0, scale_rows=None):
    return quantized_expert_cases.problem(sizes, H, INTER, seed, scale_rows)


@pytest.mark.parametrize("limit, gpt_oss", [(None, False), (1.0, True)])
def test_every_gemm_reads_its_operands_as_the_table_says(limit, gpt_oss):
    """Bit for bit, with an empty expert and a group of more than 128 rows (two token tiles);
    gpt-oss's activation and biases (added in fp32, never cast) with a clamp."""
    sizes = [150, 0, 7, 33]
    rows, (w_gate, w_up, w_down), grad = problem(sizes)
    activation = GPT_OSS if gpt_oss else {}
    biases = expert_biases(sizes, H, INTER) if gpt_oss else None
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
    assert_fp8_level_accuracy(fp8_block_grouped_expert_mlp, H, INTER)


def test_token_tiles_stay_inside_an_expert_group():
    assert_token_blocks_stay_inside_a_group(fp8_block_grouped_expert_mlp, H, INTER)


def test_the_layer_in_the_128_block_recipe_on_the_reference_backend():
    """The fused backend says it cannot run the recipe instead of computing bf16; the triton
    backend takes it (its tl kernels: tests/test_triton_backend_fp8_block.py)."""
    assert_the_layer_computes_in("fp8_block", H, INTER)
    fp8 = mok.get_preset("tiny").config(precision="fp8_block")
    assert mok.create_workspace(fp8).backend_name == "reference"
    from mok.backends.fused import FusedBackend
    from mok.backends.triton import TritonBackend

    cuda = torch.device("cuda", 0)
    reason = FusedBackend.unavailable_reason(fp8, cuda, None)
    assert reason is not None and "fp8_block" in reason
    assert TritonBackend.unavailable_reason(fp8, cuda, None) is None
