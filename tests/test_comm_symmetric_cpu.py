"""The NVLink exchange's protocol on the CPU: spawned gloo ranks, one shared file standing in for
symmetric memory, the row kernels under the Triton interpreter (fp32 rows: the interpreter's bf16
math is wrong). Every phase (counts, metadata, pushes with readiness flags and the waits on them,
barriers, capacity) runs as on GPUs; results must equal the collective exchange bit for bit.
"""

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist

from mok.comm.collective import CollectiveExchange
from mok.comm.layout import default_shape
from mok.comm.memory import StandInMemory
from mok.comm.symmetric import (
    OverlappedSymmetricExchange,
    OverlappedSymmetricRouterValuesExchange,
    SymmetricExchange,
    SymmetricRouterValuesExchange,
    symmetric_exchange,
)
from mok.errors import MoKCapacityError
from mok.ranks import run_ranks
from mok.routing import make_routing
from mok.testing import shared_file_allocator

from exchange_checks import compare_exchanges


def make_exchange(directory, world, hidden, top_k, local, max_tokens, **options):
    shape = default_shape(hidden, top_k, local, world, max_tokens, dtype=torch.float32, **options)
    return symmetric_exchange(
        dist.group.WORLD,
        shape,
        torch.device("cpu"),
        programs=2,
        memory=StandInMemory(shared_file_allocator(directory)),
    )


CASES = [  # (routing, hidden, top_k, local experts, tokens per rank)
    ("uniform", 24, 2, 2, [13, 7, 9]),
    ("zipf", 40, 3, 3, [0, 17, 5]),
    ("one-expert", 24, 2, 2, [11, 0, 6]),
    ("first-experts", 8, 4, 2, [20, 19, 3]),
]


def random_outputs(grouped, routing, generator):
    """A stand-in expert: random outputs of the grouped rows' shape."""
    return torch.randn(grouped.shape, generator=generator)


def compare(rank, world, tmp, pull):
    results = []
    for index, (kind, hidden, top_k, local, tokens) in enumerate(CASES):
        tokens = tokens[:world]
        generator = torch.Generator().manual_seed(100 * index + rank)
        x = torch.randn(tokens[rank], hidden, generator=generator)
        idx, w = make_routing(kind, tokens[rank], world * local, top_k, generator)
        grad_y = torch.randn(tokens[rank], hidden, generator=generator)
        shared = torch.randn(tokens[rank], hidden, generator=generator)
        # Every other case with the epilogue form's backward (its layout has no pair gradients).
        options = {"pull_dispatch": pull, "router_values": index % 2 == 1}
        symmetric = make_exchange(tmp, world, hidden, top_k, local, max(tokens), **options)
        collective = CollectiveExchange(dist.group.WORLD, local)

        inputs = (x, idx, w, grad_y)
        expert = functools.partial(random_outputs, generator=generator)
        equal = compare_exchanges(symmetric, collective, inputs, expert, shared, shared)
        symmetric.release()
        results.append({"case": kind, **equal})
    return results


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("pull", [False, True])
def test_symmetric_exchange_protocol_matches_the_collective_exchange(world, pull, tmp_path):
    for per_rank in run_ranks(compare, world, args=(str(tmp_path), pull), timeout_s=300):
        for outcome in per_rank:
            assert all(outcome.values()), outcome


def many_routings(rank, world, tmp, pull):
    """One exchange through several routings in a row (as all layers of a shape share one)."""
    # Pulls with the epilogue form's backward, pushes with the saved outputs'.
    symmetric = make_exchange(tmp, world, 24, 3, 2, 20, pull_dispatch=pull, router_values=pull)
    collective = CollectiveExchange(dist.group.WORLD, 2)
    results = []
    for call, kind in enumerate(["uniform", "one-expert", "zipf", "first-experts", "uniform"]):
        generator = torch.Generator().manual_seed(10 * call + rank)
        tokens = [20, 0, 13][(call + rank) % 3]
        x = torch.randn(tokens, 24, generator=generator)
        idx, w = make_routing(kind, tokens, world * 2, 3, generator)
        grad_y = torch.randn(tokens, 24, generator=generator)
        expert = functools.partial(random_outputs, generator=generator)
        equal = compare_exchanges(symmetric, collective, (x, idx, w, grad_y), expert)
        results.append((call, equal))
    symmetric.release()
    return results


@pytest.mark.interpreter
@pytest.mark.parametrize("pull", [False, True])
def test_one_exchange_through_many_routings(pull, tmp_path):
    """Every call of one exchange instance equals the collective exchange. Catches: readiness
    flags or barrier sequence numbers that only work on a fresh exchange (stale epochs letting a
    wait pass on the previous call's rows), buffers not fully rewritten between calls."""
    for per_rank in run_ranks(many_routings, 2, args=(str(tmp_path), pull), timeout_s=300):
        for call, outcome in per_rank:
            assert all(outcome.values()), (call, outcome)


