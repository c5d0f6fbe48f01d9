"""The device-side exchange plan against the reference routing plan, all ranks simulated in one
process: the same owner layout, computed without any host-side size."""

import torch
from hypothesis import given

from mok.comm.placement import local_counts, placement_from_counts

from routing_cases import routings, simulate_exchange


def plans_of(experts, per_rank):
    ep = len(per_rank)
    local = experts // ep
    counts = torch.stack([local_counts(idx, ep, local) for idx in per_rank])
    return [placement_from_counts(idx, counts, rank, local) for rank, idx in enumerate(per_rank)]


@given(routings())
def test_pairs_land_where_the_reference_groups_them(case):
    experts, per_rank = case
    reference_plans, grouped = simulate_exchange(experts, per_rank)
    plans = plans_of(experts, per_rank)
    local = experts // len(per_rank)
    for owner, reference in enumerate(reference_plans):
        landed = {}
        for src, (idx, plan) in enumerate(zip(per_rank, plans, strict=True)):
            for t in range(idx.shape[0]):
                for j in range(idx.shape[1]):
                    if int(idx[t, j]) // local == owner:
                        row = int(plan.pair_row[t, j])
                        assert row not in landed, "two pairs on one row"
                        landed[row] = (src, t, j, int(idx[t, j]))
        assert [landed[row] for row in range(len(landed))] == grouped[owner]
        sizes = torch.tensor(reference.group_sizes, dtype=torch.int64)
        offsets = plans[owner].group_offsets.to(torch.int64)
        assert torch.equal(offsets.diff(), sizes) and int(offsets[0]) == 0
        assert int(plans[owner].recv_pairs) == len(landed)


@given(routings())
def test_each_token_crosses_once_per_owner_in_source_then_token_order(case):
    experts, per_rank = case
    plans = plans_of(experts, per_rank)
    local = experts // len(per_rank)
    for owner, owner_plan in enumerate(plans):
        expected = [
            (src, t)
            for src, idx in enumerate(per_rank)
            for t in range(idx.shape[0])
            if any(int(e) // local == owner for e in idx[t])
        ]
        slots = {
            int(plan.token_slot[t, owner]): (src, t)
            for src, (idx, plan) in enumerate(zip(per_rank, plans, strict=True))
            for t in range(idx.shape[0])
            if int(plan.token_slot[t, owner]) >= 0
        }
        assert [slots[i] for i in range(len(slots))] == expected
        assert int(owner_plan.recv_tokens) == len(expected)
