"""The 128-block FP8 recipe as tl kernels: the casts of 1 x 128 tiles (along the features, and
along each group's tokens), the grouped product and the weight gradient,
`mok.reference.fp8_block`'s on the GPU (the casts bit for bit), the oracles of the recipe's fast
kernels and their fallback.

The cast (`block_quantize_tile`, `block_quantize_tiles`): a tile's largest magnitude, its scale
448 / amax (the division in fp64, as torchao's cast), the descale 1 / scale rounded to nearest
(not the GPU's fast division), the values e4m3 of the clamped scaled values (`e4m3_bytes`).

Each group's rows A (e4m3, 1 x 128 tiles along K with fp32 descales) times its expert's weight W
(e4m3, 128 x 128 blocks with fp32 descales), step by step along K as the recipe forms it
(`mok.reference.fp8_block.scaled_matmul`): each 128-element step's products are summed in fp32
(exact products: an e4m3 value is a bf16 value, so the step is one bf16 dot), that partial tile
is scaled by the two operands' descales, and added to the fp32 accumulator. The tile of a step is
a whole scale block along K, so a step reads one A descale per row and one W descale per column.
The kernel decodes e4m3 in the main loop and runs the BF16 tensor cores: the twin that FP8
kernels are tested against, not a fast path.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from mok.kernels._triton_compat import interpreting, patch_interpreter
from mok.kernels.formats import PackedRows, fp8_block_row_bytes
from mok.kernels.grouped_gemm import grouped_task, load_row_tile, row_tile_map
from mok.kernels.host import GemmTiles, RowTiles, launch_options, num_programs
from mok.kernels.launch import fast_launch
from mok.kernels.mx import bf16_rounded, e4m3_saturated_bytes, e4m3_values
from mok.reference.fp8_block import AMAX_FLOOR, BLOCK, E4M3_MAX

if interpreting():
    patch_interpreter()

_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_BLOCK = tl.constexpr(BLOCK)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
HARDWARE_DOT = tl.constexpr(not interpreting())
"""The step's e4m3 values enter the dot as bf16 (exact) on GPUs; under the interpreter as fp32
(exact too), since its dot multiplies the bits of bf16 values made inside a kernel."""
TILES = GemmTiles(block_m=64, block_n=128, block_k=BLOCK, num_warps=4, num_stages=3)
"""Tiles of the tl product: BLOCK_K is the scale block (one descale per row and column a step)."""
WGRAD_TILES = GemmTiles(block_m=64, block_n=64, block_k=BLOCK, num_warps=4, num_stages=2)
"""Tiles of the tl weight gradient: 64 rows of N by 64 columns of K, a step per 128 tokens."""


@triton.jit
def _magnitude_bits(tile):
    """|tile|'s fp32 bits as int32: they order as |x| does, every NaN's above infinity's, so one
    integer max finds both."""
    return tile.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _tile_scales(amax_bits):
    """(scale, descale) fp32 of tiles whose largest magnitudes have the fp32 bits amax_bits, as
    `mok.reference.fp8_block` forms them: 448 / amax in fp64 (amax at least the floor), its
    reciprocal rounded to nearest (not the GPU's fast division)."""
    amax = amax_bits.to(tl.float32, bitcast=True).to(tl.float64)
    floor = tl.full(amax.shape, _AMAX_FLOOR, tl.float64)
    amax = tl.maximum(amax, floor, propagate_nan=tl.PropagateNan.ALL)
    scale = (tl.full(amax.shape, _E4M3_MAX, tl.float64) / amax).to(tl.float32)
    return scale, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def block_quantize_tile(tile):
    """(e4m3 bytes as int32 [ROWS, 128], descales fp32 [ROWS]) of an fp32 tile of x's values,
    one 1 x 128 tile a row (zeros past a ragged end: they never raise an amax), as
    `mok.reference.fp8_block.quantize_tiles` casts them."""
    scale, descale = _tile_scales(tl.max(_magnitude_bits(tile), axis=1))
    return e4m3_saturated_bytes(tile * scale[:, None]), descale


@fast_launch
@triton.jit
def _weight_blocks_kernel(
    w_ptr,  # [E, N, K] bf16 or fp32, contiguous
    values_ptr,  # [E, N, K] out, e4m3 as uint8
    descales_ptr,  # [E, cdiv(N, 128), cdiv(K, 128)] out, fp32
    values_t_ptr,  # [E, K, N] out, e4m3 as uint8 (strides t_strides[0:2], unit last)
    descales_t_ptr,  # [E, cdiv(K, 128), cdiv(N, 128)] out, fp32 (strides t_strides[2:4])
    N,
    K,
    t_strides,
    BLOCK_SIDE: tl.constexpr,
):
    """Grid: (E, cdiv(N, 128), cdiv(K, 128)). Program (e, i, j) casts block (i, j) of w[e] (its
    elements inside w: a ragged block's amax over them), writing its codes into values and,
    transposed, into values_t, its descale at [e, i, j] and at [e, j, i]."""
    values_t_experts, values_t_rows, descales_t_experts, descales_t_rows = t_strides
    expert = tl.program_id(0).to(tl.int64)
    block_n, block_k = tl.program_id(1), tl.program_id(2)
    blocks_n, blocks_k = tl.num_programs(1), tl.num_programs(2)
    rows = block_n * BLOCK_SIDE + tl.arange(0, BLOCK_SIDE)
    cols = block_k * BLOCK_SIDE + tl.arange(0, BLOCK_SIDE)
    inside = (rows < N)[:, None] & (cols < K)[None, :]
    at = expert * N * K + rows[:, None] * K + cols[None, :]
    tile = tl.load(w_ptr + at, mask=inside, other=0.0).to(tl.float32)
    amax_bits = tl.max(tl.max(_magnitude_bits(tile), axis=1), axis=0, keep_dims=True)
    scale, descale = _tile_scales(amax_bits)
    codes = e4m3_saturated_bytes(tile * scale[:, None]).to(tl.uint8)
    tl.store(values_ptr + at, codes, mask=inside)
    at_t = expert * values_t_experts + cols[:, None].to(tl.int64) * values_t_rows + rows[None, :]
    tl.store(values_t_ptr + at_t, tl.trans(codes), mask=tl.trans(inside))
    one = tl.arange(0, 1)
    tl.store(descales_ptr + (expert * blocks_n + block_n) * blocks_k + block_k + one, descale)
    at_t = expert * descales_t_experts + block_k * descales_t_rows + block_n + one
    tl.store(descales_t_ptr + at_t, descale)


def block_quantize_weights(w: torch.Tensor, transposed_into: tuple | None = None) -> tuple:
    """`mok.reference.fp8_block.quantize_blocks(w)` bit for bit, and its transpose, in one pass:
    w [E, N, K] bf16 or fp32 -> ((values [E, N, K] float8_e4m3fn, descales [E, cdiv(N, 128),
    cdiv(K, 128)] fp32), (values [E, K, N], descales [E, cdiv(K, 128), cdiv(N, 128)])): the cast
    of w and that of w.T (W.T's blocks are W's transposed). transposed_into: where the
    transposed cast goes (views of those shapes with unit last strides, e.g. halves of a wider
    tensor), else new contiguous tensors."""
    if w.dim() != 3 or w.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"w: [E, N, K] bf16 or fp32, got {tuple(w.shape)} {w.dtype}")
    w = w.contiguous()
    experts, n, k = w.shape
    blocks_n, blocks_k = triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)
    device, e4m3 = w.device, torch.float8_e4m3fn
    values = torch.empty(experts, n, k, dtype=torch.uint8, device=device)
    descales = torch.empty(experts, blocks_n, blocks_k, dtype=torch.float32, device=device)
    if transposed_into is None:
        transposed_into = (
            torch.empty(experts, k, n, dtype=e4m3, device=device),
            torch.empty(experts, blocks_k, blocks_n, dtype=torch.float32, device=device),
        )
    values_t, descales_t = transposed_into
    if (
        values_t.shape != (experts, k, n)
        or descales_t.shape != (experts, blocks_k, blocks_n)
        or values_t.dtype != e4m3
        or values_t.stride(2) != 1
        or descales_t.stride(2) != 1
    ):
        raise ValueError(
            f"transposed_into: [{experts}, {k}, {n}] e4m3 and [{experts}, {blocks_k}, "
            f"{blocks_n}] fp32 with unit last strides"
        )
    if w.numel():
        t_strides = (*values_t.stride()[:2], *descales_t.stride()[:2])
        _weight_blocks_kernel[(experts, blocks_n, blocks_k)](
            w, values, descales, values_t.view(torch.uint8), descales_t, n, k, t_strides,
            BLOCK_SIDE=BLOCK, num_warps=8,
        )  # fmt: skip
    return (values.view(e4m3), descales), (values_t, descales_t)


