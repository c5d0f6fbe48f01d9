"""The expert MLP on rows grouped by local expert: forward and backward through the grouped GEMMs.

    gate, up = x @ W_gate[e].T, x @ W_up[e].T     fp32 accumulators, one kernel (same tile)
    h        = swiglu(gate, up)                     fp32 in that kernel's epilogue, rounded once
    out      = h @ W_down[e].T                      fp32 accumulator, rounded once

These are the rounding points of `mok.reference.expert`. Backward:

    grad_h          = grad_out @ W_down[e]           rounded to bf16 (as autograd does for h),
    grad_gate, grad_up = swiglu'(...)               in the same kernel's epilogue, from the saved
                                                    bf16 pre-activations (saved so that the clamp
                                                    decisions are the forward's fp32 ones)
    grad_x          = grad_gate @ W_gate[e] + grad_up @ W_up[e]       one kernel
    grad_W_down[e]  = grad_out[e].T @ h[e];  grad_W_gate[e] = grad_gate[e].T @ x[e]; likewise up

Forward saves h and the pre-activations (gate | up, bf16) rather than recomputing them: that costs
writing M x 2I values once, where recomputation would add a third to the backward's GEMM work.

No host synchronization: group sizes stay on the device, tile lists come from a small kernel and
every loop is bounded by host-known quantities (M, E, H, I). No atomics on results (claimed
tasks, `TileClaims`, take only their ids from a counter); every output element is reduced by one
program in a fixed order, so results are bitwise reproducible.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from mok.kernels import grouped_gemm as gg
from mok.kernels import host, warp_specialized
from mok.kernels._triton_compat import interpreting
from mok.kernels.host import (
    SWIGLU,
    Activation,
    GemmTiles,
    RowScatter,
    RowsReady,
    RowTiles,
    TileClaims,
)
from mok.kernels.registry import Product, pick, runs_gluon
from mok.weights import are_gate_up_halves, empty_gate_up_pair, has_contiguous_expert_rows


@dataclasses.dataclass(frozen=True)
class GluonTiles:
    """Tiles of the warp-specialized Gluon kernels, each of which runs its products instead of
    their tl twins where it can (Hopper; `warp_specialized.supported`, `dgrad_supported`,
    `wgrad_supported`); a None field: its products run the tl kernels."""

    gate_up: GemmTiles | None = None
    """The forward gate/up + SwiGLU (contiguous experts, or W_gate and W_up the halves of one
    fused tensor)."""
    down: GemmTiles | None = None
    """The forward down projection, with or without the peer-store epilogue."""
    dgrad: warp_specialized.DgradTiles | None = None
    """Both data gradients."""
    wgrad: warp_specialized.WgradTiles | None = None
    """Both weight gradients."""


@dataclasses.dataclass(frozen=True)
class ExpertKernelConfig:
    """Tiles of the six products of the expert MLP: the tl kernels', and the Gluon kernels'
    where those run them (`gluon`)."""

    gate_up: GemmTiles
    """Forward gate/up + SwiGLU: rows x I output tiles, reduction over H."""
    down: GemmTiles
    """Forward down: rows x H, reduction over I."""
    down_dgrad: GemmTiles
    """grad through down + SwiGLU backward: rows x I, reduction over H."""
    gate_up_dgrad: GemmTiles
    """grad through gate and up: rows x H, reduction over 2 x I."""
    down_wgrad: GemmTiles
    """grad of W_down: H x I tiles, reduction over the expert's rows."""
    gate_up_wgrad: GemmTiles
    """grads of W_gate and W_up: I x H tiles, reduction over the expert's rows."""
    gluon: GluonTiles = GluonTiles()
    """The Gluon kernels' tiles (none: the tl kernels run every product)."""


