"""The reference backend on GPUs: one CUDA device against the CPU, and 2 ranks over NCCL."""

import pytest
import torch

import mok
from mok.ranks import run_ranks
from mok.testing import global_weights, relative_error

from ep_cases import (
    GPU_ROUTED_TOLERANCE,
    assert_close_to_reference,
    check_scenarios,
    standard_scenarios,
)

TINY = mok.get_preset("tiny").config()


@pytest.mark.gpu
def test_reference_on_cuda_matches_cpu():
    full = global_weights(TINY, 0, "cpu")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, TINY.hidden_size, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, TINY.num_experts, (300, TINY.top_k), generator=gen)
    w = torch.rand(300, TINY.top_k, generator=gen)
    outputs = {}
    for device in ("cpu", "cuda"):
        layer = mok.MoE(TINY, device=device)
        layer.load_global_weights(full)
        x_dev = x.detach().to(device, copy=True).requires_grad_(True)
        y = layer(x_dev, idx.to(device), w.to(device))
        y.float().square().sum().backward()
        outputs[device] = (y.cpu(), x_dev.grad.cpu(), layer.gate.grad.cpu())
    for cpu, cuda in zip(outputs["cpu"], outputs["cuda"], strict=True):
        assert relative_error(cuda, cpu) < 1e-2


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_expert_parallel_over_nccl_equals_single_process():
    """The reference backend over NCCL against one process, to fp32 rounding before the bf16
    roundings (`auto` would pick the triton backend on GPUs, whose bf16 kernels
    tests/test_triton_backend.py holds to its own tolerance). Catches routing or all-to-all bugs of
    the expert-parallel reference: a misrouted, dropped or doubly counted row."""
    scenarios = [
        {**case, "config": case["config"].replace(backend="reference")}
        for case in standard_scenarios(2)
    ]
    results = run_ranks(check_scenarios, 2, args=(scenarios, "cuda"), backend="nccl", timeout_s=300)
    assert_close_to_reference(results, scenarios, GPU_ROUTED_TOLERANCE)
