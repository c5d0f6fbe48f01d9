"""The `triton` backend on the CPU against a float64 oracle, through the public API: its kernels
under the Triton interpreter, fp32 inside (the CPU test mode of `mok.backends.triton`), in one
process (the local exchange) and on 2 or 3 spawned gloo ranks, with the collective exchange and
with the NVLink protocol over a shared file (`simulated_symmetric_memory`). Covered: the shared
expert, the SwiGLU clamp, expert ids out of range, receive-buffer overflow, ranks without tokens,
and the gradients of x, the router weights and every weight.
"""

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

import mok
from mok.backends.triton import TritonBackend
from mok.comm.memory import simulated_symmetric_memory
from mok.ranks import run_ranks
from mok.routing import make_routing
from mok.testing import (
    RankInputs,
    float64_results,
    global_weights,
    one_call_results,
    relative_error,
    shared_file_allocator,
)
from mok.weights import ROUTED_FIELDS

# Computed in fp32, rounded once to bf16 (y and the gradients of x and the weights): normwise
# errors of ~1e-3, where a wrong or missing term of any gradient costs far more than 5e-3.
TOLERANCE = 5e-3
CPU = torch.device("cpu")

CONFIG = mok.MoKConfig(
    hidden_size=48,
    intermediate_size=32,
    num_experts=6,
    top_k=3,
    shared_intermediate_size=16,
    swiglu_limit=0.8,
    backend="triton",
    max_tokens_per_rank=64,
)
SMALL = mok.MoKConfig(
    hidden_size=32,
    intermediate_size=16,
    num_experts=4,
    top_k=2,
    backend="triton",
    max_tokens_per_rank=32,
)


@dataclasses.dataclass
class Scenario:
    """One layer call on every rank: the config, the weights' seed and each rank's inputs;
    `bad_pair` (rank, token, slot) holds the expert id E (out of range) and a NaN router weight,
    if given (a dropped pair's weight must not reach y: zeroed, not multiplied by a mask)."""

    config: mok.MoKConfig
    seed: int
    ranks: list[RankInputs]
    bad_pair: tuple[int, int, int] | None = None


def scenario(config, tokens_per_rank, seed, routing="uniform", bad_pair=None) -> Scenario:
    """Random bf16 x and grad_y and a `routing` per rank; expert id E and weight NaN at
    `bad_pair`."""
    ranks = []
    for rank, tokens in enumerate(tokens_per_rank):
        gen = torch.Generator().manual_seed(100 * seed + rank)
        x = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
        idx, w = make_routing(routing, tokens, config.num_experts, config.top_k, gen)
        grad_y = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
        ranks.append(RankInputs(x, idx, w, grad_y))
    if bad_pair is not None:
        rank, token, slot = bad_pair
        ranks[rank].topk_idx[token, slot] = config.num_experts
        ranks[rank].topk_weights[token, slot] = float("nan")
    return Scenario(config, seed, ranks, bad_pair)


def oracle(case: Scenario) -> dict[str, torch.Tensor]:
    """y and every gradient of the tokens of all ranks in float64 (`mok.testing.float64_results`):
    pairs with an id out of range are dropped (no output, zero router-weight gradient). Weight
    gradients cover all E experts."""
    config = case.config
    idx = torch.cat([r.topk_idx for r in case.ranks])
    valid = (idx >= 0) & (idx < config.num_experts)
    want = float64_results(
        torch.cat([r.x for r in case.ranks]),
        torch.where(valid, idx, 0),
        torch.where(valid, torch.cat([r.topk_weights for r in case.ranks]), 0),
        torch.cat([r.grad_y for r in case.ranks]),
        global_weights(config, case.seed, CPU),
        config.swiglu_limit,
        config.swiglu_alpha,
        config.swiglu_up_offset,
    )
    want["grad topk_weights"] = torch.where(valid, want["grad topk_weights"], 0)
    return want


def layer_results(layer: mok.MoE, inputs: RankInputs) -> dict[str, torch.Tensor]:
    """`one_call_results`, with the shared expert's gradients summed over the layer's group in
    fp32 (data parallelism sums the replicas)."""
    results = one_call_results(layer, inputs)
    if layer.group is not None:
        for key in [key for key in results if key.startswith("grad shared")]:
            results[key] = results[key].float()
            dist.all_reduce(results[key], group=layer.group)
    return results


def check_verdict(workspace) -> str | None:
    """The error `workspace.check()` raises (its class name, None if none); a second check must
    find nothing (an error is reported once)."""
    try:
        workspace.check()
    except mok.MoKInputError as error:
        verdict = type(error).__name__
    else:
        verdict = None
    workspace.check()
    return verdict


