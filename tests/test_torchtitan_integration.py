"""`mok.integrations.torchtitan`: TorchTitan's MoE with its RoutedExperts running through MoK, on a
small layer built from TorchTitan's configs. Against a float64 copy, the MoK layer's output and
gradients must be as close as the native bf16 layer's (bf16 rounding), and the parameter names
stay TorchTitan's. Bugs these catch: w1 and w3 (gate and up) swapped, scores applied to the wrong
(token, slot), ids and scores transposed, gradients not reaching the experts' parameters."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import (  # noqa: E402
    GroupedExperts,
    MoE,
    RoutedExperts,
    TokenChoiceTopKRouter,
)
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

from mok.integrations import torchtitan as mok_torchtitan  # noqa: E402
from mok.testing import relative_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def layer_config(dispatcher=LocalTokenDispatcher) -> MoE.Config:
    """TorchTitan's MoE config of the tests' layer: 8 experts (dim 64, hidden 32), top 2."""
    return MoE.Config(
        num_experts=8,
        load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=64, hidden_dim=32, num_experts=8),
            token_dispatcher=dispatcher.Config(num_experts=8, top_k=2),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=8,
            top_k=2,
            gate=Linear.Config(in_features=64, out_features=8, bias=False),
            score_func="softmax",
        ),
    )


def build_layer(config: MoE.Config | None = None) -> torch.nn.Module:
    """The layer of `config` (default `layer_config()`) with seeded weights of std 0.2."""
    torch.manual_seed(0)
    layer = (config or layer_config()).build()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.2)
    return layer.to(DEVICE)


def results(layer, x, grad):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.backward(grad)
    grads = {name: p.grad.double() for name, p in layer.named_parameters()}
    return {"y": y.detach().double(), "grad x": x.grad.double(), **grads}


def bf16_inputs_and_float64_results(base):
    """(x, grad) of the tests' call in bf16, and `base`'s results in float64 on them."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 64, generator=generator).to(DEVICE)
    grad = torch.randn(3, 7, 64, generator=generator).to(DEVICE)
    exact = results(copy.deepcopy(base).double(), x.double(), grad.double())
    return x.bfloat16(), grad.bfloat16(), exact


def test_routed_experts_through_mok_match_float64_to_bf16_rounding():
    base = build_layer()
    native = copy.deepcopy(base).bfloat16()
    ours = copy.deepcopy(base).bfloat16()
    assert mok_torchtitan.use_mok(ours) == 1
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in base.named_parameters()]
    x, grad, exact = bf16_inputs_and_float64_results(base)
    theirs = results(native, x, grad)
    mine = results(ours, x, grad)
    assert mine["routed_experts.inner_experts.w1_EFD"].abs().sum() > 0
    for name, want in exact.items():
        # bf16 roundings of h and of the outputs: ~5e-3; a swapped gate/up or score is O(1).
        error = relative_error(mine[name], want)
        assert error < 1.5e-2, (name, error)
        assert error <= 2 * relative_error(theirs[name], want) + 5e-3, name


def test_gradient_accumulation_adds_into_the_experts_own_gradients():
    """Two micro-batches: with `use_mok`'s fused accumulation the second one's gradients of w1,
    w3 and w2 are added into their .grad by the layer (autograd receives none) and equal the
    unfused run's to bf16 rounding. Catches the adapter not fusing (autograd's extra pass), a
    gradient added twice or into another weight's buffer."""
    base = build_layer()
    layers = {fuse: copy.deepcopy(base).bfloat16() for fuse in (True, False)}
    experts_names = ("w1_EFD", "w3_EFD", "w2_EDF")
    received = {fuse: {name: [] for name in experts_names} for fuse in layers}
    for fuse, layer in layers.items():
        mok_torchtitan.use_mok(layer, fuse_grad_accumulation=fuse)
        for name in experts_names:
            getattr(layer.routed_experts.inner_experts, name).register_hook(
                lambda grad, seen=received[fuse][name]: seen.append(grad is not None) or None
            )
        generator = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randn(3, 7, 64, generator=generator).to(DEVICE, torch.bfloat16)
            layer(x).float().square().mean().backward()
    for name in experts_names:
        assert received[True][name] == [True, False], name
        assert received[False][name] == [True, True], name
    for (name, got), (_, want) in zip(
        layers[True].named_parameters(), layers[False].named_parameters(), strict=True
    ):
        assert relative_error(got.grad, want.grad) < 4e-3, name


