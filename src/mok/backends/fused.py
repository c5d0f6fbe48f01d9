"""The `fused` backend: the triton backend's kernels with the token exchange overlapped.

    route -> [x to the symmetric copy, barrier] -> pull ‖ shared expert, gate/up -> down -> sum
                                                   (communication stream)  (compute stream)

Forward, per call:
  dispatch  `comm_sms` programs on a side stream load every grouped row from its token's rank
            (NVLink or local HBM) straight into the expert order, flagging each block of rows
            once written (`OverlappedExchangeBase.dispatch_overlapped`); meanwhile the shared expert
            and the gate/up + SwiGLU product run on the other SMs, each gate/up tile waiting for
            the flags of its rows (`host.RowsReady`). The grid of the products beside the
            copy is held to SMs - comm_sms, so both are resident at once: the products' waits are
            on programs that are running, never on programs that need an SM they hold. Once the
            copy is done, comm_sms more programs join the routed products on the SMs it freed
            and claim the tiles still left (`_ClaimsAfterCopy`), so that a product is held for
            no longer than the copy runs. For the backward the same programs then pull the
            tokens received, once each (`received_tokens`): the grouped rows, a copy per pair
            sized for the worst routing, go with the forward, and the gate/up weight gradient
            reads the tokens through each grouped row's index.
  combine   the down product's epilogue stores each row's output straight into the token rank's
            pair slot and counts it there (`RowScatter`, the peer-store epilogue); the token rank
            waits for its counts (bounded) and sums its pairs in the contract's order.
Every result is bitwise the triton backend's (the same products on the same rows, the same sums
in the same order); backward is the triton backend's. At EP 1 the same kernels run on local
buffers (`LocalExchange`) with nothing beside them (nothing travels, so nothing is worth
overlapping: the SMs a copy would take from the products cost more than the copy): the gate/up
product reads x through each grouped row's token where the kernels gather faster than the copy
(`gathers_rows_well`, as the triton backend), else the copy runs first on every SM.

Why it cannot deadlock: the only waits are (1) the barrier every rank passes after copying its x
(stream order, bounded), (2) a gate/up tile on rows copied by the side stream's programs, which
start once the barrier passed and are resident beside the product (the product leaves them
their SMs), and which wait on nothing, and (3) the token rank on counts that the owners' down
products add to, which run after their own gate/up, which waits only on (2). The programs that
join a product later start after the copy (stream order), so their waits are already met.
Every wait gives up after `peer_timeout_s` and records why; `Workspace.check()` raises it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mok.backends.triton import DispatchedRows, TritonBackend, TritonSaved
from mok.comm.exchange import OverlappedExchange, OverlappedRouterValuesExchange
from mok.comm.memory import symmetric_memory
from mok.distributed import group_rank_and_size
from mok.errors import MoKInputError


class _ClaimsAfterCopy:
    """`TileClaims` of the routed products held beside the communication programs: right after
    such a product's launch, the copy queued before it on the communication stream is followed
    there by `comm_sms` more programs of the product, which claim its remaining tiles on the SMs
    the copy frees; the compute stream goes on once both launches are done. The products of one
    forward or backward take one counter each, zeroed together when it starts (`start`)."""

    def __init__(self, backend: FusedBackend, products: int) -> None:
        self.backend = backend
        self.counters = torch.zeros(products, dtype=torch.int32, device=backend.workspace.device)
        self.taken = 0
        self.inputs_ready = None
        """An event on the compute stream just before the product's launch: what the programs
        that join it wait for besides the copy (not the product itself, which they join)."""

    def start(self) -> None:
        """Before a forward's or backward's products (on the compute stream, after every
        earlier launch on the counters finished: each extension joined the compute stream)."""
        self.counters.zero_()
        self.taken = 0

    def counter(self) -> torch.Tensor:
        if self.taken == self.counters.numel():
            raise RuntimeError(
                f"the fused backend's schedule claims tiles for more than {self.taken} products "
                "in one pass"
            )
        self.taken += 1
        if self.backend.comm_stream is not None:
            compute = torch.cuda.current_stream(self.backend.workspace.device)
            self.inputs_ready = compute.record_event()
        return self.counters[self.taken - 1 : self.taken]

    def extend(self, relaunch) -> None:
        backend = self.backend
        backend._beside(lambda: relaunch(backend.comm_programs), after=self.inputs_ready)
        backend._join()


class FusedBackend(TritonBackend):
    name = "fused"
    exchange_layout = {"overlapped": True}
    pull_by_default = True
    exchange: OverlappedExchange | OverlappedRouterValuesExchange

    def __init__(self, workspace) -> None:
        super().__init__(workspace)
        device = workspace.device
        self.comm_programs = workspace.config.tuning.comm_sms
        self.overlap = group_rank_and_size(workspace.group)[1] > 1
        """Copy the grouped rows beside the products (True) or first on every SM. Default: at
        EP > 1 only; at EP 1 nothing travels and the local expand is cheaper before the products
        than on comm_sms SMs beside them (measured, docs/notes/fused-kernel-plan.md). Tests set
        it at EP 1 to run the overlapped schedule with real concurrency on one GPU."""
        self.comm_stream = None
        self.beside_sms = None
        """SMs of the products that run beside the communication programs (None: the CPU,
        where the copy runs first and the products after it)."""
        self.claims = None
        """Where the routed products beside the copies claim their tiles (None: the CPU)."""
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            if self.comm_programs >= sms:
                raise MoKInputError(
                    f"comm_sms={self.comm_programs} leaves none of the {sms} SMs to the expert "
                    "products that run beside the communication programs"
                )
            self.comm_stream = torch.cuda.Stream(device)
            self.beside_sms = sms - self.comm_programs
            self.claims = _ClaimsAfterCopy(self, products=4)

    @staticmethod
    def unavailable_reason(config, device: torch.device, group) -> str | None:
        reason = TritonBackend.unavailable_reason(config, device, group)
        if reason is not None:
            return reason
        if config.precision.value != "bf16":
            return f"computes bf16 only so far, not {config.precision.value}"
        from mok.comm.symmetric import SymmetricExchangeBase

        _, ep = group_rank_and_size(group)
        if ep > 1:
            symmetric = SymmetricExchangeBase.unavailable_reason(group, device)
            if symmetric is not None:
                return f"needs the NVLink exchange at EP > 1 ({symmetric})"
            if not symmetric_memory().carries(dist.get_backend(group), device):
                return "needs an nccl group at EP > 1"
        return None

    @staticmethod
    def auto_skip_reason(device: torch.device) -> str | None:
        return "auto does not pick it yet: chosen by name (backend='fused') until measured faster"

    @property
    def overlapped(self) -> bool:
        return self.overlap

    def _beside(self, work, after: torch.cuda.Event | None = None) -> None:
        """Run `work` on the communication stream, after what the compute stream queued so far,
        or only up to the event `after` recorded on it (on the CPU: now, before the products
        that wait for it)."""
        if self.comm_stream is None:
            work()
            return
        if after is None:
            self.comm_stream.wait_stream(torch.cuda.current_stream(self.workspace.device))
        else:
            self.comm_stream.wait_event(after)
        with torch.cuda.stream(self.comm_stream):
            work()

    def _join(self) -> None:
        """The compute stream waits for the communication stream's work (only after `_beside`:
        under CUDA-graph capture, waiting on a stream the capture never forked is an error)."""
        if self.overlap and self.comm_stream is not None:
            torch.cuda.current_stream(self.workspace.device).wait_stream(self.comm_stream)

    def _dispatch(self, routing, x: torch.Tensor, weights, need_backward: bool) -> DispatchedRows:
        """Beside the products: the copy of the grouped rows on the communication programs, the
        gate/up product's tiles waiting for their rows' flags on the other SMs (claimed, with
        more programs once the copy is done), and, for the backward, the tokens received, each
        once. In order (EP 1): the triton backend's rows, with the kernels' tiles."""
        from mok.kernels import expert_mlp as em

        config = self.workspace.config
        if not self.overlap:
            rows = super()._dispatch(routing, x, weights, need_backward)
        else:
            grouped, pull, ready = self.exchange.dispatch_overlapped(
                routing, x, self.comm_programs, config.peer_timeout_s
            )
            self._beside(pull)
            tokens = None
            if need_backward and not config.tuning.keep_grouped_rows:
                tokens = self.exchange.received_tokens(routing, self.comm_programs)
            if tokens is not None:
                self._beside(tokens.pull)
            if self.claims is not None:
                self.claims.start()
            rows = DispatchedRows(grouped, ready=ready, tokens=tokens)
        if rows.kernel_config is None:
            per_expert = rows.rows.shape[0] / weights.gate.shape[0]
            rows.kernel_config = em.default_config(
                x.device, x.shape[1], config.intermediate_size, per_expert
            )
        if self.overlap:
            rows.kernel_config = em.with_gate_up_sms(
                rows.kernel_config, self.beside_sms, self.claims
            )
        return rows

    def _expert_outputs(self, routing, hidden: int) -> dict:
        """The down product's peer-store epilogue stores each output in its token rank's pair
        slot (`RowScatter`)."""
        return {"combine": self.exchange.combine_target(routing, hidden, self.dtype)}

    def _combine(
        self, routing, rows: DispatchedRows, weights, expert_out, outputs: dict, router,
        shared_out, keep_pair_out: bool,
    ):  # fmt: skip
        """The token rank waits for its pairs' counts (bounded), then sums them."""
        from mok.kernels import expert_mlp as em

        block_n = em.down_tiles(rows.kernel_config, rows.rows, weights.down).block_n
        column_tiles = -(-rows.rows.shape[1] // block_n)
        return self.exchange.combine_landed(
            routing,
            outputs["combine"],
            column_tiles,
            router,
            shared_out,
            self.workspace.config.peer_timeout_s,
            keep_pair_out,
        )

    def _output_gradients(self, saved: TritonSaved, grad_y: torch.Tensor):
        """Beside the products: the grouped rows' output gradients pulled by the communication
        programs while the first routed product waits per tile for its rows (with
        `router_gradient="epilogue"` unweighted, each pair's weight stored at its owner before),
        and what the forward did not keep made again beside the pull, on the SMs the forward's
        gate/up product had."""
        if not self.overlap:
            return super()._output_gradients(saved, grad_y)
        from mok.kernels.expert_mlp import replay_activations

        timeout = self.workspace.config.peer_timeout_s
        row_weights = grad_router = None
        if self._router_gradient_in_epilogue():
            grad_out, pull, ready, row_weights = (
                self.exchange.unweighted_combine_backward_overlapped(
                    saved.routing, grad_y, saved.weights, self.comm_programs, timeout
                )
            )
        else:
            grad_out, pull, ready, grad_router = self.exchange.combine_backward_overlapped(
                saved.routing, grad_y, saved.weights, saved.pair_out, self.comm_programs, timeout
            )
            saved.pair_out = None
        self._beside(pull)
        del pull  # it holds grad_out, which goes once its products are queued
        replay_activations(saved.experts)
        if self.claims is not None:
            self.claims.start()
        if self.comm_stream is not None:  # written by the pull: freed after it, whatever joins
            grad_out.record_stream(self.comm_stream)
        return grad_out, ready, row_weights, grad_router

    def _give_back(self, routing, grad_rows, grad_shared_x):
        """Beside the products: the owner sums the rows' gradient per staging row on every SM
        now, then the communication programs send it back and sum it over owners while the
        gate/up weights' gradient runs (`dispatch_backward_overlapped`)."""
        if not self.overlap:
            return super()._give_back(routing, grad_rows, grad_shared_x)
        give_back = self.exchange.dispatch_backward_overlapped(
            routing, grad_rows, grad_shared_x, self.comm_programs
        )
        grad_x = []
        self._beside(lambda: grad_x.append(give_back()))

        def joined() -> torch.Tensor:
            self._join()
            if self.comm_stream is not None:  # made on the communication stream, used here
                grad_x[0].record_stream(torch.cuda.current_stream(self.workspace.device))
            return grad_x[0]

        return joined
