"""Warp-specialized persistent grouped GEMM for Hopper, in Gluon.

    out[rows of group e] = A[rows of group e] @ W[e].T      A [M, K], W [E, N, K], out [M, N]

the row-tiled product of the expert MLP (the down projection forward; `grouped_gemm._down_kernel`
is its interpretable twin: same task order, same row-tile table, same result contract).

Roles inside one persistent program (one per SM):
  loader     one warp: walks the program's tasks and streams their A and W tiles into a ring of
             STAGES shared-memory slots with TMA; a slot's `ready` barrier completes when both
             tiles landed, its `empty` barrier when the consumer that read it is done with it.
  consumers  two warpgroups taking the program's tasks in turn (the default partition even ones,
             a worker odd ones). The ring hands out slots in task order, so while one consumer
             runs its tile's epilogue (convert, store) the other's wgmma main loop already runs
             on the next tile: the tensor cores do not wait for epilogues (ping-pong).

Every task is BLOCK_K steps over all of K, so the ring position of step k of the program's t-th
task is t * k_steps + k: loader and consumers agree on slots and barrier phases without talking.

Stores: a tile inside its group goes through shared memory and a TMA store (TMA drops the columns
past N); a group's last, partial tile is stored from registers with a row mask, so that nothing
outside the group is written.

Gluon does not run under TRITON_INTERPRET; the CPU tests cover the twin, and the GPU tests compare
this kernel with it bit for bit.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mok.kernels.grouped_gemm import GemmTiles, RowTiles, num_programs

CONSUMERS = gl.constexpr(2)
"""Consumer warpgroups per program (ping-pong)."""
LOADER_REGISTERS = gl.constexpr(40)
"""Registers per thread of the loader warp (it holds only scalars)."""
CONSUMER_REGISTERS = gl.constexpr(232)
"""Registers per thread of a consumer warpgroup: a 128 x 128 fp32 accumulator takes 128."""
MAX_REGISTERS = 168
"""The kernel's register limit before redistribution: 168 x 12 warps x 32 fits the 64 K file."""

PING_PONG = GemmTiles(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4, group_m=8)
"""Tiles of one consumer warpgroup, and the ring depth (4 slots of 32 KiB, plus two 32 KiB
epilogue buffers: 192 KiB of the 227 KiB of shared memory)."""


@gluon.jit
def _grouped_task(task, num_m, num_n, GROUP_M: gl.constexpr):
    """(m, n) of a task, GROUP_M tile rows at a time, m fastest (`grouped_gemm.grouped_task`)."""
    per_group = GROUP_M * num_n
    first_m = task // per_group * GROUP_M
    size = gl.minimum(num_m - first_m, GROUP_M)
    local = task % per_group
    return first_m + local % size, local // size


@gluon.jit
def _task_count(counts_ptr, N, BLOCK_N: gl.constexpr):
    """(row tiles of the groups, tiles along N, tasks) of the row-tile table."""
    num_m = gl.load(counts_ptr)
    num_n = gl.cdiv(N, BLOCK_N)
    return num_m, num_n, num_m * num_n


@gluon.jit
def _load_partition(shared, problem):
    """Loader: the A and W tiles of every step of every task of this program, in order."""
    (a_desc, w_desc, out_desc, out_ptr, a_bufs, w_bufs, out_bufs, ready, empty, turns) = shared
    (table_ptr, counts_ptr, capacity, N, K, GROUP_M, NUM_PROGRAMS) = problem
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    num_m, num_n, num_tasks = _task_count(counts_ptr, N, BLOCK_N)
    step = 0
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        m_idx, n_idx = _grouped_task(task, num_m, num_n, GROUP_M)
        expert = gl.load(table_ptr + m_idx)
        row = gl.load(table_ptr + capacity + m_idx)
        # W is read as [E * N, K]: rows past this expert's N feed only columns that are not stored.
        w_row = expert * N + n_idx * BLOCK_N
        for k in range(0, K, BLOCK_K):
            slot = step % STAGES
            # A fresh barrier counts as having completed the phase before its first: the first
            # pass over the ring does not wait.
            mbarrier.wait(empty.index(slot), (step // STAGES & 1) ^ 1)
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row, k], ready.index(slot), a_bufs.index(slot))
            tma.async_copy_global_to_shared(
                w_desc, [w_row, k], ready.index(slot), w_bufs.index(slot)
            )
            step += 1


