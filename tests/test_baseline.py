"""The standard PyTorch path (`mok.baseline`) against the single-process reference: forward and
every gradient, in one process, on 2 gloo ranks (no tokens on a rank, no rows for a rank, empty
experts, skewed routings) and on CUDA; plain SwiGLU experts and gpt-oss's (its activation and the
experts' biases, std 1/sqrt(fan-in): a bias lost, taken from another expert's rows or added
after the activation moves y and the gradients by ~1e-1, past the tolerance)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import mok
from mok.baseline import BaselineMoE, baseline_moe
from mok.ranks import run_ranks
from mok.routing import ROUTINGS
from mok.testing import RankInputs, compare_with_reference, global_weights

from ep_cases import scenario

# The baseline rounds to bf16 where the reference keeps fp32 (gate and up before SwiGLU, SwiGLU
# itself, the router weights in the combine): ~5e-3 relative error.
TOLERANCE = 1.5e-2
# With a SwiGLU clamp, pre-activations whose bf16 rounding lands on the other side of the limit
# switch their gradient on or off: the gradients upstream of the clamp differ by up to ~7e-2 here.
CLAMPED_GRADIENT_TOLERANCE = 1.5e-1
# The experts' biases' gradients are sums over an expert's rows that the indexing's backward
# accumulates in bf16 on CUDA (as TorchTitan's gpt-oss experts do): 1.7e-2 at ~100 rows an
# expert on an H200. A gradient summed over the wrong rows is O(1).
BIAS_GRADIENT_TOLERANCE = 5e-2

TINY = mok.get_preset("tiny").config()
TOP1 = TINY.replace(top_k=1, shared_intermediate_size=0)
ODD = mok.MoKConfig(
    hidden_size=48, intermediate_size=40, num_experts=6, top_k=3, shared_intermediate_size=24
)
GPT_OSS_EXPERTS = ODD.replace(swiglu_alpha=1.702, swiglu_up_offset=1.0, expert_bias=True)
CONFIGS = {"tiny": TINY, "top1-no-shared": TOP1, "odd-shapes": ODD, "gpt-oss": GPT_OSS_EXPERTS}


def baseline_errors_on_rank(case, rank, group=None, device="cpu"):
    """Relative errors of BaselineMoE on `rank` of `case` (an ep_cases.scenario)."""
    config = case["config"]
    layer = BaselineMoE(config, group=group, device=device)
    full = global_weights(config, case["seed"], device)
    layer.load_global_weights(full)
    ranks = [
        RankInputs(*(getattr(r, f.name).to(device) for f in dataclasses.fields(r)))
        for r in case["ranks"]
    ]
    return compare_with_reference(layer, full, ranks, rank)


def assert_close_to_reference(errors, config):
    for name, error in errors.items():
        clamped_gradient = config.swiglu_limit is not None and name.startswith("grad")
        limit = CLAMPED_GRADIENT_TOLERANCE if clamped_gradient else TOLERANCE
        if name.endswith("_bias"):
            limit = max(limit, BIAS_GRADIENT_TOLERANCE)
        assert error <= limit, (config, name, error)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("config_name", CONFIGS)
def test_single_process_matches_reference(config_name, routing):
    config = CONFIGS[config_name]
    case = scenario(config, [64], routing, seed=1)
    assert_close_to_reference(baseline_errors_on_rank(case, 0), config)


@pytest.mark.parametrize("config_name", CONFIGS)
def test_no_tokens_gives_empty_output_and_zero_gradients(config_name):
    errors = baseline_errors_on_rank(scenario(CONFIGS[config_name], [0]), 0)
    assert all(error == 0 for error in errors.values()), errors


@pytest.mark.parametrize(
    ("config", "routing"),
    [(TINY.replace(swiglu_limit=0.8), "zipf"), (TOP1.replace(swiglu_limit=1.0), "uniform")],
)
def test_swiglu_clamp(config, routing):
    case = scenario(config, [96], routing, seed=2)
    assert_close_to_reference(baseline_errors_on_rank(case, 0), config)


def test_functional_call_takes_router_weights_of_any_float_dtype():
    inputs = scenario(TINY, [50], "uniform", seed=3)["ranks"][0]
    weights = global_weights(TINY, 3, "cpu")
    router = inputs.topk_weights.double().requires_grad_(True)
    y = baseline_moe(inputs.x, inputs.topk_idx, router, weights)
    y.float().square().sum().backward()
    assert y.dtype == torch.bfloat16 and y.shape == inputs.x.shape
    assert router.grad.dtype == torch.float64


def test_sharing_weights_uses_the_layers_parameters():
    layer = mok.MoE(TINY)
    baseline = BaselineMoE.sharing_weights_of(layer)
    pairs = zip(layer.parameters(), baseline.parameters(), strict=True)
    assert all(ours is theirs for ours, theirs in pairs)


def baseline_errors(rank, world, scenarios, device="cpu"):
    """Rank worker: errors of the baseline against the reference, per scenario."""
    if device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return [baseline_errors_on_rank(case, rank, dist.group.WORLD, device) for case in scenarios]


def two_rank_scenarios():
    # Rank 1 has no tokens, under every routing.
    cases = [scenario(TINY, [37, 0], routing, seed) for seed, routing in enumerate(ROUTINGS)]
    # Experts 0 and 1 only: rank 0 has no tokens but all the rows, rank 1 tokens but no rows.
    cases.append(scenario(TINY, [0, 45], "first-experts", 6))
    cases.append(scenario(TINY, [0, 0], "uniform", 7))
    cases.append(scenario(TOP1, [40, 52], "zipf", 8))
    cases.append(scenario(ODD, [29, 30], "half-empty", 9))
    cases.append(scenario(TINY.replace(swiglu_limit=0.8), [96, 80], "zipf", 10))
    cases.append(scenario(GPT_OSS_EXPERTS, [33, 0], "half-empty", 11))
    return cases


def assert_all_close(results, scenarios):
    for per_rank in results:
        for case, errors in zip(scenarios, per_rank, strict=True):
            assert_close_to_reference(errors, case["config"])


def test_two_gloo_ranks_match_reference():
    scenarios = two_rank_scenarios()
    assert_all_close(run_ranks(baseline_errors, 2, args=(scenarios,), timeout_s=300), scenarios)


@pytest.mark.gpu
def test_on_cuda_matches_reference():
    cases = [
        scenario(TINY, [300], "uniform", 0),
        scenario(TINY, [0]),
        scenario(TINY, [200], "half-empty", 1),
        scenario(TINY.replace(swiglu_limit=0.8), [256], "zipf", 2),
        scenario(ODD, [100], "one-expert", 3),
        scenario(GPT_OSS_EXPERTS, [200], "half-empty", 4),
    ]
    for case in cases:
        assert_close_to_reference(baseline_errors_on_rank(case, 0, device="cuda"), case["config"])


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_over_nccl_match_reference():
    scenarios = two_rank_scenarios()
    results = run_ranks(baseline_errors, 2, args=(scenarios, "cuda"), backend="nccl", timeout_s=300)
    assert_all_close(results, scenarios)
