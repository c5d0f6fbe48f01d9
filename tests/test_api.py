"""The public API in one process: config validation, functional forward/backward, the module,
autograd, and the errors bad input gets."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mok
from mok import functional, graphs
from mok.config import TUNING_FIELDS
from mok.reference import moe_forward
from mok.reference.mx import ScaleRounding
from mok.testing import global_weights
from mok.weights import WEIGHT_FIELDS

TINY = mok.get_preset("tiny").config()


def inputs(config, tokens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    idx = torch.argsort(torch.rand(tokens, config.num_experts, generator=gen), -1)[
        :, : config.top_k
    ]
    w = torch.rand(tokens, config.top_k, generator=gen)
    return x, idx, w


def layer_for(config, seed=0):
    layer = mok.MoE(config)
    layer.load_global_weights(global_weights(config, seed, "cpu"))
    return layer


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"top_k": 9}, "top_k=9 exceeds num_experts=8"),
        ({"hidden_size": 0}, "hidden_size must be >= 1"),
        ({"hidden_size": 12.0}, "hidden_size must be an int"),
        ({"num_experts": True}, "num_experts must be an int"),
        ({"shared_intermediate_size": -1}, "shared_intermediate_size must be >= 0"),
        ({"swiglu_limit": 0.0}, "swiglu_limit must be finite and > 0"),
        ({"swiglu_limit": float("nan")}, "swiglu_limit must be finite"),
        ({"precision": "fp4"}, "precision must be one of 'bf16', 'mxfp8'"),
        ({"backend": "cuda"}, "backend must be one of"),
        ({"recv_capacity": 0}, "recv_capacity must be >= 1"),
        ({"recv_pair_capacity": 0}, "recv_pair_capacity must be >= 1"),
        ({"recv_pair_capacity": 2.5}, "recv_pair_capacity must be an int"),
        ({"comm_sms": 0}, "comm_sms must be >= 1"),
    ],
)
def test_config_rejects_bad_fields(changes, message):
    with pytest.raises(mok.MoKConfigError, match=message.replace("(", r"\(")):
        TINY.replace(**changes)


def int_limits(minimum, optional=False):
    """(accepted, rejected with message) values of an int field that must be >= minimum."""
    accepted = [minimum, minimum + 1] + ([None] if optional else [])
    wrong_type = "must be an int"
    rejected = [(minimum - 1, f"must be >= {minimum}"), (float(minimum), wrong_type)]
    return accepted, rejected + [(True, wrong_type), (str(minimum), wrong_type)]


def positive_number_limits(optional):
    """(accepted, rejected with message) values of a float field that must be finite and > 0."""
    accepted = [1e-3, 7, 2.5] + ([None] if optional else [])
    bad_value = "must be finite and > 0"
    rejected = [(0, bad_value), (0.0, bad_value), (-1.0, bad_value)]
    rejected += [(float("inf"), bad_value), (float("nan"), bad_value)]
    rejected += [(True, "must be a number"), ("1", "must be a number")]
    if not optional:
        rejected.append((None, "must be a number"))
    return accepted, rejected


def enum_limits(enum_type):
    """(accepted, rejected with message) values of a field that parses enum_type's strings."""
    members = list(enum_type)
    accepted = [member.value for member in members] + members
    message = "must be one of " + ", ".join(repr(member.value) for member in members)
    unknown = ["fp4", "cuda", None, members[0].value.upper()]
    return accepted, [(value, message) for value in unknown]