def run_scenarios(rank, world, scenarios, shared_dir=None):
    """Rank worker: per scenario, the layer's results on this rank's inputs, the exchange
    it used and the verdict of check(). With `shared_dir`, symmetric memory is simulated by files
    there (the NVLink exchange); without, a multi-rank group uses the collective exchange."""
    group = dist.group.WORLD if world > 1 else None
    simulated = (
        contextlib.nullcontext()
        if shared_dir is None
        else simulated_symmetric_memory(shared_file_allocator(shared_dir))
    )
    outcomes = []
    with simulated:
        for case in scenarios:
            layer = mok.MoE(case.config, group=group, device=CPU)
            layer.load_global_weights(global_weights(case.config, case.seed, CPU))
            results = layer_results(layer, case.ranks[rank])
            workspace = layer.workspace(CPU)
            # The reference backend has no exchange: "NoneType".
            results["exchange"] = type(getattr(workspace.backend, "exchange", None)).__name__
            results["check"] = check_verdict(workspace)
            workspace.release()
            outcomes.append(results)
    return outcomes


def assert_matches_oracle(case: Scenario, rank: int, results: dict) -> None:
    """Every result of `rank` within TOLERANCE of the oracle, and an exact zero router-weight
    gradient at the dropped pair."""
    want = oracle(case)
    world = len(case.ranks)
    start = sum(r.x.shape[0] for r in case.ranks[:rank])
    tokens = slice(start, start + case.ranks[rank].x.shape[0])
    local = case.config.local_experts(world)
    experts = slice(rank * local, (rank + 1) * local)
    assert results["y"].dtype == torch.bfloat16
    for key, expected in want.items():
        if key in ("y", "grad x", "grad topk_weights"):
            expected = expected[tokens]
        elif key.removeprefix("grad ") in ROUTED_FIELDS:
            expected = expected[experts]
        error = relative_error(results[key], expected)
        assert error <= TOLERANCE, (rank, key, error)
    if case.bad_pair is not None and case.bad_pair[0] == rank:
        _, token, slot = case.bad_pair
        assert results["grad topk_weights"][token, slot] == 0


def assert_id_error_on_its_rank(case: Scenario, rank: int, results: dict) -> None:
    """check() raised an id error on the rank holding the bad pair, nothing elsewhere."""
    bad_here = case.bad_pair is not None and case.bad_pair[0] == rank
    assert results["check"] == ("MoKInputError" if bad_here else None), rank


@pytest.mark.interpreter
def test_auto_keeps_the_reference_backend_on_the_cpu(monkeypatch):
    """Catches `auto` picking the slow interpreter on CPUs, and the CPU test mode leaking out of
    the interpreter (triton asked for on a CPU without TRITON_INTERPRET=1 must be refused)."""
    report = mok.backends.backend_report(CONFIG, CPU)
    assert report["reference"] is None and "interpreter" in report["triton"]
    assert mok.create_workspace(CONFIG.replace(backend="auto")).backend_name == "reference"
    assert mok.create_workspace(CONFIG).backend_name == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(mok.BackendUnavailableError, match="CUDA"):
        mok.create_workspace(CONFIG)


def test_triton_is_auto_on_cuda_devices_and_refuses_what_its_kernels_cannot_run():
    """Catches the CPU rule of `auto` spilling onto CUDA devices (no GPU is touched: selection
    only), and triton accepting sizes its 16-wide tiles cannot cover."""
    auto = CONFIG.replace(backend="auto")
    cuda = torch.device("cuda")
    assert mok.backends.select_backend(auto, cuda, None) is TritonBackend
    with pytest.raises(mok.BackendUnavailableError, match="hidden_size=40 is not a multiple"):
        mok.backends.select_backend(CONFIG.replace(hidden_size=40), cuda, None)


@pytest.mark.interpreter
def test_one_process_matches_float64_with_shared_expert_clamp_and_a_bad_id():
    """Catches wrong gradients anywhere in one process (e.g. the shared expert's gate and up
    gradients swapped, the clamp missing), an out-of-range pair that still contributes to y or
    keeps its router-weight gradient, an id check off by one (id E accepted), and an id error
    not raised at check() or raised twice."""
    case = scenario(CONFIG, [29], seed=1, routing="zipf", bad_pair=(0, 5, 1))
    (results,) = run_scenarios(0, 1, [case])
    assert results["exchange"] == "LocalExchange"
    assert_matches_oracle(case, 0, results)
    assert_id_error_on_its_rank(case, 0, results)


