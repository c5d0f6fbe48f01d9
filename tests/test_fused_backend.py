"""The `fused` backend against the `triton` backend, its oracle: every result bitwise equal
(y, the gradients of x, the router weights and every weight), through the public API, in one
process (the local exchange) and on 2 or 3 ranks over the NVLink protocol: on the CPU with a
shared file standing in for symmetric memory (kernels under the Triton interpreter, the copy
before the products), and on one GPU with the ranks' processes sharing it (CUDA IPC; the copy on
its own stream beside the products, with real waits). Covered: the shared expert, the SwiGLU
clamp, gpt-oss's experts (its activation and biases), an expert id out of range, a rank without
tokens, every pair on one expert, receive buffers too small, receive buffers sized by the pairs
received (`exact_buffers`), layers stacked on one exchange, and when each per-pair buffer of the
backward is dropped.

Bugs these catch: a grouped row read before it landed (stale or zero rows: y differs), a row
stored to the wrong pair slot or rank, a count that completes before the last column tile
landed, pairs of dropped rows summed, a product grid that takes the copy's SMs (a timeout
recorded, check() raises), the wrong rows saved for backward.
"""

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist
from test_triton_backend import SHARING_PEER_TIMEOUT_S
from test_triton_backend_cpu import CONFIG, SMALL, Scenario, check_verdict, scenario

import mok
from mok.comm.memory import simulated_symmetric_memory
from mok.ranks import run_ranks
from mok.testing import (
    RankInputs,
    capture_in_graph,
    cuda_ipc_allocator,
    global_weights,
    one_call_results,
    results_without_host_sync,
    shared_file_allocator,
)

CPU = torch.device("cpu")

GPU_CONFIG = mok.MoKConfig(
    hidden_size=256,
    intermediate_size=128,
    num_experts=8,
    top_k=3,
    shared_intermediate_size=64,
    swiglu_limit=6.0,
    backend="triton",
    max_tokens_per_rank=512,
    peer_timeout_s=SHARING_PEER_TIMEOUT_S,
    tuning=mok.MoKTuning(comm_sms=16),
)

GPT_OSS_EXPERTS = {"swiglu_alpha": 1.702, "swiglu_up_offset": 1.0, "expert_bias": True}
"""gpt-oss's activation and biases (a bias lost or added to the wrong expert's rows in the down
product's peer-store epilogue, or the activation's plain form, changes y and every gradient)."""


def both_backends(rank, world, scenarios, device, shared_dir=None, overlap=None):
    """Rank worker: per scenario, (triton results, fused results), each with check()'s
    verdict and the exchange it used. Symmetric memory at EP > 1: files under shared_dir (the
    CPU), or CUDA IPC (ranks sharing one GPU). `overlap`: the fused backend's schedule
    (`FusedBackend.overlap`; None: its default)."""
    group = dist.group.WORLD if world > 1 else None
    allocator = None
    if world > 1:
        allocator = cuda_ipc_allocator if shared_dir is None else shared_file_allocator(shared_dir)
    outcomes = []
    with simulated_symmetric_memory(allocator) if allocator else contextlib.nullcontext():
        for case in scenarios:
            pair = []
            for backend in ("triton", "fused"):
                config = case.config.replace(backend=backend)
                layer = mok.MoE(config, group=group, device=device)
                layer.load_global_weights(global_weights(config, case.seed, device))
                if backend == "fused" and overlap is not None:
                    layer.workspace(device).backend.overlap = overlap
                inputs = case.ranks[rank]
                inputs = RankInputs(*(t.to(device) for t in dataclasses.astuple(inputs)))
                results = {k: v.cpu() for k, v in one_call_results(layer, inputs).items()}
                workspace = layer.workspace(device)
                results["exchange"] = type(workspace.backend.exchange).__name__
                results["check"] = check_verdict(workspace)
                workspace.release()
                pair.append(results)
            outcomes.append(pair)
    return outcomes


def assert_bitwise_equal(outcomes) -> None:
    for case_index, (triton_results, fused_results) in enumerate(outcomes):
        assert triton_results.keys() == fused_results.keys()
        for key, want in triton_results.items():
            got = fused_results[key]
            if key == "exchange":  # each backend's layout has its class (the callers check them)
                continue
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want), (case_index, key)
            else:
                assert got == want, (case_index, key)


