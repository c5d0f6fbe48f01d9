"""The reference routing plan, with all ranks simulated in one process, against a plain-Python
account of where every (rank, token, slot) pair must land."""

import torch
from hypothesis import given

from mok.routing import ROUTINGS, make_routing

from routing_cases import routings, simulate_exchange


@given(routings())
def test_owner_sees_its_pairs_grouped_by_expert_then_source_then_token(case):
    experts, per_rank = case
    plans, grouped = simulate_exchange(experts, per_rank)
    local = experts // len(per_rank)
    for owner, plan in enumerate(plans):
        expected = sorted(
            (label[3], label[0], label[1], label[2])
            for src, idx in enumerate(per_rank)
            for label in [
                (src, t, j, int(idx[t, j]))
                for t in range(idx.shape[0])
                for j in range(idx.shape[1])
            ]
            if label[3] // local == owner
        )
        assert [(e, s, t, j) for (s, t, j, e) in grouped[owner]] == expected
        sizes = [
            sum(1 for label in expected if label[0] == owner * local + e) for e in range(local)
        ]
        assert plan.group_sizes == sizes


@given(routings())
def test_plan_permutations_are_inverse_pairs(case):
    experts, per_rank = case
    plans, _ = simulate_exchange(experts, per_rank)
    for plan in plans:
        n = plan.pair_order.numel()
        assert torch.equal(plan.pair_order[plan.pair_order_inverse], torch.arange(n))
        r = plan.recv_to_grouped.numel()
        assert torch.equal(plan.recv_to_grouped[plan.grouped_to_recv], torch.arange(r))
        assert sum(plan.send_splits) == n


def test_synthetic_routings_have_the_promised_shape():
    gen = torch.Generator().manual_seed(0)
    for kind in ROUTINGS:
        idx, weights = make_routing(kind, 50, 16, 4, gen)
        assert idx.shape == weights.shape == (50, 4)
        assert idx.min() >= 0 and idx.max() < 16
        # top-k routings pick k distinct experts per token
        assert (idx.sort(-1).values.diff(dim=-1) != 0).all(), kind
        torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    idx, _ = make_routing("one-expert", 50, 16, 4, gen)
    assert (idx[:, 0] == 0).all()
    idx, _ = make_routing("half-empty", 50, 16, 4, gen)
    assert (idx % 2 == 0).all()
    idx, _ = make_routing("first-experts", 50, 16, 4, gen)
    assert (idx < 4).all()
    zipf = torch.bincount(make_routing("zipf", 4000, 16, 2, gen)[0].view(-1), minlength=16)
    assert zipf[0] > 3 * zipf[-1]
