"""The single-process exchange (EP = 1) against the collective exchange without a group, on the CPU
(row kernels under the Triton interpreter, fp32 data since the interpreter's bf16 math is wrong)."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from mok.comm.collective import CollectiveExchange
from mok.comm.local import LocalExchange
from mok.testing import relative_error

from routing_cases import routings


@given(case=routings(), seed=st.integers(0, 99))
def test_local_exchange_matches_the_collective_one(case, seed):
    num_experts, per_rank = case
    topk_idx = torch.cat(per_rank)  # all ranks' tokens in one process
    tokens, top_k = topk_idx.shape
    hidden = 24
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    weights = torch.rand(tokens, top_k, generator=generator)
    shared = torch.randn(tokens, hidden, generator=generator)
    grad_y = torch.randn(tokens, hidden, generator=generator)

    local = LocalExchange(num_experts, torch.device("cpu"))
    collective = CollectiveExchange(None, num_experts)
    got, want = local.route(topk_idx), collective.route(topk_idx)
    assert torch.equal(got.group_offsets, want.group_offsets)
    grouped = local.dispatch(got, x)
    assert torch.equal(grouped, collective.dispatch(want, x))

    expert_out = torch.randn_like(grouped) if grouped.numel() else grouped
    y, pair_out = local.combine(got, expert_out, weights, shared)
    y_want, pair_out_want = collective.combine(want, expert_out, weights, shared)
    assert torch.equal(y, y_want)
    assert torch.equal(pair_out, pair_out_want)

    grad_grouped, grad_w = local.combine_backward(got, grad_y, weights, pair_out)
    grad_grouped_want, grad_w_want = collective.combine_backward(want, grad_y, weights, pair_out)
    assert torch.equal(grad_grouped, grad_grouped_want)
    assert relative_error(grad_w, grad_w_want) < 1e-5
    extra = torch.randn(tokens, hidden, generator=generator)
    grad_x = local.dispatch_backward(got, grad_grouped, extra)
    # Local sums a token's pairs in j order, the collective one in grouped-row order: fp32 rounding.
    assert relative_error(grad_x, collective.dispatch_backward(want, grad_grouped, extra)) < 1e-5
