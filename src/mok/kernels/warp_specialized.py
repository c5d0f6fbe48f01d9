"""Warp-specialized persistent grouped GEMMs for Hopper, in Gluon: all six products of the expert
MLP, forward and backward.

    out[rows of group e]    = A @ W[e].T                                 (`down`: down)
    h[rows of group e]      = swiglu(A @ W[e].T, A @ W2[e].T), both saved  (`gate_up_swiglu`)
    grad_x[rows of group e] = A @ W[e] + A2 @ W2[e]                        (`gate_up_dgrad`)
    gate | up gradients     = swiglu_backward(A @ W[e], saved gate, up)    (`down_dgrad_swiglu`)
    G[e] (+)= A[rows of group e].T @ B[rows of group e]          (`down_wgrad`, `gate_up_wgrad`)

with A [M, K] and W [E, N, K] (the data gradients read W [E, K, N] along K). The interpretable
twins are the `grouped_gemm` kernels of the same names: the same reduction order, and results
equal bit for bit (the GPU tests compare them; the CPU tests cover the twins).

Roles inside one persistent program (one per SM):
  loader     one warp: walks the program's tasks and streams their A and W tiles into a ring of
             STAGES shared-memory slots with TMA; a slot's `ready` barrier completes when its
             tiles landed, its `empty` barrier when the consumers that read it are done with it.
  consumers  two warpgroups. Ping-pong (64-row tiles): they take the program's tasks in turn, and
             a `turns` barrier passes the main loop from one to the other, so that one consumer's
             epilogue (SwiGLU, converts, stores) runs under the other's wgmma main loop.
             Cooperative (128-row tiles): both work on every task, 64 rows each, sharing the
             weight tile of each step (half the weight traffic per row).

Row-tiled tasks are BLOCK_K steps over all of K, so the ring position of step k of the program's
t-th task is t * k_steps + k: loader and consumers agree on slots and barrier phases without
talking. Stores: a tile inside its group goes through shared memory and a TMA store (TMA drops the
columns past N); a group's last, partial tile is read back from shared memory and stored with a
row mask, so that nothing outside the group is written.

The building blocks of the fused layer (their tl twins: `grouped_gemm.row_block`,
`grouped_gemm.scatter_row_tile`): the loader's A-row source is TMA tiles or, with a row index
(`source_rows`), rows gathered by cp.async from where they lie, a whole warpgroup issuing the
copies, each thread's arrival on the slot's barrier counted (forward products); the down product's
epilogue stores locally or through the peer-store epilogue (`down_scatter`: rows to other
ranks' buffers, then release adds to per-rank readiness counts); the weight gradients' epilogue
adds into an existing gradient buffer.

Tasks go to programs by a static stride (program p takes tasks p, p + P, ...), or with CLAIM
(`host.TileClaims`) at run time: the loader takes each next id from a counter with one
atomic add and hands it to the consumers through a ring of CLAIM_SLOTS task ids in shared memory
(`full` and `free` barriers per slot), so that programs launched later, on SMs another kernel
frees, take the tasks still left; an id past the end ends the consumers' loops.

The weight gradients reduce over a group's rows, a different number per expert: the loader reads
them through descriptors made on the device that end at the group's end, and the consumers count
steps task by task (`WGRAD_TILES`).

On Hopper `expert_mlp_forward` / `expert_mlp_backward` run them in place of their tl twins, with
the tiles `default_config` picks (cooperative where groups average >= 192 rows, else ping-pong):
with those tiles every product beat its twin at the presets' shapes (measured:
benchmarks/results/2026-12-01-issue12-all-products-h200.md; decisions:
docs/notes/warp-specialized-gemm.md). `scripts/gluon_compile_check.py` compiles them for sm_90a
without a GPU (registers, spills, shared memory).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mok.kernels import gluon_support
from mok.kernels.fp8_block import check_block_scaled_operands
from mok.kernels.host import (
    SWIGLU,
    Activation,
    GemmTiles,
    RowScatter,
    RowsReady,
    RowTiles,
    check_weighting,
    contiguous_biases,
    gather_source,
    gathered_rows,
    launch_persistent,
    num_programs,
    ready_flags,
    use_scratch_allocator,
)
from mok.kernels.launch import DeferredDescriptor, fast_launch
from mok.kernels.sync import OUT_OF_STEP, TIMED_OUT
from mok.reference.expert import limit_edges
from mok.reference.fp8_block import BLOCK as FP8_BLOCK
from mok.weights import has_contiguous_expert_rows

_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
"""Gluon's barrier of a CTA's threads: `thread_barrier` up to Triton 3.6, `barrier` from 3.8."""
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
"""TMA tile load: `async_copy_global_to_shared` in Triton 3.6, `async_load` in newer releases
(where the old name raises from 3.9 on)."""
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
"""TMA tile store: `async_copy_shared_to_global` in Triton 3.6, `async_store` in newer ones."""
_cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
"""cp.async of pointer rows into shared memory, renamed as the TMA copies were."""

CONSUMERS = gl.constexpr(2)
"""Consumer warpgroups per program (ping-pong)."""
TIMED_OUT_CODE = gl.constexpr(TIMED_OUT)
OUT_OF_STEP_CODE = gl.constexpr(OUT_OF_STEP)
LOADER_REGISTERS = gl.constexpr(40)
"""Registers per thread of the loader warp (it holds only scalars)."""
GATHER_LOADER_WARPS = gl.constexpr(4)
"""Warps of a loader that gathers A rows: the whole warpgroup that a one-warp loader leaves three
quarters idle (registers are given per warpgroup), so that a thread holds few row addresses."""
CONSUMER_REGISTERS = gl.constexpr(232)
"""Registers per thread of a consumer warpgroup: a 128 x 128 fp32 accumulator takes 128."""
MAX_REGISTERS = 168
"""The kernel's register limit before redistribution: 168 x 12 warps x 32 fits the 64 K file."""
CONSUMER_ROWS = 64
"""Rows of a tile one consumer warpgroup computes: a program's tile of 64 rows goes to one
consumer (the two alternate: ping-pong), one of 128 rows to both (cooperative)."""
CLAIM_SLOTS = gl.constexpr(8)
"""Slots of a claiming program's ring of task ids (`_publish_task`): how many tasks its loader
may claim ahead of its consumers."""
SCALE_BLOCK = gl.constexpr(FP8_BLOCK)
"""Elements of the 128-block FP8 recipe's scale blocks (`mok.reference.fp8_block`)."""

PING_PONG = GemmTiles(block_m=64, block_n=256, block_k=64, num_warps=4, num_stages=4, group_m=8)
"""Tiles of one consumer warpgroup, and the ring depth (4 slots of 40 KiB, plus two 32 KiB
epilogue buffers: 224 KiB of the 227 KiB of shared memory). Against 128 x 128 tiles: faster or
even at every preset, and faster by most where groups are short (kimi-k2's ~170 rows per expert
leave most of a second 128-row tile idle). Measured:
benchmarks/results/2026-12-01-warp-specialized-h200.md."""
DGRAD_SWIGLU_PING_PONG = GemmTiles(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=6)
"""Tiles of the down dgrad + SwiGLU backward kernel: a 64 x 128 accumulator, the saved gate and up
tiles in registers beside it; 6 slots of 24 KiB and four 16 KiB epilogue buffers (the saved tiles
land in them, the gradients leave from them): 208 KiB. Faster than the tl kernel at the presets'
shapes but deepseek-v3's, where it is even (measured:
benchmarks/results/2026-12-01-issue12-all-products-h200.md); six slots because four were slower
(docs/notes/warp-specialized-gemm.md, "Data gradients")."""

DOWN = gl.constexpr(0)
"""Kernel mode: out = A @ W[e].T (the forward's down projection)."""
GATE_UP_SWIGLU = gl.constexpr(1)
"""Kernel mode: h = swiglu(A @ W[e].T, A @ W2[e].T), and the two products saved."""
GATE_UP_DGRAD = gl.constexpr(2)
"""Kernel mode: grad_x = A @ W[e] + A2 @ W2[e], W read along K (this mode and the next)."""
DOWN_DGRAD_SWIGLU = gl.constexpr(3)
"""Kernel mode: grad_h = A @ W[e], then the SwiGLU backward against the saved gate and up."""

