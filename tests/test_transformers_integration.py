"""`mok.integrations.transformers`: MoK as the experts implementation of Hugging Face MoE models
(Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss), small random models built from configs in code.

Against a float32 copy of each model as the oracle, the MoK model's logits and gradients must be
as close as the native bf16 model's (bf16 noise), the parameters and state_dict keys must stay the
model's own (a checkpoint loads either way), and experts MoK cannot run must be refused with the
reason. Bugs these catch: gate and up taken from the wrong halves of
`gate_up_proj`, the router's weights or indices misread (a transposed top-k), gradients that do
not reach `gate_up_proj` through its views, a workspace reused at the wrong size or device.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mok.integrations.transformers as mok_transformers  # noqa: E402
from mok.errors import MoKConfigError, MoKInputError  # noqa: E402
from mok.integrations._workspaces import cached  # noqa: E402
from mok.testing import relative_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def qwen3_moe():
    return transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2
    )


def mixtral():
    return transformers.MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2)


def deepseek_v3():
    return transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": COMMON["num_attention_heads"]},  # MLA: one per head
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
    )


def gpt_oss():
    return transformers.GptOssConfig(
        **COMMON, head_dim=16, num_local_experts=8, num_experts_per_tok=2
    )


ARCHITECTURES = {
    "qwen3-moe": qwen3_moe,
    "mixtral": mixtral,
    "deepseek-v3": deepseek_v3,
    "gpt-oss": gpt_oss,
}


@pytest.fixture(scope="module", autouse=True)
def registered():
    mok_transformers.register()


def build(name: str, implementation: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        ARCHITECTURES[name](), dtype=torch.float32, experts_implementation="eager"
    )
    with torch.no_grad():  # routers start at zero in some models: give them a real routing
        for param_name, param in model.named_parameters():
            routing = param_name.endswith(("gate.weight", "router.weight"))
            if routing or param_name.split(".")[-1] in _EXPERT_PARAMETERS:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    oracle = model.to(DEVICE)
    model = copy.deepcopy(oracle).to(torch.bfloat16)
    model.set_experts_implementation(implementation)
    return oracle, model


def logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    logits.float().square().mean().backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), grads


def assert_as_close_as_native(exact, native, ours) -> None:
    """(logits, grads) of the MoK model (`ours`) within bf16 noise of the float32 model's
    (`exact`): each within twice the native model's distance from float32, plus a floor of a few
    bf16 roundings (both are ~1e-2 here; a swapped gate/up or a lost gradient is O(1))."""
    (exact_logits, exact_grads), (native_logits, native_grads) = exact, native
    our_logits, our_grads = ours
    assert our_grads.keys() == native_grads.keys() == exact_grads.keys()
    floor = 2e-2
    native_error = relative_error(native_logits, exact_logits)
    assert relative_error(our_logits, exact_logits) <= 2 * native_error + floor
    experts = [n for n in exact_grads if "experts.gate_up_proj" in n or "experts.down_proj" in n]
    assert experts  # the routed experts' weights do get gradients
    for param_name, exact_grad in exact_grads.items():
        native_error = relative_error(native_grads[param_name], exact_grad)
        ours_error = relative_error(our_grads[param_name], exact_grad)
        assert ours_error <= 2 * native_error + floor, (param_name, ours_error, native_error)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_mok_experts_are_as_close_to_float32_as_the_native_bf16_model(name):
    oracle, native = build(name, "eager")
    _, ours = build(name, mok_transformers.IMPLEMENTATION)
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert_as_close_as_native(
        logits_and_grads(oracle, ids), logits_and_grads(native, ids), logits_and_grads(ours, ids)
    )


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
def test_a_float32_model_under_autocast_runs_mok_experts(name):
    """A trainer's bf16 mixed precision: float32 parameters, the step under torch.autocast. The
    MoK model's logits and gradients are as close to the float32 model's as the native experts'
    under the same autocast, and the experts' gradients reach their float32 parameters in float32.
    Catches MoK refusing float32 experts under autocast (it casts them per call), gradients
    stopped at that cast, or left in bf16."""
    oracle, _ = build(name, "eager")
    native, ours = copy.deepcopy(oracle), copy.deepcopy(oracle)
    ours.set_experts_implementation(mok_transformers.IMPLEMENTATION)
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    exact = logits_and_grads(oracle, ids)
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        results = logits_and_grads(native, ids), logits_and_grads(ours, ids)
    assert_as_close_as_native(exact, *results)
    for param in ours.parameters():
        assert param.dtype == torch.float32
        assert param.grad is None or param.grad.dtype == torch.float32


def experts_results(experts, hidden, idx, weights, grad):
    hidden = hidden.detach().clone().requires_grad_(True)
    experts.zero_grad(set_to_none=True)
    out = experts(hidden, idx, weights)
    out.backward(grad)
    params = [p for n, p in experts.named_parameters() if n in _EXPERT_PARAMETERS]
    return [out.detach(), hidden.grad, *(p.grad for p in params)]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_mok_experts_match_float64_math_to_bf16_rounding(name):
    """One MoE layer's experts on the same hidden states and routing: MoK's output and gradients
    (of the hidden states, gate_up_proj, down_proj) against the float64 eager experts. The model
    test above cannot be this tight: bf16 flips of the next layer's routing add noise there."""
    check_experts_against_float64(name)


