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

import importlib

_EXPORTS = {
    "ExpertKernelConfig": "expert_mlp",
    "ExpertMLPSaved": "expert_mlp",
    "add_down_bias_dots": "expert_mlp",
    "default_config": "expert_mlp",
    "down_data_gradient": "expert_mlp",
    "down_weight_gradient": "expert_mlp",
    "expert_bias_gradients": "expert_mlp",
    "expert_mlp_backward": "expert_mlp",
    "expert_mlp_forward": "expert_mlp",
    "gate_up_data_gradient": "expert_mlp",
    "gate_up_weight_gradients": "expert_mlp",
    "weighted_down_data_gradient": "expert_mlp",
    "SWIGLU": "host",
    "Activation": "host",
    "GemmTiles": "host",
}
"""Name -> the submodule defining it. Imported on first use (PEP 562): Triton is optional, and
the Triton-free submodules (`constants`, `formats`, `_triton_compat`) serve hosts without it."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mok.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mok.kernels.{module}"), name)
