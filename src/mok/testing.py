"""Checking a layer against the single-process reference: shared by `mok bench` and the tests."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os

import torch
import torch.distributed as dist

from mok.config import MoKConfig
from mok.reference import expert_mlp, moe_forward
from mok.validation import expected_weight_shapes
from mok.weights import ROUTED_FIELDS, MoEWeights

_ERROR_CHUNK = 1 << 24


@dataclasses.dataclass
class RankInputs:
    """One rank's inputs of a forward + backward call."""

    x: torch.Tensor  # [T, H] bf16
    topk_idx: torch.Tensor  # [T, k] int
    topk_weights: torch.Tensor  # [T, k] float
    grad_y: torch.Tensor  # [T, H] bf16


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (the plain error norm if expected is 0).
    NaN or inf anywhere gives inf, so that no comparison can pass on them. Works through chunks
    of the flattened tensors, so that comparing the largest weight gradients needs little memory."""
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    actual, expected = actual.reshape(-1), expected.reshape(-1)
    error_sq = scale_sq = 0.0
    for start in range(0, actual.numel(), _ERROR_CHUNK):
        a = actual[start : start + _ERROR_CHUNK].double()
        e = expected[start : start + _ERROR_CHUNK].double()
        if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
            return float("inf")
        error_sq += (a - e).square().sum().item()
        scale_sq += e.square().sum().item()
    error, scale = error_sq**0.5, scale_sq**0.5
    return error / scale if scale > 0 else error


def global_weights(config: MoKConfig, seed: int, device) -> MoEWeights:
    """Weights of all E experts in the config's activation dtype, std 1/sqrt(fan_in), the same
    wherever they are rebuilt."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(shape):
        if shape is None:
            return None
        values = torch.randn(shape, generator=generator, device=device)
        return (values / shape[-1] ** 0.5).to(config.activation_dtype)

    shapes = expected_weight_shapes(config, config.num_experts)
    return MoEWeights(**{name: draw(shape) for name, shape in shapes.items()})


def weights_of_preactivation_std(
    config: MoKConfig, std: float, device, seed: int = 0
) -> MoEWeights:
    """`global_weights` with the gate and up projections (routed and shared) scaled so that rows
    of N(0, 1) entries give pre-activations of standard deviation about `std`."""
    scaled = {"gate", "up", "shared_gate", "shared_up"}
    return MoEWeights(
        **{
            name: (t.float() * std).to(t.dtype) if name in scaled and t is not None else t
            for name, t in global_weights(config, seed, device).tensors().items()
        }
    )


def clamped_share(
    x: torch.Tensor, topk_idx: torch.Tensor, weights: MoEWeights, swiglu_limit: float
) -> float:
    """Share of the routed gate/up pre-activation elements that the SwiGLU clamp changes
    (gate > L or |up| > L), computed per local expert on the rows routed to it."""
    clamped = total = 0
    for expert in range(weights.gate.shape[0]):
        rows = x[(topk_idx == expert).any(1)].float()
        gate = rows @ weights.gate[expert].float().T
        up = rows @ weights.up[expert].float().T
        clamped += int(((gate > swiglu_limit) | (up.abs() > swiglu_limit)).sum())
        total += gate.numel()
    return clamped / max(total, 1)


def float64_results(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    grad_y: torch.Tensor,
    weights: MoEWeights,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.0,
    swiglu_up_offset: float = 0.0,
) -> dict[str, torch.Tensor]:
    """y and every gradient of the single-process layer computed in float64 (exact math up to
    float64 rounding): `reference_results` in float64 with the activation as `mok.MoKConfig`'s
    (SwiGLU by default, gpt-oss's with alpha 1.702 and up offset 1)."""
    return reference_results(
        torch.float64,
        x,
        topk_idx,
        topk_weights,
        grad_y,
        weights,
        swiglu_limit=swiglu_limit,
        swiglu_alpha=swiglu_alpha,
        swiglu_up_offset=swiglu_up_offset,
    )


def reference_results(
    dtype: torch.dtype,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    grad_y: torch.Tensor,
    weights: MoEWeights,
    **options,
) -> dict[str, torch.Tensor]:
    """y and every gradient of `mok.reference.moe_forward(**options)` on copies of the inputs
    and weights in `dtype`, keyed as `one_call_results`: "y", "grad x", "grad topk_weights",
    "grad <weight>" (zeros for experts no token reached)."""
    x = x.to(dtype).clone().requires_grad_(True)
    w = topk_weights.to(dtype).clone().requires_grad_(True)
    full = weights.map(lambda t: t.to(dtype).clone().requires_grad_(True))
    y = moe_forward(x, topk_idx, w, full, **options)
    y.backward(grad_y.to(dtype))
    results = {"y": y.detach(), "grad x": x.grad, "grad topk_weights": w.grad}
    for name, tensor in full.tensors().items():
        if tensor is not None:
            grad = tensor.grad
            results[f"grad {name}"] = torch.zeros_like(tensor) if grad is None else grad
    return results


