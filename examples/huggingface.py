"""A Hugging Face MoE model (a tiny Qwen3-MoE built from a config in code) with MoK as its
experts implementation, next to the same model with its native experts."""

import copy

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import mok.integrations.transformers as mok_transformers

mok_transformers.register()  # adds experts_implementation="mok"
config = Qwen3MoeConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, experts_implementation="mok")
# The native model to compare with: a deep copy, which has its own config. Two models built by
# from_config(config) share that config object (a.config is b.config), and with it the experts
# implementation: setting "eager" on one would switch the other too.
native = copy.deepcopy(model)
native.set_experts_implementation("eager")

ids = torch.randint(0, config.vocab_size, (2, 16))
logits = model(ids).logits
logits.float().square().mean().backward()  # gradients reach the model's own parameters
difference = (logits.float() - native(ids).logits.float()).abs().max().item()
print(f"logits {tuple(logits.shape)}; largest difference from the native experts: {difference:.3f}")
