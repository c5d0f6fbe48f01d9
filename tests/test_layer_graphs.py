"""The layer's calls replayed from its own CUDA graphs (`MoKConfig.graphs`, `mok.graphs`).

The policy (which token counts capture) on any machine; on a GPU, every replayed call against
the same call launched eagerly by a twin layer on the same weights, bit for bit: across calls
with fresh inputs, with gradients added into existing buffers, with two forwards in flight, with
a forward whose backward never runs, with weights updated in place or replaced, and with more
token counts than the cache keeps.
"""

import pytest
import torch

import mok
from mok.graphs import AUTO_KEPT_BYTES, MAX_FORWARDS, captures, kept_bytes
from mok.routing import make_routing
from mok.testing import RankInputs, global_weights, one_call_results, results_without_host_sync

TINY = mok.get_preset("tiny").config(max_tokens_per_rank=512)


@pytest.mark.parametrize(
    ("config", "ep", "tokens", "expected"),
    [
        (TINY, 1, 512, True),
        (TINY, 2, 512, True),
        (TINY, 1, 0, False),
        (TINY.replace(graphs="off"), 1, 512, False),
        (TINY.replace(exact_buffers=True, graphs="on"), 2, 512, False),
        (TINY.replace(precision="mxfp8"), 1, 512, False),
        (TINY.replace(precision="mxfp8", graphs="on"), 1, 512, True),
        (mok.get_preset("qwen3-30b-a3b").config(), 1, 8192, False),
        (mok.get_preset("qwen3-30b-a3b").config(graphs="on"), 1, 8192, True),
    ],
    ids=[
        "tiny",
        "tiny-ep2",
        "no-tokens",
        "off",
        "exact-buffers",
        "mxfp8-auto",
        "mxfp8-on",
        "qwen3-30b-auto",
        "qwen3-30b-on",
    ],
)
def test_which_calls_capture(config, ep, tokens, expected):
    """Catches the policy inverted or ignoring a field: a layer whose graphs would keep GiBs
    captured by default, exact_buffers captured (its host read raises under capture), MXFP8
    captured by default (a replay casts the weights again at every call), T = 0 captured."""
    local = config.num_experts // ep
    assert captures(config, local, ep, tokens) is expected


def test_kept_bytes_counts_the_weight_gradients_and_the_pairs():
    """Catches an estimate that misses what the graphs keep (then `auto` would capture layers
    whose gradients alone are GiBs): tiny at 8192 tokens is small, qwen3-30b-a3b's weights alone
    are over the limit at any token count."""
    assert kept_bytes(mok.get_preset("tiny").config(), 8, 1, 8192) < AUTO_KEPT_BYTES
    qwen = mok.get_preset("qwen3-30b-a3b").config()
    assert kept_bytes(qwen, qwen.num_experts, 1, 1) > 2 * 3 * 128 * 768 * 2048 - 1


def test_cpu_workspaces_have_no_graphs():
    """Catches a CPU (or reference) workspace trying to capture."""
    assert mok.create_workspace(TINY.replace(backend="reference"), device="cpu").graphs is None


# ------------------------------------------------------------------------------------------------
# On a GPU
# ------------------------------------------------------------------------------------------------


def call_inputs(config, tokens, seed, device) -> RankInputs:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    idx, w = make_routing("zipf", tokens, config.num_experts, config.top_k, gen)
    grad_y = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    return RankInputs(x.to(device), idx.to(device), w.to(device), grad_y.to(device))


def twin_layers(backend: str, seed: int = 0):
    """(a layer whose calls replay graphs from their second on, the same layer launching every
    kernel), on the same weights."""
    config = TINY.replace(backend=backend, graphs="on")
    graphed = mok.MoE(config, device="cuda")
    graphed.load_global_weights(global_weights(config, seed, "cuda"))
    eager = mok.MoE.sharing_weights_of(graphed, config.replace(graphs="off"))
    return graphed, eager


def graph_cache(layer):
    return layer.workspace(torch.device("cuda")).graphs


def assert_equal(actual: dict, expected: dict) -> None:
    differ = [key for key, value in expected.items() if not torch.equal(actual[key], value)]
    assert not differ, f"replayed results differ from the eager call's in {differ}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "fused"])
def test_replayed_calls_equal_eager_calls_bitwise(backend):
    """Fresh inputs at every call, each call's results kept and compared again at the end.
    Catches inputs not copied into the graph's (a replay computing on the first call's), an
    output or gradient handed out without a copy (the next replay overwrites a result the caller
    holds), gradients of the wrong capture, and a cache that never replays."""
    graphed, eager = twin_layers(backend)
    kept = []
    for seed in range(5):
        inputs = call_inputs(graphed.config, 384, seed, "cuda")
        actual = one_call_results(graphed, inputs)
        assert_equal(actual, one_call_results(eager, inputs))
        kept.append((actual, {k: v.clone() for k, v in actual.items()}))
    cache = graph_cache(graphed)
    assert cache.captured == 1 and cache.replays == 4
    for actual, copy in kept:
        assert_equal(actual, copy)


