"""Gradient accumulation fused into the layer's backward: once a weight has a `.grad` (or an fp32
`main_grad`), backward adds into it in place instead of handing autograd a gradient to add in a
separate pass. Checked through `mok.MoE` on the reference backend (CPU), the triton backend under
the interpreter (CPU) and compiled (GPU)."""

from __future__ import annotations

import pytest
import torch

import mok
from mok.routing import make_routing
from mok.testing import global_weights, relative_error
from mok.weights import MoEWeights, gate_up_halves

CONFIG = mok.MoKConfig(
    hidden_size=32,
    intermediate_size=16,
    num_experts=4,
    top_k=2,
    shared_intermediate_size=16,
    max_tokens_per_rank=64,
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def micro_batch(seed: int, device, tokens: int = 24):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, CONFIG.hidden_size, generator=generator).to(device, torch.bfloat16)
    idx, w = make_routing("uniform", tokens, CONFIG.num_experts, CONFIG.top_k, generator)
    grad_y = torch.randn(tokens, CONFIG.hidden_size, generator=generator).to(device, torch.bfloat16)
    return x.requires_grad_(True), idx.to(device), w.to(device), grad_y


def layer_of(backend: str, device, fuse: bool = True, precision: str = "bf16") -> mok.MoE:
    config = CONFIG.replace(backend=backend, precision=precision)
    layer = mok.MoE(config, device=device, fuse_grad_accumulation=fuse)
    layer.load_global_weights(global_weights(CONFIG, 0, device))
    return layer


def step(layer, seed, device):
    x, idx, w, grad_y = micro_batch(seed, device)
    layer(x, idx, w).backward(grad_y)


def fresh_fp32_gradients(layer, seed, device) -> dict[str, torch.Tensor]:
    """The fp32 weight gradients of one micro-batch (functional API, zero fp32 buffers)."""
    x, idx, w, grad_y = micro_batch(seed, device)
    ws = layer.workspace(device)
    schedule, _, saved = mok.schedule_and_forward(ws, idx, x.detach(), w, layer.weights)
    buffers = {
        name: torch.zeros_like(param, dtype=torch.float32)
        for name, param in layer.named_parameters(recurse=False)
    }
    mok.backward(ws, schedule, saved, grad_y, accumulate_into=buffers)
    return buffers


def watch_autograd(layer) -> dict[str, list]:
    """Per weight and backward: whether autograd received a gradient to accumulate (a tensor hook
    sees it, or None when the layer handed it none), and the .grad a post-accumulate-grad hook
    sees (the hooks of DDP-like wrappers read it there)."""
    seen = {name: [] for name, _ in layer.named_parameters(recurse=False)}
    for name, param in layer.named_parameters(recurse=False):
        param.register_hook(lambda grad, name=name: seen[name].append(grad is not None) or None)
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: seen[name].append(p.grad.clone())
        )
    return seen


def check_main_grad_accumulates_in_place(backend: str, device, precision: str = "bf16") -> None:
    layer = layer_of(backend, device, precision=precision)
    main = {}
    for name, param in layer.named_parameters(recurse=False):
        param.main_grad = main[name] = torch.zeros_like(param, dtype=torch.float32)
    pointers = {name: buffer.data_ptr() for name, buffer in main.items()}
    plain = layer_of(backend, device, fuse=False, precision=precision)
    for seed in (1, 2):
        step(layer, seed, device)
        step(plain, seed, device)
    first, second = fresh_fp32_gradients(layer, 1, device), fresh_fp32_gradients(layer, 2, device)
    for (name, param), (_, autograd) in zip(
        layer.named_parameters(recurse=False), plain.named_parameters(recurse=False), strict=True
    ):
        assert param.grad is None, name  # main_grad took the gradient instead
        assert param.main_grad.data_ptr() == pointers[name]
        assert torch.equal(param.main_grad, first[name] + second[name]), name
        # Against autograd's own accumulation (bf16 .grad): the same sum to bf16 rounding.
        assert relative_error(param.main_grad, autograd.grad) < 1e-2, name


def test_main_grad_takes_the_sum_of_the_micro_batches_bitwise_reference():
    """Catches: a gradient written over main_grad instead of added, one handed to autograd too
    (the parameter's .grad would be set), a new buffer instead of the same one."""
    check_main_grad_accumulates_in_place("reference", torch.device("cpu"))


@pytest.mark.interpreter
@pytest.mark.parametrize("precision", ["bf16", "fp8_block"])
def test_main_grad_takes_the_sum_of_the_micro_batches_bitwise_triton_cpu(precision):
    """The triton backend's kernels add into the buffer (fp8_block: its backward adds each
    gradient after forming it): the same checks, under the interpreter."""
    check_main_grad_accumulates_in_place("triton", torch.device("cpu"), precision)


