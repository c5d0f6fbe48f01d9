"""The layer's calls replayed from CUDA graphs (`MoKTuning.graphs`).

A small layer is bound by the host: its 20-30 kernel launches and the Python around them take
1-2 ms a forward where the GPU needs microseconds. The layer never synchronizes with the host and
its kernels read what the call allocates, so a call can be captured once and replayed: a replay is
a copy of the inputs into the graph's own, one graph launch and a copy of each output.

Per workspace, `GraphCache` keeps at most `MAX_FORWARDS` captured forwards, keyed by the token
count, whether backward follows, the inputs' dtypes and the weights' addresses (the graph reads
the weights in place: an optimizer step that updates them in place is seen by the next replay, a
weight replaced by another tensor makes a new key). Each forward keeps its captured backwards,
keyed by the dtype of grad_y and by which weights' gradients are added into existing buffers (and
their dtypes). The first call of a key runs eagerly (it compiles kernels and warms caches, which a
capture cannot), the second captures and replays.

A backward graph reads the weights where they were at capture; where one of them has moved since
(FSDP2 frees the unsharded weights after forward and gathers them again for backward), that
backward launches its kernels on the replay's saved state instead.

What a captured forward saves for backward lives in its graph's memory, so one replay of a key
at a time may wait for its backward: while it waits, another forward of that key (a second
micro-batch in flight, a layer called twice) runs eagerly. The wait ends with the backward, or
when what the forward saved is freed unused (autograd dropped its graph).

A capture that CUDA refuses (an operation a graph cannot hold) warns once and turns the cache off:
capturing records without running, so that call, and every later one, launches its kernels.

The checks and the ranks' agreement on the inputs run at every call before this (functional), so
every rank meets the others the same number of times whether it replays, captures or launches;
what the device checks (expert ids, capacity, peer timeouts) is captured with the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from collections.abc import Callable

import torch

from mok.config import Graphs, MoKConfig, Precision, Recompute, RouterGradient
from mok.tree import structural_copy, take_tensors
from mok.weights import (
    MoEGradients,
    MoEWeights,
    are_gate_up_halves,
    gate_up_halves,
    joined_gate_up,
)

MAX_FORWARDS = 4
"""Captured forwards per workspace; calls of further keys run eagerly."""
AUTO_KEPT_BYTES = 64 * 2**20
"""`Graphs.AUTO` captures a token count whose graphs keep at most this much (`kept_bytes`)."""
_MAX_SEEN = 64


def kept_bytes(config: MoKConfig, local_experts: int, ep_size: int, num_tokens: int) -> int:
    """Bytes the graphs of one token count keep between calls, roughly: the weights' gradients
    (the backward's outputs) and the per-pair activations (rows, pre-activations, h, outputs) of
    the most pairs a rank can receive from `ep_size` ranks of `num_tokens` tokens (h and the
    pre-activations only where the forward keeps them, `MoKTuning.recompute`; the outputs only
    where the router weights' gradient reads them, `MoKConfig.router_gradient`)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    weights = local_experts * 3 * hidden * inter + 3 * config.shared_intermediate_size * hidden
    pairs = ep_size * num_tokens * config.top_k
    element = config.activation_dtype.itemsize
    kept_inter = 3 * inter if config.tuning.recompute is Recompute.NONE else 0
    kept_hidden = hidden if config.router_gradient is RouterGradient.EPILOGUE else 2 * hidden
    return element * (weights + pairs * (kept_hidden + kept_inter))


def captures(config: MoKConfig, local_experts: int, ep_size: int, num_tokens: int) -> bool:
    """Whether calls of `num_tokens` tokens replay graphs under `config.tuning.graphs`."""
    if config.tuning.graphs is Graphs.OFF or config.tuning.exact_buffers or num_tokens == 0:
        return False
    if config.tuning.graphs is Graphs.ON:
        return True
    return (
        config.precision is Precision.BF16
        and kept_bytes(config, local_experts, ep_size, num_tokens) <= AUTO_KEPT_BYTES
    )


@dataclasses.dataclass(eq=False)
class _CapturedBackward:
    graph: torch.cuda.CUDAGraph
    grad_y: torch.Tensor
    into: dict[str, torch.Tensor]
    """The gradient buffers the graph adds into, copied in from the caller's before a replay and
    back after it."""
    grads: MoEGradients


@dataclasses.dataclass(eq=False)
class _CapturedForward:
    graph: torch.cuda.CUDAGraph
    topk_idx: torch.Tensor
    x: torch.Tensor
    topk_weights: torch.Tensor
    schedule: object
    y: torch.Tensor
    saved: object
    """The functional SavedForward of the capture (None without backward); every backward runs on
    a structural copy of it, since a backward takes its state apart as it goes."""
    held: list[torch.Tensor]
    """Every tensor of schedule and saved, held here so that their memory stays theirs."""
    weights: list[tuple[torch.Tensor, int]]
    """The weights the graphs read, with their addresses at capture: FSDP2 frees a weight's
    storage between forward and backward and makes it anew, maybe elsewhere, and a backward
    graph must not read where the weight was."""
    backwards: dict[tuple, _CapturedBackward] = dataclasses.field(default_factory=dict)
    warm_backwards: set[tuple] = dataclasses.field(default_factory=set)
    replays: int = 0
    waiting: bool = False
    """A replay's saved state waits for its backward."""


@dataclasses.dataclass(eq=False)
class GraphedState:
    """`SavedForward.saved` of a replayed call: the capture that holds its state and the replay
    it came from (the state is valid while no later replay of the capture ran)."""

    forward: _CapturedForward
    replay: int
    used: bool = False


def _stop_waiting(forward: _CapturedForward, replay: int) -> None:
    if forward.replays == replay:
        forward.waiting = False


def call_key(topk_idx, x, topk_weights, weights) -> tuple | None:
    """What a call's inputs are, short of their values: for each input its type, shape, dtype
    and device, and for each weight also its address and strides (None where absent). Two calls
    with equal keys pass the same host checks (they look at nothing else) and, with the same
    need for backward, can replay the same graph (which reads the weights in place). None where
    an input is not a tensor or `weights` not a MoEWeights (the checks then say why)."""
    inputs = (topk_idx, x, topk_weights)
    if not all(isinstance(t, torch.Tensor) for t in inputs) or type(weights) is not MoEWeights:
        return None
    key = tuple((type(t), t.shape, t.dtype, t.device) for t in inputs)
    return key + tuple(
        None if t is None else (type(t), t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
        for t in weights.astuple()
    )


def _sync_debug_mode_set() -> bool:
    """CUDA's sync debug mode is set (e.g. to prove a call never waits for the GPU): a capture,
    which synchronizes the device once before it starts, is left for later."""
    return torch.cuda.get_sync_debug_mode() != 0


def _static(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _capture(run: Callable):
    """(graph, what `run()` returned while it was captured). A capture that CUDA refuses raises
    RuntimeError and leaves the caller's stream and PyTorch's random generator as they were."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            result = run()
    except RuntimeError:
        # The graph's exit raised in capture_end, before it restored the stream and before
        # PyTorch ended its CUDA generator's capture, which would then refuse every later random
        # operation of the process ("Offset increment outside graph capture"); a capture that
        # ends well ends it.
        torch.cuda.set_stream(stream)
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch.zeros(1, device=stream.device)
        raise
    return graph, result


class GraphCache:
    """The captured calls of one workspace. `run_forward(topk_idx, x, topk_weights, weights,
    need_backward) -> (schedule, y, saved)` and `run_backward(schedule, saved, grad_y, into) ->
    MoEGradients` are the workspace's unchecked eager calls; `wanted(num_tokens)` says whether a
    token count is worth its graphs."""

    def __init__(
        self,
        run_forward: Callable,
        run_backward: Callable,
        wanted: Callable[[int], bool],
    ) -> None:
        self._run_forward = run_forward
        self._run_backward = run_backward
        self._wanted = functools.lru_cache(maxsize=_MAX_SEEN)(wanted)
        self._forwards: dict[tuple, _CapturedForward] = {}
        self._seen: set[tuple] = set()
        self.failed: str | None = None
        """Why a capture failed, after which this cache captures nothing more (every call then
        launches its kernels); None while none has."""
        self.replays = 0
        """Forward calls replayed so far (tests, benchmarks)."""

    @property
    def captured(self) -> int:
        """Forwards captured so far (tests, benchmarks)."""
        return len(self._forwards)

    def takes(self, num_tokens: int) -> bool:
        """Whether calls of `num_tokens` tokens are captured (the config's policy)."""
        return self._wanted(num_tokens)

    def clear(self) -> None:
        """Drop every capture, and the memory it holds (its activations, its gradients, and the
        weights it read: a weight replaced by another tensor stays alive while a capture of it
        does). A call whose state waits for its backward keeps its own capture until then."""
        self._forwards.clear()
        self._seen.clear()

    def forward(
        self, topk_idx, x, topk_weights, weights: MoEWeights, need_backward: bool, key: tuple
    ):
        """(schedule, y, saved) of this call replayed from a graph (`saved`: a GraphedState or
        None), or None where the call is to run eagerly. `key`: the call's `call_key`."""
        num_tokens = topk_idx.shape[0]
        if self.failed or torch.cuda.is_current_stream_capturing() or not self.takes(num_tokens):
            return None
        key = (need_backward, key)
        forward = self._forwards.get(key)
        if forward is None:
            if key not in self._seen:
                if len(self._seen) < _MAX_SEEN:
                    self._seen.add(key)
                return None
            if len(self._forwards) >= MAX_FORWARDS or _sync_debug_mode_set():
                return None
            forward = self._try(
                self._capture_forward, topk_idx, x, topk_weights, weights, need_backward
            )
            if forward is None:
                return None
            self._forwards[key] = forward
        elif forward.waiting:
            return None
        else:
            torch._foreach_copy_(
                [forward.topk_idx, forward.x, forward.topk_weights], [topk_idx, x, topk_weights]
            )
        forward.graph.replay()
        self.replays += 1
        y = forward.y.clone()
        if forward.saved is None:
            return forward.schedule, y, None
        forward.replays += 1
        forward.waiting = True
        state = GraphedState(forward, forward.replays)
        weakref.finalize(state, _stop_waiting, forward, forward.replays)
        return forward.schedule, y, dataclasses.replace(forward.saved, saved=state)

    def _try(self, capture, *args):
        """`capture(*args)`, or None (and a warning, and no captures from then on) where CUDA
        refused it: a capture records without running, so the call then launches its kernels
        as if none had been tried."""
        try:
            return capture(*args)
        except RuntimeError as error:
            self.failed = f"{type(error).__name__}: {error}"
            warnings.warn(
                f"mok: capturing the layer's CUDA graph failed ({self.failed}); its calls launch "
                "their kernels from now on (MoKTuning.graphs='off' skips the attempt)",
                RuntimeWarning,
                stacklevel=4,
            )
            return None

    def _capture_forward(self, topk_idx, x, topk_weights, weights, need_backward):
        statics = [_static(t) for t in (topk_idx, x, topk_weights)]
        graph, (schedule, y, saved) = _capture(
            lambda: self._run_forward(*statics, weights, need_backward)
        )
        held: list[torch.Tensor] = []
        take_tensors((schedule, saved), held)
        present = [t for t in weights.astuple() if t is not None]
        addresses = [(t, t.data_ptr()) for t in present]
        return _CapturedForward(graph, *statics, schedule, y, saved, held, addresses)

    def backward(
        self, state: GraphedState, grad_y: torch.Tensor, into: dict[str, torch.Tensor]
    ) -> MoEGradients:
        """The gradients of the replayed call `state` (as the eager backward's: buffers in
        `into` get the gradient added and are returned in its place)."""
        forward = state.forward
        if state.used or forward.replays != state.replay:
            raise RuntimeError(
                "this forward's saved state was used by a backward already: a layer call "
                "serves one backward"
            )
        state.used = True
        try:
            key = (grad_y.dtype,) + tuple((n, b.dtype) for n, b in sorted(into.items()))
            backward = forward.backwards.get(key)
            in_place = all(t.data_ptr() == address for t, address in forward.weights)
            if backward is None and key in forward.warm_backwards and in_place:
                capturing = torch.cuda.is_current_stream_capturing()
                if not (self.failed or capturing or _sync_debug_mode_set()):
                    backward = self._try(self._capture_backward, forward, grad_y, into)
                    if backward is not None:
                        forward.backwards[key] = backward
            if backward is None or not in_place:
                forward.warm_backwards.add(key)
                schedule, saved = structural_copy((forward.schedule, forward.saved))
                return self._run_backward(schedule, saved, grad_y, into)
            statics = [backward.grad_y, *(backward.into[name] for name in into)]
            torch._foreach_copy_(statics, [grad_y, *into.values()])
            backward.graph.replay()
            return self._gradients(backward, into)
        finally:
            forward.waiting = False

    def _capture_backward(self, forward, grad_y, into):
        static_grad_y = _static(grad_y)
        static_into = {name: _static(buffer) for name, buffer in into.items()}
        schedule, saved = structural_copy((forward.schedule, forward.saved))
        graph, grads = _capture(
            lambda: self._run_backward(schedule, saved, static_grad_y, static_into)
        )
        return _CapturedBackward(graph, static_grad_y, static_into, grads)

    @staticmethod
    def _gradients(backward: _CapturedBackward, into: dict) -> MoEGradients:
        """The captured gradients copied out: into the caller's buffers for `into`, else into
        new tensors (the next replay overwrites the graph's); gate and up as the halves of one
        tensor where the graph wrote them so (`joined_gate_up` then takes it whole)."""
        grads = backward.grads
        whole = _cloned_whole(grads.weights, into)
        present = {name: t for name, t in grads.weights.tensors().items() if t is not None}
        if into:
            torch._foreach_copy_(list(into.values()), [present[name] for name in into])
        handed = {"x": grads.x, "topk_weights": grads.topk_weights}
        if whole:
            handed["gate_up"] = joined_gate_up(grads.weights.gate, grads.weights.up)
        handed.update(
            (name, t)
            for name, t in present.items()
            if name not in into and not (whole and name in ("gate", "up"))
        )
        copies = dict(zip(handed, _fresh_copies(list(handed.values())), strict=True))
        weights = {name: into[name] if name in into else copies.get(name) for name in present}
        if whole:
            weights["gate"], weights["up"] = gate_up_halves(copies["gate_up"])
        x, topk_weights = copies["x"], copies["topk_weights"]
        return MoEGradients(x=x, topk_weights=topk_weights, weights=MoEWeights(**weights))


def _fresh_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of floating-point `tensors` in new memory: one multiplication by one per dtype
    over all of them at once, where a clone each would cost a launch and its host time. Bitwise
    for every number, signed zeros and subnormals included; a NaN stays a NaN."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for position, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(position)
    copies: list[torch.Tensor | None] = [None] * len(tensors)
    for positions in by_dtype.values():
        made = torch._foreach_mul([tensors[p] for p in positions], 1.0)
        for position, copy in zip(positions, made, strict=True):
            copies[position] = copy
    return copies


def _cloned_whole(grads: MoEWeights, into: dict) -> bool:
    """Whether the gate and up gradients are copied out as one tensor: neither goes into a
    caller's buffer, and the graph wrote them as the halves of one."""
    return "gate" not in into and "up" not in into and are_gate_up_halves(grads.gate, grads.up)
