"""Hugging Face `transformers`: MoK as an experts implementation of its MoE models.

transformers (5.x) runs the routed experts of its MoE models (Qwen3-MoE, Mixtral, DeepSeek-V3 and
others) through one seam: an `*Experts` module holding `gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I], called as `experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`, whose
forward is looked up by name in transformers' registry of experts implementations. `register()`
adds "mok" there:

    import mok.integrations.transformers as mok_transformers
    mok_transformers.register()
    model = AutoModelForCausalLM.from_config(config, experts_implementation="mok",
                                             dtype=torch.bfloat16)
    # or, on a model already built: model.set_experts_implementation("mok")

The model keeps its routers, its shared experts and its parameters: the experts module's own
`gate_up_proj` and `down_proj` are the layer's weights (gate and up as views of `gate_up_proj`,
which the Hopper kernels read in place; the layer also takes `gate_up_proj` whole, so that its
gradient comes from the kernels as one tensor), so `state_dict()` keys, checkpoints and
optimizers are those of the original model. The backend is
the config's `auto` (the `triton` backend on GPUs) unless `register(backend=...)` says otherwise;
the precision bf16 unless `register(precision="mxfp8")` (the routed experts in MXFP8).

Expert parallelism: `shard_experts(model, group)` keeps only this rank's experts in every experts
module (rank r of ep holds experts [r * E / ep, (r + 1) * E / ep), as `mok.MoE` does), and the
layer then exchanges tokens over `group`; a full-size checkpoint tensor loaded into a sharded
module is sliced to this rank's experts. Every rank must then run the model's MoE layers together.
`register()` also adds "mok-baseline": the standard expert-parallel PyTorch path (`mok.baseline`)
on the same weights, to compare with.

Supported, in bf16 or MXFP8 (also fp32 parameters under `torch.autocast(dtype=torch.bfloat16)`,
which the layer casts per call as autocast casts a matmul's): SwiGLU experts with concatenated
[gate; up] weights and no biases, and gpt-oss's experts (transposed, interleaved gate/up
weights, per-expert biases, its activation (up + 1) * gate * sigmoid(1.702 gate) with its
clamp). The triton kernels read weights with a unit last stride, which gpt-oss's transposed
views are not: on its first MoK call a gpt-oss experts module has its `gate_up_proj` and
`down_proj` stored again in place (same Parameter objects,
shapes, names and values; strides (2IH, 1, H) and (IH, 1, I), the memory of [E, 2I, H] and
[E, H, I] tensors), after which MoK's views of them are K-contiguous. Tensors that viewed the old
storage no longer share it; checkpoints and optimizers are unaffected. `unsupported_reason`
names what other experts modules need.
"""

from __future__ import annotations

import torch
from torch import nn

from mok.baseline import baseline_moe
from mok.config import MoKConfig, Precision, parse_enum
from mok.distributed import expert_parallel_group, group_rank_and_size
from mok.errors import MoKInputError
from mok.functional import Workspace
from mok.integrations._workspaces import (
    MIN_TOKENS,
    checked_config_options,
    compiled_call,
    workspace_for,
)
from mok.module import cast_for_autocast, moe
from mok.weights import MoEWeights

IMPLEMENTATION = "mok"
"""The name models take as `experts_implementation`."""
BASELINE_IMPLEMENTATION = "mok-baseline"
"""The standard expert-parallel path (`mok.baseline`) as an experts implementation."""
_ACTIVATIONS = ("SiLU", "SiLUActivation")
_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
_GROUP = "_mok_group"


def _is_gpt_oss(experts: nn.Module) -> bool:
    """gpt-oss's layout: gate_up_proj [E, H, 2I] with gate and up interleaved along 2I, biases,
    down_proj [E, I, H], and its activation's alpha and limit."""
    return (
        getattr(experts, "is_transposed", False)
        and not getattr(experts, "is_concatenated", True)
        and getattr(experts, "has_bias", False)
        and hasattr(experts, "alpha")
        and hasattr(experts, "limit")
    )


def _activation_options(experts: nn.Module) -> dict:
    """The MoKConfig fields of the module's experts' activation and biases: gpt-oss's limit,
    alpha, up offset 1 and biases; none (SwiGLU without biases) otherwise."""
    if not _is_gpt_oss(experts):
        return {}
    return dict(
        swiglu_limit=float(experts.limit),
        swiglu_alpha=float(experts.alpha),
        swiglu_up_offset=1.0,
        expert_bias=True,
    )


