"""The configuration of one MoE layer: its shape, its numerics and the tunables of the backends."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping

import torch

from mok.errors import MoKConfigError
from mok.reference.mx import BLOCK as MX_BLOCK
from mok.reference.mx import ScaleRounding


class Precision(str, enum.Enum):
    """Numerics of the expert GEMMs. Communication, the shared expert and the outputs stay bf16."""

    BF16 = "bf16"
    """bf16 operands, fp32 accumulation."""
    MXFP8 = "mxfp8"
    """e4m3 operands with one power-of-two (e8m0) scale per 32 elements along the reduction."""
    FP8_BLOCK = "fp8_block"
    """The 128-block recipe (DeepSeek-V3's, Transformer Engine's block scaling): e4m3 operands,
    activations and gradients with one fp32 scale per 1 x 128 tile along the reduction, weights
    per 128 x 128 block; each 128-element step's partial sums scaled and added in fp32
    (`mok.reference.fp8_block_expert`). The `reference` backend, and the `triton` backend on the
    recipe's tl kernels (rows dispatched as their e4m3 cast)."""


class Backend(str, enum.Enum):
    """Which implementation runs the layer."""

    AUTO = "auto"
    """The fastest backend that can run on the workspace's device and group."""
    TRITON = "triton"
    """Triton kernels and the NVLink exchange: CUDA GPUs, no host synchronization."""
    FUSED = "fused"
    """The triton backend's kernels with the exchange overlapped: the dispatch copied by
    `comm_sms` programs while the expert products run on the other SMs, and the combine stored
    by the down product's epilogue. `auto` does not pick it yet: it is chosen by name until its
    times at EP > 1 over NVLink beat `triton`'s (docs/notes/fused-kernel-plan.md)."""
    REFERENCE = "reference"
    """Plain PyTorch: any device, any `torch.distributed` group. The oracle and the fallback."""


class Dispatch(str, enum.Enum):
    """Which side moves the token rows of the NVLink dispatch."""

    AUTO = "auto"
    """Push for `triton`, whose pull was slower and needs an extra local copy
    (docs/notes/comm-design.md); pull for `fused`, which lands the rows in the order its products
    take them (docs/notes/fused-kernel-plan.md)."""
    PUSH = "push"
    """Senders store their rows into the owners' buffers (once per token and owner), and the
    owners expand them into the experts' order."""
    PULL = "pull"
    """Owners load the rows from the senders' buffers (`triton`: once per token and owner, then
    expanded; `fused`: once per pair, straight into the experts' order)."""


class Validation(str, enum.Enum):
    """How the ranks check each call's inputs on the host. Both check every rank's own inputs
    (types, dtypes, devices, shapes, the weights against the config: what keeps the kernels in
    bounds) and the device checks expert ids and buffer capacity (raised by `Workspace.check()`);
    they differ in what happens when one rank's input is bad. There is no mode without checks: a
    rank's own checks are what keeps the kernels in bounds, and cost host time at every call
    (docs/tuning.md; skipped for inputs like the last accepted call's, where the device checks the
    ids); where the host bounds a model, a CUDA graph of its step removes them with the rest of
    the host's work."""

    COLLECTIVE = "collective"
    """The ranks then agree over a CPU (gloo) twin of the group, one host round trip per forward
    and per backward (its cost: docs/tuning.md): a bad input on any rank makes every rank raise
    MoKInputError before any exchange, and the group stays usable. The default: the fast
    backends do not wait for the host, so where a layer's GPU time exceeds its host time the
    round trip costs nothing."""
    LOCAL = "local"
    """No round trip: a rank with a bad input raises MoKInputError alone and skips the call. The
    other ranks' exchange then waits for it: on the triton backend until `peer_timeout_s`, then
    `Workspace.check()` raises MoKTimeoutError and every rank calls `Workspace.reset()`; on the
    collective exchanges of the reference backend until the process group's timeout. The hosts
    no longer meet at every call either, so `peer_timeout_s` must exceed the longest host-side
    stall of one rank between layer calls (a checkpoint written by one rank, say). Use it for
    small layers bound by the host, where the round trip shows."""


