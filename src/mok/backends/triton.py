"""The `triton` backend: the token exchange and the Triton expert kernels, forward and backward,
with no host synchronization.

    route -> dispatch -> expert MLP kernels -> combine        (forward)
    combine_backward -> expert MLP backward kernels -> dispatch_backward       (backward)

The exchange is the NVLink one (`mok.comm.symmetric`) on an expert-parallel group of one host,
the local one (`mok.comm.local`) in a single process, and the collective one
(`mok.comm.collective`; its `route` reads split sizes on the host) where symmetric memory is not
available. The shared expert runs through the same kernels as one group of all the rank's tokens.
Separate kernels on one stream: the fused, overlapped kernel is the next step.

Errors found on the device (an expert id outside [0, E), a receive buffer too small) never touch
memory out of bounds: bad pairs are dropped (zero weight, zero gradients) and `check()` raises at
the next host synchronization the caller chooses (`mok.Workspace.check`).

MXFP8 (`precision="mxfp8"`): x is cast along H on its own rank and dispatched as packed e4m3
bytes and scales (`mok.kernels.mx.MXRows`: 0.52x the bytes of a bf16 row), the routed experts run
through `mok.kernels.mx_expert_mlp` (the reference's quantization points), and the combine saves
the pairs' outputs as their MX cast for the router weights' gradient; the shared expert, the
router, the combine's sum and every gradient that travels stay bf16.

The 128-block FP8 recipe (`precision="fp8_block"`): x is cast along H on its own rank (1 x 128
tiles) and dispatched as packed e4m3 bytes and fp32 descales (`mok.kernels.fp8_block.BlockRows`:
0.52x the bytes of a bf16 row), and the routed experts run `mok.kernels.fp8_block_expert_mlp`
(the recipe's casts and tl products, bitwise the reference's under the interpreter); the
weights' gradients are added into accumulation buffers after they are formed, in fp32, as the
reference backend adds them.

CPU test mode: asked for by name (`backend="triton"`) on a CPU under TRITON_INTERPRET=1, the same
code runs with the kernels under the Triton interpreter and the exchanges on CPU tensors (gloo,
or a shared file standing in for symmetric memory). The interpreter computes bf16 wrongly, so
there x, the weights, the router weights and grad_y are upcast to fp32 at entry, everything runs
in fp32, and results are cast back to the dtypes of the API at exit: the rounding points differ
from the bf16 contract of GPUs (h and the expert outputs are not rounded to bf16). For tests only,
slow; `auto` never picks it on a CPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mok.comm.exchange import (
    Exchange,
    ExchangeRouting,
    GroupedPairOutputs,
    ReceivedTokens,
    RouterValuesExchange,
)
from mok.comm.memory import symmetric_memory
from mok.distributed import group_rank_and_size
from mok.errors import MoKInputError
from mok.kernels._triton_compat import interpreting
from mok.kernels.constants import DeviceConstants
from mok.kernels.formats import fp8_block_row_bytes, mx_row_bytes
from mok.weights import EXPERT_BIAS_FIELDS, MoEGradients, MoEWeights

if TYPE_CHECKING:  # Triton is optional: the kernels are imported where they run
    from mok.comm.layout import ExchangeShape
    from mok.kernels import ExpertKernelConfig, ExpertMLPSaved
    from mok.kernels.fp8_block_expert_mlp import FP8BlockSaved
    from mok.kernels.host import RowsReady
    from mok.kernels.mx import MXRows
    from mok.kernels.mx_expert_mlp import MXExpertSaved

KERNEL_MULTIPLE = 16
"""The expert kernels' tiles need H and I (also the shared expert's) to be multiples of this."""


@dataclasses.dataclass(frozen=True)
class TritonRouting:
    """One call's routing: the exchange's, and which pairs are valid."""

    exchange: ExchangeRouting
    valid: torch.Tensor
    """[T, k] bool: pairs whose expert id is in range (the others are dropped)."""


@dataclasses.dataclass
class TritonSaved:
    """What the triton (and fused) backend's forward keeps for its backward."""

    routing: ExchangeRouting
    weights: torch.Tensor
    """[T, k] the router weights as used (zero for dropped pairs)."""
    valid: torch.Tensor
    experts: ExpertMLPSaved | MXExpertSaved | FP8BlockSaved
    shared: ExpertMLPSaved | None
    pair_out: torch.Tensor | MXRows | GroupedPairOutputs | None
    """The pairs' outputs, for the router weights' gradient (MXFP8: their cast along H); None
    once backward has read them."""
    dtypes: dict[str, torch.dtype]
    """What each gradient is returned in: "x", "topk_weights" and every weight field."""