def default_config(
    device: torch.device, hidden: int, inter: int, rows_per_expert: float | None = None
) -> ExpertKernelConfig:
    """Tiles for a device, a shape and the mean rows per expert (M / E; None: many).

    Under the interpreter: small tiles, so that tests at small H and I still have ragged rows,
    partial tiles, several tasks per program and partial task groups. On a GPU (tiles chosen by
    measurement: docs/notes/expert-kernels.md): 128-row tiles, and 64-row ones in forward where
    groups average under 192 rows (a 128-row tiling would leave a third of the rows idle). On
    Hopper all six products run the warp-specialized Gluon kernels
    (docs/notes/warp-specialized-gemm.md): cooperative 128-row tiles, or ping-pong 64-row ones
    where groups average under 192 rows, for the same reason (gate/up: also where H < 4096)."""
    if device.type != "cuda":
        small = GemmTiles(16, 32, 32, num_warps=4, num_stages=1, group_m=2)
        return ExpertKernelConfig(small, small, small, small, small, small)
    short = rows_per_expert is not None and rows_per_expert < 192
    wgrad = GemmTiles(128, 256, 32, num_warps=8, num_stages=4)
    hopper = warp_specialized.available(device)
    # gate/up's epilogue (h and both pre-activations) weighs most in short reductions, where
    # ping-pong consumers hide it behind each other's main loops: faster than cooperative tiles
    # at H = 2048, slower at H = 4096 (benchmarks/results/2026-12-01-issue12-all-products-h200.md).
    swiglu = (
        warp_specialized.SWIGLU_PING_PONG
        if short or hidden < 4096
        else warp_specialized.SWIGLU_COOPERATIVE
    )
    gluon = GluonTiles()
    if hopper:
        gluon = GluonTiles(
            gate_up=swiglu,
            down=warp_specialized.PING_PONG if short else warp_specialized.COOPERATIVE,
            dgrad=warp_specialized.SHORT_DGRAD_TILES if short else warp_specialized.DGRAD_TILES,
            wgrad=warp_specialized.WGRAD_TILES,
        )
    return ExpertKernelConfig(
        gluon=gluon,
        gate_up=GemmTiles(64, 128, 64, 4, 4) if short else GemmTiles(128, 128, 64, 8, 3),
        down=GemmTiles(64, 256, 64, 8, 4) if short else GemmTiles(128, 256, 64, 8, 3),
        down_dgrad=GemmTiles(128, 128, 64, num_warps=8, num_stages=4),
        gate_up_dgrad=GemmTiles(128, 256, 32, num_warps=8, num_stages=3),
        down_wgrad=wgrad,
        gate_up_wgrad=wgrad,
    )


def gathers_rows_well(
    rows: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, config: ExpertKernelConfig
) -> bool:
    """Whether `expert_mlp_forward` should read rows [S, H] through an index (`source_rows`)
    rather than take them copied into grouped order first: where its gate/up product runs the
    warp-specialized kernel with ping-pong 64-row tiles at H < 4096. There the gathered product
    costs less than the copy plus the product on TMA tiles; with 128-row tiles it costs more than
    the copy saves, and at H = 7168 with 64-row tiles about as much (measured:
    benchmarks/results/2026-12-03-ep1-gathered-forward-local-sums-h200.md,
    2026-12-01-issue12-building-blocks-h200.md)."""
    return (
        runs_gluon(Product.GATE_UP, config, rows, w_gate, w_up)
        and config.gluon.gate_up.block_m == warp_specialized.CONSUMER_ROWS
        and rows.shape[1] < 4096
    )


@dataclasses.dataclass
class ExpertMLPSaved:
    """What `expert_mlp_backward` needs from a forward call. A backward that is the only one of
    its forward may `release` each activation after the last product that reads it."""

    rows: torch.Tensor
    """[M, H] the forward's input rows."""
    group_offsets: torch.Tensor
    """[E + 1] int32."""
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    h: torch.Tensor | None
    """[M, I] swiglu output (rows outside the groups hold garbage); None while `replay`."""
    gate_up: torch.Tensor | None
    """[M, 2I] pre-activations gate | up, in the rows' dtype; None while `replay`."""
    row_tiles: dict[int, RowTiles]
    """Row-tile lists by block_m, reused by backward."""
    swiglu_limit: float | None
    config: ExpertKernelConfig
    activation: Activation = SWIGLU
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """The experts' biases (gate, up [E, I]; down [E, H]), or None."""
    source_rows: torch.Tensor | None = None
    """[M] int32, or None. Set (`read_rows_through`): `rows` are [S, H] and grouped row r is
    rows[source_rows[r]], read there by the gate/up weight gradient, the one product of the
    backward that reads rows."""
    replay: bool = False
    """The forward kept neither h nor the pre-activations (`expert_mlp_forward`'s
    `keep_activations=False`): `replay_activations` makes them again, bitwise, before the first
    product that reads them."""

    def read_rows_through(self, rows: torch.Tensor, source_rows: torch.Tensor) -> None:
        """Keep `rows` [S, H] and the index source_rows [M] int32 instead of the grouped rows
        (grouped row r = rows[source_rows[r]], the same values): e.g. each token received once,
        where the grouped rows hold a copy per pair and are sized for the worst routing."""
        m = host.gathered_rows(self.rows, self.source_rows)
        if source_rows.shape != (m,) or source_rows.dtype != torch.int32:
            raise ValueError(
                f"source_rows: expected [{m}] int32, got "
                f"{tuple(source_rows.shape)} {source_rows.dtype}"
            )
        dtype = self.w_gate.dtype
        if rows.dim() != 2 or rows.shape[1] != self.w_gate.shape[2] or rows.dtype != dtype:
            raise ValueError(
                f"rows read through an index: expected [S, {self.w_gate.shape[2]}] "
                f"{dtype}, got {tuple(rows.shape)} {rows.dtype}"
            )
        self.rows, self.source_rows = rows, source_rows

    def release(self, *names: str) -> None:
        """Drop the saved activations `names` ("rows", "h", "gate_up"; None afterwards): their
        memory goes back to the caching allocator once nothing else holds them, for later
        allocations on the stream it was made on (the products already queued there that read
        them still run first). A product that needs a released activation raises."""
        for name in names:
            if name not in ("rows", "h", "gate_up"):
                raise ValueError(f"{name!r} is not a saved activation (rows, h, gate_up)")
            setattr(self, name, None)
            if name == "rows":
                self.source_rows = None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check(
    name: str, value, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], device
) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    if value.dtype not in dtypes:
        allowed = " or ".join(_dtype_name(d) for d in dtypes)
        raise ValueError(f"{name} has dtype {_dtype_name(value.dtype)}, expected {allowed}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device}, but the rows are on {device}")


