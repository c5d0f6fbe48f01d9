"""The NVLink (symmetric-memory) exchange on 2 GPUs: bit for bit the collective exchange, in both
directions and both dispatch variants (router-weight gradients to fp32 rounding); replay under a
CUDA graph with changing routings; receive capacity overflow detected and raised, never a crash.

Run alone with: python -m pytest tests/test_comm_symmetric.py (spawns 2 ranks, NCCL).
"""

import pytest
import torch
import torch.distributed as dist

import mok
from mok.comm.collective import CollectiveExchange
from mok.comm.layout import default_shape
from mok.comm.symmetric import symmetric_exchange
from mok.errors import MoKCapacityError
from mok.ranks import run_ranks
from mok.reference import grouped_expert_mlp
from mok.testing import global_weights

from ep_cases import TINY, rank_inputs
from exchange_checks import compare_exchanges

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

CASES = [
    ("uniform", TINY, [33, 20]),
    ("zipf", TINY.replace(swiglu_limit=0.7), [40, 0]),
    ("one-expert", TINY.replace(shared_intermediate_size=0), [0, 17]),
    ("first-experts", TINY, [64, 63]),
    ("half-empty", mok.MoKConfig(1000, 40, 12, 3, shared_intermediate_size=16), [129, 70]),
    ("uniform", mok.MoKConfig(7168, 64, 16, 8), [300, 257]),
]


def make_exchange(config, world, max_tokens, **options):
    device = torch.device("cuda", torch.cuda.current_device())
    programs = options.pop("programs", 8)
    shape = default_shape(
        config.hidden_size,
        config.top_k,
        config.local_experts(world),
        world,
        max_tokens,
        options.pop("recv_capacity", None),
        **options,
    )
    return symmetric_exchange(dist.group.WORLD, shape, device, programs=programs)


def inputs_on_rank(rank, config, tokens, kind, seed):
    device = torch.device("cuda", rank)
    inputs = rank_inputs(config, tokens[rank], kind, seed * 100 + rank)
    return [t.to(device) for t in (inputs.x, inputs.topk_idx, inputs.topk_weights, inputs.grad_y)]


def compare_case(rank, world, kind, config, tokens, seed, pull):
    """One layer call through both exchanges; which results are bitwise equal."""
    device = torch.device("cuda", rank)
    inputs = inputs_on_rank(rank, config, tokens, kind, seed)
    local = config.local_experts(world)
    full = global_weights(config, seed, device)
    experts = slice(rank * local, (rank + 1) * local)

    def expert(grouped, routing):
        sizes = routing.group_offsets.diff().tolist()
        weights = (full.gate[experts], full.up[experts], full.down[experts])
        return grouped_expert_mlp(grouped, sizes, *weights, config.swiglu_limit)

    # Pulls with the epilogue form's backward, pushes with the saved outputs'.
    symmetric = make_exchange(config, world, max(tokens), pull_dispatch=pull, router_values=pull)
    collective = CollectiveExchange(dist.group.WORLD, local)
    shared = torch.randn_like(inputs[0]) if config.has_shared_expert else None
    extra = torch.randn_like(inputs[0]) if config.has_shared_expert else None
    equal = compare_exchanges(symmetric, collective, inputs, expert, shared, extra)
    symmetric.release()
    return equal


def compare_cases(rank, world):
    return [
        (kind, pull, compare_case(rank, world, kind, config, tokens, seed, pull))
        for seed, (kind, config, tokens) in enumerate(CASES)
        for pull in (False, True)
    ]


def test_symmetric_exchange_is_bitwise_the_collective_exchange():
    for per_rank in zip(*run_ranks(compare_cases, 2, backend="nccl"), strict=True):
        for kind, pull, equal in per_rank:
            assert all(equal.values()), (kind, "pull" if pull else "push", equal)


def graph_replay(rank, world):
    """Capture route -> dispatch -> (a stand-in expert) -> combine once; replay with new routings;
    compare every replay with the collective exchange run eagerly."""
    config = mok.MoKConfig(1536, 32, 16, 4)
    tokens = [96, 80]
    device = torch.device("cuda", rank)
    symmetric = make_exchange(config, world, max(tokens))
    collective = CollectiveExchange(dist.group.WORLD, config.local_experts(world))
    x, idx, w, _ = inputs_on_rank(rank, config, tokens, "uniform", 0)
    static = [t.clone() for t in (x, idx, w)]

    def layer():
        routing = symmetric.route(static[1])
        grouped = symmetric.dispatch(routing, static[0])
        torch.mul(grouped, 2, out=symmetric.expert_output_buffer())
        return symmetric.combine(routing, symmetric.expert_output_buffer(), static[2])[0]

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        layer()  # compile the kernels outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = layer()
    matches = []
    for seed, kind in enumerate(["uniform", "zipf", "first-experts", "one-expert"]):
        new = inputs_on_rank(rank, config, tokens, kind, seed + 1)
        for target, value in zip(static, new[:3], strict=True):
            target.copy_(value)
        graph.replay()
        routing = collective.route(static[1])
        grouped = collective.dispatch(routing, static[0])
        y_want, _ = collective.combine(routing, grouped * 2, static[2])
        matches.append(torch.equal(y_static, y_want))
    symmetric.check()
    return matches


def test_symmetric_exchange_replays_under_a_cuda_graph_with_changing_routings():
    for matches in run_ranks(graph_replay, 2, backend="nccl"):
        assert matches == [True] * 4


def overflow(rank, world):
    """A capacity too small for one call: rows dropped, MoKCapacityError at check(), then a call
    that fits works and matches the collective exchange."""
    config = mok.MoKConfig(256, 32, 8, 2)
    symmetric = make_exchange(config, world, 64, recv_capacity=20)
    collective = CollectiveExchange(dist.group.WORLD, config.local_experts(world))
    x, idx, w, _ = inputs_on_rank(rank, config, [64, 64], "first-experts", 0)
    routing = symmetric.route(idx)
    grouped = symmetric.dispatch(routing, x)
    y, _ = symmetric.combine(routing, grouped, w)
    torch.cuda.synchronize()
    outcome = {"finite": bool(torch.isfinite(y.float()).all())}
    try:
        symmetric.check()
        outcome["raised"] = None
    except MoKCapacityError as error:
        outcome["raised"] = str(error)
    x, idx, w, _ = inputs_on_rank(rank, config, [6, 5], "uniform", 1)
    routing = symmetric.route(idx)
    grouped = symmetric.dispatch(routing, x)
    y, _ = symmetric.combine(routing, grouped, w)
    want = collective.route(idx)
    y_want, _ = collective.combine(want, collective.dispatch(want, x), w)
    outcome["after"] = torch.equal(y, y_want)
    symmetric.check()  # nothing dropped since the last check
    return outcome


def test_capacity_overflow_raises_at_check_and_the_exchange_stays_usable():
    for outcome in run_ranks(overflow, 2, backend="nccl"):
        assert outcome["finite"]
        assert outcome["raised"] is not None and "recv_capacity" in outcome["raised"]
        assert outcome["after"]
