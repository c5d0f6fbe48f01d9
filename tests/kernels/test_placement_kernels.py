"""The routing-plan kernels (mok.kernels.placement), on a GPU or under the Triton interpreter, every
rank of a group simulated in one process (one tensor holds every rank's copy of a buffer, so that
peer offsets are plain element distances), against a plain-Python oracle of the documented
layout: staging by (source, token), grouped rows by (local expert, source, token, j), capacities
clipping, ids outside [0, E) dropped."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import mok.kernels.placement as placement_kernels
from mok.kernels.placement import PlacementKernels, owner_rows

from routing_cases import every_expert, routings

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLAG_TOKENS = 2


def oracle(experts, per_rank, token_capacity, pair_capacity, max_tokens):
    """(the counts table every rank should hold, per rank a dict of the expected plan, pair
    metadata, pull sources and owner rows, whether a capacity overflows, the most rows needed)."""
    ep = len(per_rank)
    local = experts // ep
    top_k = per_rank[0].shape[1]

    def valid(e):
        return 0 <= e < experts

    staging = [[] for _ in range(ep)]  # owner -> [(src, t)]
    grouped = [[] for _ in range(ep)]  # owner -> [(local expert, src, t, j)]
    for src, idx in enumerate(per_rank):
        for t, row in enumerate(idx.tolist()):
            for owner in range(ep):
                if any(valid(e) and e // local == owner for e in row):
                    staging[owner].append((src, t))
            for j, e in enumerate(row):
                if valid(e):
                    grouped[e // local].append((e % local, src, t, j))
    for rows in grouped:
        rows.sort()
    table = torch.zeros(ep, experts + ep, dtype=torch.int64)
    for src, idx in enumerate(per_rank):
        for row in idx.tolist():
            for e in filter(valid, row):
                table[src, e] += 1
    for owner, rows in enumerate(staging):
        for src, _ in rows:
            table[src, experts + owner] += 1
    slot_of = [{key: i for i, key in enumerate(rows) if i < token_capacity} for rows in staging]
    row_of = [{(s, t, j): i for i, (_, s, t, j) in enumerate(rows)} for rows in grouped]

    results = []
    for rank, idx in enumerate(per_rank):
        tokens = idx.shape[0]
        token_slot = torch.full((tokens, ep), -1, dtype=torch.int64)
        pair_row = torch.full((tokens, top_k), -1, dtype=torch.int64)
        for t, row in enumerate(idx.tolist()):
            for owner in range(ep):
                token_slot[t, owner] = slot_of[owner].get((rank, t), -1)
            for j, e in enumerate(row):
                if valid(e):
                    r = row_of[e // local][(rank, t, j)]
                    if r < pair_capacity and token_slot[t, e // local] >= 0:
                        pair_row[t, j] = r
        meta = {}
        for r, (_, src, t, j) in enumerate(grouped[rank][:pair_capacity]):
            slot = slot_of[rank].get((src, t), -1)
            back = src * max_tokens * top_k + t * top_k + j if slot >= 0 else -1
            meta[r] = (slot, back)
        sizes = [sum(1 for g in grouped[rank] if g[0] == e) for e in range(local)]
        offsets = torch.tensor([0] + sizes).cumsum(0).clamp(max=pair_capacity).to(torch.int32)
        recv_pairs = min(len(grouped[rank]), pair_capacity)
        owner_view = torch.tensor([[-1, 0, -1, 0]] * pair_capacity, dtype=torch.int64).view(-1, 4)
        per_rank_pairs = max_tokens * top_k
        blocks_per_rank = -(-max_tokens // FLAG_TOKENS)
        for r in range(recv_pairs):
            slot, back = meta[r]
            if back >= 0:
                src, pair = divmod(back, per_rank_pairs)
                flag = src * blocks_per_rank + pair // top_k // FLAG_TOKENS
                owner_view[r] = torch.tensor([slot, src, pair, flag])
            else:
                owner_view[r] = torch.tensor([slot, 0, -1, 0])
        results.append(
            {
                "token_slot": token_slot,
                "pair_row": pair_row,
                "group_offsets": offsets,
                "recv": (min(len(staging[rank]), token_capacity), recv_pairs),
                "meta": meta,
                "sources": {slot: key for key, slot in slot_of[rank].items()},
                "owner_rows": owner_view.t(),
            }
        )
    needed = (max(map(len, staging)), max(map(len, grouped)))
    overflowed = needed[0] > token_capacity or needed[1] > pair_capacity
    return table, results, overflowed, needed


def run_plan(experts, per_rank, token_capacity, pair_capacity, max_tokens):
    """The kernels' plans of every rank, and their meta / source buffers and overflow state."""
    ep = len(per_rank)
    local = experts // ep
    top_k = per_rank[0].shape[1]
    columns = experts + ep
    kernels = PlacementKernels(ep, local, top_k, torch.device(DEVICE))
    per_rank = [idx.to(DEVICE) for idx in per_rank]
    tables = torch.zeros(ep, ep, columns, dtype=torch.int64, device=DEVICE)
    metas = torch.full((ep, pair_capacity + 1, 2), -7, dtype=torch.int64, device=DEVICE)
    sources = torch.full((ep, token_capacity + 1, 2), -7, dtype=torch.int64, device=DEVICE)

    def offsets(buffers, rank):
        size = buffers[0].numel()
        return torch.tensor([(d - rank) * size for d in range(ep)], device=DEVICE)

    block_counts = [
        kernels.count(idx, tables[rank], offsets(tables, rank), rank)
        for rank, idx in enumerate(per_rank)
    ]
    overflowed = torch.zeros(1, dtype=torch.bool, device=DEVICE)
    most_needed = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    # At EP 1 the inverse of pair_row too, in a buffer whose unwritten entries read -7.
    grouped = torch.full((2, max(pair_capacity, 1)), -7, dtype=torch.int32, device=DEVICE)
    plans = [
        kernels.place(
            idx,
            block_counts[rank],
            tables[rank],
            rank,
            token_capacity,
            pair_capacity,
            overflowed,
            most_needed,
            max_tokens,
            meta=(metas[rank], offsets(metas, rank)),
            source=(sources[rank], offsets(sources, rank)),
            grouped=(grouped[0], grouped[1]) if ep == 1 else None,
        )
        for rank, idx in enumerate(per_rank)
    ]
    return tables, plans, metas, sources, overflowed, most_needed, grouped


