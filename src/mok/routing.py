"""Synthetic routings for benchmarks and tests: (topk_idx [T, k] int64, topk_weights [T, k] fp32).

All take a `torch.Generator` so that every rank can rebuild any rank's routing.
"""

from __future__ import annotations

import torch

ROUTINGS = ("uniform", "zipf", "one-expert", "half-empty", "first-experts")


def _top_k_of_logits(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of a softmax, weights renormalized over the k picks (as DeepSeek and Qwen3 do)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, idx = torch.topk(probs, top_k, dim=-1)
    return idx, weights / weights.sum(-1, keepdim=True)


def random_weights(tokens: int, top_k: int, generator: torch.Generator, device) -> torch.Tensor:
    """Router weights in (0, 1] summing to 1 over k."""
    weights = torch.rand(tokens, top_k, generator=generator, device=device) + 0.05
    return weights / weights.sum(-1, keepdim=True)


def make_routing(
    kind: str,
    tokens: int,
    num_experts: int,
    top_k: int,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing of `tokens` tokens over `num_experts` experts.

    uniform        top-k of a softmax over standard normal logits (near-uniform expert load)
    zipf           expert e drawn with probability proportional to 1 / (e + 1): a few hot experts
    one-expert     every token's first pick is expert 0, the others distinct random experts
    half-empty     only the even experts receive tokens (when there are at least 2k of them)
    first-experts  the k picks are the first k experts: all load on the first rank(s)
    """
    if kind == "uniform":
        logits = torch.randn(tokens, num_experts, generator=generator, device=device)
        return _top_k_of_logits(logits, top_k)
    if kind == "zipf":
        popularity = 1.0 / torch.arange(1, num_experts + 1, device=device, dtype=torch.float32)
        # Gumbel-top-k samples k distinct experts with probabilities proportional to popularity.
        uniform = torch.rand(tokens, num_experts, generator=generator, device=device)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-20)))
        idx = torch.topk(popularity.log() + gumbel, top_k, dim=-1).indices
        return idx, random_weights(tokens, top_k, generator, device)
    if kind == "one-expert":
        keys = torch.rand(tokens, num_experts - 1, generator=generator, device=device)
        others = torch.argsort(keys, dim=-1)[:, : top_k - 1] + 1
        zero = torch.zeros(tokens, 1, dtype=torch.int64, device=device)
        idx = torch.cat([zero, others], dim=-1)
        return idx, random_weights(tokens, top_k, generator, device)
    if kind == "half-empty":
        candidates = torch.arange(0, num_experts, 2, device=device)
        if candidates.numel() < top_k:
            candidates = torch.arange(num_experts, device=device)
        keys = torch.rand(tokens, candidates.numel(), generator=generator, device=device)
        idx = candidates[torch.argsort(keys, dim=-1)[:, :top_k]]
        return idx, random_weights(tokens, top_k, generator, device)
    if kind == "first-experts":
        keys = torch.rand(tokens, top_k, generator=generator, device=device)
        idx = torch.argsort(keys, dim=-1)
        return idx, random_weights(tokens, top_k, generator, device)
    raise ValueError(f"unknown routing {kind!r}; known: {', '.join(ROUTINGS)}")
