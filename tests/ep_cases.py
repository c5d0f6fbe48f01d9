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


def assert_close_to_reference(results, scenarios):
    for case_index, case in enumerate(scenarios):
        for rank, per_rank in enumerate(results):
            for name, error in per_rank[case_index].items():
                shared = name.startswith("grad shared")
                limit = SHARED_TOLERANCE if shared else ROUTED_TOLERANCE
                assert error <= limit, (case["config"], rank, name, error)


TINY = mok.get_preset("tiny").config()


def standard_scenarios(world):
    tokens = [37, 64, 0, 5][:world] if world == 4 else [37, 0]
    cases = [scenario(TINY, tokens, routing, seed) for seed, routing in enumerate(ROUTINGS)]
    cases.append(scenario(TINY.replace(swiglu_limit=0.8), [23] * world, "zipf", 10))
    top1 = TINY.replace(top_k=1, shared_intermediate_size=0, swiglu_limit=1.0)
    cases.append(scenario(top1, [19] * world, "uniform", 11))
    odd = mok.MoKConfig(
        hidden_size=48,
        intermediate_size=40,
        num_experts=3 * world,
        top_k=3,
        shared_intermediate_size=24,
    )
    cases.append(scenario(odd, [29 + r for r in range(world)], "zipf", 12))
    return cases
