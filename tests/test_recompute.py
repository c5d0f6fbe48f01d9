"""`MoKTuning.recompute`: the backward makes the experts' h and pre-activations again instead of
keeping them from the forward. The results must be those of the layer that keeps them, bit for
bit (the same gate/up product on the same rows), and the forward must keep less.

Bugs these catch: a replay that reads other rows than the forward (the grouped rows where the
forward read x through each pair's token, or the index dropped), that runs another activation
or forgets the biases or the clamp (every gradient differs), a replay that never runs (the
backward raises on a missing activation) or runs where nothing was dropped, the option ignored
(the activations still kept: the memory it saves), a saved state of the compiled path that
cannot hold the missing activations.
"""

import dataclasses

import pytest
import torch
from test_fused_backend import GPT_OSS_EXPERTS, cases
from test_triton_backend_cpu import CONFIG, SMALL, scenario

import mok
import mok.kernels.expert_mlp as em
from mok.comm.memory import simulated_symmetric_memory
from mok.kernels import Activation
from mok.ranks import run_ranks
from mok.testing import (
    RankInputs,
    cuda_ipc_allocator,
    global_weights,
    one_call_results,
    shared_file_allocator,
)

CPU = torch.device("cpu")


def test_config_refuses_recompute_where_it_does_not_apply():
    assert CONFIG.replace(recompute="gate_up").tuning.recompute is mok.Recompute.GATE_UP
    with pytest.raises(mok.MoKConfigError, match="recompute must be one of 'none', 'gate_up'"):
        CONFIG.replace(recompute="all")
    with pytest.raises(mok.MoKConfigError, match="applies to bf16 experts"):
        mok.MoKConfig(64, 32, 4, 2, precision="mxfp8", tuning={"recompute": "gate_up"})


def recording_replays(monkeypatch) -> list[tuple[bool, bool]]:
    """Per replay that had something to make: (h was missing, the pre-activations were)."""
    replays = []
    replay = em.replay_activations

    def recorded(saved):
        if saved.replay:
            replays.append((saved.h is None, saved.gate_up is None))
        replay(saved)

    monkeypatch.setattr(em, "replay_activations", recorded)
    return replays


def layer_results(config, case, rank, device, overlap=None, group=None) -> dict:
    layer = mok.MoE(config, group=group, device=device)
    layer.load_global_weights(global_weights(config, case.seed, device))
    if overlap is not None:
        layer.workspace(device).backend.overlap = overlap
    inputs = RankInputs(*(t.to(device) for t in dataclasses.astuple(case.ranks[rank])))
    results = {k: v.cpu() for k, v in one_call_results(layer, inputs).items()}
    layer.workspace(device).release()
    return results


def without_and_with_recompute(config, case, rank, device, overlap=None, group=None):
    return [
        layer_results(config.replace(recompute=mode), case, rank, device, overlap, group)
        for mode in ("none", "gate_up")
    ]


def assert_bitwise_equal(kept: dict, replayed: dict) -> None:
    assert kept.keys() == replayed.keys()
    for key, want in kept.items():
        assert torch.equal(replayed[key], want), key


@pytest.mark.interpreter
@pytest.mark.parametrize("source_rows", [False, True], ids=["grouped-rows", "through-tokens"])
def test_replayed_activations_are_the_forwards_bitwise(source_rows):
    """The kernels alone: a forward that keeps no activations keeps none, writes no
    pre-activations, and its backward (which replays them) gives the gradients of the forward
    that kept them, under gpt-oss's activation with its clamp and biases, with the rows read
    in place or through an index."""
    torch.manual_seed(0)
    experts, hidden, inter, tokens = 3, 32, 16, 11
    x = torch.randn(tokens, hidden)
    index = torch.randint(0, tokens, (20,), dtype=torch.int32)
    rows, source = (x, index) if source_rows else (x[index.long()], None)
    offsets = torch.tensor([0, 7, 7, 18], dtype=torch.int32)  # an empty expert, 2 padding rows
    w_gate, w_up = torch.randn(experts, inter, hidden) / 6, torch.randn(experts, inter, hidden) / 6
    w_down = torch.randn(experts, hidden, inter) / 4
    biases = tuple(torch.randn(experts, n) for n in (inter, inter, hidden))
    activation = Activation(1.702, 1.0)
    grad_out = torch.randn(20, hidden)
    results = []
    for keep in (True, False):
        out, saved = em.expert_mlp_forward(
            rows,
            offsets,
            w_gate,
            w_up,
            w_down,
            swiglu_limit=0.8,
            activation=activation,
            biases=biases,
            source_rows=source,
            keep_activations=keep,
        )
        assert saved.replay is not keep
        assert (saved.h is None, saved.gate_up is None) == (not keep, not keep)
        kept = None
        if not keep:
            em.replay_activations(saved)
            assert not saved.replay
            kept = (saved.h, saved.gate_up)
        grads = em.expert_mlp_backward(grad_out, saved)
        results.append((out[:18], [g[:18] if g.dim() == 2 else g for g in grads], kept))
        if keep:
            forward_h, forward_gate_up = saved.h, saved.gate_up
    (out, grads, _), (replayed_out, replayed_grads, (h, gate_up)) = results
    assert torch.equal(replayed_out, out)
    assert torch.equal(h[:18], forward_h[:18]) and torch.equal(gate_up[:18], forward_gate_up[:18])
    for want, got in zip(grads, replayed_grads, strict=True):
        assert torch.equal(got, want)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "backend, config, overlap",
    [
        ("triton", CONFIG, None),
        ("triton", CONFIG.replace(**GPT_OSS_EXPERTS), None),
        ("fused", CONFIG, True),
    ],
    ids=["triton", "triton-gpt-oss", "fused-overlapped"],
)
def test_one_process_layer_with_recompute_equals_the_layer_without(
    backend, config, overlap, monkeypatch
):
    """Every result bitwise, over calls with a bad id, every pair on one expert and no tokens;
    the replays made both activations of the routed and the shared experts, and only under the
    option."""
    config = config.replace(backend=backend)
    for case in cases(config, 1):
        replays = recording_replays(monkeypatch)
        kept, replayed = without_and_with_recompute(config, case, 0, CPU, overlap)
        assert_bitwise_equal(kept, replayed)
        tokens = case.ranks[0].x.shape[0]
        assert replays == ([(True, True)] * 2 if tokens else [])  # routed and shared


