"""The reference routing plan, with all ranks simulated in one process, against a plain-Python
account of where every (rank, token, slot) pair must land."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from mok.reference import RoutingPlan, expert_counts
from mok.routing import ROUTINGS, make_routing


@st.composite
def routings(draw):
    """Per-rank topk_idx of an expert-parallel group: any T (0 included), duplicates allowed."""
    ep = draw(st.sampled_from([1, 2, 3, 4, 8]))
    local_experts = draw(st.integers(1, 5))
    experts = ep * local_experts
    top_k = draw(st.integers(1, min(experts, 4)))
    per_rank = []
    for _ in range(ep):
        tokens = draw(st.integers(0, 12))
        style = draw(st.sampled_from(["free", "one-expert", "one-rank"]))
        if style == "free":
            ids = st.integers(0, experts - 1)
        elif style == "one-expert":
            ids = st.just(draw(st.integers(0, experts - 1)))
        else:
            owner = draw(st.integers(0, ep - 1))
            ids = st.integers(owner * local_experts, (owner + 1) * local_experts - 1)
        flat = draw(st.lists(ids, min_size=tokens * top_k, max_size=tokens * top_k))
        per_rank.append(torch.tensor(flat, dtype=torch.int64).view(tokens, top_k))
    return experts, per_rank


def simulate_exchange(experts, per_rank):
    """Build every rank's plan and move labelled pairs through them as the reference exchange does.

    Returns, per owner rank, the labels (src, t, j, expert) in the owner's grouped order, and the
    plans."""
    counts = torch.stack([expert_counts(idx, experts) for idx in per_rank])
    plans = [RoutingPlan.build(idx, counts, rank) for rank, idx in enumerate(per_rank)]
    sent = []
    for src, (idx, plan) in enumerate(zip(per_rank, plans, strict=True)):
        top_k = idx.shape[1]
        labels = [
            (src, p // top_k, p % top_k, int(idx.view(-1)[p])) for p in plan.pair_order.tolist()
        ]
        chunks, start = [], 0
        for size in plan.send_splits:
            chunks.append(labels[start : start + size])
            start += size
        sent.append(chunks)
    grouped = []
    for owner, plan in enumerate(plans):
        received = [label for src in range(len(plans)) for label in sent[src][owner]]
        assert plan.recv_splits == [len(sent[src][owner]) for src in range(len(plans))]
        grouped.append([received[i] for i in plan.recv_to_grouped.tolist()])
    return plans, grouped


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
