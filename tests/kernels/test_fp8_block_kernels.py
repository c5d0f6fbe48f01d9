"""The 128-block FP8 recipe's kernels (`mok.kernels.fp8_block`) against its reference
(`mok.reference.fp8_block`): under the interpreter on the CPU, compiled on the GPU.

The cast of 1 x 128 tiles: bit for bit (values and descales). Bugs these catch: the descale by
the GPU's fast division (off by an ulp; on the GPU), an amax that lets a NaN through as a number
or misses a tile's last elements, a scale from the wrong tile or row, a floor not applied (a tile
of zeros with an infinite scale), e4m3 rounding off at ties or in the subnormal range.

The cast along each group's tokens (the weight gradients' operands): bit for bit, each group's
tiles from its first row, their descales at the row-tile table's rows. Catches tiles cut from the
start of the rows instead of each group's, a group's last tile reaching into the next group's
rows, descales stored at the wrong tile.

The weight gradient against the recipe's GEMM over each group's tokens, expert by expert, within
the same rounding bound as the product: a step's descales from another tile or expert, a group's
tokens past its end, an expert without rows not zeros.

The grouped product against the recipe's GEMM (`scaled_matmul`), group by group (the tl kernel
here; the Gluon kernel on the FP8 tensor cores below).
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
from mx_cases import assert_same_bits, blocks_of_every_kind

from mok.kernels import warp_specialized
from mok.kernels.fp8_block import (
    TILES,
    BlockRows,
    block_quantize_rows,
    block_quantize_tiles,
    block_quantize_tokens,
    block_quantize_weights,
    block_scaled_grouped_mm,
    block_scaled_grouped_wgrad,
    quantize_side_by_side,
    token_tile_starts,
)
from mok.kernels.grouped_gemm import row_tile_map
from mok.kernels.host import Activation
from mok.reference.expert import activation_gradients
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


def _check_against_the_recipe(problem, out: torch.Tensor, step_sums: float = 0.0) -> None:
    """out within fp32's rounding of the recipe's sums, plus `step_sums` times the terms'
    magnitudes (what the FP8 tensor cores' sums of a step may lose, summed over the steps)."""
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
        bound = (2 * (steps + 130) * 2.0**-24 + step_sums) * magnitude
        if out.dtype == torch.bfloat16:
            bound += 2.0**-8 * want.double().abs()
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


FP8_TENSOR_CORE_SUMS = 2.0**-7
"""What the FP8 tensor cores' sum of a step's 128 products may lose, relative to the sum of the
products' magnitudes: they keep about 14 bits (DeepSeek-V3's report), so the bound allows the
truncations of a step's 4 instructions of 32 products. Far below what wrong math gives: a step
dropped or scaled twice, or a descale of another row, block or expert (those are O(1) of the
magnitude here, where rows, experts and blocks are scaled differently)."""


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("groups", "n", "k"),
    [
        ([70, 0, 130, 3], 320, 208),  # empty, ragged groups; N's last block and K's last step part
        ([128, 64, 192], 256, 384),  # whole tiles and blocks
    ],
)
def test_the_fp8_tensor_core_product_follows_the_recipe(groups, n, k, out_dtype):
    """The Gluon kernel (`warp_specialized.block_scaled_grouped_mm`): each step summed by the
    FP8 tensor cores from zero, then scaled and added in fp32; within the FP8 sums' bound."""
    problem = _problem(groups, n, k, seed=3)
    a_values, a_descales, w_values, w_descales, offsets = (t.to(DEVICE) for t in problem)
    tiles = row_tile_map(offsets, a_values.shape[0], warp_specialized.BLOCK_SCALED_TILES.block_m)
    out = warp_specialized.block_scaled_grouped_mm(
        a_values, a_descales, w_values, w_descales, offsets, tiles, out_dtype
    )
    _check_against_the_recipe(problem, out.cpu(), FP8_TENSOR_CORE_SUMS)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_the_fp8_tensor_core_down_data_gradient_follows_the_recipe():
    """`warp_specialized.block_scaled_down_dgrad_swiglu`: grad h from the FP8 tensor cores (the
    products' bound, as above), rounded to bf16, through gpt-oss's clamped activation's backward
    on the saved pre-activations, each half rounded once; within the bound carried through the
    backward (|d grad gate / d grad h| <= 1.1 (|up| + 1), |d grad up / d grad h| <= |gate|) and
    one bf16 rounding of grad h. Catches W_down read along N instead of K (the bf16 kernel's
    way), the saved gate and up halves swapped, grad h not rounded, the clamp's zeros missing."""
    groups, n, k = [70, 0, 130, 3], 192, 208
    a_values, a_descales, w_values, w_descales, offsets = _problem(groups, n, k, seed=12)
    m = sum(groups)
    generator = torch.Generator().manual_seed(13)
    gate_up = (torch.randn(m, 2 * n, generator=generator) * 4).bfloat16()
    limit, activation = 7.0, Activation(1.702, 1.0)
    on = [t.to(DEVICE) for t in (a_values, a_descales, w_values, w_descales, offsets, gate_up)]
    tiles = row_tile_map(on[4], m, warp_specialized.BLOCK_SCALED_TILES.block_m)
    grad_gate_up = warp_specialized.block_scaled_down_dgrad_swiglu(
        on[0], on[1], (on[2], on[3]), on[4], tiles, on[5], limit, activation
    ).cpu()
    a_exact = dequantize_tiles(a_values, a_descales, dtype=torch.float64).abs()
    relative = 2 * (a_descales.shape[1] + 130) * 2.0**-24 + FP8_TENSOR_CORE_SUMS
    for e in range(len(groups)):
        start, end = offsets[e].item(), offsets[e + 1].item()
        grad_h = scaled_matmul(
            a_values[start:end], a_descales[start:end], w_values[e], block_rows(w_descales[e], n)
        )
        w_exact = dequantize_blocks(w_values[e], w_descales[e], dtype=torch.float64).abs()
        bound = relative * (a_exact[start:end] @ w_exact.T) + 2.0**-8 * grad_h.double().abs()
        gate, up = gate_up[start:end, :n], gate_up[start:end, n:]
        wants = activation_gradients(
            gate, up, grad_h.bfloat16().float(), (limit, activation.alpha, activation.up_offset),
            torch.bfloat16,
        )  # fmt: skip
        slopes = (1.1 * (up.double().abs() + 1.0), gate.double().abs())
        for half, (want, slope) in enumerate(zip(wants, slopes, strict=True)):
            got = grad_gate_up[start:end, half * n : (half + 1) * n].double()
            error = (got - want.double()).abs()
            allowed = slope * bound + 2.0**-8 * want.double().abs() + 1e-6
            assert bool((error <= allowed).all()), (e, half)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_the_fp8_tensor_core_gate_up_product_follows_the_recipe():
    """`warp_specialized.block_scaled_gate_up_swiglu`: the gate and up products of one pass over
    A, each expert's biases and SwiGLU in fp32, h and the saved pre-activations rounded once;
    within the FP8 sums' bound, carried through SwiGLU for h (|d h / d gate| <= 1.1 |up|,
    |d h / d up| <= |gate| + 0.3). Catches W_up's descales read for gate (or the reverse), another
    expert's biases, a step of one of the two products dropped."""
    groups, n, k = [70, 0, 130, 3], 192, 208
    generator = torch.Generator().manual_seed(9)
    m, experts = sum(groups), len(groups)
    rows = torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 4
    casts = []
    for _ in range(2):
        w = torch.randn(experts, n, k, generator=generator)
        w = w * (0.01 + torch.rand(experts, 1, 1, generator=generator)) * k**-0.5
        casts.append(tuple(t.contiguous() for t in quantize_blocks(w.bfloat16())))
    biases = [torch.randn(experts, n, generator=generator).bfloat16() for _ in range(2)]
    a_values, a_descales = (t.contiguous() for t in quantize_tiles(rows.bfloat16()))
    offsets = torch.tensor([0, *torch.tensor(groups).cumsum(0).tolist()], dtype=torch.int32)
    on = [t.to(DEVICE) for t in (a_values, a_descales, offsets)]
    tiles = row_tile_map(on[2], m, warp_specialized.BLOCK_SCALED_SWIGLU_TILES.block_m)
    h, gate_up = warp_specialized.block_scaled_gate_up_swiglu(
        on[0], on[1], *([t.to(DEVICE) for t in cast] for cast in casts), on[2], tiles, None,
        True, biases=[b.to(DEVICE) for b in biases],
    )  # fmt: skip
    h, gate_up = h.cpu().double(), gate_up.cpu().double()
    a_exact = dequantize_tiles(a_values, a_descales, dtype=torch.float64).abs()
    relative = 2 * (a_descales.shape[1] + 130) * 2.0**-24 + FP8_TENSOR_CORE_SUMS
    for e in range(experts):
        start, end = offsets[e].item(), offsets[e + 1].item()
        wants, bounds = [], []
        for (values, descales), bias in zip(casts, biases, strict=True):
            product = scaled_matmul(
                a_values[start:end], a_descales[start:end], values[e], block_rows(descales[e], n)
            )
            wants.append(product.double() + bias[e].double())
            w_exact = dequantize_blocks(values[e], descales[e], dtype=torch.float64).abs()
            bounds.append(relative * (a_exact[start:end] @ w_exact.T))
        for half, (want, bound) in enumerate(zip(wants, bounds, strict=True)):
            saved = gate_up[start:end, half * n : (half + 1) * n]
            assert bool(((saved - want).abs() <= bound + 2.0**-8 * want.abs()).all()), (e, half)
        (gate, up), (gate_bound, up_bound) = wants, bounds
        want_h = torch.nn.functional.silu(gate) * up
        h_bound = 1.1 * up.abs() * gate_bound + (gate.abs() + 0.3) * up_bound
        error = (h[start:end] - want_h).abs()
        assert bool((error <= h_bound + 2.0**-8 * want_h.abs() + 1e-6).all()), e


