"""Fuzzed expert-parallel routings and a plain-Python simulation of the reference exchange."""

import torch
from hypothesis import strategies as st

from mok.reference import ReferenceRouting, expert_counts


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


def every_expert(tokens, experts, seed):
    """topk_idx [tokens, experts] with top_k = num_experts: each row a random permutation."""
    keys = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(seed))
    return torch.argsort(keys, dim=1)


def simulate_exchange(experts, per_rank):
    """Build every rank's plan and move labelled pairs through them as the reference exchange does.

    Returns, per owner rank, the labels (src, t, j, expert) in the owner's grouped order, and the
    plans."""
    counts = torch.stack([expert_counts(idx, experts) for idx in per_rank])
    plans = [ReferenceRouting.build(idx, counts, rank) for rank, idx in enumerate(per_rank)]
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