@dataclasses.dataclass
class DispatchedRows:
    """The routed experts' rows of one forward, as the dispatch leaves them."""

    rows: torch.Tensor | MXRows
    """[M, H] the grouped rows (MXFP8: their cast), or x [T, H] read through `source_rows`."""
    source_rows: torch.Tensor | None = None
    """[M] int32: grouped row r is rows[source_rows[r]]; None: rows are the grouped rows."""
    kernel_config: ExpertKernelConfig | None = None
    """The products' tiles (None: the kernels' default)."""
    ready: RowsReady | None = None
    """The rows' readiness flags, where they land while the products run."""
    tokens: ReceivedTokens | None = None
    """The tokens received, each once, that the backward reads instead of the grouped rows."""


class TritonBackend:
    name = "triton"
    checks_ids_on_device = True
    exchange_layout: dict = {}
    """Options of the NVLink exchange's shape (`mok.comm.symmetric.ExchangeShape`)."""
    pull_by_default = False
    """Dispatch.AUTO means pull (True) or push (False) on this backend."""

    def __init__(self, workspace) -> None:
        # Imported here: Triton is an optional dependency of the package.
        from mok.comm.collective import CollectiveExchange
        from mok.comm.local import LocalExchange
        from mok.comm.symmetric import SymmetricExchangeBase, acquire_exchange

        self.workspace = workspace
        self.exchange: Exchange | RouterValuesExchange
        config, device, group = workspace.config, workspace.device, workspace.group
        # The kernels' dtype: the config's on GPUs, fp32 on the CPU (the interpreter's bf16 is off).
        self.dtype = config.activation_dtype if device.type == "cuda" else torch.float32
        _, ep = group_rank_and_size(group)
        self.mxfp8 = config.precision.value == "mxfp8"
        self.fp8_block = config.precision.value == "fp8_block"
        if ep == 1:
            self.exchange = LocalExchange(config.num_experts, device)
        elif SymmetricExchangeBase.unavailable_reason(group, device) is None:
            shape = self.exchange_shape(config, ep, self.dtype)
            self.exchange = acquire_exchange(
                group, shape, device, config.tuning.comm_sms, config.peer_timeout_s
            )
        else:
            self.exchange = CollectiveExchange(group, workspace.local_experts)
        self.bad_ids = torch.zeros(1, dtype=torch.bool, device=device)
        self._constants = DeviceConstants()
        self.weight_casts = None
        """The routed weights' FP8 casts kept between calls (`MoKTuning.mx_weight_casts`)."""
        if self.mxfp8:
            from mok.kernels.mx_expert_mlp import MXWeightCache

            self.weight_casts = MXWeightCache()
        elif self.fp8_block:
            from mok.kernels.fp8_block_expert_mlp import BlockWeightCache

            self.weight_casts = BlockWeightCache()
        # Checked on every rank before `route` (mok.functional), so that no rank fails alone.
        self.max_tokens = config.max_tokens_per_rank

    @classmethod
    def exchange_shape(cls, config, ep_size: int, dtype: torch.dtype) -> ExchangeShape:
        """The sizes of the NVLink exchange's symmetric buffers for `config` at `ep_size`, rows
        in `dtype` (the kernels' dtype)."""
        from mok.comm.layout import default_shape

        layout = dict(cls.exchange_layout)
        packed_rows = {"mxfp8": mx_row_bytes, "fp8_block": fp8_block_row_bytes}
        if config.precision.value in packed_rows:
            # Elements of dtype per dispatched row (packed e4m3 and scales).
            row_bytes = packed_rows[config.precision.value](config.hidden_size)
            layout["dispatch_width"] = row_bytes // dtype.itemsize
        return default_shape(
            config.hidden_size,
            config.top_k,
            config.local_experts(ep_size),
            ep_size,
            config.max_tokens_per_rank,
            config.recv_capacity,
            config.recv_pair_capacity,
            dtype=dtype,
            pull_dispatch=cls._pulls(config),
            router_values=config.router_gradient.value == "epilogue",
            **layout,
        )

    @classmethod
    def symmetric_buffer_bytes(cls, config, ep_size: int) -> dict[str, int]:
        """Bytes per region of the symmetric buffer a rank allocates on GPUs for layers of
        `config` at `ep_size` (none at EP 1)."""
        from mok.comm.layout import buffer_layout, region_bytes

        if ep_size == 1:
            return {}
        shape = cls.exchange_shape(config, ep_size, config.activation_dtype)
        return region_bytes(buffer_layout(shape, ep_size))

    @classmethod
    def _pulls(cls, config) -> bool:
        from mok.config import Dispatch

        if config.tuning.dispatch is Dispatch.AUTO:
            return cls.pull_by_default
        return config.tuning.dispatch is Dispatch.PULL

    @staticmethod
    def unavailable_reason(config, device: torch.device, group) -> str | None:
        """None if the backend can run when asked for by name, else why not."""
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'mok[triton]')"
        if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
            return (
                f"needs a CUDA device, got {device} (a CPU only under the Triton interpreter, "
                "TRITON_INTERPRET=1, a test mode)"
            )
        if config.precision.value not in ("bf16", "mxfp8", "fp8_block"):
            return f"computes bf16, MXFP8 and fp8_block only, not {config.precision.value}"
        sizes = {
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "shared_intermediate_size": config.shared_intermediate_size,
        }
        for name, size in sizes.items():
            if size % KERNEL_MULTIPLE:
                return f"{name}={size} is not a multiple of {KERNEL_MULTIPLE}"
        collectives = "nccl" if device.type == "cuda" else "gloo"
        if group is not None and not symmetric_memory().carries(dist.get_backend(group), device):
            return f"expert parallelism on {device.type} tensors needs a {collectives} group"
        return None

    @staticmethod
    def auto_skip_reason(device: torch.device) -> str | None:
        """Why `auto` passes the backend over on `device` although it may run there."""
        if device.type != "cuda":
            return (
                "auto picks it on CUDA devices only: on the CPU it runs under the Triton "
                "interpreter, slowly and in fp32, for tests (backend='triton', TRITON_INTERPRET=1)"
            )
        return None

    def route(self, topk_idx: torch.Tensor) -> TritonRouting:
        from mok.kernels.placement import checked_ids

        safe, valid = checked_ids(topk_idx, self.workspace.config.num_experts, self.bad_ids)
        exact = self.workspace.config.tuning.exact_buffers
        return TritonRouting(self.exchange.route(safe, exact_rows=exact), valid)

    overlapped = False
    """Whether the exchange's copies run beside the products (`mok.backends.fused`): the triton
    backend runs each step after the one before, on one stream."""
    beside_sms = None
    """SMs of the products that run beside the copies (None: all)."""
    claims = None
    """Where the products beside the copies claim their tiles (`host.TileClaims`; None: none)."""

    def forward(self, routing: TritonRouting, topk_idx, x, topk_weights, weights, need_backward):
        """The forward pass plan, one for both backends; the schedule hooks (`_dispatch`,
        `_expert_outputs`, `_combine`, `_beside`, `_join`) say where the communication runs.
        Beside the copies, the shared expert runs first, on the products' SMs, while the routed
        products wait for their rows; in order, it runs after the routed experts."""
        valid, routing = routing.valid, routing.exchange
        given = weights
        x, weights, router, dtypes = self._layer_inputs(valid, x, topk_weights, weights)
        rows = self._dispatch(routing, x, weights, need_backward)
        if self.overlapped:
            shared_out, shared = self._shared_forward(x, weights, need_backward, self.beside_sms)
        outputs = self._expert_outputs(routing, x.shape[1])
        expert_out, experts = self._routed_forward(
            routing, rows, given, weights, need_backward, outputs
        )
        if not self.overlapped:
            shared_out, shared = self._shared_forward(x, weights, need_backward)
        self._join()
        self._keep_rows(routing, x, rows, experts)
        keep_pair_out = need_backward and not self._router_gradient_in_epilogue()
        y, pair_out = self._combine(
            routing, rows, weights, expert_out, outputs, router, shared_out, keep_pair_out
        )
        y = y.to(dtypes["x"])
        if not need_backward:
            return y, None
        return y, TritonSaved(routing, router, valid, experts, shared, pair_out, dtypes)

    def _dispatch(
        self, routing: ExchangeRouting, x: torch.Tensor, weights: MoEWeights, need_backward: bool
    ) -> DispatchedRows:
        """The routed experts' rows, in order. MXFP8: x cast along H on its own rank, sent as
        e4m3 bytes and scales. bf16: x read in place through each grouped row's token by the
        gate/up product, with the tiles that decided it, where the grouped rows would be copies
        of x's rows (EP 1) and the kernels gather faster than the exchange copies
        (`gathers_rows_well`), unless `keep_grouped_rows`; else the rows sent into grouped order
        (the kernels' default tiles). fp8_block: x cast along H on its own rank (1 x 128 tiles),
        sent as e4m3 bytes and fp32 descales (`BlockRows`)."""
        config = self.workspace.config
        if self.fp8_block:
            from mok.kernels.fp8_block import BlockRows, block_quantize_rows

            packed = block_quantize_rows(x).as_rows(self.dtype)
            grouped = self.exchange.dispatch(routing, packed)
            return DispatchedRows(BlockRows.from_rows(grouped, x.shape[1]))
        if self.mxfp8:
            from mok.kernels.mx import MXRows, mx_quantize_rows

            packed = mx_quantize_rows(x, config.mx_rounding).as_rows(self.dtype)
            return DispatchedRows(
                MXRows.from_rows(self.exchange.dispatch(routing, packed), x.shape[1])
            )
        from mok.kernels import default_config
        from mok.kernels.expert_mlp import gathers_rows_well

        tokens = self.exchange.tokens_of_grouped_rows(routing)
        if tokens is not None and not config.tuning.keep_grouped_rows:
            per_expert = tokens.shape[0] / weights.gate.shape[0]
            kernel_config = default_config(
                x.device, x.shape[1], config.intermediate_size, per_expert
            )
            if gathers_rows_well(x, weights.gate, weights.up, kernel_config):
                return DispatchedRows(x, source_rows=tokens, kernel_config=kernel_config)
        return DispatchedRows(self.exchange.dispatch(routing, x))

    def _expert_outputs(self, routing: ExchangeRouting, hidden: int) -> dict:
        """Where the routed experts' outputs go, as the expert forward's keyword: the exchange's
        buffer (`out`)."""
        return {"out": self.exchange.expert_output_buffer()}

    def _routed_forward(
        self, routing: ExchangeRouting, rows: DispatchedRows, given: MoEWeights,
        weights: MoEWeights, need_backward: bool, outputs: dict,
    ):  # fmt: skip
        """(the routed experts' outputs, their saved state) of the dispatched rows; `given`: the
        weights as the caller holds them (MXFP8 keeps their casts between calls)."""
        if self.fp8_block:
            return self._fp8_block_forward(
                routing, rows, given, weights, need_backward, outputs["out"]
            )
        config = self.workspace.config
        options = {
            "save_for_backward": need_backward,
            "activation": self._activation(),
            "biases": weights.expert_biases(),
            **outputs,
        }
        if self.mxfp8:
            from mok.kernels.mx_expert_mlp import mx_expert_mlp_forward

            rounding = config.mx_rounding
            casts = self._mx_weight_casts(given, rounding, need_backward)
            return mx_expert_mlp_forward(
                rows.rows, routing.group_offsets, casts, config.swiglu_limit, rounding, **options
            )
        from mok.kernels import expert_mlp_forward

        return expert_mlp_forward(
            rows.rows,
            routing.group_offsets,
            weights.gate,
            weights.up,
            weights.down,
            config.swiglu_limit,
            config=rows.kernel_config,
            rows_ready=rows.ready,
            source_rows=rows.source_rows,
            keep_activations=self._keeps_activations(),
            **options,
        )

    def _fp8_block_forward(
        self, routing: ExchangeRouting, rows: DispatchedRows, given: MoEWeights,
        weights: MoEWeights, need_backward: bool, out: torch.Tensor | None,
    ):  # fmt: skip
        """The routed experts in the 128-block FP8 recipe (`fp8_block_expert_forward`): (their
        outputs, in `out`'s first rows where the exchange gives a buffer, their saved state or
        None). The weights' block casts kept between calls where `_keeps_weight_casts` (one
        cast serves both passes), else made by the forward for its backward."""
        from mok.kernels.fp8_block_expert_mlp import fp8_block_expert_forward

        casts = None
        if self._keeps_weight_casts(need_backward):
            casts = self.weight_casts.get(given.gate, given.up, given.down, self.dtype)
        expert_out, experts = fp8_block_expert_forward(
            rows.rows,
            routing.group_offsets,
            weights.gate,
            weights.up,
            weights.down,
            self.workspace.config.swiglu_limit,
            biases=weights.expert_biases(),
            activation=self._activation(),
            weight_casts=casts,
            out=out,
        )
        return expert_out, experts if need_backward else None

    def _combine(
        self, routing: ExchangeRouting, rows: DispatchedRows, weights: MoEWeights, expert_out,
        outputs: dict, router, shared_out, keep_pair_out: bool,
    ):  # fmt: skip
        """(y [T, H], the pairs' outputs or None): each token's outputs summed with its router
        weights (MXFP8: the pairs' outputs kept as their cast)."""
        rounding = self.workspace.config.mx_rounding if self.mxfp8 else None
        return self.exchange.combine(
            routing,
            expert_out,
            router,
            shared_out,
            save_pair_out=keep_pair_out,
            pair_out_mx=rounding,
        )

    def _beside(self, work, after: torch.cuda.Event | None = None) -> None:
        """Run `work` (a copy) beside the products: in order, now."""
        work()

    def _join(self) -> None:
        """Wait for the work run beside the products: in order, it is done."""

    def _keep_rows(
        self, routing: ExchangeRouting, x: torch.Tensor, rows: DispatchedRows, experts
    ) -> None:
        """What the backward reads as the rows (bf16), unless `keep_grouped_rows`: the tokens
        received, each once, where the dispatch brought them; x and each grouped row's token
        where the grouped rows are copies of x's rows (EP 1); else the grouped rows, as the
        expert forward keeps them. The grouped rows (a copy per pair) then go with the
        forward."""
        if self.mxfp8 or self.fp8_block or experts is None or rows.source_rows is not None:
            return
        if rows.tokens is not None:
            experts.read_rows_through(rows.tokens.rows, rows.tokens.source_rows)
            return
        tokens = self.exchange.tokens_of_grouped_rows(routing)
        if tokens is not None and not self.workspace.config.tuning.keep_grouped_rows:
            experts.read_rows_through(x, tokens)

    def _keeps_weight_casts(self, need_backward: bool) -> bool:
        """Whether this call reads the routed weights' FP8 casts from `weight_casts`, as
        `MoKTuning.mx_weight_casts` says (else it casts them for itself, and the kept ones, stale
        by the next step, go)."""
        from mok.config import MXWeightCasts

        policy = self.workspace.config.tuning.mx_weight_casts
        if policy is MXWeightCasts.PER_PASS or (policy is MXWeightCasts.AUTO and need_backward):
            self.weight_casts.clear()
            return False
        return True

    def _mx_weight_casts(self, weights: MoEWeights, rounding, need_backward: bool):
        """The routed weights' MXFP8 casts for this call (`_keeps_weight_casts`)."""
        from mok.config import MXWeightCasts
        from mok.kernels.mx_expert_mlp import MXWeightsCastPerPass

        routed = (weights.gate, weights.up, weights.down)
        if not self._keeps_weight_casts(need_backward):
            return MXWeightsCastPerPass(*routed, rounding, self.dtype)
        both = self.workspace.config.tuning.mx_weight_casts is MXWeightCasts.KEEP
        return self.weight_casts.get(*routed, rounding, self.dtype, backward=both)

    def _layer_inputs(self, valid: torch.Tensor, x, topk_weights, weights):
        """(x, contiguous, and the weights in the kernels' dtype, the router weights as used
        (zero for dropped pairs), the API's dtypes of x, topk_weights and every weight)."""
        dtypes = {"x": x.dtype, "topk_weights": topk_weights.dtype}
        dtypes.update({name: w.dtype for name, w in weights.tensors().items() if w is not None})
        x, weights = x.to(self.dtype).contiguous(), weights.map(lambda w: w.to(self.dtype))
        if self.dtype == torch.float32:
            # The interpreter truncates fp32 -> bf16: the router-weight gradient stays fp32 until
            # PyTorch rounds it at exit.
            topk_weights = topk_weights.float()
        return x, weights, self._dropped_as_zero(valid, topk_weights), dtypes

    def _router_gradient_in_epilogue(self) -> bool:
        """Whether the down dgrad's epilogue forms the router weights' gradient
        (`MoKConfig.router_gradient`): the forward then keeps no pair outputs."""
        from mok.config import RouterGradient

        return self.workspace.config.router_gradient is RouterGradient.EPILOGUE

    def _keeps_activations(self) -> bool:
        """Whether the experts' forward keeps h and the pre-activations (`MoKTuning.recompute`)."""
        from mok.config import Recompute

        return self.workspace.config.tuning.recompute is Recompute.NONE

    def _activation(self):
        """The experts' activation (`host.Activation`) of the config."""
        from mok.kernels import Activation

        config = self.workspace.config
        return Activation(config.swiglu_alpha, config.swiglu_up_offset)

    def _shared_forward(self, x, weights: MoEWeights, need_backward: bool, sms: int | None = None):
        """(the shared expert's output, its saved state), or (None, None) without one; sms: the
        grids of all its products, forward and backward, held to that many SMs."""
        from mok.kernels import expert_mlp as em

        if not weights.has_shared_expert:
            return None, None
        config = self.workspace.config
        kernel_cfg = None
        if sms is not None:
            inter = config.shared_intermediate_size
            kernel_cfg = em.held_to(em.default_config(x.device, x.shape[1], inter, x.shape[0]), sms)
        return em.expert_mlp_forward(
            x,
            self._all_tokens(x.shape[0]),
            weights.shared_gate.unsqueeze(0),
            weights.shared_up.unsqueeze(0),
            weights.shared_down.unsqueeze(0),
            config.swiglu_limit,
            save_for_backward=need_backward,
            config=kernel_cfg,
            activation=self._activation(),
            keep_activations=self._keeps_activations(),
        )

    def backward(
        self,
        routing: TritonRouting,
        saved: TritonSaved,
        grad_y: torch.Tensor,
        accumulate_into: dict,
    ) -> MoEGradients:
        """Gradients of the layer, the backward pass plan of both backends; a weight named in
        `accumulate_into` has its gradient added into that buffer by the weight-gradient kernels
        themselves (no extra pass). `saved` serves this backward only: each saved activation is
        dropped after the last product that reads it. The routed products read grad_out first
        (`_down_gradients`), then the pre-activations' gradients: in order, the weights'
        gradients before the rows' gradient, so that it and the rows are never held together;
        beside the copies, the rows' gradient first, so that its way back to the tokens' ranks
        overlaps the gate/up weights' gradient, and the shared expert's backward beside the
        copy of grad_out's rows."""
        from mok.kernels import gate_up_data_gradient, gate_up_weight_gradients

        into = accumulate_into
        grad_y = grad_y.to(self.dtype).contiguous()
        grad_out, ready, row_weights, grad_router = self._output_gradients(saved, grad_y)
        if self.overlapped:
            grad_shared_x, shared_grads = self._shared_backward(saved, grad_y, into)
        experts, grads, dots = saved.experts, {}, None
        # The products' grids beside the copies, else every SM, no claims.
        sms, claims = (self.beside_sms, self.claims) if self.overlapped else (None, None)
        if self.mxfp8:
            grad_rows = self._mx_gradients(grad_out, experts, into, grads)
        elif self.fp8_block:
            grad_rows = self._fp8_block_gradients(grad_out, experts, into, grads)
        else:
            grad_gate_up, dots = self._down_gradients(
                grad_out,
                experts,
                into,
                grads,
                row_weights,
                rows_ready=ready,
                dgrad_sms=sms,
                claims=claims,
            )
        del grad_out  # the last of its products is queued: its memory serves the next ones
        if self.overlapped:
            grad_rows = gate_up_data_gradient(grad_gate_up, experts)
            grad_x = self._give_back(saved.routing, grad_rows, grad_shared_x)
            del grad_rows  # summed per staging row: not held beside the weights' gradient
            grads["gate"], grads["up"] = gate_up_weight_gradients(
                grad_gate_up,
                experts,
                into.get("gate"),
                into.get("up"),
                sms=sms,
                claims=claims,
            )
            experts.release("rows")
            del grad_gate_up
            grad_x = grad_x()
        else:
            if not (self.mxfp8 or self.fp8_block):
                grad_rows = self._gate_up_gradients(grad_gate_up, experts, into, grads)
                del grad_gate_up
            grad_shared_x, shared_grads = self._shared_backward(saved, grad_y, into)
            grad_x = self._give_back(saved.routing, grad_rows, grad_shared_x)()
        if grad_router is None:
            # After grad x: at EP > 1 the ranks meet once more, where they are level anyway.
            grad_router = self.exchange.pair_values(saved.routing, dots)
        grad_router = self._dropped_as_zero(saved.valid, grad_router)
        return self._gradients(saved, grad_x, grad_router, {**grads, **shared_grads}, into)

    @staticmethod
    def _fp8_block_gradients(grad_out, experts, into: dict, grads: dict) -> torch.Tensor:
        """The routed experts' backward in the 128-block recipe (`fp8_block_expert_backward`):
        the weights' and biases' gradients (into `grads`; a buffer of `into` has its gradient
        added in fp32 and rounded once more, as the reference backend adds it: `add_` computes
        in fp32 for bf16), the rows' gradient [M, H] returned."""
        from mok.kernels.fp8_block_expert_mlp import fp8_block_expert_backward

        grad_rows, *gradients = fp8_block_expert_backward(grad_out, experts)
        for name, grad in zip(("gate", "up", "down", *EXPERT_BIAS_FIELDS), gradients, strict=True):
            if grad is not None:
                buffer = into.get(name)
                grads[name] = grad if buffer is None else buffer.add_(grad)
        return grad_rows

    def _output_gradients(self, saved: TritonSaved, grad_y: torch.Tensor):
        """(the grouped rows' output gradients [M, H], their readiness flags where they land
        beside the products (None: in order), each row's router weight [M] fp32 where they come
        unweighted (`router_gradient="epilogue"`; else None), the router weights' gradient
        [T, k] (None where the down dgrad's epilogue forms it))."""
        if self._router_gradient_in_epilogue():
            grad_out, row_weights = self.exchange.unweighted_combine_backward(
                saved.routing, grad_y, saved.weights
            )
            return grad_out, None, row_weights, None
        grad_out, grad_router = self.exchange.combine_backward(
            saved.routing, grad_y, saved.weights, saved.pair_out
        )
        saved.pair_out = None
        return grad_out, None, None, grad_router

    def _give_back(self, routing: ExchangeRouting, grad_rows, grad_shared_x):
        """The rows' gradient sent back to the tokens' ranks and summed there with the shared
        expert's: returns what gives grad x [T, H] (in order, once done)."""
        grad_x = self.exchange.dispatch_backward(routing, grad_rows, extra=grad_shared_x)
        return lambda: grad_x

    @staticmethod
    def _mx_gradients(grad_out, experts: MXExpertSaved, into: dict, grads: dict) -> torch.Tensor:
        """The routed MXFP8 experts' backward: the weights' and biases' gradients (into `grads`),
        the rows' gradient [M, H] returned."""
        from mok.kernels.mx_expert_mlp import mx_expert_mlp_backward

        routed = mx_expert_mlp_backward(
            grad_out,
            experts,
            into.get("gate"),
            into.get("up"),
            into.get("down"),
            release=True,
            grad_bias_buffers=tuple(into.get(name) for name in EXPERT_BIAS_FIELDS),
        )
        grads.update(gate=routed.gate, up=routed.up, down=routed.down)
        if routed.biases is not None:
            grads.update(zip(EXPERT_BIAS_FIELDS, routed.biases, strict=True))
        return routed.rows

    @staticmethod
    def _down_gradients(
        grad_out, experts, into: dict, grads: dict, row_weights=None, **dgrad_options
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The routed products that read grad_out [M, H]: (the pre-activations' gradients
        [M, 2I], `dgrad_options` as in `down_data_gradient`; None, or with row_weights the dots),
        then W_down's gradient and the biases' (into `grads`). With row_weights [M] fp32,
        grad_out holds the rows' unweighted gradients and the down dgrad applies the weights in
        its epilogue (`weighted_down_data_gradient`, returning each row's router-weight dot [M]
        fp32, plus <grad row, b_down> with expert biases; b_down's gradient of the weighted
        rows, in fp32). The saved pre-activations and h are released after their last
        product."""
        from mok.kernels import (
            add_down_bias_dots,
            down_data_gradient,
            down_weight_gradient,
            expert_bias_gradients,
            weighted_down_data_gradient,
        )

        if row_weights is None:
            grad_gate_up, dots = down_data_gradient(grad_out, experts, **dgrad_options), None
        else:
            grad_gate_up, dots = weighted_down_data_gradient(
                grad_out, experts, row_weights, **dgrad_options
            )
        experts.release("gate_up")
        grads["down"] = down_weight_gradient(grad_out, experts, into.get("down"))
        experts.release("h")
        if experts.biases is not None:
            if dots is not None:
                add_down_bias_dots(grad_out, experts, dots)
            buffers = [into.get(name) for name in EXPERT_BIAS_FIELDS]
            gradients = expert_bias_gradients(
                grad_out, grad_gate_up, experts, *buffers, row_weights=row_weights
            )
            grads.update(zip(EXPERT_BIAS_FIELDS, gradients, strict=True))
        return grad_gate_up, dots

    @staticmethod
    def _gate_up_gradients(grad_gate_up, experts, into: dict, grads: dict) -> torch.Tensor:
        """The routed products that read the pre-activations' gradients: W_gate's and W_up's
        gradients (into `grads`; the saved rows released after them), then the rows' gradient
        [M, H] (returned), so that it and the rows are never held together."""
        from mok.kernels import gate_up_data_gradient, gate_up_weight_gradients

        grads["gate"], grads["up"] = gate_up_weight_gradients(
            grad_gate_up, experts, into.get("gate"), into.get("up")
        )
        experts.release("rows")
        return gate_up_data_gradient(grad_gate_up, experts)

    @staticmethod
    def _shared_backward(saved: TritonSaved, grad_y: torch.Tensor, into: dict):
        """(the shared expert's gradient of x or None, its weights' gradients by name)."""
        from mok.kernels import expert_mlp_backward

        if saved.shared is None:
            return None, {}
        # The shared expert runs as one expert of a group of one: [1, ...] views of its buffers.
        buffers = [into.get(name) for name in ("shared_gate", "shared_up", "shared_down")]
        grad_shared_x, gate, up, down = expert_mlp_backward(
            grad_y,
            saved.shared,
            *(None if b is None else b.unsqueeze(0) for b in buffers),
            release=True,
        )
        return grad_shared_x, {
            "shared_gate": gate.squeeze(0),
            "shared_up": up.squeeze(0),
            "shared_down": down.squeeze(0),
        }

    @staticmethod
    def _gradients(
        saved: TritonSaved, grad_x, grad_router, grads: dict, into: dict
    ) -> MoEGradients:
        """The gradients in the API's dtypes (accumulation buffers returned as they are)."""
        return MoEGradients(
            x=grad_x.to(saved.dtypes["x"]),
            topk_weights=grad_router.to(saved.dtypes["topk_weights"]),
            weights=MoEWeights(
                **{
                    name: into[name] if name in into else g.to(saved.dtypes[name])
                    for name, g in grads.items()
                }
            ),
        )

    def check(self) -> None:
        """Raise what the device found since the last check (synchronizes with the host): a
        failed wait on a peer first (the results since are undefined), then a capacity overflow,
        then expert ids out of range."""
        self.exchange.check()
        if bool(self.bad_ids.item()):
            self.bad_ids.zero_()
            raise MoKInputError(
                f"topk_idx held expert ids outside [0, num_experts="
                f"{self.workspace.config.num_experts}); those pairs were dropped"
            )

    def reset(self) -> None:
        """After a MoKTimeoutError: make the exchange usable again (collective)."""
        self.exchange.reset()

    def release(self) -> None:
        from mok.comm.symmetric import SymmetricExchangeBase, release_exchange

        if isinstance(self.exchange, SymmetricExchangeBase):
            release_exchange(self.exchange)
        else:
            self.exchange.release()

    def memory_outside_allocator(self) -> int:
        from mok.comm.symmetric import SymmetricExchangeBase

        if isinstance(self.exchange, SymmetricExchangeBase):
            return self.exchange.bytes_outside_allocator
        return 0

    def _dropped_as_zero(self, valid: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`values` with zero where `valid` is False (NaN included). The zero is a cached device
        scalar: a Python 0 would be made into a device tensor by a fill kernel at every call."""
        zero = self._constants.get(
            ("zero", values.dtype),
            lambda: torch.zeros((), dtype=values.dtype, device=values.device),
        )
        return torch.where(valid, values, zero)

    def _all_tokens(self, tokens: int) -> torch.Tensor:
        """[2] int32 offsets of one group holding all `tokens` rows, on the device."""
        device = self.workspace.device
        return self._constants.get(
            tokens, lambda: torch.arange(2, dtype=torch.int32, device=device) * tokens
        )