# Every MoKConfig field: values it accepts and values it rejects (with the message), on LIMITS_BASE
# (TINY with top_k = 1, so that num_experts = 1 is valid; its 8 experts allow top_k up to 8).
LIMITS_BASE = TINY.replace(top_k=1)
FIELD_LIMITS = {
    "hidden_size": int_limits(1),
    "intermediate_size": int_limits(1),
    "num_experts": int_limits(1),
    "top_k": (int_limits(1)[0] + [8], int_limits(1)[1] + [(9, "top_k=9 exceeds num_experts=8")]),
    "shared_intermediate_size": int_limits(0),
    "swiglu_limit": positive_number_limits(optional=True),
    "precision": enum_limits(mok.Precision),
    "backend": enum_limits(mok.Backend),
    "validation": enum_limits(mok.Validation),
    "dispatch": enum_limits(mok.Dispatch),
    "graphs": enum_limits(mok.Graphs),
    "mx_rounding": enum_limits(ScaleRounding),
    "mx_weight_casts": enum_limits(mok.MXWeightCasts),
    "recompute": enum_limits(mok.Recompute),
    "router_gradient": enum_limits(mok.RouterGradient),
    "max_tokens_per_rank": int_limits(1),
    "comm_sms": int_limits(1),
    "recv_capacity": int_limits(1, optional=True),
    "recv_pair_capacity": int_limits(1, optional=True),
    "peer_timeout_s": positive_number_limits(optional=False),
    "swiglu_alpha": positive_number_limits(optional=False),
    "swiglu_up_offset": (
        [0.0, 1, -2.5],
        [(v, "must be a finite number") for v in (float("inf"), float("nan"), True, "1", None)],
    ),
    "expert_bias": ([False, True], [(v, "must be a bool") for v in (1, "yes", None)]),
    "exact_buffers": ([False, True], [(v, "must be a bool") for v in (1, "yes", None)]),
    "keep_grouped_rows": ([False, True], [(v, "must be a bool") for v in (1, "yes", None)]),
}
# What an accepted value is stored as (int fields: int).
STORED_TYPES = {
    "swiglu_limit": float,
    "peer_timeout_s": float,
    "precision": mok.Precision,
    "backend": mok.Backend,
    "validation": mok.Validation,
    "dispatch": mok.Dispatch,
    "graphs": mok.Graphs,
    "mx_rounding": ScaleRounding,
    "mx_weight_casts": mok.MXWeightCasts,
    "recompute": mok.Recompute,
    "router_gradient": mok.RouterGradient,
    "swiglu_alpha": float,
    "swiglu_up_offset": float,
    "expert_bias": bool,
    "exact_buffers": bool,
    "keep_grouped_rows": bool,
}


def stored_value(config, name):
    """The value of field `name` of `config` or of its `tuning`."""
    return getattr(config.tuning if name in TUNING_FIELDS else config, name)


def test_every_config_field_has_its_limits_tested():
    """Catches a new MoKConfig or MoKTuning field added without limit cases (and so, likely,
    without checks)."""
    fields = {field.name for field in dataclasses.fields(mok.MoKConfig)} - {"tuning"}
    assert set(FIELD_LIMITS) == fields | {field.name for field in dataclasses.fields(mok.MoKTuning)}


@pytest.mark.parametrize(
    ("name", "value"),
    [(name, value) for name, (accepted, _) in FIELD_LIMITS.items() for value in accepted],
)
def test_config_accepts_each_field_at_its_limits(name, value):
    """Catches a bound off by one (rejecting a field at its minimum, top_k = num_experts) and a
    value stored unparsed (a string for an enum, an int for a float)."""
    stored = stored_value(LIMITS_BASE.replace(**{name: value}), name)
    assert stored == value
    if value is not None:
        assert type(stored) is STORED_TYPES.get(name, int)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (name, value, message)
        for name, (_, rejected) in FIELD_LIMITS.items()
        for value, message in rejected
    ],
)
def test_config_rejects_each_field_past_its_limits(name, value, message):
    """Catches a missing or off-by-one check (minimum - 1, 0 or a non-finite float accepted), bools
    taken for ints or numbers, and an error that does not name the field."""
    with pytest.raises(mok.MoKConfigError) as raised:
        LIMITS_BASE.replace(**{name: value})
    assert name in str(raised.value)
    assert message in str(raised.value)