def test_the_fp8_tensor_core_product_refuses_what_it_cannot_take():
    """Off Hopper, or K not in 16-byte rows: a ValueError naming the tl kernel to use."""
    problem = [t.to(DEVICE) for t in _problem([8, 8], 128, 200)]
    tiles = row_tile_map(problem[-1], 16, warp_specialized.BLOCK_SCALED_TILES.block_m)
    with pytest.raises(ValueError, match="fp8_block.block_scaled_grouped_mm"):
        warp_specialized.block_scaled_grouped_mm(*problem, tiles)


def _assert_the_cast_is(cast, want) -> None:
    """A cast (values, descales) on the device is the reference's: the values' bytes (any NaN
    code for NaN), NaN descales where the reference's are, the others equal."""
    (values, descales), (want_values, want_descales) = cast, want
    assert_same_bits(values.cpu().view(torch.uint8), want_values.contiguous().view(torch.uint8))
    nan = want_descales.isnan()
    assert torch.equal(descales.cpu().isnan(), nan)
    assert torch.equal(descales.cpu()[~nan], want_descales[~nan])


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's numpy,
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # on the infinities' tiles
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cast_is_the_references_bit_for_bit(dtype):
    """Tiles over magnitudes 2^-140 .. 2^120 with a NaN, infinities, subnormals, powers of two
    and e4m3 ties (`blocks_of_every_kind`), a tile of zeros and one below the amax floor (their
    scales from the floor), K ragged (200: the last tile of 72)."""
    x = blocks_of_every_kind(dtype)[:, :200]
    x[8, :128] = 0.0
    x[9, 128:] = torch.linspace(-3e-13, 3e-13, 72)
    _assert_the_cast_is(block_quantize_tiles(x.to(DEVICE)), quantize_tiles(x))


