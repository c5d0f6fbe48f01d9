"""Layer shapes of published models, used by `mok bench` and the tests."""

from __future__ import annotations

import dataclasses

from mok.config import MoKConfig
from mok.errors import MoKConfigError


@dataclasses.dataclass(frozen=True)
class Preset:
    """One MoE layer shape from a model's published config: the shape fields are the
    `MoKConfig` fields of the same names."""

    name: str
    """What `mok bench --preset` and `get_preset` take."""
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    shared_intermediate_size: int = 0
    default_tokens: int = 8192
    """Tokens per rank the benchmark uses unless told otherwise."""
    expert_options: tuple[tuple[str, object], ...] = ()
    """MoKConfig fields of the experts' activation and biases where they are not plain SwiGLU
    without biases (gpt-oss's), as (name, value) pairs."""

    def config(self, **overrides) -> MoKConfig:
        """The MoKConfig of this layer; `overrides` set other fields (precision, backend, ...)."""
        fields = dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_experts=self.num_experts,
            top_k=self.top_k,
            shared_intermediate_size=self.shared_intermediate_size,
            **dict(self.expert_options),
        )
        fields.update(overrides)
        return MoKConfig.from_fields(**fields)


GPT_OSS_EXPERTS = (
    ("swiglu_limit", 7.0),
    ("swiglu_alpha", 1.702),
    ("swiglu_up_offset", 1.0),
    ("expert_bias", True),
)
"""gpt-oss's experts: gate * sigmoid(1.702 * gate) * (up + 1) after the clamp at 7, with biases on
gate, up and down."""


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset("tiny", 128, 64, 8, 2, shared_intermediate_size=64),
        Preset("qwen3-30b-a3b", 2048, 768, 128, 8, default_tokens=16384),
        Preset("qwen3-235b-a22b", 4096, 1536, 128, 8),
        Preset("deepseek-v3", 7168, 2048, 256, 8, shared_intermediate_size=2048),
        Preset("kimi-k2", 7168, 2048, 384, 8, shared_intermediate_size=2048),
        Preset("mixtral-8x7b", 4096, 14336, 8, 2),
        Preset("gpt-oss-20b", 2880, 2880, 32, 4, expert_options=GPT_OSS_EXPERTS),
        Preset("gpt-oss-120b", 2880, 2880, 128, 4, expert_options=GPT_OSS_EXPERTS),
    )
}


def get_preset(name: str) -> Preset:
    """The preset called `name`; MoKConfigError (a ValueError) lists the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise MoKConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