def without_and_with_grouped_rows(config, inputs: RankInputs, device, monkeypatch):
    """One call's results of `config` in one process, without and with `keep_grouped_rows`,
    and for each the shape of the rows its routed experts kept and those rows as the gate/up
    weight gradient reads them ([M, H]: through the index where one is kept)."""
    import mok.kernels as kernels

    weight_gradients = kernels.gate_up_weight_gradients
    kept = []

    def recording(grad_gate_up, saved, *args, **options):
        read = saved.rows if saved.source_rows is None else saved.rows[saved.source_rows.long()]
        kept.append((tuple(saved.rows.shape), read.clone()))
        return weight_gradients(grad_gate_up, saved, *args, **options)

    monkeypatch.setattr(kernels, "gate_up_weight_gradients", recording)
    results = []
    for keep in (False, True):
        layer_config = config.replace(keep_grouped_rows=keep)
        layer = mok.MoE(layer_config, device=device)
        layer.load_global_weights(global_weights(layer_config, 0, device))
        results.append(one_call_results(layer, inputs))
    return results, kept


def assert_x_read_in_place_of_the_grouped_rows(results, kept, tokens, config) -> None:
    """Bitwise the same results; without the option the experts kept x's T rows, with it the
    T x k grouped rows, and the product read the same rows either way."""
    without, keeping = results
    assert without.keys() == keeping.keys()
    for key, value in without.items():
        assert torch.equal(value, keeping[key]), key
    (through_x, read_through_x), (grouped, read_grouped) = kept
    assert through_x == (tokens, config.hidden_size)
    assert grouped == (tokens * config.top_k, config.hidden_size)
    assert torch.equal(read_through_x, read_grouped)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "fused"])
def test_one_process_backward_reads_x_instead_of_keeping_the_grouped_rows(backend, monkeypatch):
    """At EP 1 the routed experts keep x and each grouped row's token for the gate/up weight
    gradient, not the grouped rows (k copies of x's rows), unless `keep_grouped_rows`. Bugs
    caught: an index naming the pair or another expert's row instead of the row's token (the
    rows read differ, and so do the weights' gradients), the grouped rows still kept (the memory
    the default saves), the option ignored, a dropped pair's row read wrongly."""
    config = CONFIG.replace(backend=backend)
    case = scenario(config, [29], seed=3, routing="zipf", bad_pair=(0, 4, 2))
    results, kept = without_and_with_grouped_rows(config, case.ranks[0], CPU, monkeypatch)
    assert_x_read_in_place_of_the_grouped_rows(results, kept, 29, config)


@pytest.mark.interpreter
@pytest.mark.parametrize("tokens", [29, 0])
def test_one_process_forward_reads_x_through_the_index_where_kernels_gather_well(
    tokens, monkeypatch
):
    """At EP 1, where `gathers_rows_well` says so (the warp-specialized kernels' 64-row tiles
    on Hopper; forced here), the triton backend's gate/up product reads x through each grouped
    row's token and nothing is copied into grouped order; bit for bit the results of the copy
    (`keep_grouped_rows` still copies), with x's T rows kept for the backward. Bugs caught: an
    index naming the pair or its grouped row instead of its token (other rows read, other
    results), the copy still made (the time and memory this saves), the index not kept (the
    backward reading x's rows as grouped rows), a dropped pair's row read wrongly, a call
    without tokens failing."""
    import mok.kernels.expert_mlp as em
    from mok.comm.local import LocalExchange

    monkeypatch.setattr(em, "gathers_rows_well", lambda *args: True)
    dispatch, dispatched = LocalExchange.dispatch, []

    def counting(self, routing, x):
        dispatched.append(x.shape[0])
        return dispatch(self, routing, x)

    monkeypatch.setattr(LocalExchange, "dispatch", counting)
    bad_pair = (0, 4, 2) if tokens else None
    case = scenario(CONFIG, [tokens], seed=3, routing="zipf", bad_pair=bad_pair)
    results, kept = without_and_with_grouped_rows(CONFIG, case.ranks[0], CPU, monkeypatch)
    assert_x_read_in_place_of_the_grouped_rows(results, kept, tokens, CONFIG)
    assert dispatched == [tokens]  # the call that keeps the grouped rows copies; this one not


