"""`torch.compile(fullgraph=True)` of a transformer-style block holding `mok.MoE`: the layer enters
the graph as the custom ops of `mok.ops` (no graph break) and gives eager's results.

The triton backend runs its kernels under the Triton interpreter on the CPU and compiled on GPUs.
Bugs these catch: a graph break (fullgraph raises), fake implementations whose shapes or dtypes
differ from the real outputs (the compiled graph fails or mis-sizes buffers), gradients returned to
the wrong inputs (weights swapped, a missing shared expert), a forward's saved state handed to the
wrong backward (two micro-batches in flight), state left behind in the ops' table.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_checkpointing import CONFIG, Block, in_mxfp8
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import mok
from mok import ops
from mok.testing import global_weights, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = CONFIG.replace(backend="triton")


def run_block(
    compiler: str | None, fuse: bool, micro_batches: int = 2, wrap=None, config=TRITON
) -> dict:
    """y, grad x of each micro-batch (forwards first, then backwards, so two saved states are in
    flight) and every parameter's accumulated gradient; `wrap(block)`: the module run instead."""
    torch.manual_seed(0)
    block = Block(config, device=DEVICE)
    block.moe.fuse_grad_accumulation = fuse
    block.moe.load_global_weights(global_weights(config, 1, DEVICE))
    block.moe.workspace(torch.device(DEVICE))
    if wrap is not None:
        block = wrap(block)
    run = block if compiler is None else torch.compile(block, fullgraph=True, backend=compiler)
    generator = torch.Generator().manual_seed(3)
    inputs, outputs = [], []
    for step in range(micro_batches):
        x = torch.randn(24 + 5 * step, 32, generator=generator).bfloat16().to(DEVICE)
        inputs.append(x.requires_grad_(True))
        outputs.append(run(x))
    results = {}
    for step, (x, y) in enumerate(zip(inputs, outputs, strict=True)):
        y.backward(torch.randn(y.shape, generator=generator).bfloat16().to(DEVICE))
        results[f"y{step}"] = y.detach()
        results[f"x{step}"] = x.grad
    for name, param in block.named_parameters():
        results[name] = param.grad
    return results


@pytest.mark.parametrize(
    "precision",
    ["bf16", "mxfp8", "bf16-recompute", "bf16-router-epilogue", "bf16-reference"],
)
def test_compiled_block_equals_eager_bitwise(precision):
    """aot_eager keeps every operation of eager: only the layer's own path differs (the custom
    ops), so results must be equal bit for bit. Eager without fused accumulation, since the
    compiled layer hands its weight gradients to autograd (summed in bf16, as eager then does).
    mxfp8 (sizes multiples of 32; the weights cast per pass, the backward checking they did not
    change in place): caught besides, an MX saved state handed to the wrong backward, or the
    compiled backward casting other weights than its forward read. bf16-recompute
    (`MoKTuning.recompute`): a saved state without activations through the ops, replayed in
    the compiled backward. bf16-router-epilogue (`MoKConfig.router_gradient`): a saved state
    without pair outputs. bf16-reference: the reference backend inside the custom ops, whose
    autograd graph is recorded off the op's thread (there autograd would record nothing, and
    backward would find no graph)."""
    config = in_mxfp8(TRITON) if precision == "mxfp8" else TRITON
    if precision == "bf16-recompute":
        config = TRITON.replace(recompute="gate_up")
    if precision == "bf16-router-epilogue":
        config = TRITON.replace(router_gradient="epilogue")
    if precision == "bf16-reference":
        config = TRITON.replace(backend="reference")
    torch._dynamo.reset()
    eager = run_block(None, fuse=False, config=config)
    compiled = run_block("aot_eager", fuse=False, config=config)
    for name, value in eager.items():
        assert torch.equal(compiled[name], value), name
    assert not ops._saved  # every forward's state was used by its backward and dropped


