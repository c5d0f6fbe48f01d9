"""The layer's calls replayed from its own CUDA graphs (`MoKTuning.graphs`, `mok.graphs`).

The policy (which token counts capture) on any machine; on a GPU, every replayed call against
the same call launched eagerly by a twin layer on the same weights, bit for bit: across calls
with fresh inputs, with gradients added into existing buffers, with two forwards in flight, with
a forward whose backward never runs, with weights updated in place or replaced, and with more
token counts than the cache keeps.
"""

import dataclasses

import pytest
import torch

import mok
from mok import functional, graphs, tree
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
# The cache's bookkeeping on the CPU: a toy layer, and a stand-in for CUDA graphs
# ------------------------------------------------------------------------------------------------


class FakeGraph:
    """A CUDA graph's semantics on the CPU: a replay runs the captured call again on what its
    inputs hold now and writes every result into the capture's own tensors (a graph rewrites the
    same memory at every replay, which is what the cache must copy out of)."""

    def __init__(self, run, result):
        self.run = run
        self.replays = 0
        self.targets: list[torch.Tensor] = []
        tree.take_tensors(result, self.targets)

    def replay(self):
        self.replays += 1
        fresh: list[torch.Tensor] = []
        tree.take_tensors(self.run(), fresh)
        for target, value in zip(self.targets, fresh, strict=True):
            target.copy_(value)


def fake_capture(run):
    result = run()
    return FakeGraph(run, result), result


@dataclasses.dataclass
class ToySchedule:
    topk_idx: torch.Tensor


def toy_forward(topk_idx, x, topk_weights, weights, need_backward):
    """y = x * sum(topk_weights) * sum(gate): a layer small enough to check by hand, with state
    saved for backward that a later replay overwrites (x itself)."""
    y = x * topk_weights.sum(1, keepdim=True) * weights.gate.sum()
    saved = functional.SavedForward(x.shape[0], {"x": x, "w": topk_weights, "gate": weights.gate})
    return ToySchedule(topk_idx), y, saved if need_backward else None


def toy_backward(schedule, saved, grad_y, into):
    x, w, gate = saved.saved["x"], saved.saved["w"], saved.saved["gate"]
    scale = w.sum(1, keepdim=True)
    grad_gate = torch.full_like(gate, float((grad_y * x * scale).sum()))
    grads = {"gate": grad_gate, "up": torch.zeros(2), "down": torch.zeros(2)}
    for name, buffer in into.items():
        grads[name] = buffer.add_(grads[name])
    return mok.MoEGradients(
        x=grad_y * scale * gate.sum(),
        topk_weights=(grad_y * x).sum(1, keepdim=True).expand_as(w) * gate.sum(),
        weights=mok.MoEWeights(**grads),
    )


@pytest.fixture
def toy_cache(monkeypatch):
    monkeypatch.setattr(graphs, "_capture", fake_capture)
    monkeypatch.setattr(graphs, "_sync_debug_mode_set", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return graphs.GraphCache(toy_forward, toy_backward, wanted=lambda tokens: tokens > 0)


def toy_inputs(seed, tokens=6):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 4, (tokens, 2), generator=gen),
        torch.randn(tokens, 3, generator=gen),
        torch.rand(tokens, 2, generator=gen),
    )


TOY_WEIGHTS = mok.MoEWeights(gate=torch.randn(2, 2), up=torch.randn(2), down=torch.randn(2))


def toy_forward_call(cache, inputs, weights=TOY_WEIGHTS):
    """The cache's forward of a toy call (None where it declines to replay)."""
    return cache.forward(*inputs, weights, True, graphs.call_key(*inputs, weights))


def toy_call(cache, inputs, grad_y=None, into=None, weights=TOY_WEIGHTS):
    """(y, grads) of one call through the cache, or eagerly where it declines."""
    replayed = toy_forward_call(cache, inputs, weights)
    schedule, y, saved = replayed or toy_forward(*inputs, weights, True)
    if grad_y is None:
        return y, saved
    into = into or {}
    if isinstance(saved.saved, graphs.GraphedState):
        return y, cache.backward(saved.saved, grad_y, into)
    return y, toy_backward(schedule, saved, grad_y, into)


def toy_expected(inputs, grad_y, weights=TOY_WEIGHTS):
    schedule, y, saved = toy_forward(*inputs, weights, True)
    return y, toy_backward(schedule, saved, grad_y, {})