def test_tuning_is_taken_as_settings_a_mapping_or_names_beside_the_config_fields():
    """The three ways to set a `MoKTuning` field give the same config, and each refuses what is not
    one. Catches a tuning name dropped on the way (replace, from_fields, a preset or an adapter's
    options would then run the default), a mapping stored unparsed, and an unknown name accepted
    in silence."""
    tuning = mok.MoKTuning(comm_sms=16, recompute="gate_up", graphs="off")
    settings = {"comm_sms": 16, "recompute": "gate_up", "graphs": "off"}
    made = [
        TINY.replace(tuning=tuning),
        TINY.replace(tuning=settings),
        TINY.replace(**settings),
        mok.MoKConfig.from_fields(**{**vars_of(TINY), **settings}),
        mok.get_preset("tiny").config(**settings),
    ]
    assert all(config.tuning == tuning for config in made)
    assert made[0] == made[2] and made[0] != TINY
    assert TINY.replace(tuning=tuning).replace(comm_sms=8).tuning.recompute is mok.Recompute.GATE_UP
    with pytest.raises(mok.MoKConfigError, match="'comm_sm' is not a MoKTuning field"):
        TINY.replace(tuning={"comm_sm": 16})
    with pytest.raises(mok.MoKConfigError, match="tuning must be a MoKTuning, got int"):
        TINY.replace(tuning=16)
    with pytest.raises(TypeError, match="comm_sm"):
        TINY.replace(comm_sm=16)
    with pytest.raises(mok.MoKConfigError, match="applies to bf16 experts"):
        TINY.replace(precision="mxfp8", tuning=settings)


def vars_of(config):
    """`config`'s own fields (not `tuning`) by name."""
    return {
        f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "tuning"
    }


def test_config_accepts_strings_and_reports_layout():
    config = TINY.replace(precision="bf16", backend="reference", swiglu_limit=7)
    assert config.precision is mok.Precision.BF16 and config.backend is mok.Backend.REFERENCE
    assert config.swiglu_limit == 7.0
    assert config.local_experts(4) == 2
    with pytest.raises(mok.MoKConfigError, match="num_experts=8 is not divisible .* size 3"):
        config.local_experts(3)
    # docs/reference-machine.md: 2 * T * k * 3 * H * I + 2 * T * 3 * H * I_shared
    assert config.forward_flops(10) == 2 * 10 * 2 * 3 * 128 * 64 + 2 * 10 * 3 * 128 * 64


def test_mxfp8_runs_on_the_reference_backend_and_refuses_unaligned_sizes_at_once():
    """Catches a backend taking a precision it would compute in bf16, and MXFP8 accepted for
    sizes its 32-element scale blocks cannot cover until the first call: the config refuses
    them when it is made, for either size."""
    mx_config = TINY.replace(precision="mxfp8")
    assert mok.create_workspace(mx_config).backend_name == "reference"
    for change in ({"hidden_size": 48}, {"intermediate_size": 40}):
        name = next(iter(change))
        with pytest.raises(mok.MoKConfigError, match=f"{name} to be a multiple of 32"):
            mx_config.replace(**change)
    with pytest.raises(mok.MoKConfigError, match="multiple of 32"):
        mok.MoKConfig(
            hidden_size=48, intermediate_size=64, num_experts=4, top_k=2, precision="mxfp8"
        )


