"""The workspaces of adapted model modules: one per module, held beside it (a deep copy of a model
must not copy a workspace, whose buffers and group belong to the original)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mok import ops
from mok.config import TUNING_FIELDS, MoKConfig
from mok.errors import MoKConfigError, MoKInputError
from mok.functional import Workspace, create_workspace

MIN_TOKENS = 8192
"""Tokens per call a workspace is first sized for, without a fixed size; a larger call makes a
larger one."""
_SLOT = "_mok_workspace"


SET_BY_ADAPTERS = (
    "hidden_size",
    "intermediate_size",
    "num_experts",
    "top_k",
    "backend",
    "precision",
    "max_tokens_per_rank",
)
"""MoKConfig fields every adapter sets from the model and its own arguments."""


def checked_config_options(options: dict, also_set: tuple[str, ...] = ()) -> dict:
    """`options` (fields of MoKConfig or MoKTuning an adapter's user sets: `validation`,
    `mx_weight_casts`, `graphs`, `comm_sms`, ...), refused with MoKConfigError where they name no
    field or one the adapter takes from the model (`SET_BY_ADAPTERS`, and that adapter's
    `also_set`); values are checked when the config is made."""
    fields = {field.name for field in dataclasses.fields(MoKConfig)} | TUNING_FIELDS
    for name in options:
        if name not in fields:
            raise MoKConfigError(f"{name!r} is not a MoKConfig or MoKTuning field")
        if name in SET_BY_ADAPTERS or name in also_set:
            raise MoKConfigError(f"{name!r} is taken from the model; it cannot be set here")
    return dict(options)


def _slot(owner: nn.Module) -> ops.WorkspaceSlot:
    slot = getattr(owner, _SLOT, None)
    if slot is None:
        slot = ops.WorkspaceSlot()
        # In the module's own attributes, not a module-level weak table: torch.compile guards on
        # such a table's entries by position, which move when another module's entry goes.
        setattr(owner, _SLOT, slot)
    return slot


def workspace_for(
    owner: nn.Module, config: MoKConfig, group, device: torch.device, fixed_tokens: bool
) -> Workspace:
    """`owner`'s workspace for `config` on `device` over `group`, made again when any of them
    changed or, unless `fixed_tokens`, when a call needs more tokens than it is sized for (`config`
    then names this call's tokens; with `fixed_tokens` every rank passes the same size, so that
    the ranks agree without a round trip per call)."""
    if not fixed_tokens:
        tokens = config.max_tokens_per_rank
        config = config.replace(
            max_tokens_per_rank=max(MIN_TOKENS, 1 << max(tokens - 1, 0).bit_length())
        )
    slot = _slot(owner)
    workspace = slot.workspace
    if workspace is not None:
        if (
            workspace.device == device
            and workspace.group is group
            and workspace.config.replace(max_tokens_per_rank=config.max_tokens_per_rank) == config
            and workspace.config.max_tokens_per_rank >= config.max_tokens_per_rank
        ):
            return workspace
        workspace.release()
    return slot.hold(create_workspace(config, group, device))


def cached(owner: nn.Module) -> Workspace | None:
    """`owner`'s current workspace, if any."""
    slot = getattr(owner, _SLOT, None)
    return None if slot is None else slot.workspace


def compiled_call(
    owner: nn.Module, x, topk_idx, topk_weights, weights, gate_up=None
) -> torch.Tensor:
    """y [T, H] of `owner`'s layer through the custom ops of `mok.ops`, what torch.compile
    traces: on the workspace an eager call made (making one is a collective, outside a trace);
    gate_up as in `mok.moe`."""
    slot = getattr(owner, _SLOT, None)
    if slot is None or slot.workspace is None:
        raise MoKInputError(
            f"torch.compile of {type(owner).__name__} with MoK needs its workspace made first: "
            "run the model once eagerly before compiling"
        )
    return ops.moe(x, topk_idx, topk_weights, weights, slot.workspace_id, gate_up)