def cases(config, world) -> list[Scenario]:
    """A plain call, a skewed one with a bad id, one with every pair on expert 0 and a rank
    without tokens (at EP > 1), and one whose pairs all go to the first experts (at EP > 1 the
    other ranks receive nothing: no rows to pull, no tiles, counts of zero), with token counts
    that are not powers of two."""
    uneven = [21, 13, 9][:world]
    idle = [19, 0, 7][:world] if world > 1 else [0]
    return [
        scenario(config, uneven, seed=1),
        scenario(config, uneven, seed=2, routing="zipf", bad_pair=(world - 1, 3, 1)),
        scenario(config, idle, seed=3, routing="one-expert"),
        scenario(config, uneven, seed=4, routing="first-experts"),
    ]


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "config",
    [CONFIG, SMALL, CONFIG.replace(**GPT_OSS_EXPERTS)],
    ids=["shared-clamp", "small", "gpt-oss"],
)
def test_one_process_matches_the_triton_backend_bitwise(config):
    outcomes = both_backends(0, 1, cases(config, 1), CPU)
    assert_bitwise_equal(outcomes)
    assert outcomes[1][1]["check"] == "MoKInputError"  # the bad id is reported by fused too


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "world, dispatch, experts",
    [(2, "pull", "swiglu"), (2, "push", "swiglu"), (3, "pull", "swiglu"), (3, "push", "swiglu")]
    + [(2, "pull", "gpt-oss")],
)
def test_expert_parallel_matches_the_triton_backend_bitwise(world, dispatch, experts, tmp_path):
    """Both dispatches of the overlapped layer (the push: staging, then the expand waiting on
    the senders' flags beside the products), against the triton backend's same dispatch; and
    gpt-oss's experts, whose down bias rides the peer-store epilogue to the token's rank."""
    config = CONFIG.replace(dispatch=dispatch)
    if experts == "gpt-oss":
        config = config.replace(**GPT_OSS_EXPERTS)
    per_rank = run_ranks(both_backends, world, args=(cases(config, world), CPU, tmp_path))
    for rank, outcomes in enumerate(per_rank):
        assert outcomes[0][0]["exchange"] == "SymmetricExchange", rank
        assert outcomes[0][1]["exchange"] == "OverlappedSymmetricExchange", rank
        assert_bitwise_equal(outcomes)


@pytest.mark.interpreter
@pytest.mark.parametrize("dispatch", ["pull", "push"])
def test_receive_buffers_too_small_drop_the_same_rows_and_raise(dispatch, tmp_path):
    """Capacity overflow: both backends drop the same pairs and check() raises on every rank."""
    tight = CONFIG.replace(recv_pair_capacity=20, recv_capacity=25, dispatch=dispatch)
    per_rank = run_ranks(
        both_backends,
        2,
        args=([scenario(tight, [30, 25], seed=4, routing="first-experts")], CPU, tmp_path),
    )
    for outcomes in per_rank:
        assert_bitwise_equal(outcomes)
        assert outcomes[0][1]["check"] == "MoKCapacityError"


def call_reset_call(rank, world, shared_dir):
    """Rank worker: a fused call, a reset (collective), the overlapped flags and epochs after
    it, then the triton and fused results of a second call."""
    group = dist.group.WORLD
    with simulated_symmetric_memory(shared_file_allocator(shared_dir)):
        first, second = scenario(CONFIG, [17, 11], seed=7), scenario(CONFIG, [9, 20], seed=8)
        config = CONFIG.replace(backend="fused")
        layer = mok.MoE(config, group=group, device=CPU)
        layer.load_global_weights(global_weights(config, first.seed, CPU))
        one_call_results(layer, first.ranks[rank])
        workspace = layer.workspace(CPU)
        workspace.reset()
        exchange = workspace.backend.exchange
        cleared = [t.tolist() for t in (exchange.landed, exchange.landed_backward)]
        cleared.append(exchange.backward_epoch.item())
        workspace.release()
    return cleared, both_backends(rank, world, [second], CPU, shared_dir)