@gluon.jit
def _consume(shared, problem, ROLE: gl.constexpr):
    """Consumer ROLE (0 or 1): tasks ROLE, ROLE + 2, ... of this program; main loop, epilogue."""
    (a_desc, w_desc, out_desc, out_ptr, a_bufs, w_bufs, out_bufs, ready, empty, turns) = shared
    (table_ptr, counts_ptr, capacity, N, K, GROUP_M, NUM_PROGRAMS) = problem
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    out_buf = out_bufs.index(ROLE)
    num_m, num_n, num_tasks = _task_count(counts_ptr, N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    first = gl.program_id(0) + ROLE * NUM_PROGRAMS
    nth = ROLE
    for task in range(first, num_tasks, CONSUMERS * NUM_PROGRAMS):
        m_idx, n_idx = _grouped_task(task, num_m, num_n, GROUP_M)
        row = gl.load(table_ptr + capacity + m_idx)
        row_end = gl.load(table_ptr + 2 * capacity + m_idx)
        step = nth * k_steps
        # Wait for the other consumer to have issued its tile's main loop: it has then waited on
        # every slot before ours, so our ready waits are at most one phase ahead of the barriers
        # (phase parity cannot tell a phase from the one two later). This also orders the two
        # main loops on the tensor cores.
        mbarrier.wait(turns.index(ROLE), (nth // CONSUMERS & 1) ^ (1 - ROLE))
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
        for k in range(k_steps):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), step // STAGES & 1)
            acc = warpgroup_mma(
                a_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True
            )
            # Keep one wgmma in flight; the one before it has read its slot, which goes back.
            acc, _, _ = warpgroup_mma_wait(1, deps=(acc, a_bufs.index(slot), w_bufs.index(slot)))
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k > 0)
            step += 1
        mbarrier.arrive(turns.index(1 - ROLE))
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
        value = acc.to(out_desc.dtype)
        n_off = n_idx * BLOCK_N
        if row + BLOCK_M <= row_end:
            tma.store_wait(0)  # this consumer's previous store has left its buffer
            out_buf.store(value)
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [row, n_off], out_buf)
        else:
            rows = row + gl.arange(0, BLOCK_M, rows_layout)
            cols = n_off + gl.arange(0, BLOCK_N, cols_layout)
            mask = (rows < row_end)[:, None] & (cols < N)[None, :]
            gl.store(out_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :], value, mask=mask)
        nth += CONSUMERS
    tma.store_wait(0)


@gluon.jit
def _first_consumer(shared, problem):
    _consume(shared, problem, 0)


@gluon.jit
def _second_consumer(shared, problem):
    _consume(shared, problem, 1)


@gluon.jit(do_not_specialize=["capacity"])
def _rows_wt_kernel(
    a_desc,  # [M, K], block [BLOCK_M, BLOCK_K]
    w_desc,  # [E * N, K], block [BLOCK_N, BLOCK_K]
    out_desc,  # [M, N] out, block [BLOCK_M, BLOCK_N]
    out_ptr,  # out's first element (contiguous)
    table_ptr,  # [3, capacity] int32 row tiles
    counts_ptr,  # [2] int32
    capacity,
    N,
    K,
    GROUP_M: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Grid: NUM_PROGRAMS, num_warps 4. out = A @ W[e].T for every group's rows."""
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    out_bufs = gl.allocate_shared_memory(
        dtype, [CONSUMERS] + out_desc.block_type.shape, out_desc.layout
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for role in gl.static_range(CONSUMERS):
        mbarrier.init(turns.index(role), count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)
        mbarrier.init(empty.index(slot), count=1)
    shared = (a_desc, w_desc, out_desc, out_ptr, a_bufs, w_bufs, out_bufs, ready, empty, turns)
    problem = (table_ptr, counts_ptr, capacity, N, K, GROUP_M, NUM_PROGRAMS)
    gl.warp_specialize(
        [
            (_first_consumer, (shared, problem)),
            (_second_consumer, (shared, problem)),
            (_load_partition, (shared, problem)),
        ],
        [4, 1],
        [CONSUMER_REGISTERS, LOADER_REGISTERS],
    )
    for slot in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(slot))
        mbarrier.invalidate(empty.index(slot))
    for role in gl.static_range(CONSUMERS):
        mbarrier.invalidate(turns.index(role))


_GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _descriptor(tensor: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, _GLUON_DTYPES[tensor.dtype])
    return TensorDescriptor.from_tensor(tensor, block, layout)


def supported(rows: torch.Tensor) -> bool:
    """Whether the warp-specialized kernels can run on `rows`' device and dtype (Hopper, 16-bit)."""
    return (
        rows.is_cuda
        and torch.cuda.get_device_capability(rows.device)[0] == 9
        and rows.dtype in _GLUON_DTYPES
    )


def rows_wt(
    rows: torch.Tensor,
    weights: torch.Tensor,
    tiles: RowTiles,
    cfg: GemmTiles = PING_PONG,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [M, N] = rows[group e] @ weights[e].T (rows [M, K], weights [E, N, K], contiguous);
    rows outside the groups are left unwritten. The result of `grouped_gemm.down`."""
    m, k = rows.shape
    num_experts, n, _ = weights.shape
    if tiles.block_m != cfg.block_m:
        raise ValueError(f"row tiles of {tiles.block_m} rows for a kernel of {cfg.block_m}")
    if out is None:
        out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    out = out[:m]
    if m == 0:
        return out
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    programs = num_programs(rows.device, tiles.capacity * triton.cdiv(n, bn), cfg)
    _rows_wt_kernel[(programs,)](
        _descriptor(rows, [bm, bk]),
        _descriptor(weights.view(num_experts * n, k), [bn, bk]),
        _descriptor(out, [bm, bn]),
        out,
        tiles.table,
        tiles.counts,
        tiles.capacity,
        n,
        k,
        GROUP_M=cfg.group_m,
        NUM_PROGRAMS=programs,
        STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        maxnreg=MAX_REGISTERS,
    )
    return out