def _check_tma_layout(name: str, value: torch.Tensor) -> None:
    """Tensor descriptors need a unit last stride and 16-byte aligned other strides and base."""
    size = value.element_size()
    if value.numel() and (
        value.stride(-1) != 1
        or any((s * size) % 16 for s in value.stride()[:-1])
        or value.data_ptr() % 16
    ):
        raise ValueError(
            f"{name} must have a unit last stride and 16-byte aligned strides and address "
            f"(strides {tuple(value.stride())}); pass .contiguous()"
        )


def _activation_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    # fp32 only where the interpreter runs the kernels: it computes fp32 exactly and bf16 wrongly.
    if device.type == "cuda":
        return (torch.bfloat16,)
    return (torch.bfloat16, torch.float32)


def _check_forward_inputs(rows, group_offsets, w_gate, w_up, w_down, swiglu_limit) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"rows must be a 2-D tensor [M, H], got {shape}")
    device = rows.device
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"rows are on {device}: the expert kernels need a CUDA device "
            "(or TRITON_INTERPRET=1 for CPU tensors)"
        )
    if not isinstance(w_gate, torch.Tensor) or w_gate.dim() != 3:
        raise ValueError("w_gate must be a 3-D tensor [E, I, H]")
    num_experts, inter, hidden = w_gate.shape
    m = rows.shape[0]
    _check("rows", rows, (m, hidden), _activation_dtypes(device), device)
    _check("group_offsets", group_offsets, (num_experts + 1,), (torch.int32,), device)
    _check("w_gate", w_gate, (num_experts, inter, hidden), (rows.dtype,), device)
    _check("w_up", w_up, (num_experts, inter, hidden), (rows.dtype,), device)
    _check("w_down", w_down, (num_experts, hidden, inter), (rows.dtype,), device)
    if num_experts < 1:
        raise ValueError("there must be at least one expert (w_gate.shape[0] >= 1)")
    for name, size in (("H", hidden), ("I", inter)):
        if size < 16 or size % 16:
            raise ValueError(f"{name}={size} must be a positive multiple of 16")
    for name, value in (("rows", rows), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        _check_tma_layout(name, value)
    if swiglu_limit is not None:
        if isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float)):
            raise ValueError(f"swiglu_limit must be a number or None, got {swiglu_limit!r}")
        if not math.isfinite(swiglu_limit) or swiglu_limit <= 0:
            raise ValueError(f"swiglu_limit must be finite and > 0, got {swiglu_limit}")


def held_to(
    config, sms: int | None, only: tuple[str, ...] | None = None, claims: TileClaims | None = None
):
    """The config (an ExpertKernelConfig, or any dataclass of tiles; None stays None) with the
    grids of its products held to `sms` SMs (`GemmTiles.max_sms`; None: all), and with `claims`
    their tasks claimed where their kernels can (`TileClaims`: more programs may join once SMs
    free up): of every product, or of the fields named in `only`, by their paths ("gate_up",
    "gluon.dgrad.down")."""
    if config is None or isinstance(config, GemmTiles):
        return config and dataclasses.replace(config, max_sms=sms, claims=claims)
    changes = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if not dataclasses.is_dataclass(value):
            continue
        if only is None or field.name in only:
            changes[field.name] = held_to(value, sms, claims=claims)
        elif inner := tuple(p.split(".", 1)[1] for p in only if p.startswith(field.name + ".")):
            changes[field.name] = held_to(value, sms, inner, claims)
    return dataclasses.replace(config, **changes)


