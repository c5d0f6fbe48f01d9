"""Where the time of one MoE layer call goes: the CUDA kernels of one forward + backward, by kernel.

    python benchmarks/profile_layer.py [--preset deepseek-v3] [--backend triton] [--tokens N]

Spawns one rank per GPU (EP = the GPU count), warms up, then profiles one forward + backward with
torch.profiler on every rank and prints rank 0's kernels sorted by total CUDA time.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import mok
from mok.launch import run_ranks
from mok.routing import make_routing
from mok.testing import global_weights


def profile_rank(rank, world, preset_name, backend, tokens, rows):
    device = torch.device("cuda", rank)
    preset = mok.get_preset(preset_name)
    tokens = tokens or preset.default_tokens
    config = preset.config(backend=backend, max_tokens_per_rank=tokens)
    layer = mok.MoE(config, group=dist.group.WORLD if world > 1 else None, device=device)
    layer.load_global_weights(global_weights(config, 0, device))
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, config.hidden_size, generator=generator).to(device, torch.bfloat16)
    idx, w = make_routing("uniform", tokens, config.num_experts, config.top_k, generator)
    idx, w = idx.to(device), w.to(device)
    grad_y = torch.randn_like(x)

    def step():
        xx = x.detach().requires_grad_(True)
        ww = w.detach().requires_grad_(True)
        layer(xx, idx, ww).backward(grad_y)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    world = torch.cuda.device_count()
    tables = run_ranks(
        profile_rank,
        world,
        args=(args.preset, args.backend, args.tokens, args.rows),
        backend="nccl",
    )
    print(f"{args.preset}, backend {args.backend}, EP {world}, rank 0:")
    print(tables[0])


if __name__ == "__main__":
    main()