def test_packed_rows_hold_the_cast_bit_for_bit():
    """`block_quantize_rows`: each packed row's values and descales are `block_quantize_tiles`'s,
    after a round trip through the exchange's row dtype; 0.52x a bf16 row's bytes at H = 7168.
    Catches descales written over the values or past the row, a row stride taken as K, and a
    packed width the exchange would cut."""
    x = torch.randn(37, 272, generator=torch.Generator().manual_seed(8)).bfloat16().to(DEVICE)
    packed = block_quantize_rows(x)
    moved = BlockRows.from_rows(packed.as_rows(torch.bfloat16).clone(), 272)
    values, descales = block_quantize_tiles(x)
    assert torch.equal(moved.codes.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(moved.descales, descales)
    assert BlockRows.row_bytes(272) == 288 and BlockRows.row_bytes(7168) / (2 * 7168) < 0.52


def test_the_cast_of_rows_of_a_wider_tensor():
    """Rows with a stride past K (a view of a wider tensor): each row read from its own start."""
    wide = blocks_of_every_kind(torch.bfloat16, seed=3)
    x = wide[:, 16 : 16 + 3 * 128]
    values, descales = block_quantize_tiles(x.to(DEVICE))
    want_values, want_descales = quantize_tiles(x)
    assert_same_bits(values.cpu().view(torch.uint8), want_values.view(torch.uint8))
    nan = want_descales.isnan()
    assert torch.equal(descales.cpu()[~nan], want_descales[~nan])


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's numpy,
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # on the infinities' tiles
def test_the_cast_along_each_groups_tokens_is_the_references():
    """Groups of 130, 0, 40 and 300 rows after 6 rows outside them (tiles of 128 and ragged
    ones); values over many binades with the special ones of `blocks_of_every_kind`."""
    x = blocks_of_every_kind(torch.bfloat16, seed=4).repeat(8, 1)[:, :96]
    groups, first = [130, 0, 40, 300], 6
    offsets = torch.tensor([first, *(first + torch.tensor(groups).cumsum(0)).tolist()])
    offsets = offsets.to(torch.int32)
    tiles = row_tile_map(offsets.to(DEVICE), x.shape[0], 128)
    values, descales = block_quantize_tokens(x.to(DEVICE), tiles)
    values, descales = values.cpu().view(torch.uint8), descales.cpu()
    tile = 0
    for start, size in zip(offsets[:-1].tolist(), groups, strict=True):
        want_values, want_descales = quantize_tiles(x[start : start + size], dim=0)
        assert_same_bits(values[start : start + size], want_values.view(torch.uint8))
        got = descales[tile : tile + want_descales.shape[0]]
        nan = want_descales.isnan()
        assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan], want_descales[~nan])
        tile += want_descales.shape[0]