def with_gate_up_sms(
    config: ExpertKernelConfig, sms: int | None, claims: TileClaims | None = None
) -> ExpertKernelConfig:
    """The config with the forward gate/up product's grid held to `sms` SMs (None: all): what
    runs beside communication programs leaves them theirs (`GemmTiles.max_sms`); with `claims`,
    its tasks claimed (`held_to`)."""
    return held_to(config, sms, ("gate_up", "gluon.gate_up"), claims)


def _with_down_dgrad_sms(
    config: ExpertKernelConfig, sms: int, claims: TileClaims | None
) -> ExpertKernelConfig:
    """The config with the backward's first product (through W_down) held to `sms` SMs."""
    return held_to(config, sms, ("down_dgrad", "gluon.dgrad.down"), claims)


def down_tiles(config: ExpertKernelConfig, h: torch.Tensor, w_down: torch.Tensor) -> GemmTiles:
    """The tiles the forward down product runs with for h [M, I] (its block_n is what the
    peer-store epilogue's counts count in: one add per row and column tile)."""
    return pick(Product.DOWN, config, h, w_down)[0]


def cached_row_tiles(
    saved_tiles: dict[int, RowTiles], group_offsets, num_rows, block_m
) -> RowTiles:
    """`grouped_gemm.row_tile_map` of the groups for block_m, made once per call and kept in
    `saved_tiles` (`ExpertMLPSaved.row_tiles`) for every later product with that block_m."""
    if block_m not in saved_tiles:
        saved_tiles[block_m] = gg.row_tile_map(group_offsets, num_rows, block_m)
    return saved_tiles[block_m]


def _check_forward_buffers(rows, w_gate, m: int, out, biases) -> None:
    """Raise ValueError unless `out` (or None) holds M contiguous rows of the rows' dtype and the
    biases (or None) are gate's, up's [E, I] and down's [E, H] in it."""
    if biases is not None:
        experts, inter, hidden = w_gate.shape
        shapes = ((experts, inter), (experts, inter), (experts, hidden))
        for name, bias, shape in zip(("gate", "up", "down"), biases, shapes, strict=True):
            _check(f"{name} bias", bias, shape, (rows.dtype,), rows.device)
    if out is not None:
        _check("out", out[:m], (m, rows.shape[1]), (rows.dtype,), rows.device)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")