@pytest.mark.interpreter
def test_reset_clears_the_overlapped_flags(tmp_path):
    """Bug caught: flags left stamped with an epoch that the restarted epochs reach again (a
    product after a reset would read rows before they land)."""
    for cleared, outcomes in run_ranks(call_reset_call, 2, args=(tmp_path,)):
        *flags, epoch = cleared
        assert all(value == 0 for block in flags for value in block) and epoch == 0
        assert_bitwise_equal(outcomes)


def fused_reasons(rank, world):
    """Rank worker: why the fused backend cannot run (None: it can), and why auto passes it over,
    on this CPU gloo group without simulated symmetric memory."""
    from mok.backends.fused import FusedBackend

    config = CONFIG.replace(backend="fused")
    return (
        FusedBackend.unavailable_reason(config, CPU, dist.group.WORLD),
        FusedBackend.auto_skip_reason(CPU),
    )


@pytest.mark.interpreter
def test_fused_says_why_it_cannot_run_without_the_nvlink_exchange():
    """Bug caught: the backend falling back to host-synchronizing collectives at EP > 1 (or
    failing inside) instead of naming what it needs; `auto` picking it before it is measured."""
    for reason, auto_reason in run_ranks(fused_reasons, 2):
        assert reason is not None and "NVLink exchange" in reason
        assert auto_reason is not None and "backend='fused'" in auto_reason


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["swiglu", "gpt-oss"])
@pytest.mark.parametrize("overlap", [True, False], ids=["beside", "copy-first"])
def test_one_gpu_matches_the_triton_backend_bitwise(overlap, experts):
    """The compiled kernels (warp-specialized on Hopper); beside: the copy on its own stream,
    running at the same time as the products that wait for its rows (real concurrency, unlike
    ranks sharing a GPU, whose kernels take turns). gpt-oss: its activation and biases in the
    Gluon epilogues, the down bias in the peer-store one."""
    device = torch.device("cuda", 0)
    config = GPU_CONFIG
    if experts == "gpt-oss":
        config = GPU_CONFIG.replace(**GPT_OSS_EXPERTS)
    outcomes = both_backends(0, 1, cases(config, 1), device, overlap=overlap)
    assert_bitwise_equal(outcomes)