def test_gpt_oss_experts_run_the_triton_kernels_on_their_own_parameters():
    """gpt-oss's experts through the triton backend (under the interpreter on CPUs): on the first
    call its gate_up_proj and down_proj are stored again K-contiguous in place (the same
    Parameter objects and values), and the results match float64 to bf16 rounding. Catches the
    kernels misreading the interleaved gate/up views (O(1)), values changed by the re-layout,
    gradients that miss the re-laid parameters, the backend falling back to the reference."""
    mok_transformers.register(backend="triton")
    try:
        ours = check_experts_against_float64("gpt-oss")
    finally:
        mok_transformers.register()
    experts = ours.model.layers[0].mlp.experts
    assert type(cached(experts).backend).__name__ == "TritonBackend"
    assert experts.gate_up_proj.stride()[1] == 1 and experts.down_proj.stride()[1] == 1
    _, native = build("gpt-oss", "eager")  # the same initial values, never re-laid
    for name, value in native.model.layers[0].mlp.experts.named_parameters():
        assert torch.equal(getattr(experts, name), value), name


def accumulated_gradients(name: str, fuse: bool, precision: str = "bf16", backend: str = "auto"):
    """(expert parameters' gradients after two micro-batches of the MoK model, and per expert
    parameter of the first MoE layer whether autograd received a gradient for it in each)."""
    mok_transformers.register(fuse_grad_accumulation=fuse, precision=precision, backend=backend)
    try:
        _, model = build(name, mok_transformers.IMPLEMENTATION)
        experts = model.model.layers[-1].mlp.experts
        received = {n: [] for n, _ in experts.named_parameters() if n in _EXPERT_PARAMETERS}
        for param_name in received:
            getattr(experts, param_name).register_hook(
                lambda grad, n=param_name: received[n].append(grad is not None) or None
            )
        generator = torch.Generator().manual_seed(1)
        for _ in range(2):
            ids = torch.randint(0, 97, (3, 11), generator=generator).to(DEVICE)
            model(ids).logits.float().square().mean().backward()
    finally:
        mok_transformers.register()
    grads = {n: p.grad for n, p in model.named_parameters() if n.split(".")[-1] in received}
    return grads, received