@pytest.mark.slow
def test_block_compiled_by_inductor_matches_eager():
    """Inductor fuses and reorders the block's other bf16 operations: eager's results to bf16
    rounding (a swapped or lost gradient would be O(1))."""
    torch._dynamo.reset()
    eager = run_block(None, fuse=True)
    compiled = run_block("inductor", fuse=True)
    for name, value in eager.items():
        assert relative_error(compiled[name], value) < 2e-2, name


def test_compile_before_the_workspace_exists_says_what_to_do():
    torch._dynamo.reset()
    layer = mok.MoE(TRITON, device=DEVICE)
    x = torch.randn(4, 32, dtype=torch.bfloat16, device=DEVICE)
    idx = torch.zeros(4, 2, dtype=torch.long, device=DEVICE)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="workspace made first"):
        compiled(x, idx, torch.ones(4, 2, device=DEVICE))
    layer.workspace(torch.device(DEVICE))
    assert compiled(x, idx, torch.ones(4, 2, device=DEVICE)).shape == x.shape


def compiled_block(**options):
    """(a fresh seeded block with its workspace made, torch.compile of it with `options`)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block(TRITON, device=DEVICE)
    block.moe.load_global_weights(global_weights(TRITON, 1, DEVICE))
    block.moe.workspace(torch.device(DEVICE))
    return block, torch.compile(block, fullgraph=True, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_training_step_replays_in_a_cuda_graph(compiler):
    """A whole training step of the compiled block (forward, backward into the parameters'
    `.grad`) captured in one CUDA graph: each replay on new inputs gives bit for bit what the
    compiled step gives run directly. Catches a host-side value the capture bakes in (a token
    count, a cached cast, the ops' table entry looked up at replay instead of at capture), a
    kernel that allocates or synchronizes during capture, state of one replay read by the next."""
    from mok.testing import capture_in_graph

    block, compiled = compiled_block(backend=compiler)
    x = torch.zeros(40, 32, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    grad_y = torch.zeros(40, 32, dtype=torch.bfloat16, device=DEVICE)
    for param in block.parameters():
        param.grad = torch.zeros_like(param)

    def step():
        for tensor in (x, *block.parameters()):
            tensor.grad = None if tensor is x else tensor.grad.zero_()
        y = compiled(x)
        y.backward(grad_y)
        return y

    def results(y):
        grads = {name: p.grad.clone() for name, p in block.named_parameters()}
        return {"y": y.detach().clone(), "grad x": x.grad.clone(), **grads}

    generator = torch.Generator(device=DEVICE).manual_seed(5)
    with torch.no_grad():
        x.normal_(generator=generator)
        grad_y.normal_(generator=generator)
    graph, y_static = capture_in_graph(step)
    x_grad_static = x.grad
    for _ in range(3):
        with torch.no_grad():
            x.copy_(torch.randn(x.shape, generator=generator, device=DEVICE))
            grad_y.copy_(torch.randn(grad_y.shape, generator=generator, device=DEVICE))
        graph.replay()
        x.grad = x_grad_static
        replayed = results(y_static)
        direct = results(step())
        for name, value in direct.items():
            assert torch.equal(replayed[name], value), name
    block.moe.workspace(torch.device(DEVICE)).check()
    assert not ops._saved


@pytest.mark.gpu
def test_reduce_overhead_steps_match_the_block_compiled_without_graphs():
    """`torch.compile(mode="reduce-overhead")`: CUDA-graph trees replay the block's other
    operations, the layer's ops run between the graphs (they are tagged cudagraph_unsafe). Over
    steps on new inputs the results must be those of the same block compiled without graphs.
    Catches the layer's ops recorded into a graph (a replay would not run the host code that
    keeps the forward's state for backward, and the trees would hand that state's memory to the
    next graph: gradients from overwritten activations, O(1) off, or the trees' error on reading
    an overwritten output), and the layer's own graphs not replayed inside the compiled ops;
    bf16 tolerance only for Inductor's own choices between the modes."""
    assert torch._C.Tag.cudagraph_unsafe in torch.ops.mok.moe_forward.default.tags

    def steps(mode: str) -> list[dict]:
        block, compiled = compiled_block(mode=mode)
        generator = torch.Generator(device=DEVICE).manual_seed(7)
        results = []
        for _ in range(5):  # warm-up, recording, then replays
            torch.compiler.cudagraph_mark_step_begin()
            x = torch.randn(40, 32, generator=generator, device=DEVICE).bfloat16()
            x.requires_grad_(True)
            y = compiled(x)
            y.backward(torch.randn(40, 32, generator=generator, device=DEVICE).bfloat16())
            grads = {name: p.grad.clone() for name, p in block.named_parameters()}
            results.append({"y": y.detach().clone(), "grad x": x.grad.clone(), **grads})
            block.zero_grad(set_to_none=True)
        replays.append(block.moe.workspace(torch.device(DEVICE)).graphs.replays)
        return results

    replays = []
    graphed, plain = steps("reduce-overhead"), steps("default")
    for step, (got, want) in enumerate(zip(graphed, plain, strict=True)):
        for name, value in want.items():
            assert relative_error(got[name], value) < 2e-2, (step, name)
    assert not ops._saved
    # Between Inductor's graphs the small layer's ops replay the layer's own (MoKTuning.graphs
    # auto): the first call of the token count runs eagerly, the next ones replay.
    assert all(count >= 3 for count in replays), replays


