"""Triton kernels of MoK (Hopper GPUs; the CPU interpreter runs them for tests).

`expert_mlp_forward` / `expert_mlp_backward`: the expert MLP on rows grouped by local expert.
`grouped_gemm`: the @triton.jit tile functions and persistent kernels behind them.
`warp_specialized`: Gluon versions of all six products for Hopper (in use there), with the same
A-row sources and epilogues.
`mx`: the MXFP8 cast (`mx_quantize`, and tile functions for epilogues).
"""

from mok.kernels.expert_mlp import (
    ExpertKernelConfig,
    ExpertMLPSaved,
    default_config,
    expert_mlp_backward,
    expert_mlp_forward,
)
from mok.kernels.grouped_gemm import GemmTiles

__all__ = [
    "ExpertKernelConfig",
    "ExpertMLPSaved",
    "GemmTiles",
    "default_config",
    "expert_mlp_backward",
    "expert_mlp_forward",
]
