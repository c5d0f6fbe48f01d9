"""The `triton` backend in MXFP8 against the MXFP8 reference, through the public API.

CPU test mode (kernels under the interpreter, fp32 where GPUs round to bf16), in one process and
on 2 gloo ranks with the NVLink protocol over a shared file (x crossing as packed e4m3 rows):
against the single-process MXFP8 reference computed in fp32
(`compare_with_reference(dtype=float32)`: the same rounding points), so the two differ by
summation order and by the bf16 rounding of the results at the API (2^-9 normwise); a missed or
misplaced cast costs e4m3's rounding, ~2e-2.

On GPUs: against the reference backend in MXFP8 at every preset's shape, skewed and empty
routings, T = 0, EP 1 and EP 2 over NVLink; bitwise repeatable, with no host synchronization.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from test_triton_backend import SHARING_PEER_TIMEOUT_S
from test_triton_backend_cpu import scenario

import mok
from mok.comm.memory import simulated_symmetric_memory
from mok.kernels.mx import MXRows
from mok.ranks import run_ranks
from mok.testing import (
    RankInputs,
    compare_with_reference,
    cuda_ipc_allocator,
    global_weights,
    one_call_results,
    relative_error,
    results_without_host_sync,
    shared_file_allocator,
)

CPU = torch.device("cpu")
TOLERANCE = 5e-3
CONFIG = mok.MoKConfig(
    hidden_size=64,
    intermediate_size=32,
    num_experts=4,
    top_k=2,
    shared_intermediate_size=32,
    swiglu_limit=1.5,
    precision="mxfp8",
    backend="triton",
    max_tokens_per_rank=48,
)


def errors_against_the_reference(rank, world, case, shared_dir):
    """Rank worker: the MXFP8 triton layer's errors against the fp32 MXFP8 reference, and the
    bytes of one row in the NVLink exchange's staging (None in one process)."""
    group = dist.group.WORLD if world > 1 else None
    with simulated_symmetric_memory(shared_file_allocator(shared_dir)):
        layer = mok.MoE(case.config, group=group, device=CPU)
        full = global_weights(case.config, case.seed, CPU)
        layer.load_global_weights(full)
        errors = compare_with_reference(layer, full, case.ranks, rank, dtype=torch.float32)
        layer.workspace(CPU).check()
        staging = getattr(layer.workspace(CPU).backend.exchange, "view", None)
        row_bytes = None
        if staging is not None:
            row = staging.staging.local[0]
            row_bytes = row.numel() * row.element_size()
        layer.workspace(CPU).release()
    return errors, row_bytes


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mxfp8_layer_matches_the_reference(world, rounding, tmp_path):
    config = CONFIG.replace(mx_rounding=rounding)
    case = scenario(config, [23, 17][:world], seed=3)
    if world == 1:
        per_rank = [errors_against_the_reference(0, 1, case, tmp_path)]
    else:
        per_rank = run_ranks(errors_against_the_reference, world, args=(case, tmp_path))
    for errors, row_bytes in per_rank:
        for key, error in errors.items():
            assert error <= TOLERANCE, (key, error)
        # x travels as e4m3 bytes and scales: 64 + 2 bytes padded to 80, where an fp32 (CPU test
        # mode) row would take 256 and a bf16 one 128 (0.625x: the padding weighs at H = 64).
        assert row_bytes in (None, MXRows.row_bytes(CONFIG.hidden_size)), row_bytes


def assert_gpt_oss_experts_match_the_reference(config, tmp_path) -> None:
    """gpt-oss's activation and expert biases in `config`'s precision, on 2 ranks. Bugs caught:
    the FP8 path dropping the activation's alpha or offset or a bias (errors of O(1)), the
    biases' gradients missing from the layer's (absent keys) or not those of this rank's
    experts."""
    config = config.replace(
        swiglu_alpha=1.702, swiglu_up_offset=1.0, expert_bias=True, swiglu_limit=1.0
    )
    case = scenario(config, [23, 17], seed=4)
    for errors, _ in run_ranks(errors_against_the_reference, 2, args=(case, tmp_path)):
        assert {"grad gate_bias", "grad up_bias", "grad down_bias"} <= set(errors)
        for key, error in errors.items():
            assert error <= TOLERANCE, (key, error)