@pytest.mark.interpreter
def test_one_process_reads_x_through_the_index_where_kernels_gather_well(monkeypatch):
    """At EP 1 with the copy-first schedule, where `gathers_rows_well` says so (forced here), the
    fused backend's gate/up product reads x through each grouped row's token as the triton
    backend's does: nothing is copied into grouped order, and every result stays bitwise the
    triton backend's (the down product's stores into the combine's pair slots included). Catches
    the copy still made (its time and memory), and the gathered rows or the index kept for the
    backward disagreeing with the peer-store epilogue's combine."""
    import mok.kernels.expert_mlp as em
    from mok.comm.local import LocalExchange

    monkeypatch.setattr(em, "gathers_rows_well", lambda *args: True)
    copies = []
    for name in ("dispatch", "dispatch_overlapped"):
        original = getattr(LocalExchange, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            copies.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(LocalExchange, name, counted)
    outcomes = both_backends(0, 1, cases(CONFIG, 1), CPU)
    assert_bitwise_equal(outcomes)
    assert copies == []


@pytest.mark.interpreter
def test_one_process_overlapped_schedule_matches_the_triton_backend_bitwise():
    """The schedule of EP > 1 (the copy flagging its tiles, the products waiting) in one process."""
    assert_bitwise_equal(both_backends(0, 1, cases(CONFIG, 1), CPU, overlap=True))


@pytest.mark.interpreter
def test_one_process_claimed_schedule_matches_the_triton_backend_bitwise(monkeypatch):
    """The overlapped schedule as a GPU runs it, its routed products held to 2 programs that
    claim their tiles, each joined by `comm_sms` more (`_ClaimsAfterCopy`; on the CPU right
    after the product, under the interpreter the tl twins claim): still bitwise the triton
    backend's, and the forward claims for one product, the backward for two (the down dgrad and
    the weight gradients' tl kernels keep the static grid). Catches a product's tiles claimed
    from another's counter (computed by nobody: y or a gradient differs), a pass that does not
    start its counters afresh (the second call's products find them spent), and an extension
    that never launches or launches the wrong number of programs."""
    from mok.backends import fused
    from mok.kernels import grouped_gemm

    taken = []
    original_init, original_counter = fused.FusedBackend.__init__, fused._ClaimsAfterCopy.counter

    def init(self, workspace):
        original_init(self, workspace)
        self.beside_sms = 2
        self.claims = fused._ClaimsAfterCopy(self, products=4)

    def counter(self):
        taken.append(self.taken)
        return original_counter(self)

    monkeypatch.setattr(fused.FusedBackend, "__init__", init)
    monkeypatch.setattr(fused._ClaimsAfterCopy, "counter", counter)
    launches, ends = [], []
    original_launch = grouped_gemm.launch_persistent

    def launch_persistent(launch, programs, claims):
        grids = []

        def recorded(programs, counter):
            grids.append(programs)
            launch(programs, counter)

        original_launch(recorded, programs, claims)
        if claims is not None:
            launches.append(grids)
            ends.append(int(claims.counters[claims.taken - 1]))

    monkeypatch.setattr(grouped_gemm, "launch_persistent", launch_persistent)
    assert_bitwise_equal(both_backends(0, 1, cases(CONFIG, 1), CPU, overlap=True))
    # Three of the four calls have rows (the third has no tokens). Per call: gate/up (counter 0
    # of the forward), then the down dgrad (counter 0 of the backward).
    assert taken == [0, 0] * 3
    assert launches == [[2, CONFIG.tuning.comm_sms]] * 6  # held, then joined
    # Every task claimed, then one id past the end for each of the 2 + comm_sms programs.
    assert all(end >= 2 + CONFIG.tuning.comm_sms for end in ends)


def stacked_layers(rank, world, scenario, device, shared_dir=None):
    """Rank worker: per backend (triton, fused), two layers of one shape (sharing one exchange)
    stacked, forward and backward once: y, the gradients of x and the router weights, and of
    both layers' weights. Symmetric memory as in `both_backends`."""
    allocator = cuda_ipc_allocator if shared_dir is None else shared_file_allocator(shared_dir)
    inputs = RankInputs(*(t.to(device) for t in dataclasses.astuple(scenario.ranks[rank])))
    results = []
    with simulated_symmetric_memory(allocator):
        for backend in ("triton", "fused"):
            config = scenario.config.replace(backend=backend)
            layers = []
            for seed in (scenario.seed, scenario.seed + 1):
                layer = mok.MoE(config, group=dist.group.WORLD, device=device)
                layer.load_global_weights(global_weights(config, seed, device))
                layers.append(layer)
            exchanges = {id(layer.workspace(device).backend.exchange) for layer in layers}
            x = inputs.x.clone().requires_grad_(True)
            weights = inputs.topk_weights.clone().requires_grad_(True)
            y = layers[1](layers[0](x, inputs.topk_idx, weights), inputs.topk_idx, weights)
            y.backward(inputs.grad_y)
            found = {"y": y, "grad x": x.grad, "grad topk_weights": weights.grad}
            for index, layer in enumerate(layers):
                found |= {f"{name} {index}": p.grad for name, p in layer.named_parameters()}
            found = {key: value.detach().cpu() for key, value in found.items()}
            found["exchanges"] = len(exchanges)
            for layer in layers:
                layer.workspace(device).release()
            results.append(found)
    return [results]


@pytest.mark.interpreter
def test_stacked_layers_sharing_an_exchange_match_the_triton_backend_bitwise(tmp_path):
    """Two layers of one shape at EP 2 share one exchange: the second forward's owners store
    their outputs into the memory that the first forward's pairs came back in, and that the
    backwards then fill with pair gradients (the overlapped layout's pair slots are the pair
    gradients' memory). Catches a pass that reads pair slots or gradients another pass has
    overwritten (the saved pair outputs kept as a view of the slots instead of a copy, a
    backward's gradients written before the forward's sum read the slots)."""
    scenario_ = cases(CONFIG, 2)[0]
    for outcome in run_ranks(stacked_layers, 2, args=(scenario_, CPU, tmp_path)):
        assert outcome[0][1]["exchanges"] == 1
        assert_bitwise_equal(outcome)


@pytest.mark.shares_gpu
@pytest.mark.gpu
def test_stacked_layers_on_ranks_sharing_one_gpu_match_the_triton_backend_bitwise():
    """The stacked layers of the test above with the ranks' processes sharing one GPU: real
    concurrency between one rank's pulls of pair gradients and another's stores of outputs."""
    scenario_ = cases(GPU_CONFIG, 2)[0]
    for outcome in run_ranks(stacked_layers, 2, args=(scenario_, torch.device("cuda", 0))):
        assert outcome[0][1]["exchanges"] == 1
        assert_bitwise_equal(outcome)


def buffer_lifetimes(rank, world, backend, shared_dir, keep_grouped_rows=False):
    """Rank worker: one call of `backend` at EP `world` over a shared file, with what the
    routed experts' backward still held when its gate/up weight gradient and its rows' gradient
    were launched (the functions the backends import at each call, wrapped; the shared expert's
    backward runs its own)."""
    import weakref

    import mok.kernels as kernels

    seen = {}
    down_data_gradient = kernels.down_data_gradient
    gate_up_weight_gradients = kernels.gate_up_weight_gradients
    gate_up_data_gradient = kernels.gate_up_data_gradient

    def first_product(grad_out, saved, **options):
        seen["grad_out"], seen["saved"] = weakref.ref(grad_out), saved
        return down_data_gradient(grad_out, saved, **options)

    def weight_gradient(grad_gate_up, saved, *args, **options):
        rows_gradient_freed = seen.get("grad rows", lambda: None)() is None
        freed = (seen["grad_out"]() is None, saved.gate_up is None, saved.h is None)
        seen["at wgrad"] = (*freed, rows_gradient_freed)
        through_tokens = saved.source_rows is not None
        seen["rows"] = (through_tokens, saved.rows.shape[0] < grad_gate_up.shape[0])
        return gate_up_weight_gradients(grad_gate_up, saved, *args, **options)

    def rows_gradient(grad_gate_up, saved, *args):
        seen["rows released at dgrad"] = saved.rows is None
        grad_rows = gate_up_data_gradient(grad_gate_up, saved, *args)
        seen["grad rows"] = weakref.ref(grad_rows)
        return grad_rows

    kernels.down_data_gradient = first_product
    kernels.gate_up_weight_gradients = weight_gradient
    kernels.gate_up_data_gradient = rows_gradient
    config = CONFIG.replace(backend=backend, keep_grouped_rows=keep_grouped_rows)
    with simulated_symmetric_memory(shared_file_allocator(shared_dir)):
        layer = mok.MoE(config, group=dist.group.WORLD, device=CPU)
        layer.load_global_weights(global_weights(config, 0, CPU))
        one_call_results(layer, cases(config, world)[0].ranks[rank])
        layer.workspace(CPU).release()
    saved = seen["saved"]
    released = saved.rows is None and saved.source_rows is None
    return seen["at wgrad"], seen["rows released at dgrad"], released, seen["rows"]


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "backend, keep_grouped_rows",
    [("triton", False), ("fused", False), ("fused", True)],
    ids=["triton", "fused", "fused keeping the grouped rows"],
)
def test_backward_drops_each_buffer_after_its_last_product(backend, keep_grouped_rows, tmp_path):
    """At EP 2 (the fused backend's pull beside the products): when the gate/up weight gradient
    of the routed experts runs, grad_out [pair_capacity, H] is freed, the saved pre-activations
    and h are released, and no rows' gradient is held; the triton backend runs the rows'
    gradient after it, with the saved rows released (the fused one runs it first and sums it
    per staging row before, so that the return of grad x runs beside the weight gradient). The
    fused backend keeps no grouped rows at all: its weight gradient reads the tokens received,
    once each (fewer rows than the pair capacity), through their index. Bug caught: a reference
    outliving its last product (the pull's closure, the give-back's closure, a local, the saved
    state) that keeps a [pair_capacity, ...] tensor in the backward's peak memory (1.75 GiB each
    at deepseek-v3, EP 2), and the fused forward saving the grouped rows again, or not when
    `keep_grouped_rows` asks it to."""
    fused = backend == "fused"
    through = fused and not keep_grouped_rows
    args = (backend, tmp_path, keep_grouped_rows)
    for seen in run_ranks(buffer_lifetimes, 2, args=args):
        assert seen == ((True, True, True, True), not fused, True, (through, through))