class Graphs(str, enum.Enum):
    """Whether the layer replays its own calls from CUDA graphs (CUDA devices, the `triton` and
    `fused` backends; `mok.graphs`). From the second call of a token count on, a call is then a
    copy of its inputs, one graph launch and a copy of its outputs, instead of 20-30 kernel
    launches and the Python around them (their host time: docs/tuning.md), with the same results
    bit for bit. What it costs: the graphs keep their memory between calls (the saved
    activations, the backward's weight gradients, the weights they read) and capture once per
    token count, at most four of them per layer (`workspace.graphs.clear()` drops them)."""

    AUTO = "auto"
    """Graphs for layers whose calls the host bounds: bf16, not `exact_buffers`, and the memory
    a graph keeps (weight gradients and per-pair activations) within 64 MiB at that token
    count (`mok.graphs.kept_bytes`); larger layers give the GPU more work per launch than the
    host takes to launch it."""
    ON = "on"
    """Graphs at every size and precision (not with `exact_buffers`, which reads the host)."""
    OFF = "off"
    """Every call launches its kernels."""


class MXWeightCasts(str, enum.Enum):
    """When the routed weights' FP8 casts are made (precisions "mxfp8" and "fp8_block", `triton`
    backend). MXFP8's products read each weight as the values of its cast along their reduction
    dimension: one layout in forward, the other in backward, each the weight's size in bf16. The
    128-block recipe's one block cast (e4m3 and a descale per 128 x 128 block, about half the
    weight's bf16 size) serves both passes: `keep` and `auto` alike keep it between calls that
    will not run backward, and `keep` also between training calls."""

    AUTO = "auto"
    """`per_pass` for calls that will run backward (training), `keep` for the forward layout
    of calls that will not (evaluation, inference with fixed weights)."""
    KEEP = "keep"
    """Both layouts made in one pass over each weight and kept until the weights change (an
    optimizer step): a step's forward and backward and every micro-batch of it reuse them, for
    two bf16 copies of every routed weight held between steps (beside the weights themselves)."""
    PER_PASS = "per_pass"
    """Each pass casts the layout it reads and drops it after: no copy of the weights is held
    between passes, for one more read of the weights a step (and a cast per micro-batch)."""


class Recompute(str, enum.Enum):
    """What the experts' backward makes again instead of keeping it from the forward (the
    `triton` and `fused` backends, bf16; the `reference` backend keeps autograd's tensors)."""

    NONE = "none"
    """The forward keeps h and the pre-activations gate | up of every pair for the backward."""
    GATE_UP = "gate_up"
    """The forward keeps neither; the backward runs the gate/up product with its activation
    again, on the rows the forward read (kept either way), before its first product: bitwise
    the same h and pre-activations, so the same gradients. Per layer it holds T x k x 3I fewer
    values between the passes (routed experts; T x 3I of the shared expert) and its forward
    writes no pre-activations, for one more gate/up product in the backward."""


class RouterGradient(str, enum.Enum):
    """How the backward forms the router weights' gradient <grad_y[t], out[t, j]> (bf16)."""

    SAVED_OUTPUTS = "saved_outputs"
    """The forward keeps every pair's expert output (T x k x H values a layer) and the combine's
    backward reads them: the output rounded to bf16 enters the gradient. The pairs' gradients
    w * grad_y are rounded before the down product's data and weight gradients."""
    EPILOGUE = "epilogue"
    """The forward keeps no pair outputs: the down product's data gradient takes grad_y's rows
    unweighted and forms <grad_y[t] @ W_down[e], h> in its epilogue, in fp32 from the operands
    the forward used (exact but for fp32 sums), then applies the weight to the product before
    its one rounding; W_down's gradient reads round(w * h). The down product's backward takes
    longer, since its epilogue reads and writes h (measured:
    benchmarks/results/2026-12-04-router-gradient-epilogue-h200.md). At EP > 1 a
    token's grad_y row crosses to each owner once, with each pair's weight, instead of one
    weighted row per pair, and each pair's dot comes back. With expert biases the dots gain
    <grad_y[t], b_down[e]> and b_down's gradient sums w * grad_y in fp32. bf16; the `reference`
    and `triton` and `fused` backends, any EP."""