@pytest.mark.interpreter
def test_mxfp8_layer_with_gpt_oss_experts_matches_the_reference(tmp_path):
    assert_gpt_oss_experts_match_the_reference(CONFIG, tmp_path)


@pytest.mark.interpreter
def test_mxfp8_layer_with_exact_buffers_matches_the_reference(tmp_path):
    """`exact_buffers` at EP 2: the packed e4m3 rows and their scales in grouped tensors of the
    pairs received rather than the capacity. Bug caught: the MX views (`MXRows.from_rows`, the
    scales' blocks) still laid out for the capacity's rows, so that scales pair with the wrong
    rows (errors of whole rows, far past the tolerance)."""
    config = CONFIG.replace(exact_buffers=True)
    case = scenario(config, [23, 17], seed=5)
    for errors, _ in run_ranks(errors_against_the_reference, 2, args=(case, tmp_path)):
        for key, error in errors.items():
            assert error <= TOLERANCE, (key, error)


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF16 = torch.bfloat16


def train_twice(policy: str) -> tuple[list[torch.Tensor], mok.MoE]:
    """Two training steps of the MXFP8 layer with `mx_weight_casts=policy`, an in-place update
    of the weights between them (as an optimizer step): y and every gradient of both."""
    layer = mok.MoE(CONFIG.replace(mx_weight_casts=policy), device=DEVICE)
    layer.load_global_weights(global_weights(CONFIG, 3, DEVICE))
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        # Magnitudes spread over powers of two: a block's scale then depends on its direction,
        # so a cast along the wrong dimension has other values (uniform weights would not tell).
        for param in layer.parameters():
            param.mul_(torch.exp2(torch.randint(-4, 4, param.shape, generator=generator)).to(param))
    results = []
    for _ in range(2):
        x = torch.randn(40, CONFIG.hidden_size, generator=generator).to(DEVICE, BF16)
        x.requires_grad_()
        idx = torch.randint(0, CONFIG.num_experts, (40, CONFIG.top_k), generator=generator)
        w = torch.rand(40, CONFIG.top_k, generator=generator).to(DEVICE, BF16).requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = layer(x, idx.to(DEVICE), w)
        y.backward(torch.randn(y.shape, generator=generator).to(DEVICE, BF16))
        results += [y.detach(), x.grad, w.grad, *(p.grad for p in layer.parameters())]
        with torch.no_grad():
            for param in layer.parameters():
                param.mul_(0.5)
    return results, layer


def kept_casts(layer: mok.MoE):
    """The MXWeightValues the layer's triton backend keeps between calls, or None."""
    return layer.workspace(DEVICE).backend.weight_casts.kept


@pytest.mark.interpreter
def test_each_weight_cast_policy_gives_the_same_training_steps():
    """`mx_weight_casts`: keep (both layouts kept until the weights change), per_pass (each pass
    casts what it reads) and auto give the same y and gradients bit for bit over two steps with
    an update between; after a training call only keep holds casts, and auto keeps the forward's
    layout alone after a call without backward. Catches a pass reading the other layout (the
    forward's cast in a data gradient: e4m3 error), casts of the weights before the update, a
    training step that keeps two copies of the weights under auto."""
    expected, kept = train_twice("keep")
    assert kept_casts(kept) is not None and kept_casts(kept).has_backward
    for policy in ("per_pass", "auto"):
        got, layer = train_twice(policy)
        for want, value in zip(expected, got, strict=True):
            assert torch.equal(value, want), policy
        assert kept_casts(layer) is None, policy
    x = torch.randn(8, CONFIG.hidden_size, device=DEVICE, dtype=BF16)
    idx = torch.zeros(8, CONFIG.top_k, dtype=torch.int64, device=DEVICE)
    w = torch.ones(8, CONFIG.top_k, device=DEVICE, dtype=BF16)
    with torch.no_grad():
        layer(x, idx, w)
    assert kept_casts(layer) is not None and not kept_casts(layer).has_backward
    layer(x.requires_grad_(), idx, w)  # training again: the evaluation's casts are dropped
    assert kept_casts(layer) is None