@pytest.mark.gpu
def test_main_grad_takes_the_sum_of_the_micro_batches_bitwise_triton_gpu():
    """The compiled weight-gradient kernels add into the fp32 buffers: bitwise the fp32 sum."""
    check_main_grad_accumulates_in_place("triton", torch.device("cuda"))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_existing_grad_is_added_into_without_autograd(backend):
    """Second micro-batch: .grad is the same tensor, holds (to bf16 rounding) what autograd's own
    accumulation gives, autograd received no gradient to add for the weights, and their
    post-accumulate-grad hooks still ran and saw the summed .grad. Catches: accumulation not fused
    (autograd adds: the extra pass), gradients overwritten or counted twice, hooks that see the
    gradient before the layer added it."""
    if backend == "triton" and DEVICE.type == "cpu" and not _interpreting():
        pytest.skip("the triton backend needs a GPU or the interpreter")
    fused, plain = layer_of(backend, DEVICE), layer_of(backend, DEVICE, fuse=False)
    seen = {"fused": watch_autograd(fused), "plain": watch_autograd(plain)}
    for layer in (fused, plain):
        step(layer, 1, DEVICE)
    pointers = {name: p.grad.data_ptr() for name, p in fused.named_parameters(recurse=False)}
    for layer in (fused, plain):
        step(layer, 2, DEVICE)
    for (name, got), (_, want) in zip(
        fused.named_parameters(recurse=False), plain.named_parameters(recurse=False), strict=True
    ):
        received, hooked = seen["fused"][name][0::2], seen["fused"][name][1::2]
        assert received == [True, False], name  # autograd got nothing to add the second time
        assert seen["plain"][name][0::2] == [True, True], name
        assert torch.equal(hooked[-1], got.grad), name
        assert got.grad.data_ptr() == pointers[name]
        # One rounding of the fp32 sum against two: bf16 rounding level apart (the interpreter
        # truncates its bf16 stores toward zero: up to one bf16 step); a lost or doubled
        # micro-batch is O(1).
        tolerance = 1e-2 if _interpreting() else 4e-3
        assert relative_error(got.grad, want.grad) < tolerance, name


def joined_step(layer: mok.MoE, gate_up, others: dict, seed: int, fuse: bool) -> None:
    """One micro-batch of `layer`'s workspace through `mok.moe(gate_up=...)`: gate and up the
    halves of the [E, 2I, H] parameter gate_up (the layout of transformers' `gate_up_proj`),
    the other weights the parameters `others`."""
    x, idx, w, grad_y = micro_batch(seed, DEVICE)
    gate, up = gate_up_halves(gate_up)
    weights = MoEWeights(gate=gate, up=up, **others)
    mok.moe(x, idx, w, weights, layer.workspace(DEVICE), fuse, gate_up=gate_up).backward(grad_y)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gate_up_taken_whole_has_its_gradient_added_into_its_halves(backend):
    """gate and up as the halves of one parameter (transformers' `gate_up_proj`): the second
    micro-batch's gradients go into the halves of gate_up's .grad in place, autograd receives
    none for it, and the sum is autograd's own to bf16 rounding; an fp32 main_grad of gate_up
    holds the fp32 sums bitwise, gate's in its first half. Catches the halves swapped or both
    added into one, the joined gradient also handed to autograd (added twice), a fresh tensor in
    place of .grad."""
    if backend == "triton" and DEVICE.type == "cpu" and not _interpreting():
        pytest.skip("the triton backend needs a GPU or the interpreter")
    layer = layer_of(backend, DEVICE)
    initial = {name: p.detach() for name, p in layer.named_parameters(recurse=False)}

    def parameters():
        gate_up = torch.nn.Parameter(torch.cat((initial["gate"], initial["up"]), dim=1))
        others = {n: torch.nn.Parameter(p.clone()) for n, p in initial.items() if n[:4] != "gate"}
        others.pop("up")
        return gate_up, others

    (fused, fused_others), (plain, plain_others) = parameters(), parameters()
    received = []
    fused.register_hook(lambda grad: received.append(grad is not None) or None)
    for seed in (1, 2):
        joined_step(layer, fused, fused_others, seed, fuse=True)
        if seed == 1:
            pointer = fused.grad.data_ptr()
        joined_step(layer, plain, plain_others, seed, fuse=False)
    assert received == [True, False]
    assert fused.grad.data_ptr() == pointer
    tolerance = 1e-2 if _interpreting() else 4e-3
    assert relative_error(fused.grad, plain.grad) < tolerance
    for name, param in fused_others.items():
        assert relative_error(param.grad, plain_others[name].grad) < tolerance, name

    main, _ = parameters()
    main.main_grad = torch.zeros_like(main, dtype=torch.float32)
    for seed in (1, 2):
        joined_step(layer, main, {n: p.detach() for n, p in plain_others.items()}, seed, True)
    first, second = fresh_fp32_gradients(layer, 1, DEVICE), fresh_fp32_gradients(layer, 2, DEVICE)
    assert main.grad is None
    expected = torch.cat((first["gate"] + second["gate"], first["up"] + second["up"]), dim=1)
    assert torch.equal(main.main_grad, expected)


