"""The token exchange over NVLink through PyTorch symmetric memory: no host synchronization,
deterministic, capturable in a CUDA graph.

Same layouts and the same results, bit for bit, as `CollectiveExchange` (`mok.comm.placement`): each
token crosses once to each owner of one of its experts into the owner's staging rows, the owner
expands them into one row per pair grouped by local expert, and each pair's output returns to the
token's rank, where the k outputs are summed in fp32, j ascending.

Who moves what (the side that knows the addresses does the copy):
  route     counts: every rank writes its counts into every peer, barrier; each sender computes
            its rows' places (`mok.kernels.placement`, the values of
            `mok.comm.placement.placement_from_counts`) and writes each pair's (staging row,
            return address) into the owner's metadata, barrier.
  dispatch  push: the sender stores its token rows into the owners' staging and sets one flag
            per block of tokens on each owner; the owner's expand waits on the flags of the rows
            it copies (the hook a fused GEMM uses to start on the first rows).
            pull: the sender copies x into its symmetric buffer, barrier, the owner loads.
  combine   the owner's expert outputs sit in a symmetric buffer; barrier; each token's rank loads
            its pairs' outputs and sums them.
  backward  the token's rank writes the pair gradients (w * grad_y) into a symmetric buffer,
            barrier, the owner loads them (combine_backward); the owner sums its pairs' input
            gradients per staging row in fp32, barrier, the token's rank loads and sums them over
            owners in ascending rank (dispatch_backward).
            With the router weights applied by the down product's epilogue instead: the token's
            rank stores its grad_y rows into the owners' staging, as a push dispatch does but
            with no flags, and each pair's weight into its owner's row_weights, barrier, the
            owner expands (unweighted_combine_backward); later the owner writes its rows' dots,
            barrier, the token's rank loads each pair's (pair_values).

Every wait is bounded (`mok.kernels.sync`): a barrier or flag that a peer never reaches gives up
after `timeout_s`, records which wait and which peer on the device, and `check()` raises
`MoKTimeoutError`; a peer found two or more barriers ahead (the ranks' calls diverged) is
recorded at once. After either, the buffers' contents are undefined until every rank calls
`reset()` (collective); the CUDA context stays usable.

Why the barriers suffice: every phase writes into a peer only after a barrier that the peer
passes only once its earlier work on that buffer is done (stream order), and reads a peer's
buffer only after a barrier (or a flag) that the peer passes after writing it.

Classes: one per buffer layout (`exchange_class`): `SymmetricExchange` and
`SymmetricRouterValuesExchange` (staged, the `triton` backend's), `OverlappedSymmetricExchange`
and `OverlappedSymmetricRouterValuesExchange` (the `fused` backend's); the router-values ones
serve `router_gradient="epilogue"`.

Capacity: staging holds `token_capacity` rows and the grouped/output buffers `pair_capacity`
rows on every rank. Every rank sees all counts, so all of them detect an overflow identically
on the device: rows past a capacity are dropped (never written out of bounds; their expert
contribution is zero, as in capacity-factor token dropping) and a sticky flag is set.
`check()` (a host synchronization, collective in effect because every rank holds the same flag)
raises `MoKCapacityError`; nothing checks it implicitly, since there is no host synchronization
to piggyback on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import triton

from mok.comm.exchange import ReceivedTokens
from mok.comm.layout import ExchangeShape, buffer_layout, region_bytes
from mok.comm.memory import SymmetricMemory, symmetric_memory
from mok.distributed import group_rank_and_size, raise_if_any_rank_failed
from mok.errors import MoKCapacityError, MoKInputError, MoKTimeoutError
from mok.kernels.constants import DeviceConstants
from mok.kernels.host import RowScatter, RowsReady
from mok.kernels.mx import MXRows
from mok.kernels.placement import PlacementKernels, owner_rows
from mok.kernels.rows import (
    COPY_ROWS,
    COPY_TILE,
    LOCAL_SUM,
    PAIR_GRADIENT_PROGRAMS_PER_SM,
    PUSH_TILE,
    copy_rows,
    pair_gradients,
    push_rows,
    reduce_rows,
)
from mok.kernels.sync import OUT_OF_STEP, TIMED_OUT, await_counts, barrier, new_status
from mok.reference.mx import ScaleRounding

WAITS = (
    "route: every rank's counts written",
    "route: the pair addresses written",
    "dispatch: token rows pushed",
    "dispatch: x copied for pulling",
    "combine: expert outputs written",
    "combine backward: pair gradients written",
    "combine backward: gradient rows and router weights pushed",
    "combine backward: the rows' router-weight dots written",
    "dispatch backward: staging gradients summed",
    "release: peers done with the buffers",
    "combine: expert outputs stored here",
    "overlap: grouped rows copied beside the products",
)
"""Every place where a rank waits for its peers, by wait id (what a timeout names); the last is
the overlapped layer's products waiting for rows copied beside them (forward or backward)."""
_PUSH_WAIT = WAITS.index("dispatch: token rows pushed")
"""The one wait on readiness flags (its `where` is a flag index, not a rank)."""


