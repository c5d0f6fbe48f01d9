"""Activation checkpointing (`torch.utils.checkpoint`) around a transformer-style block holding
`mok.MoE`: the gradients equal those of the plain block bit for bit, reentrant and not, in one
process and over expert parallelism (the recomputed forward runs the exchange again during the
backward, on every rank in the same order).

Bugs these catch: a forward whose state leaks into the next call (the recomputation would see
the first forward's buffers, or the backward the recomputation's), a backward that reads buffers
a second forward overwrote, gradients of the router weights or of the block's other parameters
lost through the checkpoint boundary, fused gradient accumulation adding twice when the forward
runs twice.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import mok
from mok.comm.memory import simulated_symmetric_memory
from mok.ranks import run_ranks
from mok.testing import global_weights, shared_file_allocator

CONFIG = mok.MoKConfig(
    hidden_size=32,
    intermediate_size=16,
    num_experts=4,
    top_k=2,
    shared_intermediate_size=16,
    max_tokens_per_rank=64,
)


class Block(nn.Module):
    """x + MoE(proj(x)) with a softmax-over-top-k router: the shape of an MoE transformer block."""

    def __init__(self, config: mok.MoKConfig, group=None, device=None):
        super().__init__()
        hidden = config.hidden_size
        self.proj = nn.Linear(hidden, hidden, device=device, dtype=torch.bfloat16)
        self.router = nn.Linear(hidden, config.num_experts, device=device, dtype=torch.bfloat16)
        self.moe = mok.MoE(config, group=group, device=device)
        self.top_k = config.top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        logits = self.router(h).float()
        values, idx = logits.topk(self.top_k, dim=-1)
        return x + self.moe(h, idx, values.softmax(-1))


def block_gradients(config, rank, world, mode: str, device, micro_batches: int = 2) -> dict:
    """Gradients of x and every parameter after `micro_batches` forward+backward calls (the
    weight gradients accumulate, as over micro-batches), with the block checkpointed or not."""
    group = dist.group.WORLD if world > 1 else None
    torch.manual_seed(0)
    block = Block(config, group=group, device=device)
    block.moe.load_global_weights(global_weights(config, 1, device))
    generator = torch.Generator().manual_seed(10 + rank)
    grads = {}
    for step in range(micro_batches):
        tokens = 24 + 5 * step + 3 * rank
        x = torch.randn(tokens, config.hidden_size, generator=generator).bfloat16().to(device)
        x.requires_grad_(True)
        if mode == "plain":
            y = block(x)
        else:
            y = checkpoint(block, x, use_reentrant=mode == "reentrant")
        grad_y = torch.randn(y.shape, generator=generator).bfloat16().to(device)
        y.backward(grad_y)
        grads[f"x{step}"] = x.grad.cpu()
    for name, param in block.named_parameters():
        grads[name] = param.grad.cpu()
    return grads


def in_mxfp8(config: mok.MoKConfig) -> mok.MoKConfig:
    """config with MXFP8 routed experts: its sizes raised to the multiples of 32 MXFP8 needs."""
    return config.replace(precision="mxfp8", intermediate_size=32, shared_intermediate_size=32)


def assert_bitwise_equal(plain: dict, checkpointed: dict) -> None:
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        assert torch.equal(grad, checkpointed[name]), name


BACKENDS = [
    "reference",
    # The kernels under the Triton interpreter (fp32 inside) on the CPU, for real on GPUs.
    pytest.param("triton", marks=pytest.mark.slow),
    # MXFP8 routed experts (sizes multiples of 32), their weights cast per pass: the recomputed
    # forward casts them again, and the backward checks them against that forward's.
    pytest.param("triton mxfp8", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_checkpointed_block_has_the_same_gradients(backend, mode):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = CONFIG.replace(backend=backend.split()[0])
    if backend.endswith("mxfp8"):
        config = in_mxfp8(config)
    plain = block_gradients(config, 0, 1, "plain", device)
    assert_bitwise_equal(plain, block_gradients(config, 0, 1, mode, device))


def _rank_worker(rank, world, backend, shared_dir):
    device = torch.device("cuda", rank) if torch.cuda.is_available() else "cpu"
    config = CONFIG.replace(backend=backend)
    simulated = (
        contextlib.nullcontext()
        if shared_dir is None
        else simulated_symmetric_memory(shared_file_allocator(shared_dir))
    )
    with simulated:
        plain = block_gradients(config, rank, world, "plain", device)
        checkpointed = block_gradients(config, rank, world, "non-reentrant", device)
    return plain, checkpointed


EXCHANGES = [
    "reference",
    pytest.param("triton", marks=pytest.mark.slow),
    # On the CPU: the NVLink protocol over a shared file, whose buffers every call reuses.
    pytest.param("triton symmetric", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_checkpointed_block_over_expert_parallelism(exchange, tmp_path):
    """EP 2 on gloo (CPU) or NCCL (two GPUs, the NVLink exchange): the recomputation's exchange
    matches up across the ranks and the gradients equal the plain block's on every rank."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (or none: gloo on the CPU)")
    backend, _, symmetric = exchange.partition(" ")
    if symmetric and torch.cuda.is_available():
        pytest.skip("on GPUs the triton case runs the NVLink exchange itself")
    collectives = "nccl" if torch.cuda.is_available() else "gloo"
    shared_dir = str(tmp_path) if symmetric else None
    results = run_ranks(
        _rank_worker, 2, args=(backend, shared_dir), backend=collectives, timeout_s=600
    )
    for plain, checkpointed in results:
        assert_bitwise_equal(plain, checkpointed)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "non-reentrant"])
