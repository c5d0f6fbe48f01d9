"""The `triton` backend on GPUs against the reference: every preset's layer shape (expert count cut
to keep the single-process reference small), skewed routings, empty experts, no tokens on a rank;
bitwise identical across runs; no host synchronization in forward or backward.

One GPU (EP = 1), two GPUs over NCCL (EP = 2, the NVLink exchange), and EP 2 and 3 with the ranks'
processes sharing one GPU (the NVLink exchange's kernels compiled, symmetric memory by CUDA IPC).
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from test_triton_backend_cpu import (
    assert_x_read_in_place_of_the_grouped_rows,
    without_and_with_grouped_rows,
)

import mok
from mok.comm.memory import simulated_symmetric_memory
from mok.ranks import run_ranks
from mok.reference import combine, moe_forward
from mok.reference.expert import swiglu
from mok.routing import make_routing
from mok.testing import (
    RankInputs,
    capture_in_graph,
    clamped_share,
    compare_with_reference,
    cuda_ipc_allocator,
    float64_results,
    global_weights,
    one_call_results,
    relative_error,
    results_without_host_sync,
    weights_of_preactivation_std,
)

# bf16 kernels against the fp32 reference: bf16 rounding of h, the outputs and the gradients.
TOLERANCE = 2e-2


def preset_configs(num_experts: int = 16) -> list[tuple[str, mok.MoKConfig]]:
    """Every preset's H, I, k and shared expert, with `num_experts` routed experts (or fewer)."""
    configs = []
    for name, preset in mok.PRESETS.items():
        experts = min(preset.num_experts, num_experts)
        config = preset.config(num_experts=experts, backend="triton", max_tokens_per_rank=256)
        configs.append((name, config))
    return configs


CASES = [(name, config, "uniform") for name, config in preset_configs()] + [
    ("deepseek-v3 zipf", dict(preset_configs())["deepseek-v3"], "zipf"),
    ("qwen3-30b half-empty", dict(preset_configs())["qwen3-30b-a3b"], "half-empty"),
    ("qwen3-30b one-expert", dict(preset_configs())["qwen3-30b-a3b"], "one-expert"),
    (
        "tiny clamp",
        mok.get_preset("tiny").config(backend="triton", swiglu_limit=3.0, max_tokens_per_rank=256),
        "zipf",
    ),
]


def rank_inputs(config, tokens, routing, seed, device):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    idx, w = make_routing(routing, tokens, config.num_experts, config.top_k, gen)
    grad_y = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    return RankInputs(x.to(device), idx.to(device), w.to(device), grad_y.to(device))


def check_cases(rank, world, cases, tokens_per_rank, backend="triton"):
    """Rank worker: errors against the reference, bitwise repeatability, and no host sync."""
    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD if world > 1 else None
    results = []
    for index, (name, config, routing) in enumerate(cases):
        config = config.replace(backend=backend)
        everyone = [
            rank_inputs(config, tokens, routing, 100 * index + r, device)
            for r, tokens in enumerate(tokens_per_rank)
        ]
        full = global_weights(config, index, device)
        layer = mok.MoE(config, group=group, device=device)
        layer.load_global_weights(full)
        assert layer.workspace(device).backend_name == backend
        errors = compare_with_reference(layer, full, everyone, rank)
        first = one_call_results(layer, everyone[rank])
        second = results_without_host_sync(layer, everyone[rank])
        layer.workspace(device).check()
        repeatable = all(torch.equal(first[key], second[key]) for key in first)
        results.append((name, errors, repeatable))
    return results


def assert_results(per_rank_results):
    for results in per_rank_results:
        for name, errors, repeatable in results:
            assert repeatable, name
            for key, error in errors.items():
                assert error < TOLERANCE, (name, key, error)


@pytest.mark.gpu
def test_triton_backend_single_gpu_matches_reference():
    results = check_cases(0, 1, CASES, [192])
    assert_results([results])


@pytest.mark.gpu
def test_triton_backend_with_no_tokens():
    results = check_cases(0, 1, CASES[-1:], [0])
    assert_results([results])


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_triton_backend_over_nvlink_matches_reference():
    results = run_ranks(check_cases, 2, args=(CASES, [160, 97]), backend="nccl")
    assert_results(results)
    empty_rank = run_ranks(check_cases, 2, args=(CASES[-2:], [0, 131]), backend="nccl")
    assert_results(empty_rank)


