"""Checks of the tensors handed to the layer. Each check returns a message naming the problem, or
None; the caller raises, after telling the other ranks (see `mok.distributed`), so that a bad input
on one rank never leaves the others waiting."""

from __future__ import annotations

import torch

from mok.config import MoKConfig
from mok.weights import MoEWeights, has_contiguous_expert_rows

INDEX_DTYPES = (torch.int32, torch.int64)
_AUTOCAST_HINT = "torch.autocast(device_type, dtype=torch.bfloat16), which casts them per call"


def _check_tensor(
    name: str,
    value,
    shape: tuple[int, ...],
    device: torch.device,
    dtypes: tuple[torch.dtype, ...] | None = None,
    floating: bool = False,
    dtype_hint: str = "",
) -> str | None:
    if not isinstance(value, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(value).__name__}"
    if tuple(value.shape) != tuple(shape):
        return f"{name} has shape {tuple(value.shape)}, expected {tuple(shape)}"
    if dtypes is not None and value.dtype not in dtypes:
        expected = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        hint = f" ({dtype_hint})" if dtype_hint and value.dtype == torch.float32 else ""
        return (
            f"{name} has dtype {str(value.dtype).removeprefix('torch.')}, expected {expected}{hint}"
        )
    if floating and not value.is_floating_point():
        return f"{name} must be a floating-point tensor, got {value.dtype}"
    if value.device != device:
        return f"{name} is on {value.device}, but the layer runs on {device}"
    return None


def check_routing(
    config: MoKConfig, topk_idx, device: torch.device, check_ids: bool = True
) -> str | None:
    """topk_idx must be [T, k] int32/int64 on `device` with every id in [0, E).

    With check_ids, reads the minimum and maximum id back to the host (a synchronization on GPUs);
    backends that check the ids on the device pass False."""
    if not isinstance(topk_idx, torch.Tensor):
        return f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}"
    if topk_idx.dim() != 2 or topk_idx.shape[1] != config.top_k:
        return f"topk_idx has shape {tuple(topk_idx.shape)}, expected [T, top_k={config.top_k}]"
    problem = _check_tensor(
        "topk_idx", topk_idx, tuple(topk_idx.shape), device, dtypes=INDEX_DTYPES
    )
    if problem or topk_idx.numel() == 0 or not check_ids:
        return problem
    low, high = (int(v) for v in torch.aminmax(topk_idx))
    if low < 0 or high >= config.num_experts:
        bad = low if low < 0 else high
        return f"topk_idx holds expert id {bad}, outside [0, num_experts={config.num_experts})"
    return None


def check_tokens(
    config: MoKConfig, x, topk_weights, num_tokens: int, device: torch.device
) -> str | None:
    """x must be [T, H] bf16 and topk_weights [T, k] floating point, both on `device`, with T the
    token count the schedule was built for."""
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] != num_tokens:
        return (
            f"x has {x.shape[0]} tokens but the schedule was built from topk_idx with {num_tokens}"
        )
    return _check_tensor(
        "x",
        x,
        (num_tokens, config.hidden_size),
        device,
        dtypes=(config.activation_dtype,),
        dtype_hint=f"fp32 activations: cast them, or run under {_AUTOCAST_HINT}",
    ) or _check_tensor(
        "topk_weights", topk_weights, (num_tokens, config.top_k), device, floating=True
    )


def expected_weight_shapes(
    config: MoKConfig, local_experts: int
) -> dict[str, tuple[int, ...] | None]:
    """Field of MoEWeights -> the shape it must have (None: must be absent)."""
    h, i, s = config.hidden_size, config.intermediate_size, config.shared_intermediate_size
    shapes: dict[str, tuple[int, ...] | None] = {
        "gate": (local_experts, i, h),
        "up": (local_experts, i, h),
        "down": (local_experts, h, i),
    }
    shared = {"shared_gate": (s, h), "shared_up": (s, h), "shared_down": (h, s)}
    for name, shape in shared.items():
        shapes[name] = shape if config.has_shared_expert else None
    biases = {"gate_bias": (local_experts, i), "up_bias": (local_experts, i)}
    biases["down_bias"] = (local_experts, h)
    for name, shape in biases.items():
        shapes[name] = shape if config.expert_bias else None
    return shapes


def check_weights(
    config: MoKConfig, weights, local_experts: int, device: torch.device
) -> str | None:
    """Every weight present with the shape of `expected_weight_shapes`, bf16, on `device`."""
    if not isinstance(weights, MoEWeights):
        return f"weights must be a mok.MoEWeights, got {type(weights).__name__}"
    for name, shape in expected_weight_shapes(config, local_experts).items():
        value = getattr(weights, name)
        if name.endswith("_bias"):
            absent, present = "no expert biases (expert_bias=False)", "expert biases"
        else:
            absent, present = "no shared expert (shared_intermediate_size=0)", "a shared expert"
        if shape is None:
            if value is not None:
                return f"weights.{name} is given, but the config has {absent}"
            continue
        if value is None:
            return f"weights.{name} is missing: the config has {present}"
        problem = _check_tensor(
            f"weights.{name}",
            value,
            shape,
            device,
            dtypes=(config.activation_dtype,),
            dtype_hint=f"fp32 parameters: run the layer under {_AUTOCAST_HINT}",
        )
        if problem:
            return problem
    return None


GRADIENT_BUFFER_DTYPES = (torch.float32, torch.bfloat16)


def check_accumulation_buffers(
    config: MoKConfig, buffers, local_experts: int, device: torch.device
) -> str | None:
    """`buffers` (weight field -> tensor) must name weights the layer has, each an fp32 or bf16
    tensor of that weight's shape on `device`, contiguous or (routed weights) with each expert's
    rows contiguous, as the halves of gate_up's gradient are: the gradient is added into it in
    place."""
    if not isinstance(buffers, dict):
        return (
            f"accumulate_into must be a dict of weight name -> tensor, got {type(buffers).__name__}"
        )
    shapes = expected_weight_shapes(config, local_experts)
    for name, buffer in buffers.items():
        if shapes.get(name) is None:
            return f"accumulate_into names {name!r}, which is not a weight of this layer"
        # mok.MoE passes a parameter's main_grad (or .grad) here: name both.
        label = f"the gradient buffer of weights.{name} (accumulate_into[{name!r}] or main_grad)"
        problem = _check_tensor(label, buffer, shapes[name], device, GRADIENT_BUFFER_DTYPES)
        if problem is None and not (buffer.is_contiguous() or has_contiguous_expert_rows(buffer)):
            problem = (
                f"{label} must be contiguous, or each expert's rows contiguous (a half of "
                "gate_up's [E, 2I, H] gradient): the gradient is added into it in place"
            )
        if problem:
            return problem
    return None


def check_grad_output(grad_y, num_tokens: int, config: MoKConfig, device) -> str | None:
    """The gradient of the output must be [T, H] on `device`, floating point."""
    return _check_tensor(
        "grad_output", grad_y, (num_tokens, config.hidden_size), device, floating=True
    )
