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

import dataclasses

import pytest
import torch
from test_fused_backend import GPT_OSS_EXPERTS, assert_bitwise_equal, both_backends, cases
from test_recompute import kept_between_passes
from test_triton_backend_cpu import (
    CONFIG,
    EXPERT_PARALLEL,
    SMALL,
    Scenario,
    assert_id_error_on_its_rank,
    assert_matches_oracle,
    layer_results,
    repeated_expert_case,
    run_scenarios,
    scenario,
)

import mok
from mok.ranks import run_ranks
from mok.testing import compare_with_reference, global_weights, relative_error

CPU = torch.device("cpu")
EPILOGUE = {"router_gradient": "epilogue"}
BIASED = SMALL.replace(expert_bias=True, swiglu_alpha=1.702, swiglu_up_offset=1.0)
"""gpt-oss's experts: biases (the dots gain <grad_y, b_down>, and b_down's gradient sums the
rows times their weights) and its activation."""


def test_config_refuses_the_epilogue_where_it_does_not_apply():
    assert CONFIG.replace(**EPILOGUE).router_gradient is mok.RouterGradient.EPILOGUE
    assert CONFIG.router_gradient is mok.RouterGradient.SAVED_OUTPUTS
    with pytest.raises(mok.MoKConfigError, match="router_gradient must be one of"):
        CONFIG.replace(router_gradient="kernel")
    with pytest.raises(mok.MoKConfigError, match="takes bf16 experts"):
        CONFIG.replace(precision="mxfp8", hidden_size=64, **EPILOGUE)
    assert CONFIG.replace(expert_bias=True, **EPILOGUE).expert_bias


@pytest.mark.interpreter
@pytest.mark.parametrize("overlap", [None, True], ids=["default", "overlapped"])
def test_the_fused_backend_at_ep1_is_the_triton_backend_bitwise(overlap):
    """The fused layer at EP 1 (its down product storing the outputs through the peer-store
    epilogue; by default the triton backend's backward, with the overlapped schedule forced its
    own, the products waiting on flags): every result bit for bit the triton backend's,
    gpt-oss's experts included."""
    config = BIASED.replace(**EPILOGUE)
    outcomes = both_backends(0, 1, cases(config, 1), CPU, overlap=overlap)
    assert_bitwise_equal(outcomes)
    assert outcomes[1][1]["check"] == "MoKInputError"  # the bad id is reported by fused too


@pytest.mark.interpreter
@pytest.mark.parametrize("world, dispatch", [(2, "pull"), (2, "push"), (3, "pull")])
def test_the_fused_backend_at_ep_is_the_triton_backend_bitwise(world, dispatch, tmp_path):
    """The overlapped backward's form: grad_y's rows pulled per pair beside the products (the
    weights stored at the owners first), the dots back after the join, against the triton
    backend's staging push; gpt-oss's experts (biases and activation); a bad id, no tokens on
    a rank, every pair on one expert."""
    config = CONFIG.replace(dispatch=dispatch, **EPILOGUE, **GPT_OSS_EXPERTS)
    per_rank = run_ranks(both_backends, world, args=(cases(config, world), CPU, tmp_path))
    for rank, outcomes in enumerate(per_rank):
        assert outcomes[0][1]["exchange"] == "OverlappedSymmetricRouterValuesExchange", rank
        assert_bitwise_equal(outcomes)


@pytest.mark.interpreter
def test_the_fused_backend_drops_the_same_pairs_for_capacity(tmp_path):
    """Receive buffers too small: both backends drop the same pairs (their dots zero) and
    check() raises on every rank."""
    tight = CONFIG.replace(recv_pair_capacity=20, recv_capacity=25, **EPILOGUE)
    case = scenario(tight, [30, 25], seed=4, routing="first-experts")
    for outcomes in run_ranks(both_backends, 2, args=([case], CPU, tmp_path)):
        assert_bitwise_equal(outcomes)
        assert outcomes[0][1]["check"] == "MoKCapacityError"


def epilogue_case(case: Scenario, **options) -> Scenario:
    """`case` with the epilogue form (and `options`) in its config."""
    return dataclasses.replace(case, config=case.config.replace(**EPILOGUE, **options))