@fast_launch
@triton.jit
def _block_quantize_kernel(
    x_ptr,  # [M, K] bf16 or fp32
    values_ptr,  # [M, K] out, e4m3 as uint8
    descales_ptr,  # [M, S] out, fp32
    M,
    K,
    strides,  # the row strides of x, values and descales, in their elements
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid: (cdiv(M, BLOCK_M), S). One program casts the 1 x 128 tiles of step program_id(1) of
    BLOCK_M rows."""
    x_stride, values_stride, descales_stride = strides
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    step = tl.program_id(1)
    cols = step * BLOCK_K + tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    inside = (rows < M)[:, None] & (cols < K)[None, :]
    tile = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=inside, other=0.0)
    codes, descales = block_quantize_tile(tile.to(tl.float32))
    values_at = values_ptr + rows64[:, None] * values_stride + cols[None, :]
    tl.store(values_at, codes.to(tl.uint8), mask=inside)
    tl.store(descales_ptr + rows64 * descales_stride + step, descales, mask=rows < M)


def _check_cast_input(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32) or x.stride(1) != 1:
        raise ValueError(
            f"x: [M, K] bf16 or fp32 with a unit last stride, got {tuple(x.shape)} {x.dtype}"
        )


def _cast_rows(x: torch.Tensor, values: torch.Tensor, descales: torch.Tensor) -> None:
    """x's 1 x 128 tiles cast into values [M, K] uint8 and descales [M, S] fp32 (unit last
    strides, any row strides)."""
    m, k = x.shape
    if m and k:
        block_m = 32
        strides = (x.stride(0), values.stride(0), descales.stride(0))
        _block_quantize_kernel[(triton.cdiv(m, block_m), descales.shape[1])](
            x, values, descales, m, k, strides, BLOCK_M=block_m, BLOCK_K=BLOCK
        )


def block_quantize_tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`mok.reference.fp8_block.quantize_tiles(x)` along x's last dimension, bit for bit: x [M, K]
    bf16 or fp32 with a unit last stride -> (values [M, K] float8_e4m3fn, descales
    [M, cdiv(K, 128)] fp32), both contiguous."""
    _check_cast_input(x)
    m, k = x.shape
    values = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    descales = torch.empty(m, triton.cdiv(k, BLOCK), dtype=torch.float32, device=x.device)
    _cast_rows(x, values, descales)
    return values.view(torch.float8_e4m3fn), descales


