"""The down data gradient with the router weights applied in its epilogue
(`grouped_gemm.down_dgrad_swiglu_weighted`) against `reference.expert.weighted_down_backward`.

Under the interpreter (CPU, in CI) the kernel runs in fp32, which the interpreter computes exactly,
so a wrong row, column tile, weight or mask shows far above fp32 rounding against float64 math.
The bf16 rounding points (w applied to the fp32 product before its one rounding, not to rounded
rows) and the warp-specialized twin are the GPU tests' (`test_warp_specialized.py`).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mok.kernels import grouped_gemm as gg
from mok.kernels.grouped_gemm import row_tile_map
from mok.kernels.host import GemmTiles
from mok.reference.expert import weighted_down_backward
from mok.testing import relative_error

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="interpreter tests; the GPU tests cover CUDA"
    ),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

TILES = GemmTiles(16, 32, 32, num_warps=4, num_stages=2)
FP32_TOL = 1e-5


def _swiglu_gradients(grad_h, gate, up):
    """float64 autograd gradients of silu(gate) * up."""
    gate, up = gate.double().requires_grad_(), up.double().requires_grad_()
    h = torch.nn.functional.silu(gate) * up
    return torch.autograd.grad(h, (gate, up), grad_h.double())


def _inputs(sizes, hidden, inter, before, after, seed):
    gen = torch.Generator().manual_seed(seed)
    m = before + sum(sizes) + after
    offsets = (torch.tensor([0, *sizes]).cumsum(0) + before).to(torch.int32)
    grad_out = torch.randn(m, hidden, generator=gen)
    gate_up = torch.randn(m, 2 * inter, generator=gen)
    h = torch.randn(m, inter, generator=gen)
    w_down = torch.randn(len(sizes), hidden, inter, generator=gen) / inter**0.5
    # Negative, zero and positive weights: a weight applied twice, as its square or not at all
    # shows on some rows.
    row_weights = torch.randn(m, generator=gen)
    row_weights[::7] = 0.0
    outside = torch.ones(m, dtype=torch.bool)
    outside[before : before + sum(sizes)] = False
    grad_out[outside] = float("nan")  # never read
    return grad_out, gate_up, h, w_down, row_weights, offsets, outside


def _check(sizes, hidden, inter, before=0, after=0, seed=0):
    grad_out, gate_up, h, w_down, row_weights, offsets, outside = _inputs(
        sizes, hidden, inter, before, after, seed
    )
    inside = ~outside
    h_before = h.clone()
    tiles = row_tile_map(offsets, grad_out.shape[0], TILES.block_m)
    grad_gate_up, dots = gg.down_dgrad_swiglu_weighted(
        grad_out, w_down, gate_up, h, row_weights, tiles, None, TILES
    )
    grad_h, want_dots, weighted_h = weighted_down_backward(
        grad_out[inside].double(),
        sizes,
        h_before[inside].double(),
        w_down.double(),
        row_weights[inside].double(),
    )
    want = torch.cat(_swiglu_gradients(grad_h, *gate_up[inside].chunk(2, 1)), 1)
    assert relative_error(grad_gate_up[inside], want) < FP32_TOL
    assert relative_error(dots[inside], want_dots) < FP32_TOL
    assert relative_error(h[inside], weighted_h) < FP32_TOL
    # Rows outside the groups: h untouched, no dot.
    assert torch.equal(h[outside], h_before[outside])
    assert torch.equal(dots[outside], torch.zeros_like(dots[outside]))


CASES = {
    # name: (group sizes, H (the reduction), I (the gradients' columns), rows before, after)
    "uniform": ([40, 33, 16, 57], 64, 96, 0, 0),
    "empty and one-row groups": ([0, 1, 0, 45, 0, 3], 64, 64, 3, 5),
    "all rows on one expert": ([0, 0, 70, 0], 32, 64, 0, 2),
    "I not a tile multiple": ([20, 7, 29], 64, 40, 1, 0),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_the_weighted_down_dgrad_matches_the_reference(name):
    """gate | up gradients, the router weights' dots and the weighted h against float64 math.
    Catches a row weight read for the wrong row (or none, or twice), a dot stored at the wrong
    column tile or row (the tiles' partial dots must all land, once each), h's rows outside the
    groups overwritten, and columns past I entering a dot."""
    sizes, hidden, inter, before, after = CASES[name]
    _check(sizes, hidden, inter, before, after)


@pytest.mark.interpreter
@settings(max_examples=8, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    inter=st.sampled_from([8, 24, 32, 72]),
    before=st.integers(0, 4),
    after=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_fuzz_the_weighted_down_dgrad(sizes, inter, before, after, seed):
    """Group sizes (empty, all rows on one expert, not tile multiples) and widths fuzzed."""
    _check(sizes, 32, inter, before, after, seed)


def test_bad_weighting_inputs_raise():
    grad_out, gate_up, h, w_down, row_weights, offsets, _ = _inputs([4, 5], 32, 32, 0, 0, 0)
    tiles = row_tile_map(offsets, grad_out.shape[0], TILES.block_m)
    with pytest.raises(ValueError, match="row_weights must be"):
        gg.down_dgrad_swiglu_weighted(
            grad_out, w_down, gate_up, h, row_weights.double(), tiles, None, TILES
        )
    with pytest.raises(ValueError, match="h must be contiguous"):
        gg.down_dgrad_swiglu_weighted(
            grad_out, w_down, gate_up, h.t().contiguous().t(), row_weights, tiles, None, TILES
        )


@pytest.mark.interpreter
def test_the_expert_backward_with_weighted_rows_matches_the_reference():
    """`weighted_down_data_gradient` on a forward's saved state, then `down_weight_gradient` of
    the same unweighted rows: W_down's gradient is grad_rows.T @ round(w * h), the rounding
    points' weighted h. Catches the saved h left unweighted (W_down's gradient of the unweighted
    rows) or weighted twice, and the dots read from another saved tensor."""
    from mok.kernels import (
        ExpertKernelConfig,
        down_weight_gradient,
        expert_mlp_forward,
        weighted_down_data_gradient,
    )
    from mok.reference.expert import swiglu

    sizes, hidden, inter = [9, 0, 20, 4], 32, 48
    gen = torch.Generator().manual_seed(3)
    m = sum(sizes)
    offsets = torch.tensor([0, *sizes]).cumsum(0).to(torch.int32)
    rows = torch.randn(m, hidden, generator=gen)
    w_gate, w_up = (torch.randn(4, inter, hidden, generator=gen) / hidden**0.5 for _ in range(2))
    w_down = torch.randn(4, hidden, inter, generator=gen) / inter**0.5
    config = ExpertKernelConfig(*(TILES,) * 6)
    _, saved = expert_mlp_forward(rows, offsets, w_gate, w_up, w_down, config=config)
    grad_rows = torch.randn(m, hidden, generator=gen)
    row_weights = torch.rand(m, generator=gen)
    bounds = offsets.tolist()
    h = torch.cat(
        [
            swiglu(
                rows[a:b].double() @ w_gate[e].double().T, rows[a:b].double() @ w_up[e].double().T
            )
            for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
        ]
    )
    _, dots = weighted_down_data_gradient(grad_rows, saved, row_weights)
    grad_w_down = down_weight_gradient(grad_rows, saved)
    _, want_dots, weighted_h = weighted_down_backward(
        grad_rows.double(), sizes, h, w_down.double(), row_weights.double()
    )
    want_w_down = torch.stack(
        [
            grad_rows[a:b].double().T @ weighted_h[a:b]
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]
    )
    assert relative_error(dots, want_dots) < FP32_TOL
    assert relative_error(grad_w_down, want_w_down) < FP32_TOL