@dataclasses.dataclass(frozen=True)
class MoKTuning:
    """How the backends run a layer, with the same results at every setting (bit for bit): where
    the time and memory go. The defaults suit most layers; change one where a profile or a memory
    budget says so (docs/tuning.md). Validated on construction; part of the config the ranks
    agree on."""

    comm_sms: int = 24
    """SMs the NVLink exchange's copy kernels run on (EP > 1), and the SMs the `fused` backend's
    communication programs hold beside the expert products: more move rows faster and leave fewer
    SMs to the products. Change it only where a profile shows the exchange or the products
    waiting (docs/notes/comm-design.md, "Bandwidth")."""
    exact_buffers: bool = False
    """Size each call's tensors with a row per received pair (the expert products' rows, their
    activations and gradients) by the pairs this rank received, read on the host after the
    routing, instead of by `recv_pair_capacity`: the memory of an all-to-all with exact sizes
    (the baseline's) for one device synchronization per forward (the host waits for the routing's
    counts); the same results. Use it at EP > 1 where memory is short and that synchronization is
    acceptable; a call under CUDA-graph capture raises. The `fused` backend's default (the tokens
    received kept instead of the grouped rows, see `keep_grouped_rows`) reaches about the same
    peak without it; there the option keeps the grouped rows at their exact size, for the gate/up
    weight gradient on TMA tiles. Peaks measured: docs/tuning.md. No effect where the exchange
    sizes exactly already: EP 1, and the collective exchange (which synchronizes anyway)."""
    keep_grouped_rows: bool = False
    """Keep the grouped rows (a copy of a token per pair: k times the rows) for the backward, so
    that the gate/up weight gradient reads them on TMA tiles. Without it (the default) the layer
    keeps the tokens its experts read, once each, and that product reads them through each
    grouped row's index, a little slower. At EP 1 (the triton and fused backends, bf16) those
    tokens are x itself, so the grouped rows (T x k x H) go with the forward; the `fused` backend
    at EP > 1 keeps the tokens received (EP x T rows at most, where the grouped rows are sized
    for the worst routing: EP x T x k). Set it where memory is plentiful and that product's time
    matters (time and peaks measured: docs/tuning.md). The same results. No effect where the
    grouped rows are kept anyway: MXFP8, the triton backend at EP > 1, and for the fused backend
    at EP > 1 `exact_buffers` and the push dispatch."""
    dispatch: Dispatch = Dispatch.AUTO
    """Who moves the rows of the NVLink dispatch (EP > 1): see `Dispatch`. `auto` takes each
    backend's choice; `push` and `pull` are there to compare them."""
    graphs: Graphs = Graphs.AUTO
    """Whether calls replay CUDA graphs of the layer: `auto` for small layers, whose calls the
    host bounds; `off` where the memory the graphs keep matters more than host time; `on` for
    every size. See `Graphs`."""
    mx_weight_casts: MXWeightCasts = MXWeightCasts.AUTO
    """When the routed weights' FP8 casts are made and how long they are kept (precisions
    "mxfp8" and "fp8_block"): `auto` holds no copy of the weights between passes in training;
    `keep` trades copies of every routed weight (MXFP8: two in bf16; fp8_block: one of about half
    its bf16 size) for fewer casts. See `MXWeightCasts`."""
    recompute: Recompute = Recompute.NONE
    """Whether the backward makes the experts' h and pre-activations again instead of keeping
    them from the forward (bf16): `gate_up` where many layers' activations do not fit, for one
    more gate/up product in the backward and the same gradients. See `Recompute`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dispatch", parse_enum(Dispatch, self.dispatch, "dispatch"))
        object.__setattr__(self, "graphs", parse_enum(Graphs, self.graphs, "graphs"))
        weight_casts = parse_enum(MXWeightCasts, self.mx_weight_casts, "mx_weight_casts")
        object.__setattr__(self, "mx_weight_casts", weight_casts)
        object.__setattr__(self, "recompute", parse_enum(Recompute, self.recompute, "recompute"))
        _require_int(self, "comm_sms", minimum=1)
        for name in ("exact_buffers", "keep_grouped_rows"):
            if not isinstance(getattr(self, name), bool):
                raise MoKConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")


TUNING_FIELDS = frozenset(field.name for field in dataclasses.fields(MoKTuning))
"""The names of `MoKTuning`'s fields, which `MoKConfig.replace` and the adapters' options take
beside the config's own."""