SHARING_PEER_TIMEOUT_S = 120.0
"""The peer timeout of ranks sharing one GPU: a rank's first call compiles its kernels while its
peers wait, and with a dozen test workers compiling at once that outlasts the default 10 s."""


def sharing_cases() -> list:
    """Cases for ranks sharing one GPU, 12 routed experts (EP 2, 3 and 4 divide them): a shared
    expert (deepseek-v3's shape), skewed, half-empty and one-expert routings, the clamp."""
    patient = SHARING_PEER_TIMEOUT_S
    configs = {
        name: config.replace(peer_timeout_s=patient)
        for name, config in preset_configs(num_experts=12)
    }
    tiny = mok.get_preset("tiny").config(
        num_experts=12, swiglu_limit=3.0, max_tokens_per_rank=256, peer_timeout_s=patient
    )
    return [
        ("deepseek-v3 zipf", configs["deepseek-v3"], "zipf"),
        ("qwen3-235b uniform", configs["qwen3-235b-a22b"], "uniform"),
        ("qwen3-30b half-empty", configs["qwen3-30b-a3b"], "half-empty"),
        ("qwen3-30b one-expert", configs["qwen3-30b-a3b"], "one-expert"),
        ("tiny clamp", tiny, "zipf"),
    ]


def check_cases_sharing_one_gpu(rank, world, cases, tokens_per_rank, backend):
    """`check_cases` with the ranks' processes on one GPU over a gloo group, their symmetric
    memory one buffer mapped into every process by CUDA IPC."""
    torch.cuda.set_device(0)
    with simulated_symmetric_memory(cuda_ipc_allocator):
        return check_cases(rank, world, cases, tokens_per_rank, backend)


@pytest.mark.shares_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend, tokens_per_rank",
    [("triton", [160, 97]), ("triton", [131, 0, 97]), ("fused", [131, 0, 97])],
    ids=["triton EP 2", "triton EP 3", "fused EP 3"],
)
def test_expert_parallel_on_ranks_sharing_one_gpu_matches_reference(backend, tokens_per_rank):
    """The NVLink exchange's kernels as compiled for the GPU (the CPU tests run them under the
    interpreter, the two-GPU tests need a second GPU), against the single-process reference:
    forward and every gradient, at EP 2 and at EP 3 with no tokens on one rank. The fused
    backend's EP 2 is the triton backend's bit for bit (test_fused_backend). Bugs caught: a
    compiled-only error in the exchange (a peer offset, a flag index, a count read past a rank's
    rows, a loop over ranks specialized for EP 2), which the bitwise comparison of two backends
    that share the exchange would not see."""
    world = len(tokens_per_rank)
    results = run_ranks(
        check_cases_sharing_one_gpu,
        world,
        args=(sharing_cases(), tokens_per_rank, backend),
        timeout_s=900,
    )
    assert_results(results)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "fused"])
def test_one_gpu_backward_reads_x_instead_of_keeping_the_grouped_rows(backend, monkeypatch):
    """The interpreter test's GPU twin at qwen3-30b-a3b's shape: the gate/up weight gradient is
    the Gluon kernel gathering x's rows through each grouped row's token (checked: one launch
    with the index, one without), bitwise its product on TMA tiles of the grouped rows. Bugs
    caught: a compiled-only error in the gathering loader at EP 1 (x has T rows where the index
    has T x k), the kernel silently swapped for the tl fallback."""
    from mok.kernels import registry

    device = torch.device("cuda")
    config = dict(preset_configs(num_experts=12))["qwen3-30b-a3b"]
    config = config.replace(backend=backend, graphs="off")
    inputs = rank_inputs(config, 250, "zipf", 7, device)
    twins = registry._PRODUCTS[registry.Product.GATE_UP_WGRAD]
    launch, gathered = twins.gluon, []

    def recording(*args, source_rows=None, **options):
        gathered.append(source_rows is not None)
        return launch(*args, source_rows=source_rows, **options)

    # The registry holds the kernels it picks from: the Gluon one is recorded there.
    replaced = dataclasses.replace(twins, gluon=recording)
    monkeypatch.setitem(registry._PRODUCTS, registry.Product.GATE_UP_WGRAD, replaced)
    results, kept = without_and_with_grouped_rows(config, inputs, device, monkeypatch)
    assert_x_read_in_place_of_the_grouped_rows(results, kept, 250, config)
    assert gathered == [True, False]


