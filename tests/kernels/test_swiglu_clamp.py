"""The SwiGLU clamp's decisions survive saving the pre-activations in bf16.

The backward evaluates the clamp masks (gate <= L, -L <= up <= L) on the pre-activations that the
forward saved in bf16. Rounding alone moves values within half an ulp of L (0.016 at L = 7) across
it, flipping their masks: gradients off by ~3 % where the clamp is often active. The forward saves
them through `saved_preactivations`, which keeps every decision. On the CPU the interpreter
truncates the fp32 -> bf16 store instead of rounding it; the property holds for any monotone
rounding, so the same test runs under the interpreter (CI) and compiled (GPU).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from mok.kernels.grouped_gemm import saved_preactivations
from mok.reference.expert import limit_edges
from mok.reference.expert import saved_preactivations as reference_saved

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def _save_kernel(
    gate_ptr,  # [N] fp32
    up_ptr,  # [N] fp32
    saved_gate_ptr,  # [N] out, the saved dtype
    saved_up_ptr,  # [N] out, the saved dtype
    n,
    limit,
    below,
    above,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    gate = tl.load(gate_ptr + offsets, mask=mask)
    up = tl.load(up_ptr + offsets, mask=mask)
    gate, up = saved_preactivations(gate, up, limit, below, above, True)
    tl.store(saved_gate_ptr + offsets, gate.to(saved_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(saved_up_ptr + offsets, up.to(saved_up_ptr.dtype.element_ty), mask=mask)


def near_the_limit(limit: float, count: int, generator: torch.Generator) -> torch.Tensor:
    """fp32 values within a few bf16 ulps of -L and L (every fp32 neighbour of ±L among them),
    plus L itself, ±inf, NaN and values far from it."""
    lim = torch.tensor(limit, dtype=torch.float32)
    ulp = 2.0 ** (torch.floor(torch.log2(lim)) - 7)
    near = lim + (torch.rand(count, generator=generator) * 6 - 3) * ulp
    neighbours = torch.stack([torch.nextafter(lim, lim + 1), torch.nextafter(lim, lim - 1), lim])
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, 100.0, -100.0])
    values = torch.cat([near, neighbours, specials])
    return torch.cat([values, -values])


@pytest.mark.parametrize("limit", [7.0, 0.8, 3.3])
def test_saved_preactivations_keep_the_clamp_decisions(limit):
    """Catches: pre-activations saved by plain rounding (masks flip within half an ulp of L), a
    clamp decision made with < instead of <=, an unclamped value moved by more than one ulp, NaN
    turned into a number."""
    generator = torch.Generator().manual_seed(0)
    gate = near_the_limit(limit, 4000, generator)
    up = gate[torch.randperm(gate.numel(), generator=generator)]
    gate, up = gate.to(DEVICE), up.to(DEVICE)
    saved_gate = torch.empty_like(gate, dtype=torch.bfloat16)
    saved_up = torch.empty_like(up, dtype=torch.bfloat16)
    below, above = limit_edges(limit, torch.bfloat16)
    block = 1024
    _save_kernel[(triton.cdiv(gate.numel(), block),)](
        gate, up, saved_gate, saved_up, gate.numel(), limit, below, above, BLOCK=block
    )
    if DEVICE.type == "cuda":  # the interpreter truncates the store: its bits differ
        # The reference's rule (the MXFP8 reference's backward reads it) is the kernels'.
        reference_gate, reference_up = reference_saved(gate, up, limit, torch.bfloat16)
        assert torch.equal(reference_gate.view(torch.int16), saved_gate.view(torch.int16))
        assert torch.equal(reference_up.view(torch.int16), saved_up.view(torch.int16))
    lim = torch.tensor(limit, dtype=torch.float32, device=DEVICE)
    sg, su = saved_gate.float(), saved_up.float()
    assert torch.equal(sg <= lim, gate <= lim)
    assert torch.equal((su >= -lim) & (su <= lim), (up >= -lim) & (up <= lim))
    assert torch.equal(torch.isnan(sg), torch.isnan(gate))
    assert torch.equal(torch.isnan(su), torch.isnan(up))
    # Unclamped finite values stay within one bf16 ulp of the fp32 value; infinities stay.
    assert torch.equal(sg[gate == -torch.inf], gate[gate == -torch.inf])
    for saved, value, kept in ((sg, gate, gate.abs() <= lim), (su, up, up.abs() <= lim)):
        ulp = 2.0 ** (torch.floor(torch.log2(value[kept].abs().clamp(min=1e-30))) - 7)
        assert ((saved[kept] - value[kept]).abs() <= ulp).all()


def test_plain_rounding_would_flip_decisions():
    """Canary: the inputs above really reach the failure the encoding prevents (rounding 7 + ulp/4
    to bf16 gives 7, whose mask says unclamped)."""
    lim = torch.tensor(7.0)
    value = lim + 2.0**-7 / 4
    assert value > lim and value.to(torch.bfloat16).float() <= lim


def test_limit_edges():
    """Catches: edges on the wrong side of L, or not adjacent values of the saved dtype."""
    for limit in (7.0, 0.8, 3.3, 1e-3, 448.0):
        for dtype in (torch.bfloat16, torch.float32):
            below, above = limit_edges(limit, dtype)
            lim = torch.tensor(limit, dtype=torch.float32).item()
            assert below <= lim < above
            b = torch.tensor(below, dtype=dtype)
            assert b.item() == below
            assert torch.nextafter(b, torch.tensor(float("inf"), dtype=dtype)).item() == above
    assert limit_edges(None, torch.bfloat16) == (0.0, 0.0)
