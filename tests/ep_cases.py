"""Expert-parallel test cases shared by the gloo (CPU) and NCCL (GPU) tests."""

import dataclasses

import torch
import torch.distributed as dist

import mok
from mok.routing import ROUTINGS, make_routing
from mok.testing import RankInputs, compare_with_reference, global_weights

# Routed results travel different paths but are computed row by row the same way: they agree to
# fp32 rounding. The shared expert's gradient is the bf16 sum of per-rank halves: bf16 rounding.
ROUTED_TOLERANCE = 1e-4
SHARED_TOLERANCE = 1e-2
# On GPUs the reference's fp32 GEMMs run in cuBLAS, whose reduction order depends on how many rows
# a call holds: a row's fp32 values differ by fp32 rounding between one process and an expert-
# parallel split, and now and then that flips the bf16 rounding of h or y by one ulp (2**-8
# relative). A few such flips in a tensor of a few thousand elements stay below 1e-3; a misrouted,
# dropped or doubly counted row is above 1e-2.
GPU_ROUTED_TOLERANCE = 1e-3


def rank_inputs(config, tokens, routing, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    idx, w = make_routing(routing, tokens, config.num_experts, config.top_k, gen)
    grad_y = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    return RankInputs(x, idx, w, grad_y)


def scenario(config, tokens_per_rank, routing="uniform", seed=0):
    ranks = [
        rank_inputs(config, tokens, routing, seed * 100 + rank)
        for rank, tokens in enumerate(tokens_per_rank)
    ]
    return {"config": config, "ranks": ranks, "seed": seed}


def check_scenarios(rank, world, scenarios, device="cpu"):
    """Rank worker: errors of the expert-parallel layer against the reference, per scenario.
    With device "cuda" every rank works on its own GPU (an NCCL group)."""
    if device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for case in scenarios:
        layer = mok.MoE(case["config"], group=dist.group.WORLD, device=device)
        full = global_weights(case["config"], case["seed"], device)
        layer.load_global_weights(full)
        ranks = [
            RankInputs(*(getattr(r, f.name).to(device) for f in dataclasses.fields(r)))
            for r in case["ranks"]
        ]
        results.append(compare_with_reference(layer, full, ranks, rank))
    return results


def assert_close_to_reference(results, scenarios, routed_tolerance=ROUTED_TOLERANCE):
    for case_index, case in enumerate(scenarios):
        for rank, per_rank in enumerate(results):
            for name, error in per_rank[case_index].items():
                shared = name.startswith("grad shared")
                limit = SHARED_TOLERANCE if shared else routed_tolerance
                assert error <= limit, (case["config"], rank, name, error)


TINY = mok.get_preset("tiny").config()


def standard_scenarios(world):
    """The scenarios of the multi-rank tests at 2, 4 or 8 ranks."""
    if world == 8:
        return eight_rank_scenarios()
    if world not in (2, 4):
        raise ValueError(f"no standard scenarios for {world} ranks (2, 4 or 8)")
    tokens = [37, 64, 0, 5] if world == 4 else [37, 0]
    cases = [scenario(TINY, tokens, routing, seed) for seed, routing in enumerate(ROUTINGS)]
    cases.append(scenario(TINY.replace(swiglu_limit=0.8), [23] * world, "zipf", 10))
    top1 = TINY.replace(top_k=1, shared_intermediate_size=0, swiglu_limit=1.0)
    cases.append(scenario(top1, [19] * world, "uniform", 11))
    # top_k = num_experts: every token goes to every expert on every rank.
    cases.append(scenario(TINY.replace(top_k=TINY.num_experts), [13] * world, "uniform", 13))
    odd = mok.MoKConfig(
        hidden_size=48,
        intermediate_size=40,
        num_experts=3 * world,
        top_k=3,
        shared_intermediate_size=24,
    )
    cases.append(scenario(odd, [29 + r for r in range(world)], "zipf", 12))
    return cases


# 8 ranks on the 2-core CI machines: spawning them costs ~10 s, so one spawn runs a few small
# cases that still cover what 8 ranks add: ranks without tokens (1, 3, 6), ranks and experts that
# receive nothing, one expert per rank (E = ep) and several.
EIGHT_RANK_TOKENS = [9, 0, 5, 0, 12, 3, 0, 7]


def eight_rank_scenarios():
    tokens = EIGHT_RANK_TOKENS
    two_per_rank = mok.MoKConfig(
        hidden_size=48,
        intermediate_size=40,
        num_experts=16,
        top_k=3,
        shared_intermediate_size=24,
        swiglu_limit=0.8,
    )
    top1 = TINY.replace(top_k=1, shared_intermediate_size=0)
    return [
        scenario(TINY, tokens, "uniform", 20),
        # experts 0 and 1 only: ranks 2..7 receive nothing; rank 1 has no tokens but receives
        scenario(TINY.replace(swiglu_limit=0.8), tokens, "first-experts", 21),
        # only even experts: one empty expert on every rank
        scenario(two_per_rank, tokens, "half-empty", 22),
        scenario(top1, tokens, "zipf", 23),
    ]


def empty_experts(case):
    """Experts that no token of any rank picked in a scenario."""
    config = case["config"]
    picked = torch.cat([r.topk_idx.reshape(-1) for r in case["ranks"]])
    counts = torch.bincount(picked, minlength=config.num_experts)
    return (counts == 0).nonzero().flatten().tolist()