SWIGLU_PING_PONG = GemmTiles(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
"""Tiles of the gate/up + SwiGLU kernel: two 64 x 128 fp32 accumulators per consumer (128
registers a thread); 4 slots of 40 KiB and four 16 KiB epilogue buffers (two per consumer, for
h, gate and up in turn): 224 KiB."""
COOPERATIVE = GemmTiles(block_m=128, block_n=256, block_k=64, num_warps=4, num_stages=3)
"""Cooperative tiles of the single-product kernels: 128 x 256, each consumer on 64 rows of it
sharing the weight tile (half the weight traffic per row of 64 x 256 ping-pong tiles); 3 slots of
48 KiB and two 32 KiB epilogue buffers: 208 KiB."""
SWIGLU_COOPERATIVE = GemmTiles(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3)
"""Cooperative tiles of the gate/up + SwiGLU kernel: 128 x 128 of both products (the tl kernel's
tile), each consumer on 64 rows; 3 slots of 48 KiB and four 16 KiB epilogue buffers: 208 KiB."""
DGRAD_SWIGLU_COOPERATIVE = GemmTiles(
    block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=5
)
"""Cooperative tiles of the down dgrad + SwiGLU backward kernel: 128 x 128, each consumer on 64
rows; 5 slots of 32 KiB and four 16 KiB epilogue buffers: 224 KiB."""


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
def _claim_task(counter_ptr):
    """The launch's next unclaimed task (`host.TileClaims`): one atomic add for the whole
    loader, whatever its warps (an atomic on a one-element tensor is made by one thread, which
    shares its result with the others through shared memory)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    one = gl.arange(0, 1, layout)
    claimed = gl.atomic_add(counter_ptr + one, gl.full([1], 1, gl.int32, layout), sem="relaxed")
    return gl.max(claimed, 0)


@gluon.jit
def _loader_first_task(claims, CLAIM: gl.constexpr):
    """Loader: the program's first task, by the static stride (its program id) or claimed."""
    if CLAIM:
        task = _claim_task(claims[3])
    else:
        task = gl.program_id(0)
    return task


@gluon.jit
def _loader_next_task(claims, task, NUM_PROGRAMS: gl.constexpr, CLAIM: gl.constexpr):
    """Loader: the program's task after `task`, NUM_PROGRAMS further on or claimed."""
    if CLAIM:
        task = _claim_task(claims[3])
    else:
        task += NUM_PROGRAMS
    return task


@gluon.jit
def _publish_task(claims, nth, task):
    """Loader of a claiming program: hand its nth task to the consumers through the ring of task
    ids (an id past the task count ends their loops), once they have read what the slot held."""
    ids, full, free, _ = claims
    SLOTS: gl.constexpr = ids.shape[0]
    slot = nth % SLOTS
    mbarrier.wait(free.index(slot), (nth // SLOTS & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    ids.index(slot).store(gl.full([1], task, gl.int32, layout))
    mbarrier.arrive(full.index(slot))


@gluon.jit
def _program_task(claims, nth, NUM_PROGRAMS: gl.constexpr, CLAIM: gl.constexpr):
    """Consumer: the program's nth task, by the static stride or, with CLAIM, the one its loader
    claimed (`_publish_task`), whose slot it then releases."""
    if CLAIM:
        ids, full, free, _ = claims
        SLOTS: gl.constexpr = ids.shape[0]
        slot = nth % SLOTS
        mbarrier.wait(full.index(slot), nth // SLOTS & 1)
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        task = gl.max(ids.index(slot).load(layout), 0)
        mbarrier.arrive(free.index(slot))
    else:
        task = gl.program_id(0) + nth * NUM_PROGRAMS
    return task


@gluon.jit
def _end_claims(claims, nth):
    """Loader of a claiming program, out of tasks: its consumers' next tasks (nth and, for
    ping-pong consumers that take tasks in turn, nth + 1) end their loops."""
    _publish_task(claims, nth, 2147483647)
    _publish_task(claims, nth + 1, 2147483647)


@gluon.jit
def _claim_ring(consumers: gl.constexpr):
    """The ring of task ids of a claiming program: ids, `full` and `free` barriers per slot (a
    slot is free once `consumers` consumers read it)."""
    # Rows of one id, a rank-1 layout: `index` gives a row's view.
    ids = gl.allocate_shared_memory(
        gl.int32, [CLAIM_SLOTS, 1], gl.SwizzledSharedLayout(1, 1, 1, [0])
    )
    full = gl.allocate_shared_memory(gl.int64, [CLAIM_SLOTS, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [CLAIM_SLOTS, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(CLAIM_SLOTS):
        mbarrier.init(full.index(slot), count=1)
        mbarrier.init(free.index(slot), count=consumers)
    return ids, full, free


@gluon.jit
def _drop_claim_ring(claims):
    ids, full, free, _ = claims
    for slot in gl.static_range(CLAIM_SLOTS):
        mbarrier.invalidate(full.index(slot))
        mbarrier.invalidate(free.index(slot))


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, SPLIT: gl.constexpr):
    """The barriers of a loader's ring and its consumers: per slot `ready` (the loader's copies
    landed) and `empty` (released by each of the SPLIT consumers that read it), and per consumer
    `turns` (ping-pong order) and `fetched` (its epilogue's loads landed)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    fetched = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for role in gl.static_range(CONSUMERS):
        mbarrier.init(turns.index(role), count=1)
        mbarrier.init(fetched.index(role), count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)
        mbarrier.init(empty.index(slot), count=SPLIT)
    return ready, empty, turns, fetched


@gluon.jit
def _task_claims(claims_ptr, ready, empty, readers: gl.constexpr, CLAIM: gl.constexpr):
    """What the partitions take their tasks through: with CLAIM the ring of claimed task ids
    that `readers` consumers read (`_claim_ring`) and the launch's counter; else placeholders
    never read (claims_ptr may be None then)."""
    if CLAIM:
        ids, full, free = _claim_ring(readers)
        claims = (ids, full, free, claims_ptr)
    else:
        claims = (ready, ready, empty, empty)
    return claims


@gluon.jit
def _drop_ring(ready, empty, turns, fetched, claims, CLAIM: gl.constexpr):
    """Invalidate `_ring_barriers`' barriers, and with CLAIM the claim ring's."""
    STAGES: gl.constexpr = ready.shape[0]
    for slot in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(slot))
        mbarrier.invalidate(empty.index(slot))
    for role in gl.static_range(CONSUMERS):
        mbarrier.invalidate(turns.index(role))
        mbarrier.invalidate(fetched.index(role))
    if CLAIM:
        _drop_claim_ring(claims)


@gluon.jit
def _sigmoid(x):
    """`tl.sigmoid`'s formula, operation for operation."""
    return 1 / (1 + gl.exp(-x))


@gluon.jit
def _swiglu(gate, up, activation, HAS_LIMIT: gl.constexpr, PLAIN: gl.constexpr):
    """`grouped_gemm.swiglu_tile`, operation for operation (the twins agree bit for bit):
    silu(gate) * up when PLAIN, else gate * sigmoid(alpha * gate) * (up + up_offset)."""
    limit, alpha, up_offset = activation[0], activation[3], activation[4]
    if HAS_LIMIT:
        gate = gl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        up = gl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL)
        up = gl.minimum(up, limit, propagate_nan=tl.PropagateNan.ALL)
    if PLAIN:
        return gate * _sigmoid(gate) * up
    return gate * _sigmoid(alpha * gate) * (up + up_offset)


@gluon.jit
def _saved_preactivations(gate, up, limit, below, above, HAS_LIMIT: gl.constexpr):
    """`grouped_gemm.saved_preactivations`: gate and up as saved for the backward, such that its
    clamp decisions on the saved values are the forward's on the fp32 ones."""
    if HAS_LIMIT:
        clamped_gate = gl.maximum(gate, above, propagate_nan=tl.PropagateNan.ALL)
        kept_gate = gl.minimum(gate, below, propagate_nan=tl.PropagateNan.ALL)
        gate = gl.where(gate > limit, clamped_gate, kept_gate)
        high_up = gl.maximum(up, above, propagate_nan=tl.PropagateNan.ALL)
        low_up = gl.minimum(up, -above, propagate_nan=tl.PropagateNan.ALL)
        kept_up = gl.maximum(up, -below, propagate_nan=tl.PropagateNan.ALL)
        kept_up = gl.minimum(kept_up, below, propagate_nan=tl.PropagateNan.ALL)
        up = gl.where(up > limit, high_up, gl.where(up < -limit, low_up, kept_up))
    return gate, up


@gluon.jit
def _add_expert_bias(acc, bias_ptr, expert, n_off, N, layout: gl.constexpr):
    """`grouped_gemm.add_expert_bias`: acc [BM, BN] fp32 (in `layout`) + the expert's bias
    (bias [E, N]) over its columns n_off + [0, BN)."""
    BLOCK_N: gl.constexpr = acc.shape[1]
    cols = n_off + gl.arange(0, BLOCK_N, gl.SliceLayout(0, layout))
    bias = gl.load(bias_ptr + expert * N + cols, mask=cols < N, other=0.0)
    return acc + bias.to(gl.float32)[None, :]


@gluon.constexpr_function
def _reads_w_by_k(mode, bf16_weights):
    """Whether a launch reads W's tiles along K ([BLOCK_K, BLOCK_N] blocks of W [E, K, N]): the
    data-gradient modes on bf16 weights. FP8 MMAs take both operands K-major, so the
    block-scaled products read [BLOCK_N, BLOCK_K] blocks of W [E, N, K] in every mode."""
    return mode >= GATE_UP_DGRAD.value and bf16_weights


@gluon.constexpr_function
def _gather_layout(block_k, bits, warps, row_bytes=512):
    """Registers of a gathered [rows, block_k] A tile: 16-byte pieces, a warp's lanes along K,
    covering at most row_bytes of a row (a thread then holds block_k x bits / 8 / row_bytes
    pieces of each of its rows, one where the tile's row is no wider)."""
    vector = 128 // bits
    lanes_k = min(block_k // vector, row_bytes // 16, 32)
    return gl.BlockedLayout([1, vector], [32 // lanes_k, lanes_k], [warps, 1], [1, 0])


STEP_ROW_BYTES = gl.constexpr(128)
"""Bytes of a row that one copy instruction of a warp takes in the weight gradient's gathered
steps (`_gather_step`): four rows of one whole 128-byte line each, which is one row of the
shared tile's swizzle (no bank conflicts), so that a thread holds few rows, whose addresses it
computes once for all of its pieces of the row."""


@gluon.jit
def _gathered_starts(gather, row, WG_M: gl.constexpr, BLOCK_K: gl.constexpr):
    """Where the rows [row, row + WG_M) of a tile start in A (elements; negative past num_rows or
    for a negative index: a row of zeros, `_gather_rows`): read once per task from the index, so
    that the steps along K issue copies without waiting."""
    (a_ptr, a_stride, source_rows_ptr, num_rows, K) = gather
    layout: gl.constexpr = _gather_layout(
        BLOCK_K, a_ptr.dtype.element_ty.primitive_bitwidth, gl.num_warps()
    )
    rows = row + gl.arange(0, WG_M, gl.SliceLayout(1, layout))
    valid = rows < num_rows
    source = gl.load(source_rows_ptr + rows, mask=valid, other=0).to(gl.int64)
    return gl.where(valid, source * a_stride, -1)


@gluon.jit
def _gather_rows(gather, starts, k, buf):
    """Start copying A[source_rows[r], k:+BK] for the buf's rows r (their `starts`) into `buf`
    by cp.async in 16-byte pieces, zeros for rows past num_rows and columns past K: the gathering
    A-row source."""
    (a_ptr, a_stride, source_rows_ptr, num_rows, K) = gather
    BLOCK_K: gl.constexpr = buf.shape[1]
    VECTOR: gl.constexpr = 128 // a_ptr.dtype.element_ty.primitive_bitwidth
    layout: gl.constexpr = _gather_layout(
        BLOCK_K, a_ptr.dtype.element_ty.primitive_bitwidth, gl.num_warps()
    )
    cols = k + gl.arange(0, BLOCK_K, gl.SliceLayout(0, layout))
    cols = gl.max_contiguous(gl.multiple_of(cols, VECTOR), VECTOR)
    # A row stride that is a whole number of vectors (host checks) keeps every start aligned.
    aligned = gl.multiple_of(gl.maximum(starts, 0), VECTOR)
    # K is a whole number of vectors too (host checks): the mask is constant over each piece.
    mask = (starts >= 0)[:, None] & gl.max_constancy(cols < K, VECTOR)[None, :]
    _cp_async_load(buf, a_ptr + aligned[:, None] + cols[None, :], mask=mask)


@gluon.jit
def _globaltimer():
    return gl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1
    )


@gluon.jit
def _record_failure(status_ptr, code: gl.constexpr, wait_id, where, seen):
    """`mok.kernels.sync.record_failure`: the first failure recorded in a status wins (on
    one-element tensors: Gluon's atomics take distributed operands)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    one = gl.arange(0, 1, layout)
    zero = gl.full([1], 0, gl.int64, layout)
    old = gl.atomic_cas(status_ptr + one, zero, zero + code, sem="relaxed")
    first = old == 0
    gl.store(status_ptr + 1 + one, zero + wait_id, mask=first)
    gl.store(status_ptr + 2 + one, zero + where.to(gl.int64), mask=first)
    gl.store(status_ptr + 3 + one, zero + seen.to(gl.int64), mask=first)


@gluon.jit
def _wait_rows_ready(ready, row, row_end, FLAG_ROWS: gl.constexpr, FLAGS: gl.constexpr):
    """`grouped_gemm.wait_rows_ready` in the loader: spin (bounded, recording a failure in the
    status like `mok.kernels.sync.wait_ready`) until the flags of rows [row, row_end) carry
    this call's epoch, acquire what they publish, then fence so that the TMA copies issued next
    (async proxy) see it."""
    flags_ptr, epoch_ptr, status_ptr, timeout_ns, wait_id = ready
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    index = row // FLAG_ROWS + gl.arange(0, FLAGS, layout)
    mask = index <= (row_end - 1) // FLAG_ROWS
    epoch = gl.load(epoch_ptr)
    failed = gl.load(status_ptr, volatile=True)
    start = _globaltimer()
    seen = gl.load(flags_ptr + index, mask=mask, other=epoch, volatile=True)
    late = False
    while (gl.min(seen - epoch, 0) < 0) & (gl.max(seen - epoch, 0) <= 0) & (failed == 0) & ~late:
        seen = gl.load(flags_ptr + index, mask=mask, other=epoch, volatile=True)
        late = _globaltimer() - start > timeout_ns
    if failed == 0:
        far = gl.full([FLAGS], 1 << 62, gl.int64, layout)
        if gl.max(seen - epoch, 0) > 0:
            where = gl.min(gl.where(seen > epoch, index.to(gl.int64), far), 0)
            _record_failure(status_ptr, OUT_OF_STEP_CODE, wait_id, where, gl.max(seen, 0))
        elif gl.min(seen - epoch, 0) < 0:
            where = gl.min(gl.where(seen < epoch, index.to(gl.int64), far), 0)
            _record_failure(status_ptr, TIMED_OUT_CODE, wait_id, where, gl.min(seen, 0))
    nothing = gl.full([FLAGS], 0, gl.int32, layout)
    gl.atomic_add(flags_ptr + index, nothing, mask=mask, sem="acquire", scope="sys")
    gl.inline_asm_elementwise(
        "fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _step_index(gather, row, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """The index of the rows [row, row + ROWS) of `gather` (`_gathered_starts`'s source), -1
    past num_rows, in the layout of `_gather_step`'s copies (one value per row a thread copies):
    loaded a step ahead of them, so that its round trip does not delay the step's copies."""
    (a_ptr, a_stride, source_rows_ptr, num_rows, K) = gather
    layout: gl.constexpr = _gather_layout(
        BLOCK_N, a_ptr.dtype.element_ty.primitive_bitwidth, gl.num_warps(), STEP_ROW_BYTES
    )
    rows = row + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    return gl.load(source_rows_ptr + rows, mask=rows < num_rows, other=-1)


@gluon.jit
def _gather_step(gather, index, k, buf):
    """Start copying A[index[r], k:+BN] into `buf`'s rows r by cp.async in 16-byte pieces, zeros
    where the index is negative and for columns past K: one step of the weight gradient's
    gathered rows, whose index `_step_index` loaded. Offsets in 32 bits (the host checks that
    A's elements are fewer than 2^31): a row's start costs a multiply, not a 64-bit product."""
    (a_ptr, a_stride, source_rows_ptr, num_rows, K) = gather
    VECTOR: gl.constexpr = 128 // a_ptr.dtype.element_ty.primitive_bitwidth
    layout: gl.constexpr = _gather_layout(
        buf.shape[1], a_ptr.dtype.element_ty.primitive_bitwidth, gl.num_warps(), STEP_ROW_BYTES
    )
    cols = k + gl.arange(0, buf.shape[1], gl.SliceLayout(0, layout))
    cols = gl.max_contiguous(gl.multiple_of(cols, VECTOR), VECTOR)
    # A row stride that is a whole number of vectors (host checks) keeps every start aligned.
    starts = gl.multiple_of(gl.maximum(index, 0) * a_stride, VECTOR)
    mask = (index >= 0)[:, None] & gl.max_constancy(cols < K, VECTOR)[None, :]
    _cp_async_load(buf, a_ptr + starts[:, None] + cols[None, :], mask=mask)


@gluon.jit
def _load_partition(
    operands,
    problem,
    rows_ready,
    MODE: gl.constexpr,
    GATHER: gl.constexpr,
    FLAG_ROWS: gl.constexpr,
    WAIT_FLAGS: gl.constexpr,
    CLAIM: gl.constexpr,
):
    """Loader: the A and W tiles of every step of every task of this program, in order. A step
    holds one A tile and one W tile (two W tiles in GATE_UP_SWIGLU; GATE_UP_DGRAD alternates
    steps between its two products). A tiles come by TMA, or with GATHER through the rows' index
    (`_gather_rows`; not in GATE_UP_DGRAD). WAIT_FLAGS > 0: a task's first copy waits until its
    rows landed (`_wait_rows_ready` on the `RowsReady` fields in `rows_ready`). CLAIM: the tasks
    are claimed here and handed to the consumers (`_publish_task`)."""
    (a_desc, a2_desc, w_desc, w2_desc, a_bufs, w_bufs, w2_bufs, ready, empty, turns, gather,
     _) = operands  # fmt: skip
    (table_ptr, counts_ptr, capacity, N, K, GROUP_M, NUM_PROGRAMS, claims, w_expert_rows,
     num_rows) = problem  # fmt: skip
    SECOND_WEIGHT: gl.constexpr = MODE == GATE_UP_SWIGLU
    TWO_PRODUCTS: gl.constexpr = MODE == GATE_UP_DGRAD
    W_BY_K: gl.constexpr = _reads_w_by_k(MODE, operands[11] is None)
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1 if W_BY_K else 0]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    SPLIT: gl.constexpr = a_bufs.type.shape[0] // STAGES
    WG_M: gl.constexpr = a_desc.block_type.shape[0]
    # Gathered A tiles are counted by their copies' arrivals, not in bytes.
    step_bytes: gl.constexpr = (0 if GATHER else SPLIT * a_desc.block_type.nbytes) + (
        1 + SECOND_WEIGHT
    ) * w_desc.block_type.nbytes
    num_m, num_n, num_tasks = _task_count(counts_ptr, N, BLOCK_N)
    if GATHER:
        rows_source = (gather[0], gather[1], gather[2], num_rows, K)
    step = 0
    nth = 0
    task = _loader_first_task(claims, CLAIM)
    while task < num_tasks:
        if CLAIM:
            _publish_task(claims, nth, task)
        m_idx, n_idx = _grouped_task(task, num_m, num_n, GROUP_M)
        expert = gl.load(table_ptr + m_idx)
        row = gl.load(table_ptr + capacity + m_idx)
        n_off = n_idx * BLOCK_N
        if WAIT_FLAGS > 0:
            row_end = gl.load(table_ptr + 2 * capacity + m_idx)
            _wait_rows_ready(rows_ready, row, row_end, FLAG_ROWS, WAIT_FLAGS)
        if GATHER:
            first_starts = _gathered_starts(rows_source, row, WG_M, BLOCK_K)
            last_starts = _gathered_starts(rows_source, row + (SPLIT - 1) * WG_M, WG_M, BLOCK_K)
        for k in range(0, K, BLOCK_K):
            # W is read as rows of its 2-D view (`_expert_rows`), an expert's first row
            # w_expert_rows after the previous one's. W_BY_K: rows of N, and K is a multiple of
            # BLOCK_K (`dgrad_supported`), so that no step reaches past this expert's K rows.
            # Else rows of K: rows past this expert's N feed only columns that are not stored.
            if W_BY_K:
                w_row = expert * w_expert_rows + k
                w_col = n_off
            else:
                w_row = expert * w_expert_rows + n_off
                w_col = k
            for product in gl.static_range(1 + TWO_PRODUCTS):
                slot = step % STAGES
                # A fresh barrier counts as having completed the phase before its first: the first
                # pass over the ring does not wait.
                mbarrier.wait(empty.index(slot), (step // STAGES & 1) ^ 1)
                bar = ready.index(slot)
                if GATHER:
                    _gather_rows(rows_source, first_starts, k, a_bufs.index(slot * SPLIT))
                    if SPLIT == 2:
                        _gather_rows(rows_source, last_starts, k, a_bufs.index(slot * SPLIT + 1))
                    # Each thread's arrival (counted first, made when its copies landed) comes
                    # before the expect below, so the slot cannot complete before the rows did.
                    async_copy.mbarrier_arrive(bar)
                mbarrier.expect(bar, step_bytes)
                if not GATHER:
                    # SPLIT > 1: the tile's rows in one part per consumer (cooperative tiles).
                    for part in gl.static_range(SPLIT):
                        a_buf = a_bufs.index(slot * SPLIT + part)
                        a_at = [row + part * WG_M, k]
                        if product == 0:
                            _tma_load(a_desc, a_at, bar, a_buf)
                        else:
                            _tma_load(a2_desc, a_at, bar, a_buf)
                if product == 0:
                    _tma_load(w_desc, [w_row, w_col], bar, w_bufs.index(slot))
                else:
                    _tma_load(w2_desc, [w_row, w_col], bar, w_bufs.index(slot))
                if SECOND_WEIGHT:
                    _tma_load(w2_desc, [w_row, w_col], bar, w2_bufs.index(slot))
                step += 1
        if CLAIM:
            nth += 1
        task = _loader_next_task(claims, task, NUM_PROGRAMS, CLAIM)
    if CLAIM:
        _end_claims(claims, nth)


@gluon.jit
def _store_staged(desc, buf, ptr, row_stride, row, row_end, n_off, N):
    """Store a tile staged in `buf` at [row, n_off]: by TMA when it is inside its group (TMA drops
    the columns past N), else rows [row, row_end) and columns [n_off, N) only, read back in rows
    of 16-byte vectors (few addresses in registers) and stored with a mask."""
    BLOCK_M: gl.constexpr = desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = desc.block_type.shape[1]
    VECTOR: gl.constexpr = 128 // desc.block_type.element_ty.primitive_bitwidth
    LANES_N: gl.constexpr = min(BLOCK_N // VECTOR, 32)
    if row + BLOCK_M <= row_end:
        fence_async_shared()
        _tma_store(desc, [row, n_off], buf)
    else:
        rows_layout: gl.constexpr = gl.BlockedLayout(
            [1, VECTOR], [32 // LANES_N, LANES_N], [gl.num_warps(), 1], [1, 0]
        )
        tile = buf.load(rows_layout)
        rows = row + gl.arange(0, BLOCK_M, gl.SliceLayout(1, rows_layout))
        cols = n_off + gl.arange(0, BLOCK_N, gl.SliceLayout(0, rows_layout))
        mask = (rows < row_end)[:, None] & (cols < N)[None, :]
        offsets = rows.to(gl.int64)[:, None] * row_stride + cols[None, :]
        gl.store(ptr + offsets, tile, mask=mask)


@gluon.jit
def _scatter_staged(buf, target, row, row_end, n_off, N, RANKS: gl.constexpr):
    """The peer-store epilogue (`grouped_gemm.scatter_row_tile`, same contract) on a tile staged
    in `buf`: rows [row, row_end) to their ranks' buffers in 16-byte vectors, then one release
    add per destination rank to its count of this rank (RANKS: a power of two >= ep)."""
    (
        out_ptr,
        out_offsets_ptr,
        dest_rank_ptr,
        dest_row_ptr,
        counts_ptr,
        counts_offsets_ptr,
        rank,
    ) = target
    BLOCK_M: gl.constexpr = buf.shape[0]
    BLOCK_N: gl.constexpr = buf.shape[1]
    VECTOR: gl.constexpr = 128 // buf.dtype.primitive_bitwidth
    LANES_N: gl.constexpr = min(BLOCK_N // VECTOR, 32)
    rows_layout: gl.constexpr = gl.BlockedLayout(
        [1, VECTOR], [32 // LANES_N, LANES_N], [gl.num_warps(), 1], [1, 0]
    )
    tile = buf.load(rows_layout)
    rows = row + gl.arange(0, BLOCK_M, gl.SliceLayout(1, rows_layout))
    valid = rows < row_end
    dest_rank = gl.load(dest_rank_ptr + rows, mask=valid, other=0)
    dest_row = gl.load(dest_row_ptr + rows, mask=valid, other=-1)
    keep = valid & (dest_row >= 0)
    # Row starts are whole vectors: N and every peer offset are multiples of VECTOR (host checks).
    base = gl.load(out_offsets_ptr + dest_rank, mask=keep, other=0)
    starts = gl.multiple_of(base + dest_row.to(gl.int64) * N, VECTOR)
    cols = n_off + gl.arange(0, BLOCK_N, gl.SliceLayout(0, rows_layout))
    mask = keep[:, None] & (cols < N)[None, :]
    gl.store(out_ptr + starts[:, None] + cols[None, :], tile, mask=mask)
    peers = gl.arange(0, RANKS, gl.SliceLayout(0, rows_layout))
    hits = (dest_rank[:, None] == peers[None, :]) & keep[:, None]
    landed = gl.sum(hits.to(gl.int32), axis=0)
    signal = landed > 0
    counts_at = gl.load(counts_offsets_ptr + peers, mask=signal, other=0)
    # Every thread's stores precede the release adds (this consumer's barrier), which publish them
    # at system scope: the rows may live on another GPU.
    _thread_barrier()
    gl.atomic_add(counts_ptr + counts_at + rank, landed, mask=signal, sem="release", scope="sys")


@gluon.jit
def _swiglu_backward(grad_h, gate, up, activation, HAS_LIMIT: gl.constexpr, PLAIN: gl.constexpr):
    """`grouped_gemm.swiglu_backward_tile`, operation for operation (bitwise the same)."""
    limit, alpha, up_offset = activation[0], activation[3], activation[4]
    g = gate
    u = up
    if HAS_LIMIT:
        g = gl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        u = gl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL)
        u = gl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL)
    if PLAIN:
        sig = _sigmoid(g)
        grad_up = grad_h * (g * sig)
        grad_gate = grad_h * u * (sig * (1.0 + g * (1.0 - sig)))
    else:
        sig = _sigmoid(alpha * g)
        grad_up = grad_h * (g * sig)
        grad_gate = grad_h * (u + up_offset) * (sig * (1.0 + alpha * g * (1.0 - sig)))
    if HAS_LIMIT:
        grad_gate = gl.where(gate <= limit, grad_gate, 0.0)
        grad_up = gl.where((up >= -limit) & (up <= limit), grad_up, 0.0)
    return grad_gate, grad_up


@gluon.jit
def _row_weights(weighting, row, row_end, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """The router weights of a tile's rows [row, row_end) (0 past row_end), loaded before the
    main loop so that the epilogue does not wait for them."""
    row_weights_ptr = weighting[1]
    rows = row + gl.arange(0, BLOCK_M, gl.SliceLayout(1, layout))
    return gl.load(row_weights_ptr + rows, mask=rows < row_end, other=0.0)


@gluon.jit
def _router_weighting(
    acc, w, h_desc, weighting, h_buf, row, row_end, n_off, n_idx, N, layout: gl.constexpr
):
    """`grouped_gemm.router_weighting_tile` on a consumer's accumulator (same contract), with
    the rows' weights w (`_row_weights`) and h's tile fetched into h_buf beside the main loop
    (`_fetch_saved`): the partial dots <acc, h> of rows [row, row_end) into column n_idx of
    dots, round(w * h) stored over h's tile from h_buf, and w * acc returned, unrounded."""
    h_ptr, _, dots_ptr, dots_stride = weighting
    BLOCK_M: gl.constexpr = acc.shape[0]
    rows = row + gl.arange(0, BLOCK_M, gl.SliceLayout(1, layout))
    h = h_buf.load(layout).to(gl.float32)
    # Rows past row_end hold other groups' h: their dots are not stored, nor their h.
    dots = gl.sum(acc * h, axis=1)
    gl.store(dots_ptr + rows.to(gl.int64) * dots_stride + n_idx, dots, mask=rows < row_end)
    h_buf.store((w[:, None] * h).to(h_desc.dtype))
    _store_staged(h_desc, h_buf, h_ptr, N, row, row_end, n_off, N)
    return w[:, None] * acc


@gluon.jit
def _fetch_saved(saved, bufs, first, fetched, row, n_off, WEIGHTED: gl.constexpr):
    """Start loading the saved gate and up tiles of a tile's rows, and with WEIGHTED h's, into
    the consumer's epilogue buffers `first`, `first + 1` (and `first + 2`) (DOWN_DGRAD_SWIGLU),
    once its previous stores have left them."""
    saved_gate_desc, saved_up_desc, h_desc = saved
    tma.store_wait(0)
    mbarrier.expect(fetched, (2 + WEIGHTED) * saved_gate_desc.block_type.nbytes)
    _tma_load(saved_gate_desc, [row, n_off], fetched, bufs.index(first))
    _tma_load(saved_up_desc, [row, n_off], fetched, bufs.index(first + 1))
    if WEIGHTED:
        _tma_load(h_desc, [row, n_off], fetched, bufs.index(first + 2))


@gluon.jit
def _store_pair(gate_desc, up_desc, bufs, first, gate_up_ptr, gate, up, row, row_end, n_off, N):
    """Store two fp32 [BM, BN] tiles, rounded, into the halves of an [M, 2N] matrix (gate | up),
    through the epilogue buffers `first` and `first + 1`. Both are staged before either is
    stored: no register tile stays live across the stores."""
    bufs.index(first).store(gate.to(gate_desc.dtype))
    bufs.index(first + 1).store(up.to(up_desc.dtype))
    _store_staged(gate_desc, bufs.index(first), gate_up_ptr, 2 * N, row, row_end, n_off, N)
    _store_staged(up_desc, bufs.index(first + 1), gate_up_ptr + N, 2 * N, row, row_end, n_off, N)


@gluon.jit
def _ready_a_tile(ready, a_bufs, step, PART: gl.constexpr, GATHER: gl.constexpr):
    """A consumer's wait for ring step `step`'s tiles: (its slot, the consumer's part of the A
    tile there), fenced for wgmma where GATHER's rows landed by cp.async."""
    STAGES: gl.constexpr = ready.shape[0]
    SPLIT: gl.constexpr = a_bufs.shape[0] // STAGES
    slot = step % STAGES
    mbarrier.wait(ready.index(slot), step // STAGES & 1)
    if GATHER:
        # The gathered rows were written by cp.async (the generic proxy); wgmma reads through
        # the async proxy.
        fence_async_shared()
    return slot, a_bufs.index(slot * SPLIT + PART)


@gluon.jit
def _descale_pointers(
    descales, expert, row, n_off, num_rows, shape: gl.constexpr, layout: gl.constexpr
):
    """Where a consumer's tile of `shape` (rows, columns) reads its descales for the
    block-scaled main loop, step k at + k: A's of each of its rows (1 x 128 tiles along K, [M, S]
    fp32; rows past M masked) and W's and W2's of each of its columns (128 x 128 blocks, [E,
    cdiv(N, 128), S] fp32). Columns past N read the last block's: they reach only columns never
    stored."""
    a_descales, w_descales, w2_descales, steps, blocks = descales
    rows = row + gl.arange(0, shape[0], layout=gl.SliceLayout(1, layout))
    cols = n_off + gl.arange(0, shape[1], layout=gl.SliceLayout(0, layout))
    col_blocks = (expert * blocks + gl.minimum(cols // SCALE_BLOCK, blocks - 1)) * steps
    a_at = a_descales + rows.to(gl.int64) * steps
    return a_at, rows < num_rows, w_descales + col_blocks, w2_descales + col_blocks


@gluon.jit
def _block_scaled_step(a, w, w2, k, acc, acc2, zeros, descale_at, SECOND_WEIGHT: gl.constexpr):
    """One step of the 128-block FP8 recipe: the step's e4m3 products A[:, k] @ W[k, :] summed
    by the FP8 tensor cores from zero, then that fp32 partial tile times A's descale of each row
    and W's of each column (their product first, as `mok.reference.fp8_block.scaled_matmul`
    forms it) added to acc on the CUDA cores (the tensor cores' FP8 sums keep too few bits to
    carry across steps); with SECOND_WEIGHT the same with W2 into acc2, both products in flight
    together. The descales load while the products run; their operands are read once this
    returns. zeros: an fp32 tile of acc's shape and layout (the wgmma's operand)."""
    partial = warpgroup_mma(a, w, zeros, use_acc=False, is_async=True)
    if SECOND_WEIGHT:
        partial2 = warpgroup_mma(a, w2, zeros, use_acc=False, is_async=True)
    a_at, a_inside, w_at, w2_at = descale_at
    a_descale = gl.load(a_at + k, mask=a_inside, other=0.0)[:, None]
    w_descale = gl.load(w_at + k)[None, :]
    if SECOND_WEIGHT:
        w2_descale = gl.load(w2_at + k)[None, :]
        partial, partial2, _ = warpgroup_mma_wait(0, deps=(partial, partial2, a))
        acc2 = acc2 + partial2 * (a_descale * w2_descale)
    else:
        partial, _ = warpgroup_mma_wait(0, deps=(partial, a))
    return acc + partial * (a_descale * w_descale), acc2


@gluon.jit
def _main_loop(
    operands,
    nth,
    k_steps,
    acc_layout: gl.constexpr,
    ROLE: gl.constexpr,
    SECOND_WEIGHT: gl.constexpr,
    W_BY_K: gl.constexpr,
    GATHER: gl.constexpr,
    descale_at,
):
    """Consumer ROLE's main loop over the program's nth task: its k_steps steps taken from the
    loader's ring (A @ W, or A @ W.T unless W_BY_K), returned as fp32 accumulators (acc, and with
    SECOND_WEIGHT acc2, A @ W2.T; zeros otherwise). With the block-scaled operand (`descales`,
    FP8 A and W, BLOCK_K one scale block), each step is `_block_scaled_step` at `descale_at`
    (`_descale_pointers`)."""
    a_desc, w_desc, a_bufs, w_bufs, w2_bufs = (
        operands[0],
        operands[2],
        operands[4],
        operands[5],
        operands[6],
    )
    ready, empty, turns, descales = operands[7], operands[8], operands[9], operands[11]
    WG_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1 if W_BY_K else 0]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    SPLIT: gl.constexpr = a_bufs.type.shape[0] // STAGES
    PART: gl.constexpr = ROLE if SPLIT > 1 else 0
    step = nth * k_steps
    if SPLIT == 1:
        # Wait for the other consumer to have issued its tile's main loop: it has then waited
        # on every slot before ours, so our ready waits are at most one phase ahead of the
        # barriers (phase parity cannot tell a phase from the one two later). This also
        # orders the two main loops on the tensor cores. Cooperative consumers need no
        # turns: a slot refills only once both have released it.
        mbarrier.wait(turns.index(ROLE), (nth // CONSUMERS & 1) ^ (1 - ROLE))
    acc = gl.zeros((WG_M, BLOCK_N), gl.float32, acc_layout)
    acc2 = gl.zeros((WG_M, BLOCK_N), gl.float32, acc_layout)
    for k in range(k_steps):
        slot, a = _ready_a_tile(ready, a_bufs, step, PART, GATHER)
        if W_BY_K:
            w = w_bufs.index(slot)
        else:
            w = w_bufs.index(slot).permute((1, 0))
        if descales is not None:
            zeros = gl.zeros((WG_M, BLOCK_N), gl.float32, acc_layout)
            w2 = w2_bufs.index(slot).permute((1, 0))
            acc, acc2 = _block_scaled_step(a, w, w2, k, acc, acc2, zeros, descale_at, SECOND_WEIGHT)
            mbarrier.arrive(empty.index(slot))
        else:
            acc = warpgroup_mma(a, w, acc, is_async=True)
            if SECOND_WEIGHT:
                acc2 = warpgroup_mma(a, w2_bufs.index(slot).permute((1, 0)), acc2, is_async=True)
                # At most this step's second wgmma in flight: the step before has read its slot.
                acc, acc2, _ = warpgroup_mma_wait(1, deps=(acc, acc2, a))
            else:
                acc, _ = warpgroup_mma_wait(1, deps=(acc, a))
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k > 0)
        step += 1
    if SPLIT == 1:
        mbarrier.arrive(turns.index(1 - ROLE))
    # Block-scaled steps each waited for their product and released their slot.
    if descales is None:
        if SECOND_WEIGHT:
            acc, acc2 = warpgroup_mma_wait(0, deps=(acc, acc2))
        else:
            acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
    return acc, acc2


@gluon.jit
def _down_dgrad_epilogue(
    acc,
    row_weights,
    outputs,
    first,
    fetched,
    phase,
    row,
    row_end,
    n_off,
    n_idx,
    N,
    acc_layout: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    PLAIN: gl.constexpr,
    WEIGHTED: gl.constexpr,
):
    """DOWN_DGRAD_SWIGLU's epilogue of one tile (grad_h in acc): once the saved pre-activations
    (and with WEIGHTED h) fetched beside the main loop are in (`fetched` at `phase`), the router
    weighting (WEIGHTED), then the activation's backward, stored as the gate | up gradients."""
    (_, gate_desc, up_desc, out_bufs, saved, _, epilogue, _, weighting) = outputs
    gate_up_ptr, activation = epilogue[1], epilogue[2]
    dtype: gl.constexpr = gate_desc.dtype
    mbarrier.wait(fetched, phase)
    if WEIGHTED:
        acc = _router_weighting(
            acc, row_weights, saved[2], weighting, out_bufs.index(first + 2), row, row_end, n_off,
            n_idx, N,
            acc_layout,
        )  # fmt: skip
    # h was rounded to the activation dtype in forward, so its gradient is too (autograd).
    grad_h = acc.to(dtype).to(gl.float32)
    # Rows past row_end hold other groups' values: they reach only rows never stored.
    gate = out_bufs.index(first).load(acc_layout).to(gl.float32)
    up = out_bufs.index(first + 1).load(acc_layout).to(gl.float32)
    grad_gate, grad_up = _swiglu_backward(grad_h, gate, up, activation, HAS_LIMIT, PLAIN)
    _store_pair(
        gate_desc, up_desc, out_bufs, first, gate_up_ptr, grad_gate, grad_up, row, row_end, n_off,
        N,
    )  # fmt: skip


@gluon.jit
def _product_epilogue(
    acc,
    acc2,
    outputs,
    expert_at,
    first,
    row,
    row_end,
    n_off,
    N,
    acc_layout: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    PLAIN: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    SECOND_WEIGHT: gl.constexpr,
    SCATTER_RANKS: gl.constexpr,
):
    """The epilogue of one tile of the other modes: the expert's biases (HAS_BIAS; its index at
    expert_at), with SECOND_WEIGHT the activation, stored locally or with SCATTER_RANKS by the
    peer-store epilogue; with SECOND_WEIGHT and two epilogue buffers, the pre-activations saved
    too."""
    (out_desc, gate_desc, up_desc, out_bufs, _, _, epilogue, target, _) = outputs
    out_ptr, gate_up_ptr, activation, biases = epilogue
    limit, limit_below, limit_above = activation[0], activation[1], activation[2]
    OUTPUTS: gl.constexpr = out_bufs.type.shape[0] // CONSUMERS
    dtype: gl.constexpr = out_desc.dtype
    if HAS_BIAS:
        expert = gl.load(expert_at)
        acc = _add_expert_bias(acc, biases[0], expert, n_off, N, acc_layout)
        if SECOND_WEIGHT:
            acc2 = _add_expert_bias(acc2, biases[1], expert, n_off, N, acc_layout)
    tma.store_wait(0)  # this consumer's previous stores have left its buffers
    if SECOND_WEIGHT:
        value = _swiglu(acc, acc2, activation, HAS_LIMIT, PLAIN).to(dtype)
    else:
        value = acc.to(dtype)
    out_bufs.index(first).store(value)
    if SCATTER_RANKS > 0:
        _scatter_staged(out_bufs.index(first), target, row, row_end, n_off, N, SCATTER_RANKS)
    else:
        _store_staged(out_desc, out_bufs.index(first), out_ptr, N, row, row_end, n_off, N)
    if SECOND_WEIGHT and OUTPUTS == 2:
        # The saved pre-activations: gate through the second buffer, then up through the
        # first once h's store has left it (two buffers, not three: a deeper ring).
        gate, up = _saved_preactivations(acc, acc2, limit, limit_below, limit_above, HAS_LIMIT)
        gate_buf = out_bufs.index(first + 1)
        gate_buf.store(gate.to(dtype))
        _store_staged(gate_desc, gate_buf, gate_up_ptr, 2 * N, row, row_end, n_off, N)
        tma.store_wait(1)
        out_bufs.index(first).store(up.to(dtype))
        _store_staged(
            up_desc, out_bufs.index(first), gate_up_ptr + N, 2 * N, row, row_end, n_off, N
        )


@gluon.jit
def _zero_rows_outside_groups(
    outputs, problem, num_m, num_n, first, acc_layout: gl.constexpr, ROLE: gl.constexpr,
    SPLIT: gl.constexpr,
):  # fmt: skip
    """GATE_UP_DGRAD: zeros into the rows outside every group, consumer ROLE's share of them by
    the static stride, from no reduction (a static grid: the launcher does not let this mode
    claim)."""
    out_desc, out_bufs, out_ptr = outputs[0], outputs[3], outputs[6][0]
    # A value, not a constexpr, where Triton passes the tuple's constexprs as values (3.6).
    (table_ptr, counts_ptr, capacity, N, _, _, num_programs, _, _, _) = problem
    WG_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    PART: gl.constexpr = ROLE if SPLIT > 1 else 0
    TASK_STRIDE: gl.constexpr = CONSUMERS if SPLIT == 1 else 1
    FIRST_TASK: gl.constexpr = ROLE if SPLIT == 1 else 0
    own_start = gl.program_id(0) + FIRST_TASK * num_programs
    outside = (gl.load(counts_ptr + 1) - num_m) * num_n
    zeros = gl.zeros((WG_M, BLOCK_N), out_desc.dtype, acc_layout)
    for task in range(own_start, outside, TASK_STRIDE * num_programs):
        m_idx = num_m + task // num_n
        n_off = task % num_n * BLOCK_N
        row = gl.load(table_ptr + capacity + m_idx) + PART * WG_M
        row_end = gl.load(table_ptr + 2 * capacity + m_idx)
        if row < row_end:
            tma.store_wait(0)
            out_bufs.index(first).store(zeros)
            _store_staged(out_desc, out_bufs.index(first), out_ptr, N, row, row_end, n_off, N)


@gluon.jit
def _consume(
    operands,
    outputs,
    problem,
    MODE: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    PLAIN: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    GATHER: gl.constexpr,
    SCATTER_RANKS: gl.constexpr,
    CLAIM: gl.constexpr,
    WEIGHTED: gl.constexpr,
    ROLE: gl.constexpr,
):
    """Consumer ROLE (0 or 1): for each of its tasks, the main loop (`_main_loop`), then the
    mode's epilogue (`_down_dgrad_epilogue`, `_product_epilogue`). Ping-pong (SPLIT 1): tasks
    ROLE, ROLE + 2, ... of this program, a whole tile each. Cooperative (SPLIT 2): every task of
    the program, rows [ROLE * WG_M, (ROLE + 1) * WG_M) of its tile, the weight tile shared with
    the other. CLAIM: the program's tasks are those its loader claimed (`_program_task`)."""
    a_desc, w_desc, a_bufs, w_bufs = operands[0], operands[2], operands[4], operands[5]
    out_bufs, saved, fetched, weighting = outputs[3], outputs[4], outputs[5], outputs[8]
    (table_ptr, counts_ptr, capacity, N, K, GROUP_M, NUM_PROGRAMS, claims, _, num_rows) = problem
    descales = operands[11]
    SECOND_WEIGHT: gl.constexpr = MODE == GATE_UP_SWIGLU
    TWO_PRODUCTS: gl.constexpr = MODE == GATE_UP_DGRAD
    W_BY_K: gl.constexpr = _reads_w_by_k(MODE, descales is None)
    WG_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1 if W_BY_K else 0]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    SPLIT: gl.constexpr = a_bufs.type.shape[0] // STAGES
    PART: gl.constexpr = ROLE if SPLIT > 1 else 0
    TASK_STRIDE: gl.constexpr = (
        CONSUMERS if SPLIT == 1 else 1
    )  # one task in TASK_STRIDE is this consumer's
    FIRST_TASK: gl.constexpr = ROLE if SPLIT == 1 else 0  # this consumer's first, in the program
    OUTPUTS: gl.constexpr = out_bufs.type.shape[0] // CONSUMERS
    # An instruction's K: 32 bytes of the operands' elements (16 bf16, 32 e4m3).
    INSTR_K: gl.constexpr = 256 // a_desc.dtype.primitive_bitwidth
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, INSTR_K]
    )
    num_m, num_n, num_tasks = _task_count(counts_ptr, N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K) * (1 + TWO_PRODUCTS)
    first = ROLE * OUTPUTS
    nth = FIRST_TASK  # the program's task index
    task = _program_task(claims, nth, NUM_PROGRAMS, CLAIM)
    while task < num_tasks:
        m_idx, n_idx = _grouped_task(task, num_m, num_n, GROUP_M)
        row = gl.load(table_ptr + capacity + m_idx) + PART * WG_M
        row_end = gl.load(table_ptr + 2 * capacity + m_idx)
        n_off = n_idx * BLOCK_N
        row_weights = 0.0  # WEIGHTED's, else unused
        if MODE == DOWN_DGRAD_SWIGLU:
            # The saved pre-activations (and h) load while the main loop runs.
            _fetch_saved(saved, out_bufs, first, fetched.index(ROLE), row, n_off, WEIGHTED)
            if WEIGHTED:
                row_weights = _row_weights(weighting, row, row_end, WG_M, acc_layout)
        descale_at = 0  # the block-scaled main loop's, else unused
        if descales is not None:
            descale_at = _descale_pointers(
                descales, gl.load(table_ptr + m_idx), row, n_off, num_rows, [WG_M, BLOCK_N],
                acc_layout,
            )  # fmt: skip
        acc, acc2 = _main_loop(
            operands, nth, k_steps, acc_layout, ROLE, SECOND_WEIGHT, W_BY_K, GATHER, descale_at
        )
        # The other consumer's main loop runs during this epilogue.
        if MODE == DOWN_DGRAD_SWIGLU:
            _down_dgrad_epilogue(
                acc, row_weights, outputs, first, fetched.index(ROLE), nth // TASK_STRIDE & 1, row,
                row_end, n_off, n_idx, N, acc_layout, HAS_LIMIT, PLAIN, WEIGHTED,
            )  # fmt: skip
        else:
            _product_epilogue(
                acc, acc2, outputs, table_ptr + m_idx, first, row, row_end, n_off, N, acc_layout,
                HAS_LIMIT, PLAIN, HAS_BIAS, SECOND_WEIGHT, SCATTER_RANKS,
            )  # fmt: skip
        nth += TASK_STRIDE
        task = _program_task(claims, nth, NUM_PROGRAMS, CLAIM)
    if MODE == GATE_UP_DGRAD:
        _zero_rows_outside_groups(outputs, problem, num_m, num_n, first, acc_layout, ROLE, SPLIT)
    tma.store_wait(0)


@fast_launch
@gluon.jit(do_not_specialize=["capacity", "num_rows"])
def _row_tiles_kernel(
    a_desc,  # [M, K], block [BLOCK_M, BLOCK_K]
    a2_desc,  # [M, K] the second product's A when GATE_UP_DGRAD (else a_desc)
    w_desc,  # W's rows [R, K], block [BLOCK_N, BLOCK_K]; W_BY_K modes: [R, N], block [BK, BN]
    w2_desc,  # the second weight (GATE_UP_SWIGLU, GATE_UP_DGRAD; else w_desc), as w_desc
    out_desc,  # [M, N] out, block [BLOCK_M, BLOCK_N]
    gate_desc,  # [M, N] (row stride 2N) out: pre-activations A @ W.T, or the gradient of gate
    up_desc,  # [M, N] (row stride 2N) out: pre-activations A @ W2.T, or the gradient of up
    saved_gate_desc,  # [M, N] (row stride 2N) the saved gate pre-activations (DOWN_DGRAD_SWIGLU)
    saved_up_desc,  # [M, N] (row stride 2N) the saved up pre-activations (DOWN_DGRAD_SWIGLU)
    h_desc,  # weighting: [M, N] the forward's h (else another descriptor, never read)
    capacity,  # columns of the row-tile table
    num_rows,  # M
    problem,  # (table_ptr [3, capacity] int32, counts_ptr [2] int32, N, K, w_expert_rows)
    epilogue,  # (out_ptr, gate_up_ptr, activation, biases), below
    gather,  # None, or the gathering row source (a_ptr [S, K], a_stride, source_rows_ptr [M])
    rows_ready,  # None, or the `RowsReady` fields in order: the A rows land while this runs
    scatter,  # None, or the `RowScatter` fields in order (DOWN): the peer-store epilogue
    claims_ptr,  # None, or [1] int32 the launch's task counter (`host.TileClaims`)
    weighting,  # None, or `_router_weighting`'s (h_ptr, row_weights_ptr, dots_ptr, dots_stride)
    descales,  # None, or the block-scaled FP8 operands' (`_descale_pointers`): (A's [M, S], W's
    # and W2's [E, cdiv(N, 128), S] fp32, S, cdiv(N, 128)); DOWN and GATE_UP_SWIGLU
    MODE: gl.constexpr,
    PLAIN: gl.constexpr,  # act: SwiGLU, else gpt-oss's form (`_swiglu`)
    TILING: gl.constexpr,  # (STAGES, SPLIT, GROUP_M, NUM_PROGRAMS)
    READY_FLAGS: gl.constexpr,  # rows_ready's (FLAG_ROWS: rows a flag, flags a tile at most)
    SCATTER_RANKS: gl.constexpr,  # scatter's ranks, a power of two >= ep; 0 without
):
    """Grid: NUM_PROGRAMS (with claims_ptr: any, the tasks claimed from it), num_warps 4; row
    tiles of SPLIT x WG_M rows (the A descriptor's block rows), one consumer's each (SPLIT 1,
    ping-pong) or both consumers' (SPLIT 2, cooperative). For every group's rows, by MODE
    (w_expert_rows: rows of w_desc and w2_desc from one expert's first row to the next's):
    DOWN            out = A @ W[e].T (+ bias[e])
    GATE_UP_SWIGLU     out = act(A @ W[e].T (+ bias[e]), A @ W2[e].T (+ bias2[e]))
    GATE_UP_DGRAD      out = A @ W[e] + A2 @ W2[e], the two interleaved step by step; zeros in
                       the rows outside every group
    DOWN_DGRAD_SWIGLU  gate | up gradients = act_backward(A @ W[e], saved gate, saved up);
                       with weighting: A's rows unweighted, each row's router weight applied to
                       the product in the epilogue (`_router_weighting`)
    The epilogue's: out_ptr (out's first element); gate_up_ptr None, or [M, 2N] the storage of
    gate_desc and up_desc (the pre-activations saved); activation (limit or None (no clamp), the
    largest value of the output dtype <= limit, the smallest > limit, alpha, up_offset: act is
    gate * sigmoid(alpha * gate) * (up + up_offset) unless PLAIN); biases None, or (bias,)
    added to the product (DOWN), or (bias, bias2) added to gate and up (GATE_UP_SWIGLU), each
    [E, N], in fp32.
    The parts absent as None are compiled out: the A rows come as TMA tiles unless `gather`
    (`_gather_rows`), tasks by the static stride unless `claims_ptr`, stores are local unless
    `scatter` (`_scatter_staged`, with readiness counts), with `rows_ready` every task waits
    for its A rows to land first (`_wait_rows_ready`; a kernel beside this one writes them), and
    with `descales` (DOWN or GATE_UP_SWIGLU, e4m3 A and weights, BLOCK_K 128) the products run
    on the FP8 tensor cores in the 128-block recipe's steps (`_block_scaled_step`)."""
    (table_ptr, counts_ptr, N, K, w_expert_rows) = problem
    STAGES: gl.constexpr = TILING[0]
    SPLIT: gl.constexpr = TILING[1]
    GROUP_M: gl.constexpr = TILING[2]
    NUM_PROGRAMS: gl.constexpr = TILING[3]
    FLAG_ROWS: gl.constexpr = READY_FLAGS[0]
    WAIT_FLAGS: gl.constexpr = READY_FLAGS[1]
    GATHER: gl.constexpr = gather is not None
    CLAIM: gl.constexpr = claims_ptr is not None
    WEIGHTED: gl.constexpr = weighting is not None
    HAS_BIAS: gl.constexpr = epilogue[3] is not None
    HAS_LIMIT: gl.constexpr = epilogue[2][0] is not None
    SAVE_PREACT: gl.constexpr = MODE == GATE_UP_SWIGLU and epilogue[1] is not None
    LOADER_WARPS: gl.constexpr = GATHER_LOADER_WARPS if GATHER else 1
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(
        dtype, [STAGES * SPLIT] + a_desc.block_type.shape, a_desc.layout
    )
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    if MODE == GATE_UP_SWIGLU:
        w2_bufs = gl.allocate_shared_memory(
            dtype, [STAGES] + w2_desc.block_type.shape, w2_desc.layout
        )
    else:
        w2_bufs = w_bufs
    OUTPUTS: gl.constexpr = 2 + WEIGHTED if SAVE_PREACT or MODE == DOWN_DGRAD_SWIGLU else 1
    out_bufs = gl.allocate_shared_memory(
        out_desc.dtype, [CONSUMERS * OUTPUTS] + out_desc.block_type.shape, out_desc.layout
    )
    ready, empty, turns, fetched = _ring_barriers(STAGES, SPLIT)
    claims = _task_claims(claims_ptr, ready, empty, SPLIT, CLAIM)  # ping-pong: one reads an id
    # Parts that may be None enter tuples as the arguments themselves (a rebound None cannot).
    operands = (a_desc, a2_desc, w_desc, w2_desc, a_bufs, w_bufs, w2_bufs, ready, empty, turns,
                gather, descales)  # fmt: skip
    saved = (saved_gate_desc, saved_up_desc, h_desc)
    outputs = (out_desc, gate_desc, up_desc, out_bufs, saved, fetched, epilogue, scatter,
               weighting)  # fmt: skip
    scheduled = (table_ptr, counts_ptr, capacity, N, K, GROUP_M, NUM_PROGRAMS, claims,
                 w_expert_rows, num_rows)  # fmt: skip
    # The argument tuples are written out: constexprs in a tuple bound to a name arrive as values.
    gl.warp_specialize(
        [
            (_consume, (operands, outputs, scheduled, MODE, HAS_LIMIT, PLAIN, HAS_BIAS, GATHER,
                        SCATTER_RANKS, CLAIM, WEIGHTED, 0)),
            (_consume, (operands, outputs, scheduled, MODE, HAS_LIMIT, PLAIN, HAS_BIAS, GATHER,
                        SCATTER_RANKS, CLAIM, WEIGHTED, 1)),
            (_load_partition, (operands, scheduled, rows_ready, MODE, GATHER, FLAG_ROWS, WAIT_FLAGS,
                               CLAIM)),
        ],
        [4, LOADER_WARPS],
        [CONSUMER_REGISTERS, LOADER_REGISTERS],
    )  # fmt: skip
    _drop_ring(ready, empty, turns, fetched, claims, CLAIM)


_GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_LAYOUT_DTYPES = {**_GLUON_DTYPES, torch.float32: gl.float32, torch.float8_e4m3fn: gl.float8e4nv}


@functools.cache
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a TMA block: one object per block and dtype (Triton builds
    it slowly, and `mok.kernels.launch` keys launches by the layout's identity)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _LAYOUT_DTYPES[dtype])


def _descriptor(tensor: torch.Tensor, block: list[int]) -> DeferredDescriptor:
    """The TMA descriptor of `tensor` by blocks of `block` (layout: `_shared_layout`'s), made
    by `mok.kernels.launch` where a launch needs Gluon's object."""
    layout = _shared_layout(tuple(block), tensor.dtype)
    return DeferredDescriptor(TensorDescriptor, tensor, block, layout)


@functools.cache
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def available(device: torch.device) -> bool:
    """Whether the warp-specialized kernels run on `device`: a Hopper GPU, with a Triton whose
    Gluon they are tested with, unless MOK_WARP_SPECIALIZED says otherwise (`gluon_support`: 0
    runs the tl kernels everywhere, to compare the two or as a fallback)."""
    return device.type == "cuda" and _is_hopper(device) and gluon_support.enabled()


def _expert_rows(w: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """Weights [E, R, C] (R x C per expert: N x K, or K x N where the data gradients read them
    along K) as the kernels read them: one 2-D view of rows of C elements, evenly spaced, expert
    e's R rows starting at row e * per_expert, and per_expert; None where W is not so laid out or
    TMA cannot read it (16-byte aligned rows and row starts). Contiguous experts give [E * R, C]
    and R. Views of a fused tensor (gate and up as the halves of a [E, 2I, H] gate_up_proj, as
    Hugging Face models hold them) give (E - 1) * 2I + I rows and 2I, the other half's rows
    between two experts' (a tile that reaches past an expert's rows reads them, for columns that
    are never stored). gpt-oss's interleaved gate and up (every other row of [E, 2I, H]) give
    rows 2H elements apart, E * I of them, and I."""
    experts, rows, columns = w.shape
    stride, row_stride = w.stride(0), w.stride(1)
    if experts == 0 or w.stride(2) != 1 or row_stride < columns or stride % row_stride:
        return None
    size = w.element_size()
    if stride < rows * row_stride or (columns * size) % 16 or (row_stride * size) % 16:
        return None
    if w.data_ptr() % 16:
        return None
    per_expert = stride // row_stride
    view = w.as_strided(((experts - 1) * per_expert + rows, columns), (row_stride, 1))
    return view, per_expert


def _weight_rows(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`_expert_rows`, or ValueError naming the weight's layout where the kernels cannot read it
    (`supported` says so before a launch; this is for direct callers)."""
    view = _expert_rows(w)
    if view is None:
        raise ValueError(
            f"weights of shape {tuple(w.shape)}, strides {w.stride()}: the kernels read them as "
            "rows of one 2-D view (unit last stride, rows adjacent within an expert, 16-byte "
            "aligned); see warp_specialized.supported"
        )
    return view


def supported(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the kernels here take these operands: 16-bit, on a Hopper GPU, the weights of one
    launch (W, and W2 where it has one) each [E, N, K] with its rows in one 2-D view
    (`_expert_rows`: contiguous experts, or the halves of a fused tensor), 16-byte aligned for
    TMA, with the same distance between experts' first rows (one launch argument)."""
    views = [_expert_rows(w) for w in weights]
    return (
        available(rows.device)
        and rows.dtype in _GLUON_DTYPES
        and None not in views
        and len({per_expert for _, per_expert in views}) == 1
    )


def dgrad_supported(rows: torch.Tensor, cfg: GemmTiles, *weights: torch.Tensor) -> bool:
    """Whether the data-gradient kernels take these operands: `supported`, every weight's
    reduction dimension (dim 1 of [E, K, N]) a multiple of cfg.block_k, so that a step never
    reaches into the next expert's weights, and rows of N elements 16-byte aligned for TMA."""
    return supported(rows, *weights) and all(
        w.shape[1] % cfg.block_k == 0 and (w.shape[2] * w.element_size()) % 16 == 0 for w in weights
    )


@dataclasses.dataclass(frozen=True)
class DgradTiles:
    """Tiles of the two data-gradient kernels."""

    gate_up: GemmTiles
    """grad_x = grad_gate @ W_gate[e] + grad_up @ W_up[e] (`gate_up_dgrad`)."""
    down: GemmTiles
    """The gate | up gradients through W_down and the SwiGLU backward (`down_dgrad_swiglu`)."""


DGRAD_TILES = DgradTiles(gate_up=COOPERATIVE, down=DGRAD_SWIGLU_COOPERATIVE)
"""Cooperative 128-row tiles, for groups averaging 192 rows or more: the two consumers share each
weight tile (half the weight traffic per row), which there beats ping-pong's overlap of epilogues
(measured: benchmarks/results/2026-12-01-issue12-all-products-h200.md)."""
SHORT_DGRAD_TILES = DgradTiles(gate_up=PING_PONG, down=DGRAD_SWIGLU_PING_PONG)
"""Ping-pong 64-row tiles, for groups averaging under 192 rows (kimi-k2 at EP 1: ~170), where a
128-row tile leaves a third of its rows idle (measured:
benchmarks/results/2026-12-01-issue12-all-products-h200.md)."""


@dataclasses.dataclass(frozen=True)
class _RowsProblem:
    """The operands of one `_row_tiles_kernel` launch (unused descriptors repeat another)."""

    mode: int
    a: torch.Tensor  # [M, K]
    w: torch.Tensor  # [E, N, K], or [E, K, N] when read along K
    out: torch.Tensor  # [M, N], or the [M, 2N] gate | up gradients (DOWN_DGRAD_SWIGLU)
    a2: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None  # [M, 2N] saved pre-activations: out, or in (dgrad)
    swiglu_limit: float | None = None
    source_rows: torch.Tensor | None = None  # [M] int32: A is [S, K], read through this index
    scatter: RowScatter | None = None  # DOWN: out's rows to the ranks' buffers instead
    ready: RowsReady | None = None  # the A rows land while the product runs
    activation: Activation = SWIGLU  # GATE_UP_SWIGLU, DOWN_DGRAD_SWIGLU
    bias: torch.Tensor | None = None  # [E, N]: DOWN's outputs' bias, GATE_UP_SWIGLU's gate's
    bias2: torch.Tensor | None = None  # [E, N]: GATE_UP_SWIGLU's up's bias
    weighting: tuple[torch.Tensor, torch.Tensor] | None = None  # DOWN_DGRAD_SWIGLU: h, row weights
    descales: tuple[torch.Tensor, ...] | None = None  # FP8 A, W and W2 (W's again): theirs, fp32

    @property
    def w_by_k(self) -> bool:
        """Whether W is [E, K, N], read along K (`_reads_w_by_k`), else [E, N, K]."""
        return self.mode >= GATE_UP_DGRAD.value and self.descales is None


def _consumer_split(block_m: int) -> int:
    """Consumers per tile of block_m rows: 1 for CONSUMER_ROWS (ping-pong), 2 for twice that
    (cooperative, or the weight gradients' shared tiles); other sizes raise ValueError."""
    if block_m not in (CONSUMER_ROWS, CONSUMERS.value * CONSUMER_ROWS):
        raise ValueError(
            f"tiles of {block_m} rows: {CONSUMER_ROWS} (ping-pong) or "
            f"{CONSUMERS.value * CONSUMER_ROWS} (both consumers on each tile)"
        )
    return block_m // CONSUMER_ROWS


def _descriptors(problem: _RowsProblem, cfg: GemmTiles, n: int) -> tuple:
    """The nine TMA descriptors of a launch, in the kernel's order (those the mode does not use
    repeat one it does: each is built once, host time), then the tensor holding the gate | up
    halves (the saved pre-activations out, or the gradients of DOWN_DGRAD_SWIGLU; None where the
    launch stores neither) and the distance between the weights' experts in rows; ValueError
    where the two weights' distances differ."""
    mode, a, w = problem.mode, problem.a, problem.w
    bm, bn, bk = CONSUMER_ROWS, cfg.block_n, cfg.block_k
    w_block = [bk, bn] if problem.w_by_k else [bn, bk]
    w_rows, w_expert_rows = _weight_rows(w)
    w2_desc = w_desc = _descriptor(w_rows, w_block)
    if problem.w2 is not None:
        w2_rows, w2_expert_rows = _weight_rows(problem.w2)
        if w2_expert_rows != w_expert_rows:
            raise ValueError(
                f"the two weights' experts are {w_expert_rows} and {w2_expert_rows} rows apart: "
                "one launch takes one distance"
            )
        w2_desc = _descriptor(w2_rows, w_block)
    a_desc = _descriptor(a, [bm, bk])
    a2_desc = a_desc if problem.a2 is None else _descriptor(problem.a2, [bm, bk])
    out = problem.out
    if mode == DOWN_DGRAD_SWIGLU.value:
        gate_up = out  # the gradients' gate | up halves; the saved ones come in
        gate_desc = out_desc = _descriptor(out[:, :n], [bm, bn])
        up_desc = _descriptor(out[:, n:], [bm, bn])
        saved_gate = _descriptor(problem.gate_up[:, :n], [bm, bn])
        saved_up = _descriptor(problem.gate_up[:, n:], [bm, bn])
    else:
        out_desc = gate_desc = up_desc = saved_gate = saved_up = _descriptor(out, [bm, bn])
        gate_up = problem.gate_up  # GATE_UP_SWIGLU: the pre-activations go out
        if gate_up is not None:
            gate_desc = _descriptor(gate_up[:, :n], [bm, bn])
            up_desc = _descriptor(gate_up[:, n:], [bm, bn])
    descriptors = (
        a_desc, a2_desc, w_desc, w2_desc, out_desc, gate_desc, up_desc, saved_gate, saved_up
    )  # fmt: skip
    return descriptors, gate_up, w_expert_rows


def _check_options(problem: _RowsProblem, cfg: GemmTiles, m: int, n: int) -> None:
    """Raise ValueError where the launch's options do not fit its operands: gathered rows not in
    16-byte pieces, readiness flags or a scatter target too small, claims in GATE_UP_DGRAD,
    expert biases of another shape or count."""
    mode, a = problem.mode, problem.a
    k = a.shape[1]
    if problem.source_rows is not None and (
        k * a.element_size() % 16 or a.stride(0) * a.element_size() % 16
    ):
        raise ValueError(
            f"gathered rows of {k} columns, row stride {a.stride(0)}: both must be multiples "
            "of 16 bytes (cp.async copies 16-byte pieces)"
        )
    scatter, ready = problem.scatter, problem.ready
    if ready is not None:
        ready.check(m)
    if scatter is not None:
        scatter.check(m, n)
        if n % 8 or scatter.out.data_ptr() % 16:
            raise ValueError("RowScatter: rows of 16-byte multiples, out 16-byte aligned")
    if cfg.claims is not None and mode == GATE_UP_DGRAD.value:
        raise ValueError("TileClaims: GATE_UP_DGRAD's zeros take their tasks by the static stride")
    biases = [b for b in (problem.bias, problem.bias2) if b is not None]
    for bias in biases:
        if bias.shape != (problem.w.shape[0], n) or bias.dtype != problem.out.dtype:
            raise ValueError(
                f"expert bias of shape {tuple(bias.shape)} {bias.dtype}: expected "
                f"[{problem.w.shape[0]}, {n}] {problem.out.dtype}"
            )
    if len(biases) != (0 if problem.bias is None else 1 + (mode == GATE_UP_SWIGLU.value)):
        raise ValueError("expert biases: one for DOWN, gate's and up's for GATE_UP_SWIGLU")


def _launch(problem: _RowsProblem, tiles: RowTiles, cfg: GemmTiles) -> torch.Tensor | None:
    """Launch `_row_tiles_kernel` on `problem` (its tiles and config checked first); returns the
    router weights' partial dots [M, column tiles] fp32 with `problem.weighting`, else None."""
    mode, a, w = problem.mode, problem.a, problem.w
    k = a.shape[1]
    n = w.shape[2] if problem.w_by_k else w.shape[1]
    if tiles.block_m != cfg.block_m:
        raise ValueError(f"row tiles of {tiles.block_m} rows for a kernel of {cfg.block_m}")
    split = _consumer_split(cfg.block_m)
    if problem.weighting is not None:
        cfg = _with_epilogue_buffers(cfg, 3)
    bm, bn = CONSUMER_ROWS, cfg.block_n
    descriptors, gate_up, w_expert_rows = _descriptors(problem, cfg, n)
    out = problem.out
    limit = problem.swiglu_limit
    m = gathered_rows(a, problem.source_rows)
    scatter, ready = problem.scatter, problem.ready
    _check_options(problem, cfg, m, n)
    activation = problem.activation
    clamp = None if limit is None else float(limit)
    edges = limit_edges(limit, out.dtype)
    epilogue = (
        out,
        gate_up,
        (clamp, *edges, float(activation.alpha), float(activation.up_offset)),
        contiguous_biases((problem.bias, problem.bias2)),
    )
    problem_args = (tiles.table, tiles.counts, n, k, w_expert_rows)
    ready_fields = None if ready is None else ready.args()
    scatter_fields = None if scatter is None else scatter.args()
    dots = weighting_args = descales = None
    if problem.descales is not None:
        a_descales, w_descales, _ = problem.descales
        descales = (*problem.descales, a_descales.shape[1], w_descales.shape[1])
    h_desc = descriptors[7]  # a descriptor of the launch's, never read
    if problem.weighting is not None:
        h, row_weights = problem.weighting
        dots = torch.zeros(m, triton.cdiv(n, bn), dtype=torch.float32, device=h.device)
        h_desc = _descriptor(h, [bm, bn])
        weighting_args = (h, row_weights, dots, dots.shape[1])

    def launch(programs: int, counter: torch.Tensor | None) -> None:
        _row_tiles_kernel[(programs,)](
            *descriptors,
            h_desc,
            tiles.capacity,
            m,
            problem_args,
            epilogue,
            gather_source(a, problem.source_rows),
            ready_fields,
            scatter_fields,
            counter,
            weighting_args,
            descales,
            MODE=mode,
            PLAIN=activation.plain,
            TILING=(cfg.num_stages, split, cfg.group_m, programs if counter is None else 1),
            READY_FLAGS=ready_flags(ready, cfg.block_m),
            SCATTER_RANKS=scatter.ep_block if scatter else 0,
            num_warps=cfg.num_warps,
            maxnreg=MAX_REGISTERS,
        )

    programs = num_programs(a.device, tiles.capacity * triton.cdiv(n, bn), cfg)
    launch_persistent(launch, programs, cfg.claims)
    return dots


def down(
    rows: torch.Tensor,
    weights: torch.Tensor,
    tiles: RowTiles,
    cfg: GemmTiles = PING_PONG,
    out: torch.Tensor | None = None,
    source_rows: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [M, N] = rows[group e] @ weights[e].T (rows [M, K], weights [E, N, K], `supported`),
    plus bias[e] (bias [E, N], the rows' dtype, added in fp32) where given; rows outside the
    groups are left unwritten. The result of `grouped_gemm.down`. With `source_rows` [M] int32,
    grouped row r is rows[source_rows[r]] (rows [S, K], read in place)."""
    m = gathered_rows(rows, source_rows)
    if out is None:
        out = torch.empty(m, weights.shape[1], dtype=rows.dtype, device=rows.device)
    out = out[:m]
    if m:
        problem = _RowsProblem(DOWN.value, rows, weights, out, source_rows=source_rows, bias=bias)
        _launch(problem, tiles, cfg)
    return out


def down_scatter(
    rows: torch.Tensor,
    weights: torch.Tensor,
    tiles: RowTiles,
    scatter: RowScatter,
    cfg: GemmTiles = PING_PONG,
    source_rows: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """`down`'s rows (with its `bias`) stored by the peer-store epilogue instead: grouped row
    r to row scatter.dest_row[r] of rank scatter.dest_rank[r]'s buffer, then one release add per
    destination rank and tile to that rank's count of this rank. The result of
    `grouped_gemm.down_scatter` (the same values and counts)."""
    m = gathered_rows(rows, source_rows)
    if m:
        problem = _RowsProblem(
            DOWN.value,
            rows,
            weights,
            scatter.out,
            source_rows=source_rows,
            scatter=scatter,
            bias=bias,
        )
        _launch(problem, tiles, cfg)
    else:
        scatter.check(m, weights.shape[1])


def gate_up_swiglu(
    rows: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    tiles: RowTiles,
    swiglu_limit: float | None,
    save_preact: bool,
    cfg: GemmTiles = SWIGLU_PING_PONG,
    source_rows: torch.Tensor | None = None,
    ready: RowsReady | None = None,
    activation: Activation = SWIGLU,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [M, I] = act(rows @ W_gate[e].T, rows @ W_up[e].T) per group (`activation`: SwiGLU or
    gpt-oss's; `biases` (gate, up [E, I], the rows' dtype) added in fp32 first), and when
    `save_preact` the pre-activations gate | up [M, 2I] as `grouped_gemm.saved_preactivations`
    saves them: the results of `grouped_gemm.gate_up_swiglu`. Rows outside the groups are left
    unwritten. With `source_rows` [M] int32, grouped row r is rows[source_rows[r]] (rows [S, H],
    read in place). With `ready`, a tile reads its rows only once their flags say they landed
    (`RowsReady`)."""
    m = gathered_rows(rows, source_rows)
    inter = w_gate.shape[1]
    h = torch.empty(m, inter, dtype=rows.dtype, device=rows.device)
    gate_up = (
        torch.empty(m, 2 * inter, dtype=rows.dtype, device=rows.device) if save_preact else None
    )
    if m:
        problem = _RowsProblem(
            GATE_UP_SWIGLU.value,
            rows,
            w_gate,
            h,
            w2=w_up,
            gate_up=gate_up,
            swiglu_limit=swiglu_limit,
            source_rows=source_rows,
            ready=ready,
            activation=activation,
            bias=None if biases is None else biases[0],
            bias2=None if biases is None else biases[1],
        )
        _launch(problem, tiles, cfg)
    return h, gate_up


def gate_up_dgrad(
    grad_gate_up: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    tiles: RowTiles,
    cfg: GemmTiles = PING_PONG,
) -> torch.Tensor:
    """grad_x [M, H] = grad_gate @ W_gate[e] + grad_up @ W_up[e] per group (grad_gate_up [M, 2I],
    `dgrad_supported` weights [E, I, H]), zero outside the groups: the result of
    `grouped_gemm.gate_up_dgrad` with the same BLOCK_K (the two products alternate step by
    step)."""
    m = grad_gate_up.shape[0]
    inter, hidden = w_gate.shape[1], w_gate.shape[2]
    grad_x = torch.empty(m, hidden, dtype=grad_gate_up.dtype, device=grad_gate_up.device)
    if m:
        problem = _RowsProblem(
            GATE_UP_DGRAD.value,
            grad_gate_up[:, :inter],
            w_gate,
            grad_x,
            a2=grad_gate_up[:, inter:],
            w2=w_up,
        )
        _launch(problem, tiles, cfg)
    return grad_x


SHARED_MEMORY_BYTES = 227 * 1024 - 1024
"""What one program's buffers may take of an H200 SM's shared memory: the rest is barriers."""


def _with_epilogue_buffers(cfg: GemmTiles, per_consumer: int) -> GemmTiles:
    """cfg with as many ring slots as fit beside `per_consumer` epilogue buffers of a consumer's
    tile, each consumer's (at most cfg's slots): the weighted down dgrad fetches h beside the
    saved pre-activations."""
    size = 2  # bytes of a 16-bit element
    slot = (cfg.block_m * cfg.block_k + cfg.block_k * cfg.block_n) * size
    epilogue = CONSUMERS.value * per_consumer * CONSUMER_ROWS * cfg.block_n * size
    stages = min(cfg.num_stages, (SHARED_MEMORY_BYTES - epilogue) // slot)
    return dataclasses.replace(cfg, num_stages=stages)


def down_dgrad_swiglu(
    grad_out: torch.Tensor,
    w_down: torch.Tensor,
    gate_up: torch.Tensor,
    tiles: RowTiles,
    swiglu_limit: float | None,
    cfg: GemmTiles = DGRAD_SWIGLU_PING_PONG,
    ready: RowsReady | None = None,
    activation: Activation = SWIGLU,
) -> torch.Tensor:
    """Gradients of the pre-activations gate | up [M, 2I] from grad_out [M, H] through W_down
    ([E, H, I], `dgrad_supported`) and the activation's backward (SwiGLU or gpt-oss's) on the
    saved gate | up [M, 2I]; rows outside the groups unwritten. The result of
    `grouped_gemm.down_dgrad_swiglu`. With `ready`, a tile reads its grad_out rows only once
    their flags say they landed (`RowsReady`)."""
    grad_gate_up, _ = _down_dgrad_swiglu(
        grad_out, w_down, gate_up, tiles, swiglu_limit, cfg, ready, activation, None
    )
    return grad_gate_up


def down_dgrad_swiglu_weighted(
    grad_out: torch.Tensor,
    w_down: torch.Tensor,
    gate_up: torch.Tensor,
    h: torch.Tensor,
    row_weights: torch.Tensor,
    tiles: RowTiles,
    swiglu_limit: float | None,
    cfg: GemmTiles = DGRAD_SWIGLU_PING_PONG,
    ready: RowsReady | None = None,
    activation: Activation = SWIGLU,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`grouped_gemm.down_dgrad_swiglu_weighted` (same contract; the gradients and h bitwise the
    same, the dots to fp32 summation order): grad_out's rows unweighted, each row's router weight
    applied after the product, the router weights' dots [M] returned, h overwritten by
    round(w * h)."""
    m, inter = grad_out.shape[0], w_down.shape[2]
    check_weighting(grad_out, h, row_weights, inter)
    if m == 0:
        return grad_out.new_empty(0, 2 * inter), row_weights.new_zeros(0)
    return _down_dgrad_swiglu(
        grad_out, w_down, gate_up, tiles, swiglu_limit, cfg, ready, activation, (h, row_weights)
    )


def _down_dgrad_swiglu(
    grad_out, w_down, gate_up, tiles: RowTiles, swiglu_limit, cfg: GemmTiles, ready, activation,
    weighting: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    m = grad_out.shape[0]
    inter = w_down.shape[2]
    grad_gate_up = torch.empty(m, 2 * inter, dtype=grad_out.dtype, device=grad_out.device)
    if not m:
        return grad_gate_up, None
    problem = _RowsProblem(
        DOWN_DGRAD_SWIGLU.value,
        grad_out,
        w_down,
        grad_gate_up,
        gate_up=gate_up,
        swiglu_limit=swiglu_limit,
        ready=ready,
        activation=activation,
        weighting=weighting,
    )
    dots = _launch(problem, tiles, cfg)
    return grad_gate_up, None if dots is None else dots.sum(1)


BLOCK_SCALED_TILES = GemmTiles(
    block_m=64, block_n=128, block_k=FP8_BLOCK, num_warps=4, num_stages=6, group_m=8
)
"""Ping-pong tiles of the block-scaled FP8 product: a step is one scale block of K (128 e4m3
elements, one 128-byte row of a tile); 128 columns hold a consumer's accumulator and its step's
partial tile in 64 registers each."""


def block_scaled_supported(a_values: torch.Tensor, w_values: torch.Tensor) -> bool:
    """Whether `block_scaled_grouped_mm` takes these operands: e4m3 A [M, K] and W [E, N, K] on a
    Hopper GPU, K a multiple of 16 (TMA's 16-byte rows), W's rows in one 2-D view
    (`_expert_rows`)."""
    return (
        available(a_values.device)
        and a_values.dtype == w_values.dtype == torch.float8_e4m3fn
        and a_values.shape[1] % 16 == 0
        and _expert_rows(w_values) is not None
    )


BLOCK_SCALED_SWIGLU_TILES = dataclasses.replace(BLOCK_SCALED_TILES, block_n=64)
"""Tiles of the block-scaled gate/up product: 64 columns, so that a consumer's two accumulators
and the step's two partial tiles take 32 registers each."""


def _descales(a_descales, w_descales, w2_descales=None) -> tuple:
    """`_RowsProblem.descales` of a block-scaled launch: A's, W's and W2's (W's again for one
    weight), contiguous."""
    w_descales = w_descales.contiguous()
    w2_descales = w_descales if w2_descales is None else w2_descales.contiguous()
    return a_descales.contiguous(), w_descales, w2_descales


def _block_scaled_operands(a_values, a_descales, weight_casts, group_offsets, cfg) -> tuple:
    """(M, N) of a block-scaled product of A's cast and the weights' block casts ((values,
    descales) each, of one shape), or ValueError naming what does not fit."""
    for values, descales in weight_casts:
        m, n, _ = check_block_scaled_operands(a_values, a_descales, values, descales, group_offsets)
    if cfg.block_k != FP8_BLOCK:
        raise ValueError(f"a step of the recipe is one scale block: block_k {FP8_BLOCK}")
    if not all(block_scaled_supported(a_values, values) for values, _ in weight_casts):
        raise ValueError(
            f"A {tuple(a_values.shape)} and W {tuple(weight_casts[0][0].shape)}: the FP8 kernel "
            "takes e4m3 operands on a Hopper GPU with K a multiple of 16 "
            "(`block_scaled_supported`); use fp8_block.block_scaled_grouped_mm"
        )
    return m, n


def block_scaled_grouped_mm(
    a_values: torch.Tensor,
    a_descales: torch.Tensor,
    w_values: torch.Tensor,
    w_descales: torch.Tensor,
    group_offsets: torch.Tensor,
    tiles: RowTiles,
    out_dtype: torch.dtype = torch.bfloat16,
    cfg: GemmTiles = BLOCK_SCALED_TILES,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fp8_block.block_scaled_grouped_mm` (same operands and contract) on the FP8 tensor cores
    (`block_scaled_supported` operands; tiles: `row_tile_map` of the groups for cfg.block_m): each
    step's 128 products are summed by the tensor cores, whose FP8 sums keep fewer bits than fp32,
    then scaled and accumulated in fp32 (`_block_scaled_step`), so the result is the tl kernel's
    up to that rounding of each step's partial sums. bias: [E, N] of out_dtype, each expert's
    added to its rows in fp32 before the rounding. out: where the result goes ([M, N] of
    out_dtype, rows TMA can store: a unit last stride, 16-byte aligned), else a new tensor."""
    cast = (w_values, w_descales)
    m, n = _block_scaled_operands(a_values, a_descales, [cast], group_offsets, cfg)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a_values.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or out.stride(1) != 1:
        raise ValueError(f"out: [{m}, {n}] {out_dtype} with a unit last stride")
    if m and n:
        descales = _descales(a_descales, w_descales)
        problem = _RowsProblem(DOWN.value, a_values, w_values, out, bias=bias, descales=descales)
        _launch(problem, tiles, cfg)
    return out


def block_scaled_gate_up_swiglu(
    a_values: torch.Tensor,
    a_descales: torch.Tensor,
    gate_cast: tuple[torch.Tensor, torch.Tensor],
    up_cast: tuple[torch.Tensor, torch.Tensor],
    group_offsets: torch.Tensor,
    tiles: RowTiles,
    swiglu_limit: float | None,
    save_preact: bool,
    out_dtype: torch.dtype = torch.bfloat16,
    cfg: GemmTiles = BLOCK_SCALED_SWIGLU_TILES,
    activation: Activation = SWIGLU,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [M, I] of out_dtype = act(A @ W_gate[e].T (+ b_gate[e]), A @ W_up[e].T (+ b_up[e])) per
    group in the 128-block recipe, one pass over A's tiles: A's cast (a_values [M, H] e4m3,
    a_descales [M, S] fp32) times the weights' block casts (gate_cast, up_cast: values [E, I, H]
    e4m3, descales [E, cdiv(I, 128), S] fp32), each step summed by the FP8 tensor cores as in
    `block_scaled_grouped_mm`; the biases ([E, I], out_dtype) and `activation` in fp32 on the
    accumulators, h rounded once. With save_preact also the pre-activations gate | up [M, 2I] as
    `grouped_gemm.saved_preactivations` keeps them. Rows outside the groups are left
    unwritten."""
    casts = [gate_cast, up_cast]
    m, n = _block_scaled_operands(a_values, a_descales, casts, group_offsets, cfg)
    device = a_values.device
    h = torch.empty(m, n, dtype=out_dtype, device=device)
    gate_up = torch.empty(m, 2 * n, dtype=out_dtype, device=device) if save_preact else None
    if m and n:
        problem = _RowsProblem(
            GATE_UP_SWIGLU.value,
            a_values,
            gate_cast[0],
            h,
            w2=up_cast[0],
            gate_up=gate_up,
            swiglu_limit=swiglu_limit,
            activation=activation,
            bias=None if biases is None else biases[0],
            bias2=None if biases is None else biases[1],
            descales=_descales(a_descales, gate_cast[1], up_cast[1]),
        )
        _launch(problem, tiles, cfg)
    return h, gate_up


def block_scaled_down_dgrad_swiglu(
    a_values: torch.Tensor,
    a_descales: torch.Tensor,
    down_transposed: tuple[torch.Tensor, torch.Tensor],
    group_offsets: torch.Tensor,
    tiles: RowTiles,
    gate_up: torch.Tensor,
    swiglu_limit: float | None,
    activation: Activation = SWIGLU,
    cfg: GemmTiles = BLOCK_SCALED_TILES,
) -> torch.Tensor:
    """Gradients of the pre-activations gate | up [M, 2I] (gate_up's dtype) in the 128-block
    recipe: grad_h = grad_out's cast (a_values [M, H] e4m3, a_descales [M, S] fp32) times
    W_down's transposed block cast (down_transposed: values [E, I, H] e4m3, descales [E,
    cdiv(I, 128), S] fp32) on the FP8 tensor cores as `block_scaled_grouped_mm` forms it,
    rounded to gate_up's dtype (h was rounded so in the forward), then the activation's backward
    on the saved gate | up [M, 2I], in the epilogue of `down_dgrad_swiglu`. Rows outside the
    groups unwritten."""
    m, inter = _block_scaled_operands(a_values, a_descales, [down_transposed], group_offsets, cfg)
    if gate_up.shape != (m, 2 * inter):
        raise ValueError(f"gate_up: [{m}, {2 * inter}], got {tuple(gate_up.shape)}")
    grad_gate_up = torch.empty(m, 2 * inter, dtype=gate_up.dtype, device=gate_up.device)
    if m and inter:
        problem = _RowsProblem(
            DOWN_DGRAD_SWIGLU.value,
            a_values,
            down_transposed[0],
            grad_gate_up,
            gate_up=gate_up,
            swiglu_limit=swiglu_limit,
            activation=activation,
            descales=_descales(a_descales, down_transposed[1]),
        )
        _launch(problem, tiles, cfg)
    return grad_gate_up


# --------------------------------------------------------------------------------------------------
# Weight gradients: out[e] (+)= A[rows of group e].T @ B[rows of group e]
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WgradTiles:
    """Tiles of one consumer warpgroup of the weight-gradient kernel, by the gradient's dtype:
    an fp32 gradient's epilogue buffers take twice the shared memory."""

    half: GemmTiles
    """For bf16 or fp16 gradients."""
    single: GemmTiles
    """For fp32 gradients (main-gradient buffers)."""

    def for_grad(self, dtype: torch.dtype) -> GemmTiles:
        return self.single if dtype == torch.float32 else self.half


WGRAD_TILES = WgradTiles(
    half=GemmTiles(block_m=128, block_n=256, block_k=64, num_warps=4, num_stages=3),
    single=GemmTiles(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4),
)
"""Shared 128-row tiles: 128 x 256 with 3 slots of 48 KiB and two 32 KiB epilogue buffers (208
KiB) for 16-bit gradients; 128 x 128 with 4 slots of 32 KiB and two 32 KiB fp32 buffers (192 KiB)
for fp32 ones, which do not fit the larger tile. Every tile re-reads its group's rows from L2 (a
reduction over only its expert's rows, ~170-512 at the presets' shapes at EP 1), so the tile's
size, not the overlap of epilogues, sets the speed: these tiles beat 64-row ping-pong tiles and
the tl kernels at every preset (measured: benchmarks/results/2026-12-01-issue12-wgrad.md,
2026-12-01-issue12-all-products-h200.md)."""


@gluon.jit
def _wgrad_task(task, per_half, m_tiles, n_tiles, HALVES: gl.constexpr, GROUP_M: gl.constexpr):
    """(expert, half, m, n) of a weight-gradient task: expert by expert, each expert's halves in
    order (gate, then up), GROUP_M tile rows at a time within a half."""
    half_index = task // per_half
    m_idx, n_idx = _grouped_task(task % per_half, m_tiles, n_tiles, GROUP_M)
    return half_index // HALVES, half_index % HALVES, m_idx, n_idx


@gluon.jit
def _group_rows(offsets_ptr, expert):
    """(first row, row count) of an expert's group."""
    first = gl.load(offsets_ptr + expert)
    return first, gl.maximum(gl.load(offsets_ptr + expert + 1) - first, 0)


@gluon.jit
def _group_descriptors(
    a_ptr, b_ptr, first, rows, half, P, Q, a_stride, a_bufs, b_bufs, GATHER: gl.constexpr
):
    """Descriptors of a group's A columns of one half and of its B rows, whose row extent ends at
    the group's end: TMA zero-fills the last step's rows past it, as in the tl twin. GATHER: B's
    rows are gathered (`_copy_step`), and A's descriptor stands in for B's, never read."""
    BLOCK_K: gl.constexpr = a_bufs.shape[1]
    start = first.to(gl.int64)
    a_desc = tma.make_tensor_descriptor(
        a_ptr + start * a_stride + half * P,
        [gl.maximum(rows, 1), P],
        [a_stride, 1],
        [BLOCK_K, a_bufs.shape[2]],
        a_bufs.layout,
    )
    if GATHER:
        b_desc = a_desc
    else:
        b_desc = tma.make_tensor_descriptor(
            b_ptr + start * Q,
            [gl.maximum(rows, 1), Q],
            [Q, 1],
            [BLOCK_K, b_bufs.shape[2]],
            b_bufs.layout,
        )
    return a_desc, b_desc


@gluon.jit
def _wait_landed(ready, last, step, STAGES: gl.constexpr):
    """Wait until the copies of ring step `last` have landed, unless the ring has moved on by a
    full turn since (the loader then already waited for that slot to be released, after its
    consumer saw the copies land). Only then is `last` the slot's latest phase, which parity
    names safely."""
    if step - last < STAGES:
        mbarrier.wait(ready.index(last % STAGES), last // STAGES & 1)


@gluon.jit
def _copy_step(
    a_desc,
    b_desc,
    k,
    m_off,
    n_off,
    bar,
    a_bufs,
    b_bufs,
    slot,
    SPLIT: gl.constexpr,
    gather,
    GATHER: gl.constexpr,
):
    """One reduction step's copies: the A tile in SPLIT parts (one per consumer when the two
    share a tile), then the B tile: by TMA, or with GATHER the group's rows first + k.. read
    through the index by cp.async (gather: `_gather_rows`'s source, whose row count is the
    group's end, and the index of the step's rows, `_step_index`), zeros past the group's end
    (`_gather_step`)."""
    BLOCK_K: gl.constexpr = a_bufs.shape[1]
    WG_M: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.shape[2]
    BYTES: gl.constexpr = a_bufs.dtype.primitive_bitwidth // 8
    b_buf = b_bufs.index(slot)
    if GATHER:
        source, index = gather
        _gather_step(source, index, n_off, b_buf)
        # Each thread's arrival (counted now, made when its copies landed) comes before the
        # expect below, so the slot cannot complete before the rows did.
        async_copy.mbarrier_arrive(bar)
        mbarrier.expect(bar, SPLIT * WG_M * BLOCK_K * BYTES)
    else:
        mbarrier.expect(bar, (SPLIT * WG_M + BLOCK_N) * BLOCK_K * BYTES)
    for part in gl.static_range(SPLIT):
        a_buf = a_bufs.index(slot * SPLIT + part)
        _tma_load(a_desc, [k, m_off + part * WG_M], bar, a_buf)
    if not GATHER:
        _tma_load(b_desc, [k, n_off], bar, b_buf)


@gluon.jit
def _next_group_descriptors(
    operands, sets, changes, last_steps, step, first, rows, half, P, Q, a_stride,
    GATHER: gl.constexpr,
):  # fmt: skip
    """The two descriptor sets (a_even, b_even, a_odd, b_odd) with the one due at this change
    (even, then odd, alternately) remade for the group's rows [first, first + rows) and `half`,
    once that set's last copies (at ring step `last_steps[0]` or `[1]`) have landed."""
    a_ptr, b_ptr, a_bufs, b_bufs, ready = (
        operands[0],
        operands[1],
        operands[2],
        operands[3],
        operands[4],
    )
    a_even, b_even, a_odd, b_odd = sets
    STAGES: gl.constexpr = b_bufs.shape[0]
    if changes % 2 == 0:
        _wait_landed(ready, last_steps[0], step, STAGES)
        a_even, b_even = _group_descriptors(
            a_ptr, b_ptr, first, rows, half, P, Q, a_stride, a_bufs, b_bufs, GATHER
        )
    else:
        _wait_landed(ready, last_steps[1], step, STAGES)
        a_odd, b_odd = _group_descriptors(
            a_ptr, b_ptr, first, rows, half, P, Q, a_stride, a_bufs, b_bufs, GATHER
        )
    return a_even, b_even, a_odd, b_odd


@gluon.jit
def _copy_step_of_set(
    descriptors, even, k, m_off, n_off, bar, a_bufs, b_bufs, slot, SPLIT: gl.constexpr, gather,
    GATHER: gl.constexpr,
):  # fmt: skip
    """`_copy_step` with the descriptors of the set in use: descriptors = (A, B of the even set,
    A, B of the odd set), even: whether the even set is in use (`_wgrad_load_partition`)."""
    a_even, b_even, a_odd, b_odd = descriptors
    if even:
        _copy_step(
            a_even, b_even, k, m_off, n_off, bar, a_bufs, b_bufs, slot, SPLIT, gather, GATHER
        )
    else:
        _copy_step(a_odd, b_odd, k, m_off, n_off, bar, a_bufs, b_bufs, slot, SPLIT, gather, GATHER)


@gluon.jit
def _wgrad_load_partition(operands, problem, CLAIM: gl.constexpr, GATHER: gl.constexpr):
    """Loader: the A and B tiles of every reduction step of this program's tasks, in order
    (CLAIM: tasks it claims and hands to the consumers, `_publish_task`).

    The reduction runs over a group's rows, read through descriptors made on the device
    (`_group_descriptors`) whenever the expert or half changes. The copy engine reads a
    descriptor from global memory, so one must not be rewritten while copies issued with it are
    in flight: two sets alternate, and a set is rewritten only once its last copies have landed
    (`_wait_landed`, which rarely has to wait: the other set's steps ran in between)."""
    (a_ptr, b_ptr, a_bufs, b_bufs, ready, empty, turns, fetched, b_gather) = operands
    (
        offsets_ptr,
        num_tasks,
        per_half,
        m_tiles,
        n_tiles,
        P,
        Q,
        a_stride,
        HALVES,
        GROUP_M,
        NUM_PROGRAMS,
        claims,
    ) = problem
    STAGES: gl.constexpr = b_bufs.shape[0]
    SPLIT: gl.constexpr = a_bufs.shape[0] // STAGES
    BLOCK_K: gl.constexpr = a_bufs.shape[1]
    BLOCK_M: gl.constexpr = SPLIT * a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.shape[2]
    step = 0
    cached = -1
    changes = 0
    last_even = -STAGES  # the last ring step issued with the even set of descriptors
    last_odd = -STAGES
    zero = gl.to_tensor(0)
    a_even, b_even = _group_descriptors(
        a_ptr, b_ptr, zero, zero, 0, P, Q, a_stride, a_bufs, b_bufs, GATHER
    )
    a_odd, b_odd = _group_descriptors(
        a_ptr, b_ptr, zero, zero, 0, P, Q, a_stride, a_bufs, b_bufs, GATHER
    )
    nth = 0
    task = _loader_first_task(claims, CLAIM)
    while task < num_tasks:
        if CLAIM:
            _publish_task(claims, nth, task)
        expert, half, m_idx, n_idx = _wgrad_task(task, per_half, m_tiles, n_tiles, HALVES, GROUP_M)
        first, rows = _group_rows(offsets_ptr, expert)
        if task // per_half != cached:
            a_even, b_even, a_odd, b_odd = _next_group_descriptors(
                operands, (a_even, b_even, a_odd, b_odd), changes, (last_even, last_odd), step,
                first, rows, half, P, Q, a_stride, GATHER,
            )  # fmt: skip
            cached = task // per_half
            changes += 1
        even = changes % 2 == 1  # the set made at the latest change
        if GATHER:
            b_stride, source_rows_ptr = b_gather
            source = (b_ptr, b_stride, source_rows_ptr, first + rows, Q)
            next_index = _step_index(source, first, BLOCK_K, BLOCK_N)
        for k in range(0, rows, BLOCK_K):
            if GATHER:
                gather = (source, next_index)
                # The next step's index, loaded now: its round trip overlaps this step's wait
                # and copies instead of delaying the next step's.
                next_index = _step_index(source, first + k + BLOCK_K, BLOCK_K, BLOCK_N)
            else:
                gather = b_gather  # None
            slot = step % STAGES
            mbarrier.wait(empty.index(slot), (step // STAGES & 1) ^ 1)
            _copy_step_of_set(
                (a_even, b_even, a_odd, b_odd), even, k, m_idx * BLOCK_M, n_idx * BLOCK_N,
                ready.index(slot), a_bufs, b_bufs, slot, SPLIT, gather, GATHER,
            )  # fmt: skip
            step += 1
        if rows > 0:
            if even:
                last_even = step - 1
            else:
                last_odd = step - 1
        if CLAIM:
            nth += 1
        task = _loader_next_task(claims, task, NUM_PROGRAMS, CLAIM)
    if CLAIM:
        _end_claims(claims, nth)


@gluon.jit
def _fetch_wgrad_tile(desc, buf, fetched, row, col):
    """Start loading a gradient tile to add to into the consumer's epilogue buffer, once the
    consumer's previous store has left it."""
    tma.store_wait(0)
    mbarrier.expect(fetched, desc.block_type.nbytes)
    _tma_load(desc, [row, col], fetched, buf)


@gluon.jit
def _store_wgrad_tile(desc, buf, fetched, acc, row, col, loads, ACCUMULATE: gl.constexpr):
    """Write an fp32 tile of a weight gradient through shared memory. With ACCUMULATE, first add
    the existing tile that `_fetch_wgrad_tile` started loading, in fp32, then round once
    (`grouped_gemm.store_weight_tile`). Returns the count of the consumer's fetches so far."""
    tma.store_wait(0)  # the consumer's previous store has left its buffer
    if ACCUMULATE:
        mbarrier.wait(fetched, loads & 1)
        acc += buf.load(acc.type.layout).to(gl.float32)
        loads += 1
    buf.store(acc.to(desc.dtype))
    fence_async_shared()
    _tma_store(desc, [row, col], buf)
    return loads


@gluon.jit
def _wgrad_main_loop(
    operands, step, k_steps, mine, acc_layout: gl.constexpr, ROLE: gl.constexpr,
    GATHER: gl.constexpr,
):  # fmt: skip
    """Consumer ROLE's main loop over its mine-th task: k_steps steps of A.T @ B from the
    loader's ring, from ring step `step` on. Returns (the fp32 accumulator, the ring step after
    them)."""
    a_bufs, b_bufs, ready, empty, turns = (
        operands[2],
        operands[3],
        operands[4],
        operands[5],
        operands[6],
    )
    STAGES: gl.constexpr = b_bufs.shape[0]
    SPLIT: gl.constexpr = a_bufs.shape[0] // STAGES
    WG_M: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.shape[2]
    PART: gl.constexpr = ROLE if SPLIT > 1 else 0
    if SPLIT == 1:
        # Turns as in `_consume`: every ready wait at most one phase ahead of its barrier.
        mbarrier.wait(turns.index(ROLE), (mine & 1) ^ (1 - ROLE))
    acc = gl.zeros((WG_M, BLOCK_N), gl.float32, acc_layout)
    for k in range(k_steps):
        slot, a = _ready_a_tile(ready, a_bufs, step, PART, GATHER)
        acc = warpgroup_mma(a.permute((1, 0)), b_bufs.index(slot), acc, is_async=True)
        acc, _ = warpgroup_mma_wait(1, deps=(acc, a))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k > 0)
        step += 1
    if SPLIT == 1:
        mbarrier.arrive(turns.index(1 - ROLE))
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k_steps > 0)
    return acc, step


@gluon.jit
def _wgrad_consume(
    operands,
    outputs,
    problem,
    ACCUMULATE_FIRST: gl.constexpr,
    ACCUMULATE_SECOND: gl.constexpr,
    CLAIM: gl.constexpr,
    GATHER: gl.constexpr,
    ROLE: gl.constexpr,
):
    """Consumer ROLE (0 or 1): main loop, then epilogue (CLAIM: of the tasks its loader claimed,
    every one of which both consumers read, `_program_task`).

    Ping-pong (one A part per step): every other task of this program, a whole tile each. Tasks
    reduce over groups of different sizes, so a consumer counts the steps of the other's tasks
    too, to know the ring position of its own. Cooperative (two A parts per step): both consumers
    on every task, each on its part of the tile's rows, sharing the B tile."""
    (a_ptr, b_ptr, a_bufs, b_bufs, ready, empty, turns, fetched, b_gather) = operands
    (first_desc, second_desc, out_bufs, out_rows_per_expert) = outputs
    (
        offsets_ptr,
        num_tasks,
        per_half,
        m_tiles,
        n_tiles,
        P,
        Q,
        a_stride,
        HALVES,
        GROUP_M,
        NUM_PROGRAMS,
        claims,
    ) = problem
    STAGES: gl.constexpr = b_bufs.shape[0]
    SPLIT: gl.constexpr = a_bufs.shape[0] // STAGES
    BLOCK_K: gl.constexpr = a_bufs.shape[1]
    WG_M: gl.constexpr = a_bufs.shape[2]
    BLOCK_M: gl.constexpr = SPLIT * WG_M
    BLOCK_N: gl.constexpr = b_bufs.shape[2]
    PART: gl.constexpr = ROLE if SPLIT > 1 else 0
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    buf = out_bufs.index(ROLE)
    bar = fetched.index(ROLE)
    step = 0
    mine = 0
    loads = 0
    turn = 0  # the program's task index
    task = _program_task(claims, turn, NUM_PROGRAMS, CLAIM)
    while task < num_tasks:
        expert, half, m_idx, n_idx = _wgrad_task(task, per_half, m_tiles, n_tiles, HALVES, GROUP_M)
        first, rows = _group_rows(offsets_ptr, expert)
        k_steps = gl.cdiv(rows, BLOCK_K)
        if SPLIT > 1 or turn % CONSUMERS == ROLE:
            part_row = m_idx * BLOCK_M + PART * WG_M
            row = expert * out_rows_per_expert + part_row
            col = n_idx * BLOCK_N
            # Where P is not a multiple of BLOCK_M, the second consumer's rows of the last tile
            # lie wholly past P (P is a multiple of WG_M): their A columns are TMA's zeros, and
            # nothing is fetched or stored for them (the rows there are another expert's).
            inside = part_row < P
            # The tile to add to loads while the main loop runs. An expert without rows leaves
            # an accumulation buffer untouched.
            if rows > 0 and inside:
                if half == 0:
                    if ACCUMULATE_FIRST:
                        _fetch_wgrad_tile(first_desc, buf, bar, row, col)
                else:
                    if ACCUMULATE_SECOND:
                        _fetch_wgrad_tile(second_desc, buf, bar, row, col)
            acc, step = _wgrad_main_loop(operands, step, k_steps, mine, acc_layout, ROLE, GATHER)
            # Epilogue (ping-pong: while the other consumer's main loop runs).
            if half == 0:
                if inside and (rows > 0 or not ACCUMULATE_FIRST):
                    loads = _store_wgrad_tile(
                        first_desc, buf, bar, acc, row, col, loads, ACCUMULATE_FIRST
                    )
            else:
                if inside and (rows > 0 or not ACCUMULATE_SECOND):
                    loads = _store_wgrad_tile(
                        second_desc, buf, bar, acc, row, col, loads, ACCUMULATE_SECOND
                    )
            mine += 1
        else:
            step += k_steps
        turn += 1
        task = _program_task(claims, turn, NUM_PROGRAMS, CLAIM)
    tma.store_wait(0)


@fast_launch
@gluon.jit
def _weight_gradient_kernel(
    a_ptr,  # [M, HALVES * P], row stride a_stride
    b_ptr,  # [M, Q] contiguous; with gather: [S, Q] rows read through source_rows_ptr
    gather,  # None, or (b_stride, source_rows_ptr [M] int32: row r of B's groups is
    # b[source_rows[r]])
    offsets_ptr,  # [E + 1] int32
    first_desc,  # [(E - 1) * S + P, Q] out (fp32 or bf16), block [BLOCK_M, BLOCK_N]: half 0's
    second_desc,  # gradient, expert e's rows from row e * S; the same for half 1 (or first_desc)
    num_experts,
    P,
    Q,
    S,  # rows from one expert's gradient to the next's: P, or 2P for the halves of [E, 2P, Q]
    a_stride,
    claims_ptr,  # None, or [1] int32 the launch's task counter (`host.TileClaims`)
    ACCUMULATE_FIRST: gl.constexpr,
    ACCUMULATE_SECOND: gl.constexpr,
    HALVES: gl.constexpr,
    SPLIT: gl.constexpr,
    A_LAYOUT: gl.constexpr,
    B_LAYOUT: gl.constexpr,
    BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Grid: NUM_PROGRAMS (one per SM at most; with claims_ptr: any, the tasks claimed from it),
    num_warps 4. For every expert e and half j:
    out_j[e] (+)= A[group e, j * P:(j + 1) * P].T @ B[group e], out_j [E, P, Q] seen as 2-D rows,
    expert e's from row e * S (P a multiple of WG_M: a consumer's rows lie wholly inside P or
    wholly past it, and those past it are neither fetched nor stored, so that no tile reaches
    into the next expert's rows, or into the other half's when S > P). A consumer's
    tile is the descriptors' block, WG_M x BLOCK_N; with SPLIT 2 the two consumers share tiles of
    2 x WG_M rows (cooperative), with SPLIT 1 each has its own (ping-pong). With gather: B's
    rows are read through their index by a loader of a warpgroup (`_copy_step`), the same values
    in the same order as B's rows gathered beforehand."""
    GATHER: gl.constexpr = gather is not None
    CLAIM: gl.constexpr = claims_ptr is not None
    LOADER_WARPS: gl.constexpr = GATHER_LOADER_WARPS if GATHER else 1
    WG_M: gl.constexpr = first_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = first_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = SPLIT * WG_M
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES * SPLIT, BLOCK_K, WG_M], A_LAYOUT)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], B_LAYOUT)
    out_bufs = gl.allocate_shared_memory(
        first_desc.dtype, [CONSUMERS, WG_M, BLOCK_N], first_desc.layout
    )
    ready, empty, turns, fetched = _ring_barriers(STAGES, SPLIT)
    claims = _task_claims(claims_ptr, ready, empty, CONSUMERS, CLAIM)  # both read every id
    m_tiles = gl.cdiv(P, BLOCK_M)
    n_tiles = gl.cdiv(Q, BLOCK_N)
    per_half = m_tiles * n_tiles
    num_tasks = num_experts * HALVES * per_half
    operands = (a_ptr, b_ptr, a_bufs, b_bufs, ready, empty, turns, fetched, gather)
    outputs = (first_desc, second_desc, out_bufs, S)
    problem = (
        offsets_ptr,
        num_tasks,
        per_half,
        m_tiles,
        n_tiles,
        P,
        Q,
        a_stride,
        HALVES,
        GROUP_M,
        NUM_PROGRAMS,
        claims,
    )
    # The argument tuples are written out: constexprs in a tuple bound to a name arrive as values.
    gl.warp_specialize(
        [
            (
                _wgrad_consume,
                (operands, outputs, problem, ACCUMULATE_FIRST, ACCUMULATE_SECOND, CLAIM, GATHER, 0),
            ),
            (
                _wgrad_consume,
                (operands, outputs, problem, ACCUMULATE_FIRST, ACCUMULATE_SECOND, CLAIM, GATHER, 1),
            ),
            (_wgrad_load_partition, (operands, problem, CLAIM, GATHER)),
        ],
        [4, LOADER_WARPS],
        [CONSUMER_REGISTERS, LOADER_REGISTERS],
    )
    _drop_ring(ready, empty, turns, fetched, claims, CLAIM)


def wgrad_supported(
    a: torch.Tensor,
    b: torch.Tensor,
    grad: torch.Tensor,
    cfg: GemmTiles,
    gather: bool = False,
) -> bool:
    """Whether `_weight_gradient_kernel` takes these operands: 16-bit A and B on a Hopper GPU, unit
    column strides, an fp32 or 16-bit gradient [E, P, Q] whose P is a multiple of a consumer's
    rows (64: a tile of two consumers' rows may end past P, gpt-oss's 2880) and whose experts
    each hold P contiguous rows (the experts may lie further apart: the halves
    of an [E, 2P, Q] tensor), and rows 16-byte aligned for TMA (gather: B's rows read through an
    index, B's elements fewer than 2^31, the width of its offsets)."""
    num_experts, p, q = grad.shape
    return (
        available(a.device)
        and a.dtype in _GLUON_DTYPES
        and b.dtype == a.dtype
        and grad.dtype in (torch.float32, a.dtype)
        and has_contiguous_expert_rows(grad)
        and a.stride(-1) == 1
        and b.is_contiguous()
        and p % CONSUMER_ROWS == 0
        and (a.stride(0) * a.element_size()) % 16 == 0
        and (p * a.element_size()) % 16 == 0
        and (q * a.element_size()) % 16 == 0
        and not (gather and b.numel() >= 2**31)
    )


def _gradient_rows(grad: torch.Tensor, rows_per_expert: int) -> torch.Tensor:
    """grad [E, P, Q] (`has_contiguous_expert_rows`) as the 2-D rows [(E - 1) * S + P, Q] its
    experts lie in, S = rows_per_expert apart: expert e's row i is row e * S + i."""
    num_experts, p, q = grad.shape
    return grad.as_strided(((num_experts - 1) * rows_per_expert + p, q), (q, 1))


def _launch_weight_gradients(
    a: torch.Tensor,
    b: torch.Tensor,
    group_offsets: torch.Tensor,
    grads: tuple[torch.Tensor, ...],
    accumulate: tuple[bool, ...],
    cfg: GemmTiles,
    source_rows: torch.Tensor | None = None,
) -> None:
    num_experts, p, q = grads[0].shape
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    gather = source_rows is not None
    # A consumer's rows straddling P would land on the next expert's gradient, or the other
    # half's (2-D descriptors over the experts' rows).
    if not all(wgrad_supported(a, b, g, cfg, gather) for g in grads) or any(
        g.stride() != grads[0].stride() for g in grads
    ):
        raise ValueError(
            f"gradients [E, {p}, {q}] {grads[0].dtype} from {a.dtype} operands: not taken by the "
            f"Gluon weight-gradient kernel with {bm}-row tiles (`wgrad_supported`: P a multiple "
            f"of {CONSUMER_ROWS}, 16-byte rows, each expert's rows contiguous, gathered rows "
            "fewer than 2^31 elements; every gradient laid out alike); use the tl kernel"
        )
    if gather:
        gathered_rows(b, source_rows)
    split = _consumer_split(bm)
    wg_m = CONSUMER_ROWS
    halves = len(grads)
    tasks = num_experts * halves * triton.cdiv(p, bm) * triton.cdiv(q, bn)
    # The gradients' own dtype (fp32, or A's: `wgrad_supported`) sets their tiles' layout.
    rows_per_expert = grads[0].stride(0) // q
    descs = [_descriptor(_gradient_rows(g, rows_per_expert), [wg_m, bn]) for g in grads]
    use_scratch_allocator(a.device)

    def launch(programs: int, counter: torch.Tensor | None) -> None:
        _weight_gradient_kernel[(programs,)](
            a,
            b,
            (b.stride(0), source_rows) if gather else None,
            group_offsets,
            descs[0],
            descs[-1],
            num_experts,
            p,
            q,
            rows_per_expert,
            a.stride(0),
            counter,
            ACCUMULATE_FIRST=accumulate[0],
            ACCUMULATE_SECOND=accumulate[-1],
            HALVES=halves,
            SPLIT=split,
            A_LAYOUT=_shared_layout((bk, wg_m), a.dtype),
            B_LAYOUT=_shared_layout((bk, bn), a.dtype),
            BLOCK_K=bk,
            GROUP_M=cfg.group_m,
            NUM_PROGRAMS=programs if counter is None else 1,
            STAGES=cfg.num_stages,
            num_warps=cfg.num_warps,
            maxnreg=MAX_REGISTERS,
        )

    launch_persistent(launch, num_programs(a.device, tasks, cfg), cfg.claims)


def down_wgrad(
    grad_out: torch.Tensor,
    h: torch.Tensor,
    group_offsets: torch.Tensor,
    grad_w_down: torch.Tensor,
    accumulate: bool,
    cfg: GemmTiles | None = None,
) -> None:
    """grad_w_down[e] (+)= grad_out[group e].T @ h[group e] in place ([E, H, I], fp32 or bf16):
    the result of `grouped_gemm.down_wgrad` (`wgrad_supported` operands). cfg None: the tiles of
    WGRAD_TILES for the gradient's dtype."""
    cfg = cfg or WGRAD_TILES.for_grad(grad_w_down.dtype)
    _launch_weight_gradients(grad_out, h, group_offsets, (grad_w_down,), (accumulate,), cfg)


def gate_up_wgrad(
    grad_gate_up: torch.Tensor,
    rows: torch.Tensor,
    group_offsets: torch.Tensor,
    grad_w_gate: torch.Tensor,
    grad_w_up: torch.Tensor,
    accumulate_gate: bool,
    accumulate_up: bool,
    cfg: GemmTiles | None = None,
    source_rows: torch.Tensor | None = None,
) -> None:
    """grad_w_gate[e] (+)= grad_gate[group e].T @ rows[group e], grad_w_up likewise, in place: the
    result of `grouped_gemm.gate_up_wgrad` (`wgrad_supported` operands, both gradients of one
    dtype), source_rows included (the grouped rows read through it from rows [S, H]). cfg None:
    the tiles of WGRAD_TILES for the gradients' dtype."""
    cfg = cfg or WGRAD_TILES.for_grad(grad_w_gate.dtype)
    _launch_weight_gradients(
        grad_gate_up,
        rows,
        group_offsets,
        (grad_w_gate, grad_w_up),
        (accumulate_gate, accumulate_up),
        cfg,
        source_rows,
    )


# --------------------------------------------------------------------------------------------------
# Block-scaled FP8 weight gradients: out[e] = G[tokens of e].T @ X[tokens of e], a step per 128
# tokens
# --------------------------------------------------------------------------------------------------

BLOCK_SCALED_WGRAD_TILES = GemmTiles(
    block_m=64, block_n=128, block_k=FP8_BLOCK, num_warps=4, num_stages=6, group_m=8
)
"""Ping-pong tiles of the recipe's weight gradient: 64 rows of N by 128 columns of K, a step one
tile of 128 tokens (the operands' casts along the tokens, stored tokens-contiguous); 6 slots of
24 KiB and two fp32 64 x 128 epilogue buffers."""


@gluon.jit
def _token_steps(offsets_ptr, tile_starts_ptr, expert):
    """(first 128-token tile, tile count) of an expert's group."""
    rows = gl.maximum(gl.load(offsets_ptr + expert + 1) - gl.load(offsets_ptr + expert), 0)
    return gl.load(tile_starts_ptr + expert), gl.cdiv(rows, SCALE_BLOCK)


@gluon.jit
def _block_scaled_wgrad_task(task, n_tiles, k_tiles, GROUP_M: gl.constexpr):
    """(expert, n tile, k tile) of a task: expert by expert, GROUP_M tile rows at a time."""
    per_expert = n_tiles * k_tiles
    n_idx, k_idx = _grouped_task(task % per_expert, n_tiles, k_tiles, GROUP_M)
    return task // per_expert, n_idx, k_idx


@gluon.jit
def _block_scaled_wgrad_loader(operands, problem):
    """Loader: the G and X tiles of every step of this program's tasks, in order; a step's tiles
    are the task's rows of G_t and of X_t at one token tile of its expert."""
    (g_desc, x_desc, g_bufs, x_bufs, ready, empty, _) = operands
    (offsets_ptr, tile_starts_ptr, num_tasks, n_tiles, k_tiles, GROUP_M, NUM_PROGRAMS, _, _) = (
        problem
    )
    STAGES: gl.constexpr = x_bufs.shape[0]
    WG_M: gl.constexpr = g_bufs.shape[1]
    BLOCK_N: gl.constexpr = x_bufs.shape[1]
    STEP: gl.constexpr = g_bufs.shape[2]
    step_bytes: gl.constexpr = g_desc.block_type.nbytes + x_desc.block_type.nbytes
    step = 0
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        expert, n_idx, k_idx = _block_scaled_wgrad_task(task, n_tiles, k_tiles, GROUP_M)
        first, steps = _token_steps(offsets_ptr, tile_starts_ptr, expert)
        for s in range(steps):
            slot = step % STAGES
            mbarrier.wait(empty.index(slot), (step // STAGES & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, step_bytes)
            tokens = (first + s) * STEP
            _tma_load(g_desc, [n_idx * WG_M, tokens], bar, g_bufs.index(slot))
            _tma_load(x_desc, [k_idx * BLOCK_N, tokens], bar, x_bufs.index(slot))
            step += 1


@gluon.jit
def _block_scaled_wgrad_consume(operands, outputs, problem, ROLE: gl.constexpr):
    """Consumer ROLE (0 or 1): every other task of this program, ping-pong. Each step: the FP8
    tensor cores' product of the step's 128 tokens from zero, then times G's descale of each
    row and X's of each column of that token tile, added to the fp32 accumulator
    (`_block_scaled_step`); the tile rounded once into out. A consumer counts the other's steps
    too, to know its own ring position."""
    (_, _, g_bufs, x_bufs, ready, empty, turns) = operands
    (out_desc, out_bufs, g_descales, x_descales) = outputs
    (offsets_ptr, tile_starts_ptr, num_tasks, n_tiles, k_tiles, GROUP_M, NUM_PROGRAMS, N, K) = (
        problem
    )
    STAGES: gl.constexpr = x_bufs.shape[0]
    WG_M: gl.constexpr = g_bufs.shape[1]
    BLOCK_N: gl.constexpr = x_bufs.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
    )
    rows_in = gl.arange(0, WG_M, layout=gl.SliceLayout(1, acc_layout))
    cols_in = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    buf = out_bufs.index(ROLE)
    step = 0
    nth = 0
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        expert, n_idx, k_idx = _block_scaled_wgrad_task(task, n_tiles, k_tiles, GROUP_M)
        first, steps = _token_steps(offsets_ptr, tile_starts_ptr, expert)
        if nth % CONSUMERS == ROLE:
            rows = n_idx * WG_M + rows_in
            cols = k_idx * BLOCK_N + cols_in
            # Columns past K read the last column's descale: they reach only columns never
            # stored (TMA clips the store).
            cols = gl.minimum(cols, K - 1)
            # Turns as in `_main_loop`: every ready wait at most one phase ahead of its barrier.
            mbarrier.wait(turns.index(ROLE), (nth // CONSUMERS & 1) ^ (1 - ROLE))
            acc = gl.zeros((WG_M, BLOCK_N), gl.float32, acc_layout)
            for s in range(steps):
                slot = step % STAGES
                mbarrier.wait(ready.index(slot), step // STAGES & 1)
                tile = (first + s).to(gl.int64)
                x_at = x_descales + tile * K + cols
                at = (g_descales + tile * N + rows, rows < N, x_at, x_at)
                x = x_bufs.index(slot).permute((1, 0))
                zeros = gl.zeros((WG_M, BLOCK_N), gl.float32, acc_layout)
                steps_out = _block_scaled_step(
                    g_bufs.index(slot), x, x, 0, acc, acc, zeros, at, False
                )
                acc = steps_out[0]
                mbarrier.arrive(empty.index(slot))
                step += 1
            mbarrier.arrive(turns.index(1 - ROLE))
            tma.store_wait(0)  # this consumer's previous tile has left its buffer
            buf.store(acc.to(out_desc.dtype))
            fence_async_shared()
            _tma_store(out_desc, [expert * N + n_idx * WG_M, k_idx * BLOCK_N], buf)
        else:
            step += steps
        nth += 1
    tma.store_wait(0)


@fast_launch
@gluon.jit
def _block_scaled_wgrad_kernel(
    g_desc,  # [N, T] e4m3 G_t: the gradient cast along the tokens, tokens contiguous, tile t of
    # 128 tokens at columns 128 t..; block [WG_M, 128]
    x_desc,  # [K, T] e4m3 X_t alike; block [BLOCK_N, 128]
    out_desc,  # [E * N, K] out (fp32 or 16-bit), block [WG_M, BLOCK_N]
    g_descales,  # [tiles, N] fp32: row t the descales of token tile t
    x_descales,  # [tiles, K] fp32
    offsets_ptr,  # [E + 1] int32 group offsets
    tile_starts_ptr,  # [E] int32: each expert's first token tile
    num_experts,
    N,
    K,
    GROUP_M: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Grid: NUM_PROGRAMS, num_warps 4. out[e] = G[group e].T @ X[group e] in the recipe's
    steps, one per 128-token tile of the group (tokens past the group's end are the casts'
    zeros), rounded once; zeros for an expert without tokens. N a multiple of WG_M: a tile's
    rows never reach the next expert's."""
    WG_M: gl.constexpr = g_desc.block_type.shape[0]
    STEP: gl.constexpr = g_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = x_desc.block_type.shape[0]
    g_bufs = gl.allocate_shared_memory(g_desc.dtype, [STAGES, WG_M, STEP], g_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_N, STEP], x_desc.layout)
    out_bufs = gl.allocate_shared_memory(
        out_desc.dtype, [CONSUMERS, WG_M, BLOCK_N], out_desc.layout
    )
    ready, empty, turns, fetched = _ring_barriers(STAGES, 1)
    n_tiles = gl.cdiv(N, WG_M)
    k_tiles = gl.cdiv(K, BLOCK_N)
    num_tasks = num_experts * n_tiles * k_tiles
    operands = (g_desc, x_desc, g_bufs, x_bufs, ready, empty, turns)
    outputs = (out_desc, out_bufs, g_descales, x_descales)
    problem = (
        offsets_ptr, tile_starts_ptr, num_tasks, n_tiles, k_tiles, GROUP_M, NUM_PROGRAMS, N, K
    )  # fmt: skip
    # The argument tuples are written out: constexprs in a tuple bound to a name arrive as values.
    gl.warp_specialize(
        [
            (_block_scaled_wgrad_consume, (operands, outputs, problem, 0)),
            (_block_scaled_wgrad_consume, (operands, outputs, problem, 1)),
            (_block_scaled_wgrad_loader, (operands, problem)),
        ],
        [4, 1],
        [CONSUMER_REGISTERS, LOADER_REGISTERS],
    )
    _drop_ring(ready, empty, turns, fetched, None, False)


def block_scaled_wgrad_supported(n: int, k: int, device: torch.device) -> bool:
    """Whether `block_scaled_grouped_wgrad` takes a gradient [E, N, K] on this device: Hopper,
    N a multiple of a consumer's 64 rows (a tile never reaches the next expert's rows), K a
    multiple of 16 (TMA's 16-byte rows)."""
    return available(device) and n % CONSUMER_ROWS == 0 and k % 16 == 0


def block_scaled_grouped_wgrad(
    g_tokens: tuple[torch.Tensor, torch.Tensor],
    x_tokens: tuple[torch.Tensor, torch.Tensor],
    group_offsets: torch.Tensor,
    tile_starts: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    cfg: GemmTiles = BLOCK_SCALED_WGRAD_TILES,
) -> torch.Tensor:
    """`fp8_block.block_scaled_grouped_wgrad` on the FP8 tensor cores: out [E, N, K] of
    out_dtype, out[e] = G[group e].T @ X[group e], each 128-token step summed by the tensor
    cores from zero, then scaled by G's descale of each row and X's of each column and added in
    fp32; zeros for an expert without tokens. g_tokens, x_tokens: the operands' casts along the
    tokens as `fp8_block.block_quantize_tokens(..., transposed=True)` makes them ((values [N, T]
    e4m3, descales [tiles, N] fp32), and [K, T], [tiles, K]); tile_starts [E] int32 each
    expert's first token tile (`fp8_block.token_tile_starts`)."""
    (g_values, g_descales), (x_values, x_descales) = g_tokens, x_tokens
    n, k, experts = g_values.shape[0], x_values.shape[0], group_offsets.numel() - 1
    if not block_scaled_wgrad_supported(n, k, g_values.device):
        raise ValueError(
            f"a weight gradient [E, {n}, {k}]: the FP8 kernel takes N a multiple of "
            f"{CONSUMER_ROWS} and K of 16 on a Hopper GPU; use fp8_block.block_scaled_grouped_wgrad"
        )
    if g_values.shape[1] != x_values.shape[1] or g_values.shape[1] % FP8_BLOCK:
        raise ValueError("G_t and X_t: the same tokens, whole tiles of 128")
    out = torch.empty(experts, n, k, dtype=out_dtype, device=g_values.device)
    if experts == 0 or n == 0 or k == 0:
        return out
    wg_m, bn, step = CONSUMER_ROWS, cfg.block_n, FP8_BLOCK
    tasks = experts * triton.cdiv(n, wg_m) * triton.cdiv(k, bn)
    programs = num_programs(g_values.device, tasks, cfg)
    _block_scaled_wgrad_kernel[(programs,)](
        _descriptor(g_values, [wg_m, step]),
        _descriptor(x_values, [bn, step]),
        _descriptor(out.view(experts * n, k), [wg_m, bn]),
        g_descales.contiguous(),
        x_descales.contiguous(),
        group_offsets,
        tile_starts,
        experts,
        n,
        k,
        GROUP_M=cfg.group_m,
        NUM_PROGRAMS=programs,
        STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        maxnreg=MAX_REGISTERS,
    )
    return out