def test_routed_experts_in_mxfp8_are_mxfp8_close_to_float64():
    """`use_mok(precision="mxfp8")`: the routed experts' output and weight gradients lie further
    from float64 than bf16's (e4m3 has 3 mantissa bits to bf16's 7), and far below O(1).
    Catches the precision not reaching the layer (bf16-level errors)."""
    base = build_layer()
    bf16, mx = copy.deepcopy(base).bfloat16(), copy.deepcopy(base).bfloat16()
    mok_torchtitan.use_mok(bf16)
    mok_torchtitan.use_mok(mx, precision="mxfp8")
    x, grad, exact = bf16_inputs_and_float64_results(base)
    ours_bf16 = results(bf16, x, grad)
    ours_mx = results(mx, x, grad)
    experts = [name for name in exact if "inner_experts" in name]
    assert len(experts) == 3
    for name in ["y", *experts]:
        error = relative_error(ours_mx[name], exact[name])
        assert 2 * relative_error(ours_bf16[name], exact[name]) < error < 0.1, (name, error)
    with pytest.raises(ValueError, match="precision must be one of"):
        mok_torchtitan.use_mok(mx, precision="fp8")


def test_other_config_fields_reach_the_layer():
    """`use_mok(**config_options)`: a MoKConfig field reaches the layer's config; one the
    adapter sets itself raises. Catches options dropped on the way to the workspace."""
    from mok.integrations._workspaces import cached

    layer = build_layer().bfloat16()
    mok_torchtitan.use_mok(layer, validation="local")
    layer(torch.randn(2, 5, 64, device=DEVICE, dtype=torch.bfloat16))
    assert cached(layer.routed_experts).config.validation.value == "local"
    with pytest.raises(ValueError, match="'top_k' is taken from the model"):
        mok_torchtitan.use_mok(build_layer(), top_k=1)


def test_a_float32_layer_under_autocast_runs_through_mok():
    """Mixed precision with fp32 parameters (TorchTitan without FSDP's bf16 parameters, under
    torch.autocast): MoK behind the fp32 layer's experts computes in bf16 and is within bf16
    rounding of float64, as close as TorchTitan's own path in bf16 (CPU autocast leaves that path
    in fp32, so its bf16 copy is the yardstick), and the experts' gradients come back in fp32.
    Catches MoK refusing fp32 experts (it casts them per call) or a gradient lost at that cast."""
    base = build_layer()
    ours = copy.deepcopy(base)
    assert mok_torchtitan.use_mok(ours) == 1
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 64, generator=generator).to(DEVICE)
    grad = torch.randn(3, 7, 64, generator=generator).to(DEVICE)
    exact = results(copy.deepcopy(base).double(), x.double(), grad.double())
    theirs = results(copy.deepcopy(base).bfloat16(), x.bfloat16(), grad.bfloat16())
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        mine = results(ours, x, grad)
    assert ours.routed_experts.inner_experts.w1_EFD.grad.dtype == torch.float32
    for name, want in exact.items():
        error = relative_error(mine[name], want)
        assert error < 1.5e-2, (name, error)
        assert error <= 2 * relative_error(theirs[name], want) + 5e-3, name


