"""Triton kernels of MoK (Hopper GPUs; the CPU interpreter runs them for tests).

`expert_mlp_forward` / `expert_mlp_backward`: the expert MLP on rows grouped by local expert (the
backward also product by product, `down_data_gradient`, `down_weight_gradient`,
`gate_up_weight_gradients`, `gate_up_data_gradient`; `expert_bias_gradients` for experts with
biases; `weighted_down_data_gradient` and `add_down_bias_dots` for the router weights applied
after the down product), SwiGLU or gpt-oss's `Activation`.
`grouped_gemm`: the @triton.jit tile functions and persistent kernels behind them.
`warp_specialized`: Gluon versions of all six products for Hopper (in use there), with the same
A-row sources and epilogues.
`mx`: the MXFP8 casts (bytes and scales, or the values they represent: the operands of bf16
GEMMs that compute MX products exactly) and their inverse; `mx_expert_mlp`: the expert MLP in
MXFP8 on the bf16 kernels fed with those casts.
"""

from mok.kernels.expert_mlp import (
    ExpertKernelConfig,
    ExpertMLPSaved,
    add_down_bias_dots,
    default_config,
    down_data_gradient,
    down_weight_gradient,
    expert_bias_gradients,
    expert_mlp_backward,
    expert_mlp_forward,
    gate_up_data_gradient,
    gate_up_weight_gradients,
    weighted_down_data_gradient,
)
from mok.kernels.grouped_gemm import SWIGLU, Activation, GemmTiles

__all__ = [
    "SWIGLU",
    "Activation",
    "ExpertKernelConfig",
    "ExpertMLPSaved",
    "GemmTiles",
    "add_down_bias_dots",
    "default_config",
    "down_data_gradient",
    "down_weight_gradient",
    "expert_bias_gradients",
    "expert_mlp_backward",
    "expert_mlp_forward",
    "gate_up_data_gradient",
    "gate_up_weight_gradients",
    "weighted_down_data_gradient",
]
