"""`MoKConfig.validation`: the ranks agree on every call's inputs (`collective`, the default) or
each checks its own (`local`, no host round trip). Same results either way; what differs is the
host's work per call and what a bad input on one rank does.

Bugs these catch: a local mode that still meets the other ranks on the host (its cost would not
go away), a mode that skips this rank's own checks (a bad shape reaching the kernels), a bad input
in local mode that hangs the other ranks instead of timing out and recovering after `reset()`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_peer_timeouts import WHERE, backend_of, warm_layer

import mok
from mok import functional
from mok.errors import MoKConfigError, MoKInputError, MoKTimeoutError
from mok.ranks import run_ranks
from mok.testing import RankInputs, compare_with_reference, global_weights, one_call_results

TINY = mok.get_preset("tiny").config()


def test_validation_is_a_config_field_with_named_choices():
    assert TINY.validation is mok.Validation.COLLECTIVE
    assert TINY.replace(validation="local").validation is mok.Validation.LOCAL
    with pytest.raises(MoKConfigError, match="'collective', 'local'"):
        TINY.replace(validation="none")


@pytest.mark.parametrize("validation", ["collective", "local"])
def test_one_process_checks_its_inputs_in_both_modes(validation):
    layer = mok.MoE(TINY.replace(validation=validation, backend="reference"))
    x = torch.randn(5, TINY.hidden_size)  # fp32, not bf16
    idx = torch.zeros(5, TINY.top_k, dtype=torch.long)
    with pytest.raises(MoKInputError, match="x has dtype float32") as error:
        layer(x, idx, torch.ones(5, TINY.top_k))
    assert "validation='local'" not in str(error.value)  # nothing to say without other ranks


def count_agreements(rank, world, validation):
    """Results of two calls on this rank and how many input agreements the ranks held."""
    config = TINY.replace(validation=validation, backend="reference")
    layer = mok.MoE(config, group=dist.group.WORLD)
    layer.load_global_weights(global_weights(config, 0, "cpu"))
    calls = 0
    agree = functional.raise_if_any_rank_failed

    def counting(problem, group):
        nonlocal calls
        calls += 1
        agree(problem, group)

    functional.raise_if_any_rank_failed = counting
    results = []
    for call in range(2):
        generator = torch.Generator().manual_seed(10 * call + rank)
        x = torch.randn(20, config.hidden_size, generator=generator).bfloat16()
        idx = torch.randint(0, config.num_experts, (20, config.top_k), generator=generator)
        w = torch.rand(20, config.top_k, generator=generator)
        grad_y = torch.randn(20, config.hidden_size, generator=generator).bfloat16()
        results.append(one_call_results(layer, RankInputs(x, idx, w, grad_y)))
    return calls, results


def test_local_validation_skips_the_agreement_and_changes_no_result():
    collective = run_ranks(count_agreements, 2, args=("collective",), timeout_s=300)
    local = run_ranks(count_agreements, 2, args=("local",), timeout_s=300)
    for (agreed, theirs), (not_agreed, ours) in zip(collective, local, strict=True):
        # Both agree on the config once, when the workspace is made; then collective agrees on
        # every forward and backward, twice, and local never.
        assert not_agreed == 1
        assert agreed == not_agreed + 4
        for call_theirs, call_ours in zip(theirs, ours, strict=True):
            for name, value in call_theirs.items():
                assert torch.equal(value, call_ours[name]), name


def bad_input_on_one_rank(rank, world, where, tmp):
    """validation='local', the triton backend: rank 0 passes fp32 x once. Rank 0 raises alone;
    rank 1's call waits for it until the peer timeout and finishes; check() raises on rank 1;
    both reset; the next call matches the reference."""
    with warm_layer(where, rank, world, tmp, validation="local") as (layer, full, everyone, _):
        workspace = layer.workspace(everyone[rank].x.device)
        dist.barrier()
        mine = everyone[rank]
        raised = None
        try:
            x = mine.x.float() if rank == 0 else mine.x
            layer(x, mine.topk_idx, mine.topk_weights)
        except MoKInputError as error:
            raised = str(error)
        dist.barrier()
        try:
            workspace.check()
            timed_out = None
        except MoKTimeoutError as error:
            timed_out = str(error)
        workspace.reset()
        errors = compare_with_reference(layer, full, everyone, rank)
        workspace.check()
    return raised, timed_out, errors


@pytest.mark.parametrize("where", WHERE)
def test_a_bad_input_on_one_rank_in_local_mode_times_out_and_recovers(where, tmp_path):
    first, second = run_ranks(
        bad_input_on_one_rank,
        2,
        args=(where, str(tmp_path)),
        backend=backend_of(where),
        timeout_s=300,
    )
    assert "x has dtype float32" in first[0] and "validation='local'" in first[0]
    assert second[0] is None  # rank 1's input was fine: it ran the call
    assert second[1] is not None and "gave up waiting for rank 0" in second[1]
    for _, _, errors in (first, second):
        assert max(errors.values()) < 2e-2, errors
