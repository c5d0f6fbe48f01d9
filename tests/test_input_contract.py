"""The layer's contract for two legal but unusual inputs, on every backend (the reference, and
the triton and fused backends under the interpreter), in one process and on two ranks:

- a token that names one expert more than once in `topk_idx`: each pair counts, with its own
  router weight, as the float64 oracle computes it;
- a NaN router weight at a valid expert id: IEEE arithmetic, as PyTorch would give it and with
  nothing masked: that token's y and x gradient are NaN, and so are the weight gradients of the
  pair's expert; every other result (other tokens, the router weights' gradients,
  other experts, the shared expert) is bit for bit what the same call gives with a finite
  weight there.

Bugs these catch: a repeated expert collapsed into one pair (or its second weight dropped), a
NaN weight zeroed or clamped (hiding a diverged router), and a NaN leaking into other tokens'
rows or other experts' gradients (a padded tile, a sum over a whole buffer, a 0 x NaN mask).
"""

from __future__ import annotations

import pytest
import torch
from test_triton_backend_cpu import CONFIG, assert_matches_oracle, run_scenarios, scenario

from mok.ranks import run_ranks
from mok.weights import ROUTED_FIELDS

BACKENDS = [
    "reference",
    pytest.param("triton", marks=pytest.mark.interpreter),
    pytest.param("fused", marks=pytest.mark.interpreter),
]
NAN_TOKEN, NAN_SLOT = 3, 1


def results_on_ranks(cases, world, tmp_path) -> list[list[dict]]:
    """Each rank's results of `cases`."""
    if world == 1:
        return [run_scenarios(0, 1, cases)]
    return run_ranks(run_scenarios, world, args=(cases, str(tmp_path)), timeout_s=300)


def repeated_experts(config, world):
    """Every third token names expert 0 in all its k slots, the others a random routing."""
    case = scenario(config, [11, 7][:world], seed=8, routing="zipf")
    for inputs in case.ranks:
        inputs.topk_idx[::3] = 0
    return case


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_token_may_name_one_expert_more_than_once(backend, world, tmp_path):
    case = repeated_experts(CONFIG.replace(backend=backend), world)
    for rank, (results,) in enumerate(results_on_ranks([case], world, tmp_path)):
        assert_matches_oracle(case, rank, results)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_router_weight_reaches_only_what_ieee_arithmetic_sends_it_to(
    backend, world, tmp_path
):
    config = CONFIG.replace(backend=backend)
    finite = scenario(config, [13, 9][:world], seed=4)
    poisoned = scenario(config, [13, 9][:world], seed=4)
    poisoned.ranks[0].topk_weights[NAN_TOKEN, NAN_SLOT] = float("nan")
    local = config.num_experts // world
    visited = int(poisoned.ranks[0].topk_idx[NAN_TOKEN, NAN_SLOT])
    per_rank = results_on_ranks([finite, poisoned], world, tmp_path)
    for rank, (want, got) in enumerate(per_rank):
        other_tokens = torch.ones(got["y"].shape[0], dtype=torch.bool)
        if rank == 0:
            other_tokens[NAN_TOKEN] = False
            assert got["y"][NAN_TOKEN].isnan().all() and got["grad x"][NAN_TOKEN].isnan().all()
        for key in ("y", "grad x"):
            assert torch.equal(got[key][other_tokens], want[key][other_tokens]), (rank, key)
        assert torch.equal(got["grad topk_weights"], want["grad topk_weights"]), rank
        for name in [name for name in ROUTED_FIELDS if f"grad {name}" in want]:
            for expert in range(local):
                grad, clean = got[f"grad {name}"][expert], want[f"grad {name}"][expert]
                if rank * local + expert == visited:
                    assert grad.isnan().any(), (rank, name, expert)
                else:
                    assert torch.equal(grad, clean), (rank, name, expert)
        for key in [key for key in want if key.startswith("grad shared")]:
            assert torch.equal(got[key], want[key]), (rank, key)