@dataclasses.dataclass(frozen=True)
class MoKConfig:
    """What one MoE layer computes (its shape, numerics and activation), the backend that runs it,
    its buffers' capacities and how its ranks check their inputs; `tuning` holds the settings
    that change where time and memory go but not the results. Validated on construction.

    All ranks of an expert-parallel group must use equal configs. The expert-parallel size is not
    part of the config: it comes from the process group the workspace is built on.
    """

    hidden_size: int
    """H: width of a token row (the model's hidden size)."""
    intermediate_size: int
    """I: intermediate width of one routed expert."""
    num_experts: int
    """E: routed experts in the whole layer (all ranks together); at EP > 1 a multiple of the
    expert-parallel size."""
    top_k: int
    """k: experts each token is routed to (at most E)."""
    shared_intermediate_size: int = 0
    """Intermediate width of the shared expert that every token passes (deepseek-v3, kimi-k2);
    0 means no shared expert."""
    swiglu_limit: float | None = None
    """Clamp L of SwiGLU: gate <= L and -L <= up <= L before silu(gate) * up, in the routed and
    the shared experts. Set it to the model's clamp (gpt-oss: 7); None: no clamp."""
    precision: Precision = Precision.BF16
    """Numerics of the routed expert GEMMs: `bf16`, or `mxfp8` to train or evaluate with MX
    numerics (H and I multiples of 32; the `reference` and `triton` backends; on Hopper the
    products read the casts' values in bf16, docs/mxfp8.md), or `fp8_block` for the 128-block
    recipe's numerics (the `reference` and `triton` backends; the triton backend's products
    decode e4m3 to bf16 so far, docs/mxfp8.md)."""
    backend: Backend = Backend.AUTO
    """Implementation. `auto` takes the fastest that can run here: `triton` on CUDA GPUs where it
    can, else `reference`. Name `fused` to overlap the exchange with the experts, `reference` for
    the plain-PyTorch oracle; see `Backend`."""
    max_tokens_per_rank: int = 8192
    """Largest T a rank passes in one call. The `triton` and `fused` backends size the NVLink
    exchange's buffers by it (EP > 1) and refuse a call with more tokens (MoKInputError): set it
    to the largest micro-batch a rank runs, since a larger value only costs memory (`mok memory`
    prints the buffer)."""
    recv_capacity: int | None = None
    """Rows of a rank's receive buffer in the NVLink exchange (EP > 1). None sizes it for the worst
    case (every token of every rank routed here), which never overflows. A smaller one saves
    memory where the routing is known to be balanced; tokens past it are dropped and
    `Workspace.check()` raises MoKCapacityError."""
    recv_pair_capacity: int | None = None
    """(token, expert) pairs a rank's experts can take in one call (EP > 1, the NVLink exchange):
    the rows of the expert GEMMs' buffers and activations. None: top_k per receive-buffer row,
    which never overflows (2x the mean of a uniform routing at EP 2, 8x at EP 8). A capacity
    factor c is `ceil(c * max_tokens_per_rank * top_k)`; pairs past it are dropped and reported by
    `Workspace.check()` (MoKCapacityError). Set one to bound memory where the routing is balanced;
    `tuning.exact_buffers` saves memory without dropping, for a host synchronization."""
    peer_timeout_s: float = 10.0
    """Longest time a rank of the `triton` or `fused` backend waits on the device for a peer (a
    barrier, rows in flight) before it gives up, records the failure and lets the call finish;
    `Workspace.check()` then raises `MoKTimeoutError`. It must exceed the longest lag between the
    ranks' GPUs reaching the same layer call (the module's input agreement keeps the hosts
    together): raise it with `validation="local"` where one rank may stall between calls."""
    validation: Validation = Validation.COLLECTIVE
    """How the ranks check each call's inputs: agreeing on them (`collective`, the default: a bad
    input raises on every rank) or each alone (`local`, no host round trip: for small layers bound
    by the host); see `Validation`."""
    swiglu_alpha: float = 1.0
    """alpha of the activation gate * sigmoid(alpha * gate) * (up + swiglu_up_offset): 1 with an
    offset of 0 is SwiGLU (silu(gate) * up); gpt-oss uses 1.702 and 1 (with its clamp at 7;
    `mok.presets.GPT_OSS_EXPERTS`)."""
    swiglu_up_offset: float = 0.0
    """Added to up (after its clamp) before the product; see `swiglu_alpha`."""
    expert_bias: bool = False
    """Per-expert biases on the routed experts' gate, up and down projections, for models that
    have them (gpt-oss)."""
    mx_rounding: ScaleRounding = ScaleRounding.RCEIL
    """How MXFP8 picks each block's scale (precision "mxfp8"): RCEIL (amax never saturates, the
    default) or FLOOR (amax's own power of two over 256), as torchao's `to_mx`. Take the one of
    the recipe the model is trained or evaluated with."""
    router_gradient: RouterGradient = RouterGradient.SAVED_OUTPUTS
    """Where the router weights' gradient is formed, and so whether the forward keeps the pairs'
    outputs: `epilogue` keeps none (T x k x H values a layer fewer) where memory is short, for a
    slower down backward. See `RouterGradient`."""
    tuning: MoKTuning = dataclasses.field(default_factory=MoKTuning)
    """The backends' settings that keep the results (`MoKTuning`); a mapping of its fields is
    taken too. `replace` changes one by its name (`config.replace(comm_sms=16)`)."""

    def __post_init__(self) -> None:
        # Accept the plain strings too ("bf16", "reference"): configs come from command lines.
        object.__setattr__(self, "precision", parse_enum(Precision, self.precision, "precision"))
        object.__setattr__(self, "backend", parse_enum(Backend, self.backend, "backend"))
        object.__setattr__(
            self, "validation", parse_enum(Validation, self.validation, "validation")
        )
        rounding = parse_enum(ScaleRounding, self.mx_rounding, "mx_rounding")
        object.__setattr__(self, "mx_rounding", rounding)
        tuning = _as_tuning(self.tuning)
        object.__setattr__(self, "tuning", tuning)
        recompute = tuning.recompute
        if recompute is not Recompute.NONE and self.precision is not Precision.BF16:
            raise MoKConfigError(
                f"recompute={recompute.value!r} applies to bf16 experts; precision "
                f"{self.precision.value!r} keeps its activations as e4m3 casts already "
                "(about half the bf16 layer's): use recompute='none'"
            )
        router_gradient = parse_enum(RouterGradient, self.router_gradient, "router_gradient")
        object.__setattr__(self, "router_gradient", router_gradient)
        if router_gradient is RouterGradient.EPILOGUE and self.precision is not Precision.BF16:
            raise MoKConfigError(
                "router_gradient='epilogue' takes bf16 experts; got precision "
                f"{self.precision.value!r}: use 'saved_outputs'"
            )
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
            _require_int(self, name, minimum=1)
        if self.precision is Precision.MXFP8:
            for name in ("hidden_size", "intermediate_size"):
                if getattr(self, name) % MX_BLOCK:
                    raise MoKConfigError(
                        f"precision='mxfp8' needs {name} to be a multiple of {MX_BLOCK} (its "
                        f"scale blocks along the reduction), got {getattr(self, name)}"
                    )
        _require_int(self, "max_tokens_per_rank", minimum=1)
        _require_int(self, "shared_intermediate_size", minimum=0)
        if self.top_k > self.num_experts:
            raise MoKConfigError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}: "
                "a token cannot pick more experts than exist"
            )
        if self.swiglu_limit is not None:
            _require_positive_float(self, "swiglu_limit", "a number or None")
        _require_positive_float(self, "peer_timeout_s", "a number")
        _require_positive_float(self, "swiglu_alpha", "a number")
        _require_finite_float(self, "swiglu_up_offset")
        if not isinstance(self.expert_bias, bool):
            raise MoKConfigError(f"expert_bias must be a bool, got {self.expert_bias!r}")
        for name in ("recv_capacity", "recv_pair_capacity"):
            if getattr(self, name) is not None:
                _require_int(self, name, minimum=1)

    @property
    def activation_dtype(self) -> torch.dtype:
        """dtype of token rows, weights, outputs and communication: bf16 at every precision (MXFP8
        quantizes inside the expert GEMMs)."""
        return torch.bfloat16

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_intermediate_size > 0

    def local_experts(self, ep_size: int) -> int:
        """E_loc: experts each of `ep_size` ranks owns; expert e lives on rank e // E_loc."""
        if not isinstance(ep_size, int) or ep_size < 1:
            raise MoKConfigError(f"expert-parallel size must be a positive int, got {ep_size!r}")
        if self.num_experts % ep_size:
            raise MoKConfigError(
                f"num_experts={self.num_experts} is not divisible by the expert-parallel size "
                f"{ep_size}: every rank must own the same number of experts"
            )
        return self.num_experts // ep_size

    def forward_flops(self, num_tokens: int) -> int:
        """GEMM FLOPs of one forward pass over `num_tokens` tokens (backward is twice this)."""
        routed = 2 * num_tokens * self.top_k * 3 * self.hidden_size * self.intermediate_size
        shared = 2 * num_tokens * 3 * self.hidden_size * self.shared_intermediate_size
        return routed + shared

    def reference_options(self) -> dict[str, object]:
        """The keyword arguments of `mok.reference.moe_forward` that this config sets (the clamp,
        precision, MX rounding, activation and router-gradient form): one mapping for every
        caller of the reference, so that none of them computes another layer than the config's."""
        return {
            "swiglu_limit": self.swiglu_limit,
            "precision": self.precision.value,
            "mx_rounding": self.mx_rounding.value,
            "swiglu_alpha": self.swiglu_alpha,
            "swiglu_up_offset": self.swiglu_up_offset,
            "router_gradient": self.router_gradient.value,
        }

    @classmethod
    def from_fields(cls, **fields) -> MoKConfig:
        """A config from the fields of `MoKConfig` and of `MoKTuning` named side by side (a
        command line's, an adapter's options): the tuning names go to `tuning`."""
        return cls(**_tuning_names_moved(fields, MoKTuning()))

    def replace(self, **changes) -> MoKConfig:
        """A copy with some fields changed (validated again); a `MoKTuning` field's name changes
        that field of `tuning`."""
        return dataclasses.replace(self, **_tuning_names_moved(changes, self.tuning))


