"""The expert products in MXFP8 on Hopper's bf16 tensor cores: @triton.jit tile functions and
persistent kernels, the interpretable twins of the fast path (`docs/mxfp8.md`): the forward, the
data gradients and the weight gradients.

Hopper has no block-scaled MMA, but every e4m3 x 2^k a real tensor holds is a bf16 value, so an MX
operand dequantized to bf16 feeds a bf16 MMA exactly: the products are the exact MX products,
accumulated in fp32. Here each main-loop step dequantizes its A and W tiles in registers
(`mx_operand`, built on `mok.kernels.mx.mx_dequantize_tile`); a warp-specialized kernel would do
it in a producer stage instead, hidden behind the MMA of the consumers.

    gate, up = Q_H(x) @ Q_H(W_gate[e]).T, Q_H(x) @ Q_H(W_up[e]).T     fp32 accumulators
    h        = Q_I(swiglu(gate, up))            quantized in the epilogue from fp32 (never bf16)
    out      = Q_I(h) @ Q_I(W_down[e]).T        fp32 accumulator, rounded once

    grad h   = bf16(Q_H(g) @ Q_H(W_down[e]))   W_down read along H, its first dimension
    grad gate, grad up = the SwiGLU backward at the saved fp32 pre-activations
    grad x   = Q_I(grad gate) @ Q_I(W_gate[e]) + Q_I(grad up) @ Q_I(W_up[e])
    grad W   = Q_T(a[e]).T @ Q_T(b[e])           a, b quantized along the group's rows in blocks
                                                 of 32 from its first, in the kernel's registers

(`mok.reference.mx_expert`; Q_d: MXFP8 along d.) Operands are e4m3 bytes (uint8) with
e8m0 scale bytes per 32 elements along the reduction; row tiles come from
`grouped_gemm.row_tile_map`, tasks walk as in `grouped_gemm`. On the CPU interpreter the MMAs run
in fp32 (exact for these products, as bf16 is on GPUs; the interpreter's bf16 is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels._triton_compat import interpreting, patch_interpreter
from mok.kernels.grouped_gemm import (
    GemmTiles,
    RowTiles,
    grouped_task,
    load_row_tile,
    num_programs,
    swiglu_backward_tile,
    swiglu_tile,
)
from mok.kernels.mx import (
    bf16_rounded,
    mx_dequantize_columns,
    mx_dequantize_tile,
    mx_quantize_tile,
)
from mok.reference.mx import BLOCK, ScaleRounding

if interpreting():
    patch_interpreter()


@triton.jit
def mx_operand(
    codes_ptr,  # uint8 [R, K] e4m3 bytes, contiguous
    scales_ptr,  # uint8 [R, K // 32] e8m0 bytes, contiguous
    rows,  # [BLOCK_R] row indices
    row_ok,  # [BLOCK_R] bool
    k,
    K,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """The MX operand block [BLOCK_R, BLOCK_K] at rows `rows`, columns k.., dequantized exactly
    and cast to DOT_DTYPE (bf16 on GPUs: exact); zeros for masked rows and columns past K."""
    cols = k + tl.arange(0, BLOCK_K)
    offsets = rows.to(tl.int64)[:, None] * K + cols[None, :]
    mask = row_ok[:, None] & (cols < K)[None, :]
    codes = tl.load(codes_ptr + offsets, mask=mask, other=0)
    blocks = k // 32 + tl.arange(0, BLOCK_K // 32)
    scale_offsets = rows.to(tl.int64)[:, None] * (K // 32) + blocks[None, :]
    scale_mask = row_ok[:, None] & (blocks < K // 32)[None, :]
    scale_bytes = tl.load(scales_ptr + scale_offsets, mask=scale_mask, other=127).to(tl.int32)
    return mx_dequantize_tile(codes, scale_bytes, BLOCK_R, BLOCK_K).to(DOT_DTYPE)


@triton.jit
def mx_rows_tile(
    a_codes_ptr,  # [M, K]
    a_scales_ptr,
    w_codes_ptr,  # [E, N, K]
    w_scales_ptr,
    row,
    row_end,
    expert,
    n_off,
    N,
    K,
    acc,  # [BLOCK_M, BLOCK_N] fp32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """The MX main loop: acc + Q(A)[row:row_end] @ Q(W[expert])[n_off:+BN].T over K."""
    rows = row + tl.arange(0, BLOCK_M)
    w_rows = n_off + tl.arange(0, BLOCK_N)
    w_codes = w_codes_ptr + expert.to(tl.int64) * N * K
    w_scales = w_scales_ptr + expert.to(tl.int64) * N * (K // 32)
    for k in tl.range(0, K, BLOCK_K):
        a = mx_operand(
            a_codes_ptr, a_scales_ptr, rows, rows < row_end, k, K, BLOCK_M, BLOCK_K, DOT_DTYPE
        )
        w = mx_operand(w_codes, w_scales, w_rows, w_rows < N, k, K, BLOCK_N, BLOCK_K, DOT_DTYPE)
        acc = tl.dot(a, w.T, acc)
    return acc


@triton.jit
def mx_k_major_operand(
    codes_ptr,  # uint8 [K, N] e4m3 bytes, contiguous
    scales_ptr,  # uint8 [K // 32, N] e8m0 bytes: quantized along K, the first dimension
    k,
    cols,  # [BLOCK_N] column indices
    col_ok,  # [BLOCK_N] bool
    K,
    N,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """The MX operand block [BLOCK_K, BLOCK_N] at rows k.., columns `cols` of a [K, N] weight
    read along K (as W_down in grad h = g @ W_down), dequantized exactly, cast to DOT_DTYPE."""
    ks = k + tl.arange(0, BLOCK_K)
    mask = (ks < K)[:, None] & col_ok[None, :]
    codes = tl.load(codes_ptr + ks.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0)
    blocks = k // 32 + tl.arange(0, BLOCK_K // 32)
    scale_mask = (blocks < K // 32)[:, None] & col_ok[None, :]
    scale_offsets = blocks.to(tl.int64)[:, None] * N + cols[None, :]
    scale_bytes = tl.load(scales_ptr + scale_offsets, mask=scale_mask, other=127).to(tl.int32)
    values = mx_dequantize_columns(codes, scale_bytes, BLOCK_K, BLOCK_N)
    return values.to(DOT_DTYPE)


@triton.jit
def mx_rows_k_major_tile(
    a_codes_ptr,  # [M, K], quantized along K
    a_scales_ptr,
    w_codes_ptr,  # [E, K, N], quantized along K (dim 1)
    w_scales_ptr,  # [E, K // 32, N]
    row,
    row_end,
    expert,
    n_off,
    N,
    K,
    acc,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """The MX main loop of the data gradients: acc + Q(A)[row:row_end] @ Q(W[expert])[:, n_off:+BN]
    over K, the weight read along its first dimension."""
    rows = row + tl.arange(0, BLOCK_M)
    cols = n_off + tl.arange(0, BLOCK_N)
    w_codes = w_codes_ptr + expert.to(tl.int64) * K * N
    w_scales = w_scales_ptr + expert.to(tl.int64) * (K // 32) * N
    for k in tl.range(0, K, BLOCK_K):
        a = mx_operand(
            a_codes_ptr, a_scales_ptr, rows, rows < row_end, k, K, BLOCK_M, BLOCK_K, DOT_DTYPE
        )
        w = mx_k_major_operand(
            w_codes, w_scales, k, cols, cols < N, K, N, BLOCK_K, BLOCK_N, DOT_DTYPE
        )
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _store_rows(
    ptr, stride, tile, row, row_end, n_off, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Store rows [row, row_end), columns [n_off, N) of a tile into a matrix of row stride
    `stride` starting at ptr."""
    rows = row + tl.arange(0, BLOCK_M)
    cols = n_off + tl.arange(0, BLOCK_N)
    mask = (rows < row_end)[:, None] & (cols < N)[None, :]
    tl.store(ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :], tile, mask=mask)


