"""The `triton` backend in the 128-block FP8 recipe (`precision="fp8_block"`) against the recipe's
reference, through the public API.

CPU test mode (kernels under the interpreter, fp32 where GPUs round to bf16), in one process and on
2 gloo ranks with the NVLink protocol over a shared file (x crossing as its cast, packed e4m3 rows
and descales): against the single-process reference
computed in fp32 (`compare_with_reference(dtype=float32)`: the same rounding points), so the two
differ by the order of fp32 sums inside the products' steps and by the bf16 rounding of the
results at the API (2^-9 normwise; the MXFP8 tests' layer, worker and tolerance). Bugs these
catch, each far outside that: the recipe's casts skipped or placed elsewhere (the layer in bf16 is
4.6e-2 off the recipe's here), the biases or the activation's alpha and offset dropped (O(1)), a
gradient not added into its accumulation buffer, the biases' gradients missing from the layer's,
gradients of another rank's experts.
"""

import pytest
import torch
from test_triton_backend_cpu import scenario
from test_triton_backend_mx import CONFIG as MXFP8_CONFIG
from test_triton_backend_mx import (
    TOLERANCE,
    assert_gpt_oss_experts_match_the_reference,
    assert_gpu_results,
    errors_against_the_reference,
    gpu_cases,
    gpu_check_cases,
)

import mok
from mok.kernels.fp8_block import BlockRows
from mok.ranks import run_ranks
from mok.testing import global_weights

CPU = torch.device("cpu")
CONFIG = MXFP8_CONFIG.replace(precision="fp8_block")
"""The MXFP8 tests' layer (H 64, I 32, 4 experts, top 2, a shared expert, a clamp) in the recipe."""


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [1, 2])
def test_fp8_block_layer_matches_the_reference(world, tmp_path):
    case = scenario(CONFIG, [23, 17][:world], seed=3)
    if world == 1:
        per_rank = [errors_against_the_reference(0, 1, case, tmp_path)]
    else:
        per_rank = run_ranks(errors_against_the_reference, world, args=(case, tmp_path))
    for errors, row_bytes in per_rank:
        assert {"grad x", "grad gate", "grad down"} <= set(errors), sorted(errors)
        for key, error in errors.items():
            assert error <= TOLERANCE, (key, error)
        # x travels as its cast: 64 e4m3 bytes and one fp32 descale padded to 80, where an fp32
        # (CPU test mode) row would take 256 and a bf16 one 128.
        assert row_bytes in (None, BlockRows.row_bytes(CONFIG.hidden_size)), row_bytes


@pytest.mark.interpreter
def test_fp8_block_layer_with_gpt_oss_experts_matches_the_reference(tmp_path):
    assert_gpt_oss_experts_match_the_reference(CONFIG, tmp_path)


@pytest.mark.interpreter
@pytest.mark.parametrize("policy", ["auto", "keep", "per_pass"])
def test_weight_casts_are_kept_as_the_policy_says(policy):
    """`mx_weight_casts` in the recipe: evaluation calls reuse one block cast of the weights until
    an in-place update (auto, keep), training calls cast afresh (auto, per_pass) or reuse it
    (keep); a call reusing the cast gives the first call's output bit for bit. Catches a cast
    kept past a weight update (stale outputs), or dropped where it should be reused (the cast
    count)."""
    config = CONFIG.replace(max_tokens_per_rank=16, mx_weight_casts=policy)
    layer = mok.MoE(config, device=CPU)
    layer.load_global_weights(global_weights(config, 5, CPU))
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(16, config.hidden_size, generator=generator).bfloat16()
    idx = torch.randint(0, config.num_experts, (16, config.top_k), generator=generator)
    w = torch.rand(16, config.top_k, generator=generator)
    cache = layer.workspace(CPU).backend.weight_casts
    with torch.no_grad():
        first = layer(x, idx, w)
        assert torch.equal(layer(x, idx, w), first)
    kept = policy != "per_pass"
    assert cache.casts == (1 if kept else 0)
    with torch.no_grad():
        layer.gate.mul_(0.5)
        halved = layer(x, idx, w)
    assert not torch.equal(halved, first)  # the update reached the cast
    assert cache.casts == (2 if kept else 0)
    layer(x, idx, w).sum().backward()  # keep: the evaluation's cast; auto: dropped, cast afresh
    assert cache.casts == (2 if kept else 0)
    assert (cache.kept is not None) == (policy == "keep")


# On the FP8 tensor cores each step's e4m3 products are summed in fewer bits than fp32 before the
# promotion, where the reference sums them in fp32: the routed gradients differ from the
# reference's by more than MXFP8's (whose MMAs are bf16): 2.05e-3 measured on an H100 for tiny's
# router weights' gradient. A missed or misplaced cast still costs ~2e-2.
GPU_ROUTED_TOLERANCE = 4e-3


@pytest.mark.gpu
def test_fp8_block_layer_on_a_gpu_matches_the_reference_backend():
    """Every preset's shapes in the recipe on the FP8 tensor cores (Hopper) against the reference
    backend. Catches what the CPU tests catch on the tl kernels, on the tensor cores' epilogues
    (biases, the clamp, the saved pre-activations) and at the presets' ragged K (gpt-oss's
    2880); a second call without host synchronization repeats the first bit for bit."""
    results = gpu_check_cases(0, 1, gpu_cases("fp8_block"), [192])
    assert_gpu_results([results], GPU_ROUTED_TOLERANCE)