def test_backends_say_why_they_cannot_run_here(monkeypatch):
    report = mok.backends.backend_report(TINY, torch.device("cpu"))
    assert report["reference"] is None
    assert "CUDA" in report["triton"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # with it, triton runs on CPUs (a test mode)
    with pytest.raises(mok.BackendUnavailableError, match="triton"):
        mok.create_workspace(TINY.replace(backend="triton"))
    assert mok.create_workspace(TINY).backend_name == "reference"  # auto on the CPU


def test_workspace_check_on_the_reference_backend_finds_nothing():
    ws = mok.create_workspace(TINY)
    ws.check()
    ws.release()
    with pytest.raises(RuntimeError, match="released"):
        ws.check()


# -- module and autograd ---------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [0, 1, 37])
@pytest.mark.parametrize("limit", [None, 1.5])
@pytest.mark.parametrize("top_k", [2, 8], ids=["k=2", "k=E"])  # k = E: every token, every expert
def test_module_matches_reference_values_and_gradients(tokens, limit, top_k):
    config = TINY.replace(swiglu_limit=limit, top_k=top_k)
    layer = layer_for(config)
    x, idx, w = inputs(config, tokens)
    x.requires_grad_(True)
    w.requires_grad_(True)
    grad = torch.randn(tokens, config.hidden_size).to(torch.bfloat16)
    y = layer(x, idx, w)
    y.backward(grad)

    ref_weights = global_weights(config, 0, "cpu").map(lambda t: t.requires_grad_(True))
    x_ref, w_ref = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y_ref = moe_forward(x_ref, idx, w_ref, ref_weights, limit)
    y_ref.backward(grad)

    assert torch.equal(y, y_ref)
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(w.grad, w_ref.grad)
    for name, ref in ref_weights.tensors().items():
        if ref is None:  # a weight the config does not have (expert biases)
            assert getattr(layer, name) is None, name
            continue
        expected = ref.grad if ref.grad is not None else torch.zeros_like(ref)
        assert torch.equal(getattr(layer, name).grad, expected), name


def test_module_accepts_leading_dimensions():
    layer = layer_for(TINY)
    x, idx, w = inputs(TINY, 12)
    flat = layer(x, idx, w)
    batched = layer(x.view(3, 4, -1), idx.view(3, 4, -1), w.view(3, 4, -1))
    assert batched.shape == (3, 4, TINY.hidden_size)
    assert torch.equal(batched.view(12, -1), flat)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp32_parameters_under_autocast_compute_as_the_bf16_layer(backend):
    """Mixed precision with fp32 parameters and activations (autocast to bf16, as a trainer's
    bf16 mode runs): y is the bf16 layer's on the same (bf16-rounded) values bit for bit, in bf16,
    and every gradient reaches the fp32 parameters and input in fp32, the bf16 layer's gradient
    exactly. Catches the cast skipped (the layer would refuse fp32), a gradient stopped at the
    cast, gradients left in bf16 on fp32 parameters, the shared expert's weights not cast."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    config = TINY.replace(backend=backend)
    bf16_layer = layer_for(config).to(device)
    fp32_layer = layer_for(config).float().to(device)
    x, idx, w = (t.to(device) for t in inputs(config, 20))
    grad_y = torch.randn(20, config.hidden_size, generator=torch.Generator().manual_seed(4))
    grad_y = grad_y.to(device)
    x16, x32 = (x.clone().requires_grad_(True), x.float().requires_grad_(True))
    want = bf16_layer(x16, idx, w)
    want.backward(grad_y.bfloat16())
    with torch.autocast(device, dtype=torch.bfloat16):
        got = fp32_layer(x32, idx, w)
    got.backward(grad_y.bfloat16())
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert x32.grad.dtype == torch.float32 and torch.equal(x32.grad, x16.grad.float())
    for name, param in fp32_layer.named_parameters():
        expected = getattr(bf16_layer, name).grad
        assert param.grad.dtype == torch.float32, name
        assert torch.equal(param.grad, expected.float()), name


def test_fp32_input_without_autocast_says_what_to_do():
    layer = layer_for(TINY)
    x, idx, w = inputs(TINY, 4)
    with pytest.raises(mok.MoKInputError, match=r"float32, expected bfloat16 .*torch\.autocast"):
        layer(x.float(), idx, w)
    with pytest.raises(mok.MoKInputError, match=r"weights.gate has dtype float32.*autocast"):
        layer.float()(x, idx, w)


def test_a_deep_copy_makes_a_workspace_of_its_own():
    """copy.deepcopy (model copies for EMA or evaluation) and torch.save / torch.load of a whole
    layer that ran: the copy starts without a workspace and makes its own on its first call, with
    the same results; the original keeps its own. Catches a copy that shares the original's
    workspace (two layers writing one set of buffers) or that duplicates it (a copied process
    group, or symmetric memory that the copy's ranks never allocated together)."""
    import copy
    import io

    layer = layer_for(TINY)
    x, idx, w = inputs(TINY, 12)
    want = layer(x, idx, w)
    original = layer.workspace(torch.device("cpu"))
    twin = copy.deepcopy(layer)
    assert twin._slot.workspace is None
    assert torch.equal(twin(x, idx, w), want)
    assert twin.workspace(torch.device("cpu")) is not original
    assert layer.workspace(torch.device("cpu")) is original
    saved = io.BytesIO()
    torch.save(layer, saved)  # a whole model saved: its workspace stays behind
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert loaded._slot.workspace is None
    assert torch.equal(loaded(x, idx, w), want)


def test_layer_without_shared_expert_has_no_shared_parameters():
    config = TINY.replace(shared_intermediate_size=0)
    layer = mok.MoE(config)
    assert layer.shared_gate is None
    assert {name for name, _ in layer.named_parameters()} == {"gate", "up", "down"}
    x, idx, w = inputs(config, 5)
    assert layer(x, idx, w).shape == (5, config.hidden_size)


def test_weights_in_field_order_from_the_container_and_the_module():
    """`MoEWeights.astuple` and `MoE.weights`, which every call reads, name each tensor by its
    field. Catches two fields swapped (gate fed to the kernels as up) or one left out."""
    numbered = mok.MoEWeights(
        **{name: torch.full((1,), float(i)) for i, name in enumerate(WEIGHT_FIELDS)}
    )
    assert [float(t) for t in numbered.astuple()] == list(range(len(WEIGHT_FIELDS)))
    assert list(numbered.tensors()) == list(WEIGHT_FIELDS)
    layer = mok.MoE(TINY.replace(expert_bias=True))
    assert all(getattr(layer.weights, name) is getattr(layer, name) for name in WEIGHT_FIELDS)


def test_functional_forward_backward_equals_autograd():
    layer = layer_for(TINY)
    x, idx, w = inputs(TINY, 20)
    grad = torch.randn(20, TINY.hidden_size).to(torch.bfloat16)

    ws = mok.create_workspace(TINY)
    schedule = mok.build_schedule(ws, idx)
    y, saved = mok.forward(ws, schedule, x, w, layer.weights)
    grads = mok.backward(ws, schedule, saved, grad)

    x.requires_grad_(True)
    w.requires_grad_(True)
    y_auto = layer(x, idx, w)
    y_auto.backward(grad)
    assert torch.equal(y, y_auto)
    assert torch.equal(grads.x, x.grad)
    assert torch.equal(grads.topk_weights, w.grad)
    for name, value in grads.weights.tensors().items():
        if value is None:  # a weight the config does not have (expert biases)
            assert getattr(layer, name) is None, name
            continue
        assert torch.equal(value, getattr(layer, name).grad), name


def test_schedule_and_forward_is_both_steps_with_one_check():
    layer = layer_for(TINY)
    x, idx, w = inputs(TINY, 9)
    ws = mok.create_workspace(TINY)
    schedule, y, saved = mok.schedule_and_forward(ws, idx, x, w, layer.weights)
    y_two, _ = mok.forward(ws, mok.build_schedule(ws, idx), x, w, layer.weights)
    assert torch.equal(y, y_two) and saved is not None and schedule.num_tokens == 9
    with pytest.raises(mok.MoKInputError, match="expected bfloat16"):
        mok.schedule_and_forward(ws, idx, x.float(), w, layer.weights)
    with pytest.raises(mok.MoKInputError, match="topk_idx"):
        mok.schedule_and_forward(ws, idx[:, :1], x, w, layer.weights)


def test_forward_without_backward_state_and_released_workspace():
    layer = layer_for(TINY)
    x, idx, w = inputs(TINY, 4)
    ws = mok.create_workspace(TINY)
    schedule = mok.build_schedule(ws, idx)
    y, saved = mok.forward(ws, schedule, x, w, layer.weights, need_backward=False)
    assert saved is None and y.shape == x.shape
    with pytest.raises(mok.MoKInputError, match="need_backward=True"):
        mok.backward(ws, schedule, saved, torch.zeros_like(y))
    ws.release()
    with pytest.raises(RuntimeError, match="released"):
        mok.build_schedule(ws, idx)


def test_no_grad_call_keeps_no_graph():
    layer = layer_for(TINY)
    x, idx, w = inputs(TINY, 4)
    with torch.no_grad():
        y = layer(x, idx, w)
    assert not y.requires_grad


# -- bad input ----------------------------------------------------------------------------------


def bad_calls():
    x, idx, w = inputs(TINY, 6)
    yield "x float32", (x.float(), idx, w), "x has dtype float32, expected bfloat16"
    yield "x hidden", (x[:, :64], idx, w), r"x has shape \(6, 64\), expected \(6, 128\)"
    yield (
        "idx out of range",
        (x, idx.clone().fill_(8), w),
        r"expert id 8, outside \[0, num_experts=8\)",
    )
    yield "idx negative", (x, idx - 5, w), "expert id -5"
    yield "idx float", (x, idx.float(), w), "topk_idx has dtype float32, expected int32 or int64"
    yield "idx k", (x, idx[:, :1], w), r"topk_idx has shape \(6, 1\), expected \[T, top_k=2\]"
    yield (
        "idx tokens",
        (x, idx[:5], w[:5]),
        "x has 6 tokens but the schedule was built from topk_idx with 5",
    )
    yield "weights tokens", (x, idx, w[:5]), r"topk_weights has shape \(5, 2\), expected \(6, 2\)"
    yield "weights int", (x, idx, idx), "topk_weights must be a floating-point tensor"


@pytest.mark.parametrize(
    ("args", "message"), [pytest.param(a, m, id=case) for case, a, m in bad_calls()]
)
def test_bad_input_names_the_problem(args, message):
    layer = layer_for(TINY)
    with pytest.raises(mok.MoKInputError, match=message):
        layer(*args)


VALUE_CASES = ("idx out of range", "idx negative")
"""The bad calls whose problem is in the ids' values, which the triton backend checks on the
device (`Workspace.check()`) and not on the host."""


@pytest.mark.parametrize(
    ("args", "message"),
    [pytest.param(a, m, id=case) for case, a, m in bad_calls() if case not in VALUE_CASES],
)
def test_a_bad_input_after_accepted_calls_still_names_the_problem(args, message, monkeypatch):
    """The host checks are skipped for a call whose inputs are like the last accepted call's
    (where the device checks the ids). Catches a key that leaves out what a check reads (a
    dtype, the tokens of one input, a shape): the bad call would reach the kernels unchecked."""
    layer = layer_for(TINY)
    ws = layer.workspace(torch.device("cpu"))
    monkeypatch.setattr(ws.backend, "checks_ids_on_device", True, raising=False)
    good = inputs(TINY, 6)
    for _ in range(2):
        layer(*good)
    assert ws.accepted_inputs is not None
    with pytest.raises(mok.MoKInputError, match=message):
        layer(*args)
    assert ws.accepted_inputs is None
    torch.testing.assert_close(layer(*good), layer_for(TINY)(*good), rtol=0, atol=0)


def test_weights_unlike_the_accepted_calls_are_checked(monkeypatch):
    """Catches weights left out of the skipped checks' key: a weight of another shape or dtype,
    or a missing one, after accepted calls with the right ones."""
    layer = layer_for(TINY)
    x, idx, w = inputs(TINY, 3)
    ws = layer.workspace(x.device)
    monkeypatch.setattr(ws.backend, "checks_ids_on_device", True, raising=False)
    weights = layer.weights.map(torch.Tensor.detach)  # of one type with the wrong ones below
    mok.schedule_and_forward(ws, idx, x, w, weights)
    wrong = [
        (mok.MoEWeights(weights.gate[:4], weights.up, weights.down, *_shared(weights)), "gate"),
        (
            mok.MoEWeights(
                weights.gate, weights.up.view(torch.float16), weights.down, *_shared(weights)
            ),
            "float16",
        ),
        (mok.MoEWeights(weights.gate, weights.up, weights.down), "shared_gate is missing"),
    ]
    for bad, message in wrong:
        with pytest.raises(mok.MoKInputError, match=message):
            mok.schedule_and_forward(ws, idx, x, w, bad)
        mok.schedule_and_forward(ws, idx, x, w, weights)


def _laid_out(values: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`values` as they are, or the same values in a transposed layout (non-contiguous)."""
    if not transposed or values.dim() != 2:
        return values
    return values.t().contiguous().t()


@given(
    tokens=st.integers(0, 5),
    hidden=st.sampled_from([TINY.hidden_size, 64]),
    x_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    idx_dtype=st.sampled_from([torch.int64, torch.int32, torch.float32]),
    top_k=st.sampled_from([TINY.top_k, 1]),
    weight_tokens=st.integers(0, 5),
    weight_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
    gate_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    layouts=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    seed=st.integers(0, 9),
)
def test_the_host_checks_read_nothing_the_call_key_leaves_out(
    tokens,
    hidden,
    x_dtype,
    idx_dtype,
    top_k,
    weight_tokens,
    weight_dtype,
    gate_dtype,
    layouts,
    seed,
):
    """Skipping the checks for inputs of an accepted call's `call_key` is sound only if the
    checks' verdict depends on nothing else. Two calls with equal keys (one contiguous with
    some values, one in another layout, with other values and requiring grad) must get the same
    verdict, good or bad. Catches a check that starts reading what the key leaves out (a
    contiguity or stride requirement, a value, requires_grad)."""
    ws = mok.create_workspace(TINY)
    gen = torch.Generator().manual_seed(seed)
    shapes = ((tokens, top_k), (tokens, hidden), (weight_tokens, TINY.top_k))
    dtypes = (idx_dtype, x_dtype, weight_dtype)
    layer = layer_for(TINY)
    weights = layer.weights.map(torch.Tensor.detach)
    weights = dataclasses.replace(weights, gate=weights.gate.view(gate_dtype))

    def verdict(call):
        idx, x, topk_weights = call
        problem = functional._routing_problem(ws, idx)
        return problem or functional._forward_problem(ws, idx.shape[0], x, topk_weights, weights)

    def realised(transposed):
        tensors = [
            torch.randint(0, TINY.num_experts, shape, generator=gen).to(dtype)
            for shape, dtype in zip(shapes, dtypes, strict=True)
        ]
        tensors = [_laid_out(t, flip) for t, flip in zip(tensors, transposed, strict=True)]
        if transposed[1] and x_dtype.is_floating_point:
            tensors[1].requires_grad_(True)
        return tensors

    plain, other = realised((False, False, False)), realised(layouts)
    assert graphs.call_key(*plain, weights) == graphs.call_key(*other, weights)
    assert verdict(plain) == verdict(other)


def test_ids_are_checked_at_every_call_where_the_host_checks_them():
    """The reference backend checks the ids' values on the host. Catches the skipped checks
    applied there too: ids out of range after an accepted call would index past the weights."""
    layer = layer_for(TINY)
    x, idx, w = inputs(TINY, 6)
    layer(x, idx, w)
    with pytest.raises(mok.MoKInputError, match="expert id 8"):
        layer(x, idx.clone().fill_(8), w)


def test_weights_that_do_not_match_the_config():
    layer = layer_for(TINY)
    x, idx, w = inputs(TINY, 3)
    ws = layer.workspace(x.device)
    weights = layer.weights
    schedule = mok.build_schedule(ws, idx)
    wrong = [
        (mok.MoEWeights(weights.gate[:4], weights.up, weights.down, *_shared(weights)), "gate"),
        (
            mok.MoEWeights(weights.gate.float(), weights.up, weights.down, *_shared(weights)),
            "float32",
        ),
        (mok.MoEWeights(weights.gate, weights.up, weights.down), "shared_gate is missing"),
    ]
    for bad, message in wrong:
        with pytest.raises(mok.MoKInputError, match=message):
            mok.forward(ws, schedule, x, w, bad)
    no_shared = mok.create_workspace(TINY.replace(shared_intermediate_size=0))
    with pytest.raises(mok.MoKInputError, match="no shared expert"):
        mok.forward(no_shared, mok.build_schedule(no_shared, idx), x, w, weights)


def _shared(weights):
    return weights.shared_gate, weights.shared_up, weights.shared_down


def test_load_global_weights_checks_what_it_copies():
    layer = mok.MoE(TINY)
    full = global_weights(TINY, 0, "cpu")
    with pytest.raises(mok.MoKInputError, match="holds 4 experts, expected all 8"):
        layer.load_global_weights(full.map(lambda t: t[:4] if t.dim() == 3 else t))
    layer.load_global_weights(full)
    assert torch.equal(layer.down, full.down)


def test_a_backend_token_limit_is_checked_before_routing(monkeypatch):
    ws = mok.create_workspace(TINY.replace(max_tokens_per_rank=8))
    monkeypatch.setattr(ws.backend, "max_tokens", 8, raising=False)
    _, idx, _ = inputs(TINY, 9)
    with pytest.raises(mok.MoKInputError, match="max_tokens_per_rank=8"):
        mok.build_schedule(ws, idx)
    _, idx, _ = inputs(TINY, 8)
    mok.build_schedule(ws, idx)
