"""Triton kernels of MoK (Hopper GPUs; the CPU interpreter runs them for tests).

`expert_mlp_forward` / `expert_mlp_backward`: the expert MLP on rows grouped by local expert (the
backward also in its two halves, `expert_mlp_data_gradients` and `expert_mlp_weight_gradients`).
`grouped_gemm`: the @triton.jit tile functions and persistent kernels behind them.
`warp_specialized`: Gluon versions of all six products for Hopper (in use there), with the same
A-row sources and epilogues.
`mx`: the MXFP8 cast (`mx_quantize`, and tile functions for epilogues) and its inverse
(`mx_dequantize_tile`, for the operands of MX products); `mx_grouped_gemm`: the forward
products in MXFP8 (interpretable twins; not yet in a backend).
"""

from mok.kernels.expert_mlp import (
    ExpertKernelConfig,
    ExpertMLPSaved,
    default_config,
    expert_mlp_backward,
    expert_mlp_data_gradients,
    expert_mlp_forward,
    expert_mlp_weight_gradients,
)
from mok.kernels.grouped_gemm import GemmTiles

__all__ = [
    "ExpertKernelConfig",
    "ExpertMLPSaved",
    "GemmTiles",
    "default_config",
    "expert_mlp_backward",
    "expert_mlp_data_gradients",
    "expert_mlp_forward",
    "expert_mlp_weight_gradients",
]
