"""The `reference` backend: `mok.reference` behind the functional API.

Runs anywhere PyTorch runs (CPU with gloo, GPUs with NCCL). It synchronizes with the host for the
routing counts and keeps the whole autograd graph of forward for backward; it is the oracle and the
fallback, not the fast path.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch

from mok.reference import ReferenceRouting, moe_forward
from mok.weights import MoEGradients, MoEWeights

T = TypeVar("T")


@dataclasses.dataclass
class _SavedGraph:
    """Forward's output with its autograd graph and the leaves backward differentiates against."""

    y: torch.Tensor
    x: torch.Tensor
    topk_weights: torch.Tensor
    weights: MoEWeights


class ReferenceBackend:
    name = "reference"
    checks_ids_on_device = False
    max_tokens = None

    def __init__(self, workspace) -> None:
        self.workspace = workspace

    @staticmethod
    def unavailable_reason(config, device: torch.device, group) -> str | None:
        return None

    @staticmethod
    def auto_skip_reason(device: torch.device) -> str | None:
        return None

    def route(self, topk_idx: torch.Tensor) -> ReferenceRouting:
        ws = self.workspace
        return ReferenceRouting.exchange(topk_idx, ws.config.num_experts, ws.group)

    def forward(self, routing, topk_idx, x, topk_weights, weights, need_backward):
        run = dict(
            topk_idx=topk_idx,
            **self.workspace.config.reference_options(),
            group=self.workspace.group,
            routing=routing,
        )
        if not need_backward:
            with torch.no_grad():
                return moe_forward(x, topk_weights=topk_weights, weights=weights, **run), None
        leaves = _SavedGraph(
            y=None,
            x=_leaf(x),
            topk_weights=_leaf(topk_weights),
            weights=weights.map(_leaf),
        )

        def record():
            with torch.enable_grad():
                return moe_forward(
                    leaves.x, topk_weights=leaves.topk_weights, weights=leaves.weights, **run
                )

        leaves.y = _where_autograd_records(record, x.device)
        return leaves.y.detach(), leaves

    def backward(
        self, routing, saved: _SavedGraph, grad_y: torch.Tensor, accumulate_into: dict
    ) -> MoEGradients:
        weight_items = [(k, v) for k, v in saved.weights.tensors().items() if v is not None]
        inputs = [saved.x, saved.topk_weights] + [v for _, v in weight_items]
        # Runs the graph recorded by forward, on this thread: running needs no recording, and
        # under a compiled CUDA backward this thread is the autograd engine's device thread, on
        # which a helper thread's autograd.grad would wait forever.
        grads = torch.autograd.grad(saved.y, inputs, grad_y.to(saved.y.dtype), allow_unused=True)
        grads = [
            torch.zeros_like(i) if g is None else g for i, g in zip(inputs, grads, strict=True)
        ]
        weight_grads = dict.fromkeys(saved.weights.tensors())
        weight_grads.update({name: g for (name, _), g in zip(weight_items, grads[2:], strict=True)})
        for name, buffer in accumulate_into.items():
            # Not fused: the bf16 gradient is added afterwards, in fp32, rounded once more.
            buffer.copy_(buffer.float() + weight_grads[name].float())
            weight_grads[name] = buffer
        return MoEGradients(x=grads[0], topk_weights=grads[1], weights=MoEWeights(**weight_grads))

    def check(self) -> None:
        """Nothing is checked on the device: inputs were checked on the host."""

    def reset(self) -> None:
        """Nothing waits on the device: nothing to reset."""

    def release(self) -> None:
        pass

    def memory_outside_allocator(self) -> int:
        return 0


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().requires_grad_(True)


_AUTOGRAD_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mok-autograd")


def _autograd_records() -> bool:
    """Whether operations on tensors that require grad record a graph on this thread."""
    with torch.enable_grad():
        return (torch.ones(1, requires_grad=True) * 1).grad_fn is not None


def _where_autograd_records(work: Callable[[], T], device: torch.device) -> T:
    """work() on this thread, or, where autograd does not record here, on a helper thread on the
    same CUDA device and stream, waited for. torch.compile reaches the layer through the custom
    ops of `mok.ops`, and PyTorch runs a custom op's implementation with autograd's dispatch
    keys excluded on the calling thread (grad mode cannot switch them back on); a new thread
    starts without that exclusion. The operations are the same, so are the results."""
    if _autograd_records():
        return work()
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def on_helper():
        if stream is None:
            return work()
        with torch.cuda.device(device), torch.cuda.stream(stream):
            return work()

    return _AUTOGRAD_THREAD.submit(on_helper).result()