def test_non_reentrant_checkpointing_frees_the_layers_activations(checkpointed, monkeypatch):
    """Between forward and backward of a block under non-reentrant checkpointing (the mode
    PyTorch recommends, and TorchTitan's and transformers' default), the layer's own
    activations (the experts' SwiGLU output h, a per-call tensor) are freed, to be recomputed;
    without checkpointing they are kept. Catches the forward's state held where the checkpoint's
    hooks cannot reach it (the gradients stay right, but the layer's memory is never saved)."""
    import gc
    import weakref

    from mok import functional

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = CONFIG.replace(backend="triton")
    activations = []
    layer_forward = functional.schedule_and_forward

    def watched(*args, **kwargs):
        schedule, y, saved = layer_forward(*args, **kwargs)
        if saved is not None:
            activations.append(weakref.ref(saved.saved.experts.h))
        return schedule, y, saved

    monkeypatch.setattr(functional, "schedule_and_forward", watched)
    torch.manual_seed(0)
    block = Block(config, device=device)
    block.moe.load_global_weights(global_weights(config, 1, device))
    x = torch.randn(24, config.hidden_size, device=device).bfloat16().requires_grad_(True)
    y = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
    gc.collect()
    assert len(activations) == 1
    assert (activations[0]() is None) == checkpointed
    y.float().sum().backward()
    assert x.grad is not None and len(activations) == 1 + checkpointed


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "non-reentrant"])
def test_the_saved_state_is_walked_only_under_saved_tensor_hooks(checkpointed, monkeypatch):
    """The forward's state is taken apart for save_for_backward, and put together again in
    backward, only where saved-tensor hooks are set (checkpointing, offloading). Catches the walk
    run at every call (it cost ~0.3 ms of host time per backward on the GPU machine, a fifth of
    a small layer's) or skipped under the hooks (the state's tensors would stay out of reach)."""
    from mok import tree

    walks = {"take": 0, "put": 0}
    take, put = tree.take_tensors, tree.put_tensors

    def counted(name, walk):
        def wrapper(*args):
            walks[name] += 1
            return walk(*args)

        return wrapper

    monkeypatch.setattr(tree, "take_tensors", counted("take", take))
    monkeypatch.setattr(tree, "put_tensors", counted("put", put))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = CONFIG.replace(backend="triton")
    torch.manual_seed(0)
    block = Block(config, device=device)
    block.moe.load_global_weights(global_weights(config, 1, device))
    x = torch.randn(24, config.hidden_size, device=device).bfloat16().requires_grad_(True)
    y = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
    y.float().sum().backward()
    # Checkpointed: the first forward and the recomputation each take; the backward puts once.
    expected = {"take": 2, "put": 1} if checkpointed else {"take": 0, "put": 0}
    assert walks == expected