@pytest.mark.parametrize(
    "name, precision, backend",
    [
        ("qwen3-moe", "bf16", "auto"),
        ("gpt-oss", "bf16", "auto"),
        # The triton backend's MX kernels (under the interpreter on CPUs).
        pytest.param("qwen3-moe", "mxfp8", "triton", marks=pytest.mark.slow),
    ],
)
def test_gradient_accumulation_adds_into_the_models_own_gradients(name, precision, backend):
    """Two micro-batches: with `register()`'s fused accumulation the second one's gradients of
    the parameters MoK reads whole (Qwen3-MoE's gate_up_proj and down_proj, gpt-oss's
    down_proj_bias) are added into their .grad by the layer, autograd receiving none, and every
    expert gradient equals the unfused run's to bf16 rounding (gpt-oss's views still go through
    autograd). Catches the adapter not fusing, gate_up_proj's halves swapped or added twice, a
    view's gradient dropped; in MXFP8 (gate_up_proj's halves cast whole, per pass), the MX
    backward's gradients written into the wrong half or not added."""
    fused, fused_received = accumulated_gradients(name, True, precision, backend)
    plain, plain_received = accumulated_gradients(name, False, precision, backend)
    whole = {"gate_up_proj", "down_proj"} if name == "qwen3-moe" else {"down_proj_bias"}
    for param_name, seen in fused_received.items():
        assert seen == ([True, False] if param_name in whole else [True, True]), param_name
        assert plain_received[param_name] == [True, True], param_name
    assert fused.keys() == plain.keys() and fused
    # The interpreter converts fp32 to bf16 by truncation: the kernels' adds into a bf16 .grad
    # then err twice as much as a rounding add (measured against the fp32 sum of the two
    # micro-batches' gradients: 0.0035 fused, 0.0017 unfused); a wrong half or add is O(1).
    interpreted = backend == "triton" and not torch.cuda.is_available()
    tolerance = 8e-3 if interpreted else 4e-3
    for param_name, grad in fused.items():
        assert relative_error(grad, plain[param_name]) < tolerance, param_name


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
def test_mxfp8_experts_are_mxfp8_close_to_float64(name):
    """`register(precision="mxfp8")`: the routed experts in MXFP8 (gpt-oss's activation and
    biases included). Their error against float64 lies above the bf16 experts' (e4m3 has 3
    mantissa bits to bf16's 7) and far below O(1), but for the down bias's gradient, which sums
    grad_out and is the bf16 layer's. Catches the precision not reaching the layer (bf16-level
    errors), or an MX path that misreads the model's weights (O(1))."""
    bf16 = check_experts_against_float64(name, return_errors=True)
    mok_transformers.register(precision="mxfp8")
    try:
        mx = check_experts_against_float64(name, return_errors=True, tolerance=0.1)
    finally:
        mok_transformers.register()
    for label, error in mx.items():
        if label == "grad down_proj_bias":  # grad_out's sums: nothing cast on the way
            assert error == bf16[label]
        else:
            assert 2 * bf16[label] < error, (label, error, bf16[label])
    with pytest.raises(MoKConfigError, match="precision must be one of"):
        mok_transformers.register(precision="fp8")


def test_other_config_fields_reach_every_layer():
    """`register(**config_options)`: a MoKConfig field the user sets reaches the layers'
    configs; a name that is no field, or one the adapter takes from the model, raises. Catches
    options dropped on the way to the workspace, or a user's hidden size overriding the
    model's."""
    mok_transformers.register(validation="local", mx_weight_casts="per_pass")
    try:
        _, model = build("qwen3-moe", mok_transformers.IMPLEMENTATION)
        model(torch.randint(0, 97, (2, 5)).to(DEVICE))
        config = cached(model.model.layers[0].mlp.experts).config
    finally:
        mok_transformers.register()
    assert config.validation.value == "local" and config.tuning.mx_weight_casts.value == "per_pass"
    with pytest.raises(MoKConfigError, match="'nope' is not a MoKConfig or MoKTuning field"):
        mok_transformers.register(nope=1)
    with pytest.raises(MoKConfigError, match="'hidden_size' is taken from the model"):
        mok_transformers.register(hidden_size=8)