def expert_mlp_forward(
    rows: torch.Tensor,
    group_offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
    save_for_backward: bool = True,
    config: ExpertKernelConfig | None = None,
    out: torch.Tensor | None = None,
    rows_ready: RowsReady | None = None,
    combine: RowScatter | None = None,
    down_operand: Callable[[torch.Tensor], torch.Tensor] | None = None,
    activation: Activation = SWIGLU,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    source_rows: torch.Tensor | None = None,
    keep_activations: bool = True,
) -> tuple[torch.Tensor | None, ExpertMLPSaved | None]:
    """Every expert's MLP on its group of rows.

    rows: [M, H] bf16 on a CUDA device (fp32 is accepted on CPU under TRITON_INTERPRET=1), grouped
      by local expert: group e is rows[group_offsets[e]:group_offsets[e + 1]].
    group_offsets: [E + 1] int32 on the rows' device, non-decreasing, group_offsets[E] <= M. Rows
      outside [group_offsets[0], group_offsets[E]) are padding: never read into any result.
    w_gate, w_up: [E, I, H]; w_down: [E, H, I]; the rows' dtype; H and I multiples of 16; any
      layout of unit last stride and 16-byte aligned strides (e.g. views of one [E, 2I, H]).
    swiglu_limit: None, or L > 0: gate <= L and -L <= up <= L before silu(gate) * up.
    save_for_backward: keep what `expert_mlp_backward` needs (else `saved` is None).
    config: tiles (None: `default_config`).
    out: None, or a contiguous [>= M, H] tensor of the rows' dtype (e.g. a communication buffer)
      that the outputs go into; its first M rows are returned.
    rows_ready: the rows land while the gate/up product runs (written by a kernel beside it,
      `RowsReady`): each tile waits for its rows' flags first.
    combine: the outputs leave by the peer-store epilogue instead (`RowScatter`: row r to row
      dest_row[r] of rank dest_rank[r]'s buffer, counted per row and column tile of
      `down_tiles(config, ...)`); `out` must be None and None is returned in its place.
    down_operand: maps h [M, I] to what the down product reads instead (of h's shape, dtype and
      layout: the MXFP8 layer's cast of h); `saved.h` stays h.
    activation: gate * sigmoid(alpha * gate) * (up + up_offset) after the clamp (SwiGLU by
      default). biases: None, or (gate, up [E, I], down [E, H]) of the rows' dtype, added in fp32
      to the pre-activations and the outputs (the rows `combine` stores too).
    source_rows: [M] int32, each in [0, S): the gate/up product reads grouped row r as
      rows[source_rows[r]] of rows [S, H] (e.g. x itself at EP 1), with no grouped copy; `saved`
      keeps rows and the index (`ExpertMLPSaved.read_rows_through`). `gathers_rows_well` says
      where this is faster than copying the rows first.
    keep_activations: with save_for_backward, keep h and the pre-activations; False keeps
      neither (nor writes the pre-activations): the backward makes them again
      (`replay_activations`, on the rows `saved` keeps), bitwise.

    Returns (out [M, H] in the rows' dtype, saved); rows of `out` outside the groups are left
    unwritten. Never synchronizes with the host."""
    if combine is not None and out is not None:
        raise ValueError("expert_mlp_forward: pass out or combine, not both")
    _check_forward_inputs(rows, group_offsets, w_gate, w_up, w_down, swiglu_limit)
    m = host.gathered_rows(rows, source_rows)
    _check_forward_buffers(rows, w_gate, m, out, biases)
    hidden, inter = rows.shape[1], w_gate.shape[1]
    cfg = config or default_config(rows.device, hidden, inter, m / w_gate.shape[0])
    if m == 0:
        out = None if combine else rows.new_empty(0, hidden)
        saved = ExpertMLPSaved(
            rows[:0], group_offsets, w_gate, w_up, w_down, rows.new_empty(0, inter),
            rows.new_empty(0, 2 * inter), {}, swiglu_limit, cfg, activation, biases,
        )  # fmt: skip
        return out, saved if save_for_backward else None
    tiles: dict[int, RowTiles] = {}
    gate_up_cfg, gate_up_swiglu = pick(Product.GATE_UP, cfg, rows, w_gate, w_up)
    keep = save_for_backward and keep_activations
    h, gate_up = gate_up_swiglu(
        rows,
        w_gate,
        w_up,
        cached_row_tiles(tiles, group_offsets, m, gate_up_cfg.block_m),
        swiglu_limit,
        keep,
        gate_up_cfg,
        source_rows=source_rows,
        ready=rows_ready,
        activation=activation,
        biases=None if biases is None else biases[:2],
    )
    h_in = h if down_operand is None else down_operand(h)
    down_bias = None if biases is None else biases[2]
    out = _down_product(h_in, w_down, tiles, group_offsets, cfg, out, combine, down_bias)
    del h_in
    if not save_for_backward:
        return out, None
    saved = ExpertMLPSaved(
        rows, group_offsets, w_gate, w_up, w_down, h if keep else None, gate_up, tiles,
        swiglu_limit, cfg, activation, biases, source_rows=source_rows, replay=not keep,
    )  # fmt: skip
    return out, saved


def _down_product(h, w_down, tiles: dict, group_offsets, cfg, out, combine, bias):
    """The down product of h [M, I] with w_down [E, H, I] (+ bias [E, H]) on the row tiles of
    `group_offsets` (cached in `tiles` by block rows): into `out` (None: a new tensor), returned;
    or, with `combine`, stored by the peer-store epilogue (`RowScatter`), returning None."""
    product = Product.DOWN if combine is None else Product.DOWN_SCATTER
    down_cfg, down = pick(product, cfg, h, w_down)
    row_tiles = cached_row_tiles(tiles, group_offsets, h.shape[0], down_cfg.block_m)
    if combine is None:
        return down(h, w_down, row_tiles, down_cfg, out, bias=bias)
    down(h, w_down, row_tiles, scatter=combine, cfg=down_cfg, bias=bias)
    return None


def replay_activations(saved: ExpertMLPSaved) -> None:
    """Where the forward kept no activations (`saved.replay`): h [M, I] and the pre-activations
    [M, 2I] made again into `saved` by the forward's gate/up product on the rows it keeps, with
    the forward's tiles and grid (so bitwise the forward's values), its tasks taken by the
    static stride (the forward's tile claims belong to the forward). No-op otherwise."""
    if not saved.replay:
        return
    rows = _saved_tensor(saved, "rows")
    m = host.gathered_rows(rows, saved.source_rows)
    tiles, gate_up_swiglu = pick(Product.GATE_UP, saved.config, rows, saved.w_gate, saved.w_up)
    tiles = dataclasses.replace(tiles, claims=None)
    saved.h, saved.gate_up = gate_up_swiglu(
        rows,
        saved.w_gate,
        saved.w_up,
        cached_row_tiles(saved.row_tiles, saved.group_offsets, m, tiles.block_m),
        saved.swiglu_limit,
        True,
        tiles,
        source_rows=saved.source_rows,
        activation=saved.activation,
        biases=None if saved.biases is None else saved.biases[:2],
    )
    saved.replay = False


