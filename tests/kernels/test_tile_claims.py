"""Claimed tiles (`host.TileClaims`), the host side: how a product's launch takes its
counter and its extension, which products a held config lets claim, what the warp-specialized
launcher refuses, and the fused backend's counters. The kernels' claiming runs on the GPU
(`test_warp_specialized.py`: claimed products bitwise equal to the static grid, every program
ending once)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok.kernels import expert_mlp as em
from mok.kernels import grouped_gemm as gg
from mok.kernels import host, warp_specialized
from mok.kernels.host import GemmTiles


class _Claims:
    """`TileClaims` recording what the launcher asks of it; its extension adds `extra` programs."""

    def __init__(self, extra: int = 5) -> None:
        self.extra = extra
        self.counters: list[torch.Tensor] = []
        self.extended = 0

    def counter(self) -> torch.Tensor:
        self.counters.append(torch.zeros(1, dtype=torch.int32))
        return self.counters[-1]

    def extend(self, relaunch) -> None:
        self.extended += 1
        relaunch(self.extra)


def test_a_claiming_launch_takes_one_counter_and_its_extension_shares_it():
    """Bugs caught: the extension's programs given a fresh counter (they would recompute every
    tile, racing the first launch's stores), a counter taken per launch, the extension never
    offered, or a static launch handed a counter (its programs would claim from garbage)."""
    launches = []
    host.launch_persistent(lambda programs, counter: launches.append((programs, counter)), 7, None)
    assert launches == [(7, None)]
    claims = _Claims(extra=5)
    launches.clear()
    host.launch_persistent(
        lambda programs, counter: launches.append((programs, counter)), 7, claims
    )
    assert len(claims.counters) == 1 and claims.extended == 1
    assert [programs for programs, _ in launches] == [7, 5]
    assert all(counter is claims.counters[0] for _, counter in launches)


def _hopper_like_config() -> em.ExpertKernelConfig:
    small = GemmTiles(16, 32, 32, num_warps=4, num_stages=1)
    return em.ExpertKernelConfig(
        *([small] * 6),
        gluon=em.GluonTiles(
            gate_up=warp_specialized.SWIGLU_PING_PONG,
            down=warp_specialized.PING_PONG,
            dgrad=warp_specialized.DGRAD_TILES,
            wgrad=warp_specialized.WGRAD_TILES,
        ),
    )


def test_held_configs_let_only_their_held_products_claim():
    """The gate/up product (forward), the first data gradient (backward) and the weight
    gradients carry the claims of their schedule; the forward's down product and the second
    data gradient, which run on every SM once the copy is done, do not (the latter's launcher
    refuses claims: its zero-filling of the rows outside the groups is static). Claims do not
    change a config's equality or hash (configs key caches)."""
    cfg, claims = _hopper_like_config(), _Claims()
    forward = em.with_gate_up_sms(cfg, 100, claims)
    assert forward.gate_up.claims is claims and forward.gluon.gate_up.claims is claims
    assert forward.gluon.gate_up.max_sms == 100
    assert forward.down.claims is None and forward.gluon.down.claims is None
    backward = em._with_down_dgrad_sms(cfg, 100, claims)
    assert backward.gluon.dgrad.down.claims is claims
    assert backward.gluon.dgrad.gate_up.claims is None
    assert backward.down_dgrad.claims is claims and backward.gate_up_dgrad.claims is None
    weights = em.held_to(cfg, 100, claims=claims)
    assert weights.gluon.wgrad.half.claims is claims
    assert weights.gluon.wgrad.single.claims is claims
    claimed = forward.gluon.gate_up
    unclaimed = dataclasses.replace(claimed, claims=None)
    assert claimed == unclaimed and hash(claimed) == hash(unclaimed)


