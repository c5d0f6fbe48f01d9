"""The collective (NCCL/gloo) token exchange on 2, 4 and 8 gloo ranks: dispatch, the reference
experts, combine and both backward steps, against the single-process reference layer."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import mok
from mok.comm.collective import CollectiveExchange
from mok.ranks import run_ranks
from mok.reference import expert_mlp, grouped_expert_mlp, moe_forward
from mok.testing import RankInputs, global_weights, relative_error

from ep_cases import EIGHT_RANK_TOKENS, TINY, rank_inputs
from sum_order_cases import order_sensitive_addends, sequential_sum


def exchange_case(rank, world, config, tokens_per_rank, routing, seed, device="cpu"):
    """Rank worker: one layer call through the exchange, and its errors against the reference."""
    everyone = [
        RankInputs(*(getattr(inputs, f.name).to(device) for f in dataclasses.fields(inputs)))
        for inputs in (
            rank_inputs(config, tokens, routing, seed * 100 + r)
            for r, tokens in enumerate(tokens_per_rank)
        )
    ]
    mine = everyone[rank]
    full = global_weights(config, seed, device)
    local = config.local_experts(world)
    experts = slice(rank * local, (rank + 1) * local)

    exchange = CollectiveExchange(dist.group.WORLD, local)
    routing = exchange.route(mine.topk_idx)
    grouped = exchange.dispatch(routing, mine.x).requires_grad_(True)
    sizes = routing.group_offsets.diff().tolist()
    expert_out = grouped_expert_mlp(
        grouped,
        sizes,
        full.gate[experts],
        full.up[experts],
        full.down[experts],
        config.swiglu_limit,
    )
    x_shared = mine.x.clone().requires_grad_(True)
    shared_out = None
    if full.has_shared_expert:
        shared_out = expert_mlp(
            x_shared, full.shared_gate, full.shared_up, full.shared_down, config.swiglu_limit
        )
    y, pair_out = exchange.combine(routing, expert_out.detach(), mine.topk_weights, shared_out)

    grad_grouped_out, grad_w = exchange.combine_backward(
        routing, mine.grad_y, mine.topk_weights, pair_out
    )
    expert_out.backward(grad_grouped_out)
    shared_grad = None
    if shared_out is not None:
        shared_out.backward(mine.grad_y)
        shared_grad = x_shared.grad
    grad_x = exchange.dispatch_backward(routing, grouped.grad, extra=shared_grad)

    ref_weights = full.map(lambda t: t.clone().requires_grad_(True))
    x_all = torch.cat([r.x for r in everyone]).requires_grad_(True)
    w_all = torch.cat([r.topk_weights for r in everyone]).requires_grad_(True)
    y_all = moe_forward(
        x_all, torch.cat([r.topk_idx for r in everyone]), w_all, ref_weights, config.swiglu_limit
    )
    y_all.backward(torch.cat([r.grad_y for r in everyone]))
    start = sum(tokens_per_rank[:rank])
    rows = slice(start, start + tokens_per_rank[rank])
    return {
        "y bitwise": bool(torch.equal(y, y_all[rows].detach())),
        "grad x": relative_error(grad_x, x_all.grad[rows]),
        "grad topk_weights": relative_error(grad_w, w_all.grad[rows]),
        "staging rows": sum(routing.recv_tokens),
        "grouped rows": grouped.shape[0],
    }


CASES = [
    ("uniform", TINY),
    ("zipf", TINY.replace(swiglu_limit=0.7)),
    ("one-expert", TINY.replace(shared_intermediate_size=0)),
    ("first-experts", TINY),
    ("uniform", TINY.replace(top_k=1)),
    ("half-empty", mok.MoKConfig(48, 40, 12, 3, shared_intermediate_size=16)),
]


def exchange_cases(rank, world, cases, device="cpu"):
    """Rank worker: `exchange_case` for each (routing, config, tokens per rank)."""
    if device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return [
        exchange_case(rank, world, config, tokens, kind, 3, device)
        for kind, config, tokens in cases
    ]


# 8 ranks (one spawn, ~10 s on 2 cores): one expert per rank, two per rank with the even ones
# empty, all picks on the first owner(s), top-1; ranks 1, 3 and 6 have no tokens.
EIGHT_RANK_CASES = [
    ("uniform", TINY),
    ("first-experts", TINY.replace(swiglu_limit=0.7)),
    ("first-experts", mok.MoKConfig(48, 40, 16, 2, shared_intermediate_size=0)),
    ("half-empty", mok.MoKConfig(48, 40, 16, 3, shared_intermediate_size=16)),
    ("zipf", TINY.replace(top_k=1)),
]


def run_cases(world, backend="gloo", device="cpu"):
    if world == 8:
        cases = [(kind, config, EIGHT_RANK_TOKENS) for kind, config in EIGHT_RANK_CASES]
    else:
        tokens = [33, 0, 20, 7][:world]
        cases = [(kind, config, tokens) for kind, config in CASES]
    results = run_ranks(exchange_cases, world, args=(cases, device), backend=backend)
    check(cases, results, world)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_collective_exchange_matches_reference(world):
    run_cases(world)


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_collective_exchange_over_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    run_cases(world, backend="nccl", device="cuda")


def check(cases, results, world):
    for index, (kind, config, _) in enumerate(cases):
        per_rank = [results[rank][index] for rank in range(world)]
        for rank, errors in enumerate(per_rank):
            context = (kind, config, rank, errors)
            assert errors["y bitwise"], context
            # grad x rounds once from fp32 where autograd rounds per contribution: bf16 level.
            assert errors["grad x"] < 1e-2, context
            assert errors["grad topk_weights"] < 1e-5, context
        # A token crosses once per owner: with all picks on the first k experts, each token
        # reaches ceil(k / E_loc) owners (k = 2, E_loc >= 2: half as many staging rows as pairs).
        staging = sum(r["staging rows"] for r in per_rank)
        grouped = sum(r["grouped rows"] for r in per_rank)
        assert staging <= grouped
        if kind == "first-experts":
            owners = -(-config.top_k // config.local_experts(world))
            assert staging * config.top_k == grouped * owners, (staging, grouped)
            # only those owners receive anything
            assert all(r["grouped rows"] == 0 for r in per_rank[owners:]), per_rank


ORDER_TOKENS = [10, 0, 7]
ORDER_HIDDEN = 32


def grad_x_over_owners(rank, world):
    """Rank worker: one expert per rank, every token picks all of them (in a random order), so
    each owner holds one pair of every token. Source s's addends [T_s, world + 1, H]: the gradient
    of its pair on owner 0, 1, ..., then `extra`. Returns (this rank's grad x, its addends)."""
    addends = [
        order_sensitive_addends(tokens, world + 1, ORDER_HIDDEN, seed=source)
        for source, tokens in enumerate(ORDER_TOKENS)
    ]
    keys = torch.rand(ORDER_TOKENS[rank], world, generator=torch.Generator().manual_seed(rank))
    exchange = CollectiveExchange(dist.group.WORLD, 1)
    routing = exchange.route(torch.argsort(keys, dim=1))
    # Owner `rank` holds its pairs by source rank, then token.
    grad_grouped = torch.cat([source[:, rank] for source in addends])
    extra = addends[rank][:, world].contiguous()
    return exchange.dispatch_backward(routing, grad_grouped, extra), addends[rank]


def test_dispatch_backward_adds_owners_by_rank_then_extra():
    """Catches a grad-x reduction over owners that leaves its documented order (owners by
    ascending rank, then `extra`): owners reversed, or `extra` added first. It takes 3 ranks:
    with one or two owners the partial sums commute."""
    results = run_ranks(grad_x_over_owners, 3, timeout_s=120)
    for rank, (grad_x, addends) in enumerate(results):
        assert torch.equal(grad_x, sequential_sum(addends)), rank
        if rank == 1:
            continue  # no tokens
        for order in ([2, 1, 0, 3], [3, 0, 1, 2]):
            assert not torch.equal(sequential_sum(addends[:, order]), grad_x), (rank, order)