@pytest.mark.interpreter
@pytest.mark.parametrize("exchange", ["symmetric", "symmetric-pull", "collective"])
@pytest.mark.parametrize("world", [2, 3])
def test_the_triton_backend_follows_float64_at_ep(world, exchange, tmp_path):
    """Over the NVLink exchange (push and pull dispatch, symmetric memory simulated by a file)
    and the collective one: the grad_y rows sent to each owner unweighted, each pair's weight
    with them, the dots sent back. A bad id's pair stays zero; a rank without tokens; at EP 2
    tokens that pick one expert twice (two grouped rows of one token on one owner); expert
    biases."""
    options = {"dispatch": "pull"} if exchange == "symmetric-pull" else {}
    scenarios = [epilogue_case(EXPERT_PARALLEL[world], **options)]
    if world == 2:
        scenarios.append(epilogue_case(repeated_expert_case(), **options))
        scenarios.append(epilogue_case(scenario(BIASED, [17, 11], seed=8), **options))
    shared_dir = None if exchange == "collective" else str(tmp_path)
    per_rank = run_ranks(run_scenarios, world, args=(scenarios, shared_dir), timeout_s=300)
    for rank, outcomes in enumerate(per_rank):
        for case, results in zip(scenarios, outcomes, strict=True):
            symmetric = "SymmetricRouterValuesExchange"
            assert results["exchange"] == (
                "CollectiveExchange" if exchange == "collective" else symmetric
            )
            assert_matches_oracle(case, rank, results)
            assert_id_error_on_its_rank(case, rank, results)


@pytest.mark.interpreter
def test_capacity_overflow_drops_the_pairs_and_raises_at_check(tmp_path):
    """Pairs past the receive capacity: their dots come back as zero, nothing is non-finite,
    and check() raises on every rank."""
    case = scenario(
        SMALL.replace(recv_pair_capacity=12, **EPILOGUE), [16, 16], seed=5, routing="first-experts"
    )
    per_rank = run_ranks(run_scenarios, 2, args=([case], str(tmp_path)), timeout_s=300)
    for (results,) in per_rank:
        tensors = [v for v in results.values() if isinstance(v, torch.Tensor)]
        assert all(bool(torch.isfinite(t.float()).all()) for t in tensors)
        assert results["check"] == "MoKCapacityError"


def reference_results(rank, world, scenarios):
    """Rank worker: per scenario, the reference backend's results on this rank's inputs."""
    group = torch.distributed.group.WORLD if world > 1 else None
    outcomes = []
    for case in scenarios:
        layer = mok.MoE(case.config, group=group, device=CPU)
        layer.load_global_weights(global_weights(case.config, case.seed, CPU))
        outcomes.append(layer_results(layer, case.ranks[rank]))
    return outcomes


@pytest.mark.parametrize("config", [CONFIG, SMALL, BIASED], ids=["shared-clamp", "small", "biases"])
def test_the_reference_follows_float64_in_one_process(config):
    """The oracle's epilogue form against exact math, with a shared expert and the clamp."""
    config = config.replace(backend="reference", **EPILOGUE)
    scenarios = [case for case in cases(config, 1) if case.bad_pair is None]  # no bad ids
    for case, results in zip(scenarios, reference_results(0, 1, scenarios), strict=True):
        assert_matches_oracle(case, 0, results)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "config",
    [CONFIG, SMALL, CONFIG.replace(recompute="gate_up"), BIASED],
    ids=["shared-clamp", "small", "recompute", "biases"],
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


@pytest.mark.parametrize("biases", [False, True], ids=["plain", "biases"])
@pytest.mark.parametrize("world", [2, 3])
def test_the_reference_follows_float64_at_ep(world, biases):
    """The pairs' weights travel with their rows over gloo (a rank without tokens at EP 3)."""
    config = SMALL.replace(backend="reference", num_experts=6, expert_bias=biases, **EPILOGUE)
    tokens = [21, 13, 9][:world] if world == 2 else [19, 0, 7]
    case = scenario(config, tokens, seed=5, routing="zipf")
    per_rank = run_ranks(reference_results, world, args=([case],))
    for rank, (results,) in enumerate(per_rank):
        assert_matches_oracle(case, rank, results)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "fused"])
