"""`MoKConfig.router_gradient="epilogue"`: the router weights' gradient formed in the down data
gradient's epilogue, so that the forward keeps no pair outputs.

Bugs these catch: a pair's weight or dot taken for another grouped row (the row weights gathered
or the dots scattered through the wrong index: O(1) errors in every gradient of those pairs),
the combine's backward weighting the rows as well (w applied twice), W_down's gradient of the
unweighted rows and the unweighted h (h not overwritten by w h), a dropped pair's gradient
left nonzero, the option ignored (the pair outputs still kept: the memory it saves), and a
configuration that cannot run it accepted instead of refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_backend import cases
from test_recompute import kept_between_passes
from test_triton_backend_cpu import (
    CONFIG,
    SMALL,
    assert_id_error_on_its_rank,
    assert_matches_oracle,
    layer_results,
    run_scenarios,
    scenario,
)

import mok
from mok.errors import BackendUnavailableError
from mok.launch import run_ranks
from mok.testing import compare_with_reference, global_weights

CPU = torch.device("cpu")
EPILOGUE = {"router_gradient": "epilogue"}


def test_config_refuses_the_epilogue_where_it_does_not_apply():
    assert CONFIG.replace(**EPILOGUE).router_gradient is mok.RouterGradient.EPILOGUE
    assert CONFIG.router_gradient is mok.RouterGradient.SAVED_OUTPUTS
    with pytest.raises(mok.MoKConfigError, match="router_gradient must be one of"):
        CONFIG.replace(router_gradient="kernel")
    with pytest.raises(mok.MoKConfigError, match="bf16 experts without biases"):
        CONFIG.replace(precision="mxfp8", hidden_size=64, **EPILOGUE)
    with pytest.raises(mok.MoKConfigError, match="bf16 experts without biases"):
        CONFIG.replace(expert_bias=True, **EPILOGUE)


@pytest.mark.interpreter
def test_the_fused_backend_refuses_the_epilogue():
    from mok.backends.fused import FusedBackend

    reason = FusedBackend.unavailable_reason(CONFIG.replace(**EPILOGUE), CPU, None)
    assert "not built into the overlapped backward" in reason


def refused_at_ep2(rank, world):
    layer = mok.MoE(SMALL.replace(**EPILOGUE), group=torch.distributed.group.WORLD, device=CPU)
    try:
        layer.workspace(CPU)
    except BackendUnavailableError as error:
        return str(error)
    return None


@pytest.mark.interpreter
def test_the_triton_backend_refuses_the_epilogue_at_ep2():
    for message in run_ranks(refused_at_ep2, 2):
        assert message is not None and "runs at EP 1 only" in message


def reference_results(rank, world, scenarios):
    """Rank worker: per scenario, the reference backend's results on this rank's inputs."""
    group = torch.distributed.group.WORLD if world > 1 else None
    outcomes = []
    for case in scenarios:
        layer = mok.MoE(case.config, group=group, device=CPU)
        layer.load_global_weights(global_weights(case.config, case.seed, CPU))
        outcomes.append(layer_results(layer, case.ranks[rank]))
    return outcomes


@pytest.mark.parametrize("config", [CONFIG, SMALL], ids=["shared-clamp", "small"])
def test_the_reference_follows_float64_in_one_process(config):
    """The oracle's epilogue form against exact math, with a shared expert and the clamp."""
    config = config.replace(backend="reference", **EPILOGUE)
    scenarios = [case for case in cases(config, 1) if case.bad_pair is None]  # no bad ids
    for case, results in zip(scenarios, reference_results(0, 1, scenarios), strict=True):
        assert_matches_oracle(case, 0, results)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "config",
    [CONFIG, SMALL, CONFIG.replace(recompute="gate_up")],
    ids=["shared-clamp", "small", "recompute"],
)
def test_the_triton_backend_follows_float64_in_one_process(config):
    """The kernels (interpreter, fp32) over a plain call, a bad id (its pair's gradient zero),
    every pair on one expert, no tokens, and the first experts only; with `recompute`, h is
    made again before the epilogue reads and overwrites it."""
    config = config.replace(**EPILOGUE)
    scenarios = cases(config, 1)
    for case, results in zip(scenarios, run_scenarios(0, 1, scenarios), strict=True):
        assert results["exchange"] == "LocalExchange"
        assert_matches_oracle(case, 0, results)
        assert_id_error_on_its_rank(case, 0, results)


@pytest.mark.parametrize("world", [2, 3])
def test_the_reference_follows_float64_at_ep(world):
    """The pairs' weights travel with their rows over gloo (a rank without tokens at EP 3)."""
    config = SMALL.replace(backend="reference", num_experts=6, **EPILOGUE)
    tokens = [21, 13, 9][:world] if world == 2 else [19, 0, 7]
    case = scenario(config, tokens, seed=5, routing="zipf")
    per_rank = run_ranks(reference_results, world, args=([case],))
    for rank, (results,) in enumerate(per_rank):
        assert_matches_oracle(case, rank, results)


@pytest.mark.interpreter
def test_the_forward_keeps_no_pair_outputs():
    """What the layer hands autograd's saved-tensor hooks shrinks by the pairs' outputs, T x k
    x H values (fp32 under the interpreter), and the results stay within fp32 rounding."""
    case = scenario(CONFIG, [23], seed=6)
    inputs = case.ranks[0]
    saved_outputs, kept = kept_between_passes(CONFIG, inputs, CPU)
    epilogue, kept_less = kept_between_passes(CONFIG.replace(**EPILOGUE), inputs, CPU)
    tokens = inputs.x.shape[0]
    assert kept - kept_less == 4 * tokens * CONFIG.top_k * CONFIG.hidden_size
    for key, want in saved_outputs.items():
        assert torch.allclose(epilogue[key].float(), want.float(), rtol=1e-4, atol=1e-5), key


@pytest.mark.gpu
def test_on_a_gpu_the_epilogue_follows_its_reference_and_keeps_less():
    """On an H200's kernels (Gluon, x read through each pair's token): every result against
    the reference of the same rounding points, the router weights' gradient to fp32 sums (both
    form it from the forward's h), and the forward keeps T x k x H bf16 values fewer."""
    from test_triton_backend import TOLERANCE, preset_configs, rank_inputs

    device = torch.device("cuda")
    config = dict(preset_configs(num_experts=16))["qwen3-30b-a3b"]
    config = config.replace(graphs="off", shared_intermediate_size=256, **EPILOGUE)
    tokens = 250
    inputs = rank_inputs(config, tokens, "zipf", 5, device)
    full = global_weights(config, 0, device)
    layer = mok.MoE(config, device=device)
    layer.load_global_weights(full)
    errors = compare_with_reference(layer, full, [inputs], 0)
    layer.workspace(device).release()
    # Both form it in fp32 from their own h, whose bf16 roundings differ in a few elements: 1.6e-4
    # measured on an H200. The saved-outputs form (y rounded to bf16) lies ~1.6e-3 away.
    assert errors["grad topk_weights"] < 5e-4, errors
    assert all(error < TOLERANCE for error in errors.values()), errors
    saved_outputs = config.replace(router_gradient="saved_outputs")
    _, kept = kept_between_passes(saved_outputs, inputs, device)
    _, kept_less = kept_between_passes(config, inputs, device)
    assert kept - kept_less == 2 * tokens * config.top_k * config.hidden_size
