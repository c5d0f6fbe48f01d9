"""The single-process exchange (EP = 1) against the collective exchange without a group, and both
exchanges' sums against their documented orders, in fp32 on a GPU or on the CPU (row kernels under
the Triton interpreter, whose bf16 math is wrong)."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from mok.comm.collective import CollectiveExchange
from mok.comm.local import LocalExchange
from mok.testing import relative_error

from routing_cases import every_expert, routings
from sum_order_cases import order_sensitive_addends, power_of_two_weights, sequential_sum

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EXCHANGES = {
    "local": lambda experts: LocalExchange(experts, DEVICE),
    "collective": lambda experts: CollectiveExchange(None, experts),
}


@given(case=routings(), seed=st.integers(0, 99))
# top_k = num_experts: catches an exchange that assumes a token leaves some expert out.
@example(case=(4, [every_expert(9, 4, seed=2)]), seed=0)
def test_local_exchange_matches_the_collective_one(case, seed):
    num_experts, per_rank = case
    topk_idx = torch.cat(per_rank).to(DEVICE)  # all ranks' tokens in one process
    tokens, top_k = topk_idx.shape
    hidden = 24
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=generator).to(DEVICE)
    shared = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    grad_y = torch.randn(tokens, hidden, generator=generator).to(DEVICE)

    local = LocalExchange(num_experts, DEVICE)
    collective = CollectiveExchange(None, num_experts)
    got, want = local.route(topk_idx), collective.route(topk_idx)
    assert torch.equal(got.group_offsets, want.group_offsets)
    grouped = local.dispatch(got, x)
    assert torch.equal(grouped, collective.dispatch(want, x))
    # What a backward reads instead of the grouped rows: each row's token of x.
    token_of_row = local.tokens_of_grouped_rows(got)
    assert token_of_row.dtype == torch.int32
    assert torch.equal(grouped, x[token_of_row.long()])
    assert collective.tokens_of_grouped_rows(want) is None

    expert_out = torch.randn_like(grouped) if grouped.numel() else grouped
    y, pair_out = local.combine(got, expert_out, weights, shared)
    y_want, pair_out_want = collective.combine(want, expert_out, weights, shared)
    assert torch.equal(y, y_want)
    # The local exchange keeps the expert outputs where they are, each pair's at its row.
    assert pair_out.rows is expert_out
    assert torch.equal(expert_out[got.pair_row], pair_out_want)

    grad_grouped, grad_w = local.combine_backward(got, grad_y, weights, pair_out)
    grad_grouped_want, grad_w_want = collective.combine_backward(
        want, grad_y, weights, pair_out_want
    )
    assert torch.equal(grad_grouped, grad_grouped_want)
    assert relative_error(grad_w, grad_w_want) < 1e-5
    # The same gradients from the outputs copied in token order (`combine_landed`'s form).
    in_token_order = local.combine_backward(got, grad_y, weights, pair_out_want)
    assert torch.equal(in_token_order[0], grad_grouped)
    assert torch.equal(in_token_order[1], grad_w)
    extra = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    grad_x = local.dispatch_backward(got, grad_grouped, extra)
    # Local sums a token's pairs in j order, the collective one in grouped-row order: fp32 rounding.
    assert relative_error(grad_x, collective.dispatch_backward(want, grad_grouped, extra)) < 1e-5


def distinct_routing(tokens, top_k, experts, seed):
    """(topk_idx [T, k] of distinct experts in random order, grouped_row [T, k]): the row of pair
    (t, j) in the grouped layout, by expert, then token, then j."""
    keys = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(seed))
    topk_idx = torch.argsort(keys, dim=1)[:, :top_k]
    grouped_row = torch.empty(tokens * top_k, dtype=torch.int64)
    grouped_row[torch.argsort(topk_idx.reshape(-1), stable=True)] = torch.arange(tokens * top_k)
    return topk_idx, grouped_row.view(tokens, top_k)


def reordered(values, order):
    """values [T, k, H] with values[t, order[t, i]] at [t, i]."""
    return values.gather(1, order[..., None].expand_as(values))


@pytest.mark.parametrize("shared", [False, True], ids=["no-shared", "shared"])
@pytest.mark.parametrize("exchange", sorted(EXCHANGES))
def test_combine_order_decides_the_result_on_order_sensitive_data(exchange, shared):
    """Catches an exchange whose combine adds a token's pairs in another order than the contract's
    (shared output, then j ascending): in grouped-row order, reversed, or the shared output last.
    On these addends every such order changes the result, which the test checks too."""
    tokens, top_k, experts, hidden = 12, 3, 5, 32
    topk_idx, grouped_row = distinct_routing(tokens, top_k, experts, seed=4)
    addends = order_sensitive_addends(tokens, shared + top_k, hidden, seed=5 + shared)
    weights = power_of_two_weights(tokens, top_k, seed=6)
    products = addends[:, shared:]
    expert_out = torch.empty(tokens * top_k, hidden)
    expert_out[grouped_row.reshape(-1)] = (products / weights[..., None]).reshape(-1, hidden)
    shared_out = addends[:, 0].to(DEVICE) if shared else None
    exchange = EXCHANGES[exchange](experts)
    routing = exchange.route(topk_idx.to(DEVICE))
    y, _ = exchange.combine(routing, expert_out.to(DEVICE), weights.to(DEVICE), shared_out)
    y = y.cpu()
    assert torch.equal(y, sequential_sum(addends))

    by_grouped_row = torch.argsort(grouped_row, dim=1)
    other_orders = [
        torch.cat([addends[:, :shared], products.flip(1)], 1),
        torch.cat([addends[:, :shared], reordered(products, by_grouped_row)], 1),
    ]
    if shared:
        other_orders.append(torch.cat([products, addends[:, :1]], 1))
    for addends_in_other_order in other_orders:
        assert not torch.equal(sequential_sum(addends_in_other_order), y)


@pytest.mark.parametrize("exchange", sorted(EXCHANGES))
def test_dispatch_backward_order_decides_the_result_on_order_sensitive_data(exchange):
    """Catches a grad-x reduction that leaves its documented order: the local exchange adds a
    token's pair gradients j ascending, the collective one by ascending grouped row (expert
    order here), each then `extra`. On these addends the other order, the reverse and `extra`
    first all change the result, which the test checks too."""
    tokens, top_k, experts, hidden = 12, 3, 5, 32
    topk_idx, grouped_row = distinct_routing(tokens, top_k, experts, seed=7)
    addends = order_sensitive_addends(tokens, top_k + 1, hidden, seed=8)
    pair_grads, extra = addends[:, :top_k], addends[:, top_k].to(DEVICE)
    # summed_pair[t, i]: the pair whose gradient is the i-th addend in the documented order
    by_grouped_row = torch.argsort(grouped_row, dim=1)
    in_j_order = torch.arange(top_k).expand(tokens, top_k)
    summed_pair = in_j_order if exchange == "local" else by_grouped_row
    grad_grouped = torch.empty(tokens * top_k, hidden)
    grad_grouped[grouped_row.gather(1, summed_pair).reshape(-1)] = pair_grads.reshape(-1, hidden)
    routed = EXCHANGES[exchange](experts)
    routing = routed.route(topk_idx.to(DEVICE))
    grad_x = routed.dispatch_backward(routing, grad_grouped.to(DEVICE), extra).cpu()
    assert torch.equal(grad_x, sequential_sum(addends))

    # The same pair gradients summed in the other exchange's order.
    other_pair = by_grouped_row if exchange == "local" else in_j_order
    position = torch.argsort(summed_pair, dim=1).gather(1, other_pair)
    other_orders = [
        torch.cat([pair_grads.flip(1), addends[:, top_k:]], 1),
        torch.cat([reordered(pair_grads, position), addends[:, top_k:]], 1),
        torch.cat([addends[:, top_k:], pair_grads], 1),
    ]
    for addends_in_other_order in other_orders:
        assert not torch.equal(sequential_sum(addends_in_other_order), grad_x)