@pytest.mark.shares_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dispatch", ["pull", "push"])
def test_ranks_sharing_one_gpu_match_the_triton_backend_bitwise(dispatch):
    """EP 2 with the NVLink protocol's kernels compiled, the ranks' processes sharing the GPU."""
    device = torch.device("cuda", 0)
    config = GPU_CONFIG.replace(dispatch=dispatch)
    per_rank = run_ranks(both_backends, 2, args=(cases(config, 2), device))
    for outcomes in per_rank:
        assert outcomes[0][0]["exchange"] == "SymmetricExchange"
        assert outcomes[0][1]["exchange"] == "OverlappedSymmetricExchange"
        assert_bitwise_equal(outcomes)


@pytest.mark.gpu
def test_comm_sms_that_leave_no_sm_to_the_products_raise():
    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    config = GPU_CONFIG.replace(backend="fused", comm_sms=sms)
    layer = mok.MoE(config, device=device)
    x = torch.randn(8, config.hidden_size, device=device, dtype=torch.bfloat16)
    idx = torch.zeros(8, config.top_k, dtype=torch.int64, device=device)
    with pytest.raises(mok.MoKInputError, match="comm_sms"):
        layer(x, idx, torch.ones(8, config.top_k, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False], ids=["beside", "copy-first"])