def _as_tuning(tuning) -> MoKTuning:
    """`tuning` as a MoKTuning (a mapping of its fields is made into one), or MoKConfigError."""
    if isinstance(tuning, Mapping):
        unknown = sorted(set(tuning) - TUNING_FIELDS)
        if unknown:
            raise MoKConfigError(f"tuning: {unknown[0]!r} is not a MoKTuning field")
        tuning = MoKTuning(**tuning)
    if not isinstance(tuning, MoKTuning):
        raise MoKConfigError(f"tuning must be a MoKTuning, got {type(tuning).__name__}")
    return tuning


def _tuning_names_moved(fields: dict, base: MoKTuning) -> dict:
    """`fields` with the `MoKTuning` field names among them moved into its `tuning`: made from
    `fields`' own `tuning`, else from `base`, with those fields changed."""
    names = TUNING_FIELDS & fields.keys()
    if not names:
        return fields
    knobs = {name: fields.pop(name) for name in names}
    fields["tuning"] = dataclasses.replace(_as_tuning(fields.get("tuning", base)), **knobs)
    return fields


def parse_enum(enum_type, value, name):
    """`enum_type(value)`, or MoKConfigError naming `name` and the allowed values."""
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in enum_type)
        raise MoKConfigError(f"{name} must be one of {allowed}; got {value!r}") from None


def _require_positive_float(config: object, name: str, expected: str) -> None:
    """The field must be a finite number > 0; stored as a float."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MoKConfigError(f"{name} must be {expected}, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise MoKConfigError(f"{name} must be finite and > 0, got {value}")
    object.__setattr__(config, name, float(value))


def _require_finite_float(config: object, name: str) -> None:
    """The field must be a finite number; stored as a float."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MoKConfigError(f"{name} must be a finite number, got {value!r}")
    object.__setattr__(config, name, float(value))


def _require_int(config: object, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MoKConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise MoKConfigError(f"{name} must be >= {minimum}, got {value}")