@st.composite
def plan_cases(draw):
    experts, per_rank = draw(routings())
    if draw(st.booleans()):  # some ids outside [0, E): dropped
        bad = st.sampled_from([-3, -1, experts, experts + 4])
        per_rank = [
            torch.where(torch.rand(idx.shape) < 0.2, draw(bad), idx) if idx.numel() else idx
            for idx in per_rank
        ]
    ep = len(per_rank)
    max_tokens = max(max(idx.shape[0] for idx in per_rank), 1)
    top_k = per_rank[0].shape[1]
    worst_tokens = ep * max_tokens
    token_capacity = draw(st.sampled_from([worst_tokens, max(1, worst_tokens // 3)]))
    pair_capacity = draw(st.sampled_from([token_capacity * top_k, max(1, token_capacity // 2)]))
    tile = draw(st.sampled_from([placement_kernels.TILE_ELEMENTS, 16, 64]))
    return experts, per_rank, token_capacity, pair_capacity, max_tokens, tile


# 2 ranks of 5 tokens with top_k = num_experts = 4: with capacities of 10 tokens and 20 pairs the
# worst-case buffers are exactly full (every token of every rank on each owner, with
# min(k, E_loc) = 2 pairs each): catches an off-by-one in the clipping or the overflow test (a full
# buffer taken as overflowing).
EVERY_EXPERT = [every_expert(5, 4, seed=rank) for rank in range(2)]


@settings(deadline=None)
@given(plan_cases())
@example((4, EVERY_EXPERT, 10, 20, 5, placement_kernels.TILE_ELEMENTS))
# EP 1 with ids out of range and one pair past the capacity: dropped pairs write no grouped row.
@example((3, [torch.tensor([[0, 2], [5, 1], [2, 2], [-1, 0]])], 4, 5, 4, 16))
def test_placement_kernels_match_the_layout_oracle(case):
    experts, per_rank, token_capacity, pair_capacity, max_tokens, tile = case
    with pytest.MonkeyPatch.context() as patch:
        # Small tiles: many token blocks and several scan steps over them.
        patch.setattr(placement_kernels, "TILE_ELEMENTS", tile)
        tables, plans, metas, sources, overflowed, most_needed, grouped = run_plan(
            experts, per_rank, token_capacity, pair_capacity, max_tokens
        )
    table, expected, want_overflow, needed = oracle(
        experts, per_rank, token_capacity, pair_capacity, max_tokens
    )
    tables, metas, sources = tables.cpu(), metas.cpu(), sources.cpu()
    for rank in range(len(per_rank)):
        assert torch.equal(tables[rank], table)
    assert bool(overflowed) == want_overflow
    assert most_needed.tolist() == list(needed)
    top_k = per_rank[0].shape[1]
    for rank, (plan, want) in enumerate(zip(plans, expected, strict=True)):
        assert torch.equal(plan.token_slot.cpu(), want["token_slot"])
        assert torch.equal(plan.pair_row.cpu(), want["pair_row"])
        assert torch.equal(plan.group_offsets.cpu(), want["group_offsets"])
        assert (int(plan.recv_tokens), int(plan.recv_pairs)) == want["recv"]
        for row, pair in want["meta"].items():
            assert tuple(metas[rank, row].tolist()) == pair
        for slot, (src, t) in want["sources"].items():
            assert tuple(sources[rank, slot].tolist()) == (src, t)
        rows = owner_rows(
            metas[rank, :pair_capacity].to(DEVICE),
            plan.recv_pairs,
            max_tokens * top_k,
            top_k,
            FLAG_TOKENS,
            -(-max_tokens // FLAG_TOKENS),
        )
        got = torch.stack(
            [rows.grouped_to_staging, rows.return_rank, rows.return_row, rows.flag_index]
        )
        assert torch.equal(got.cpu(), want["owner_rows"])
    if len(per_rank) == 1:
        assert_grouped_rows_invert_pair_row(grouped.cpu(), expected[0]["pair_row"], top_k)


def assert_grouped_rows_invert_pair_row(grouped, pair_row, top_k) -> None:
    """EP 1's grouped_pair / grouped_token: each delivered pair's row names that pair and its
    token, and rows no pair reaches stay unwritten. Catches a row index off by one, the pair's
    slot j or the token's k-fold index stored in place of the other, or a dropped pair (id out of
    range, past the capacity) that still writes."""
    want = torch.full_like(grouped, -7)
    tokens = torch.arange(pair_row.shape[0]).repeat_interleave(top_k)
    rows = pair_row.reshape(-1)
    delivered = rows >= 0
    want[0, rows[delivered]] = torch.arange(rows.numel(), dtype=torch.int32)[delivered]
    want[1, rows[delivered]] = tokens[delivered].to(torch.int32)
    assert torch.equal(grouped, want)


@pytest.mark.parametrize("tokens", [0, 1, 700, 1500])
def test_checked_ids_replace_ids_out_of_range_and_say_so(tokens):
    """Catches a bound off by one (id E kept, or id E - 1 dropped), negative ids kept, a flag
    that a later block overwrites with False, or a tail past the last full block left unwritten."""
    generator = torch.Generator().manual_seed(tokens)
    experts = 6
    topk_idx = torch.randint(-2, experts + 2, (tokens, 3), generator=generator, dtype=torch.int32)
    if tokens > 1:
        topk_idx[-1] = torch.tensor([experts - 1, 0, experts - 1])
    topk_idx = topk_idx.to(DEVICE)
    inside = (topk_idx >= 0) & (topk_idx < experts)
    for ids, expect_bad in (
        (topk_idx, bool((~inside).any())),
        (topk_idx.clamp(0, experts - 1), False),
    ):
        bad = torch.zeros(1, dtype=torch.bool, device=DEVICE)
        safe, valid = placement_kernels.checked_ids(ids, experts, bad)
        ok = (ids >= 0) & (ids < experts)
        assert torch.equal(valid, ok)
        assert safe.dtype == torch.int64
        assert torch.equal(safe, torch.where(ok, ids, 0).long())
        assert bool(bad.item()) == expect_bad