def _expert_parallel_layers(rank: int, world: int):
    """(TorchTitan's own expert-parallel layer, the same through MoK, both parallelized over an
    `ep` mesh of the gloo world; bf16). TorchTitan builds meshes for CUDA and defaults to its
    spmd_types backend, which its trainer sets up: the CPU test takes its partial_dtensor backend
    on a CPU mesh."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.distributed.utils as titan_distributed
    from torch.distributed.tensor import Shard
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    titan_distributed._spmd_backend = "partial_dtensor"
    parallel_dims_module.device_type = "cpu"
    config = layer_config(AllToAllTokenDispatcher)
    layout = {"w1_EFD": Shard(1), "w2_EDF": Shard(2), "w3_EFD": Shard(1)}
    set_moe_sharding_config(config, enable_ep=True, enable_sp=False, expert_param_layout=layout)
    base = build_layer(config).cpu().bfloat16()
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=world,
        cp=1,
        tp=1,
        pp=1,
        ep=world,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    native, ours = copy.deepcopy(base), copy.deepcopy(base)
    assert mok_torchtitan.use_mok(ours, group=dims.get_optional_mesh("ep")) == 1
    native.parallelize(dims)
    ours.parallelize(dims)
    return native, ours


def test_the_layer_with_mok_compiles_whole():
    """torch.compile(fullgraph=True) of TorchTitan's MoE with MoK behind its routed experts (the
    triton backend: the interpreter on CPUs), after one eager call that makes the workspace: the
    experts run as `mok.ops`' custom ops, and output and gradients equal eager's bit for bit
    under aot_eager. Catches a graph break in the adapter (fullgraph raises) and gradients lost
    between the ops and TorchTitan's parameters."""
    layer = build_layer().bfloat16()
    mok_torchtitan.use_mok(layer, backend="triton")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 64, generator=generator).bfloat16().to(DEVICE)
    grad = torch.randn(2, 9, 64, generator=generator).bfloat16().to(DEVICE)
    eager = results(layer, x, grad)
    torch._dynamo.reset()
    compiled = results(torch.compile(layer, fullgraph=True, backend="aot_eager"), x, grad)
    compiled = {key.removeprefix("_orig_mod."): value for key, value in compiled.items()}
    assert compiled.keys() == eager.keys()
    for key, value in eager.items():
        assert torch.equal(compiled[key], value), key


def _under_titans_expert_parallelism(rank: int, world: int) -> dict:
    """Relative differences between MoK and TorchTitan's own path under TorchTitan's expert
    parallelism (y, grad x, this rank's expert and router gradients), and the error of use_mok
    once the model was parallelized."""
    native, ours = _expert_parallel_layers(rank, world)
    generator = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(2, 8, 64, generator=generator).bfloat16()
    grad = torch.randn(2, 8, 64, generator=generator).bfloat16()
    results = {}
    for name, layer in (("native", native), ("mok", ours)):
        inputs = x.clone().requires_grad_(True)
        y = layer(inputs)
        y.backward(grad)
        results[name] = {"y": y.detach().float(), "grad x": inputs.grad.float()}
        for key, param in layer.named_parameters():
            local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            results[name][key] = local.float()
    errors = {k: relative_error(results["mok"][k], v) for k, v in results["native"].items()}
    try:
        mok_torchtitan.use_mok(native)
    except Exception as error:  # noqa: BLE001 - returned for the test to check
        errors["late use_mok"] = str(error)
    return errors


def test_missing_torch_features_names_what_this_pytorch_lacks(monkeypatch):
    """The check that skips TorchTitan's own model code on an older PyTorch. Catches a check of the
    wrong module or name (it would report nothing, and TorchTitan fail mid-run instead)."""
    present = mok_torchtitan.missing_torch_features()
    monkeypatch.delattr(torch.compiler, "_is_non_strict_tracing", raising=False)
    missing = mok_torchtitan.missing_torch_features()
    assert "torch.compiler._is_non_strict_tracing" in missing
    assert set(missing) - set(present) == {"torch.compiler._is_non_strict_tracing"}


def test_under_torchtitans_own_expert_parallelism_mok_matches_its_path():
    """Two gloo ranks, TorchTitan's parallelize with EP 2 (experts sharded by its DTensor
    placements, its all-to-all dispatcher in the native layer). Catches the adapter reading the
    global instead of the local experts, an exchange that loses or doubles tokens, use_mok
    applied after parallelize silently leaving TorchTitan's path running."""
    if missing := mok_torchtitan.missing_torch_features():
        pytest.skip(f"TorchTitan's parallelism needs {', '.join(missing)} (a newer PyTorch)")
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.distributed.utils as titan_distributed

    from mok.ranks import run_ranks

    if not (
        hasattr(titan_distributed, "_spmd_backend") and hasattr(parallel_dims_module, "device_type")
    ):
        pytest.skip("this TorchTitan has no CPU path this test knows how to select")
    for errors in run_ranks(_under_titans_expert_parallelism, 2):
        assert "before TorchTitan's parallelize" in errors.pop("late use_mok")
        # Two bf16 implementations (rounding ~5e-3 each); a lost or misrouted token is O(1).
        assert max(errors.values()) < 2e-2, errors
