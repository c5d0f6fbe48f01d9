"""Plain-PyTorch MoE layer: the numerics contract, the oracle for every kernel, and the fallback."""

from mok.reference.expert import expert_mlp, grouped_expert_mlp, swiglu
from mok.reference.moe import combine, moe_forward
from mok.reference.routing import ReferenceRouting, exchange_expert_counts, expert_counts

__all__ = [
    "ReferenceRouting",
    "combine",
    "exchange_expert_counts",
    "expert_counts",
    "expert_mlp",
    "grouped_expert_mlp",
    "moe_forward",
    "swiglu",
]
