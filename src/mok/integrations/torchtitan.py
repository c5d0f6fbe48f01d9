"""TorchTitan: MoK behind its routed-experts seam.

TorchTitan's MoE (`torchtitan.models.common.moe.MoE`) routes with its own router, then calls a
`RoutedExperts` module: a token dispatcher (reorder, and all-to-all under expert parallelism), the
`GroupedExperts` (w1 [E, F, D] gate, w3 [E, F, D] up, w2 [E, D, F] down: MoK's layout), and the
combine that weights the expert outputs by the router's scores. `use_mok(model)` makes every
`RoutedExperts` of `model` run those three steps as one `mok.moe` call on the same parameters;
the router, the shared experts, the load-balancing buffers and the parameter names stay
TorchTitan's:

    from mok.integrations import torchtitan as mok_torchtitan
    mok_torchtitan.use_mok(model)                      # one process
    mok_torchtitan.use_mok(model, group=ep_mesh)       # parameters holding this rank's experts

With a group, the experts' parameters must hold this rank's E / ep experts (as TorchTitan's
expert-parallel sharding leaves them; DTensors are read through `to_local()`), and every call may
pass at most `max_tokens_per_rank` tokens a rank. Under TorchTitan's own expert parallelism, call
`use_mok(model, group=parallel_dims.get_optional_mesh("ep"))` before `model.parallelize(
parallel_dims)`: parallelize wraps each module's forward (redistribution and `local_map`), and
wraps MoK's that way; after it, `use_mok` raises (it could not take the forward over).

TorchTitan 0.3.0 is built against PyTorch nightlies: its MoE layer runs on PyTorch 2.11, but its
model builders, FSDP wrapping and all-to-all dispatcher read newer PyTorch APIs (`missing_torch_
features` names them for the PyTorch at hand). The adapter itself needs none of them.
"""

from __future__ import annotations

import torch
from torch import nn

from mok.config import MoKConfig, Precision, parse_enum
from mok.distributed import expert_parallel_group, group_rank_and_size
from mok.errors import MoKInputError
from mok.integrations._workspaces import (
    MIN_TOKENS,
    checked_config_options,
    compiled_call,
    workspace_for,
)
from mok.module import cast_for_autocast, moe
from mok.weights import MoEWeights


def _local(parameter: torch.Tensor) -> torch.Tensor:
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


class _MoKRoutedExperts(nn.Module):
    """A TorchTitan RoutedExperts (its class swapped for this one) whose forward is `mok.moe`."""

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
        """x [B, L, D], scores and expert ids [B, L, K] -> [B, L, D]; the token counts per expert
        that TorchTitan's dispatcher takes are not needed."""
        del num_local_tokens_per_expert_E
        batch, length, dim = x_BLD.shape
        top_k = topk_expert_ids_BLK.shape[-1]
        experts = self.inner_experts
        weights = MoEWeights(
            gate=_local(experts.w1_EFD), up=_local(experts.w3_EFD), down=_local(experts.w2_EDF)
        )
        x, weights = cast_for_autocast(x_BLD.reshape(-1, dim), weights, torch.bfloat16)
        x = x.to(weights.gate.dtype)
        ids = topk_expert_ids_BLK.reshape(-1, top_k)
        scores = topk_scores_BLK.reshape(-1, top_k)
        if torch.compiler.is_compiling():
            y = compiled_call(self, x, ids, scores, weights)
        else:
            workspace = self._workspace(weights, x.shape[0], top_k, x.device)
            y = moe(x, ids, scores, weights, workspace, self._mok_fuse_grad_accumulation)
        return y.to(x_BLD.dtype).view(batch, length, dim)

    def _workspace(self, weights: MoEWeights, tokens: int, top_k: int, device: torch.device):
        """The module's workspace for its weights' shape and a call of `tokens` tokens."""
        group, backend, max_tokens, precision = self._mok
        _, ep = group_rank_and_size(group)
        local_experts, hidden_dim, dim = weights.gate.shape
        config = MoKConfig.from_fields(
            hidden_size=dim,
            intermediate_size=hidden_dim,
            num_experts=local_experts * ep,
            top_k=top_k,
            backend=backend,
            precision=precision,
            max_tokens_per_rank=max_tokens or tokens,
            **self._mok_config_options,
        )
        return workspace_for(self, config, group, device, max_tokens is not None)


# What TorchTitan 0.3.0's model code reads from PyTorch beyond PyTorch 2.11, as (module, name).
_TITAN_TORCH_FEATURES = (
    ("torch.distributed.fsdp", "DataParallelMeshDims"),  # models/*/parallelize.py
    ("torch.compiler", "_is_non_strict_tracing"),  # its AllToAllTokenDispatcher
)


def missing_torch_features() -> list[str]:
    """The PyTorch APIs TorchTitan 0.3.0's models, parallelism and token dispatcher use that this
    PyTorch lacks, as dotted names (empty where TorchTitan's own code runs)."""
    import importlib

    return [
        f"{module}.{name}"
        for module, name in _TITAN_TORCH_FEATURES
        if not hasattr(importlib.import_module(module), name)
    ]


def use_mok(
    model: nn.Module,
    group=None,
    backend: str = "auto",
    max_tokens_per_rank: int = MIN_TOKENS,
    precision: str = "bf16",
    fuse_grad_accumulation: bool = True,
    **config_options,
) -> int:
    """Run every TorchTitan RoutedExperts of `model` through MoK (expert parallelism over `group`,
    a ProcessGroup or a one-dimensional DeviceMesh, when given), at `precision` ("bf16";
    "mxfp8": the routed experts in MXFP8, dim and hidden_dim multiples of 32).
    fuse_grad_accumulation: as `mok.moe`'s, in eager mode, for w1, w3 and w2 where they are
    plain parameters (a DTensor's local shard is not a leaf: autograd adds its gradient).
    config_options: other fields of every layer's `MoKConfig` or `MoKTuning` (`validation`,
    `graphs`, `mx_weight_casts`, ...; not those taken from the model: MoKConfigError). Returns
    how many were switched."""
    from torchtitan.models.common.moe import RoutedExperts

    precision = parse_enum(Precision, precision, "precision")
    options = checked_config_options(config_options)
    group = expert_parallel_group(group)
    switched = 0
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            if "forward" in vars(module) or getattr(module, "_parallelized", False):
                # parallelize() wrapped the bound forward of the original class in an instance
                # attribute: a class swap now would leave TorchTitan's path running, silently.
                raise MoKInputError(
                    "mok_torchtitan.use_mok must run before TorchTitan's parallelize(): "
                    f"{type(module).__name__} already has its forward wrapped"
                )
            module.__class__ = type("MoKRoutedExperts", (_MoKRoutedExperts, type(module)), {})
            max_tokens = None if group is None else max_tokens_per_rank
            module._mok = (group, backend, max_tokens, precision)
            module._mok_fuse_grad_accumulation = fuse_grad_accumulation
            module._mok_config_options = options
            switched += 1
    return switched