def test_the_cast_along_the_tokens_of_a_tile_cast_reads_it_as_its_values():
    """`block_quantize_tokens` of a 1 x 128 tile cast (as the backward casts the saved rows and h
    again along the tokens), here packed rows as the exchange brings them (strided values and
    descales): bit for bit the cast of `dequantize_tiles` of it. Catches a descale of another
    column tile or row, a row stride taken from the values for the descales, the e4m3 decode
    rounding."""
    x = blocks_of_every_kind(torch.bfloat16, seed=5).repeat(4, 1)[:, :272]
    x[~torch.isfinite(x)] = 1.0  # the packed cast's tiles: finite values only
    groups, first = [130, 0, 100], 3
    offsets = torch.tensor([first, *(first + torch.tensor(groups).cumsum(0)).tolist()])
    tiles = row_tile_map(offsets.to(torch.int32).to(DEVICE), x.shape[0], 128)
    packed = block_quantize_rows(x.to(DEVICE))
    got = block_quantize_tokens((packed.codes, packed.descales), tiles)
    want = block_quantize_tokens(dequantize_tiles(packed.codes, packed.descales), tiles)
    rows = slice(first, first + sum(groups))
    assert torch.equal(got[0][rows].view(torch.uint8), want[0][rows].view(torch.uint8))
    used = tiles.counts[0].item()
    assert torch.equal(got[1][:used], want[1][:used])