@triton.jit(do_not_specialize=["capacity"])
def _mx_gate_up_swiglu_kernel(
    x_codes_ptr,  # [M, H] e4m3 bytes of the grouped rows, quantized along H
    x_scales_ptr,  # [M, H // 32]
    wg_codes_ptr,  # [E, I, H] W_gate, quantized along H
    wg_scales_ptr,
    wu_codes_ptr,  # [E, I, H] W_up, quantized along H
    wu_scales_ptr,
    h_codes_ptr,  # [M, I] out: h quantized along I
    h_scales_ptr,  # [M, I // 32] out
    gate_up_ptr,  # [M, 2I] fp32 out when SAVE_PREACT: gate | up
    table_ptr,
    counts_ptr,
    capacity,
    hidden,
    inter,
    limit,
    HAS_LIMIT: tl.constexpr,
    SAVE_PREACT: tl.constexpr,
    RCEIL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS. Per group e: h = Q_I(swiglu(Q_H(x) @ Q_H(W_gate[e]).T, ... W_up ...)),
    stored as e4m3 bytes and scales; with SAVE_PREACT also the fp32 pre-activations."""
    n_tiles = tl.cdiv(inter, BLOCK_N)
    num_tasks = tl.load(counts_ptr) * n_tiles
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS):
        m_idx, n_idx = grouped_task(task, num_tasks // n_tiles, n_tiles, GROUP_M)
        expert, row, row_end = load_row_tile(table_ptr, capacity, m_idx)
        n_off = n_idx * BLOCK_N
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        gate = mx_rows_tile(
            x_codes_ptr,
            x_scales_ptr,
            wg_codes_ptr,
            wg_scales_ptr,
            row,
            row_end,
            expert,
            n_off,
            inter,
            hidden,
            zeros,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            DOT_DTYPE,
        )
        up = mx_rows_tile(
            x_codes_ptr,
            x_scales_ptr,
            wu_codes_ptr,
            wu_scales_ptr,
            row,
            row_end,
            expert,
            n_off,
            inter,
            hidden,
            zeros,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            DOT_DTYPE,
        )
        h = swiglu_tile(gate, up, limit, HAS_LIMIT)
        codes, scale_bytes = mx_quantize_tile(h, BLOCK_M, BLOCK_N, RCEIL)
        h_bytes = codes.to(tl.uint8)
        _store_rows(h_codes_ptr, inter, h_bytes, row, row_end, n_off, inter, BLOCK_M, BLOCK_N)
        _store_rows(
            h_scales_ptr,
            inter // 32,
            scale_bytes.to(tl.uint8),
            row,
            row_end,
            n_off // 32,
            inter // 32,
            BLOCK_M,
            BLOCK_N // 32,
        )
        if SAVE_PREACT:
            preact = gate_up_ptr
            _store_rows(preact, 2 * inter, gate, row, row_end, n_off, inter, BLOCK_M, BLOCK_N)
            _store_rows(preact + inter, 2 * inter, up, row, row_end, n_off, inter, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["capacity"])
def _mx_down_kernel(
    h_codes_ptr,  # [M, I] e4m3 bytes, quantized along I
    h_scales_ptr,  # [M, I // 32]
    w_codes_ptr,  # [E, H, I] W_down, quantized along I
    w_scales_ptr,
    out_ptr,  # [M, H] out
    table_ptr,
    counts_ptr,
    capacity,
    hidden,
    inter,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS. Per group e: out = Q_I(h) @ Q_I(W_down[e]).T, rounded once."""
    n_tiles = tl.cdiv(hidden, BLOCK_N)
    num_tasks = tl.load(counts_ptr) * n_tiles
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS):
        m_idx, n_idx = grouped_task(task, num_tasks // n_tiles, n_tiles, GROUP_M)
        expert, row, row_end = load_row_tile(table_ptr, capacity, m_idx)
        n_off = n_idx * BLOCK_N
        acc = mx_rows_tile(
            h_codes_ptr,
            h_scales_ptr,
            w_codes_ptr,
            w_scales_ptr,
            row,
            row_end,
            expert,
            n_off,
            hidden,
            inter,
            tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            DOT_DTYPE,
        )
        value = acc.to(out_ptr.dtype.element_ty)
        _store_rows(out_ptr, hidden, value, row, row_end, n_off, hidden, BLOCK_M, BLOCK_N)


def _bytes(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor's bytes (float8_e4m3fn viewed as uint8), checked against `shape`."""
    if tensor.dtype == torch.float8_e4m3fn:
        tensor = tensor.view(torch.uint8)
    if tensor.dtype != torch.uint8 or tuple(tensor.shape) != shape or not tensor.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous {shape} float8_e4m3fn or uint8 tensor, got "
            f"{tuple(tensor.shape)} {tensor.dtype}"
        )
    return tensor


def _check_tiles(cfg: GemmTiles, *sizes: int) -> None:
    if cfg.block_k % BLOCK or cfg.block_n % BLOCK:
        raise ValueError(f"MX tiles need block_k and block_n multiples of {BLOCK}, got {cfg}")
    for size in sizes:
        if size % BLOCK:
            raise ValueError(
                f"MXFP8 needs every reduced and quantized size to be a multiple of {BLOCK}, "
                f"got {size}"
            )


def _dot_dtype(device: torch.device):
    return tl.bfloat16 if device.type == "cuda" else tl.float32


def mx_gate_up_swiglu(
    x: tuple[torch.Tensor, torch.Tensor],
    w_gate: tuple[torch.Tensor, torch.Tensor],
    w_up: tuple[torch.Tensor, torch.Tensor],
    tiles: RowTiles,
    swiglu_limit: float | None,
    cfg: GemmTiles,
    rounding: ScaleRounding | str = ScaleRounding.RCEIL,
    save_preact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The MX gate/up + SwiGLU product of grouped rows: x = (data [M, H], scales [M, H / 32]),
    w_gate and w_up = (data [E, I, H], scales [E, I, H / 32]), all quantized along H
    (`mok.reference.mx.quantize`). Returns (h data [M, I] float8_e4m3fn, h scales [M, I / 32]
    uint8: h quantized along I from fp32 with `rounding`, and when save_preact the fp32
    pre-activations gate | up [M, 2I]). Rows outside the groups are left unwritten."""
    x_data, x_scales = x
    m, hidden = x_data.shape
    experts, inter = w_gate[0].shape[:2]
    _check_tiles(cfg, hidden, inter)
    shapes = {
        "x data": (x_data, (m, hidden)),
        "x scales": (x_scales, (m, hidden // BLOCK)),
        "w_gate data": (w_gate[0], (experts, inter, hidden)),
        "w_gate scales": (w_gate[1], (experts, inter, hidden // BLOCK)),
        "w_up data": (w_up[0], (experts, inter, hidden)),
        "w_up scales": (w_up[1], (experts, inter, hidden // BLOCK)),
    }
    args = [_bytes(name, tensor, shape) for name, (tensor, shape) in shapes.items()]
    device = x_data.device
    h_codes = torch.empty(m, inter, dtype=torch.uint8, device=device)
    h_scales = torch.empty(m, inter // BLOCK, dtype=torch.uint8, device=device)
    gate_up = torch.empty(m, 2 * inter, dtype=torch.float32, device=device) if save_preact else None
    if m:
        programs = num_programs(device, tiles.capacity * triton.cdiv(inter, cfg.block_n), cfg)
        _mx_gate_up_swiglu_kernel[(programs,)](
            *args,
            h_codes,
            h_scales,
            gate_up if save_preact else h_scales,
            tiles.table,
            tiles.counts,
            tiles.capacity,
            hidden,
            inter,
            0.0 if swiglu_limit is None else float(swiglu_limit),
            HAS_LIMIT=swiglu_limit is not None,
            SAVE_PREACT=save_preact,
            RCEIL=ScaleRounding(rounding) is ScaleRounding.RCEIL,
            **_launch_options(cfg, programs, device),
        )
    return h_codes.view(torch.float8_e4m3fn), h_scales, gate_up


def mx_down(
    h: tuple[torch.Tensor, torch.Tensor],
    w_down: tuple[torch.Tensor, torch.Tensor],
    tiles: RowTiles,
    cfg: GemmTiles,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """out [M, H] = Q_I(h) @ Q_I(W_down[e]).T per group, rounded once to out_dtype: h = (data
    [M, I], scales [M, I / 32]) and w_down = (data [E, H, I], scales [E, H, I / 32]), quantized
    along I. Rows outside the groups are left unwritten."""
    h_data, h_scales = h
    m, inter = h_data.shape
    experts, hidden = w_down[0].shape[:2]
    _check_tiles(cfg, hidden, inter)
    shapes = {
        "h data": (h_data, (m, inter)),
        "h scales": (h_scales, (m, inter // BLOCK)),
        "w_down data": (w_down[0], (experts, hidden, inter)),
        "w_down scales": (w_down[1], (experts, hidden, inter // BLOCK)),
    }
    args = [_bytes(name, tensor, shape) for name, (tensor, shape) in shapes.items()]
    device = h_data.device
    out = torch.empty(m, hidden, dtype=out_dtype, device=device)
    if m:
        programs = num_programs(device, tiles.capacity * triton.cdiv(hidden, cfg.block_n), cfg)
        _mx_down_kernel[(programs,)](
            *args,
            out,
            tiles.table,
            tiles.counts,
            tiles.capacity,
            hidden,
            inter,
            **_launch_options(cfg, programs, device),
        )
    return out


@triton.jit(do_not_specialize=["capacity"])
def _mx_down_dgrad_swiglu_kernel(
    g_codes_ptr,  # [M, H] grad out, quantized along H
    g_scales_ptr,
    w_codes_ptr,  # [E, H, I] W_down, quantized along H (dim 1)
    w_scales_ptr,  # [E, H // 32, I]
    gate_up_ptr,  # [M, 2I] fp32 saved pre-activations
    gate_codes_ptr,  # [M, I] out: grad gate quantized along I
    gate_scales_ptr,  # [M, I // 32] out
    up_codes_ptr,  # [M, I] out: grad up quantized along I
    up_scales_ptr,  # [M, I // 32] out
    grad_ptr,  # [M, 2I] out: grad gate | grad up rounded to bf16 (fp32 storage)
    table_ptr,
    counts_ptr,
    capacity,
    hidden,
    inter,
    limit,
    HAS_LIMIT: tl.constexpr,
    RCEIL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS. grad h = bf16(Q_H(g) @ Q_H(W_down[e])); grad gate, grad up = the
    SwiGLU backward at the saved fp32 pre-activations; stored quantized along I (for grad x) and
    rounded to bf16 (for the weight gradients)."""
    n_tiles = tl.cdiv(inter, BLOCK_N)
    num_tasks = tl.load(counts_ptr) * n_tiles
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS):
        m_idx, n_idx = grouped_task(task, num_tasks // n_tiles, n_tiles, GROUP_M)
        expert, row, row_end = load_row_tile(table_ptr, capacity, m_idx)
        n_off = n_idx * BLOCK_N
        acc = mx_rows_k_major_tile(
            g_codes_ptr,
            g_scales_ptr,
            w_codes_ptr,
            w_scales_ptr,
            row,
            row_end,
            expert,
            n_off,
            inter,
            hidden,
            tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            DOT_DTYPE,
        )
        grad_h = bf16_rounded(acc)
        rows = row + tl.arange(0, BLOCK_M)
        cols = n_off + tl.arange(0, BLOCK_N)
        mask = (rows < row_end)[:, None] & (cols < inter)[None, :]
        saved = gate_up_ptr + rows.to(tl.int64)[:, None] * (2 * inter) + cols[None, :]
        gate = tl.load(saved, mask=mask, other=0.0)
        up = tl.load(saved + inter, mask=mask, other=0.0)
        grad_gate, grad_up = swiglu_backward_tile(grad_h, gate, up, limit, HAS_LIMIT)
        for part in tl.static_range(2):
            grad = grad_gate if part == 0 else grad_up
            codes_ptr = gate_codes_ptr if part == 0 else up_codes_ptr
            scales_ptr = gate_scales_ptr if part == 0 else up_scales_ptr
            codes, scale_bytes = mx_quantize_tile(grad, BLOCK_M, BLOCK_N, RCEIL)
            offset = part * inter
            _store_rows(
                codes_ptr, inter, codes.to(tl.uint8), row, row_end, n_off, inter, BLOCK_M, BLOCK_N
            )
            _store_rows(
                scales_ptr,
                inter // 32,
                scale_bytes.to(tl.uint8),
                row,
                row_end,
                n_off // 32,
                inter // 32,
                BLOCK_M,
                BLOCK_N // 32,
            )
            _store_rows(
                grad_ptr + offset,
                2 * inter,
                bf16_rounded(grad),
                row,
                row_end,
                n_off,
                inter,
                BLOCK_M,
                BLOCK_N,
            )


@triton.jit(do_not_specialize=["capacity"])
def _mx_gate_up_dgrad_kernel(
    gate_codes_ptr,  # [M, I] grad gate, quantized along I
    gate_scales_ptr,  # [M, I // 32]
    up_codes_ptr,  # [M, I] grad up, quantized along I
    up_scales_ptr,
    wg_codes_ptr,  # [E, I, H] W_gate, quantized along I (dim 1)
    wg_scales_ptr,  # [E, I // 32, H]
    wu_codes_ptr,
    wu_scales_ptr,
    out_ptr,  # [M, H] grad x
    table_ptr,
    counts_ptr,
    capacity,
    hidden,
    inter,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS. grad x = Q_I(grad gate) @ Q_I(W_gate[e]) + Q_I(grad up) @ Q_I(W_up[e]),
    both products into one fp32 accumulator (gate's first), rounded once."""
    n_tiles = tl.cdiv(hidden, BLOCK_N)
    num_tasks = tl.load(counts_ptr) * n_tiles
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS):
        m_idx, n_idx = grouped_task(task, num_tasks // n_tiles, n_tiles, GROUP_M)
        expert, row, row_end = load_row_tile(table_ptr, capacity, m_idx)
        n_off = n_idx * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for part in tl.static_range(2):
            w_codes = wg_codes_ptr if part == 0 else wu_codes_ptr
            w_scales = wg_scales_ptr if part == 0 else wu_scales_ptr
            acc = mx_rows_k_major_tile(
                gate_codes_ptr if part == 0 else up_codes_ptr,
                gate_scales_ptr if part == 0 else up_scales_ptr,
                w_codes,
                w_scales,
                row,
                row_end,
                expert,
                n_off,
                hidden,
                inter,
                acc,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                DOT_DTYPE,
            )
        _store_rows(
            out_ptr,
            hidden,
            acc.to(out_ptr.dtype.element_ty),
            row,
            row_end,
            n_off,
            hidden,
            BLOCK_M,
            BLOCK_N,
        )


def _launch_options(cfg: GemmTiles, programs: int, device: torch.device) -> dict:
    return {
        "DOT_DTYPE": _dot_dtype(device),
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "GROUP_M": cfg.group_m,
        "NUM_PROGRAMS": programs,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }


def mx_down_dgrad_swiglu(
    grad_out: tuple[torch.Tensor, torch.Tensor],
    w_down: tuple[torch.Tensor, torch.Tensor],
    gate_up: torch.Tensor,
    tiles: RowTiles,
    swiglu_limit: float | None,
    cfg: GemmTiles,
    rounding: ScaleRounding | str = ScaleRounding.RCEIL,
):
    """The MX backward through W_down and SwiGLU: grad h = bf16(Q_H(g) @ Q_H(W_down[e])) per
    group, then the SwiGLU backward at the saved fp32 pre-activations gate_up [M, 2I]
    (`mx_gate_up_swiglu(save_preact=True)`). grad_out = (data [M, H], scales [M, H / 32]) along
    H; w_down = (data [E, H, I], scales [E, H / 32, I]) along H, its dim 1
    (`mok.reference.mx.quantize(w_down, dim=1)`). Returns ((grad gate data [M, I], scales
    [M, I / 32]), (grad up data, scales), both along I with `rounding`, and grad gate | grad up
    [M, 2I] rounded to bf16 precision, in fp32)."""
    g_data, g_scales = grad_out
    m, hidden = g_data.shape
    experts, _, inter = w_down[0].shape
    _check_tiles(cfg, hidden, inter)
    shapes = {
        "grad_out data": (g_data, (m, hidden)),
        "grad_out scales": (g_scales, (m, hidden // BLOCK)),
        "w_down data": (w_down[0], (experts, hidden, inter)),
        "w_down scales": (w_down[1], (experts, hidden // BLOCK, inter)),
    }
    args = [_bytes(name, tensor, shape) for name, (tensor, shape) in shapes.items()]
    if tuple(gate_up.shape) != (m, 2 * inter) or gate_up.dtype != torch.float32:
        raise ValueError(
            f"gate_up: expected [{m}, {2 * inter}] float32, got {tuple(gate_up.shape)}"
        )
    device = g_data.device
    codes = [torch.empty(m, inter, dtype=torch.uint8, device=device) for _ in range(2)]
    scales = [torch.empty(m, inter // BLOCK, dtype=torch.uint8, device=device) for _ in range(2)]
    grads = torch.empty(m, 2 * inter, dtype=torch.float32, device=device)
    if m:
        programs = num_programs(device, tiles.capacity * triton.cdiv(inter, cfg.block_n), cfg)
        _mx_down_dgrad_swiglu_kernel[(programs,)](
            *args,
            gate_up.contiguous(),
            codes[0],
            scales[0],
            codes[1],
            scales[1],
            grads,
            tiles.table,
            tiles.counts,
            tiles.capacity,
            hidden,
            inter,
            0.0 if swiglu_limit is None else float(swiglu_limit),
            HAS_LIMIT=swiglu_limit is not None,
            RCEIL=ScaleRounding(rounding) is ScaleRounding.RCEIL,
            **_launch_options(cfg, programs, device),
        )
    quantized = [(c.view(torch.float8_e4m3fn), s) for c, s in zip(codes, scales, strict=True)]
    return quantized[0], quantized[1], grads


def mx_gate_up_dgrad(
    grad_gate: tuple[torch.Tensor, torch.Tensor],
    grad_up: tuple[torch.Tensor, torch.Tensor],
    w_gate: tuple[torch.Tensor, torch.Tensor],
    w_up: tuple[torch.Tensor, torch.Tensor],
    tiles: RowTiles,
    cfg: GemmTiles,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """grad x [M, H] = Q_I(grad gate) @ Q_I(W_gate[e]) + Q_I(grad up) @ Q_I(W_up[e]) per group,
    one fp32 sum rounded once, zero outside the groups: the grads (data [M, I], scales
    [M, I / 32]) along I, the weights (data [E, I, H], scales [E, I / 32, H]) along I, their dim
    1."""
    m, inter = grad_gate[0].shape
    experts, _, hidden = w_gate[0].shape
    _check_tiles(cfg, hidden, inter)
    shapes = {
        "grad_gate data": (grad_gate[0], (m, inter)),
        "grad_gate scales": (grad_gate[1], (m, inter // BLOCK)),
        "grad_up data": (grad_up[0], (m, inter)),
        "grad_up scales": (grad_up[1], (m, inter // BLOCK)),
        "w_gate data": (w_gate[0], (experts, inter, hidden)),
        "w_gate scales": (w_gate[1], (experts, inter // BLOCK, hidden)),
        "w_up data": (w_up[0], (experts, inter, hidden)),
        "w_up scales": (w_up[1], (experts, inter // BLOCK, hidden)),
    }
    args = [_bytes(name, tensor, shape) for name, (tensor, shape) in shapes.items()]
    device = grad_gate[0].device
    out = torch.zeros(m, hidden, dtype=out_dtype, device=device)  # zero outside the groups
    if m:
        programs = num_programs(device, tiles.capacity * triton.cdiv(hidden, cfg.block_n), cfg)
        _mx_gate_up_dgrad_kernel[(programs,)](
            *args,
            out,
            tiles.table,
            tiles.counts,
            tiles.capacity,
            hidden,
            inter,
            **_launch_options(cfg, programs, device),
        )
    return out


@triton.jit
def mx_row_blocks(tile, ROWS: tl.constexpr, COLS: tl.constexpr, RCEIL: tl.constexpr):
    """Q_T of an fp32 tile [ROWS, COLS]: each column's blocks of 32 consecutive rows cast to
    MXFP8 and back (exact values, fp32), as `mok.reference.mx_expert.quantized_rows`."""
    codes, scale_bytes = mx_quantize_tile(tl.trans(tile), COLS, ROWS, RCEIL)
    return tl.trans(mx_dequantize_tile(codes, scale_bytes, COLS, ROWS))


@triton.jit
def _mx_group_at_b_kernel(
    a_ptr,  # [M, P] fp32 values (contiguous)
    b_ptr,  # [M, Q] fp32 values (contiguous)
    offsets_ptr,  # [E + 1] int32 group offsets
    out_ptr,  # [E, P, Q] fp32 out
    num_experts,
    P,
    Q,
    RCEIL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: NUM_PROGRAMS. out[e] = Q_T(a[group e]).T @ Q_T(b[group e]), the rows of group e
    quantized in blocks of 32 from its first row (the last block zero-padded); zeros for an
    empty group. BLOCK_T a multiple of 32: a step's blocks never straddle the group's start."""
    p_tiles = tl.cdiv(P, BLOCK_P)
    q_tiles = tl.cdiv(Q, BLOCK_Q)
    num_tasks = num_experts * p_tiles * q_tiles
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS):
        expert = task // (p_tiles * q_tiles)
        p_off = (task // q_tiles) % p_tiles * BLOCK_P
        q_off = task % q_tiles * BLOCK_Q
        first = tl.load(offsets_ptr + expert)
        end = tl.load(offsets_ptr + expert + 1)
        ps = p_off + tl.arange(0, BLOCK_P)
        qs = q_off + tl.arange(0, BLOCK_Q)
        acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
        for t in tl.range(first, end, BLOCK_T):
            rows = t + tl.arange(0, BLOCK_T)
            live = rows < end
            a_mask = live[:, None] & (ps < P)[None, :]
            a = tl.load(
                a_ptr + rows.to(tl.int64)[:, None] * P + ps[None, :], mask=a_mask, other=0.0
            )
            b_mask = live[:, None] & (qs < Q)[None, :]
            b = tl.load(
                b_ptr + rows.to(tl.int64)[:, None] * Q + qs[None, :], mask=b_mask, other=0.0
            )
            a_q = mx_row_blocks(a, BLOCK_T, BLOCK_P, RCEIL).to(DOT_DTYPE)
            b_q = mx_row_blocks(b, BLOCK_T, BLOCK_Q, RCEIL).to(DOT_DTYPE)
            acc = tl.dot(a_q.T, b_q, acc)
        out = out_ptr + expert.to(tl.int64) * P * Q
        mask = (ps < P)[:, None] & (qs < Q)[None, :]
        tl.store(out + ps.to(tl.int64)[:, None] * Q + qs[None, :], acc, mask=mask)


def mx_group_at_b(
    a: torch.Tensor,
    b: torch.Tensor,
    group_offsets: torch.Tensor,
    cfg: GemmTiles,
    rounding: ScaleRounding | str = ScaleRounding.RCEIL,
) -> torch.Tensor:
    """The MX weight gradient of every group: out [E, P, Q] fp32, out[e] = Q_T(a[e]).T @
    Q_T(b[e]) for a [M, P] and b [M, Q] (fp32 values, e.g. bf16 gradients or dequantized MX
    operands), group e the rows [offsets[e], offsets[e + 1]) ([E + 1] int32 on the device),
    quantized along the rows in blocks of 32 from each group's first. Tiles: block_m (P) x
    block_n (Q), block_k the rows per step (a multiple of 32)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"a [M, P] and b [M, Q] expected, got {tuple(a.shape)}, {tuple(b.shape)}")
    if cfg.block_k % BLOCK:
        raise ValueError(f"MX weight gradients step over rows in multiples of {BLOCK}: {cfg}")
    experts = group_offsets.numel() - 1
    (m, p), q = a.shape, b.shape[1]
    out = torch.zeros(experts, p, q, dtype=torch.float32, device=a.device)
    if m and experts:
        tasks = experts * triton.cdiv(p, cfg.block_m) * triton.cdiv(q, cfg.block_n)
        programs = num_programs(a.device, tasks, cfg)
        _mx_group_at_b_kernel[(programs,)](
            a.float().contiguous(),
            b.float().contiguous(),
            group_offsets,
            out,
            experts,
            p,
            q,
            RCEIL=ScaleRounding(rounding) is ScaleRounding.RCEIL,
            DOT_DTYPE=_dot_dtype(a.device),
            BLOCK_P=cfg.block_m,
            BLOCK_Q=cfg.block_n,
            BLOCK_T=cfg.block_k,
            NUM_PROGRAMS=programs,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return out
