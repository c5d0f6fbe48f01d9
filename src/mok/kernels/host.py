"""Host-side types and launch helpers shared by the expert products' tl kernels
(`grouped_gemm`) and their Gluon twins (`warp_specialized`): tiles (`GemmTiles`), the groups' row
tiles (`RowTiles`), where rows come from and go (`RowsReady`, `RowScatter`), run-time task claims
(`TileClaims`), the activation's parameters, and the persistent grid's size and launch."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol

import torch
import triton

from mok.kernels.sync import timeout_ns


class TileClaims(Protocol):
    """Dynamic tile claiming for a persistent product (the `fused` backend implements it).

    The product's programs take their tasks from a counter with an atomic add instead of by a
    static stride, so that programs launched later, on SMs that another kernel frees, take the
    tasks still left. Each task is still computed whole by one program in the same order, so the
    results are bitwise those of the static grid; only which program computes a task changes.
    The warp-specialized kernels claim (`warp_specialized`: gate/up + SwiGLU, down, down dgrad
    + SwiGLU, the weight gradients), and of the tl kernels gate/up + SwiGLU and down dgrad +
    SwiGLU (their twins, which the interpreter runs); the other tl kernels keep the static
    stride (`GemmTiles.claims` is then not used)."""

    def counter(self) -> torch.Tensor:
        """A [1] int32 counter at zero, for one product's launches (its own: no other product
        claims from it until this one's launches are done). Called right before the product's
        first launch, once its inputs are queued: a provider may mark that point in the stream
        for the programs that join later."""
        ...

    def extend(self, relaunch: Callable[[int], None]) -> None:
        """Called once, right after the product's launch: `relaunch(programs)` launches the
        product again with that many programs claiming from the same counter."""
        ...


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """Tile shape and launch parameters of one persistent GEMM kernel."""

    block_m: int
    """Rows of an output tile (token rows in row-tiled kernels, weight rows in weight gradients)."""
    block_n: int
    """Columns of an output tile."""
    block_k: int
    """Depth of one step along the reduction."""
    num_warps: int = 8
    num_stages: int = 3
    """Software-pipelining depth of the reduction loop."""
    group_m: int = 8
    """Tasks are walked group_m tile rows at a time (row fastest inside a group), so that the
    programs running together share both operands in L2."""
    programs_per_sm: int = 1
    """Persistent programs per SM; 2 lets one program's prologue and epilogue overlap another's
    main loop where registers and shared memory allow."""
    max_sms: int | None = None
    """SMs the persistent grid may take (None: all): a product that runs beside communication
    programs leaves them theirs, so that both are resident at once (the product waits on them)."""
    claims: TileClaims | None = dataclasses.field(default=None, compare=False)
    """Tasks claimed at run time (`TileClaims`) by the kernels that can, instead of by a static
    stride; None: the static grid."""


@dataclasses.dataclass(frozen=True)
class RowTiles:
    """Every group's row tiles of BLOCK_M rows, listed on the device by `row_tile_map`.

    The first `counts[0]` entries of `table` cover the experts' groups in order; the next
    `counts[1] - counts[0]` cover the rows outside every group ([0, offsets[0]) and
    [offsets[E], M)), with expert -1, so that a kernel can zero those rows.
    """

    table: torch.Tensor
    """[3, capacity] int32: expert (-1 outside the groups), first row, end row (exclusive)."""
    counts: torch.Tensor
    """[2] int32: row tiles of the groups; of the groups and the rows outside them."""
    capacity: int
    """cdiv(M, block_m) + E + 2: a host-known bound on the number of tiles."""
    block_m: int


@dataclasses.dataclass(frozen=True)
class RowScatter:
    """Where a row-tiled product's output rows go when they leave for other ranks' buffers instead
    of a local [M, N] matrix: the peer-store epilogue (`scatter_row_tile`). Buffers of other ranks
    are reached through peer-offset tables (`mok.kernels.rows`); a table of zeros is local."""

    out: torch.Tensor
    """[R, N] this rank's buffer (contiguous); rank d's is at out_offsets[d] elements from it."""
    out_offsets: torch.Tensor
    """[ep] int64 peer-offset table of `out`."""
    dest_rank: torch.Tensor
    """[M] int32: the rank each output row goes to."""
    dest_row: torch.Tensor
    """[M] int32: its row in that rank's buffer; -1: the row is not stored."""
    counts: torch.Tensor
    """[ep] int32 this rank's readiness counts: counts[s] grows by the rows that landed here from
    rank s, once per column tile of BLOCK_N. Zeroed by their owner before the product starts."""
    counts_offsets: torch.Tensor
    """[ep] int64 peer-offset table of `counts`."""
    rank: int

    def check(self, num_rows: int, columns: int) -> None:
        """Raise ValueError naming the first field that does not fit M rows of N columns."""
        ep = self.out_offsets.shape[0]
        expected = {
            "out": (self.out.dim() == 2 and self.out.shape[1] == columns, f"[R, {columns}]"),
            "out_offsets": (self.out_offsets.dtype == torch.int64, "[ep] int64"),
            "dest_rank": (tuple(self.dest_rank.shape) == (num_rows,), f"[{num_rows}] int32"),
            "dest_row": (tuple(self.dest_row.shape) == (num_rows,), f"[{num_rows}] int32"),
            "counts": (tuple(self.counts.shape) == (ep,), f"[{ep}] int32"),
            "counts_offsets": (tuple(self.counts_offsets.shape) == (ep,), f"[{ep}] int64"),
        }
        for name, (fits, shape) in expected.items():
            if not fits:
                raise ValueError(f"RowScatter.{name}: expected {shape}, got {getattr(self, name)}")
        int32 = [self.dest_rank, self.dest_row, self.counts]
        if any(t.dtype != torch.int32 for t in int32) or not self.out.is_contiguous():
            raise ValueError("RowScatter: dest_rank, dest_row, counts int32; out contiguous")
        if not 0 <= self.rank < ep:
            raise ValueError(f"RowScatter.rank {self.rank} outside [0, {ep})")

    def args(self) -> tuple:
        """The kernel arguments, in `scatter_row_tile`'s order."""
        return (
            self.out,
            self.out_offsets,
            self.dest_rank,
            self.dest_row,
            self.counts,
            self.counts_offsets,
            self.rank,
        )

    @property
    def ep_block(self) -> int:
        return max(2, triton.next_power_of_2(self.out_offsets.shape[0]))