@pytest.mark.interpreter
def test_weights_changed_between_forward_and_backward_raise_per_pass():
    """Casting per pass, the backward casts the weights again: changed in place since the
    forward, they would give the gradient of another layer. It raises, naming the weight."""
    layer = mok.MoE(CONFIG.replace(mx_weight_casts="per_pass"), device=DEVICE)
    layer.load_global_weights(global_weights(CONFIG, 3, DEVICE))
    x = torch.randn(16, CONFIG.hidden_size, device=DEVICE, dtype=BF16, requires_grad=True)
    idx = torch.randint(0, CONFIG.num_experts, (16, CONFIG.top_k), device=DEVICE)
    y = layer(x, idx, torch.rand(16, CONFIG.top_k, device=DEVICE, dtype=BF16))
    with torch.no_grad():
        layer.down.add_(1.0)
    with pytest.raises(mok.MoKInputError, match="weights.down was changed in place"):
        y.backward(torch.ones_like(y))


# On GPUs both backends round at the contract's bf16 points; they differ where the fp32 sums run
# in another order (the reference's fp32 matmuls, the kernels' bf16 MMAs of the same exact
# operands) and where such a difference moves an e4m3 rounding of h or of the SwiGLU gradients
# (2^-4 of that element): measured on an H200 at most 6e-4 for the routed weights' gradients and
# the router weights' (GPU_ROUTED_TOLERANCE), 1e-3 for y. The shared expert is bf16 in both, as
# in the bf16 tests: the kernels round h to bf16 where the reference keeps fp32, 3.7e-3 measured
# for its gradients and grad x (GPU_TOLERANCE). A missed cast, a cast along the wrong dimension
# or a bf16 operand where MX is due costs e4m3's rounding, ~2e-2 normwise.
GPU_TOLERANCE = 6e-3
GPU_ROUTED_TOLERANCE = 2e-3
GPU_ROUTED = ("grad gate", "grad up", "grad down", "grad topk_weights")


def gpu_cases(precision: str = "mxfp8") -> list[tuple[str, mok.MoKConfig, str]]:
    """Every preset's H, I, k and shared expert in `precision` (16 routed experts at most),
    skewed and empty routings, an active clamp."""
    configs = {
        name: preset.config(
            num_experts=min(preset.num_experts, 16),
            backend="triton",
            precision=precision,
            max_tokens_per_rank=256,
        )
        for name, preset in mok.PRESETS.items()
    }
    cases = [(name, config, "uniform") for name, config in configs.items()]
    cases += [
        ("deepseek-v3 zipf", configs["deepseek-v3"], "zipf"),
        ("qwen3-30b half-empty", configs["qwen3-30b-a3b"], "half-empty"),
        ("qwen3-30b one-expert", configs["qwen3-30b-a3b"], "one-expert"),
        ("tiny clamp", configs["tiny"].replace(swiglu_limit=3.0), "zipf"),
    ]
    return cases


