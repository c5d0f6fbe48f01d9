"""FSDP2 over a data x expert parallel mesh: a block holding `mok.MoE`, its expert group the
mesh's "ep" dimension, the routed experts sharded by FSDP2 over "dp" and the rest of the block
over all ranks. Runs on 4 CPU processes (gloo); on a GPU host, run `main` under torchrun with
device_type "cuda" and one process per GPU."""

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import mok
from mok.ranks import run_ranks

config = mok.MoKConfig(hidden_size=32, intermediate_size=16, num_experts=4, top_k=2)


class Block(nn.Module):
    """x + MoE(proj(x)), routed by a softmax over the router's logits."""

    def __init__(self, group, device):
        super().__init__()
        hidden = config.hidden_size
        self.proj = nn.Linear(hidden, hidden, device=device, dtype=torch.bfloat16)
        self.router = nn.Linear(hidden, config.num_experts, device=device, dtype=torch.bfloat16)
        self.moe = mok.MoE(config, group=group, device=device)  # this rank's experts

    def forward(self, x):
        h = self.proj(x)
        weights, idx = self.router(h).float().softmax(-1).topk(config.top_k, dim=-1)
        return x + self.moe(h, idx, weights)


def main(rank, world, dp, ep, device_type="cpu"):
    device = torch.device(device_type, rank if device_type == "cuda" else 0)
    mesh = init_device_mesh(device_type, (dp, ep), mesh_dim_names=("dp", "ep"))
    everyone = init_device_mesh(device_type, (world,), mesh_dim_names=("all",))
    block = Block(group=mesh["ep"], device=device)
    fully_shard(block.moe, mesh=mesh["dp"])  # routed experts: sharded and averaged over "dp"
    fully_shard(block, mesh=everyone)  # the projection and the router: over all ranks

    x = torch.randn(16, config.hidden_size, dtype=torch.bfloat16, device=device)
    block(x).float().square().mean().backward()
    return {name: tuple(p.grad.to_local().shape) for name, p in block.named_parameters()}


if __name__ == "__main__":
    shards = run_ranks(main, 4, args=(2, 2))  # DP 2 x EP 2 on gloo
    print(f"rank 0 holds these gradient shards: {shards[0]}")