@pytest.mark.gpu
def test_out_of_range_expert_ids_are_dropped_and_raised_at_check():
    config = mok.get_preset("tiny").config(backend="triton")
    device = torch.device("cuda")
    layer = mok.MoE(config, device=device)
    layer.load_global_weights(global_weights(config, 0, device))
    inputs = rank_inputs(config, 64, "uniform", 0, device)
    bad = inputs.topk_idx.clone()
    bad[3, 0] = config.num_experts + 5
    y = layer(inputs.x, bad, inputs.topk_weights)
    assert torch.isfinite(y.float()).all()
    with pytest.raises(mok.MoKInputError, match="outside"):
        layer.workspace(device).check()
    layer.workspace(device).check()  # reported once


def two_layers(rank, world):
    """Two layers of one shape share one exchange; stacked, each still matches the reference."""
    config = mok.get_preset("tiny").config(backend="triton", max_tokens_per_rank=128)
    device = torch.device("cuda", torch.cuda.current_device())
    layers = []
    for seed in (0, 1):
        layer = mok.MoE(config, group=dist.group.WORLD, device=device)
        layer.load_global_weights(global_weights(config, seed, device))
        layers.append(layer)
    exchanges = [layer.workspace(device).backend.exchange for layer in layers]
    inputs = rank_inputs(config, 96 + rank, "zipf", rank, device)
    x = inputs.x.clone().requires_grad_(True)
    hidden = layers[1](
        layers[0](x, inputs.topk_idx, inputs.topk_weights), inputs.topk_idx, inputs.topk_weights
    )
    hidden.backward(inputs.grad_y)
    reference = [
        mok.MoE(config.replace(backend="reference"), group=dist.group.WORLD, device="meta")
        for _ in layers
    ]
    for ref, layer in zip(reference, layers, strict=True):
        for name, param in layer.named_parameters(recurse=False):
            setattr(ref, name, torch.nn.Parameter(param.detach().clone()))
    x_ref = inputs.x.clone().requires_grad_(True)
    want = reference[1](
        reference[0](x_ref, inputs.topk_idx, inputs.topk_weights),
        inputs.topk_idx,
        inputs.topk_weights,
    )
    want.backward(inputs.grad_y)
    errors = [relative_error(hidden.detach(), want.detach()), relative_error(x.grad, x_ref.grad)]
    for ref, layer in zip(reference, layers, strict=True):
        errors += [relative_error(layer.gate.grad, ref.gate.grad)]
    return exchanges[0] is exchanges[1], errors


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_layers_of_one_shape_share_one_exchange():
    for shared, errors in run_ranks(two_layers, 2, backend="nccl"):
        assert shared
        assert max(errors) < TOLERANCE, errors


def graph_replays(
    rank, world, backend="triton", overlap=None, precision="bf16", peer_timeout_s=10.0
):
    """The layer's forward and backward captured once in a CUDA graph, then replayed with other
    tokens and routings (copied into the captured inputs): per replay, whether y and every
    gradient equal the eager call's bit for bit. `overlap`: the fused backend's schedule
    (`FusedBackend.overlap`; None: its default)."""
    config = mok.get_preset("deepseek-v3").config(
        num_experts=16,
        backend=backend,
        max_tokens_per_rank=128,
        comm_sms=16,
        precision=precision,
        peer_timeout_s=peer_timeout_s,
    )
    device = torch.device("cuda", torch.cuda.current_device())
    layer = mok.MoE(config, group=dist.group.WORLD if world > 1 else None, device=device)
    layer.load_global_weights(global_weights(config, 0, device))
    if overlap is not None:
        layer.workspace(device).backend.overlap = overlap
    routings = ["uniform", "zipf", "one-expert", "half-empty"]
    cases = [
        rank_inputs(config, 96, kind, 10 * i + rank, device) for i, kind in enumerate(routings)
    ]
    eager = [one_call_results(layer, case) for case in cases]

    x = cases[0].x.clone().requires_grad_(True)
    weights = cases[0].topk_weights.clone().requires_grad_(True)
    idx, grad_y = cases[0].topk_idx.clone(), cases[0].grad_y.clone()

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = weights.grad = None
        y = layer(x, idx, weights)
        y.backward(grad_y)
        return y

    graph, y = capture_in_graph(step)
    same = []
    for case, want in zip(cases, eager, strict=True):
        with torch.no_grad():
            for static, value in zip(
                (x, idx, weights, grad_y),
                (case.x, case.topk_idx, case.topk_weights, case.grad_y),
                strict=True,
            ):
                static.copy_(value)
        graph.replay()
        got = {"y": y, "grad x": x.grad, "grad topk_weights": weights.grad}
        got.update({f"grad {n}": p.grad for n, p in layer.named_parameters(recurse=False)})
        same.append(all(torch.equal(got[key], want[key]) for key in want))
    layer.workspace(device).check()
    return same


