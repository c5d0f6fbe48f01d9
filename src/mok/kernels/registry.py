"""Which kernel runs each expert product: the warp-specialized Gluon kernel where the config
gives it tiles (Hopper, with a Triton whose Gluon the kernels support: `warp_specialized.available`)
and the operands fit it, else its tl twin, which runs everywhere (the interpreter too). The one
place that chooses; the products (`expert_mlp`) ask `pick`.

The twins of a product take the same arguments and give bitwise the same results, so a caller
never needs to know which one ran; the tiles returned are the ones to pass it (and to build
its row tiles with: their block_m). The 128-block FP8 recipe's products are the exception
(`runs_fp8_tensor_cores`): on Hopper they run on the FP8 tensor cores, whose sums differ from
the tl kernels' in their rounding."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import torch

from mok.kernels import fp8_block, warp_specialized
from mok.kernels import grouped_gemm as gg
from mok.kernels.host import GemmTiles


class Product(enum.Enum):
    """The expert MLP's products (forward, data gradients, weight gradients)."""

    GATE_UP = "gate_up"
    """rows @ W_gate[e].T and rows @ W_up[e].T, the activation in the epilogue."""
    DOWN = "down"
    """h @ W_down[e].T into a tensor."""
    DOWN_SCATTER = "down_scatter"
    """h @ W_down[e].T stored by the peer-store epilogue (`RowScatter`)."""
    DOWN_DGRAD = "down_dgrad"
    """grad_out @ W_down[e], the activation's backward in the epilogue."""
    DOWN_DGRAD_WEIGHTED = "down_dgrad_weighted"
    """DOWN_DGRAD on unweighted rows, the router weights applied in the epilogue."""
    GATE_UP_DGRAD = "gate_up_dgrad"
    """grad_gate @ W_gate[e] + grad_up @ W_up[e]."""
    DOWN_WGRAD = "down_wgrad"
    """grad_out[e].T @ h[e] into W_down's gradient."""
    GATE_UP_WGRAD = "gate_up_wgrad"
    """grad_gate[e].T @ rows[e] and grad_up[e].T @ rows[e] into W_gate's and W_up's."""


@dataclasses.dataclass(frozen=True)
class _Twins:
    gluon: Callable
    tl: Callable
    gluon_tiles: Callable[..., GemmTiles | None]
    """(config, *operands) -> the Gluon kernel's tiles, or None where it does not run them."""
    tl_field: str
    """The config's field holding the tl kernel's tiles."""


def _row_product(field: str) -> Callable[..., GemmTiles | None]:
    """Gluon tiles of a product over rows (rows [M, K] times weights [E, N, K])."""

    def tiles(config, rows: torch.Tensor, *weights: torch.Tensor) -> GemmTiles | None:
        chosen = getattr(config.gluon, field)
        return chosen if chosen is not None and warp_specialized.supported(rows, *weights) else None

    return tiles


def _data_gradient(part: str) -> Callable[..., GemmTiles | None]:
    """Gluon tiles of a data gradient (rows [M, K] times weights [E, K, N])."""

    def tiles(config, rows: torch.Tensor, *weights: torch.Tensor) -> GemmTiles | None:
        both = config.gluon.dgrad
        chosen = both and getattr(both, part)
        return (
            chosen if chosen and warp_specialized.dgrad_supported(rows, chosen, *weights) else None
        )

    return tiles


def _weight_gradient(
    config, a: torch.Tensor, b: torch.Tensor, *grads: torch.Tensor, gather: bool = False
) -> GemmTiles | None:
    """Gluon tiles of a weight gradient (a[e].T @ b[e] into each of `grads`, one dtype)."""
    both = config.gluon.wgrad
    if both is None or len({grad.dtype for grad in grads}) != 1:
        return None
    chosen = both.for_grad(grads[0].dtype)
    fits = chosen and all(
        warp_specialized.wgrad_supported(a, b, grad, chosen, gather) for grad in grads
    )
    return chosen if fits else None


