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
`gate_up_proj` and `down_proj` are the layer's weights (gate and up as views of `gate_up_proj`),
so `state_dict()` keys, checkpoints and optimizers are those of the original model. The layer runs
on one process (all experts local, as the model holds them); the backend is the config's `auto`
(the `triton` backend on GPUs) unless `register(backend=...)` says otherwise.

Supported: SwiGLU experts with concatenated [gate; up] weights and no biases, in bf16. Not yet:
gpt-oss (transposed, interleaved gate/up weights, per-expert biases and its clamped activation):
`unsupported_reason` names what a model's experts need.
"""

from __future__ import annotations

import torch
from torch import nn

from mok.config import MoKConfig
from mok.errors import MoKInputError
from mok.functional import Workspace, create_workspace
from mok.module import moe
from mok.weights import MoEWeights

IMPLEMENTATION = "mok"
"""The name models take as `experts_implementation`."""
MIN_TOKENS = 8192
"""Tokens per call the workspace is first sized for; a larger call makes a larger one."""
_ACTIVATIONS = ("SiLU", "SiLUActivation")
_STATE = "_mok_state"


def unsupported_reason(experts: nn.Module) -> str | None:
    """Why MoK cannot run this transformers experts module, or None."""
    if getattr(experts, "has_bias", False):
        return "per-expert biases (gpt-oss) are not supported yet"
    if getattr(experts, "is_transposed", False):
        return "transposed expert weights ([E, H, 2I], gpt-oss) are not supported yet"
    if not getattr(experts, "is_concatenated", True):
        return "interleaved gate/up weights are not supported yet"
    if not getattr(experts, "has_gate", True) or not hasattr(experts, "gate_up_proj"):
        return "experts without a gate projection are not supported"
    activation = type(getattr(experts, "act_fn", None)).__name__
    if activation not in _ACTIVATIONS:
        return f"the activation {activation} is not SiLU (MoK computes SwiGLU)"
    return None


def _workspace(experts: nn.Module, hidden: torch.Tensor, top_k: int, backend: str) -> Workspace:
    """The module's workspace for this device and shape, made again when a call needs more tokens
    than the current one is sized for."""
    num_experts, two_inter, hidden_size = experts.gate_up_proj.shape
    tokens = hidden.shape[0]
    state = getattr(experts, _STATE, None)
    if state is not None:
        workspace = state
        config = workspace.config
        if (
            workspace.device == hidden.device
            and config.top_k == top_k
            and config.max_tokens_per_rank >= tokens
        ):
            return workspace
        workspace.release()
    config = MoKConfig(
        hidden_size=hidden_size,
        intermediate_size=two_inter // 2,
        num_experts=num_experts,
        top_k=top_k,
        backend=backend,
        max_tokens_per_rank=max(MIN_TOKENS, 1 << max(tokens - 1, 0).bit_length()),
    )
    workspace = create_workspace(config, None, hidden.device)
    object.__setattr__(experts, _STATE, workspace)  # not a submodule, not in the state dict
    return workspace


def _forward(backend: str):
    def experts_forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts of a transformers MoE block through `mok.moe`: [T, H] out."""
        reason = unsupported_reason(self)
        if reason is not None:
            raise MoKInputError(f"{type(self).__name__}: {reason}")
        if getattr(self, "_is_expert_parallel", False):
            raise MoKInputError(
                f"{type(self).__name__}: transformers' own expert parallelism is on; MoK's "
                "experts implementation runs the model's experts on one process"
            )
        inter = self.gate_up_proj.shape[1] // 2
        weights = MoEWeights(
            gate=self.gate_up_proj[:, :inter],
            up=self.gate_up_proj[:, inter:],
            down=self.down_proj,
        )
        workspace = _workspace(self, hidden_states, top_k_index.shape[-1], backend)
        # Autograd adds the gradients of the two views into gate_up_proj's: no fused accumulation.
        return moe(hidden_states, top_k_index, top_k_weights, weights, workspace, False)

    return experts_forward


def register(backend: str = "auto") -> None:
    """Add "mok" to transformers' experts implementations (idempotent; a later call with another
    backend replaces the earlier one)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _forward(backend))
