"""The 128-block FP8 recipe's reference (`mok.reference.fp8_block`): its casts bit for bit against
torchao's eager blockwise casts and against the rule written out per element, and its GEMM
against the same sums formed one step at a time and against float64."""

import pytest
import torch

from mok.reference import fp8_block
from mok.reference.fp8_block import (
    BLOCK,
    E4M3_MAX,
    block_rows,
    dequantize_blocks,
    dequantize_tiles,
    quantize_blocks,
    quantize_tiles,
    scaled_matmul,
)


def spread(shape, seed=0, dtype=torch.bfloat16):
    """Random values whose tiles' magnitudes span many binades (so that the scales differ from
    tile to tile), with exact zeros, in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-12, 12, shape, generator=gen))
    x[torch.rand(shape, generator=gen) < 0.05] = 0.0
    return x.to(dtype)


def torchao_blockwise():
    """torchao's blockwise FP8 module, whose eager casts are the oracle (skips where the installed
    torchao has none)."""
    kernels = pytest.importorskip("torchao.prototype.blockwise_fp8_training.kernels")
    for name in ("torch_blockwise_scale_act_quant_lhs", "torch_blockwise_scale_weight_quant"):
        if not hasattr(kernels, name):
            pytest.skip(f"this torchao has no {name}")
    return kernels


def bits(values: torch.Tensor) -> torch.Tensor:
    return values.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiles_are_torchaos_activation_cast_bit_for_bit(dtype):
    """1 x 128 tiles along the last dimension against torchao's
    `torch_blockwise_scale_act_quant_lhs` (values' bits and descales). Catches the division in fp32
    instead of fp64, the product in x's dtype, a missing clamp (values past 448 become NaN in
    e4m3), a scale instead of its reciprocal."""
    kernels = torchao_blockwise()
    x = spread((64, 4 * BLOCK), dtype=dtype)
    want_values, want_descales = kernels.torch_blockwise_scale_act_quant_lhs(x, BLOCK)
    values, descales = quantize_tiles(x)
    assert torch.equal(bits(values), bits(want_values))
    assert torch.equal(descales, want_descales)


def test_blocks_are_torchaos_weight_cast_bit_for_bit():
    """128 x 128 blocks against torchao's `torch_blockwise_scale_weight_quant`. Catches blocks cut
    along the wrong dimension (a transposed block grid) and the amax of a row of blocks instead of
    one block."""
    kernels = torchao_blockwise()
    w = spread((3 * BLOCK, 2 * BLOCK), seed=1)
    want_values, want_descales = kernels.torch_blockwise_scale_weight_quant(w, BLOCK)
    values, descales = quantize_blocks(w)
    assert torch.equal(bits(values), bits(want_values))
    assert torch.equal(descales, want_descales)


def cast_one_tile(tile: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe's cast of one tile written out element by element, in Python floats."""
    amax = max(max(abs(float(v)) for v in tile.flatten()), fp8_block.AMAX_FLOOR)
    scale = torch.tensor(E4M3_MAX / amax, dtype=torch.float64).to(torch.float32)
    out = []
    for v in tile.flatten():
        product = torch.tensor(float(v), dtype=torch.float32) * scale
        out.append(product.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn))
    return torch.stack(out).reshape(tile.shape), 1.0 / scale


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_tiles_along_any_dimension_with_a_ragged_end_follow_the_rule(dim):
    """Tiles along the tokens (the weight gradient's operands) and along K, with sizes that are
    not multiples of 128: every tile against the rule applied to its own elements. Catches a
    ragged tile taking its amax over padding or over the next tile, and descales laid out along
    the wrong dimension."""
    x = spread((200, 300), seed=2)
    values, descales = quantize_tiles(x, dim)
    size = x.shape[dim]
    assert descales.shape[dim] == -(-size // BLOCK)
    for tile, start in enumerate(range(0, size, BLOCK)):
        part = x.narrow(dim, start, min(BLOCK, size - start))
        for line in range(x.shape[1 - dim % 2]):
            elements = part.select(1 - dim % 2, line)
            want_values, want_descale = cast_one_tile(elements)
            got = values.narrow(dim, start, part.shape[dim % 2]).select(1 - dim % 2, line)
            assert torch.equal(bits(got), bits(want_values))
            assert descales.select(1 - dim % 2, line)[tile] == want_descale


def test_a_tiles_largest_magnitude_maps_to_448_and_zeros_stay_zero():
    """Every tile with a nonzero element holds +-448 (its amax element); a tile of zeros gets
    zeros and a finite descale. Catches a scale off by a rounding step (the amax element at 416
    or saturating) and a division by zero (NaN values) for an all-zero tile."""
    x = spread((32, 3 * BLOCK), seed=3)
    x[5] = 0.0
    values, descales = quantize_tiles(x)
    largest = values.to(torch.float32).abs().reshape(32, 3, BLOCK).amax(-1)
    assert torch.all(largest[torch.arange(32) != 5] == E4M3_MAX)
    assert torch.all(values[5].to(torch.float32) == 0) and torch.isfinite(descales[5]).all()


def test_dequantized_tiles_and_blocks_are_within_half_an_e4m3_step():
    """|x - values * descale| <= half an e4m3 step of the value (relative 2^-4), times the
    descale, for tiles and blocks, batched over experts. Catches descales applied to the wrong
    tile or block (errors of whole binades) and a truncating cast (a full step)."""
    x = spread((100, 2 * BLOCK + 40), seed=4, dtype=torch.float32)
    values, descales = quantize_tiles(x)
    back = dequantize_tiles(values, descales)
    bound = dequantize_tiles(
        torch.ones_like(values, dtype=torch.float32).to(values.dtype), descales
    )
    half_step = torch.maximum(back.abs() * 2.0**-4, bound * 2.0**-9)  # subnormals: 2^-9 apart
    assert torch.all((x - back).abs() <= half_step)
    w = spread((2, 2 * BLOCK + 8, BLOCK + 64), seed=5, dtype=torch.float32)
    w_values, w_descales = quantize_blocks(w)
    assert w_descales.shape == (2, 3, 2)
    back = dequantize_blocks(w_values, w_descales)
    unit = dequantize_blocks(torch.ones_like(w).to(w_values.dtype), w_descales)
    assert torch.all((w - back).abs() <= torch.maximum(back.abs() * 2.0**-4, unit * 2.0**-10))


def test_the_gemm_adds_each_steps_scaled_partial_sums_in_order():
    """`scaled_matmul` (B a block cast) against the step-by-step sum written out, bit for bit, and
    against float64 math on the dequantized operands. Catches the descales applied after the
    whole sum (one scale for every step), B's block descales taken by column instead of row
    block, and a ragged last step dropped."""
    a = spread((96, 3 * BLOCK + 32), seed=6)
    b = spread((2 * BLOCK + 16, 3 * BLOCK + 32), seed=7)
    a_values, a_descales = quantize_tiles(a)
    b_values, b_descales = quantize_blocks(b)
    got = scaled_matmul(a_values, a_descales, b_values, block_rows(b_descales, b.shape[0]))
    want = torch.zeros_like(got)
    for step in range(a_descales.shape[1]):
        columns = slice(step * BLOCK, (step + 1) * BLOCK)
        partial = a_values[:, columns].float() @ b_values[:, columns].float().T
        for row_block in range(b_descales.shape[0]):
            rows = slice(row_block * BLOCK, (row_block + 1) * BLOCK)
            scale = a_descales[:, step, None] * b_descales[row_block, step]
            want[:, rows] = want[:, rows] + partial[:, rows] * scale
    assert torch.equal(got, want)
    exact = dequantize_tiles(a_values, a_descales).double() @ (
        dequantize_blocks(b_values, b_descales).double().T
    )
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-6 * exact.abs().max().item())