@pytest.mark.gpu
def test_layer_forward_and_backward_replay_in_a_cuda_graph():
    assert graph_replays(0, 1) == [True] * 4


@pytest.mark.gpu
def test_make_graphed_callables_replays_the_layer():
    """`torch.cuda.make_graphed_callables` (PyTorch's per-module CUDA graphs, as Megatron and
    Transformer Engine use them) over mok.MoE: forward and backward each replay from one graph,
    a call costing the host one graph launch, and on new tokens and routings y and every
    gradient equal the eager layer's bit for bit. Catches host state that the captures bake in
    (a token count, the forward's state kept for backward), a kernel that allocates or
    synchronizes while captured, one replay's state read by the next."""
    config = mok.get_preset("deepseek-v3").config(
        num_experts=16, backend="triton", max_tokens_per_rank=128
    )
    device = torch.device("cuda")
    eager, graphed = (mok.MoE(config, device=device) for _ in range(2))
    for layer in (eager, graphed):
        layer.load_global_weights(global_weights(config, 0, device))
        # The graphed backward hands its gradients to autograd, which accumulates them.
        layer.fuse_grad_accumulation = False
    routings = ["uniform", "zipf", "one-expert", "half-empty"]
    cases = [rank_inputs(config, 96, kind, i, device) for i, kind in enumerate(routings)]
    sample = (
        cases[0].x.clone().requires_grad_(True),
        cases[0].topk_idx.clone(),
        cases[0].topk_weights.clone().requires_grad_(True),
    )
    callable_ = torch.cuda.make_graphed_callables(graphed, sample)
    for case in cases:
        want = one_call_results(eager, case)
        got = one_call_results(callable_, case)
        for key, value in want.items():
            assert torch.equal(got[key], value), key
    graphed.workspace(device).check()


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_layer_replays_in_a_cuda_graph_over_nvlink():
    for same in run_ranks(graph_replays, 2, backend="nccl"):
        assert same == [True] * 4


def graph_replays_sharing_one_gpu(rank, world, backend):
    """`graph_replays` with the ranks' processes on one GPU (symmetric memory by CUDA IPC)."""
    torch.cuda.set_device(0)
    with simulated_symmetric_memory(cuda_ipc_allocator):
        return graph_replays(rank, world, backend, peer_timeout_s=SHARING_PEER_TIMEOUT_S)


@pytest.mark.shares_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "fused"])
def test_layer_replays_in_a_cuda_graph_on_ranks_sharing_one_gpu(backend):
    """EP 2 captured and replayed: the exchange's epoch-stamped flags, counts and barriers
    across processes. Catches a flag or count of the captured call that passes for a replay's
    (an epoch read on the host and baked into the graph), a buffer offset fixed at capture."""
    for same in run_ranks(graph_replays_sharing_one_gpu, 2, args=(backend,), timeout_s=900):
        assert same == [True] * 4


@pytest.mark.gpu
def test_mxfp8_layer_replays_in_a_cuda_graph():
    # Catches a host-side cast cache or a size read on the host that a replay would not redo.
    assert graph_replays(0, 1, precision="mxfp8") == [True] * 4


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False], ids=["beside", "copy-first"])
def test_fused_layer_replays_in_a_cuda_graph(overlap):
    """The fused backend's two streams (the copy forked from the captured stream and joined
    back) and epoch-stamped flags replay correctly: a flag of the capture must never pass for
    a replay's rows, nor a count of one call for the next."""
    assert graph_replays(0, 1, "fused", overlap) == [True] * 4


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fused_layer_replays_in_a_cuda_graph_over_nvlink():
    for same in run_ranks(graph_replays, 2, args=("fused",), backend="nccl"):
        assert same == [True] * 4