def unsupported_reason(experts: nn.Module) -> str | None:
    """Why MoK cannot run this transformers experts module, or None."""
    if not getattr(experts, "has_gate", True) or not hasattr(experts, "gate_up_proj"):
        return "experts without a gate projection are not supported"
    if _is_gpt_oss(experts):
        return None
    if getattr(experts, "has_bias", False):
        return "per-expert biases outside gpt-oss's layout are not supported"
    if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        return (
            "transposed or interleaved gate/up weights outside gpt-oss's layout are not supported"
        )
    activation = type(getattr(experts, "act_fn", None)).__name__
    if activation not in _ACTIVATIONS:
        return f"the activation {activation} is not SiLU (MoK computes SwiGLU)"
    return None


def _raise_if_unsupported(experts: nn.Module) -> None:
    reason = unsupported_reason(experts)
    if reason is not None:
        raise MoKInputError(f"{type(experts).__name__}: {reason}")


def shard_experts(model: nn.Module, group, max_tokens_per_rank: int = MIN_TOKENS) -> int:
    """Keep only this rank's experts in every experts module of `model` that MoK can run, for
    expert parallelism over `group` (a ProcessGroup or a one-dimensional DeviceMesh); a call may
    then pass at most `max_tokens_per_rank` tokens a rank (it sizes the exchange's buffers; more
    raises MoKInputError on every rank). Returns how many modules were sharded."""
    group = expert_parallel_group(group)
    rank, ep = group_rank_and_size(group)
    sharded = 0
    for module in model.modules():
        if not hasattr(module, "gate_up_proj") or unsupported_reason(module) is not None:
            continue
        num_experts = module.gate_up_proj.shape[0]
        if num_experts % ep:
            raise MoKInputError(
                f"{type(module).__name__}: {num_experts} experts cannot be split over {ep} ranks"
            )
        local = slice(rank * num_experts // ep, (rank + 1) * num_experts // ep)
        for name in _EXPERT_PARAMETERS:
            full = getattr(module, name, None)
            if full is not None:
                setattr(module, name, nn.Parameter(full.data[local].clone(), full.requires_grad))
        object.__setattr__(module, _GROUP, (group, local, num_experts, max_tokens_per_rank))
        module.register_load_state_dict_pre_hook(_load_local_experts)
        sharded += 1
    return sharded


def holds_local_experts(module: nn.Module) -> bool:
    """Whether `shard_experts` left `module` holding only this rank's experts."""
    return hasattr(module, _GROUP)


def _load_local_experts(module, state_dict, prefix, *_):
    """Slice full-size expert tensors of a checkpoint to this rank's experts."""
    _, local, num_experts, _ = getattr(module, _GROUP)
    for name in _EXPERT_PARAMETERS:
        key = prefix + name
        value = state_dict.get(key)
        if value is not None and value.shape[0] == num_experts != local.stop - local.start:
            state_dict[key] = value[local]


def _group(experts: nn.Module):
    sharding = getattr(experts, _GROUP, None)
    return None if sharding is None else sharding[0]


def _workspace(
    experts: nn.Module,
    weights: MoEWeights,
    hidden: torch.Tensor,
    top_k: int,
    backend: str,
    precision: str,
    options: dict,
) -> Workspace:
    """The module's workspace for this device, shape (its `weights`), call size, backend,
    precision and the user's other config `options`."""
    local_experts, inter, hidden_size = weights.gate.shape
    sharding = getattr(experts, _GROUP, None)
    group = None if sharding is None else sharding[0]
    _, ep = group_rank_and_size(group)
    if backend == "auto" and any(w.stride(-1) != 1 for w in (weights.gate, weights.down)):
        backend = "reference"  # the triton kernels read K-contiguous weights only
    config = MoKConfig.from_fields(
        hidden_size=hidden_size,
        intermediate_size=inter,
        num_experts=local_experts * ep,
        top_k=top_k,
        backend=backend,
        precision=precision,
        max_tokens_per_rank=hidden.shape[0] if sharding is None else sharding[3],
        **_activation_options(experts),
        **options,
    )
    return workspace_for(experts, config, group, hidden.device, fixed_tokens=sharding is not None)


_ACTIVATION_FIELDS = ("swiglu_limit", "swiglu_alpha", "swiglu_up_offset", "expert_bias")
"""MoKConfig fields the adapter also takes from the model (`_activation_options`)."""


def _forward(backend: str, precision: str, fuse_grad_accumulation: bool, options: dict):
    def experts_forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts of a transformers MoE block through `mok.moe`: [T, H] out."""
        _raise_if_unsupported(self)
        if getattr(self, "_is_expert_parallel", False):
            raise MoKInputError(
                f"{type(self).__name__}: transformers' own expert parallelism is on; use "
                "mok.integrations.transformers.shard_experts for MoK's"
            )
        weights = _weights(self)
        # Mixed precision with fp32 parameters: the layer computes in bf16, as autocast would.
        hidden_states, weights = cast_for_autocast(hidden_states, weights, torch.bfloat16)
        gate_up = _gate_up_of(self, weights)
        if torch.compiler.is_compiling():
            return compiled_call(
                self, hidden_states, top_k_index, top_k_weights, weights, gate_up=gate_up
            )
        top_k = top_k_index.shape[-1]
        workspace = _workspace(self, weights, hidden_states, top_k, backend, precision, options)
        # Fused accumulation reaches the parameters read whole (gate_up_proj, down_proj, a
        # bias); autograd adds the gradients of gpt-oss's views into theirs.
        return moe(
            hidden_states,
            top_k_index,
            top_k_weights,
            weights,
            workspace,
            fuse_grad_accumulation,
            gate_up=gate_up,
        )

    return experts_forward


def _store_k_contiguous(experts: nn.Module) -> None:
    """gpt-oss's gate_up_proj [E, H, 2I] and down_proj [E, I, H] stored again in place with H,
    then I, as their unit-stride dimension (see the module docstring); no-op once done, and
    while torch.compile traces (a compiled first call keeps the views it finds)."""
    if torch.compiler.is_compiling():
        return
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)
            if param.stride(1) != 1:
                param.data = param.data.transpose(1, 2).contiguous().transpose(1, 2)


def _weights(experts: nn.Module) -> MoEWeights:
    """The module's parameters as MoK's weights, views that share their storage."""
    if _is_gpt_oss(experts):
        _store_k_contiguous(experts)
        gate_up, bias = experts.gate_up_proj, experts.gate_up_proj_bias
        return MoEWeights(
            gate=gate_up[..., ::2].transpose(1, 2),
            up=gate_up[..., 1::2].transpose(1, 2),
            down=experts.down_proj.transpose(1, 2),
            gate_bias=bias[:, ::2],
            up_bias=bias[:, 1::2],
            down_bias=experts.down_proj_bias,
        )
    inter = experts.gate_up_proj.shape[1] // 2
    return MoEWeights(
        gate=experts.gate_up_proj[:, :inter],
        up=experts.gate_up_proj[:, inter:],
        down=experts.down_proj,
    )


def _gate_up_of(experts: nn.Module, weights: MoEWeights) -> torch.Tensor | None:
    """experts.gate_up_proj where the layer's gate and up are its halves (`_weights`: not
    gpt-oss's interleaved layout, and not cast per call by autocast), else None. Passed to the
    layer, its gradient comes as one tensor from the kernels, not as two views' gradients that
    autograd scatters into a third."""
    if _is_gpt_oss(experts) or weights.gate.dtype != experts.gate_up_proj.dtype:
        return None
    return experts.gate_up_proj


def _baseline_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The routed experts through `mok.baseline` (the standard expert-parallel path)."""
    _raise_if_unsupported(self)
    activation = _activation_options(self)
    activation.pop("expert_bias", None)  # the baseline adds the biases `_weights` holds
    return baseline_moe(
        hidden_states, top_k_index, top_k_weights, _weights(self), _group(self), **activation
    )


def register(
    backend: str = "auto",
    precision: str = "bf16",
    fuse_grad_accumulation: bool = True,
    **config_options,
) -> None:
    """Add "mok" to transformers' experts implementations (idempotent; a later call with other
    options replaces the earlier one). precision: the layer's ("bf16"; "mxfp8": the routed
    experts in MXFP8, which needs the hidden and expert intermediate sizes to be multiples of
    32). fuse_grad_accumulation: as `mok.moe`'s, in eager mode: once `gate_up_proj` or
    `down_proj` has a `.grad` (gradient accumulation over micro-batches), the kernels add into
    it in place; False where a tensor hook on them must see each micro-batch's gradient.
    config_options: other fields of every layer's `MoKConfig` or `MoKTuning` (`validation`,
    `graphs`, `mx_weight_casts`, ...; not those taken from the model: MoKConfigError)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    precision = parse_enum(Precision, precision, "precision")
    options = checked_config_options(config_options, _ACTIVATION_FIELDS)
    ALL_EXPERTS_FUNCTIONS.register(
        IMPLEMENTATION, _forward(backend, precision, fuse_grad_accumulation, options)
    )
    ALL_EXPERTS_FUNCTIONS.register(BASELINE_IMPLEMENTATION, _baseline_forward)