def _wgrad_problem():
    """Groups of 200 (a whole tile and a ragged one), 0 and 90 tokens after 5 rows outside them:
    (grad [M, N], x [M, K] bf16, offsets on the device, the groups, the first row)."""
    generator = torch.Generator().manual_seed(5)
    groups, first = [200, 0, 90], 5
    m = first + sum(groups)
    grad = torch.randn(m, 128, generator=generator) * torch.rand(m, 1, generator=generator) * 4
    x = torch.randn(m, 80, generator=generator) * torch.rand(1, 80, generator=generator)
    offsets = torch.tensor([first, *(first + torch.tensor(groups).cumsum(0)).tolist()])
    return grad.bfloat16(), x.bfloat16(), offsets.to(torch.int32).to(DEVICE), groups, first


def _check_wgrad(out, grad, x, groups, first, step_sums=0.0):
    """out [E, N, K] within fp32's rounding of the recipe's sums over each group's tokens, plus
    `step_sums` times the terms' magnitudes; zeros for an expert without tokens."""
    start = first
    for e, size in enumerate(groups):
        g_values, g_descales = quantize_tiles(grad[start : start + size], dim=0)
        x_values, x_descales = quantize_tiles(x[start : start + size], dim=0)
        want = scaled_matmul(g_values.T, g_descales.T, x_values.T, x_descales.T)
        g_exact = dequantize_tiles(g_values, g_descales, dim=0, dtype=torch.float64).abs()
        x_exact = dequantize_tiles(x_values, x_descales, dim=0, dtype=torch.float64).abs()
        relative = 2 * (g_descales.shape[0] + 130) * 2.0**-24 + step_sums
        bound = relative * (g_exact.T @ x_exact)
        error = (out[e].double() - want.double()).abs()
        assert bool((error <= bound).all()), (e, (error - bound).max().item())
        if size == 0:
            assert not out[e].any()
        start += size


def test_the_weight_gradient_follows_the_recipe():
    """The tl kernel; K 80 off the tiles."""
    grad, x, offsets, groups, first = _wgrad_problem()
    tiles = row_tile_map(offsets, grad.shape[0], 128)
    g_cast = block_quantize_tokens(grad.to(DEVICE), tiles)
    x_cast = block_quantize_tokens(x.to(DEVICE), tiles)
    out = block_scaled_grouped_wgrad(*g_cast, *x_cast, offsets).cpu()
    _check_wgrad(out, grad, x, groups, first)