def quantize_side_by_side(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The 1 x 128 tile casts (`block_quantize_tiles`) of parts [M, K_i] side by side along K,
    each part from a whole step on (padded with zero values to a multiple of 128): (values
    [M, sum of padded K_i] float8_e4m3fn, descales [M, sum of cdiv(K_i, 128)] fp32). A product
    of these with weights' casts laid out alike along K sums the parts' products in one
    accumulator."""
    m = parts[0].shape[0]
    steps = [triton.cdiv(part.shape[1], BLOCK) for part in parts]
    device = parts[0].device
    ragged = any(part.shape[1] % BLOCK for part in parts)
    values = (torch.zeros if ragged else torch.empty)(
        m, BLOCK * sum(steps), dtype=torch.uint8, device=device
    )
    descales = torch.empty(m, sum(steps), dtype=torch.float32, device=device)
    step = 0
    for part, count in zip(parts, steps, strict=True):
        _check_cast_input(part)
        at = BLOCK * step
        _cast_rows(part, values[:, at : at + part.shape[1]], descales[:, step : step + count])
        step += count
    return values.view(torch.float8_e4m3fn), descales


@dataclasses.dataclass(frozen=True)
class BlockRows(PackedRows):
    """Rows [N, C] cast in the 128-block recipe (1 x 128 tiles), packed (`PackedRows`): its C
    e4m3 bytes (`codes`: `block_quantize_tiles`' values), then its cdiv(C, 128) fp32 descales, at
    about 0.52x the bytes of a bf16 row."""

    @staticmethod
    def row_bytes(cols: int) -> int:
        """Bytes of one packed row of `cols` columns."""
        return fp8_block_row_bytes(cols)

    @property
    def descales(self) -> torch.Tensor:
        """[N, cdiv(C, 128)] fp32 (a strided view)."""
        return self.packed[:, self.cols : self.cols + 4 * triton.cdiv(self.cols, BLOCK)].view(
            torch.float32
        )


def block_quantize_rows(x: torch.Tensor) -> BlockRows:
    """x [N, C] (bf16 or fp32, a unit last stride, C a multiple of 16) cast along its rows into
    packed `BlockRows`: the values and descales of `block_quantize_tiles(x)`, bit for bit."""
    _check_cast_input(x)
    out = BlockRows.empty(*x.shape, x.device)
    _cast_rows(x, out.packed[:, : x.shape[1]], out.descales)
    return out


@triton.jit
def plain_rows(source, rows, cols, inside):
    """Row source of `_block_quantize_tokens_kernel`: x's elements (source: (x_ptr [M, C] bf16 or
    fp32, its row stride)) at rows x cols, as fp32 (zeros outside)."""
    x_ptr, x_stride = source
    tile = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=inside, other=0.0)
    return tile.to(tl.float32)


@triton.jit
def tile_cast_rows(source, rows, cols, inside):
    """Row source of `_block_quantize_tokens_kernel`: the values of a 1 x 128 tile cast (source:
    (values_ptr [M, C] e4m3 as uint8, descales_ptr [M, cdiv(C, 128)] fp32, their row strides))
    at rows x cols, each code times its tile's descale in fp32, as
    `mok.reference.fp8_block.dequantize_tiles` forms them (zeros outside)."""
    values_ptr, descales_ptr, values_stride, descales_stride = source
    codes = tl.load(
        values_ptr + rows[:, None] * values_stride + cols[None, :], mask=inside, other=0
    )
    at = descales_ptr + rows[:, None] * descales_stride + (cols // _BLOCK)[None, :]
    return e4m3_values(codes) * tl.load(at, mask=inside, other=0.0)


@triton.jit
def rows_store(values_ptr, codes, rows, cols, t, inside, C, capacity):
    """Store part of `_block_quantize_tokens_kernel`: a tile's codes ([BLOCK_C, 128], a column's
    tile along the tokens a row) into values [M, C] at the tokens' rows (rows outside the groups
    unwritten)."""
    at = values_ptr + rows[:, None] * C + cols[None, :]
    tl.store(at, tl.trans(codes).to(tl.uint8), mask=inside)


@triton.jit
def tokens_store(values_ptr, codes, rows, cols, t, inside, C, capacity):
    """Store part of `_block_quantize_tokens_kernel`: a tile's codes into values [C, capacity *
    128], tokens contiguous, token tile t at columns 128 t..: as FP8 MMAs take an operand whose
    reduction runs over the tokens (the tile's tokens past its group's end are zeros)."""
    tokens = t.to(tl.int64) * _BLOCK + tl.arange(0, _BLOCK)
    at = values_ptr + cols.to(tl.int64)[:, None] * (capacity * _BLOCK) + tokens[None, :]
    tl.store(at, codes.to(tl.uint8), mask=(cols < C)[:, None])


@fast_launch
@triton.jit(do_not_specialize=["capacity"])
def _block_quantize_tokens_kernel(
    source,  # what ROWS reads the rows' values from
    values_ptr,  # out, e4m3 as uint8, laid out as STORE writes it
    descales_ptr,  # [capacity, C] out, fp32, contiguous
    table_ptr,  # [3, capacity] int32 row tiles of 128 rows
    counts_ptr,  # [2] int32
    capacity,
    C,
    ROWS: tl.constexpr,
    STORE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid: (capacity, cdiv(C, BLOCK_C)). Program (t, j): row tile t of the groups' (rows [row,
    row_end), at most BLOCK_T) at columns j * BLOCK_C..: each column's tile along the tokens cast
    (`block_quantize_tile` on the transposed tile of the values ROWS gives, `plain_rows` or
    `tile_cast_rows`), its codes stored by STORE (`rows_store`, `tokens_store`), its descale at
    descales[t, column]."""
    t = tl.program_id(0)
    if t < tl.load(counts_ptr):
        row = tl.load(table_ptr + capacity + t)
        row_end = tl.load(table_ptr + 2 * capacity + t)
        rows = (row + tl.arange(0, BLOCK_T)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        inside = (rows < row_end)[:, None] & (cols < C)[None, :]
        codes, descales = block_quantize_tile(tl.trans(ROWS(source, rows, cols, inside)))
        STORE(values_ptr, codes, rows, cols, t, inside, C, capacity)
        tl.store(descales_ptr + t * C + cols, descales, mask=cols < C)


def block_quantize_tokens(
    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], tiles: RowTiles, transposed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cast of each group's rows along the tokens, as the recipe's weight gradients take their
    operands: tiles of 128 rows from each group's first row, `quantize_tiles(x[group], dim=0)`
    bit for bit. x [M, C] bf16 or fp32 with a unit last stride, or a 1 x 128 tile cast of it
    ((values [M, C] e4m3, descales [M, cdiv(C, 128)] fp32), unit last strides): then x is
    `dequantize_tiles(values, descales)`, read from the cast in one pass. tiles: `row_tile_map`
    of the groups with block_m 128. Returns (values float8_e4m3fn, descales [capacity, C] fp32,
    row t the descales of the table's tile t: each group's tiles in row order, the groups in
    expert order, then rows never written). values: [M, C], rows outside the groups unwritten;
    with `transposed` [C, capacity * 128], tokens contiguous, the table's tile t at columns
    128 t.. (its tokens past the group's end zeros; tiles past the table's count unwritten)."""
    if isinstance(x, tuple):
        cast_values, cast_descales = x
        m, c = cast_values.shape
        if cast_values.stride(1) != 1 or cast_descales.stride(1) != 1:
            raise ValueError("the tile cast's values and descales need unit last strides")
        if cast_descales.shape != (m, triton.cdiv(c, BLOCK)):
            raise ValueError(f"descales of [{m}, {c}] values: [{m}, {triton.cdiv(c, BLOCK)}]")
        strides = (cast_values.stride(0), cast_descales.stride(0))
        source = (cast_values.view(torch.uint8), cast_descales, *strides)
        rows_part, device = tile_cast_rows, cast_values.device
    else:
        _check_cast_input(x)
        (m, c), source, rows_part, device = x.shape, (x, x.stride(0)), plain_rows, x.device
    if tiles.block_m != BLOCK:
        raise ValueError(f"the tokens' tiles are {BLOCK} rows: row tiles of {tiles.block_m}")
    shape = (c, tiles.capacity * BLOCK) if transposed else (m, c)
    values = torch.empty(shape, dtype=torch.uint8, device=device)
    descales = torch.empty(tiles.capacity, c, dtype=torch.float32, device=device)
    if m and c:
        block_c = 32
        _block_quantize_tokens_kernel[(tiles.capacity, triton.cdiv(c, block_c))](
            source, values, descales, tiles.table, tiles.counts, tiles.capacity, c,
            ROWS=rows_part, STORE=tokens_store if transposed else rows_store, BLOCK_C=block_c,
            BLOCK_T=BLOCK,
        )  # fmt: skip
    return values.view(torch.float8_e4m3fn), descales


def token_tile_starts(group_offsets: torch.Tensor) -> torch.Tensor:
    """[E] int32: each group's first tile of 128 tokens in `row_tile_map`'s order of 128-row
    tiles (the groups' tiles in expert order), on the offsets' device, no host synchronization."""
    sizes = (group_offsets[1:] - group_offsets[:-1]).clamp(min=0)
    tiles = torch.div(sizes + BLOCK - 1, BLOCK, rounding_mode="floor")
    return (tiles.cumsum(0) - tiles).to(torch.int32)


@triton.jit
def block_scaled_step(
    a_ptr,  # [M, K] e4m3 as uint8, row stride a_stride
    a_descales_ptr,  # [M, S] fp32, S = cdiv(K, 128)
    w_ptr,  # this expert's [N, K] e4m3 as uint8, contiguous
    w_descales_ptr,  # this expert's [cdiv(N, 128), S] fp32, contiguous
    rows,  # [BLOCK_M] the tile's rows
    row_ok,  # [BLOCK_M] rows inside the group
    cols,  # [BLOCK_N] the tile's columns
    step,
    a_stride,
    N,
    K,
    BLOCK_K: tl.constexpr,
):
    """One step of the recipe's GEMM on a tile: the fp32 [BLOCK_M, BLOCK_N] partial sums of
    A[rows, step * 128 + k] x W[cols, step * 128 + k] over the step's k, times A's descale of
    each row and W's of each column (their product first, as the reference forms it)."""
    scales = tl.cdiv(K, BLOCK_K)
    ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    a_codes = tl.load(
        a_ptr + rows.to(tl.int64)[:, None] * a_stride + ks[None, :],
        mask=row_ok[:, None] & k_ok[None, :],
        other=0,
    )
    col_ok = cols < N
    w_codes = tl.load(
        w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :],
        mask=col_ok[:, None] & k_ok[None, :],
        other=0,
    )
    a = e4m3_values(a_codes)
    w = e4m3_values(w_codes)
    if HARDWARE_DOT:
        partial = tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), out_dtype=tl.float32)
    else:
        partial = tl.dot(a, tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
    a_descale = tl.load(a_descales_ptr + rows.to(tl.int64) * scales + step, mask=row_ok, other=0.0)
    w_descale = tl.load(w_descales_ptr + (cols // BLOCK_K) * scales + step, mask=col_ok, other=0.0)
    return partial * (a_descale[:, None] * w_descale[None, :])


@fast_launch
@triton.jit(do_not_specialize=["capacity"])
def _block_scaled_kernel(
    a_ptr,  # [M, K] e4m3 as uint8
    a_descales_ptr,  # [M, S] fp32
    w_ptr,  # [E, N, K] e4m3 as uint8, contiguous
    w_descales_ptr,  # [E, cdiv(N, 128), S] fp32, contiguous
    out_ptr,  # [M, N] out, contiguous
    table_ptr,  # [3, capacity] int32 row tiles
    counts_ptr,  # [2] int32
    capacity,
    a_stride,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS. out = A x W[e] in the recipe's steps for every group's rows
    (`block_scaled_step`), accumulated in fp32, rounded once to out's dtype; rows outside the
    groups are not written."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    num_m = tl.load(counts_ptr)
    scales = tl.cdiv(K, BLOCK_K)
    for task in tl.range(tl.program_id(0), num_m * n_tiles, NUM_PROGRAMS):
        m_idx, n_idx = grouped_task(task, num_m, n_tiles, GROUP_M)
        expert, row, row_end = load_row_tile(table_ptr, capacity, m_idx)
        rows = row + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        cols = n_idx * BLOCK_N + tl.arange(0, BLOCK_N)
        w_expert = w_ptr + expert.to(tl.int64) * N * K
        w_descales = w_descales_ptr + expert.to(tl.int64) * tl.cdiv(N, BLOCK_K) * scales
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, scales):
            acc += block_scaled_step(
                a_ptr, a_descales_ptr, w_expert, w_descales, rows, row_ok, cols, step, a_stride,
                N, K, BLOCK_K,
            )  # fmt: skip
        if out_ptr.dtype.element_ty == tl.bfloat16:
            acc = bf16_rounded(acc)  # the interpreter's own cast truncates
        out = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


def check_block_scaled_operands(
    a_values, a_descales, w_values, w_descales, group_offsets
) -> tuple[int, int, int]:
    """(M, N, K) of the operands, or ValueError naming the one that does not fit."""
    m, k = a_values.shape
    experts, n, w_k = w_values.shape
    steps, blocks = triton.cdiv(k, BLOCK), triton.cdiv(n, BLOCK)
    if a_values.dtype != torch.float8_e4m3fn or w_values.dtype != torch.float8_e4m3fn:
        raise ValueError(f"values must be float8_e4m3fn, got {a_values.dtype}, {w_values.dtype}")
    if w_k != k or a_values.stride(1) != 1:
        raise ValueError(
            f"A [M, K] with a unit last stride and W [E, N, K], got {tuple(a_values.shape)} and "
            f"{tuple(w_values.shape)}"
        )
    if a_descales.shape != (m, steps) or w_descales.shape != (experts, blocks, steps):
        raise ValueError(
            f"descales: A's [{m}, {steps}] and W's [{experts}, {blocks}, {steps}] expected, got "
            f"{tuple(a_descales.shape)} and {tuple(w_descales.shape)}"
        )
    if a_descales.dtype != torch.float32 or w_descales.dtype != torch.float32:
        raise ValueError("descales must be float32")
    if group_offsets.shape != (experts + 1,) or group_offsets.dtype != torch.int32:
        raise ValueError(f"group_offsets: [{experts + 1}] int32 expected")
    return m, n, k


def block_scaled_grouped_mm(
    a_values: torch.Tensor,
    a_descales: torch.Tensor,
    w_values: torch.Tensor,
    w_descales: torch.Tensor,
    group_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    cfg: GemmTiles = TILES,
    tiles: RowTiles | None = None,
) -> torch.Tensor:
    """out [M, N] of out_dtype: for each expert e, the rows of its group
    [group_offsets[e], group_offsets[e + 1]) of A (a_values [M, K] e4m3, a_descales [M, S] fp32:
    `quantize_tiles` along K) times W[e] (w_values [E, N, K] e4m3, w_descales [E, cdiv(N, 128),
    S] fp32: `quantize_blocks`), as `mok.reference.fp8_block.scaled_matmul` forms it, rounded
    once; S = cdiv(K, 128). Rows outside the groups are left unwritten. group_offsets: [E + 1]
    int32 on the device, non-decreasing, the last <= M. tiles: their `row_tile_map` for
    cfg.block_m, where the caller has it (None: made here)."""
    m, n, k = check_block_scaled_operands(a_values, a_descales, w_values, w_descales, group_offsets)
    if cfg.block_k != BLOCK:
        raise ValueError(f"a step of the recipe is one scale block: block_k {BLOCK}")
    out = torch.empty(m, n, dtype=out_dtype, device=a_values.device)
    if m == 0 or n == 0:
        return out
    if tiles is None:
        tiles = row_tile_map(group_offsets, m, cfg.block_m)
    elif tiles.block_m != cfg.block_m:
        raise ValueError(f"row tiles of {tiles.block_m} rows for tiles of {cfg.block_m}")
    programs = num_programs(a_values.device, tiles.capacity * triton.cdiv(n, cfg.block_n), cfg)
    _block_scaled_kernel[(programs,)](
        a_values.view(torch.uint8),
        a_descales.contiguous(),
        w_values.contiguous().view(torch.uint8),
        w_descales.contiguous(),
        out,
        tiles.table,
        tiles.counts,
        tiles.capacity,
        a_values.stride(0),
        n,
        k,
        **launch_options(cfg, programs),
    )
    return out


@fast_launch
@triton.jit
def _block_scaled_wgrad_kernel(
    g_ptr,  # [M, N] e4m3 as uint8, contiguous: the gradient, cast along the tokens
    g_descales_ptr,  # [capacity, N] fp32: its descales, a row per tile of 128 tokens
    x_ptr,  # [M, K] e4m3 as uint8, contiguous: the inputs, cast along the tokens
    x_descales_ptr,  # [capacity, K] fp32
    offsets_ptr,  # [E + 1] int32 group offsets
    tile_starts_ptr,  # [E] int32: each expert's first tile (row of the descales)
    out_ptr,  # [E, N, K] out, contiguous
    num_experts,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS. out[e] = G[group e].T x X[group e] in the recipe's steps, a step
    per tile of 128 tokens from the group's first row: the step's fp32 partial sums times G's
    descale of each row n and X's of each column k, added in fp32; rounded once (zeros for an
    expert without rows)."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for task in tl.range(tl.program_id(0), num_experts * n_tiles * k_tiles, NUM_PROGRAMS):
        expert = task // (n_tiles * k_tiles)
        n_idx = task // k_tiles % n_tiles
        k_idx = task % k_tiles
        start = tl.load(offsets_ptr + expert)
        end = tl.load(offsets_ptr + expert + 1)
        first_tile = tl.load(tile_starts_ptr + expert)
        ns = n_idx * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = k_idx * BLOCK_K + tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for step in range(0, tl.cdiv(end - start, BLOCK_T)):
            rows = (start + step * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
            row_ok = rows < end
            g_codes = tl.load(
                g_ptr + rows[:, None] * N + ns[None, :],
                mask=row_ok[:, None] & (ns < N)[None, :],
                other=0,
            )
            x_codes = tl.load(
                x_ptr + rows[:, None] * K + ks[None, :],
                mask=row_ok[:, None] & (ks < K)[None, :],
                other=0,
            )
            g = tl.trans(e4m3_values(g_codes))
            x = e4m3_values(x_codes)
            if HARDWARE_DOT:
                partial = tl.dot(g.to(tl.bfloat16), x.to(tl.bfloat16), out_dtype=tl.float32)
            else:
                partial = tl.dot(g, x, input_precision="ieee", out_dtype=tl.float32)
            tile = (first_tile + step).to(tl.int64)
            g_descale = tl.load(g_descales_ptr + tile * N + ns, mask=ns < N, other=0.0)
            x_descale = tl.load(x_descales_ptr + tile * K + ks, mask=ks < K, other=0.0)
            acc += partial * (g_descale[:, None] * x_descale[None, :])
        if out_ptr.dtype.element_ty == tl.bfloat16:
            acc = bf16_rounded(acc)  # the interpreter's own cast truncates
        out = out_ptr + expert.to(tl.int64) * N * K + ns[:, None] * K + ks[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(ns < N)[:, None] & (ks < K)[None, :])


def block_scaled_grouped_wgrad(
    g_values: torch.Tensor,
    g_descales: torch.Tensor,
    x_values: torch.Tensor,
    x_descales: torch.Tensor,
    group_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The recipe's weight gradient: out [E, N, K] of out_dtype, out[e] = G[group e].T x
    X[group e] with both operands cast along each group's tokens (`block_quantize_tokens` on
    the row tiles of 128 rows of group_offsets: g_values [M, N], x_values [M, K] e4m3, their
    descales [capacity, N], [capacity, K] fp32), as `mok.reference.fp8_block.scaled_matmul`
    forms it over the group's tokens, rounded once."""
    experts = group_offsets.numel() - 1
    m, n = g_values.shape
    k = x_values.shape[1]
    if g_values.dtype != torch.float8_e4m3fn or x_values.dtype != torch.float8_e4m3fn:
        raise ValueError(f"values must be float8_e4m3fn, got {g_values.dtype}, {x_values.dtype}")
    if x_values.shape[0] != m or g_descales.shape[1] != n or x_descales.shape[1] != k:
        raise ValueError(
            f"G [M, N], X [M, K] and their descales [tiles, N], [tiles, K], got "
            f"{tuple(g_values.shape)}, {tuple(x_values.shape)}, {tuple(g_descales.shape)}, "
            f"{tuple(x_descales.shape)}"
        )
    out = torch.empty(experts, n, k, dtype=out_dtype, device=g_values.device)
    if experts == 0 or n == 0 or k == 0:
        return out
    tile_starts = token_tile_starts(group_offsets)
    cfg = WGRAD_TILES
    tasks = experts * triton.cdiv(n, cfg.block_m) * triton.cdiv(k, cfg.block_n)
    programs = num_programs(g_values.device, tasks, cfg)
    _block_scaled_wgrad_kernel[(programs,)](
        g_values.contiguous().view(torch.uint8), g_descales.contiguous(),
        x_values.contiguous().view(torch.uint8), x_descales.contiguous(), group_offsets,
        tile_starts, out, experts, n, k, BLOCK_N=cfg.block_m, BLOCK_K=cfg.block_n, BLOCK_T=BLOCK,
        NUM_PROGRAMS=programs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