def expert_parallel_worker(rank, world, config, case, shared_dir):
    """Rank worker: without and with recompute over the simulated NVLink exchange."""
    group = torch.distributed.group.WORLD
    with simulated_symmetric_memory(shared_file_allocator(shared_dir)):
        return without_and_with_recompute(config, case, rank, CPU, group=group)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "fused"])
def test_expert_parallel_layer_with_recompute_equals_the_layer_without(backend, tmp_path):
    """EP 2 with a rank without tokens: the triton backend replays on the grouped rows it keeps,
    the fused one on the tokens received through their index, beside the pull of grad rows."""
    config = SMALL.replace(backend=backend, shared_intermediate_size=16)
    case = scenario(config, [0, 23], seed=7, routing="zipf")
    per_rank = run_ranks(expert_parallel_worker, 2, args=(config, case, str(tmp_path)))
    for kept, replayed in per_rank:
        assert_bitwise_equal(kept, replayed)


def kept_between_passes(config, inputs, device) -> tuple[dict, int]:
    """(one call's results, bytes of the storages the layer's forward hands to autograd's
    saved-tensor hooks for its backward: what it keeps, free of other allocations' noise)."""
    layer = mok.MoE(config, device=device)
    layer.load_global_weights(global_weights(config, 0, device))
    x = inputs.x.clone().requires_grad_(True)
    weights = inputs.topk_weights.clone().requires_grad_(True)
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = layer(x, inputs.topk_idx, weights)
    y.backward(inputs.grad_y)
    results = {"y": y.detach(), "grad x": x.grad, "grad w": weights.grad}
    results.update({name: p.grad.clone() for name, p in layer.named_parameters()})
    layer.workspace(device).release()
    return results, sum(storages.values())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "fused"])
def test_recompute_on_a_gpu_is_bitwise_and_keeps_the_activations_less(backend):
    """On an H200's kernels (the Gluon products, x read through each pair's token at EP 1):
    bitwise the layer that keeps its activations, and its forward keeps T x k x 3I + T x 3I_s
    bf16 values fewer, exactly (the storages it hands to saved-tensor hooks)."""
    from test_triton_backend import preset_configs, rank_inputs

    device = torch.device("cuda")
    config = dict(preset_configs(num_experts=16))["qwen3-30b-a3b"]
    config = config.replace(backend=backend, graphs="off", shared_intermediate_size=256)
    tokens = 250  # max_tokens_per_rank of the preset configs
    inputs = rank_inputs(config, tokens, "zipf", 5, device)
    kept, kept_bytes = kept_between_passes(config, inputs, device)
    replayed, replayed_bytes = kept_between_passes(
        config.replace(recompute="gate_up"), inputs, device
    )
    assert_bitwise_equal(kept, replayed)
    inter, shared = config.intermediate_size, config.shared_intermediate_size
    saved = 2 * 3 * (tokens * config.top_k * inter + tokens * shared)
    assert kept_bytes - replayed_bytes == saved, (kept_bytes, replayed_bytes)


@pytest.mark.gpu
@pytest.mark.shares_gpu
def test_expert_parallel_recompute_on_ranks_sharing_one_gpu():
    """EP 2 on one GPU (CUDA IPC): the fused backend's replay beside the pull of grad rows, on
    the SMs the forward's gate/up product had, gives the results of the layer that keeps its
    activations."""
    from test_triton_backend import SHARING_PEER_TIMEOUT_S

    config = SMALL.replace(
        backend="fused", hidden_size=256, intermediate_size=128, shared_intermediate_size=64
    )
    config = config.replace(peer_timeout_s=SHARING_PEER_TIMEOUT_S, max_tokens_per_rank=256)
    case = scenario(config, [0, 200], seed=8, routing="zipf")
    per_rank = run_ranks(sharing_worker, 2, args=(config, case), timeout_s=300)
    for kept, replayed in per_rank:
        assert_bitwise_equal(kept, replayed)


def sharing_worker(rank, world, config, case):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with simulated_symmetric_memory(cuda_ipc_allocator):
        return without_and_with_recompute(
            config, case, rank, device, group=torch.distributed.group.WORLD
        )