def compare_with_reference(
    layer,
    full_weights: MoEWeights,
    everyone: list[RankInputs],
    rank: int,
    dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Relative errors of `layer` (a mok.MoE holding its slice of `full_weights`) on this rank's
    inputs against the single-process reference on the inputs of all ranks, at the layer's
    precision (bf16 or MXFP8).

    Runs forward and backward on every rank (collective when the layer has a group). Keys: "y",
    "grad x", "grad topk_weights", "grad <weight>". The shared expert's gradient is summed over the
    ranks first: it is replicated, and data parallelism sums it. dtype: the reference's inputs
    and weights converted first (fp32: the rounding points of the triton backend's CPU test
    mode, which computes in fp32 where GPUs round to bf16).
    """
    mine = everyone[rank]
    x = mine.x.clone().requires_grad_(True)
    topk_weights = mine.topk_weights.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x, mine.topk_idx, topk_weights)
    y.backward(mine.grad_y)

    def converted(t):
        return t if dtype is None else t.to(dtype)

    full = full_weights.map(lambda t: converted(t.detach()).clone().requires_grad_(True))
    x_all = converted(torch.cat([r.x for r in everyone])).requires_grad_(True)
    w_all = converted(torch.cat([r.topk_weights for r in everyone])).requires_grad_(True)
    idx_all = torch.cat([r.topk_idx for r in everyone])
    config = layer.config
    y_all = moe_forward(x_all, idx_all, w_all, full, **config.reference_options())
    y_all.backward(converted(torch.cat([r.grad_y for r in everyone])))

    start = sum(r.x.shape[0] for r in everyone[:rank])
    rows = slice(start, start + mine.x.shape[0])
    errors = {
        "y": relative_error(y.detach(), y_all[rows].detach()),
        "grad x": relative_error(x.grad, x_all.grad[rows]),
        "grad topk_weights": relative_error(topk_weights.grad, w_all.grad[rows]),
    }
    local = slice(layer.first_expert, layer.first_expert + layer.local_experts)
    for name, reference in full.tensors().items():
        if reference is None:
            continue
        grad = getattr(layer, name).grad
        # An expert no token reached gets no gradient from autograd: its gradient is zero.
        expected = torch.zeros_like(reference) if reference.grad is None else reference.grad
        if name in ROUTED_FIELDS:
            expected = expected[local]
        else:
            if layer.group is not None:
                grad = grad.float()
                dist.all_reduce(grad, group=layer.group)
        errors[f"grad {name}"] = relative_error(grad, expected)
    layer.zero_grad(set_to_none=True)
    return errors


def _one_call(layer, inputs: RankInputs) -> dict[str, torch.Tensor]:
    """One forward and backward of `layer` on fresh leaves of `inputs`, gradients set to None
    first: y, and the gradients of x and topk_weights (the parameters' stay in `.grad`)."""
    x = inputs.x.detach().clone().requires_grad_(True)
    weights = inputs.topk_weights.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x, inputs.topk_idx, weights)
    y.backward(inputs.grad_y)
    return {"y": y.detach(), "grad x": x.grad, "grad topk_weights": weights.grad}


def one_call_results(layer, inputs: RankInputs) -> dict[str, torch.Tensor]:
    """y and every gradient (x, topk_weights, each parameter) of one forward and backward of
    `layer` on `inputs` (a parameter without a gradient counts as zeros); leaves no gradients."""
    results = _one_call(layer, inputs)
    for name, param in layer.named_parameters(recurse=False):
        grad = param.grad
        results[f"grad {name}"] = torch.zeros_like(param) if grad is None else grad.clone()
    layer.zero_grad(set_to_none=True)
    return results


def one_call_errors(
    layer, inputs: RankInputs, expected: dict[str, torch.Tensor]
) -> dict[str, float]:
    """`relative_error` of each of `one_call_results(layer, inputs)` against `expected` (the same
    keys), computed as the gradients lie in the parameters: no copy of them is made, so that a
    layer whose weights fill half the GPU can be checked against results already held."""
    errors = {
        key: relative_error(value, expected[key]) for key, value in _one_call(layer, inputs).items()
    }
    for name, param in layer.named_parameters(recurse=False):
        grad = torch.zeros_like(param) if param.grad is None else param.grad
        errors[f"grad {name}"] = relative_error(grad, expected[f"grad {name}"])
    layer.zero_grad(set_to_none=True)
    return errors


def results_without_host_sync(layer, inputs: RankInputs) -> dict[str, torch.Tensor]:
    """`one_call_results` with CUDA's sync debug mode set to raise: a forward or backward that
    synchronizes with the host fails."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return one_call_results(layer, inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def capture_in_graph(call):
    """(a CUDA graph of `call()`, the output of the captured call). `call` runs once first on a
    side stream, the warm-up torch.cuda.graph asks for; `graph.replay()` then reruns it on
    whatever its input tensors hold."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = call()
    return graph, output


def grouped_expert_reference(rows, group_sizes, w_gate, w_up, w_down, grad_out, swiglu_limit=None):
    """The reference expert MLP on rows grouped by expert, forward and backward through autograd.

    rows, grad_out [M, H] (the groups are the first sum(group_sizes) rows); w_gate, w_up [E, I, H];
    w_down [E, H, I]. Returns (out [M', H], grad_rows [M', H], [grad_w_gate, grad_w_up, grad_w_down]
    in fp32) for the M' = sum(group_sizes) grouped rows; experts without rows get zero gradients.
    """
    out, grad_rows = [], []
    grads = [torch.zeros_like(w, dtype=torch.float32) for w in (w_gate, w_up, w_down)]
    start = 0
    for expert, size in enumerate(group_sizes):
        if size:
            x = rows[start : start + size].clone().requires_grad_(True)
            weights = [w[expert].clone().requires_grad_(True) for w in (w_gate, w_up, w_down)]
            y = expert_mlp(x, *weights, swiglu_limit=swiglu_limit)
            y.backward(grad_out[start : start + size])
            out.append(y.detach())
            grad_rows.append(x.grad)
            for grad, weight in zip(grads, weights, strict=True):
                grad[expert] = weight.grad.float()
        start += size
    return torch.cat(out), torch.cat(grad_rows), grads


_ALLOCATIONS = itertools.count()


class SharedBufferHandle:
    """The handle API the NVLink exchange uses (`buffer_ptrs`, `get_buffer`) over one buffer that
    every rank maps (`whole`, world * nbytes bytes): rank r's buffer is its r-th slice, so the
    offsets between buffers agree on all ranks, as with symmetric memory."""

    def __init__(self, whole: torch.Tensor, nbytes: int, group):
        self.whole, self.nbytes, self.group = whole, nbytes, group
        self.buffer_ptrs = [
            whole.data_ptr() + r * nbytes for r in range(dist.get_world_size(group))
        ]

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        region = self.whole[rank * self.nbytes : (rank + 1) * self.nbytes].view(dtype)
        return region[storage_offset : storage_offset + math.prod(sizes)].view(sizes)


def shared_file_allocator(directory):
    """A buffer allocator (`mok.comm.memory.Allocate`) for `simulated_symmetric_memory` that maps
    one new file under `directory` per allocation, shared by the CPU processes of a gloo group: the
    NVLink protocol with CPU tensors, kernels under the Triton interpreter (x86 keeps each
    process's stores in order, as the exchange's flags and barriers need). Every rank must
    allocate in the same order (the files are numbered, per process)."""

    def allocate(nbytes, device, group):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        name = f"symmetric-{group.group_name}-{next(_ALLOCATIONS)}"
        path = os.path.join(os.fspath(directory), name)
        if rank == 0:
            with open(path, "wb") as handle:
                handle.truncate(world * nbytes)
        dist.barrier(group=group)
        whole = torch.from_file(path, shared=True, size=world * nbytes, dtype=torch.uint8)
        return whole[rank * nbytes : (rank + 1) * nbytes], SharedBufferHandle(whole, nbytes, group)

    return allocate


def cuda_ipc_allocator(nbytes: int, device: torch.device, group) -> tuple:
    """A buffer allocator (`mok.comm.memory.Allocate`) for `simulated_symmetric_memory`, for ranks
    that share one GPU, as processes of a gloo group: the group's first rank allocates
    world * nbytes bytes and the others map them through CUDA IPC. Ranks simulated on one GPU run
    the NVLink protocol's kernels compiled, with real cross-process flags and timers (kernels of
    different processes take turns on the GPU, so it is slow)."""
    from torch.multiprocessing.reductions import reduce_tensor

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    payload = [None]
    if rank == 0:
        whole = torch.zeros(world * nbytes, dtype=torch.uint8, device=device)
        payload = [reduce_tensor(whole)]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    if rank != 0:
        rebuild, args = payload[0]
        whole = rebuild(*args)
    return whole[rank * nbytes : (rank + 1) * nbytes], SharedBufferHandle(whole, nbytes, group)