def test_cache_replays_from_the_second_call_and_copies_results_out(toy_cache):
    """Catches a result handed out without a copy (kept results change at the next replay: y,
    grad x, the weights' gradients), inputs not copied in (a replay computing on the capture's
    inputs), and the warm-up call skipped or repeated."""
    kept = []
    for seed in range(4):
        inputs = toy_inputs(seed)
        grad_y = torch.randn_like(inputs[1])
        y, grads = toy_call(toy_cache, inputs, grad_y)
        y_expected, grads_expected = toy_expected(inputs, grad_y)
        assert torch.equal(y, y_expected) and torch.equal(grads.x, grads_expected.x)
        for name in ("gate", "up", "down"):
            assert torch.equal(getattr(grads.weights, name), getattr(grads_expected.weights, name))
        results = (y, grads.x, grads.weights.gate)
        kept.append((results, [t.clone() for t in results]))
    assert (toy_cache.captured, toy_cache.replays) == (1, 3)
    for results, copies in kept:
        assert all(torch.equal(t, c) for t, c in zip(results, copies, strict=True))


def test_cache_serves_one_call_in_flight_per_capture(toy_cache):
    """A second forward while a replay waits for its backward runs eagerly; a replay's state
    freed unused ends the wait; a state used twice raises. Catches a replay overwriting the
    state a waiting backward needs, a wait that never ends, and a second backward on
    overwritten state."""
    inputs, other = toy_inputs(0), toy_inputs(1)
    for _ in range(2):
        toy_call(toy_cache, inputs)
    _, waiting = toy_call(toy_cache, inputs)  # a replay, waiting for its backward
    assert toy_forward_call(toy_cache, other) is None
    grad_y = torch.randn_like(inputs[1])
    grads = toy_cache.backward(waiting.saved, grad_y, {})
    assert torch.equal(grads.x, toy_expected(inputs, grad_y)[1].x)
    with pytest.raises(RuntimeError, match="serves one backward"):
        toy_cache.backward(waiting.saved, grad_y, {})
    _, dropped = toy_call(toy_cache, inputs)
    del dropped
    assert toy_forward_call(toy_cache, other) is not None


def test_cache_backward_adds_into_buffers_and_falls_back_where_weights_moved(toy_cache):
    """Gradients added into the caller's buffers (copied into the graph's and back), and a
    backward whose weight moved since the capture (FSDP2 gathers it anew) launched eagerly.
    Catches a sum that starts from the capture's buffer, a buffer not written back, and a
    backward graph reading where a weight used to be."""
    inputs = toy_inputs(2)
    grad_y = torch.randn_like(inputs[1])
    expected = toy_expected(inputs, grad_y)[1].weights.gate
    buffer = torch.ones(2, 2)
    for calls in range(1, 5):  # eager, captured forward, captured backward, replays
        _, grads = toy_call(toy_cache, inputs, grad_y, into={"gate": buffer})
        assert grads.weights.gate is buffer
        assert torch.allclose(buffer, 1 + calls * expected)
    weights = mok.MoEWeights(
        gate=TOY_WEIGHTS.gate.clone(), up=TOY_WEIGHTS.up, down=TOY_WEIGHTS.down
    )
    for _ in range(3):  # eager, captured forward, captured backward
        toy_call(toy_cache, inputs, grad_y, weights=weights)
    _, state = toy_call(toy_cache, inputs, weights=weights)
    forward = state.saved.forward
    (backward,) = forward.backwards.values()
    replays = backward.graph.replays
    forward.weights[0] = (weights.gate, -1)  # as if gathered elsewhere since the capture
    grads = toy_cache.backward(state.saved, grad_y, {})
    assert backward.graph.replays == replays  # launched, not replayed
    assert torch.equal(grads.weights.gate, expected)


@pytest.mark.parametrize("failing", ["forward", "backward"])
def test_a_refused_capture_warns_and_the_calls_launch(toy_cache, monkeypatch, failing):
    """CUDA refusing a capture (an operation a graph cannot hold). Catches the error reaching the
    caller (a default-on optimization failing a training step), a result lost with the failed
    capture, and a cache that keeps trying at every call."""
    captures = []

    def refusing(run):
        captures.append(run)
        if len(captures) == (1 if failing == "forward" else 2):
            raise RuntimeError("operation not permitted when stream is capturing")
        return fake_capture(run)

    monkeypatch.setattr(graphs, "_capture", refusing)
    inputs = toy_inputs(4)
    grad_y = torch.randn_like(inputs[1])
    expected_y, expected = toy_expected(inputs, grad_y)
    with pytest.warns(RuntimeWarning, match="launch their kernels from now on"):
        for _ in range(4):
            y, grads = toy_call(toy_cache, inputs, grad_y)
            assert torch.equal(y, expected_y) and torch.equal(grads.x, expected.x)
    assert toy_cache.failed and len(captures) == (1 if failing == "forward" else 2)
    assert toy_forward_call(toy_cache, inputs) is None