def overflow(rank, world, tmp, capacity):
    symmetric = make_exchange(tmp, world, 16, 2, 2, 32, **capacity)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 16, generator=generator)
    idx, w = make_routing("first-experts", 32, world * 2, 2, generator)
    routing = symmetric.route(idx)
    y, _ = symmetric.combine(routing, symmetric.dispatch(routing, x), w)
    try:
        symmetric.check()
    except MoKCapacityError as error:
        return bool(torch.isfinite(y).all()), str(error)
    return bool(torch.isfinite(y).all()), None


@pytest.mark.parametrize(
    "capacity", [{"recv_capacity": 10}, {"pair_capacity": 12}], ids=["tokens", "pairs"]
)
@pytest.mark.interpreter
def test_capacity_overflow_is_dropped_and_raised_at_check(tmp_path, capacity):
    outcomes = run_ranks(overflow, 2, args=(str(tmp_path), capacity), timeout_s=300)
    for finite, message in outcomes:
        assert finite
        assert message is not None and "recv_pair_capacity" in message
        needed = "/ 12: rows were dropped" if "pair_capacity" in capacity else "10 / 20: rows"
        assert needed in message, message


def test_default_shape_capacities():
    """k pairs per staging row, not min(k, E_loc): a token may pick one expert more than once (the
    layer maps an id out of range to expert 0). Catches a worst case that can overflow."""
    worst = default_shape(16, 4, 2, 3, 10)
    assert (worst.token_capacity, worst.pair_capacity) == (30, 120)
    assert default_shape(16, 4, 2, 3, 10, recv_capacity=7).pair_capacity == 28
    assert default_shape(16, 4, 2, 3, 10, pair_capacity=25).pair_capacity == 25
    assert default_shape(16, 4, 2, 3, 10, pair_capacity=999).pair_capacity == 120


def layout_shapes(world: int) -> list:
    """The four layouts' shapes: staged, overlapped, each with the pair gradients and with the
    router values."""
    staged = default_shape(24, 2, 2, world, 8, dtype=torch.float32)
    overlapped = dataclasses.replace(staged, overlapped=True, pull_dispatch=True)
    return [
        shape
        for base in (staged, overlapped)
        for shape in (base, dataclasses.replace(base, router_values=True))
    ]


LAYOUT_CLASSES = [
    SymmetricExchange,
    SymmetricRouterValuesExchange,
    OverlappedSymmetricExchange,
    OverlappedSymmetricRouterValuesExchange,
]
"""The exchange class of each of `layout_shapes`."""


def layout_exchange_kinds(rank, world, directory):
    """Rank worker: the class `symmetric_exchange` makes for each layout's shape (each released
    after)."""
    kinds = []
    for shape in layout_shapes(world):
        memory = StandInMemory(shared_file_allocator(directory))
        exchange = symmetric_exchange(dist.group.WORLD, shape, torch.device("cpu"), 2, memory)
        kinds.append(type(exchange).__name__)
        exchange.release()
    return kinds


@pytest.mark.interpreter
def test_each_buffer_layout_has_its_own_exchange(tmp_path):
    """The staged layouts are the triton backend's exchanges, the overlapped ones the fused
    backend's, each with the pair gradients or the router values. Bugs caught: an overlapped
    shape built as a staged exchange, whose dispatch would find no staging region; a
    router-values shape built with `combine_backward`, whose pair-gradient region it lacks."""
    names = [kind.__name__ for kind in LAYOUT_CLASSES]
    assert run_ranks(layout_exchange_kinds, 2, args=(str(tmp_path),)) == [names] * 2


LAYOUT_CALLS = {
    "dispatch": [True, True, False, False],
    "dispatch_overlapped": [False, False, True, True],
    "combine_backward": [True, False, False, False],
    "unweighted_combine_backward": [False, True, False, False],
    "combine_backward_overlapped": [False, False, True, False],
    "unweighted_combine_backward_overlapped": [False, False, False, True],
    "pair_values": [False, True, False, True],
}
"""Which of `LAYOUT_CLASSES` has each layout-bound call."""


def test_each_exchange_class_has_only_its_layouts_calls_and_refuses_the_others_shapes():
    """Each class has only the calls its regions serve, and refuses every other layout's shape
    before allocating anything, naming the class that takes it."""
    for call, has in LAYOUT_CALLS.items():
        assert [hasattr(kind, call) for kind in LAYOUT_CLASSES] == has, call
    shapes = layout_shapes(2)
    for kind in LAYOUT_CLASSES:
        for shape, owner in zip(shapes, LAYOUT_CLASSES, strict=True):
            if owner is not kind:
                with pytest.raises(ValueError, match=f"is {owner.__name__}'s"):
                    kind(None, shape, torch.device("cpu"))