def test_the_forward_keeps_no_pair_outputs(backend):
    """What the layer hands autograd's saved-tensor hooks shrinks by the pairs' outputs, T x k
    x H values (fp32 under the interpreter), and the results stay within fp32 rounding of each
    other: the two forms apply the router weights at different points, so their fp32 values
    differ in the last bits, and a bf16 result (y, the weights' gradients) may round to the
    neighbouring bf16 value (one bf16 ulp, 2^-7 relative at most; which elements do depends on
    the CPU's matmul blocking, which varies with the allocations made before). A weight applied
    twice or to the wrong row is O(1) off."""
    config = CONFIG.replace(backend=backend)
    case = scenario(config, [23], seed=6)
    inputs = case.ranks[0]
    saved_outputs, kept = kept_between_passes(config, inputs, CPU)
    epilogue, kept_less = kept_between_passes(config.replace(**EPILOGUE), inputs, CPU)
    tokens = inputs.x.shape[0]
    assert kept - kept_less == 4 * tokens * CONFIG.top_k * CONFIG.hidden_size
    for key, want in saved_outputs.items():
        got, want = epilogue[key].float(), want.float()
        if saved_outputs[key].dtype == torch.bfloat16:
            one_ulp = 2.0**-7 * torch.maximum(got.abs(), want.abs()) + 1e-30
            assert bool(((got - want).abs() <= one_ulp).all()), key
            assert relative_error(got, want) < 1e-3, key  # few elements round apart
        else:
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), key


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset, backend",
    [("qwen3-30b-a3b", "triton"), ("gpt-oss-20b", "triton"), ("qwen3-30b-a3b", "fused")],
)
def test_on_a_gpu_the_epilogue_follows_its_reference_and_keeps_less(preset, backend):
    """On an H200's kernels (Gluon, x read through each pair's token; the fused backend's
    forward with its peer-store epilogue, at EP 1): every result against
    the reference of the same rounding points, the router weights' gradient to fp32 sums (both
    form it from the forward's h), and the forward keeps T x k x H bf16 values fewer; with
    gpt-oss's biases and activation, the down bias's dots and the biases' gradients."""
    from test_triton_backend import TOLERANCE, preset_configs, rank_inputs

    device = torch.device("cuda")
    config = dict(preset_configs(num_experts=16))[preset]
    config = config.replace(backend=backend, graphs="off", shared_intermediate_size=256, **EPILOGUE)
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


@pytest.mark.shares_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend, tokens_per_rank",
    [("triton", [160, 97]), ("triton", [131, 0, 97]), ("fused", [131, 0, 97])],
    ids=["triton EP 2", "triton EP 3", "fused EP 3"],
)
def test_on_ranks_sharing_one_gpu_the_epilogue_follows_its_reference(backend, tokens_per_rank):
    """The NVLink exchange's new steps as compiled for the GPU (symmetric memory by CUDA IPC,
    ranks sharing one GPU; the triton backend's push into staging, the fused backend's pull
    beside the weighted down dgrad waiting per tile), with the Gluon kernels, at deepseek-v3's
    shape with a shared expert, the clamp, gpt-oss's biases: every result against the reference
    of the same rounding points, bitwise repeatable with no host sync; the router weights'
    gradient to fp32 sums, as at EP 1. Bug caught (fused EP 3, qwen3-30b's case): a copy's index
    tensor freed to the compute stream's pool while the copy beside the products still read it,
    which made every call after the first wrong."""
    from test_triton_backend import (
        SHARING_PEER_TIMEOUT_S,
        TOLERANCE,
        check_cases_sharing_one_gpu,
        preset_configs,
        sharing_cases,
    )

    cases = [
        (f"{name} epilogue", config.replace(**EPILOGUE), routing)
        for name, config, routing in sharing_cases()
        if name in ("deepseek-v3 zipf", "qwen3-30b half-empty", "tiny clamp")
    ]
    gpt_oss = dict(preset_configs(num_experts=12))["gpt-oss-20b"]
    patient = gpt_oss.replace(peer_timeout_s=SHARING_PEER_TIMEOUT_S, **EPILOGUE)
    cases.append(("gpt-oss-20b zipf epilogue", patient, "zipf"))
    per_rank = run_ranks(
        check_cases_sharing_one_gpu,
        len(tokens_per_rank),
        args=(cases, tokens_per_rank, backend),
        timeout_s=900,
    )
    for results in per_rank:
        for name, errors, repeatable in results:
            assert repeatable, name
            assert errors["grad topk_weights"] < 5e-4, (name, errors)
            assert all(error < TOLERANCE for error in errors.values()), (name, errors)
