"""The standard expert-parallel MoE layer in plain PyTorch, as training stacks run it today
(TorchTitan-style): the baseline `mok bench` times every backend against.

One call, on this rank's tokens:
1. count the (token, slot) pairs per global expert on the device, exchange the counts with
   `all_to_all_single` and copy the split sizes to the host (the CPU-GPU synchronization of this
   path; none without a group);
2. gather one row per pair, in expert order (a stable sort of the expert ids);
3. `all_to_all_single` the rows to the ranks that own their experts;
4. on the owner, reorder the rows from (source rank, local expert) blocks into local-expert-major
   order and run the experts: `torch._grouped_mm` for gate and up, SwiGLU in PyTorch,
   `torch._grouped_mm` for down (gpt-oss's experts: its activation, and each row's expert bias
   added after the GEMMs, gathered by a `repeat_interleave` of the group sizes, as TorchTitan's
   gpt-oss experts do);
5. undo the reorder, `all_to_all_single` the outputs back, undo the sort, and combine the k outputs
   of each token with its router weights, plus the shared expert (plain matmuls).
Autograd differentiates all of it.

Choices that keep the baseline strong:
- each permutation is a gather whose backward is the gather by the inverse permutation (a sum over
  the k slots for the token rows), not the scatter-add autograd derives for indexing;
- SwiGLU runs in bf16 on the GEMM outputs: no fp32 copies, a fraction of the memory traffic of
  fp32 elementwise math;
- the combine is one batched matmul, y = w[T, 1, k] @ out[T, k, H] (+ shared), in bf16 with fp32
  accumulation and one rounding: it reads the k outputs once and never writes an fp32 copy of
  them, unlike `(out.float() * w[..., None]).sum(1)` or an fp32 `bmm`.
So its numerics are those of the MoK contract (`mok.reference`) up to bf16 roundings: gate and up
are rounded to bf16 before SwiGLU, SwiGLU rounds in bf16 and the router weights enter the combine
as bf16 (relative error ~5e-3 to the reference). With a SwiGLU clamp, pre-activations whose bf16
rounding lands on the other side of the limit switch their gradient on or off, so the gradients
upstream of the clamp differ more (a few 1e-2 at a limit near 1 on unit-scale data).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mok.distributed import all_to_all, group_rank_and_size
from mok.module import MoE
from mok.reference.expert import swiglu
from mok.weights import MoEWeights


def baseline_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    group: dist.ProcessGroup | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.0,
    swiglu_up_offset: float = 0.0,
) -> torch.Tensor:
    """The MoE layer on this rank's tokens. Differentiable; collective when `group` is given.

    x [T, H] bf16 (T may be 0); topk_idx [T, k] global expert ids in [0, E); topk_weights [T, k]
    (any float dtype); weights holds this rank's E_loc = E / ep experts (expert e lives on rank
    e // E_loc), with the routed experts' biases where it has them. The activation is
    `mok.reference.expert.swiglu` with swiglu_limit, swiglu_alpha and swiglu_up_offset. Returns
    y [T, H] in x's dtype.
    """
    activation = (swiglu_limit, swiglu_alpha, swiglu_up_offset)
    tokens, top_k = topk_idx.shape
    local_experts = weights.gate.shape[0]
    _, ep_size = group_rank_and_size(group)
    num_experts = local_experts * ep_size

    expert_ids, pair_order = torch.sort(topk_idx.reshape(-1), stable=True)
    pair_order_inverse = _inverse_permutation(pair_order)
    # Counted from the sorted ids: no host synchronization, unlike torch.bincount on CUDA.
    bounds = torch.arange(num_experts + 1, device=x.device, dtype=expert_ids.dtype)
    counts = torch.searchsorted(expert_ids, bounds).diff()  # [E] pairs per global expert
    sent = _GatherRows.apply(x, pair_order, pair_order_inverse, top_k)  # [T*k, H] by expert

    if ep_size == 1:
        expert_out = _experts(sent, counts, weights, activation)
        returned = expert_out
    else:
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        recv_counts = recv_counts.view(ep_size, local_experts)  # [source rank, local expert]
        splits = torch.stack([counts.view(ep_size, local_experts).sum(1), recv_counts.sum(1)])
        send_splits, recv_splits = splits.tolist()  # the host synchronization
        received = all_to_all(sent, recv_splits, send_splits, group)
        grouped_order = _source_to_expert_major(recv_counts, received.shape[0])
        grouped_order_inverse = _inverse_permutation(grouped_order)
        grouped = _GatherRows.apply(received, grouped_order, grouped_order_inverse, 1)
        expert_out = _experts(grouped, recv_counts.sum(0), weights, activation)
        back = _GatherRows.apply(expert_out, grouped_order_inverse, grouped_order, 1)
        returned = all_to_all(back, send_splits, recv_splits, group)

    pair_out = _GatherRows.apply(returned, pair_order_inverse, pair_order, 1)  # [T*k, H] by pair
    pair_out = pair_out.view(tokens, top_k, x.shape[1])
    router = topk_weights.to(x.dtype).unsqueeze(1)  # [T, 1, k]
    if weights.has_shared_expert:
        shared = _mlp(x, weights.shared_gate, weights.shared_up, weights.shared_down, activation)
        return torch.baddbmm(shared.unsqueeze(1), router, pair_out).squeeze(1)
    return torch.bmm(router, pair_out).squeeze(1)


class BaselineMoE(MoE):
    """`mok.MoE`'s weights and expert placement with `baseline_moe` as forward:
    x [T, H], topk_idx [T, k], topk_weights [T, k] -> y [T, H]. Build it on another layer's
    parameters with `BaselineMoE.sharing_weights_of(layer)`."""

    def forward(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        config = self.config
        return baseline_moe(
            x,
            topk_idx,
            topk_weights,
            self.weights,
            self.group,
            config.swiglu_limit,
            config.swiglu_alpha,
            config.swiglu_up_offset,
        )


class _GatherRows(torch.autograd.Function):
    """out[i] = rows[order[i] // repeat] for a permutation `order` of len(rows) * repeat rows:
    each row repeated `repeat` times, permuted. Backward gathers by the inverse permutation and sums
    the repeats: deterministic, and no scatter-add."""

    @staticmethod
    def forward(ctx, rows, order, order_inverse, repeat):
        ctx.save_for_backward(order_inverse)
        ctx.repeat = repeat
        source = order // repeat if repeat > 1 else order
        return rows.index_select(0, source)

    @staticmethod
    def backward(ctx, grad_out):
        (order_inverse,) = ctx.saved_tensors
        grad = grad_out.index_select(0, order_inverse)
        if ctx.repeat > 1:
            grad = grad.view(-1, ctx.repeat, grad.shape[-1]).sum(1)
        return grad, None, None, None


def _inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def _source_to_expert_major(recv_counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Received rows come in (source rank, local expert) blocks of recv_counts [ep, E_loc] rows;
    returns the index [num_rows] that gathers them into (local expert, source rank) blocks."""
    block_starts = (recv_counts.reshape(-1).cumsum(0) - recv_counts.reshape(-1)).view_as(
        recv_counts
    )
    sizes = recv_counts.T.reshape(-1)  # blocks in expert-major order
    starts = block_starts.T.reshape(-1)
    new_starts = sizes.cumsum(0) - sizes
    shift = torch.repeat_interleave(starts - new_starts, sizes, output_size=num_rows)
    return torch.arange(num_rows, device=recv_counts.device) + shift


def _experts(
    rows: torch.Tensor,
    group_sizes: torch.Tensor,
    weights: MoEWeights,
    activation: tuple[float | None, float, float],
) -> torch.Tensor:
    """Rows [R, H] grouped by local expert (group_sizes [E_loc] on the device) -> outputs [R, H];
    activation: swiglu's (limit, alpha, up_offset)."""
    biases = weights.expert_biases()
    if rows.shape[0] == 0:
        # torch._grouped_mm cannot differentiate a call with no rows on CUDA (its weight gradient
        # has a zero-length reduction: pytorch/pytorch#192497). Skip the GEMMs, but keep rows and
        # weights in the graph: the weights get zero gradients, and the backward all_to_all still
        # runs on this rank as on the others.
        untouched = [weights.gate, weights.up, weights.down, *(biases or ())]
        return rows * 0 + sum(w[:0].sum() for w in untouched)
    ends = group_sizes.cumsum(0).to(torch.int32)
    gate = torch._grouped_mm(rows, weights.gate.transpose(1, 2), offs=ends)
    up = torch._grouped_mm(rows, weights.up.transpose(1, 2), offs=ends)
    if biases is not None:
        experts = torch.arange(group_sizes.shape[0], device=rows.device)
        # output_size: the row count is known, so no host synchronization.
        row_expert = torch.repeat_interleave(experts, group_sizes, output_size=rows.shape[0])
        gate = gate + biases[0][row_expert]
        up = up + biases[1][row_expert]
    h = swiglu(gate, up, *activation)
    out = torch._grouped_mm(h, weights.down.transpose(1, 2), offs=ends)
    if biases is not None:
        out = out + biases[2][row_expert]
    return out


def _mlp(x, w_gate, w_up, w_down, activation):
    """The shared expert: x [T, H], w_gate, w_up [I_s, H], w_down [H, I_s] -> [T, H]."""
    return F.linear(swiglu(F.linear(x, w_gate), F.linear(x, w_up), *activation), w_down)
