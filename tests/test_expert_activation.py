"""gpt-oss's experts as layer options: `swiglu_alpha`, `swiglu_up_offset` (gate * sigmoid(alpha *
gate) * (up + offset)) and `expert_bias` (biases on the routed experts' gate, up and down), in the
reference and triton backends, against an independent float64 computation written from the
formula.

Bugs these catch: the offset added before the clamp instead of after, alpha applied to the wrong
operand, a bias added after the bf16 rounding or to the wrong expert, bias gradients lost or
summed over the wrong rows, biases not split over the expert-parallel ranks, a backend that does
not compute them running anyway.
"""

from __future__ import annotations

import pytest
import torch

import mok
from mok.backends.fused import FusedBackend
from mok.backends.triton import TritonBackend
from mok.baseline import BaselineMoE
from mok.ranks import run_ranks
from mok.reference.expert import expert_mlp
from mok.testing import (
    RankInputs,
    compare_with_reference,
    global_weights,
    relative_error,
    weights_of_preactivation_std,
)

GPT_OSS = mok.MoKConfig(
    hidden_size=32,
    intermediate_size=16,
    num_experts=4,
    top_k=2,
    swiglu_limit=7.0,
    swiglu_alpha=1.702,
    swiglu_up_offset=1.0,
    expert_bias=True,
    backend="reference",
)


def formula_expert(x, wg, wu, wd, bg, bu, bd, limit, alpha, offset):
    """The activation as gpt-oss writes it, in float64."""
    gate = (x @ wg.T + bg).clamp(max=limit)
    up = (x @ wu.T + bu).clamp(min=-limit, max=limit)
    return ((up + offset) * (gate * torch.sigmoid(alpha * gate))) @ wd.T + bd