def test_fused_layer_never_synchronizes_with_the_host(overlap):
    """Bug caught: a device value read on the host (a count, a capacity, an .item()) anywhere in
    the fused forward or backward; the call after the first (which compiles) must run under
    CUDA's sync debug mode set to raise."""
    device = torch.device("cuda", 0)
    config = GPU_CONFIG.replace(backend="fused")
    layer = mok.MoE(config, device=device)
    layer.load_global_weights(global_weights(config, 0, device))
    layer.workspace(device).backend.overlap = overlap
    case = cases(config, 1)[0].ranks[0]
    inputs = RankInputs(*(t.to(device) for t in dataclasses.astuple(case)))
    first = one_call_results(layer, inputs)
    second = results_without_host_sync(layer, inputs)
    layer.workspace(device).check()
    assert all(torch.equal(first[key], second[key]) for key in first)


def exact_and_capacity_sized(rank, world, scenarios, device, shared_dir=None):
    """Rank worker: per scenario and backend (triton, fused), the results with
    `exact_buffers` off and on, and for each the rows of the grouped rows and of their
    gradients that the exchange made, with the pairs this rank received."""
    from mok.comm.symmetric import OverlappedSymmetricExchange, SymmetricExchange

    allocator = cuda_ipc_allocator if shared_dir is None else shared_file_allocator(shared_dir)
    made = []

    def recording(method):
        def record(self, routing, *args, **kwargs):
            result = method(self, routing, *args, **kwargs)
            grouped = result if isinstance(result, torch.Tensor) else result[0]
            made.append((grouped.shape[0], int(routing.recv_pairs.item())))
            return result

        return record

    patched = {
        (kind, name): getattr(kind, name)
        for kind, name in (
            (SymmetricExchange, "dispatch"),
            (OverlappedSymmetricExchange, "dispatch_overlapped"),
            (SymmetricExchange, "combine_backward"),
            (OverlappedSymmetricExchange, "combine_backward_overlapped"),
        )
    }
    outcomes = []
    try:
        for (kind, name), method in patched.items():
            setattr(kind, name, recording(method))
        with simulated_symmetric_memory(allocator):
            for case in scenarios:
                for backend in ("triton", "fused"):
                    pair = []
                    for exact in (False, True):
                        config = case.config.replace(backend=backend, exact_buffers=exact)
                        layer = mok.MoE(config, group=dist.group.WORLD, device=device)
                        layer.load_global_weights(global_weights(config, case.seed, device))
                        inputs = case.ranks[rank]
                        inputs = RankInputs(*(t.to(device) for t in dataclasses.astuple(inputs)))
                        made.clear()
                        results = one_call_results(layer, inputs)
                        results = {k: v.cpu() for k, v in results.items()}
                        workspace = layer.workspace(device)
                        capacity = workspace.backend.exchange.shape.pair_capacity
                        results["check"] = check_verdict(workspace)
                        workspace.release()
                        pair.append((results, list(made), capacity))
                    outcomes.append(pair)
    finally:
        for (kind, name), method in patched.items():
            setattr(kind, name, method)
    return outcomes


