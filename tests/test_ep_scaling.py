"""benchmarks/ep_scaling.py (the model behind docs/ep-scaling.md): it runs, and a few of its
figures match values computed by hand."""

import importlib.util
import math
import pathlib
import sys

import pytest
import torch

import mok

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ep_scaling.py"


@pytest.fixture(scope="module")
def ep_scaling():
    spec = importlib.util.spec_from_file_location("ep_scaling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def scaling(module, preset, ep, tokens=8192):
    return module.Scaling(preset, ep, tokens, mok.get_preset(preset).config())


def test_prints_the_tables(ep_scaling, capsys):
    ep_scaling.main([])
    out = capsys.readouterr().out
    for title in ("Compute per rank", "Bytes per rank", "Overlap inside", "Overlap beyond"):
        assert f"### {title}" in out
    assert "| deepseek-v3 | 64 |" in out
    assert "| mixtral-8x7b | 8 |" in out and "| mixtral-8x7b | 16 |" not in out  # E = 8


def test_p_remote_by_hand(ep_scaling):
    # ep = 2, E = 256, k = 8: the other rank owns 128 experts; it gets none of the 8 picks with
    # probability 128/256 * 127/255 * ... * 121/249 = 0.0034899...
    assert ep_scaling.p_remote(256, 2, 8) == pytest.approx(1 - 0.00348994228, abs=1e-9)
    # mixtral at ep = 8: one expert per rank, k = 2 distinct picks: 7 * (1 - C(7,2)/C(8,2)) = 1.75
    assert ep_scaling.p_remote(8, 8, 2) == pytest.approx(1.75)
    # one expert per rank: every pick lands on its own rank, k * (1 - 1/ep) of them remote
    assert ep_scaling.p_remote(64, 64, 8) == pytest.approx(8 * 63 / 64)
    assert ep_scaling.p_remote(256, 1, 8) == 0


def test_p_remote_against_sampling(ep_scaling):
    experts, ep, top_k, tokens = 256, 8, 8, 20000
    gen = torch.Generator().manual_seed(0)
    picks = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
    owners = picks // (experts // ep)
    source = torch.randint(0, ep, (tokens, 1), generator=gen)
    present = torch.zeros(tokens, ep, dtype=torch.bool).scatter_(1, owners, True)
    present.scatter_(1, source, False)
    sampled = present.sum(1).double().mean().item()
    assert sampled == pytest.approx(ep_scaling.p_remote(experts, ep, top_k), abs=0.03)


def test_bytes_and_times_by_hand(ep_scaling):
    s = scaling(ep_scaling, "deepseek-v3", 8)
    # combine: 8192 tokens * 8 picks * 7/8 remote * 7168 * 2 bytes
    assert s.combine_bytes == pytest.approx(8192 * 7 * 7168 * 2)
    # backward: the same bf16 pair rows, then fp32 sums per (token, remote owner)
    assert s.backward_pair_bytes == s.combine_bytes
    assert s.backward_sum_bytes == pytest.approx(2 * s.dispatch_bytes)
    # forward FLOPs 2*T*(k*3*H*I + 3*H*I_s) at 794 TFLOP/s: the 8.18 ms floor of
    # docs/reference-machine.md
    assert s.compute_s("fwd", "dense") * 1e3 == pytest.approx(8.18, abs=0.01)
    # the smallest chunk gives each of the 32 local experts 128 rows: 128 * 32 / 8 tokens
    assert s.chunk == 512
    # compute does not depend on ep; communication grows towards k rows per token
    wide = scaling(ep_scaling, "deepseek-v3", 64)
    assert wide.compute_s("fwd", "fused") == s.compute_s("fwd", "fused")
    assert s.dispatch_bytes < wide.dispatch_bytes < 8192 * 8 * 7168 * 2


def test_inter_node_split(ep_scaling):
    s = scaling(ep_scaling, "qwen3-235b-a22b", 32)
    inside, outside = s.split_by_node("fwd")
    assert inside + outside == pytest.approx(s.forward_bytes)
    assert outside / inside == pytest.approx(24 / 7)  # 24 ranks off the node, 7 on it
    # within a node nothing leaves it
    assert scaling(ep_scaling, "qwen3-235b-a22b", 8).split_by_node("bwd")[1] == 0
    # a token crosses to another node at most once per node when forwarded inside it
    assert s.remote_nodes_per_token <= 3 < s.p_remote - 7 * s.p_owner
    assert math.isfinite(s.overlapped_s("bwd", s.inter_node_comm_s("bwd")))


def test_buffers(ep_scaling):
    s = scaling(ep_scaling, "deepseek-v3", 64)
    buffers = s.buffers(1.25)
    row = 7168 * 2
    # worst case: every token of all 64 ranks needs this rank, 4 local experts each
    assert buffers["staging"][0] == 64 * 8192 * row
    assert buffers["pair rows"][0] == 64 * 8192 * 4 * row
    # expected pairs on an owner: T * k whatever ep is
    assert buffers["pair rows"][1] == pytest.approx(1.25 * 8192 * 8 * row)
    assert buffers["combine slots"] == (8192 * 8 * row,) * 2