_PRODUCTS = {
    Product.GATE_UP: _Twins(
        warp_specialized.gate_up_swiglu,
        gg.gate_up_swiglu,
        _row_product("gate_up"),
        "gate_up",
    ),
    Product.DOWN: _Twins(warp_specialized.down, gg.down, _row_product("down"), "down"),
    Product.DOWN_SCATTER: _Twins(
        warp_specialized.down_scatter,
        gg.down_scatter,
        _row_product("down"),
        "down",
    ),
    Product.DOWN_DGRAD: _Twins(
        warp_specialized.down_dgrad_swiglu,
        gg.down_dgrad_swiglu,
        _data_gradient("down"),
        "down_dgrad",
    ),
    Product.DOWN_DGRAD_WEIGHTED: _Twins(
        warp_specialized.down_dgrad_swiglu_weighted,
        gg.down_dgrad_swiglu_weighted,
        _data_gradient("down"),
        "down_dgrad",
    ),
    Product.GATE_UP_DGRAD: _Twins(
        warp_specialized.gate_up_dgrad, gg.gate_up_dgrad, _data_gradient("gate_up"), "gate_up_dgrad"
    ),
    Product.DOWN_WGRAD: _Twins(
        warp_specialized.down_wgrad, gg.down_wgrad, _weight_gradient, "down_wgrad"
    ),
    Product.GATE_UP_WGRAD: _Twins(
        warp_specialized.gate_up_wgrad, gg.gate_up_wgrad, _weight_gradient, "gate_up_wgrad"
    ),
}


def pick(
    product: Product, config, *operands: torch.Tensor, **options
) -> tuple[GemmTiles, Callable]:
    """(tiles, kernel) of `product` for an `expert_mlp.ExpertKernelConfig` and its operands: the
    Gluon kernel where `config` has its tiles and the operands fit it, else the tl twin.
    Operands: rows and weights for products over rows and data gradients; (a, b, *gradient
    buffers) for weight gradients, whose `gather=True` says that b is read through an index."""
    twins = _PRODUCTS[product]
    tiles = twins.gluon_tiles(config, *operands, **options)
    if tiles is not None:
        return tiles, twins.gluon
    return getattr(config, twins.tl_field), twins.tl


def runs_gluon(product: Product, config, *operands: torch.Tensor, **options) -> bool:
    """Whether `pick` gives the Gluon kernel."""
    return _PRODUCTS[product].gluon_tiles(config, *operands, **options) is not None


def runs_fp8_tensor_cores(a_values: torch.Tensor, *w_values: torch.Tensor) -> bool:
    """Whether the 128-block recipe's products of A's cast with these weights' casts run on the
    FP8 tensor cores (`warp_specialized.block_scaled_*`: Hopper, `block_scaled_supported`), else
    on the tl kernels (`fp8_block`). The two differ by more than the order of fp32 sums: the
    tensor cores sum each step's e4m3 products in fewer bits than fp32, within the recipe's
    error bound, so unlike `pick`'s twins neither is the other's bitwise oracle."""
    return all(warp_specialized.block_scaled_supported(a_values, w) for w in w_values)


def block_scaled_grouped_mm(
    a_cast: tuple[torch.Tensor, torch.Tensor],
    w_cast: tuple[torch.Tensor, torch.Tensor],
    group_offsets: torch.Tensor,
    tiles,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`fp8_block.block_scaled_grouped_mm` of A's cast (values, descales) and W's block cast on
    the FP8 tensor cores where `runs_fp8_tensor_cores`, else on the tl kernel. tiles: the row
    tiles of 64 rows that both take."""
    if runs_fp8_tensor_cores(a_cast[0], w_cast[0]):
        return warp_specialized.block_scaled_grouped_mm(
            *a_cast, *w_cast, group_offsets, tiles, out_dtype
        )
    return fp8_block.block_scaled_grouped_mm(
        *a_cast, *w_cast, group_offsets, out_dtype, tiles=tiles
    )


def runs_fp8_wgrad_tensor_cores(n: int, k: int, device: torch.device) -> bool:
    """Whether the 128-block recipe's weight gradient [E, N, K] runs on the FP8 tensor cores
    (`warp_specialized.block_scaled_grouped_wgrad`, its operands cast along the tokens
    transposed), else on the tl kernel; as in `runs_fp8_tensor_cores`, the two differ by the
    tensor cores' rounding of each step's sums."""
    return warp_specialized.block_scaled_wgrad_supported(n, k, device)
