"""The 128-block FP8 grouped product (`mok.kernels.fp8_block`) against the recipe's GEMM
(`mok.reference.fp8_block.scaled_matmul`), group by group: under the interpreter on the CPU,
compiled on the GPU.

The two form the same sums in another order (the partial sums of a step, a multiply-add that the
GPU contracts), so they agree within fp32's rounding of those sums: each differs from the exact
value of the recipe's sums by at most (steps + 130) * 2^-24 times the sum of the terms'
magnitudes, and the test holds the difference to twice that. Bugs these catch, each far
outside it: a descale taken from the wrong row, column block or step (a tile of 64 columns
inside a 128 block, one of 256 across two blocks, the ragged last block of N), the partial sums
of a step scaled after they were added to the accumulator (or not at all), a step past K read
without its mask, an expert's weights or descales taken at another expert's offset, a group's
rows past its end multiplied by its expert, an e4m3 code decoded wrongly, and an output rounded
more than once.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok.kernels.fp8_block import TILES, block_scaled_grouped_mm
from mok.reference.fp8_block import (
    block_rows,
    dequantize_blocks,
    dequantize_tiles,
    quantize_blocks,
    quantize_tiles,
    scaled_matmul,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _problem(groups: list[int], n: int, k: int, seed: int = 0):
    """Random rows and weights cast by the reference: (A values, A descales, W values, W
    descales, group_offsets), the rows' magnitudes varying by row and the weights' by block."""
    generator = torch.Generator().manual_seed(seed)
    m, experts = sum(groups), len(groups)
    rows = torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 8
    weights = torch.randn(experts, n, k, generator=generator)
    weights = weights * (0.01 + torch.rand(experts, 1, 1, generator=generator))
    # Contiguous, as rows and weights come: the casts' views of K off the blocks keep their
    # padding's zeros past K, where a read past K would go unseen.
    a_values, a_descales = (t.contiguous() for t in quantize_tiles(rows.bfloat16()))
    w_values, w_descales = (t.contiguous() for t in quantize_blocks(weights.bfloat16()))
    offsets = torch.tensor([0, *torch.tensor(groups).cumsum(0).tolist()], dtype=torch.int32)
    return a_values, a_descales, w_values, w_descales, offsets


def _run(problem, out_dtype=torch.float32, cfg=TILES) -> torch.Tensor:
    on_device = [t.to(DEVICE) for t in problem]
    return block_scaled_grouped_mm(*on_device, out_dtype=out_dtype, cfg=cfg).cpu()


def _check_against_the_recipe(problem, out: torch.Tensor) -> None:
    a_values, a_descales, w_values, w_descales, offsets = problem
    steps = a_descales.shape[1]
    a_exact = dequantize_tiles(a_values, a_descales, dtype=torch.float64).abs()
    for e in range(w_values.shape[0]):
        start, end = offsets[e].item(), offsets[e + 1].item()
        n = w_values.shape[1]
        want = scaled_matmul(
            a_values[start:end], a_descales[start:end], w_values[e], block_rows(w_descales[e], n)
        )
        w_exact = dequantize_blocks(w_values[e], w_descales[e], dtype=torch.float64).abs()
        magnitude = a_exact[start:end] @ w_exact.T
        bound = 2 * (steps + 130) * 2.0**-24 * magnitude
        error = (out[start:end].double() - want.double()).abs()
        assert bool((error <= bound).all()), (e, (error - bound).max().item())


@pytest.mark.parametrize(
    ("groups", "n", "k"),
    [
        ([70, 0, 130, 3], 160, 200),  # an empty group, ragged groups, N and K off the blocks
        ([128, 64], 256, 384),  # whole tiles and blocks
    ],
)
def test_each_group_follows_the_recipe(groups, n, k):
    problem = _problem(groups, n, k)
    _check_against_the_recipe(problem, _run(problem))


@pytest.mark.parametrize("block_n", [64, 256])
def test_column_tiles_inside_and_across_weight_blocks(block_n):
    """A tile of 64 columns reads the descales of half a block, one of 256 those of two."""
    problem = _problem([40, 90], 320, 256, seed=1)
    cfg = dataclasses.replace(TILES, block_n=block_n)
    _check_against_the_recipe(problem, _run(problem, cfg=cfg))


def test_the_output_is_rounded_once():
    """The bf16 output is the fp32 accumulator rounded once, the same sums either way."""
    problem = _problem([33, 95], 128, 256, seed=2)
    exact = _run(problem, torch.float32)
    assert torch.equal(_run(problem, torch.bfloat16), exact.bfloat16())


def test_operands_that_do_not_fit_are_refused():
    a_values, a_descales, w_values, w_descales, offsets = _problem([4, 4], 128, 256)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        block_scaled_grouped_mm(a_values.float(), a_descales, w_values, w_descales, offsets)
    with pytest.raises(ValueError, match="descales"):
        block_scaled_grouped_mm(a_values, a_descales[:, :1], w_values, w_descales, offsets)
    with pytest.raises(ValueError, match="group_offsets"):
        block_scaled_grouped_mm(a_values, a_descales, w_values, w_descales, offsets[:2])
