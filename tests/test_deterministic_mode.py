"""The layer under `torch.use_deterministic_algorithms(True)`, which training stacks set for
reproducible runs: every backend runs (no operation that PyTorch refuses in that mode), and y and
every gradient equal those of the default mode bit for bit and stay finite, although in that mode
PyTorch fills the memory of every new float tensor with NaN
(`torch.utils.deterministic.fill_uninitialized_memory`), the layer's workspace buffers included.

Bugs these catch: a kernel or PyTorch step that reads rows of a buffer nobody wrote (padding of
the grouped rows, unused capacity, the rows of an empty expert, a gradient buffer accumulated into
before its first write) whose leftover contents happened to be finite; a step through an
operation that PyTorch has no deterministic CUDA kernel for (`index_add_`, `scatter_add_`, ...).
"""

from __future__ import annotations

import pytest
import torch

import mok
from mok.backends import BACKENDS
from mok.baseline import BaselineMoE
from mok.routing import make_routing
from mok.testing import RankInputs, global_weights, one_call_results

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIG = mok.MoKConfig(
    hidden_size=32,
    intermediate_size=32,  # MXFP8's scale blocks need multiples of 32
    num_experts=8,
    top_k=2,
    shared_intermediate_size=16,
    max_tokens_per_rank=64,
)


def inputs(tokens: int, routing: str, seed: int) -> RankInputs:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, CONFIG.hidden_size, generator=generator).bfloat16()
    idx, weights = make_routing(routing, tokens, CONFIG.num_experts, CONFIG.top_k, generator)
    grad_y = torch.randn(tokens, CONFIG.hidden_size, generator=generator).bfloat16()
    return RankInputs(x.to(DEVICE), idx.to(DEVICE), weights.to(DEVICE), grad_y.to(DEVICE))


def results_in_mode(implementation: str, deterministic: bool, cases) -> list[dict]:
    """One forward and backward per case of a layer made, loaded and run in the mode asked for
    (so that in deterministic mode its workspace starts NaN-filled)."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        config = config_of(implementation)
        layer = mok.MoE(config, device=DEVICE)
        layer.load_global_weights(global_weights(config, 0, DEVICE))
        if implementation == "baseline":
            layer = BaselineMoE.sharing_weights_of(layer)
        return [one_call_results(layer, case) for case in cases]
    finally:
        torch.use_deterministic_algorithms(previous)


def config_of(implementation: str) -> mok.MoKConfig:
    """ "reference", "triton", "fused", "<backend> mxfp8"; "baseline" shares a triton layer's."""
    backend, _, precision = implementation.replace("baseline", "triton").partition(" ")
    return CONFIG.replace(backend=backend, precision=precision or "bf16")


def available(implementation: str) -> bool:
    config = config_of(implementation)
    reason = BACKENDS[config.backend].unavailable_reason(config, DEVICE, None)
    return reason is None


@pytest.mark.parametrize(
    "implementation", ["reference", "baseline", "triton", "fused", "triton mxfp8"]
)
def test_deterministic_mode_changes_nothing_but_the_uninitialized_memory(
    implementation, monkeypatch
):
    if not available(implementation):
        pytest.skip(f"the {implementation} backend does not run here")
    # cuBLAS's own condition for deterministic results, which that mode checks on GPUs.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    cases = [
        inputs(37, "uniform", 1),
        inputs(40, "half-empty", 2),  # experts without rows
        inputs(23, "one-expert", 3),  # every route on one expert: the others' buffers unwritten
        inputs(0, "uniform", 4),
    ]
    default = results_in_mode(implementation, False, cases)
    deterministic = results_in_mode(implementation, True, cases)
    for case, (want, got) in enumerate(zip(default, deterministic, strict=True)):
        for name, value in want.items():
            assert torch.isfinite(got[name]).all(), (case, name)
            assert torch.equal(got[name], value), (case, name)