@pytest.mark.interpreter
@pytest.mark.parametrize("tokens", [21, 0])
def test_functional_api_returns_the_promised_dtypes(tokens):
    """Catches the CPU mode's fp32 leaking out (y, gradients of x and weights not bf16; router-
    weight gradient not in topk_weights' dtype), a forward without backward computing something
    else, and failures on a call without tokens; grad_y may be fp32 (any float dtype)."""
    case = scenario(SMALL, [tokens], seed=2)
    inputs = case.ranks[0]
    weights = global_weights(SMALL, case.seed, CPU)
    router = inputs.topk_weights.to(torch.bfloat16)
    case.ranks[0] = dataclasses.replace(inputs, topk_weights=router)
    ws = mok.create_workspace(SMALL)
    schedule = mok.build_schedule(ws, inputs.topk_idx)
    y, saved = mok.forward(ws, schedule, inputs.x, router, weights)
    grads = mok.backward(ws, schedule, saved, inputs.grad_y.float())
    y_only, nothing = mok.forward(ws, schedule, inputs.x, router, weights, need_backward=False)
    ws.check()
    assert nothing is None and torch.equal(y_only, y)
    assert grads.topk_weights.dtype == torch.bfloat16
    results = {"y": y, "grad x": grads.x, "grad topk_weights": grads.topk_weights}
    for name, grad in grads.weights.tensors().items():
        if grad is not None:
            assert grad.dtype == torch.bfloat16, name
            results[f"grad {name}"] = grad
    assert grads.x.dtype == torch.bfloat16
    assert_matches_oracle(case, 0, results)


EXPERT_PARALLEL = {
    2: scenario(CONFIG, [0, 27], seed=3, routing="zipf", bad_pair=(1, 4, 2)),
    3: scenario(CONFIG, [19, 0, 13], seed=4, bad_pair=(2, 12, 0)),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "collective"])
@pytest.mark.parametrize("world", [2, 3])
def test_expert_parallel_matches_float64(world, symmetric, tmp_path):
    """Catches expert-parallel bugs of either exchange on spawned gloo ranks: tokens or outputs
    sent to the wrong rank, gradients (x, router weights, every weight) lost on the way back, the
    shared expert's gate and up gradients swapped, a pair with id E routed past the last rank or
    kept, a rank without tokens that fails or hangs, and symmetric buffers of the wrong dtype."""
    case = EXPERT_PARALLEL[world]
    shared_dir = str(tmp_path) if symmetric else None
    per_rank = run_ranks(run_scenarios, world, args=([case], shared_dir), timeout_s=300)
    for rank, (results,) in enumerate(per_rank):
        assert results["exchange"] == ("SymmetricExchange" if symmetric else "CollectiveExchange")
        assert_matches_oracle(case, rank, results)
        assert_id_error_on_its_rank(case, rank, results)


def overflow_outcomes(rank, world, shared_dir):
    """Rank worker: run_scenarios on routings that overflow the receive buffers, reduced to
    (finite results, check() verdict) per capacity."""
    cases = [
        scenario(SMALL.replace(**capacity), [16] * world, seed=5, routing="first-experts")
        for capacity in ({"recv_capacity": 10}, {"recv_pair_capacity": 12})
    ]
    outcomes = []
    for results in run_scenarios(rank, world, cases, shared_dir):
        tensors = [v for v in results.values() if isinstance(v, torch.Tensor)]
        finite = all(bool(torch.isfinite(t.float()).all()) for t in tensors)
        outcomes.append((finite, results["check"]))
    return outcomes


@pytest.mark.interpreter
def test_capacity_overflow_drops_rows_and_raises_at_check(tmp_path):
    """Catches receive-buffer overflow (staging rows or grouped pairs) that crashes, yields
    non-finite values, or goes unreported at check() on some rank (every rank must raise)."""
    for outcomes in run_ranks(overflow_outcomes, 2, args=(str(tmp_path),), timeout_s=300):
        assert outcomes == [(True, "MoKCapacityError")] * 2


def repeated_expert_case() -> Scenario:
    """EP 2 with one local expert per rank and k = 2: tokens that pick expert 0 twice (legal
    input, the reference computes each pair), and an id out of range, which the backend routes to
    expert 0 with weight 0 (a repeat, too)."""
    config = SMALL.replace(num_experts=2, shared_intermediate_size=0)
    case = scenario(config, [9, 7], seed=6, bad_pair=(0, 2, 1))
    for inputs in case.ranks:
        inputs.topk_idx[::3] = 0
    return case


@pytest.mark.interpreter
def test_a_token_that_picks_one_expert_twice(tmp_path):
    """Regression (found by the fuzz campaign): grad x of a token with more pairs on one owner
    than that owner has experts lost all but min(k, E_loc) of them in the NVLink exchange's
    backward, silently (8-46 % off)."""
    case = repeated_expert_case()
    per_rank = run_ranks(run_scenarios, 2, args=([case], str(tmp_path)), timeout_s=300)
    for rank, (results,) in enumerate(per_rank):
        assert results["exchange"] == "SymmetricExchange"
        assert_matches_oracle(case, rank, results)
        assert_id_error_on_its_rank(case, rank, results)