def _recompute_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _save_the_layer(ctx, op, *args, **kwargs):
    """Selective checkpointing as MoE models use it: the expensive layer's outputs kept, the
    cheap operations around it recomputed."""
    if op is torch.ops.mok.moe_forward.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedBlock(torch.nn.Module):
    """`Block` under non-reentrant activation checkpointing, with a selective policy or not."""

    def __init__(self, block: Block, policy):
        super().__init__()
        self.block, self.policy = block, policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.policy is None:
            return checkpoint(self.block, x, use_reentrant=False)
        contexts = functools.partial(create_selective_checkpoint_contexts, self.policy)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=contexts)


@pytest.mark.parametrize(
    ("policy", "forwards_per_step"),
    [(None, 2), (_recompute_everything, 2), (_save_the_layer, 1)],
    ids=["full", "selective-recompute-all", "selective-save-moe"],
)
def test_compiled_checkpointed_block_equals_the_plain_block_bitwise(
    policy, forwards_per_step, monkeypatch
):
    """torch.compile(fullgraph=True) of a checkpointed block, whole or selective (a user-reported
    failure around other MoE dispatchers): the gradients of the plain eager block bit for bit
    (aot_eager keeps eager's operations). Catches the layer's op recomputed in backward with a
    new forward state while backward reads the first one's (or the reverse), the forward's state
    dropped when the policy saves the op's outputs, two forwards' states left in the table, a
    compiled graph that drops the checkpoint (the layer would run once a step)."""
    eager = run_block(None, fuse=False)
    torch._dynamo.reset()
    forwards = []
    layer_forward = ops.functional.schedule_and_forward

    def counted(*args, **kwargs):
        forwards.append(1)
        return layer_forward(*args, **kwargs)

    monkeypatch.setattr(ops.functional, "schedule_and_forward", counted)
    checkpointed = run_block(
        "aot_eager", fuse=False, wrap=lambda block: CheckpointedBlock(block, policy)
    )
    # The policy took effect: the layer ran again in backward unless its outputs were saved.
    assert len(forwards) == forwards_per_step * 2
    checkpointed = {name.removeprefix("block."): value for name, value in checkpointed.items()}
    assert checkpointed.keys() == eager.keys()
    for name, value in eager.items():
        assert torch.equal(checkpointed[name], value), name
    assert not ops._saved