def test_the_warp_specialized_launcher_refuses_claims_it_cannot_take():
    """GATE_UP_DGRAD's zero-filling of the rows outside the groups walks a static stride (not
    built for claims): it raises before anything launches, instead of leaving rows unzeroed."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m, hidden, inter, experts = 256, 128, 64, 2

    def zeros(*shape, dtype=torch.bfloat16):
        return torch.zeros(*shape, dtype=dtype, device=device)

    cfg = dataclasses.replace(warp_specialized.PING_PONG, claims=_Claims())
    capacity = m // cfg.block_m + experts + 2
    tiles = host.RowTiles(
        zeros(3, capacity, dtype=torch.int32), zeros(2, dtype=torch.int32), capacity, cfg.block_m
    )
    dgrad = warp_specialized._RowsProblem(
        warp_specialized.GATE_UP_DGRAD.value,
        zeros(m, inter),
        zeros(experts, inter, hidden),
        zeros(m, hidden),
        zeros(m, inter),
        zeros(experts, inter, hidden),
    )
    with pytest.raises(ValueError, match="TileClaims"):
        warp_specialized._launch(dgrad, tiles, cfg)
    assert cfg.claims.counters == []


def test_the_fused_backend_gives_each_product_of_a_pass_its_own_counter():
    """`_ClaimsAfterCopy`: the products of one pass take distinct counters, zeroed when a pass
    starts; more products than counters raise; the extension adds `comm_sms` programs (on the
    CPU, where there is no communication stream, at once). Bugs caught: two products sharing a
    counter (the second would find it spent and compute nothing), counters left at the previous
    pass's values. Where the extension runs on a GPU (after the copy and the product's inputs,
    not after the product) shows in a trace, `benchmarks/profile_layer.py --backend fused
    --overlap --trace DIR`, not in results."""
    from mok.backends.fused import FusedBackend, _ClaimsAfterCopy

    class Backend:
        workspace = type("Workspace", (), {"device": torch.device("cpu")})()
        comm_programs = 16
        comm_stream = None
        overlap = True
        _beside, _join = FusedBackend._beside, FusedBackend._join

    claims = _ClaimsAfterCopy(Backend(), products=3)
    claims.counters.fill_(9)
    claims.start()
    taken = [claims.counter() for _ in range(3)]
    slots = {claims.counters[i : i + 1].data_ptr() for i in range(3)}
    assert {t.data_ptr() for t in taken} == slots
    assert all(int(t) == 0 for t in taken)
    with pytest.raises(RuntimeError, match="more than 3 products"):
        claims.counter()
    relaunched = []
    claims.extend(relaunched.append)
    assert relaunched == [16]
    claims.start()
    assert claims.counter().data_ptr() == claims.counters.data_ptr()


@pytest.mark.interpreter
@pytest.mark.parametrize("sizes", [[37, 0, 70, 5], [0, 1, 0, 90]], ids=["ragged", "empty groups"])
def test_the_tl_products_that_claim_equal_their_static_grid(sizes):
    """The tl twins of the claiming products (gate/up + SwiGLU, down dgrad + SwiGLU) with their
    tasks claimed equal the static grid bit for bit, and each counter ends at tasks + programs
    (3 held, 2 joined): the interpreter runs programs one after another, so the first claims
    every task and the rest, the extension's too, each draw one id past the end. Catches a
    claimed id mapped to another tile than the static one, a program that stops before the
    tasks run out or claims again after its end, a launch not claiming at all (the counter left
    at zero)."""
    gen = torch.Generator().manual_seed(3)
    hidden, inter, before = 64, 48, 3
    m = before + sum(sizes) + 4
    offsets = (torch.tensor([0, *sizes]).cumsum(0) + before).to(torch.int32)
    rows = torch.randn(m, hidden, generator=gen)
    w_gate, w_up = (torch.randn(len(sizes), inter, hidden, generator=gen) * 0.2 for _ in "gu")
    w_down = torch.randn(len(sizes), hidden, inter, generator=gen) * 0.2
    grad_out = torch.randn(m, hidden, generator=gen)
    cfg = GemmTiles(16, 32, 32, num_warps=4, num_stages=1, group_m=2)
    tiles = gg.row_tile_map(offsets, m, cfg.block_m)
    claims = _Claims(extra=2)
    results = []
    for tiles_cfg in (cfg, dataclasses.replace(cfg, max_sms=3, claims=claims)):
        h, gate_up = gg.gate_up_swiglu(rows, w_gate, w_up, tiles, 0.5, True, tiles_cfg)
        grads = gg.down_dgrad_swiglu(grad_out, w_down, gate_up, tiles, 0.5, tiles_cfg)
        inside = slice(before, before + sum(sizes))
        results.append((h[inside], gate_up[inside], grads[inside]))
    for static, claimed in zip(*results, strict=True):
        assert torch.equal(static, claimed)
    tasks = int(tiles.counts[0]) * -(-inter // cfg.block_n)
    assert [int(c) for c in claims.counters] == [tasks + 3 + 2] * 2