def _grad_buffer(name: str, buffer, weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the tensor the kernel writes into, whether it accumulates into it)."""
    if buffer is None:
        return torch.empty_like(weight, memory_format=torch.contiguous_format), False
    _check(name, buffer, tuple(weight.shape), (torch.float32, torch.bfloat16), weight.device)
    if not (buffer.is_contiguous() or has_contiguous_expert_rows(buffer)):
        raise ValueError(
            f"{name} must be contiguous, or each expert's rows contiguous (a half of an "
            "[E, 2I, H] gradient): the gradient is added into it in place"
        )
    return buffer, True


def expert_mlp_backward(
    grad_out: torch.Tensor,
    saved: ExpertMLPSaved,
    grad_w_gate: torch.Tensor | None = None,
    grad_w_up: torch.Tensor | None = None,
    grad_w_down: torch.Tensor | None = None,
    release: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `expert_mlp_forward` given grad_out [M, H] (the rows' dtype and device): its
    four products in the order that holds the least memory at once (`down_data_gradient`,
    `down_weight_gradient`, `gate_up_weight_gradients`, `gate_up_data_gradient`).

    grad_w_gate, grad_w_up, grad_w_down: optional fp32 or bf16 buffers of the weights'
      shapes, contiguous or each expert's rows contiguous (`has_contiguous_expert_rows`: the
      halves of a gate_up gradient); the gradient is ADDED into a given buffer in place (in
      fp32, rounded once) and the buffer is returned. Otherwise a fresh tensor of the weights'
      dtype is returned.
    release: `saved` serves this backward only: each of its tensors is released after the last
      product that reads it (`ExpertMLPSaved.release`).
    Returns (grad_rows [M, H], grad_w_gate, grad_w_up, grad_w_down). grad_rows is zero outside the
    groups; weight gradients of experts without rows are zero (accumulation buffers untouched).
    Rows of grad_out outside the groups are never read.
    """
    grad_gate_up = down_data_gradient(grad_out, saved)
    if release:
        saved.release("gate_up")
    grad_w_down = down_weight_gradient(grad_out, saved, grad_w_down)
    if release:
        saved.release("h")
    grad_w_gate, grad_w_up = gate_up_weight_gradients(grad_gate_up, saved, grad_w_gate, grad_w_up)
    if release:
        saved.release("rows")
    grad_rows = gate_up_data_gradient(grad_gate_up, saved)
    return grad_rows, grad_w_gate, grad_w_up, grad_w_down


def _saved_tensor(saved: ExpertMLPSaved, name: str) -> torch.Tensor:
    if name in ("h", "gate_up"):
        replay_activations(saved)
    value = getattr(saved, name)
    if value is None:
        raise ValueError(f"the saved {name} was released by an earlier product of this backward")
    return value


def down_data_gradient(
    grad_out: torch.Tensor,
    saved: ExpertMLPSaved,
    rows_ready: RowsReady | None = None,
    dgrad_sms: int | None = None,
    claims: TileClaims | None = None,
) -> torch.Tensor:
    """The pre-activations' gradients gate | up [M, 2I] given grad_out [M, H]: grad_h = grad_out
    @ W_down[e] and the activation's backward on the saved pre-activations, one product.

    rows_ready: grad_out's rows land while this product runs, written by a kernel beside it
      (`RowsReady`): each tile waits for its rows' flags first. dgrad_sms: its grid held to this
      many SMs (`GemmTiles.max_sms`), leaving the rest to the kernel beside it. claims: with
      dgrad_sms, its tasks claimed (`TileClaims`), so that more programs may join it once the
      kernel beside is done."""
    if not isinstance(saved, ExpertMLPSaved):
        raise ValueError(f"saved must be the ExpertMLPSaved of a forward call, got {type(saved)}")
    gate_up = _saved_tensor(saved, "gate_up")
    m, inter = gate_up.shape[0], saved.w_gate.shape[1]
    _check("grad_out", grad_out, (m, saved.w_down.shape[1]), (gate_up.dtype,), gate_up.device)
    _check_tma_layout("grad_out", grad_out)
    if m == 0:
        return gate_up.new_empty(0, 2 * inter)
    cfg = saved.config
    if dgrad_sms is not None:
        cfg = _with_down_dgrad_sms(cfg, dgrad_sms, claims)
    down_cfg, down_dgrad = pick(Product.DOWN_DGRAD, cfg, grad_out, saved.w_down)
    return down_dgrad(
        grad_out,
        saved.w_down,
        gate_up,
        cached_row_tiles(saved.row_tiles, saved.group_offsets, m, down_cfg.block_m),
        saved.swiglu_limit,
        down_cfg,
        ready=rows_ready,
        activation=saved.activation,
    )


