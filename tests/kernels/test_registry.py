"""`mok.kernels.registry`: which twin runs each expert product. Runs on the CPU: `pick` reads
only shapes, dtypes and layouts, and Hopper is stood in for (`warp_specialized.available`).
Bugs caught: a product wired to another product's kernel or tiles (the scatter to the plain
down, the weighted dgrad to the plain one, a weight gradient to the data gradient's tiles, an
fp32 buffer given the bf16 tiles), the Gluon kernel picked for operands it cannot take (a
weight whose experts are not evenly spaced, mixed gradient dtypes, fp32 rows), and the Gluon
kernel picked where the device has none."""

from __future__ import annotations

import pytest
import torch

from mok.kernels import grouped_gemm as gg
from mok.kernels import warp_specialized
from mok.kernels.expert_mlp import ExpertKernelConfig, GluonTiles
from mok.kernels.host import GemmTiles
from mok.kernels.registry import Product, pick, runs_gluon

E, M, H, INTER = 4, 96, 256, 128
TL_TILES = {
    name: GemmTiles(16, 32, 32, num_warps=4, num_stages=1, group_m=index + 1)
    for index, name in enumerate(
        ("gate_up", "down", "down_dgrad", "gate_up_dgrad", "down_wgrad", "gate_up_wgrad")
    )
}
"""Six distinct tl tiles (group_m tells them apart), so that a product given another's fails."""
CONFIG = ExpertKernelConfig(
    **TL_TILES,
    gluon=GluonTiles(
        gate_up=warp_specialized.SWIGLU_PING_PONG,
        down=warp_specialized.COOPERATIVE,
        dgrad=warp_specialized.DGRAD_TILES,
        wgrad=warp_specialized.WGRAD_TILES,
    ),
)


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


def _operands(product: Product, grad_dtype=torch.bfloat16) -> tuple:
    rows, h = _bf16(M, H), _bf16(M, INTER)
    w_gate, w_up, w_down = _bf16(E, INTER, H), _bf16(E, INTER, H), _bf16(E, H, INTER)
    return {
        Product.GATE_UP: (rows, w_gate, w_up),
        Product.DOWN: (h, w_down),
        Product.DOWN_SCATTER: (h, w_down),
        Product.DOWN_DGRAD: (rows, w_down),
        Product.DOWN_DGRAD_WEIGHTED: (rows, w_down),
        Product.GATE_UP_DGRAD: (_bf16(M, 2 * INTER)[:, :INTER], w_gate, w_up),
        Product.DOWN_WGRAD: (rows, h, torch.zeros(E, H, INTER, dtype=grad_dtype)),
        Product.GATE_UP_WGRAD: (
            _bf16(M, 2 * INTER),
            rows,
            torch.zeros(E, INTER, H, dtype=grad_dtype),
            torch.zeros(E, INTER, H, dtype=grad_dtype),
        ),
    }[product]


GLUON = {
    Product.GATE_UP: (warp_specialized.SWIGLU_PING_PONG, warp_specialized.gate_up_swiglu),
    Product.DOWN: (warp_specialized.COOPERATIVE, warp_specialized.down),
    Product.DOWN_SCATTER: (warp_specialized.COOPERATIVE, warp_specialized.down_scatter),
    Product.DOWN_DGRAD: (warp_specialized.DGRAD_TILES.down, warp_specialized.down_dgrad_swiglu),
    Product.DOWN_DGRAD_WEIGHTED: (
        warp_specialized.DGRAD_TILES.down,
        warp_specialized.down_dgrad_swiglu_weighted,
    ),
    Product.GATE_UP_DGRAD: (warp_specialized.DGRAD_TILES.gate_up, warp_specialized.gate_up_dgrad),
    Product.DOWN_WGRAD: (warp_specialized.WGRAD_TILES.half, warp_specialized.down_wgrad),
    Product.GATE_UP_WGRAD: (warp_specialized.WGRAD_TILES.half, warp_specialized.gate_up_wgrad),
}
TL = {
    Product.GATE_UP: (TL_TILES["gate_up"], gg.gate_up_swiglu),
    Product.DOWN: (TL_TILES["down"], gg.down),
    Product.DOWN_SCATTER: (TL_TILES["down"], gg.down_scatter),
    Product.DOWN_DGRAD: (TL_TILES["down_dgrad"], gg.down_dgrad_swiglu),
    Product.DOWN_DGRAD_WEIGHTED: (TL_TILES["down_dgrad"], gg.down_dgrad_swiglu_weighted),
    Product.GATE_UP_DGRAD: (TL_TILES["gate_up_dgrad"], gg.gate_up_dgrad),
    Product.DOWN_WGRAD: (TL_TILES["down_wgrad"], gg.down_wgrad),
    Product.GATE_UP_WGRAD: (TL_TILES["gate_up_wgrad"], gg.gate_up_wgrad),
}


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(warp_specialized, "available", lambda device: True)


@pytest.mark.parametrize("product", list(Product), ids=lambda p: p.value)
def test_each_product_picks_its_gluon_kernel_and_tiles_where_they_run(product, hopper):
    assert pick(product, CONFIG, *_operands(product)) == GLUON[product]
    assert runs_gluon(product, CONFIG, *_operands(product))


@pytest.mark.parametrize("product", list(Product), ids=lambda p: p.value)
def test_each_product_picks_its_tl_twin_without_hopper(product, monkeypatch):
    monkeypatch.setattr(warp_specialized, "available", lambda device: False)
    assert pick(product, CONFIG, *_operands(product)) == TL[product]
    assert not runs_gluon(product, CONFIG, *_operands(product))


@pytest.mark.parametrize("product", list(Product), ids=lambda p: p.value)
def test_a_config_without_gluon_tiles_picks_the_tl_twin(product, hopper):
    tl_only = ExpertKernelConfig(**TL_TILES)
    assert pick(product, tl_only, *_operands(product)) == TL[product]


def test_fp32_gradient_buffers_take_the_wider_epilogue_tiles(hopper):
    for product, kernel in (
        (Product.DOWN_WGRAD, warp_specialized.down_wgrad),
        (Product.GATE_UP_WGRAD, warp_specialized.gate_up_wgrad),
    ):
        assert pick(product, CONFIG, *_operands(product, torch.float32)) == (
            warp_specialized.WGRAD_TILES.single,
            kernel,
        )


def test_operands_the_gluon_kernels_cannot_take_go_to_the_tl_twins(hopper):
    rows, w_up, w_down = _bf16(M, H), _bf16(E, INTER, H), _bf16(E, H, INTER)
    column_major = _bf16(E, H, INTER).transpose(1, 2)  # K not the unit-stride dimension
    assert pick(Product.GATE_UP, CONFIG, rows, column_major, w_up) == TL[Product.GATE_UP]
    assert pick(Product.DOWN, CONFIG, rows.float()[:, :INTER], w_down.float()) == TL[Product.DOWN]
    grad_out, h = _bf16(M, H), _bf16(M, INTER)
    mixed = (torch.zeros(E, INTER, H), torch.zeros(E, INTER, H, dtype=torch.bfloat16))
    assert (
        pick(Product.GATE_UP_WGRAD, CONFIG, _bf16(M, 2 * INTER), rows, *mixed)
        == TL[Product.GATE_UP_WGRAD]
    )
    assert (
        pick(Product.DOWN_WGRAD, CONFIG, grad_out, h, torch.zeros(E, H, INTER))[1]
        is warp_specialized.down_wgrad
    )