def gpu_check_cases(rank, world, cases, tokens_per_rank):
    """Rank worker: per case, the errors of the triton backend against the reference backend
    (both MXFP8, same weights and inputs), and whether a second call, run with host
    synchronization forbidden, repeats the first bit for bit."""
    from test_triton_backend import rank_inputs

    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD if world > 1 else None
    results = []
    for index, (name, config, routing) in enumerate(cases):
        inputs = rank_inputs(config, tokens_per_rank[rank], routing, 100 * index + rank, device)
        layer = mok.MoE(config, group=group, device=device)
        layer.load_global_weights(global_weights(config, index, device))
        assert layer.workspace(device).backend_name == "triton"
        reference = mok.MoE.sharing_weights_of(layer, config.replace(backend="reference"))
        want = one_call_results(reference, inputs)
        first = one_call_results(layer, inputs)
        second = results_without_host_sync(layer, inputs)
        layer.workspace(device).check()
        errors = {key: relative_error(first[key], value) for key, value in want.items()}
        dtypes = all(first[key].dtype == value.dtype for key, value in want.items())
        repeatable = all(torch.equal(first[key], second[key]) for key in first)
        results.append((name, errors, dtypes and repeatable))
        layer.workspace(device).release()
    return results


def assert_gpu_results(per_rank_results, routed_tolerance: float = GPU_ROUTED_TOLERANCE):
    for results in per_rank_results:
        for name, errors, repeatable in results:
            assert repeatable, name
            for key, error in errors.items():
                tolerance = routed_tolerance if key in GPU_ROUTED else GPU_TOLERANCE
                assert error <= tolerance, (name, key, error)


@pytest.mark.gpu
def test_mxfp8_layer_on_a_gpu_matches_the_reference_backend():
    assert_gpu_results([gpu_check_cases(0, 1, gpu_cases(), [192])])


@pytest.mark.gpu
def test_mxfp8_layer_on_a_gpu_with_no_tokens():
    assert_gpu_results([gpu_check_cases(0, 1, gpu_cases()[-2:], [0])])


def errors_on_a_shared_gpu(rank, world, case):
    """Rank worker (ranks sharing GPU 0 through CUDA IPC): the MXFP8 triton layer's errors
    against the single-process MXFP8 reference, and the bytes per row of its exchange's staging."""
    device = torch.device("cuda", 0)
    with simulated_symmetric_memory(cuda_ipc_allocator):
        layer = mok.MoE(case.config, group=dist.group.WORLD, device=device)
        full = global_weights(case.config, case.seed, device)
        layer.load_global_weights(full)
        ranks = [RankInputs(*(t.to(device) for t in dataclasses.astuple(r))) for r in case.ranks]
        errors = compare_with_reference(layer, full, ranks, rank)
        workspace = layer.workspace(device)
        workspace.check()
        row = workspace.backend.exchange.view.staging.local[0]
        workspace.release()
    return errors, row.numel() * row.element_size()


@pytest.mark.shares_gpu
@pytest.mark.gpu
def test_mxfp8_layer_on_ranks_sharing_one_gpu():
    """EP 2 with the NVLink protocol's kernels compiled (x crossing as packed e4m3 rows of
    deepseek-v3's H = 7168: 7392 bytes where bf16 takes 14336), the ranks sharing GPU 0."""
    config = dict((name, c) for name, c, _ in gpu_cases())["deepseek-v3"]
    case = scenario(config.replace(peer_timeout_s=SHARING_PEER_TIMEOUT_S), [96, 61], seed=5)
    for errors, row_bytes in run_ranks(errors_on_a_shared_gpu, 2, args=(case,)):
        assert row_bytes == MXRows.row_bytes(7168) == 7392
        for key, error in errors.items():
            tolerance = GPU_ROUTED_TOLERANCE if key in GPU_ROUTED else GPU_TOLERANCE
            assert error <= tolerance, (key, error)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_mxfp8_layer_over_nvlink_matches_the_reference_backend():
    cases = gpu_cases()
    assert_gpu_results(run_ranks(gpu_check_cases, 2, args=(cases, [160, 97]), backend="nccl"))
    assert_gpu_results(run_ranks(gpu_check_cases, 2, args=(cases[-2:], [0, 131]), backend="nccl"))