class _Region:
    """A typed slice of the symmetric buffer: the local view and every rank's element offset."""

    def __init__(self, handle, local: torch.Tensor, byte_offset: int, shape, dtype, rank: int):
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = math.prod(shape)
        self.shape, self.dtype = tuple(shape), dtype
        self.element_offset = byte_offset // itemsize
        self.handle, self.rank = handle, rank
        self._peers: dict[int, torch.Tensor] = {}
        self.local = local[byte_offset : byte_offset + count * itemsize].view(dtype).view(shape)
        base = handle.buffer_ptrs[rank]
        deltas = [(pointer - base) // itemsize for pointer in handle.buffer_ptrs]
        self.offsets = torch.tensor(deltas, dtype=torch.int64, device=local.device)

    def frozen(self) -> PeerTensor:
        return PeerTensor(self.local, self.offsets)

    def peer(self, rank: int) -> torch.Tensor:
        """Rank's copy of this region, as a tensor this process can read and write."""
        if rank not in self._peers:
            view = self.handle.get_buffer(rank, self.shape, self.dtype, self.element_offset)
            self._peers[rank] = view
        return self._peers[rank]


@dataclasses.dataclass(frozen=True)
class PeerTensor:
    """One region of the symmetric buffer as kernels take it: this rank's tensor, and per rank r
    the element offset of r's copy from it (r's copy starts at local.data_ptr() + offsets[r]
    elements, an address this process can use)."""

    local: torch.Tensor
    offsets: torch.Tensor
    """[ep] int64."""


@dataclasses.dataclass(frozen=True)
class SymmetricView:
    """Everything the exchange's kernels take, fixed for the exchange's life: each region of the
    symmetric buffer, the call counter its readiness flags carry (epoch), the barrier's sequence,
    the status word waits record failures in, and the bound of every wait. Kernels (and a fused
    kernel) receive this instead of reaching into the exchange."""

    rank: int
    ep_size: int
    signals: PeerTensor
    """[ep] int64: barrier arrivals."""
    counts: PeerTensor
    """[ep, E + ep] int64: every rank's pair and token counts."""
    pair_meta: PeerTensor
    """[pair_capacity + 1, 2] int64: per grouped row (staging row, return address)."""
    flags: PeerTensor
    """[ep * blocks_per_rank] int32: readiness of pushed token blocks (epoch-stamped)."""
    staging: PeerTensor | None
    """[token_capacity, W]: the tokens this rank receives, once per owner (not overlapped; W the
    dispatched rows' width, `ExchangeShape.dispatch_columns`)."""
    expert_out: PeerTensor | None
    """[pair_capacity, H]: the expert outputs peers pull back (not overlapped)."""
    grad_pairs: PeerTensor | None
    """[T_max * k, H]: the pairs' output gradients owners pull in backward (not with
    `router_values`, unless overlapped)."""
    grad_staging: PeerTensor
    """[token_capacity, H] fp32: per staging row, the sum of its pairs' input gradients (more
    rows where the overlapped layout's copy of x, which shares its memory, needs them)."""
    staging_source: PeerTensor | None
    """[token_capacity + 1, 2] int64 with pull dispatch: (rank, row) each staging row comes from."""
    x_copy: PeerTensor | None
    """[T_max, W] with pull dispatch: this rank's tokens, for the owners to pull. Overlapped: in
    grad_staging's memory, which no forward and backward use at once: a backward writes its
    staging gradients after every rank passed its first barrier, which each passes once its
    earlier forwards' pulls of x are done (its communication stream joined before), and a forward
    writes x after the route's barriers, which each rank passes once its earlier backward's
    pulls of staging gradients are done (joined at the end of that backward)."""
    pair_out: PeerTensor | None
    """[T_max * k, H] overlapped: the outputs of this rank's pairs, stored by their owners; the
    memory of grad_pairs, which no forward and backward use at once: a backward writes its pair
    gradients after its rank's last forward summed its pair outputs (stream order, after the
    wait for every owner's stores), and an owner stores a forward's outputs only after every
    rank passed that forward's barrier, which each passes once its earlier backward's pulls of
    pair gradients are done (its communication stream joined before the barrier)."""
    combine_counts: PeerTensor | None
    """[ep] int32 overlapped: per owner, its rows stored into pair_out (x column tiles)."""
    row_weights: PeerTensor | None
    """[pair_capacity, 1] fp32 with `router_values`: each grouped row's router weight, pushed by
    the token's rank in `unweighted_combine_backward`."""
    row_dots: PeerTensor | None
    """[pair_capacity, 1] fp32 with `router_values`: each grouped row's router-weight dot, for
    the token's rank to pull (`pair_values`). Apart from row_weights: a rank may push the next
    backward's weights into a peer while another still pulls that peer's dots."""
    epoch: torch.Tensor
    """[1] int32: calls of `route` so far."""
    sequence: torch.Tensor
    """[1] int64: barriers so far."""
    status: torch.Tensor
    """The wait status (`mok.kernels.sync.new_status`)."""
    timeout_s: float


@dataclasses.dataclass(frozen=True)
class SymmetricRouting:
    """One call's routing on this rank (device tensors only).

    group_offsets [E_loc + 1] int32: grouped rows per local expert, clipped to the pair capacity.
    recv_tokens / recv_pairs: [1] int64 staging and grouped rows received (clipped). rows: the
    rows of every tensor made for this call with a row per received pair (the grouped rows, their
    gradients, and so the expert products' activations): the pair capacity, or the pairs received
    (at least 1) when `route` read them on the host. On the token's
    side: token_slot [T, ep] (staging row per owner, -1 none or dropped), pair_row [T, k] and
    owner [T, k] (where each pair's output is, -1 dropped). On the owner's side, per grouped row:
    grouped_to_staging, return_rank, return_row (-1 dropped) and flag_index (the readiness flag of
    its token block)."""

    top_k: int
    rows: int
    group_offsets: torch.Tensor
    recv_tokens: torch.Tensor
    recv_pairs: torch.Tensor
    token_slot: torch.Tensor
    pair_row: torch.Tensor
    owner: torch.Tensor
    grouped_to_staging: torch.Tensor
    return_rank: torch.Tensor
    return_row: torch.Tensor
    flag_index: torch.Tensor


class SymmetricExchangeBase:
    """What the exchanges of every buffer layout share: the symmetric buffer, the route, the
    barriers and bounded waits, and the dispatch's backward. A layout is staged or overlapped,
    with the pair gradients or the router values; each has its class (`exchange_class`),
    composed of the layout's part (`_StagedSymmetricExchange`, `_OverlappedSymmetricExchange`)
    and the backward form's (`_PairGradients`, `_RouterValues`), so that every method it has
    works in its layout.

    Collective: all ranks create an exchange together and make the same calls in the same
    order. `programs` is the number of SMs the NVLink copies use; local copies use every SM.
    `timeout_s` bounds every wait on a peer. `memory` gives the buffers (None:
    `mok.comm.memory.symmetric_memory()`, PyTorch's symmetric memory unless a test stands in
    for it).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        shape: ExchangeShape,
        device: torch.device,
        programs: int = 24,
        memory: SymmetricMemory | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        if exchange_class(shape) is not type(self):
            raise ValueError(
                f"{type(self).__name__} takes another buffer layout: this shape is "
                f"{exchange_class(shape).__name__}'s (symmetric_exchange picks the class of a "
                "shape)"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.ep_size = group_rank_and_size(self.group)
        self.shape, self.device, self.programs = shape, device, programs
        self._constants = DeviceConstants()
        on_gpu = device.type == "cuda"
        self.local_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 4
        )
        ep, s = self.ep_size, shape
        layout = buffer_layout(shape, ep)
        offsets, total = {}, 0
        for (name, _, _), nbytes in zip(layout, region_bytes(layout).values(), strict=True):
            offsets[name] = total
            total += nbytes
        memory = memory or symmetric_memory()
        self._outside_allocator = not memory.counted_by_allocator
        self._buffer, self._handle = memory.allocate(total, device, self.group)
        self._regions = {
            name: _Region(self._handle, self._buffer, offsets[name], dims, dtype, self.rank)
            for name, dims, dtype in layout
        }
        if s.overlapped and s.pull_dispatch:
            self._regions["x_copy"] = _Region(
                self._handle,
                self._buffer,
                offsets["grad_staging"],
                (s.max_tokens, s.dispatch_columns),
                s.dtype,
                self.rank,
            )
        frozen = {name: region.frozen() for name, region in self._regions.items()}
        self.view = SymmetricView(
            rank=self.rank,
            ep_size=ep,
            staging_source=frozen.pop("staging_source", None),
            x_copy=frozen.pop("x_copy", None),
            staging=frozen.pop("staging", None),
            expert_out=frozen.pop("expert_out", None),
            pair_out=frozen["grad_pairs"] if s.overlapped else None,
            grad_pairs=frozen.pop("grad_pairs", None),
            combine_counts=frozen.pop("combine_counts", None),
            row_weights=frozen.pop("row_weights", None),
            row_dots=frozen.pop("row_dots", None),
            **frozen,
            epoch=torch.zeros(1, dtype=torch.int32, device=device),
            sequence=torch.zeros(1, dtype=torch.int64, device=device),
            status=new_status(device),
            timeout_s=timeout_s,
        )
        self.overflowed = torch.zeros(1, dtype=torch.bool, device=device)
        self.most_needed = torch.zeros(2, dtype=torch.int64, device=device)
        self.placement_kernels = PlacementKernels(ep, s.local_experts, s.top_k, device)
        self._layout_flags = self._make_local_flags()
        self._restart()

    def _make_local_flags(self) -> tuple[torch.Tensor, ...]:
        """This rank's flags and epochs beyond the buffer's that the layout needs (made once,
        zeroed with the buffer's by `_restart`)."""
        return ()

    def _restart(self) -> None:
        """Zero this rank's flags, signals, epochs, barrier sequence and status between two
        meetings of every rank on the host: the first once every rank's queued work (which may
        still write into its peers' flags) is done, the second once every rank has zeroed (no
        peer may signal into a buffer not yet zeroed). A layout's own flags go too
        (`_make_local_flags`): the epochs restart, and a flag left at a value they reach again
        would pass before its rows."""
        self._finish_queued_work()
        raise_if_any_rank_failed(None, self.group)
        for tensor in (
            self.view.flags.local,
            self.view.signals.local,
            self.view.epoch,
            self.view.sequence,
            *self._layout_flags,
        ):
            tensor.zero_()
        self.view.status.zero_()
        self._finish_queued_work()
        raise_if_any_rank_failed(None, self.group)

    def _finish_queued_work(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @staticmethod
    def unavailable_reason(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
        """None if this exchange can run for `group` on `device`, else why not. Collective (the
        ranks compare their host names). What the buffers' provider allows
        (`mok.comm.memory.SymmetricMemory.unavailable_reason`)."""
        if not dist.is_available() or not dist.is_initialized():
            return "no torch.distributed process group"
        return symmetric_memory().unavailable_reason(group, device)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of this rank's symmetric buffer (every region)."""
        return self._buffer.numel()

    @property
    def bytes_outside_allocator(self) -> int:
        """Bytes of this rank's buffer that PyTorch's caching allocator does not count: all of
        them from symmetric memory (mapped by its own allocator), none from a stand-in."""
        return self.buffer_bytes if self._outside_allocator else 0

    @property
    def handle(self):
        """The symmetric buffer's handle (`buffer_ptrs`, `get_buffer`), from its allocator."""
        return self._handle

    def release(self) -> None:
        """Free the symmetric buffers (collective; the exchange cannot be used afterwards)."""
        self._barrier("release: peers done with the buffers")
        self.view = self._regions = None
        self._handle = self._buffer = None

    def peer(self, region: str, rank: int) -> torch.Tensor:
        """Rank's copy of a region (a `SymmetricView` field name) as a tensor this process can
        read and write (for copies by the copy engine)."""
        return self._regions[region].peer(rank)

    def _barrier(self, wait: str) -> None:
        barrier(
            self.view.signals.local,
            self.view.signals.offsets,
            self.view.sequence,
            self.view.status,
            self.rank,
            self.view.timeout_s,
            WAITS.index(wait),
        )

    def reset(self) -> None:
        """Make the exchange usable again after a MoKTimeoutError: every rank calls it together
        (collective, on the host; it waits for this rank's queued work, which every bounded wait
        lets finish). Not possible while a rank is gone: then rebuild the process group."""
        self._restart()
        self.overflowed.zero_()
        self.most_needed.zero_()

    def check(self) -> None:
        """Raise MoKTimeoutError if a wait on a peer failed (until `reset`), else
        MoKCapacityError if any call since the last check dropped rows (synchronizes)."""
        code, wait_id, where, seen = self.view.status.tolist()
        if code:
            raise MoKTimeoutError(self._failure(code, wait_id, where, seen))
        if bool(self.overflowed.item()):
            tokens, pairs = self.most_needed.tolist()
            self.overflowed.zero_()
            self.most_needed.zero_()
            raise MoKCapacityError(
                f"a rank was routed {tokens} tokens / {pairs} pairs but its receive buffers hold "
                f"{self.shape.token_capacity} / {self.shape.pair_capacity}: rows were dropped. "
                "Raise MoKConfig.recv_capacity (tokens) or recv_pair_capacity (pairs); None sizes "
                "them for the worst case."
            )

    def _failure(self, code: int, wait_id: int, where: int, seen: int) -> str:
        """The message of a failed wait recorded in the status."""
        wait = WAITS[wait_id] if 0 <= wait_id < len(WAITS) else f"wait {wait_id}"
        if wait == "overlap: grouped rows copied beside the products":
            return (
                f"rank {self.rank} gave up waiting for its own copy of grouped rows (block "
                f"{where}, seen {seen}) beside the expert kernels after {self.view.timeout_s:g} s "
                "(a peer's rows never came, or another kernel held the copy's SMs)."
                + " Every rank must call Workspace.reset() before the next call."
            )
        flags = wait_id == _PUSH_WAIT
        peer = where // self.shape.blocks_per_rank if flags else where
        after = (
            " Every rank must call Workspace.reset() (for a mok.MoE: layer.workspace(device)"
            ".reset()) before the next call; "
            "if a rank is gone, rebuild the process group instead."
        )
        if code == OUT_OF_STEP:
            ahead = f"flag {where} at exchange {seen}" if flags else f"{seen} barriers ahead"
            return (
                f"rank {self.rank} found rank {peer} out of step at '{wait}' ({ahead}): the ranks' "
                "calls diverged (a rank skipped or repeated a call, or routed with another config)."
                + after
            )
        if code == TIMED_OUT:
            return (
                f"rank {self.rank} gave up waiting for rank {peer} at '{wait}' after "
                f"{self.view.timeout_s:g} s (MoKConfig.peer_timeout_s): the peer never arrived (it "
                "crashed, skipped a call, or is slower than the timeout allows)." + after
            )
        return f"rank {self.rank}: unknown failure code {code} at '{wait}'." + after

    def route(self, topk_idx: torch.Tensor, exact_rows: bool = False) -> SymmetricRouting:
        """Exchange counts and pair addresses for topk_idx [T, k] (T <= max_tokens). Collective.
        exact_rows: read the pairs received on the host (a device synchronization, not allowed
        under CUDA-graph capture) and size the call's per-pair tensors by them (`rows`)."""
        s, rank = self.shape, self.rank
        if exact_rows and topk_idx.is_cuda and torch.cuda.is_current_stream_capturing():
            raise MoKInputError(
                "MoKTuning.exact_buffers reads each call's received pairs on the host, which a "
                "CUDA graph cannot capture: capture with exact_buffers=False"
            )
        tokens, top_k = topk_idx.shape
        if tokens > s.max_tokens or top_k != s.top_k:
            raise MoKInputError(
                f"topk_idx has shape {tuple(topk_idx.shape)}; this exchange takes at most "
                f"{s.max_tokens} tokens with top_k={s.top_k}"
            )
        topk_idx = topk_idx.contiguous()
        self.view.epoch.add_(1)
        block_counts = self.placement_kernels.count(
            topk_idx, self.view.counts.local, self.view.counts.offsets, rank
        )
        self._barrier("route: every rank's counts written")
        # Peers overwrite these counts only in their next route, after this rank's second barrier.
        placement = self.placement_kernels.place(
            topk_idx,
            block_counts,
            self.view.counts.local,
            rank,
            s.token_capacity,
            s.pair_capacity,
            self.overflowed,
            self.most_needed,
            s.max_tokens,
            meta=(self.view.pair_meta.local, self.view.pair_meta.offsets),
            source=(self.view.staging_source.local, self.view.staging_source.offsets)
            if s.pull_dispatch
            else None,
        )
        self._barrier("route: the pair addresses written")
        rows = owner_rows(
            self.view.pair_meta.local[: s.pair_capacity],
            placement.recv_pairs,
            s.max_tokens * top_k,
            top_k,
            s.block_tokens,
            s.blocks_per_rank,
        )
        # The one synchronization of exact_rows: the host waits for the routing's counts.
        pairs = max(int(placement.recv_pairs.item()), 1) if exact_rows else s.pair_capacity
        return SymmetricRouting(
            top_k=top_k,
            rows=pairs,
            group_offsets=placement.group_offsets,
            recv_tokens=placement.recv_tokens,
            recv_pairs=placement.recv_pairs,
            token_slot=placement.token_slot,
            pair_row=placement.pair_row,
            owner=placement.owner,
            grouped_to_staging=rows.grouped_to_staging,
            return_rank=rows.return_rank,
            return_row=rows.return_row,
            flag_index=rows.flag_index,
        )

    def _token_sources(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, rank) in its sender's copy of x of each staging row (this call's route wrote
        them: read before the next route, which overwrites them)."""
        source = self.view.staging_source.local[: self.shape.token_capacity]
        return source[:, 1].contiguous(), source[:, 0].contiguous()

    def _pull_tokens(self, out: torch.Tensor, sources, count: torch.Tensor, programs: int) -> None:
        """Load the first `count` staging rows' tokens from their senders' copies of x into `out`
        [token_capacity, W], on `programs` programs (`sources`: `_token_sources`)."""
        source_row, source_rank = sources
        copy_rows(
            out,
            self.view.x_copy.local,
            source_row,
            count,
            programs,
            COPY_ROWS,
            src_offsets=self.view.x_copy.offsets,
            src_rank=source_rank,
            **COPY_TILE,
        )

    def _push_tokens(self, x: torch.Tensor, routing: SymmetricRouting, programs: int) -> None:
        """Store this rank's token rows x into their owners' staging (once per token and owner)
        on `programs` programs, setting a readiness flag per block of tokens on each owner."""
        s = self.shape
        push_rows(
            x,
            routing.token_slot,
            self.view.staging.local,
            self.view.staging.offsets,
            programs,
            s.block_tokens,
            flags=self.view.flags.local,
            flag_offsets=self.view.flags.offsets,
            flag_base=self.rank * s.blocks_per_rank,
            epoch=self.view.epoch,
            **PUSH_TILE,
        )

    def _pushed_rows_waits(self, routing: SymmetricRouting, timeout_s: float) -> dict:
        """`copy_rows`' arguments that make the expand of staging rows wait, bounded by
        timeout_s, for the flags of the blocks `_push_tokens` stores them in."""
        return {
            "flags": self.view.flags.local,
            "wait": routing.flag_index,
            "epoch": self.view.epoch,
            "status": self.view.status,
            "timeout_s": timeout_s,
            "wait_id": _PUSH_WAIT,
        }

    def tokens_of_grouped_rows(self, routing: SymmetricRouting) -> None:
        """None: the grouped rows are the tokens other ranks sent (`received_tokens` keeps
        those once each)."""
        return None

    def _row_count(self, rows: int) -> torch.Tensor:
        """A [1] device tensor holding `rows` (the copy kernels read their row count there)."""
        return self._constants.get(
            ("count", rows), lambda: torch.full((1,), rows, dtype=torch.int64, device=self.device)
        )

    def _owner_of_part(self, tokens: int) -> torch.Tensor:
        """[tokens * ep]: rank d for row t * ep + d."""
        return self._constants.get(
            ("owner of part", tokens),
            lambda: torch.arange(self.ep_size, device=self.device).repeat(tokens),
        )

    def _part_rows(self, tokens: int) -> torch.Tensor:
        """[tokens, ep]: row t * ep + d of a [tokens * ep, H] matrix holds owner d's part."""
        ep = self.ep_size
        return self._constants.get(
            ("part rows", tokens),
            lambda: torch.arange(tokens * ep, device=self.device).view(tokens, ep),
        )

    def _pair_rows(self, tokens: int) -> torch.Tensor:
        """[tokens, k]: row t * k + j of a [tokens * k, H] matrix holds pair (t, j)."""
        top_k = self.shape.top_k
        return self._constants.get(
            ("pair rows", tokens),
            lambda: torch.arange(tokens * top_k, device=self.device).view(tokens, top_k),
        )

    def dispatch_backward(
        self,
        routing: SymmetricRouting,
        grad_grouped: torch.Tensor,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """grad of x [T, H] from the grads of the grouped rows (first recv_pairs valid): summed
        in fp32 per staging row (ascending grouped row), then per token over owners (ascending
        rank), plus `extra` last, rounded once; the values of `CollectiveExchange`. The sums on
        every SM, the pull of the owners' rows on the exchange's `programs`."""
        s = self.shape
        self._sum_staging_gradients(routing, grad_grouped, self.local_sms)
        self._barrier("dispatch backward: staging gradients summed")
        tokens, ep = routing.token_slot.shape
        parts = torch.empty(tokens * ep, s.hidden, dtype=torch.float32, device=self.device)
        copy_rows(
            parts,
            self.view.grad_staging.local,
            routing.token_slot.view(-1),
            self._row_count(parts.shape[0]),
            self.programs,
            COPY_ROWS,
            src_offsets=self.view.grad_staging.offsets,
            src_rank=self._owner_of_part(tokens),
            **COPY_TILE,
        )
        grad_x = torch.empty(tokens, s.hidden, dtype=grad_grouped.dtype, device=self.device)
        part_rows = torch.where(routing.token_slot >= 0, self._part_rows(tokens), -1)
        reduce_rows(
            grad_x,
            parts,
            part_rows,
            self.local_sms,
            tail=None if extra is None else extra.contiguous(),
            **LOCAL_SUM,
        )
        return grad_x

    def _sum_staging_gradients(
        self, routing: SymmetricRouting, grad_grouped: torch.Tensor, programs: int
    ) -> None:
        """grad_staging[r] = the fp32 sum of the grads of the grouped rows read from staging row
        r, ascending grouped row, for the staging rows received (peers read it after a barrier)."""
        s = self.shape
        fan_in = staging_fan_in(
            routing.grouped_to_staging,
            routing.recv_pairs,
            s.token_capacity,
            s.top_k,  # not min(k, E_loc): a token may pick one expert more than once
        )
        reduce_rows(
            self.view.grad_staging.local,
            grad_grouped,
            fan_in,
            programs,
            count=routing.recv_tokens,
            **LOCAL_SUM,
        )


class _StagedSymmetricExchange(SymmetricExchangeBase):
    """Dispatch and combine of one expert-parallel group over NVLink symmetric memory, in the
    staged layout (the `triton` backend's): each call's copies run before or after the expert
    products, through the staging and expert-output regions.

    The API of `CollectiveExchange`, except that row counts stay on the device: `dispatch` returns
    [pair_capacity, H] grouped rows of which the first `routing.recv_pairs` are valid (or as many
    rows as were received, read on the host, after `route(..., exact_rows=True)`). Arguments as
    `SymmetricExchangeBase`'s.
    """

    def dispatch(self, routing: SymmetricRouting, x: torch.Tensor) -> torch.Tensor:
        """Rows x [T, W] -> grouped rows [routing.rows, W] (first recv_pairs valid); W the
        shape's dispatch_columns, of its dtype."""
        s = self.shape
        if x.dim() != 2 or x.shape[1] != s.dispatch_columns or x.dtype != s.dtype:
            raise ValueError(
                f"SymmetricExchange.dispatch takes rows of {s.dispatch_columns} {s.dtype} "
                f"elements, got {tuple(x.shape)} {x.dtype}"
            )
        x = x.contiguous()
        if s.pull_dispatch:
            self.view.x_copy.local[: x.shape[0]].copy_(x)
            self._barrier("dispatch: x copied for pulling")
            self._pull_tokens(
                self.view.staging.local, self._token_sources(), routing.recv_tokens, self.programs
            )
            waits = {}
        else:
            self._push_tokens(x, routing, self.programs)
            waits = self._pushed_rows_waits(routing, self.view.timeout_s)
        grouped = torch.empty(routing.rows, s.dispatch_columns, dtype=x.dtype, device=x.device)
        copy_rows(
            grouped,
            self.view.staging.local,
            routing.grouped_to_staging,
            routing.recv_pairs,
            self.local_sms,
            COPY_ROWS,
            **waits,
            **COPY_TILE,
        )
        return grouped

    def expert_output_buffer(self) -> torch.Tensor:
        """[pair_capacity, H]: where the expert GEMM may write its outputs so combine copies
        nothing. Valid until the next `route`."""
        return self.view.expert_out.local

    def combine(
        self,
        routing: SymmetricRouting,
        expert_out: torch.Tensor,
        topk_weights: torch.Tensor,
        shared_out: torch.Tensor | None = None,
        save_pair_out: bool = True,
        pair_out_mx: ScaleRounding | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | MXRows | None]:
        """y [T, H] from the grouped expert outputs (first recv_pairs rows), in the reference's
        order; also the pairs' outputs [T, k, H] (for combine_backward) when save_pair_out, or
        with pair_out_mx their MXFP8 cast along H (`MXRows` [T * k, H], made by the sum's pass)."""
        s = self.shape
        buffer = self.view.expert_out.local
        if expert_out.data_ptr() != buffer.data_ptr():
            rows = min(expert_out.shape[0], s.pair_capacity)
            buffer[:rows].copy_(expert_out[:rows])
        self._barrier("combine: expert outputs written")
        tokens = routing.pair_row.shape[0]
        pair_out = torch.empty(tokens, s.top_k, s.hidden, dtype=buffer.dtype, device=self.device)
        pairs = pair_out.view(-1, s.hidden)
        copy_rows(
            pairs,
            buffer,
            routing.pair_row.view(-1),
            self._row_count(pairs.shape[0]),
            self.programs,
            COPY_ROWS,
            src_offsets=self.view.expert_out.offsets,
            src_rank=routing.owner.view(-1),
            **COPY_TILE,
        )
        y = torch.empty(tokens, s.hidden, dtype=buffer.dtype, device=self.device)
        gathered = None
        if save_pair_out and pair_out_mx is not None:
            gathered = MXRows.empty(pairs.shape[0], s.hidden, self.device)
        reduce_rows(
            y,
            pairs,
            self._pair_rows(tokens),
            self.local_sms,
            weight=topk_weights.contiguous(),
            init=None if shared_out is None else shared_out.contiguous(),
            gathered=gathered,
            gathered_rounding=pair_out_mx or ScaleRounding.RCEIL,
            **LOCAL_SUM,
        )
        if gathered is not None:
            return y, gathered
        return y, pair_out if save_pair_out else None


class _OverlappedSymmetricExchange(SymmetricExchangeBase):
    """The exchange of the overlapped layer (the `fused` backend) over NVLink symmetric memory,
    in the overlapped layout: the copies run on the caller's communication stream beside the
    expert products, which wait per tile for their rows (`OverlappedExchangeBase`), and the down
    product stores each output straight into its token's rank. Arguments as
    `SymmetricExchangeBase`'s."""

    def _make_local_flags(self) -> tuple[torch.Tensor, ...]:
        # Readiness of the grouped rows copied beside the products (local): forward's stamped
        # with the routing epoch, backward's with a count of backward calls (two backwards may
        # follow one route: layers of one shape share the exchange).
        blocks = triton.cdiv(self.shape.pair_capacity, COPY_ROWS)
        self.landed = torch.zeros(blocks, dtype=torch.int32, device=self.device)
        self.landed_backward = torch.zeros(blocks, dtype=torch.int32, device=self.device)
        self.backward_epoch = torch.zeros(1, dtype=torch.int32, device=self.device)
        return (self.landed, self.landed_backward, self.backward_epoch)

    def dispatch_overlapped(
        self, routing: SymmetricRouting, x: torch.Tensor, programs: int, timeout_s: float
    ) -> tuple[torch.Tensor, Callable[[], None], RowsReady]:
        """The overlapped layout's dispatch (collective), in two parts: on the current stream,
        x goes into this rank's symmetric copy and the ranks meet (a barrier); then the returned
        `pull` callable, run on the caller's communication stream, has `programs` programs
        load each grouped row from its token's rank in grouped order, flagging every block of
        COPY_ROWS rows once written (the RowsReady the gate/up product waits on beside it).
        Returns (grouped rows [routing.rows, H], first recv_pairs valid; pull; ready)."""
        s = self.shape
        if not s.pull_dispatch:
            return self._push_overlapped(routing, x, programs, timeout_s)
        self.view.x_copy.local[: x.shape[0]].copy_(x)
        # Owners add into these counts only after the barrier below.
        self.view.combine_counts.local.zero_()
        self._barrier("dispatch: x copied for pulling")
        grouped = torch.empty(routing.rows, s.hidden, dtype=x.dtype, device=x.device)

        def pull() -> None:
            staging = routing.grouped_to_staging
            source = self.view.staging_source.local[staging.clamp(min=0)]
            source_row = torch.where(staging >= 0, source[:, 1], -1)
            source_rank = source[:, 0].contiguous()
            copy_rows(
                grouped,
                self.view.x_copy.local,
                source_row,
                routing.recv_pairs,
                programs,
                COPY_ROWS,
                src_offsets=self.view.x_copy.offsets,
                src_rank=source_rank,
                epoch=self.view.epoch,
                landed=self.landed,
                **COPY_TILE,
            )

        ready = self._copied_rows(self.landed, self.view.epoch, timeout_s)
        return grouped, pull, ready

    def received_tokens(self, routing: SymmetricRouting, programs: int) -> ReceivedTokens | None:
        """The tokens this rank received, each once ([token_capacity, H]), loaded from the
        senders' copies of x by `pull` on `programs` programs, and each grouped row's place among
        them (its staging row). Taken where the grouped rows are sized by the pair capacity and
        the tokens take fewer rows (by default: EP x T tokens against EP x T x k pairs), with the
        overlapped layout's pull dispatch (whose x copies `pull` reads); else None."""
        s, rows = self.shape, routing.rows
        exact = rows < s.pair_capacity
        if not (s.overlapped and s.pull_dispatch) or exact or s.token_capacity >= rows:
            return None
        tokens = torch.empty(s.token_capacity, s.hidden, dtype=s.dtype, device=self.device)

        def pull() -> None:
            self._pull_tokens(tokens, self._token_sources(), routing.recv_tokens, programs)

        index = routing.grouped_to_staging[:rows].to(torch.int32)
        return ReceivedTokens(tokens, index, pull)

    def _copied_rows(self, flags: torch.Tensor, epoch: torch.Tensor, timeout_s: float) -> RowsReady:
        """The readiness of grouped rows that a copy beside the products flags per COPY_ROWS."""
        wait_id = WAITS.index("overlap: grouped rows copied beside the products")
        return RowsReady(flags, COPY_ROWS, epoch, self.view.status, timeout_s, wait_id)

    def _push_overlapped(
        self, routing: SymmetricRouting, x: torch.Tensor, programs: int, timeout_s: float
    ) -> tuple[torch.Tensor, Callable[[], None], RowsReady]:
        """`dispatch_overlapped` by push: `pull` (on the communication stream) stores this rank's
        token rows into the owners' staging (once per token and owner, a readiness flag per
        block of tokens set on each owner), then expands the staging rows into the grouped order
        as their blocks land (waiting on those flags, bounded), flagging every COPY_ROWS grouped
        rows once written. No barrier: the route's barriers already order these stores after
        every owner's last read of its staging, and the owners' adds into this rank's combine
        counts come only for rows this push delivers, after the zeroing below."""
        s = self.shape
        x = x.contiguous()
        self.view.combine_counts.local.zero_()
        grouped = torch.empty(routing.rows, s.hidden, dtype=x.dtype, device=x.device)

        def pull() -> None:
            self._push_tokens(x, routing, programs)
            copy_rows(
                grouped,
                self.view.staging.local,
                routing.grouped_to_staging,
                routing.recv_pairs,
                programs,
                COPY_ROWS,
                landed=self.landed,
                **self._pushed_rows_waits(routing, timeout_s),
                **COPY_TILE,
            )

        ready = self._copied_rows(self.landed, self.view.epoch, timeout_s)
        return grouped, pull, ready

    def combine_target(
        self, routing: SymmetricRouting, hidden: int, dtype: torch.dtype
    ) -> RowScatter:
        """Where the down product's peer-store epilogue puts each grouped row's output: row
        t * k + j of the token's rank's pair_out (overlapped layout), counted there per owner."""
        return RowScatter(
            out=self.view.pair_out.local,
            out_offsets=self.view.pair_out.offsets,
            dest_rank=routing.return_rank[: routing.rows].to(torch.int32),
            dest_row=routing.return_row[: routing.rows].to(torch.int32),
            counts=self.view.combine_counts.local,
            counts_offsets=self.view.combine_counts.offsets,
            rank=self.rank,
        )

    def combine_landed(
        self,
        routing: SymmetricRouting,
        target: RowScatter,
        column_tiles: int,
        topk_weights: torch.Tensor,
        shared_out: torch.Tensor | None,
        timeout_s: float,
        save_pair_out: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y [T, H], the pairs' outputs [T, k, H] when save_pair_out) once every owner stored
        this rank's pairs (column_tiles adds per row): `combine`'s values, in its order."""
        s = self.shape
        tokens = routing.owner.shape[0]
        owner = routing.owner.view(-1)
        kept = routing.pair_row.view(-1) >= 0  # pairs dropped for capacity never come back
        expected = torch.zeros(self.ep_size, dtype=torch.int32, device=self.device)
        expected.scatter_add_(0, owner, kept.to(torch.int32))
        await_counts(
            target.counts,
            expected * column_tiles,
            self.view.status,
            timeout_s,
            WAITS.index("combine: expert outputs stored here"),
        )
        rows = torch.arange(tokens * s.top_k, device=self.device)
        pair_rows = torch.where(kept, rows, -1).view(tokens, s.top_k)
        pair_out = None
        if save_pair_out:
            pair_out = torch.empty(tokens, s.top_k, s.hidden, dtype=s.dtype, device=self.device)
        y = torch.empty(tokens, s.hidden, dtype=s.dtype, device=self.device)
        reduce_rows(
            y,
            target.out,
            pair_rows,
            self.local_sms,
            weight=topk_weights.contiguous(),
            init=None if shared_out is None else shared_out.contiguous(),
            gathered=pair_out,
            **LOCAL_SUM,
        )
        return y, pair_out

    def dispatch_backward_overlapped(
        self,
        routing: SymmetricRouting,
        grad_grouped: torch.Tensor,
        extra: torch.Tensor | None,
        programs: int,
    ) -> Callable[[], torch.Tensor]:
        """`dispatch_backward` in two parts: on the current stream, on every SM, the owner's sums
        per staging row (after which grad_grouped is no longer read: the caller may drop it
        before the products that follow); the returned callable, run on the caller's
        communication stream on `programs` SMs, has the ranks meet and each token's rank sum its
        owners' rows straight from their buffers (no gathered copy), and returns grad x [T, H]:
        the same values, in the same order."""
        s, dtype = self.shape, grad_grouped.dtype
        self._sum_staging_gradients(routing, grad_grouped, self.local_sms)
        tail = None if extra is None else extra.contiguous()

        def give_back() -> torch.Tensor:  # holds no reference to grad_grouped
            self._barrier("dispatch backward: staging gradients summed")
            tokens = routing.token_slot.shape[0]
            grad_x = torch.empty(tokens, s.hidden, dtype=dtype, device=self.device)
            reduce_rows(
                grad_x,
                self.view.grad_staging.local,
                routing.token_slot,
                programs,
                src_offsets=self.view.grad_staging.offsets,
                rank_is_column=True,
                tail=tail,
                **LOCAL_SUM,
            )
            return grad_x

        return give_back


class _PairGradients:
    """The backward of `router_gradient="saved_outputs"`: each pair's gradient w * grad_y formed
    on the token's rank (with the router weights' gradient from the saved pair outputs) and
    loaded by its owner (the layouts with a pair-gradient region)."""

    def _pair_gradients_and_pull(
        self,
        routing: SymmetricRouting,
        grad_y: torch.Tensor,
        topk_weights: torch.Tensor,
        pair_out: torch.Tensor | MXRows,
        programs: int,
        landed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, Callable[[], None], torch.Tensor]:
        """The pair gradients written into this rank's buffer and the ranks met (on the current
        stream); returns (the grouped rows' gradients [routing.rows, H], yet to be loaded by
        `pull` on `programs` programs from each row's token rank, with `landed` = (epoch, flags)
        the epoch advanced first and every block of COPY_ROWS rows flagged with it once written;
        the router weights' gradient [T, k])."""
        s = self.shape
        tokens = grad_y.shape[0]
        grad_w = pair_gradients(
            grad_y.contiguous(),
            topk_weights.contiguous(),
            pair_out,
            self.view.grad_pairs.local[: tokens * s.top_k],
            PAIR_GRADIENT_PROGRAMS_PER_SM * self.local_sms,
        )
        if landed is not None:
            landed[0].add_(1)
        self._barrier("combine backward: pair gradients written")
        grad_grouped = torch.empty(routing.rows, s.hidden, dtype=grad_y.dtype, device=self.device)
        flags = {} if landed is None else {"epoch": landed[0], "landed": landed[1]}

        def pull() -> None:
            copy_rows(
                grad_grouped,
                self.view.grad_pairs.local,
                routing.return_row,
                routing.recv_pairs,
                programs,
                COPY_ROWS,
                src_offsets=self.view.grad_pairs.offsets,
                src_rank=routing.return_rank,
                **flags,
                **COPY_TILE,
            )

        return grad_grouped, pull, grad_w


class _RouterValues:
    """The backward of `router_gradient="epilogue"`: grad_y's rows cross unweighted, each pair's
    weight goes to its owner's `row_weights`, and each grouped row's dot comes back from
    `row_dots` (the layouts with `router_values`)."""

    def _push_row_weights(self, routing: SymmetricRouting, topk_weights: torch.Tensor) -> None:
        """Store each pair's weight (fp32) at its grouped row of its owner's row_weights (pairs
        dropped for capacity skipped); the owners read them after the next barrier."""
        view, tokens = self.view, topk_weights.shape[0]
        copy_rows(
            view.row_weights.local,
            topk_weights.float().reshape(-1, 1).contiguous(),
            self._pair_rows(tokens).view(-1),
            self._row_count(tokens * self.shape.top_k),
            self.programs,
            COPY_ROWS,
            dst_row=routing.pair_row.view(-1),
            dst_offsets=view.row_weights.offsets,
            dst_rank=routing.owner.view(-1),
            **COPY_TILE,
        )

    def pair_values(self, routing: SymmetricRouting, row_values: torch.Tensor) -> torch.Tensor:
        """[T, k] fp32: each pair's value of row_values [routing.rows] fp32 (first recv_pairs
        valid) on its owner, 0 for pairs dropped for capacity. Collective (a barrier)."""
        view = self.view
        rows = min(row_values.shape[0], self.shape.pair_capacity)
        view.row_dots.local[:rows, 0].copy_(row_values[:rows])
        self._barrier("combine backward: the rows' router-weight dots written")
        tokens, top_k = routing.pair_row.shape
        values = torch.empty(tokens * top_k, 1, dtype=torch.float32, device=self.device)
        copy_rows(
            values,
            view.row_dots.local,
            routing.pair_row.view(-1),
            self._row_count(tokens * top_k),
            self.programs,
            COPY_ROWS,
            src_offsets=view.row_dots.offsets,
            src_rank=routing.owner.view(-1),
            **COPY_TILE,
        )
        return values.view(tokens, top_k)


class SymmetricExchange(_PairGradients, _StagedSymmetricExchange):
    """The staged layout with the pair gradients (`router_gradient="saved_outputs"`): the
    `triton` backend's exchange (`Exchange`)."""

    def combine_backward(
        self,
        routing: SymmetricRouting,
        grad_y: torch.Tensor,
        topk_weights: torch.Tensor,
        pair_out: torch.Tensor | MXRows,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(grads of the grouped expert outputs [routing.rows, H], grad of topk_weights [T, k]):
        the values of `CollectiveExchange.combine_backward` (the router-weight gradients up to
        the summation order of their fp32 dot products); pair_out as `combine` saved it."""
        grad_grouped, pull, grad_w = self._pair_gradients_and_pull(
            routing, grad_y, topk_weights, pair_out, self.programs
        )
        pull()
        return grad_grouped, grad_w


class SymmetricRouterValuesExchange(_RouterValues, _StagedSymmetricExchange):
    """The staged layout with the router values (`router_gradient="epilogue"`): the `triton`
    backend's exchange of that form (`RouterValuesExchange`)."""

    def unweighted_combine_backward(
        self, routing: SymmetricRouting, grad_y: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(grad_y's row of each grouped row's token [routing.rows, H], first recv_pairs valid;
        each grouped row's pair's weight [routing.rows] fp32): the values of
        `CollectiveExchange.unweighted_combine_backward`.

        Each token's row goes once to each owner, into its staging rows: nothing reads staging
        between a forward's expand, done before that forward's combine barrier, and the next
        route (a push dispatch writes it only after the route's barriers). No readiness flags:
        the epoch's are the forward dispatch's already, so the barrier orders the stores."""
        s, view = self.shape, self.view
        if grad_y.dim() != 2 or grad_y.shape[1] != s.dispatch_columns or grad_y.dtype != s.dtype:
            raise ValueError(
                f"SymmetricRouterValuesExchange.unweighted_combine_backward takes rows of "
                f"{s.dispatch_columns} {s.dtype} elements, got {tuple(grad_y.shape)} {grad_y.dtype}"
            )
        push_rows(
            grad_y.contiguous(),
            routing.token_slot,
            view.staging.local,
            view.staging.offsets,
            self.programs,
            s.block_tokens,
            **PUSH_TILE,
        )
        self._push_row_weights(routing, topk_weights)
        self._barrier("combine backward: gradient rows and router weights pushed")
        grad_rows = torch.empty(routing.rows, s.hidden, dtype=grad_y.dtype, device=self.device)
        copy_rows(
            grad_rows,
            view.staging.local,
            routing.grouped_to_staging,
            routing.recv_pairs,
            self.local_sms,
            COPY_ROWS,
            **COPY_TILE,
        )
        # A copy: the next backward's pushes rewrite the region once every rank passed this
        # one's `pair_values` barrier, and the caller may keep the weights longer.
        weights = view.row_weights.local[: routing.rows, 0].clone()
        return grad_rows, weights


class OverlappedSymmetricExchange(_PairGradients, _OverlappedSymmetricExchange):
    """The overlapped layout with the pair gradients: the `fused` backend's exchange
    (`OverlappedExchange`)."""

    def combine_backward_overlapped(
        self,
        routing: SymmetricRouting,
        grad_y: torch.Tensor,
        topk_weights: torch.Tensor,
        pair_out: torch.Tensor,
        programs: int,
        timeout_s: float,
    ) -> tuple[torch.Tensor, Callable[[], None], RowsReady | None, torch.Tensor]:
        """`combine_backward` with its pull beside the products: on the current stream the pair
        gradients go into this rank's symmetric buffer and the ranks meet; the returned `pull`,
        run on the caller's communication stream, has `programs` programs load each grouped
        row's gradient from its token's rank in grouped order, flagging every block of
        COPY_ROWS rows once written. Returns (gradients of the grouped rows [routing.rows, H],
        pull, their RowsReady, the router weights' gradient [T, k])."""
        grad_grouped, pull, grad_w = self._pair_gradients_and_pull(
            routing,
            grad_y,
            topk_weights,
            pair_out,
            programs,
            landed=(self.backward_epoch, self.landed_backward),
        )
        ready = self._copied_rows(self.landed_backward, self.backward_epoch, timeout_s)
        return grad_grouped, pull, ready, grad_w


class OverlappedSymmetricRouterValuesExchange(_RouterValues, _OverlappedSymmetricExchange):
    """The overlapped layout with the router values: the `fused` backend's exchange of the
    epilogue form (`OverlappedRouterValuesExchange`)."""

    def unweighted_combine_backward_overlapped(
        self,
        routing: SymmetricRouting,
        grad_y: torch.Tensor,
        topk_weights: torch.Tensor,
        programs: int,
        timeout_s: float,
    ) -> tuple[torch.Tensor, Callable[[], None], RowsReady, torch.Tensor]:
        """`unweighted_combine_backward` in the overlapped layout, its pull beside the products:
        on the current stream grad_y's rows go into this rank's pair-gradient region (its first
        T rows: the forward's pair outputs there were summed before, in stream order), each
        pair's weight into its owner's row_weights, and the ranks meet; the returned `pull`, run
        on the caller's communication stream, has `programs` programs load each grouped row's
        token row from its token's rank in grouped order (a row per pair, as
        `combine_backward_overlapped` loads), flagging every block of COPY_ROWS rows. Returns
        (grad_y's rows [routing.rows, H], pull, their RowsReady, each grouped row's weight
        [routing.rows] fp32)."""
        s, view = self.shape, self.view
        tokens = grad_y.shape[0]
        view.grad_pairs.local[:tokens].copy_(grad_y)
        self._push_row_weights(routing, topk_weights)
        self.backward_epoch.add_(1)
        self._barrier("combine backward: gradient rows and router weights pushed")
        weights = view.row_weights.local[: routing.rows, 0].clone()
        grad_rows = torch.empty(routing.rows, s.hidden, dtype=grad_y.dtype, device=self.device)

        def pull() -> None:
            # Made here, on the stream that reads it: the caller may drop `pull` once queued,
            # and a tensor made before on its stream would go back to that stream's pool while
            # this copy still reads it.
            token_rows = torch.where(routing.return_row >= 0, routing.return_row // s.top_k, -1)
            copy_rows(
                grad_rows,
                view.grad_pairs.local,
                token_rows,
                routing.recv_pairs,
                programs,
                COPY_ROWS,
                src_offsets=view.grad_pairs.offsets,
                src_rank=routing.return_rank,
                epoch=self.backward_epoch,
                landed=self.landed_backward,
                **COPY_TILE,
            )

        ready = self._copied_rows(self.landed_backward, self.backward_epoch, timeout_s)
        return grad_rows, pull, ready, weights


def exchange_class(shape: ExchangeShape) -> type[SymmetricExchangeBase]:
    """The exchange class of `shape`'s layout: staged or overlapped, with the pair gradients or
    the router values."""
    if shape.overlapped:
        return (
            OverlappedSymmetricRouterValuesExchange
            if shape.router_values
            else OverlappedSymmetricExchange
        )
    return SymmetricRouterValuesExchange if shape.router_values else SymmetricExchange


def symmetric_exchange(
    group: dist.ProcessGroup | None,
    shape: ExchangeShape,
    device: torch.device,
    programs: int = 24,
    memory: SymmetricMemory | None = None,
    timeout_s: float = 10.0,
) -> SymmetricExchangeBase:
    """The exchange of `shape`'s layout (`exchange_class`), made (collective)."""
    return exchange_class(shape)(group, shape, device, programs, memory, timeout_s)


_SHARED_EXCHANGES: dict[tuple, list] = {}


def acquire_exchange(
    group: dist.ProcessGroup | None,
    shape: ExchangeShape,
    device: torch.device,
    programs: int,
    timeout_s: float = 10.0,
) -> SymmetricExchangeBase:
    """The exchange of (group, device, shape, programs, timeout), created on first use (collective)
    and then shared by every user of the same key, e.g. all MoE layers of one shape: their calls
    follow one another on the stream, and every buffer is rewritten only behind a barrier that its
    readers pass once done, so one set of buffers serves them all. Pair with `release_exchange`;
    all ranks must acquire and release in the same order."""
    group = group if group is not None else dist.group.WORLD
    key = (group.group_name, str(device), shape, programs, timeout_s)
    entry = _SHARED_EXCHANGES.get(key)
    if entry is None:
        exchange = symmetric_exchange(group, shape, device, programs, timeout_s=timeout_s)
        entry = _SHARED_EXCHANGES[key] = [exchange, 0]
    entry[1] += 1
    return entry[0]


def release_exchange(exchange: SymmetricExchangeBase) -> None:
    """Drop one user of a shared exchange; the last one frees its buffers (collective then)."""
    for key, entry in list(_SHARED_EXCHANGES.items()):
        if entry[0] is exchange:
            entry[1] -= 1
            if entry[1] == 0:
                del _SHARED_EXCHANGES[key]
                exchange.release()
            return
    exchange.release()


def staging_fan_in(
    grouped_to_staging: torch.Tensor, recv_pairs: torch.Tensor, staging_rows: int, width: int
) -> torch.Tensor:
    """[staging_rows, width] int64: the grouped rows (below the device count recv_pairs) reading
    each staging row, ascending, -1 padded. No host synchronization."""
    device = grouped_to_staging.device
    pairs = grouped_to_staging.shape[0]
    grouped = torch.arange(pairs, device=device)
    valid = (grouped < recv_pairs) & (grouped_to_staging >= 0)
    staging = torch.where(valid, grouped_to_staging, staging_rows)  # invalid: a dummy row
    order = torch.sort(staging, stable=True).indices
    rows = staging[order]
    counts = torch.zeros(staging_rows + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, rows, torch.ones_like(rows))
    position = grouped - (torch.cumsum(counts, 0) - counts)[rows]
    target = torch.where(rows < staging_rows, rows * width + position, staging_rows * width)
    fan_in = torch.full((staging_rows * width + 1,), -1, dtype=torch.int64, device=device)
    fan_in.scatter_(0, target, order)
    return fan_in[:-1].view(staging_rows, width)