def clamp_case(device, tokens=4096, limit=7.0, std=4.0):
    """(config, weights, inputs) of a layer whose pre-activations reach the clamp often."""
    config = mok.MoKConfig(
        hidden_size=1024,
        intermediate_size=512,
        num_experts=8,
        top_k=2,
        shared_intermediate_size=256,
        swiglu_limit=limit,
        backend="triton",
        max_tokens_per_rank=tokens,
    )
    weights = weights_of_preactivation_std(config, std, device)
    return config, weights, rank_inputs(config, tokens, "uniform", 0, device)


@pytest.mark.gpu
def test_gradients_under_an_active_clamp_match_float64():
    """Every output within bf16 level of float64 when the clamp changes >= 5 % of the elements.
    Catches: the backward's clamp masks evaluated on bf16-rounded pre-activations (values within
    half an ulp of L flip their mask: gradients ~3e-2 off), a mask with < for <=."""
    device = torch.device("cuda")
    config, weights, inputs = clamp_case(device)
    assert clamped_share(inputs.x, inputs.topk_idx, weights, config.swiglu_limit) >= 0.05
    layer = mok.MoE(config, device=device)
    layer.load_global_weights(weights)
    got = one_call_results(layer, inputs)
    exact = float64_results(
        inputs.x, inputs.topk_idx, inputs.topk_weights, inputs.grad_y, weights, config.swiglu_limit
    )
    errors = {key: relative_error(got[key], exact[key]) for key in exact}
    assert max(errors.values()) <= 5e-3, errors


# The triton backend computes the reference's rounding points (gate and up in fp32 through SwiGLU,
# h and each expert output rounded once): only the GEMMs' accumulation order differs, ~1e-4 on y.
# Rounding gate and up to bf16 before SwiGLU (an unfused path) costs ~5e-3.
CONTRACT_TOLERANCE = 1e-3


def unfused_bf16_y(inputs, weights, limit):
    """y of a layer that rounds gate and up to bf16 before SwiGLU (no shared expert)."""
    tokens, top_k = inputs.topk_idx.shape
    out = torch.zeros(
        tokens, top_k, inputs.x.shape[1], dtype=torch.bfloat16, device=inputs.x.device
    )
    for expert in range(weights.gate.shape[0]):
        t, j = (inputs.topk_idx == expert).nonzero(as_tuple=True)
        rows = inputs.x[t].float()
        gate = (rows @ weights.gate[expert].float().T).to(torch.bfloat16).float()
        up = (rows @ weights.up[expert].float().T).to(torch.bfloat16).float()
        h = swiglu(gate, up, limit).to(torch.bfloat16)
        out[t, j] = (h.float() @ weights.down[expert].float().T).to(torch.bfloat16)
    return combine(out, inputs.topk_weights)


def contract_case(device):
    config = mok.MoKConfig(
        hidden_size=1024,
        intermediate_size=512,
        num_experts=8,
        top_k=2,
        backend="triton",
        max_tokens_per_rank=2048,
    )
    weights = global_weights(config, 3, device)
    return config, weights, rank_inputs(config, 2048, "zipf", 3, device)


@pytest.mark.gpu
def test_forward_follows_the_bf16_contract():
    """y within CONTRACT_TOLERANCE of the reference on the same bf16 inputs. Catches: gate and up
    rounded to bf16 before SwiGLU, h rounded twice or not at all, expert outputs kept in fp32
    into the combine (each a rounding point of the contract moved)."""
    device = torch.device("cuda")
    config, weights, inputs = contract_case(device)
    layer = mok.MoE(config, device=device)
    layer.load_global_weights(weights)
    y = layer(inputs.x, inputs.topk_idx, inputs.topk_weights)
    want = moe_forward(inputs.x, inputs.topk_idx, inputs.topk_weights, weights)
    assert relative_error(y, want) <= CONTRACT_TOLERANCE


@pytest.mark.gpu
def test_contract_tolerance_rejects_the_unfused_bf16_path():
    """Canary: CONTRACT_TOLERANCE is tight enough that an unfused bf16 path fails it."""
    device = torch.device("cuda")
    config, weights, inputs = contract_case(device)
    want = moe_forward(inputs.x, inputs.topk_idx, inputs.topk_weights, weights)
    assert relative_error(unfused_bf16_y(inputs, weights, None), want) > 2 * CONTRACT_TOLERANCE