def check_experts_against_float64(name, return_errors=False, tolerance=8e-3):
    """The body of the float64 comparison above; returns the MoK model, or with
    `return_errors` MoK's relative error of each result (the native comparison skipped:
    `tolerance` alone)."""
    oracle, native = build(name, "eager")
    _, ours = build(name, mok_transformers.IMPLEMENTATION)
    layer = next(i for i, layer in enumerate(oracle.model.layers) if hasattr(layer.mlp, "experts"))
    exact_experts = copy.deepcopy(oracle.model.layers[layer].mlp.experts).double()
    generator = torch.Generator().manual_seed(3)
    tokens, hidden_size = 37, COMMON["hidden_size"]
    num_experts = exact_experts.gate_up_proj.shape[0]
    hidden = torch.randn(tokens, hidden_size, generator=generator).bfloat16().to(DEVICE)
    idx = torch.stack(
        [torch.randperm(num_experts, generator=generator)[:2] for _ in range(tokens)]
    ).to(DEVICE)
    weights = torch.rand(tokens, 2, generator=generator).to(DEVICE)
    grad = torch.randn(tokens, hidden_size, generator=generator).bfloat16().to(DEVICE)
    exact = experts_results(exact_experts, hidden.double(), idx, weights.double(), grad.double())
    native = experts_results(
        native.model.layers[layer].mlp.experts, hidden, idx, weights.bfloat16(), grad
    )
    mine = experts_results(ours.model.layers[layer].mlp.experts, hidden, idx, weights, grad)
    names = [n for n, _ in exact_experts.named_parameters() if n in _EXPERT_PARAMETERS]
    labels = ["out", "grad hidden"] + [f"grad {n}" for n in names]
    errors = {}
    for label, want, theirs, ours_ in zip(labels, exact, native, mine, strict=True):
        # fp32 accumulation, bf16 roundings at h and the outputs: ~3e-3, at most the native
        # bf16 experts' error (which rounds more often). Swapped gate/up would be O(1).
        errors[label] = error = relative_error(ours_, want)
        assert error < tolerance, (label, error)
        if not return_errors:
            assert error <= 1.5 * relative_error(theirs, want) + 1e-3, label
    return errors if return_errors else ours


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_parameters_and_checkpoints_stay_the_models_own(name):
    _, native = build(name, "eager")
    _, ours = build(name, mok_transformers.IMPLEMENTATION)
    assert list(ours.state_dict()) == list(native.state_dict())
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        for param in ours.parameters():  # train a little, so that loading carries something
            param.add_(0.01 * torch.randn_like(param))
        native.load_state_dict(ours.state_dict())
        ours.set_experts_implementation("eager")
        assert torch.equal(native(ids).logits, ours(ids).logits)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_the_weights_are_rows_the_hopper_kernels_read_in_place(name):
    """The adapter's views of gate_up_proj and down_proj are what the warp-specialized kernels
    read without a copy (`warp_specialized._expert_rows`: rows of one 2-D view, gate and up the
    same distance apart). Host code, checked on the CPU. Catches a change of the views (a
    transpose, a copy, another split) that would send every adapted model's gate/up products to
    the slower tl kernels, as contiguity checks once did (1.08x / 1.27x slower at qwen3-30b-a3b).
    gpt-oss's gate and up interleave along I: every other row of gate_up_proj, each expert's I
    rows 2H elements apart."""
    from mok.kernels import warp_specialized

    _, model = build(name, mok_transformers.IMPLEMENTATION)
    modules = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert modules
    for module in modules:
        weights = mok_transformers._weights(module)
        gate, up, down = (
            warp_specialized._expert_rows(w) for w in (weights.gate, weights.up, weights.down)
        )
        assert None not in (gate, up, down)
        if name == "gpt-oss":
            inter, hidden = weights.gate.shape[1:]
            assert gate[1] == up[1] == inter and gate[0].stride() == (2 * hidden, 1)
            assert gate[0].data_ptr() == module.gate_up_proj.data_ptr()
            assert up[0].data_ptr() == gate[0].data_ptr() + hidden * gate[0].element_size()
            continue
        inter = weights.gate.shape[1]
        assert gate[1] == up[1] == 2 * inter and down[1] == weights.down.shape[1]
        assert gate[0].data_ptr() == module.gate_up_proj.data_ptr()  # the parameter itself
        assert up[0].data_ptr() == module.gate_up_proj[:, inter:].data_ptr()


