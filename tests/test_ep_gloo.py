"""Expert parallelism on the CPU: 2, 4 and 8 gloo ranks against the single-process reference, and
bad input on one rank raising on all ranks instead of hanging."""

import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import mok
from mok.ranks import run_ranks
from mok.routing import random_weights
from mok.testing import RankInputs

from ep_cases import (
    EIGHT_RANK_TOKENS,
    assert_close_to_reference,
    check_scenarios,
    eight_rank_scenarios,
    empty_experts,
    rank_inputs,
    standard_scenarios,
)

TINY = mok.get_preset("tiny").config()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_expert_parallel_equals_single_process(world):
    scenarios = standard_scenarios(world)
    results = run_ranks(check_scenarios, world, args=(scenarios,), timeout_s=300)
    assert_close_to_reference(results, scenarios)


def test_eight_rank_scenarios_have_idle_ranks_and_empty_experts():
    assert EIGHT_RANK_TOKENS.count(0) == 3
    scenarios = eight_rank_scenarios()
    assert all(len(case["ranks"]) == 8 for case in scenarios)
    first, half = scenarios[1], scenarios[2]
    assert empty_experts(first) == list(range(2, 8))  # ranks 2..7 receive nothing
    assert set(empty_experts(half)) >= set(range(1, 16, 2))  # one empty expert on every rank


@st.composite
def fuzzed_scenarios(draw):
    """A handful of layers with fuzzed shapes and explicit per-rank routings for one group."""
    world = draw(st.sampled_from([2, 4]))
    cases = []
    for index in range(3):
        local = draw(st.integers(1, 3))
        experts = local * world
        config = mok.MoKConfig(
            hidden_size=draw(st.sampled_from([16, 40, 56])),
            intermediate_size=draw(st.sampled_from([8, 24, 40])),
            num_experts=experts,
            top_k=draw(st.integers(1, min(experts, 4))),
            shared_intermediate_size=draw(st.sampled_from([0, 16])),
            swiglu_limit=draw(st.sampled_from([None, 0.5])),
        )
        ranks = []
        for rank in range(world):
            tokens = draw(st.integers(0, 20))
            # top-k routings pick distinct experts: draw a permutation prefix per token
            rows = [draw(st.permutations(range(experts)))[: config.top_k] for _ in range(tokens)]
            idx = torch.tensor(rows, dtype=torch.int64).view(tokens, config.top_k)
            gen = torch.Generator().manual_seed(index * 10 + rank)
            x = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
            grad_y = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
            w = random_weights(tokens, config.top_k, gen, "cpu")
            ranks.append(RankInputs(x, idx, w, grad_y))
        cases.append({"config": config, "ranks": ranks, "seed": index})
    return world, cases


@settings(max_examples=3)
@given(fuzzed_scenarios())
def test_fuzzed_routings_across_ranks(case):
    world, scenarios = case
    results = run_ranks(check_scenarios, world, args=(scenarios,), timeout_s=300)
    assert_close_to_reference(results, scenarios)


# -- bad input on one rank ---------------------------------------------------------------------


def call_with_bad_input(rank, world, problem):
    """Rank worker: rank 1 (or every rank) gets one bad input; returns what each rank raised, then
    checks the group still works with good input."""
    config = TINY
    if problem == "config" and rank == 1:
        config = TINY.replace(swiglu_limit=3.0)
    if problem == "tuning" and rank == 1:
        config = TINY.replace(comm_sms=8)
    layer = mok.MoE(config, group=dist.group.WORLD)
    inputs = rank_inputs(config, 10, "uniform", rank)
    x, idx, w = inputs.x, inputs.topk_idx, inputs.topk_weights
    if rank == 1:
        if problem == "expert id":
            idx = idx.clone()
            idx[3, 1] = config.num_experts
        elif problem == "dtype":
            x = x.float()
        elif problem == "tokens":
            w = w[:7]
    raised = None
    try:
        layer(x, idx, w)
    except mok.MoKInputError as error:
        raised = str(error)
    if problem not in ("config", "tuning"):
        good = rank_inputs(config, 10, "uniform", rank)
        layer(good.x, good.topk_idx, good.topk_weights)
    return raised


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        ("expert id", r"expert id 8, outside \[0, num_experts=8\)"),
        ("dtype", "x has dtype float32"),
        ("tokens", r"topk_weights has shape \(7, 2\)"),
        ("config", r"different configs \(swiglu_limit: rank 0 None, rank 1 3\.0\)"),
        ("tuning", r"different configs \(tuning\.comm_sms: rank 0 24, rank 1 8\)"),
    ],
)
def test_bad_input_on_one_rank_raises_on_every_rank(problem, message):
    raised = run_ranks(call_with_bad_input, 2, args=(problem,), timeout_s=120)
    assert all(raised), raised
    assert re.search(message, raised[1]), raised
    if problem not in ("config", "tuning"):
        assert "rank(s) [1]" in raised[0], raised