@pytest.mark.gpu
def test_a_capture_cuda_refuses_leaves_the_stream_and_the_random_generator_as_they_were():
    """A real capture that CUDA refuses (a host synchronization while capturing). Catches the
    failure leaving the capture's side stream current, or PyTorch's CUDA generator mid-capture:
    the layer swallows the failure and goes on, and every later random operation of the process
    would raise ("Offset increment outside graph capture"), far from the cause."""
    before = torch.cuda.current_stream()
    with pytest.raises(RuntimeError):
        graphs._capture(torch.cuda.synchronize)
    assert torch.cuda.current_stream() == before
    torch.manual_seed(0)
    drawn = torch.randn(1000, device="cuda")
    torch.manual_seed(0)
    assert torch.equal(torch.randn(1000, device="cuda"), drawn)


def test_clear_drops_the_captures_but_not_a_waiting_call(toy_cache):
    """Catches `clear` leaving captures (and their memory) behind, or breaking the backward of a
    call in flight when it runs."""
    inputs = toy_inputs(5)
    grad_y = torch.randn_like(inputs[1])
    for _ in range(2):
        toy_call(toy_cache, inputs)
    _, waiting = toy_call(toy_cache, inputs)
    toy_cache.clear()
    assert toy_cache.captured == 0
    grads = toy_cache.backward(waiting.saved, grad_y, {})
    assert torch.equal(grads.x, toy_expected(inputs, grad_y)[1].x)
    assert toy_forward_call(toy_cache, inputs) is None  # seen anew


def test_cache_keeps_at_most_max_forwards_captures(toy_cache):
    """Catches a cache that grows with every token count it sees (each capture keeps memory)."""
    for tokens in range(1, MAX_FORWARDS + 3):
        for _ in range(3):
            toy_call(toy_cache, toy_inputs(tokens, tokens))
    assert toy_cache.captured == MAX_FORWARDS


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fresh_copies_are_bitwise_and_own_their_memory(device):
    """The graph's gradients leave through `_fresh_copies` (a multiplication by one). Catches a
    copy that changes a bit (an added zero turns -0.0 into 0.0; a kernel flushing subnormals),
    one that drops a tensor or mixes their order across dtypes, and one that aliases its source
    (the next replay would overwrite what the caller holds)."""
    special = [-0.0, 0.0, float("inf"), -float("inf"), float("nan"), 1.0, -3.5]
    tensors = []
    for dtype in (torch.bfloat16, torch.float32):
        subnormal = torch.finfo(dtype).smallest_normal / 4
        values = torch.tensor(special + [subnormal, -subnormal], dtype=dtype)
        tensors.append(values.to(device))
        tensors.append(torch.randn(3, 5, dtype=dtype).to(device))
    tensors.append(torch.randn(4, dtype=torch.float16).to(device))
    copies = graphs._fresh_copies(tensors)
    assert len(copies) == len(tensors)
    width = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    for tensor, copy in zip(tensors, copies, strict=True):
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape
        nan = tensor.isnan()  # a NaN stays a NaN; its payload may not (CUDA's is canonical)
        assert torch.equal(copy.isnan(), nan)
        bits = width[tensor.dtype]
        assert torch.equal(copy[~nan].view(bits), tensor[~nan].view(bits))
        assert copy.data_ptr() != tensor.data_ptr()


# ------------------------------------------------------------------------------------------------
# On a GPU
# ------------------------------------------------------------------------------------------------


def call_inputs(config, tokens, seed, device) -> RankInputs:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    idx, w = make_routing("zipf", tokens, config.num_experts, config.top_k, gen)
    grad_y = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    return RankInputs(x.to(device), idx.to(device), w.to(device), grad_y.to(device))


def twin_layers(backend: str, seed: int = 0, recompute: str = "none"):
    """(a layer whose calls replay graphs from their second on, the same layer launching every
    kernel), on the same weights."""
    config = TINY.replace(backend=backend, graphs="on", recompute=recompute)
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
@pytest.mark.parametrize(
    "backend, recompute", [("triton", "none"), ("fused", "none"), ("triton", "gate_up")]
)
def test_replayed_calls_equal_eager_calls_bitwise(backend, recompute):
    """Fresh inputs at every call, each call's results kept and compared again at the end.
    Catches inputs not copied into the graph's (a replay computing on the first call's), an
    output or gradient handed out without a copy (the next replay overwrites a result the caller
    holds), gradients of the wrong capture, and a cache that never replays; with
    `recompute="gate_up"`, a backward graph that does not make the activations again from the
    captured forward's rows."""
    graphed, eager = twin_layers(backend, recompute=recompute)
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