@pytest.mark.gpu
@pytest.mark.parametrize("buffer_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gradients_added_into_existing_buffers_equal_the_eager_sums(buffer_dtype):
    """Gradient accumulation over micro-batches: the second backward adds into `.grad` (bf16) or
    a `main_grad` (fp32). Catches the caller's buffer not copied into the graph's before the
    replay (the sum would start from the capture's values) or not copied back after it, and a
    sum rounded twice (added after the kernels instead of inside them)."""
    graphed, eager = twin_layers("triton")
    sums = []
    for layer in (graphed, eager):
        for param in layer.parameters():
            param.grad = None
            if buffer_dtype == torch.float32:
                param.main_grad = torch.zeros_like(param, dtype=torch.float32)
        for seed in range(4):
            inputs = call_inputs(layer.config, 256, seed, "cuda")
            x = inputs.x.clone().requires_grad_(True)
            layer(x, inputs.topk_idx, inputs.topk_weights).backward(inputs.grad_y)
        sums.append(
            {
                name: (p.main_grad if buffer_dtype == torch.float32 else p.grad).clone()
                for name, p in layer.named_parameters()
            }
        )
        for param in layer.parameters():
            param.grad = None
            param.main_grad = None
    assert graph_cache(graphed).replays == 3
    assert_equal(*sums)


@pytest.mark.gpu
def test_two_forwards_in_flight_and_backward_in_reverse_order():
    """Two micro-batches in flight (pipeline schedules, a layer called twice): the second
    forward runs eagerly while the first replay's state waits for its backward. Catches a
    second replay overwriting the first call's saved state (its gradients would be the second
    call's)."""
    graphed, eager = twin_layers("triton")
    warm = call_inputs(graphed.config, 256, 9, "cuda")
    one_call_results(graphed, warm)
    one_call_results(graphed, warm)  # captured now
    results = []
    for layer in (graphed, eager):
        first, second = (call_inputs(layer.config, 256, seed, "cuda") for seed in (1, 2))
        xs = [inp.x.clone().requires_grad_(True) for inp in (first, second)]
        ys = [
            layer(x, inp.topk_idx, inp.topk_weights)
            for x, inp in zip(xs, (first, second), strict=True)
        ]
        ys[1].backward(second.grad_y)
        ys[0].backward(first.grad_y)
        results.append({"y0": ys[0], "y1": ys[1], "g0": xs[0].grad, "g1": xs[1].grad})
    assert_equal(*results)


@pytest.mark.gpu
def test_a_forward_without_backward_lets_the_next_call_replay():
    """Catches the wait for a backward that never comes (the output dropped, as a forward-only
    benchmark or an evaluation with gradients on does) never ending: every later call would
    run eagerly."""
    graphed, _ = twin_layers("triton")
    inputs = call_inputs(graphed.config, 256, 0, "cuda")
    x = inputs.x.clone().requires_grad_(True)
    for _ in range(4):
        y = graphed(x, inputs.topk_idx, inputs.topk_weights)
        del y
    assert graph_cache(graphed).replays == 3


@pytest.mark.gpu
def test_weights_updated_in_place_or_replaced_are_seen():
    """Catches a graph reading a weight it captured after the module's parameter was replaced by
    another tensor (load a checkpoint by assignment) and, for in-place updates (an optimizer
    step), a graph that copied the weights at capture."""
    graphed, eager = twin_layers("triton")
    inputs = call_inputs(graphed.config, 256, 3, "cuda")
    for _ in range(3):
        one_call_results(graphed, inputs)
    with torch.no_grad():
        graphed.gate.mul_(0.5)
    assert_equal(one_call_results(graphed, inputs), one_call_results(eager, inputs))
    replaced = torch.nn.Parameter(graphed.down.detach() * 2)
    graphed.down = replaced
    eager.down = replaced
    assert_equal(one_call_results(graphed, inputs), one_call_results(eager, inputs))


@pytest.mark.gpu
def test_token_counts_past_the_cache_run_eagerly():
    """Catches a cache that grows without bound with the token counts it sees (each capture
    keeps its memory) or breaks on the ones it refuses."""
    graphed, eager = twin_layers("triton")
    for tokens in [64 + 32 * i for i in range(MAX_FORWARDS + 2)]:
        inputs = call_inputs(graphed.config, tokens, tokens, "cuda")
        for _ in range(3):
            actual = one_call_results(graphed, inputs)
        assert_equal(actual, one_call_results(eager, inputs))
    assert graph_cache(graphed).captured == MAX_FORWARDS


@pytest.mark.gpu
def test_replays_never_synchronize_and_forward_only_calls_replay():
    """A replay, forward and backward, under CUDA's sync debug mode set to raise; then calls
    without gradients (their own capture). Catches a replay path that waits for the GPU (a copy
    to the host, a synchronizing graph launch) and a no-grad call replaying a capture made with
    backward (or the reverse)."""
    graphed, eager = twin_layers("triton")
    inputs = call_inputs(graphed.config, 256, 5, "cuda")
    for _ in range(3):  # eager, then forward captured, then backward captured
        one_call_results(graphed, inputs)
    assert_equal(results_without_host_sync(graphed, inputs), one_call_results(eager, inputs))
    with torch.no_grad():
        for _ in range(3):
            y = graphed(inputs.x, inputs.topk_idx, inputs.topk_weights)
        expected = eager(inputs.x, inputs.topk_idx, inputs.topk_weights)
    assert torch.equal(y, expected)
    assert graph_cache(graphed).captured == 2