def assert_exact_sizes_change_only_the_sizes(per_rank) -> None:
    for rank, outcomes in enumerate(per_rank):
        for index, ((sized, sized_made, capacity), (exact, exact_made, _)) in enumerate(outcomes):
            assert_bitwise_equal([(sized, exact)])
            assert len(sized_made) == len(exact_made) == 2, (rank, index)  # dispatch, backward
            assert all(rows == capacity for rows, _ in sized_made), (rank, index)
            assert all(rows == max(received, 1) for rows, received in exact_made), (rank, index)


@pytest.mark.interpreter
@pytest.mark.parametrize("dispatch", ["pull", "push"])
def test_exact_buffers_size_the_pair_tensors_by_the_pairs_received(dispatch, tmp_path):
    """`exact_buffers` at EP 2, both backends: the grouped rows and their gradients have one
    row per pair received (1 for a rank that receives none: the scenario whose pairs all go to
    the first experts), not the capacity, and every result is bitwise the capacity-sized one.
    Bugs caught: a per-pair tensor still made at the capacity (the memory the option exists to
    save), a kernel grid or row count taken from the tensor's rows that now misses rows or reads
    past them (results differ), an empty rank's zero-row tensors breaking a launch."""
    config = CONFIG.replace(dispatch=dispatch)
    scenarios = [cases(config, 2)[index] for index in (1, 3)]
    per_rank = run_ranks(exact_and_capacity_sized, 2, args=(scenarios, CPU, tmp_path))
    assert_exact_sizes_change_only_the_sizes(per_rank)
    first_experts = [outcomes[2][1] for outcomes in per_rank]  # triton, exact_buffers
    assert 0 in [made[0][1] for _, made, _ in first_experts]  # a rank received no pair


def exact_buffers_under_capture(rank, world, backend):
    """Rank worker: the message a CUDA-graph capture of an `exact_buffers` layer call raises
    (after an eager call), and whether an eager call after it still works (y finite)."""
    device = torch.device("cuda", 0)
    config = GPU_CONFIG.replace(backend=backend, exact_buffers=True)
    with simulated_symmetric_memory(cuda_ipc_allocator):
        layer = mok.MoE(config, group=dist.group.WORLD, device=device)
        layer.load_global_weights(global_weights(config, 0, device))
        case = cases(config, world)[0].ranks[rank]
        inputs = RankInputs(*(t.to(device) for t in dataclasses.astuple(case)))
        one_call_results(layer, inputs)
        message = None
        try:
            capture_in_graph(lambda: layer(inputs.x, inputs.topk_idx, inputs.topk_weights))
        except mok.MoKInputError as error:
            message = str(error)
        after = one_call_results(layer, inputs)
        layer.workspace(device).check()
        layer.workspace(device).release()
    return message, bool(torch.isfinite(after["y"]).all())


@pytest.mark.shares_gpu
@pytest.mark.gpu
def test_exact_buffers_on_ranks_sharing_one_gpu():
    """The GPU twin of the interpreter test above (compiled kernels, the copy beside the
    products), and the option's one limit: a CUDA-graph capture raises a clear MoKInputError
    (not a capture error from the host read) and leaves the layer usable."""
    device = torch.device("cuda", 0)
    scenarios = [cases(GPU_CONFIG, 2)[index] for index in (1, 3)]
    per_rank = run_ranks(exact_and_capacity_sized, 2, args=(scenarios, device))
    assert_exact_sizes_change_only_the_sizes(per_rank)
    for backend in ("triton", "fused"):
        for message, usable in run_ranks(exact_buffers_under_capture, 2, args=(backend,)):
            assert message is not None and "exact_buffers" in message and usable, backend