def weighted_down_data_gradient(
    grad_rows: torch.Tensor,
    saved: ExpertMLPSaved,
    row_weights: torch.Tensor,
    rows_ready: RowsReady | None = None,
    dgrad_sms: int | None = None,
    claims: TileClaims | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`down_data_gradient` with the router weights applied after the product
    (`grouped_gemm.down_dgrad_swiglu_weighted`): grad_rows [M, H] are the unweighted gradients of
    the rows' outputs, row_weights [M] fp32 each row's router weight (0 for rows no pair uses).
    Returns (the pre-activations' gradients [M, 2I], the router weights' dots [M] fp32: <grad_rows
    [r] @ W_down[e], h[r]>). The saved h then holds round(w * h), so that `down_weight_gradient(
    grad_rows, saved)` gives W_down's gradient of the weighted rows. rows_ready, dgrad_sms and
    claims as in `down_data_gradient` (the rows land beside the product; row_weights must be in
    place before it starts)."""
    if not isinstance(saved, ExpertMLPSaved):
        raise ValueError(f"saved must be the ExpertMLPSaved of a forward call, got {type(saved)}")
    gate_up = _saved_tensor(saved, "gate_up")
    h = _saved_tensor(saved, "h")
    m = gate_up.shape[0]
    _check("grad_rows", grad_rows, (m, saved.w_down.shape[1]), (gate_up.dtype,), gate_up.device)
    _check_tma_layout("grad_rows", grad_rows)
    cfg = saved.config
    if dgrad_sms is not None:
        cfg = _with_down_dgrad_sms(cfg, dgrad_sms, claims)
    down_cfg, down_dgrad = pick(Product.DOWN_DGRAD_WEIGHTED, cfg, grad_rows, saved.w_down)
    return down_dgrad(
        grad_rows,
        saved.w_down,
        gate_up,
        h,
        row_weights,
        cached_row_tiles(saved.row_tiles, saved.group_offsets, m, down_cfg.block_m),
        saved.swiglu_limit,
        down_cfg,
        ready=rows_ready,
        activation=saved.activation,
    )


def gate_up_data_gradient(
    grad_gate_up: torch.Tensor,
    saved: ExpertMLPSaved,
) -> torch.Tensor:
    """grad_rows [M, H] = grad_gate @ W_gate[e] + grad_up @ W_up[e] given the pre-activations'
    gradients [M, 2I] (`down_data_gradient`), one product; zero outside the groups. Reads no
    saved activation (the MXFP8 layer passes their cast's values)."""
    m, hidden = grad_gate_up.shape[0], saved.w_gate.shape[2]
    if m == 0:
        return grad_gate_up.new_empty(0, hidden)
    gate_up_cfg, gate_up_dgrad = pick(
        Product.GATE_UP_DGRAD, saved.config, grad_gate_up, saved.w_gate, saved.w_up
    )
    return gate_up_dgrad(
        grad_gate_up,
        saved.w_gate,
        saved.w_up,
        cached_row_tiles(saved.row_tiles, saved.group_offsets, m, gate_up_cfg.block_m),
        gate_up_cfg,
    )


def _zeroed_unless_accumulating(buffer: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """The weight gradient of a call without rows: zero, or the accumulation buffer untouched."""
    if not accumulate:
        buffer.zero_()
    return buffer


def down_weight_gradient(
    grad_out: torch.Tensor,
    saved: ExpertMLPSaved,
    grad_w_down: torch.Tensor | None = None,
    sms: int | None = None,
    claims: TileClaims | None = None,
) -> torch.Tensor:
    """grad_w_down [E, H, I]: per expert, grad_out[e].T @ h[e], from grad_out [M, H] and the
    saved h; the buffer as in `expert_mlp_backward`. sms: the grid held to this many SMs (the
    rest left to communication running beside it; None: every SM); claims: with sms, its tasks
    claimed (`TileClaims`), so that more programs may join once the communication is done."""
    grad_w_down, accumulate = _grad_buffer("grad_w_down", grad_w_down, saved.w_down)
    h = _saved_tensor(saved, "h")
    if h.shape[0] == 0:
        return _zeroed_unless_accumulating(grad_w_down, accumulate)
    cfg = saved.config if sms is None else held_to(saved.config, sms, claims=claims)
    tiles, down_wgrad = pick(Product.DOWN_WGRAD, cfg, grad_out, h, grad_w_down)
    down_wgrad(grad_out, h, saved.group_offsets, grad_w_down, accumulate, tiles)
    return grad_w_down


def gate_up_weight_gradients(
    grad_gate_up: torch.Tensor,
    saved: ExpertMLPSaved,
    grad_w_gate: torch.Tensor | None = None,
    grad_w_up: torch.Tensor | None = None,
    sms: int | None = None,
    claims: TileClaims | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_w_gate, grad_w_up) [E, I, H]: per expert, grad_gate[e].T @ rows[e] and likewise
    up, one product, from the pre-activations' gradients [M, 2I] and the saved rows (read
    through `saved.source_rows` where set); buffers, sms and claims as in
    `down_weight_gradient`. Fresh gradients of weights that are the halves of one [E, 2I, H]
    tensor are the halves of one such tensor too (`mok.weights.joined_gate_up` returns it)."""
    if grad_w_gate is None and grad_w_up is None and are_gate_up_halves(saved.w_gate, saved.w_up):
        grad_w_gate, grad_w_up = empty_gate_up_pair(saved.w_gate)
        acc_gate = acc_up = False
    else:
        grad_w_gate, acc_gate = _grad_buffer("grad_w_gate", grad_w_gate, saved.w_gate)
        grad_w_up, acc_up = _grad_buffer("grad_w_up", grad_w_up, saved.w_up)
    rows = _saved_tensor(saved, "rows")
    source_rows = saved.source_rows
    if grad_gate_up.shape[0] == 0:
        return (
            _zeroed_unless_accumulating(grad_w_gate, acc_gate),
            _zeroed_unless_accumulating(grad_w_up, acc_up),
        )
    cfg = saved.config if sms is None else held_to(saved.config, sms, claims=claims)
    tiles, gate_up_wgrad = pick(
        Product.GATE_UP_WGRAD,
        cfg,
        grad_gate_up,
        rows,
        grad_w_gate,
        grad_w_up,
        gather=source_rows is not None,
    )
    gate_up_wgrad(
        grad_gate_up,
        rows,
        saved.group_offsets,
        grad_w_gate,
        grad_w_up,
        acc_gate,
        acc_up,
        tiles,
        source_rows=source_rows,
    )
    return grad_w_gate, grad_w_up


def expert_bias_gradients(
    grad_out: torch.Tensor,
    grad_gate_up: torch.Tensor,
    saved: ExpertMLPSaved,
    grad_gate_bias: torch.Tensor | None = None,
    grad_up_bias: torch.Tensor | None = None,
    grad_down_bias: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the experts' biases of a forward with `biases`: per expert, the sums over
    its rows of the gate and up pre-activations' gradients (grad_gate_up [M, 2I], from
    `down_data_gradient`) and of grad_out [M, H] (`gg.group_column_sums`: fp32, a fixed
    order); with row_weights [M] fp32 (`weighted_down_data_gradient`'s unweighted rows), of
    each grad_out row times its weight. A given buffer (fp32 or bf16, the bias's shape) has the
    gradient added into it in place and is returned; otherwise a tensor of the bias's dtype.
    Zero for experts without rows."""
    if saved.biases is None:
        raise ValueError("expert_bias_gradients: the forward ran without biases")
    inter = saved.w_gate.shape[1]
    values = (grad_gate_up[:, :inter], grad_gate_up[:, inter:], grad_out)
    weights = (None, None, row_weights)
    names = ("grad_gate_bias", "grad_up_bias", "grad_down_bias")
    buffers = (grad_gate_bias, grad_up_bias, grad_down_bias)
    results = []
    for name, bias, value, weight, buffer in zip(
        names, saved.biases, values, weights, buffers, strict=True
    ):
        out, accumulate = _grad_buffer(name, buffer, bias)
        group_sums = gg.group_column_sums(value, saved.group_offsets, out, accumulate, weight)
        results.append(group_sums)
    return tuple(results)


def add_down_bias_dots(grad_rows: torch.Tensor, saved: ExpertMLPSaved, dots: torch.Tensor) -> None:
    """dots [M] fp32 += <grad_rows[r], b_down[e]> per grouped row r of expert e (grad_rows [M, H]
    the rows' unweighted output gradients): the down bias's part of the router weights'
    gradient, beside `weighted_down_data_gradient`'s <acc, h>."""
    if saved.biases is None:
        raise ValueError("add_down_bias_dots: the forward ran without biases")
    tiles = cached_row_tiles(
        saved.row_tiles, saved.group_offsets, grad_rows.shape[0], gg.ROW_DOTS_BLOCK_M
    )
    gg.group_row_dots(grad_rows, tiles, saved.biases[2].contiguous(), dots)