def test_a_call_with_more_tokens_gets_a_larger_workspace():
    _, ours = build("qwen3-moe", mok_transformers.IMPLEMENTATION)
    experts = ours.model.layers[0].mlp.experts
    ids = torch.randint(0, 97, (1, 5)).to(DEVICE)
    with torch.no_grad():
        ours(ids)
        first = cached(experts)
        ours(ids)
        assert cached(experts) is first  # reused
        many = mok_transformers.MIN_TOKENS + 1
        hidden = torch.randn(many, 64, dtype=torch.bfloat16, device=DEVICE)
        idx = torch.randint(0, 8, (many, 2), device=DEVICE)
        out = experts(hidden, idx, torch.rand(many, 2, device=DEVICE))
    assert out.shape == (many, 64)
    assert cached(experts).config.max_tokens_per_rank >= many


def test_experts_it_cannot_run_are_refused_with_the_reason():
    _, model = build("qwen3-moe", mok_transformers.IMPLEMENTATION)
    experts = model.model.layers[0].mlp.experts
    experts.act_fn = torch.nn.GELU()
    assert "not SiLU" in mok_transformers.unsupported_reason(experts)
    with pytest.raises(MoKInputError, match="not SiLU"):
        model(torch.randint(0, 97, (1, 4)).to(DEVICE))


def _sharded_worker(rank, world, name):
    mok_transformers.register()
    _, full = build(name, mok_transformers.IMPLEMENTATION)
    full_state = {k: v.clone() for k, v in full.state_dict().items()}
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(10 + rank))
    with torch.no_grad():
        expected = full(ids.to(DEVICE)).logits.float()
    sharded = copy.deepcopy(full)
    count = mok_transformers.shard_experts(sharded, torch.distributed.group.WORLD)
    sharded.load_state_dict(full_state)  # a full checkpoint: each rank keeps its experts
    state = sharded.state_dict()
    local = {}
    for key, value in state.items():
        if key.split(".")[-1] in _EXPERT_PARAMETERS:
            per_rank = full_state[key].shape[0] // world
            local[key] = torch.equal(
                value, full_state[key][rank * per_rank : (rank + 1) * per_rank]
            )
    with torch.no_grad():
        logits = sharded(ids.to(DEVICE)).logits.float()
    return count, list(state) == list(full_state), local, relative_error(logits, expected)