def test_expert_mlp_matches_the_formula():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 32, generator=gen, dtype=torch.float64) * 2
    wg, wu = (torch.randn(16, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    wd = torch.randn(32, 16, generator=gen, dtype=torch.float64)
    bg, bu = (torch.randn(16, generator=gen, dtype=torch.float64) for _ in range(2))
    bd = torch.randn(32, generator=gen, dtype=torch.float64)
    ours = expert_mlp(x, wg, wu, wd, 7.0, biases=(bg, bu, bd), alpha=1.702, up_offset=1.0)
    want = formula_expert(x, wg, wu, wd, bg, bu, bd, 7.0, 1.702, 1.0)
    assert torch.allclose(ours, want, rtol=1e-12, atol=1e-12)
    assert ((x @ wg.T + bg) > 7.0).any() and ((x @ wu.T + bu).abs() > 7.0).any()  # clamps bite


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_layer_matches_the_formula_with_gradients(backend):
    """The triton backend runs its kernels (under the interpreter on the CPU, in fp32; compiled
    in bf16 on GPUs) with the activation in their epilogues, the biases added to the fp32
    accumulators and the bias gradients as per-expert column sums."""
    config = GPT_OSS.replace(backend=backend)
    device = DEVICE if backend == "triton" else "cpu"
    full = global_weights(config, 0, "cpu")
    # Pre-activations of a few units: the clamp at 7 and the biases both matter.
    full = mok.MoEWeights(
        **{
            name: None
            if t is None
            else (t.float() * (6.0 if name in ("gate", "up") else 1.0)).bfloat16()
            for name, t in full.tensors().items()
        }
    )
    layer = mok.MoE(config, device=device)
    layer.load_global_weights(full)
    gen = torch.Generator().manual_seed(1)
    tokens = 23
    x = torch.randn(tokens, 32, generator=gen).bfloat16().to(device).requires_grad_(True)
    idx = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
    w = torch.rand(tokens, 2, generator=gen).to(device).requires_grad_(True)
    grad_y = torch.randn(tokens, 32, generator=gen).bfloat16()
    layer(x, idx.to(device), w).backward(grad_y.to(device))

    exact = {n: t.double().requires_grad_(True) for n, t in full.tensors().items() if t is not None}
    x64 = x.detach().cpu().double().requires_grad_(True)
    w64 = w.detach().cpu().double().requires_grad_(True)
    y64 = torch.zeros(tokens, 32, dtype=torch.float64)
    for t in range(tokens):
        for j in range(2):
            e = int(idx[t, j])
            out = formula_expert(
                x64[t : t + 1],
                *(exact[n][e] for n in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")),
                7.0,
                1.702,
                1.0,
            )
            y64 = y64 + torch.nn.functional.pad(out * w64[t, j], (0, 0, t, tokens - t - 1))
    y64.backward(grad_y.double())
    # bf16 rounding of h and of the outputs: ~4e-3; the formula off in any term is O(1).
    assert relative_error(x.grad.cpu(), x64.grad) < 1e-2
    assert relative_error(w.grad.cpu(), w64.grad) < 1e-2
    for name, tensor in exact.items():
        assert relative_error(getattr(layer, name).grad.cpu(), tensor.grad) < 1e-2, name
    assert layer.gate_bias.grad.abs().sum() > 0


@pytest.mark.gpu
def test_gpt_oss_shape_on_a_gpu_matches_the_reference_backend():
    """gpt-oss-20b's expert shape (H = I = 2880: partial tiles of every kernel) in bf16 on a GPU,
    the triton backend against the reference backend at the same rounding points: pre-activations
    of std 4 (the clamp at 7 changes ~8 % of them), biases of std ~0.4 (a lost bias moves the
    outputs by ~10 %), four experts without tokens (their bias gradients must stay zero)."""
    config = GPT_OSS.replace(
        hidden_size=2880, intermediate_size=2880, num_experts=32, top_k=4, backend="triton"
    )
    device = torch.device("cuda")
    full = weights_of_preactivation_std(config, 4.0, device)
    full = mok.MoEWeights(
        **{
            name: (t.float() * 20).bfloat16() if name.endswith("_bias") else t
            for name, t in full.tensors().items()
        }
    )
    layer = mok.MoE(config, device=device)
    layer.load_global_weights(full)
    gen = torch.Generator(device=device).manual_seed(3)
    tokens = 300
    x = torch.randn(tokens, 2880, device=device, generator=gen).bfloat16()
    idx = torch.rand(tokens, 28, device=device, generator=gen).argsort(-1)[:, :4]
    w = torch.rand(tokens, 4, device=device, generator=gen)
    grad_y = torch.randn(tokens, 2880, device=device, generator=gen).bfloat16()
    errors = compare_with_reference(layer, full, [RankInputs(x, idx, w, grad_y)], 0)
    assert max(errors.values()) < 2e-2, errors
    assert {"grad gate_bias", "grad up_bias", "grad down_bias"} <= set(errors)
    layer(x, idx, w).backward(grad_y)
    assert not layer.gate_bias.grad[28:].any() and not layer.down_bias.grad[28:].any()


def _ep_worker(rank, world, backend="reference", tokens=(11, 12)):
    import torch.distributed as dist

    config = GPT_OSS.replace(backend=backend)
    layer = mok.MoE(config, group=dist.group.WORLD, device="cpu")
    full = global_weights(config, 0, "cpu")
    layer.load_global_weights(full)
    everyone = []
    for r in range(world):
        gen = torch.Generator().manual_seed(5 + r)
        count = tokens[r]
        x = torch.randn(count, 32, generator=gen).bfloat16()
        rows = [torch.randperm(4, generator=gen)[:2] for _ in range(count)]
        idx = torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.long)
        w = torch.rand(count, 2, generator=gen)
        everyone.append(RankInputs(x, idx, w, torch.randn(count, 32, generator=gen).bfloat16()))
    # The triton backend's CPU test mode computes in fp32: the reference at its rounding points.
    dtype = torch.float32 if backend == "triton" else None
    return compare_with_reference(layer, full, everyone, rank, dtype=dtype)


# The reference backend repeats the reference's math; the triton backend returns its fp32
# gradients rounded to the parameters' bf16 (~2e-3 normwise), where a lost term is O(1).
@pytest.mark.parametrize("tokens", [(11, 12), (0, 13)], ids=["both-ranks", "a-rank-without-tokens"])
@pytest.mark.parametrize(
    "backend, tolerance",
    [("reference", 1e-4), pytest.param("triton", 5e-3, marks=pytest.mark.interpreter)],
)
def test_expert_parallel_layer_splits_the_biases_with_the_experts(backend, tolerance, tokens):
    for errors in run_ranks(_ep_worker, 2, args=(backend, tokens)):
        assert {"grad gate_bias", "grad up_bias", "grad down_bias"} <= set(errors)
        assert max(errors.values()) < tolerance, errors


def test_which_implementations_compute_it():
    """The triton and fused backends and the baseline compute gpt-oss's experts (the baseline's
    values: `tests/test_baseline.py`), the triton backend in MXFP8 too (its values:
    `tests/test_triton_backend_mx.py`). Catches a backend refusing them, or `auto` picking one
    that does not compute them."""
    # A device the triton and fused backends run on (the CPU only under the interpreter).
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert TritonBackend.unavailable_reason(GPT_OSS, device, None) is None
    assert FusedBackend.unavailable_reason(GPT_OSS, device, None) is None
    # `auto` picks the triton backend on GPUs (selection only: no GPU is touched).
    auto = GPT_OSS.replace(backend="auto")
    assert mok.backends.select_backend(auto, torch.device("cuda"), None) is TritonBackend
    baseline = BaselineMoE(GPT_OSS)
    x = torch.randn(3, 32).bfloat16()
    y = baseline(x, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
    assert y.shape == x.shape and y.isfinite().all()
    mx = GPT_OSS.replace(precision="mxfp8", intermediate_size=32)
    assert TritonBackend.unavailable_reason(mx, device, None) is None
    assert "bf16 only" in FusedBackend.unavailable_reason(mx, device, None)