@dataclasses.dataclass(frozen=True)
class RowsReady:
    """A-rows that land while the product runs (the overlapped dispatch): rows [b * block_rows,
    (b + 1) * block_rows) of A are in place once flags[b] equals epoch[0], set by a release
    (`mok.kernels.sync.signal_ready`) from another kernel running beside the product. A tile
    waits for the flags of its rows before it reads them (`wait_rows_ready`), bounded by
    timeout_s; a failure goes to `status` (`mok.kernels.sync`) under `wait_id`."""

    flags: torch.Tensor
    """[B] int32, this rank's."""
    block_rows: int
    epoch: torch.Tensor
    """[1] int32: the value meaning "written in this call"."""
    status: torch.Tensor
    timeout_s: float
    wait_id: int

    def check(self, num_rows: int) -> None:
        """Raise ValueError unless the flags cover num_rows rows."""
        needed = triton.cdiv(num_rows, self.block_rows)
        if self.flags.dtype != torch.int32 or self.flags.dim() != 1 or self.flags.numel() < needed:
            raise ValueError(
                f"RowsReady.flags: expected >= {needed} int32 flags for {num_rows} rows in blocks "
                f"of {self.block_rows}, got {tuple(self.flags.shape)} {self.flags.dtype}"
            )
        if self.block_rows < 1:
            raise ValueError(f"RowsReady.block_rows must be positive, got {self.block_rows}")
        if self.epoch.dtype != torch.int32 or self.epoch.numel() != 1:
            raise ValueError("RowsReady.epoch: expected a [1] int32 tensor")

    def args(self) -> tuple:
        """The kernel arguments, in `wait_rows_ready`'s order."""
        return (self.flags, self.epoch, self.status, timeout_ns(self.timeout_s), self.wait_id)

    def flags_per_tile(self, block_m: int) -> int:
        """A power of two >= the flags one tile of block_m rows can touch."""
        return triton.next_power_of_2(triton.cdiv(block_m, self.block_rows) + 1)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_programs(device: torch.device, max_tasks: int, cfg: GemmTiles) -> int:
    """Programs of a persistent grid: cfg.programs_per_sm per SM (of at most cfg.max_sms) on a
    GPU (3 under the interpreter, enough to exercise the task loop), never more than the tasks."""
    if device.type == "cuda":
        sms = _sm_count(device.index or 0)
        programs = min(sms, cfg.max_sms or sms) * cfg.programs_per_sm
    else:
        programs = 3 if cfg.max_sms is None else min(3, cfg.max_sms)
    return max(1, min(programs, max_tasks))


