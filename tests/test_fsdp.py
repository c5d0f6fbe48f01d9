"""`mok.MoE` inside a data x expert parallel mesh with FSDP2 (`fully_shard`): the expert group taken
from the mesh's "ep" dimension, the routed experts sharded by FSDP2 over the "dp" dimension, every
other parameter (projection, router, a dense shared expert of the block's own) by FSDP2 over all
ranks. The gradients must be those of one process running the whole batch with all experts, scaled
as FSDP2 averages them: by the ranks of each parameter's mesh.

Bugs these catch: an expert group that is not the mesh's "ep" dimension (experts fed the wrong
rows), the module's parameters swapped by FSDP2 for its unsharded ones but the layer still reading
the sharded ones (or the reverse), gradients written into a buffer FSDP2 does not reduce (fused
accumulation into a stale `.grad`), a rank's tokens missing from an expert's gradient.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mok
from mok.errors import MoKInputError
from mok.ranks import run_ranks
from mok.testing import global_weights, relative_error

CONFIG = mok.MoKConfig(
    hidden_size=32,
    intermediate_size=16,
    num_experts=4,
    top_k=2,
    max_tokens_per_rank=64,
)
SHARED = 24
# bf16 gradients (FSDP2 reduces in the parameters' dtype): a few 2^-9 roundings per element, in
# another summation order than the one-process run. A rank's tokens missing from a gradient, or a
# gradient averaged over the wrong ranks, is off by 25 % or more.
TOLERANCE = 2e-2


class Block(nn.Module):
    """x + MoE(h) + SharedExpert(h), h = proj(x), with a softmax-over-top-k router."""

    def __init__(self, config: mok.MoKConfig, group=None, device=None):
        super().__init__()
        hidden, dtype = config.hidden_size, torch.bfloat16
        self.proj = nn.Linear(hidden, hidden, device=device, dtype=dtype)
        self.router = nn.Linear(hidden, config.num_experts, device=device, dtype=dtype)
        self.shared_up = nn.Linear(hidden, SHARED, bias=False, device=device, dtype=dtype)
        self.shared_down = nn.Linear(SHARED, hidden, bias=False, device=device, dtype=dtype)
        # Last: its random initialization draws as many values as the rank has experts.
        self.moe = mok.MoE(config, group=group, device=device)
        self.top_k = config.top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        values, idx = self.router(h).float().topk(self.top_k, dim=-1)
        shared = self.shared_down(nn.functional.silu(self.shared_up(h)))
        return x + self.moe(h, idx, values.softmax(-1)) + shared


def build_block(config, group, device) -> Block:
    """The same parameters on every rank and in the one-process run (experts: this rank's)."""
    torch.manual_seed(0)
    block = Block(config, group=group, device=device)
    block.moe.load_global_weights(global_weights(config, 1, device))
    return block


def rank_batch(rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = 20 + 7 * rank
    x = torch.randn(tokens, CONFIG.hidden_size, generator=generator).bfloat16()
    grad_y = torch.randn(tokens, CONFIG.hidden_size, generator=generator).bfloat16()
    return x.to(device), grad_y.to(device)


class Checkpointed(nn.Module):
    """`block` under non-reentrant activation checkpointing."""

    def __init__(self, block: Block):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


TRACED_LAYER_OPS: list = []


def recording_aot_eager(graph_module, example_inputs):
    """aot_eager, noting the layer's custom ops in what Dynamo traced (checkpointed bodies
    included): a graph break around the layer would run it eagerly and prove nothing here."""
    from torch._dynamo.backends.debugging import aot_eager

    TRACED_LAYER_OPS.extend(
        node
        for module in graph_module.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.target is torch.ops.mok.moe_forward.default
    )
    return aot_eager(graph_module, example_inputs)


def sharded_run(
    rank: int, world: int, dp: int, ep: int, device_type: str, compiled: bool = False
) -> dict:
    """One forward+backward of the FSDP2-sharded block on this rank's batch: y and the full
    gradients (the routed experts': of this rank's experts). `compiled`: the sharded block
    torch.compile'd (aot_eager, FSDP2's hooks left to run eagerly, the layer as its custom ops,
    which need the triton backend) under activation checkpointing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    config = CONFIG.replace(backend="triton") if compiled else CONFIG
    mesh = init_device_mesh(device_type, (dp, ep), mesh_dim_names=("dp", "ep"))
    everyone = init_device_mesh(device_type, (world,), mesh_dim_names=("all",))
    with pytest.raises(MoKInputError, match="one dimension"):
        mok.MoE(config, group=mesh, device=device)  # the whole mesh: which dimension is EP?
    block = build_block(config, mesh["ep"], device)
    assert block.moe.ep_size == ep and block.moe.rank == mesh["ep"].get_local_rank()
    fully_shard(block.moe, mesh=mesh["dp"])
    fully_shard(block, mesh=everyone)
    run = block
    if compiled:
        block.moe.workspace(device)  # collective: made before tracing, as the ops require
        run = Checkpointed(torch.compile(block, backend=recording_aot_eager))
    x, grad_y = rank_batch(rank, device)
    x.requires_grad_(True)
    y = run(x)
    y.backward(grad_y)
    results = {"y": y.detach().cpu(), "x": x.grad.cpu(), "traced layer ops": len(TRACED_LAYER_OPS)}
    for name, param in block.named_parameters():
        results[name] = param.grad.full_tensor().cpu()
    return results


def one_process_gradients(world: int) -> tuple[list[torch.Tensor], dict]:
    """y per rank and the gradients of the whole batch, one process, all experts."""
    block = build_block(CONFIG, None, "cpu")
    batches = [rank_batch(rank, "cpu") for rank in range(world)]
    x = torch.cat([b[0] for b in batches]).requires_grad_(True)
    y = block(x)
    y.backward(torch.cat([b[1] for b in batches]))
    sizes = [b[0].shape[0] for b in batches]
    grads = {name: param.grad for name, param in block.named_parameters()}
    grads["x"] = x.grad
    return list(y.detach().split(sizes)), grads, sizes


def _check(results, dp, ep):
    world = dp * ep
    ys, grads, sizes = one_process_gradients(world)
    x_grads = grads.pop("x").split(sizes)
    local = CONFIG.num_experts // ep
    for rank, mine in enumerate(results):
        ep_rank = rank % ep
        assert relative_error(mine["y"], ys[rank]) < TOLERANCE, rank
        assert relative_error(mine["x"], x_grads[rank]) < TOLERANCE, rank
        for name, expected in grads.items():
            if name.startswith("moe."):
                # This rank's experts, averaged over the data-parallel replicas.
                expected = expected[ep_rank * local : (ep_rank + 1) * local] / dp
            else:
                expected = expected / world
            assert relative_error(mine[name], expected) < TOLERANCE, (rank, name)


def test_fsdp2_over_data_and_expert_parallel_mesh_on_gloo():
    """EP 2 x DP 2: four CPU ranks on gloo."""
    if torch.cuda.is_available():
        pytest.skip("the CPU test; on GPUs the NCCL test runs")
    results = run_ranks(sharded_run, 4, args=(2, 2, "cpu"), backend="gloo", timeout_s=600)
    _check(results, dp=2, ep=2)


def test_fsdp2_with_checkpointing_and_compile_on_gloo():
    """The stack of a real training run around the block: FSDP2 over the mesh, torch.compile,
    activation checkpointing; EP 2 x DP 2 on gloo, the triton backend (its kernels under the
    interpreter, its custom ops in the compiled graphs): the same gradients. Catches the compiled
    layer reading FSDP2's sharded parameters instead of the gathered ones, its gradients
    bypassing FSDP2's reduction, the recomputation under FSDP2 running the exchange out of step,
    and (the ops counted in what Dynamo traced) a graph break that leaves the layer eager."""
    if torch.cuda.is_available():
        pytest.skip("the CPU test")
    results = run_ranks(sharded_run, 4, args=(2, 2, "cpu", True), backend="gloo", timeout_s=600)
    assert all(result["traced layer ops"] >= 1 for result in results)
    _check(results, dp=2, ep=2)


def _mxfp8_data_parallel_run(rank: int, world: int, weight_casts: str) -> dict:
    """One forward+backward of the block in MXFP8 (triton backend) with its experts under FSDP2
    over `world` data-parallel ranks (EP 1): the full gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config = CONFIG.replace(
        precision="mxfp8",
        backend="triton",
        hidden_size=64,
        intermediate_size=32,
        mx_weight_casts=weight_casts,
    )
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "ep"))
    block = build_block(config, mesh["ep"], "cpu")
    fully_shard(block.moe, mesh=mesh["dp"])  # re-gathered for backward, freed after forward
    fully_shard(block, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("all",)))
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(20, config.hidden_size, generator=generator).bfloat16().requires_grad_(True)
    y = block(x)
    y.backward(torch.randn(y.shape, generator=generator).bfloat16())
    return {name: param.grad.full_tensor() for name, param in block.named_parameters()}


@pytest.mark.interpreter
def test_mxfp8_weights_cast_per_pass_under_fsdp2():
    """FSDP2 frees the experts' gathered weights after forward and gathers them again for
    backward, where MXFP8's default casts them per pass: the backward must not take the gather
    for a change in place (its check of the weights' versions raising would stop every MXFP8
    run under FSDP2), and its gradients are those of the casts kept from forward, bit for bit."""
    per_pass = run_ranks(_mxfp8_data_parallel_run, 2, args=("per_pass",), backend="gloo")
    kept = run_ranks(_mxfp8_data_parallel_run, 2, args=("keep",), backend="gloo")
    for ours, theirs in zip(per_pass, kept, strict=True):
        assert ours.keys() == theirs.keys()
        for name, grad in ours.items():
            assert torch.equal(grad, theirs[name]), name


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp2_over_an_expert_parallel_mesh_on_two_gpus():
    """EP 2 x DP 1 on two GPUs (NCCL, the triton backend and its NVLink exchange)."""
    results = run_ranks(sharded_run, 2, args=(1, 2, "cuda"), backend="nccl", timeout_s=600)
    _check([{k: v.float() for k, v in r.items() if torch.is_tensor(v)} for r in results], 1, 2)
