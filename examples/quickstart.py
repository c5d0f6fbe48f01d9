"""MoK in a few lines: one MoE layer, forward and backward, then the functional API on the same
weights. Runs anywhere PyTorch does (on a CPU: the reference backend; on a CUDA GPU: the
triton backend, with device="cuda")."""

import torch

import mok

device = "cuda" if torch.cuda.is_available() else "cpu"
config = mok.get_preset("tiny").config()  # H 128, I 64, 8 experts, top-2, a shared expert
layer = mok.MoE(config, device=device)  # no group: one process owns all 8 experts

tokens = 64
x = torch.randn(tokens, config.hidden_size, dtype=torch.bfloat16, device=device)
x.requires_grad_(True)
router_logits = torch.randn(tokens, config.num_experts, device=device)
topk_weights, topk_idx = torch.softmax(router_logits, dim=-1).topk(config.top_k, dim=-1)

y = layer(x, topk_idx, topk_weights)  # [tokens, H] bf16
y.float().square().mean().backward()
print(f"y {tuple(y.shape)}, x.grad {tuple(x.grad.shape)}, gate.grad {tuple(layer.gate.grad.shape)}")

# The functional API, shaped like the published fused system's: schedule once per routing.
ws = layer.workspace(torch.device(device))
schedule = mok.build_schedule(ws, topk_idx)
y2, saved = mok.forward(ws, schedule, x.detach(), topk_weights, layer.weights)
grads = mok.backward(ws, schedule, saved, torch.ones_like(y2))  # a mok.MoEGradients
assert torch.equal(y2, y.detach())
print(
    f"backend {ws.backend_name}: functional y equals the module's; grads.x {tuple(grads.x.shape)}"
)