def test_the_cast_along_the_tokens_transposed_holds_the_same_codes():
    """`block_quantize_tokens(transposed=True)`: each tile's codes at its 128 columns, a group's
    tokens past its end zeros, the same descales. Catches a tile at another tile's columns, the
    padding left unwritten (another group's tokens summed into a weight gradient)."""
    grad, _, offsets, groups, first = _wgrad_problem()
    tiles = row_tile_map(offsets, grad.shape[0], 128)
    values, descales = block_quantize_tokens(grad.to(DEVICE), tiles)
    values_t, descales_t = block_quantize_tokens(grad.to(DEVICE), tiles, transposed=True)
    values, values_t = values.cpu().view(torch.uint8), values_t.cpu().view(torch.uint8)
    used = tiles.counts[0].item()
    assert torch.equal(descales_t[:used], descales[:used])
    tile, start = 0, first
    for size in groups:
        for row in range(start, start + size, 128):
            rows = min(128, start + size - row)
            at = values_t[:, 128 * tile : 128 * (tile + 1)]
            assert torch.equal(at[:, :rows], values[row : row + rows].T)
            assert not at[:, rows:].any()
            tile += 1
        start += size


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_tensor_core_weight_gradient_follows_the_recipe(out_dtype):
    """`warp_specialized.block_scaled_grouped_wgrad` on the operands cast along the tokens,
    tokens contiguous: within the FP8 sums' bound (and a bf16 rounding); zeros for the expert
    without tokens. Catches a tile of another expert's tokens, a descale of another tile, row or
    column, the padding's tokens read from another group."""
    grad, x, offsets, groups, first = _wgrad_problem()
    tiles = row_tile_map(offsets, grad.shape[0], 128)
    g_tokens = block_quantize_tokens(grad.to(DEVICE), tiles, transposed=True)
    x_tokens = block_quantize_tokens(x.to(DEVICE), tiles, transposed=True)
    out = warp_specialized.block_scaled_grouped_wgrad(
        g_tokens, x_tokens, offsets, token_tile_starts(offsets), out_dtype
    ).cpu()
    if out_dtype == torch.bfloat16:
        out = out.float()
        grad_bound = FP8_TENSOR_CORE_SUMS + 2.0**-8
    else:
        grad_bound = FP8_TENSOR_CORE_SUMS
    _check_wgrad(out, grad, x, groups, first, grad_bound)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's numpy,
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # on the infinities' blocks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_weights_cast_and_its_transpose_are_the_references_bit_for_bit(dtype):
    """`block_quantize_weights`: the blocks of two experts, each over magnitudes 2^-140 .. 2^120
    with a NaN, infinities, subnormals and e4m3 ties (`blocks_of_every_kind`, a block of zeros),
    N and K ragged (192 x 200: blocks of 64 rows and of 72 columns at the ends); the transposed
    cast is the cast of w.T. Catches a block's amax taken over one row (a 1 x 128 tile's), over
    elements past a ragged end, another expert's block, and the transposed values or descales
    written at the untransposed places."""
    x = blocks_of_every_kind(dtype)
    w = torch.stack(
        [torch.cat([x, x.flip(0), x * 0.5])[:192, :200], x.flip(1)[:, :200].repeat(3, 1)]
    )
    w[1, 128:, 128:] = 0.0
    cast, transposed = block_quantize_weights(w.to(DEVICE))
    for (values, descales), source in ((cast, w), (transposed, w.transpose(1, 2))):
        _assert_the_cast_is((values, descales), quantize_blocks(source))


def test_parts_cast_side_by_side_are_each_parts_cast():
    """`quantize_side_by_side`: each part's values and descales are its own `block_quantize_tiles`
    at a whole step, zero values between a ragged part's end and the next step; the weights'
    transposed casts written into halves of one tensor (`block_quantize_weights`'s
    transposed_into) are their own. Catches a part cast from the previous part's step, a ragged
    part's padding left unwritten (garbage summed into the product), descales at the wrong
    step."""
    generator = torch.Generator().manual_seed(11)
    parts = [torch.randn(37, 200, generator=generator).bfloat16().to(DEVICE) for _ in range(2)]
    values, descales = quantize_side_by_side(parts)
    assert values.shape == (37, 512) and descales.shape == (37, 4)
    for half, part in enumerate(parts):
        own_values, own_descales = block_quantize_tiles(part)
        at = values[:, 256 * half : 256 * half + 200].view(torch.uint8)
        assert torch.equal(at, own_values.view(torch.uint8))
        assert torch.equal(descales[:, 2 * half : 2 * half + 2], own_descales)
        assert not values[:, 256 * half + 200 : 256 * (half + 1)].view(torch.uint8).any()
    w = torch.randn(2, 200, 96, generator=generator).bfloat16().to(DEVICE)
    wide = torch.zeros(2, 96, 512, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    wide_descales = torch.zeros(2, 1, 4, device=DEVICE)
    halves = (wide[..., 256:456], wide_descales[..., 2:])
    _, (own_values, own_descales) = block_quantize_weights(w)
    block_quantize_weights(w, halves)
    assert torch.equal(halves[0].view(torch.uint8), own_values.view(torch.uint8))
    assert torch.equal(halves[1], own_descales)
    assert not wide[..., :256].view(torch.uint8).any() and not wide_descales[..., :2].any()