@pytest.mark.parametrize("name", ["qwen3-moe", "deepseek-v3", "gpt-oss"])
def test_sharded_experts_give_the_one_process_model(name):
    """EP 2 on gloo: `shard_experts` keeps each rank's experts (state_dict keys unchanged; a full
    checkpoint loads sliced) and the model's logits are the one-process model's (the same expert
    math, the rows exchanged: fp32 reductions in another order at most). Catches a rank holding
    another rank's experts, a checkpoint loaded unsliced, tokens sent to the wrong rank."""
    from mok.ranks import run_ranks

    if torch.cuda.is_available():
        pytest.skip("gloo ranks on the CPU")
    for count, same_keys, local, error in run_ranks(_sharded_worker, 2, args=(name,)):
        assert count >= 1 and same_keys
        assert local and all(local.values()), local
        assert error < 1e-2, error


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
def test_a_model_with_mok_experts_compiles_whole(name):
    """torch.compile(fullgraph=True) of the whole model with MoK experts on the triton backend
    (the interpreter on CPUs): after one eager call, which makes each experts module's
    workspace, the compiled model runs the experts as `mok.ops`' custom ops and gives eager's
    logits and gradients bit for bit (aot_eager keeps every other operation). Before that call
    it says what to do. Catches a graph break in the adapter (fullgraph raises), a compiled call
    on another module's workspace, gradients lost between the ops and the views of
    gate_up_proj."""
    mok_transformers.register(backend="triton")
    try:
        _, ours = build(name, mok_transformers.IMPLEMENTATION)
        ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="run the model once eagerly"):
            torch.compile(copy.deepcopy(ours), fullgraph=True, backend="aot_eager")(ids)
        eager_logits, eager_grads = logits_and_grads(ours, ids)
        torch._dynamo.reset()
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
        logits, grads = logits_and_grads(compiled, ids)
    finally:
        mok_transformers.register()
    assert torch.equal(logits, eager_logits)
    grads = {key.removeprefix("_orig_mod."): value for key, value in grads.items()}
    assert grads.keys() == eager_grads.keys()
    for key, value in eager_grads.items():
        assert torch.equal(grads[key], value), key


def test_a_compiled_model_outlives_other_models_workspaces():
    """Another MoK model, made before this one, freed (its experts modules' workspaces with it)
    while this one compiles, between Dynamo's trace and its guards: the compiled model runs on
    its own workspaces and gives eager's logits. Catches compiled code that finds a module's
    workspace through a shared table whose entries move when another module's go (its guards,
    built on an entry's position, then fail: an IndexError while compiling)."""
    import gc

    from torch._dynamo.backends.debugging import aot_eager

    mok_transformers.register(backend="triton")
    try:
        ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        others = [build("qwen3-moe", mok_transformers.IMPLEMENTATION)[1]]
        _, ours = build("qwen3-moe", mok_transformers.IMPLEMENTATION)
        with torch.no_grad():
            others[0](ids)
            eager = ours(ids).logits

        def free_the_other_model_then_compile(graph_module, example_inputs):
            others.clear()
            gc.collect()
            return aot_eager(graph_module, example_inputs)

        torch._dynamo.reset()
        compiled = torch.compile(ours, fullgraph=True, backend=free_the_other_model_then_compile)
        with torch.no_grad():
            logits = compiled(ids).logits
    finally:
        mok_transformers.register()
    assert torch.equal(logits, eager)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_of_the_model_keeps_its_gradients(reentrant, monkeypatch):
    """transformers' own activation checkpointing (`gradient_checkpointing_enable`, every decoder
    layer recomputed in backward) over MoK experts on the triton backend: the gradients of the
    model without it, bit for bit, with each MoE layer run exactly twice (non-reentrant: its
    saved tensors go through the checkpoint's hooks, so it is dropped and recomputed like the
    rest of the layer). Catches the recomputed forward of the experts seeing
    another call's state, their backward reading the first forward's buffers after the
    recomputation rewrote them, or a checkpointing that never took effect."""
    from mok import functional

    calls = []
    layer_forward = functional.schedule_and_forward
    monkeypatch.setattr(
        functional,
        "schedule_and_forward",
        lambda *args, **kwargs: calls.append(1) or layer_forward(*args, **kwargs),
    )
    mok_transformers.register(backend="triton")
    try:
        _, plain = build("qwen3-moe", mok_transformers.IMPLEMENTATION)
        checkpointed = copy.deepcopy(plain)
        checkpointed.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
        checkpointed.train()
        plain.train()
        ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
        want_logits, want = logits_and_grads(plain, ids.to(DEVICE))
        assert len(calls) == 2  # the model's two MoE layers
        got_logits, got = logits_and_grads(checkpointed, ids.to(DEVICE))
        assert len(calls) == 2 + 2 * 2  # and each once more in backward, no more
    finally:
        mok_transformers.register()
    assert torch.equal(got_logits, want_logits)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