def _interpreting() -> bool:
    from mok.kernels._triton_compat import interpreting

    return interpreting()


@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=[x])"])
def test_gradients_not_asked_for_leave_grad_alone(how):
    """Catches the fused path adding into .grad when the caller did not ask for the weights'
    gradients (torch.autograd.grad, backward(inputs=...)): autograd never touches .grad then."""
    layer = layer_of("reference", torch.device("cpu"))
    step(layer, 1, torch.device("cpu"))
    before = {name: p.grad.clone() for name, p in layer.named_parameters(recurse=False)}
    x, idx, w, grad_y = micro_batch(2, torch.device("cpu"))
    y = layer(x, idx, w)
    if how == "autograd.grad":
        (grad_x,) = torch.autograd.grad(y, [x], grad_y)
        assert grad_x is not None
    else:
        y.backward(grad_y, inputs=[x])
    for name, param in layer.named_parameters(recurse=False):
        assert torch.equal(param.grad, before[name]), name


def test_accumulation_buffers_are_checked():
    """A buffer of the wrong shape or dtype, or for a weight the layer lacks, raises a clear error
    before any kernel writes into it."""
    layer = layer_of("reference", torch.device("cpu"))
    x, idx, w, grad_y = micro_batch(1, torch.device("cpu"))
    ws = layer.workspace(torch.device("cpu"))
    schedule, _, saved = mok.schedule_and_forward(ws, idx, x.detach(), w, layer.weights)
    bad = [
        ({"gate": torch.zeros(3, 3)}, "accumulate_into\\['gate'\\] or main_grad\\) has shape"),
        ({"up": torch.zeros_like(layer.up, dtype=torch.float16)}, "dtype float16"),
        ({"bias": torch.zeros(3)}, "not a weight of this layer"),
        ({"down": torch.zeros(16, 32, 4).transpose(0, 2)}, "contiguous"),
        # Rows 64 elements apart: the kernels would write each row's second half into the next.
        ({"gate": torch.zeros(4, 16, 64)[:, :, :32]}, "each expert's rows contiguous"),
    ]
    for buffers, message in bad:
        with pytest.raises(mok.MoKInputError, match=message):
            mok.backward(ws, schedule, saved, grad_y, accumulate_into=buffers)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: torch.zeros_like(p, dtype=torch.float16), "weights.up .*dtype float16"),
        (lambda p: torch.zeros(3, 3), "weights.up .*has shape"),
        (lambda p: torch.zeros(p.shape[::-1]).transpose(0, 2), "weights.up .*contiguous"),
    ],
)
def test_an_unusable_main_grad_raises(make, message):
    """Catches the backward quietly handing the gradient to autograd (.grad) when main_grad is
    set but cannot take it: the training loop would step on a main_grad that never changed."""
    layer = layer_of("reference", torch.device("cpu"))
    layer.up.main_grad = make(layer.up)
    x, idx, w, grad_y = micro_batch(1, torch.device("cpu"))
    with pytest.raises(mok.MoKInputError, match=message):
        layer(x, idx, w).backward(grad_y)
    assert layer.up.grad is None


def _ddp_gradients(rank: int, world: int, backend: str) -> dict[str, torch.Tensor]:
    """Rank worker: the layer (all experts on every rank) under DistributedDataParallel, two
    micro-batches of this rank's, the first under `no_sync()` as gradient accumulation runs."""
    from torch.nn.parallel import DistributedDataParallel

    layer = DistributedDataParallel(layer_of(backend, torch.device("cpu")))
    for micro in range(2):
        x, idx, w, grad_y = micro_batch(10 * rank + micro, torch.device("cpu"))
        if micro == 0:
            with layer.no_sync():
                layer(x, idx, w).backward(grad_y)
        else:
            layer(x, idx, w).backward(grad_y)
    return {name: param.grad for name, param in layer.module.named_parameters()}


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_ddp_with_accumulation_averages_the_fused_gradients(backend):
    """DDP over 2 gloo ranks with gradient accumulation: after the synchronizing micro-batch every
    rank holds the same gradients, the mean over the ranks of all four micro-batches' sums (to
    bf16 rounding). Catches the fused accumulation (the second micro-batch's gradient added by
    the layer, none handed to autograd) bypassing DDP's reducer: the ranks would keep their own
    sums, or DDP would wait for gradients that never come."""
    from mok.ranks import run_ranks

    if backend == "triton" and DEVICE.type == "cpu" and not _interpreting():
        pytest.skip("the triton backend needs a GPU or the interpreter")
    if DEVICE.type == "cuda":
        pytest.skip("a CPU test (gloo)")
    ranks = run_ranks(_ddp_gradients, 2, args=(backend,))
    one_process = layer_of(backend, torch.device("cpu"), fuse=False)
    for rank in range(2):
        for micro in range(2):
            step(one_process, 10 * rank + micro, torch.device("cpu"))
    for name, param in one_process.named_parameters():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert relative_error(ranks[0][name], param.grad.float() / 2) < 2e-2, name