def launch_options(cfg: GemmTiles, programs: int) -> dict:
    """The tile meta-parameters and launch options of a persistent tl product on `programs`
    programs (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, num_warps, num_stages)."""
    return {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "GROUP_M": cfg.group_m,
        "NUM_PROGRAMS": programs,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }


def launch_persistent(
    launch: Callable[[int, torch.Tensor | None], None], programs: int, claims: TileClaims | None
) -> None:
    """Launch a persistent product by `launch(programs, counter)`: with counter None its
    programs take tasks by the static stride; with `claims`, they claim them from a fresh counter
    (`TileClaims.counter`), and the claims' extension may launch more programs on it."""
    if claims is None:
        launch(programs, None)
        return
    counter = claims.counter()
    launch(programs, counter)
    claims.extend(lambda more: launch(more, counter))


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def use_scratch_allocator(device: torch.device) -> None:
    """Tensor descriptors made inside a kernel need global scratch memory for their TMA maps."""
    if device.type == "cuda":
        triton.set_allocator(_scratch)


@dataclasses.dataclass(frozen=True)
class Activation:
    """The experts' activation gate * sigmoid(alpha * gate) * (up + up_offset), after the clamp
    (`mok.reference.expert.swiglu`); alpha 1 and offset 0 is SwiGLU, silu(gate) * up, computed by
    the plain formula. gpt-oss: alpha 1.702, offset 1."""

    alpha: float = 1.0
    up_offset: float = 0.0

    @property
    def plain(self) -> bool:
        return self.alpha == 1.0 and self.up_offset == 0.0


SWIGLU = Activation()


def gathered_rows(rows: torch.Tensor, source_rows: torch.Tensor | None) -> int:
    """M, the grouped rows of a product whose A rows are `rows` [S, K], read in place (M = S) or
    through `source_rows` [M] int32 (grouped row r is rows[source_rows[r]], each index in
    [0, S)); raise ValueError if the index does not fit."""
    if source_rows is None:
        return rows.shape[0]
    if source_rows.dim() != 1 or source_rows.dtype != torch.int32:
        raise ValueError(
            f"source_rows: expected [M] int32, got {tuple(source_rows.shape)} {source_rows.dtype}"
        )
    if source_rows.device != rows.device or rows.stride(1) != 1:
        raise ValueError("source_rows: on the rows' device, and rows with unit column stride")
    return source_rows.shape[0]


def gather_source(rows: torch.Tensor, source_rows: torch.Tensor | None) -> tuple | None:
    """A product's gathering A-row source as its kernels take it: (rows [S, K], their row stride,
    source_rows [M]); None where the rows are read in place."""
    if source_rows is None:
        return None
    return rows, rows.stride(0), source_rows


def contiguous_biases(biases: tuple | None) -> tuple | None:
    """Expert biases as the kernels take them: None without (no tuple, or its first None), else
    the given ones contiguous (gpt-oss's gate and up biases are every other column of one tensor:
    the kernels read copies)."""
    if biases is None or biases[0] is None:
        return None
    return tuple(bias.contiguous() for bias in biases if bias is not None)


def ready_flags(ready: RowsReady | None, block_m: int) -> tuple[int, int]:
    """A product's READY_FLAGS: (rows a flag, flags a tile of block_m rows touches at most) of
    the rows it waits for; (1, 0) where it waits for none."""
    return (ready.block_rows, ready.flags_per_tile(block_m)) if ready else (1, 0)


def check_weighting(grad_out, h, row_weights, inter: int) -> None:
    """Raise ValueError unless h is contiguous [M, inter] in grad_out's dtype and row_weights
    fp32 [M] (the inputs of `down_dgrad_swiglu_weighted`)."""
    m = grad_out.shape[0]
    if h.shape != (m, inter) or h.dtype != grad_out.dtype or not h.is_contiguous():
        raise ValueError(
            f"h must be contiguous [{m}, {inter}] {grad_out.dtype}, got {tuple(h.shape)} "
            f"{h.dtype} (contiguous: {h.is_contiguous()})"
        )
    if row_weights.shape != (m,) or row_weights.dtype != torch.float32:
        raise ValueError(
            f"row_weights must be [{m}] float32, got {tuple(row_weights.shape)} {row_weights.dtype}"
        )
