"""MoK: fast Mixture-of-Experts layers for expert-parallel training.

The layers, bottom up: `mok.reference` (plain PyTorch, the oracle) -> kernels -> communication ->
`mok.functional` (config, workspace, schedule, forward, backward) -> `mok.module` (`mok.moe`,
`mok.MoE`) -> `mok bench` and the command line.
"""

from mok.backends import symmetric_buffer_bytes
from mok.config import (
    Backend,
    Dispatch,
    Graphs,
    MoKConfig,
    MoKTuning,
    MXWeightCasts,
    Precision,
    Recompute,
    RouterGradient,
    Validation,
)
from mok.errors import (
    BackendUnavailableError,
    MoKCapacityError,
    MoKConfigError,
    MoKInputError,
    MoKTimeoutError,
)
from mok.functional import (
    SavedForward,
    Schedule,
    Workspace,
    backward,
    build_schedule,
    create_workspace,
    forward,
    schedule_and_forward,
)
from mok.module import MoE, moe
from mok.presets import PRESETS, get_preset
from mok.weights import MoEGradients, MoEWeights

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "Backend",
    "BackendUnavailableError",
    "MoE",
    "MoEGradients",
    "MoEWeights",
    "MoKConfig",
    "MoKConfigError",
    "MoKTuning",
    "MoKCapacityError",
    "MoKInputError",
    "MoKTimeoutError",
    "Dispatch",
    "Graphs",
    "MXWeightCasts",
    "Precision",
    "Recompute",
    "RouterGradient",
    "Validation",
    "SavedForward",
    "Schedule",
    "Workspace",
    "backward",
    "build_schedule",
    "create_workspace",
    "forward",
    "get_preset",
    "moe",
    "schedule_and_forward",
    "symmetric_buffer_bytes",
]
