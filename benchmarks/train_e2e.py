"""End-to-end training: a small random-initialised MoE language model of a real architecture,
trained for N steps with different experts implementations, on one process or expert-parallel.

    PYTHONPATH=src python3 benchmarks/train_e2e.py [--arch qwen3-moe] [--steps 50] [--ep 2]
                                                   [--out DIR]
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/train_e2e.py --ep 2 [...]

The model is built from a config in code (no downloads): --arch picks Qwen3-MoE, Mixtral or
DeepSeek-V3, scaled by --layers, --hidden, --experts, --top-k, --moe-intermediate. With
--framework torchtitan the model is TorchTitan's Qwen3-MoE (--titan-flavor, cut to --layers and to
the task's vocabulary) against itself with MoK behind its routed experts (EP 1). Every
implementation starts from the same weights and sees the same batches of a synthetic next-token
task (a fixed random successor table, followed 90 % of the time: the loss falls, so curves have
something to agree on). AdamW (fused by default: --optimizer), bf16 weights (--weights
fp32-autocast: fp32 weights, each step under torch.autocast to bf16, as a trainer's bf16 mixed
precision runs). Implementations (--implementations): at EP 1 the native transformers experts
(`grouped_mm` on GPUs, `eager` on the CPU) and `mok`; at EP > 1 (one rank per GPU, or gloo ranks
on the CPU; `shard_experts` keeps each rank's experts, the other parameters are replicated and
their gradients averaged over the ranks) the standard expert-parallel path `mok-baseline` and
`mok`; the script spawns its ranks, or joins a torchrun job. `mok-mxfp8` is `mok` with the routed
experts in MXFP8 (`mok-mxfp8-keep`: the weights' casts kept between steps), `mok-fp8-block` in
the 128-block FP8 recipe, `mok-unfused` `mok`
with gradient accumulation left to autograd.
--routing balanced replaces the routers' choice of experts by a fixed random one of the same size,
weighted by their own scores: a random-initialised model's own routing sends most tokens to a few
experts, which a training run that balances its experts does not.
Reported per implementation: the loss at every step (the mean over the ranks) and the largest
difference from the first implementation's (and which runs match it bit for bit: with
--deterministic and an implementation named twice, whether training repeats exactly), rank 0's
median step time (after --warmup steps) with its min-max, tokens/s of all ranks and its ratio to
the first implementation, and peak memory on GPUs. With --out: train-e2e.md, .json and .png
(loss and step time per step).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import mok.integrations.transformers as mok_transformers
from mok.bench import git_commit
from mok.ranks import init_from_env, run_ranks

VOCAB = 512
MOK_VARIANTS = {
    "mok": {},
    "mok-mxfp8": {"precision": "mxfp8"},
    "mok-mxfp8-keep": {"precision": "mxfp8", "mx_weight_casts": "keep"},
    "mok-fp8-block": {"precision": "fp8_block"},
    "mok-unfused": {"fuse_grad_accumulation": False},
    "mok-recompute": {"recompute": "gate_up"},
    "mok-router-epilogue": {"router_gradient": "epilogue"},
}
"""--implementations names that run MoK (transformers models and TorchTitan's), with the options
of the adapters (`register`, `use_mok`): `mok-mxfp8` the routed experts in MXFP8 (the weights'
casts made by each pass, as training defaults to), `mok-mxfp8-keep` with both casts of the
weights kept until the weights change, `mok-fp8-block` in the 128-block FP8 recipe, `mok-unfused`
the micro-batches' weight gradients added by autograd instead of by the layer's kernels,
`mok-recompute` the experts' h and pre-activations made again in the backward
(`MoKTuning.recompute`), `mok-router-epilogue` the router weights' gradient formed by the down
product's backward, no pair outputs kept (`MoKConfig.router_gradient`)."""


def transformers_implementation(implementation: str) -> str:
    """The experts implementation to set on a transformers model for `implementation`, with
    "mok" registered with its options."""
    if implementation not in MOK_VARIANTS:
        return implementation
    mok_transformers.register(**MOK_VARIANTS[implementation])
    return "mok"


def model_config(args):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
    )
    if args.arch == "qwen3-moe":
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=64,
            moe_intermediate_size=args.moe_intermediate,
            num_experts=args.experts,
            num_experts_per_tok=args.top_k,
        )
    if args.arch == "mixtral":
        common["intermediate_size"] = args.moe_intermediate
        return transformers.MixtralConfig(
            **common, num_local_experts=args.experts, num_experts_per_tok=args.top_k
        )
    heads = common["num_attention_heads"]
    return transformers.DeepseekV3Config(
        **{**common, "num_key_value_heads": heads},
        moe_intermediate_size=args.moe_intermediate,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        q_lora_rank=args.hidden // 2,
        kv_lora_rank=args.hidden // 4,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
    )


def batches(args, device, rank: int = 0, world: int = 1):
    """This rank's share of the synthetic task's batches: rows [rank * batch, (rank + 1) * batch)
    of global batches of world * batch sequences of seq + 1 tokens, the same for every
    implementation (at EP 1 with --batch B * ep, the union of the EP ranks' batches)."""
    generator = torch.Generator().manual_seed(args.seed)
    successor = torch.randperm(VOCAB, generator=generator)
    rows = args.batch * world
    for _ in range(args.steps * args.accumulate):
        tokens = torch.empty(rows, args.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (rows,), generator=generator)
        for t in range(1, args.seq + 1):
            follow = torch.rand(rows, generator=generator) < 0.9
            noise = torch.randint(0, VOCAB, (rows,), generator=generator)
            tokens[:, t] = torch.where(follow, successor[tokens[:, t - 1]], noise)
        yield tokens[rank * args.batch : (rank + 1) * args.batch].to(device)


def average_gradients(model, group, world: int) -> None:
    """Data parallelism over the expert-parallel ranks: the loss is the mean of the ranks'. An
    expert's gradient already sums every rank's tokens (the exchange brought them): / world;
    every other parameter is replicated: averaged over the ranks (all-reduce)."""
    for module in model.modules():
        sharded = mok_transformers.holds_local_experts(module)
        for param in module.parameters(recurse=False):
            if param.grad is None:
                continue
            if not sharded:
                dist.all_reduce(param.grad, group=group)
            param.grad.div_(world)


def mixed_precision(args, device: torch.device):
    """The context each forward runs in: autocast to bf16 with --weights fp32-autocast."""
    return torch.autocast(device.type, torch.bfloat16, enabled=args.weights != "bf16")


def next_token_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of predicting tokens [B, L + 1] from their first L (fp32)."""
    logits = logits_of(model, tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def make_optimizer(model, args) -> torch.optim.AdamW:
    """AdamW over every parameter at --lr, in the implementation --optimizer names."""
    return torch.optim.AdamW(model.parameters(), lr=args.lr, **{args.optimizer: True})


def train(
    model, args, device, rank: int = 0, world: int = 1, group=None, label: str = "model"
) -> dict:
    optimizer = make_optimizer(model, args)
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    micro_batches = batches(args, device, rank, world)
    forward = model
    for index in range(args.steps):
        if index == 1 and args.compile != "none":
            # After one eager step: MoK's experts make their workspaces there (a collective,
            # outside any trace). The compiling steps fall in the warm-up.
            torch._dynamo.reset()
            forward = torch.compile(model, backend=args.compile)
        step = [next(micro_batches) for _ in range(args.accumulate)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for tokens in step:
            with mixed_precision(args, device):
                loss = next_token_loss(forward, tokens)
            (loss / args.accumulate).backward()
            total += loss.detach() / args.accumulate
        if group is not None:
            average_gradients(model, group, world)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        if group is not None:
            dist.all_reduce(total, group=group)
            total /= world
        losses.append(total.item())
    if args.profile and rank == 0 and device.type == "cuda":
        trace = Path(args.trace) / f"trace-{label}.json" if args.trace else None
        with mixed_precision(args, device):
            print_step_profile(forward, optimizer, tokens, args.profile, trace)
    timed = times[args.warmup :] or times
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    with mixed_precision(args, device):
        load = expert_load(model, tokens, args.experts)
    return {
        "losses": losses,
        "step_ms": times,
        "median_ms": statistics.median(timed),
        "min_ms": min(timed),
        "max_ms": max(timed),
        "tokens_per_s": world
        * args.accumulate
        * args.batch
        * args.seq
        / statistics.median(timed)
        * 1e3,
        "peak_gib": peak,
        "expert_load": load,
    }


def print_step_profile(model, optimizer, tokens, top: int, trace: Path | None = None) -> None:
    """One more training step under torch.profiler (no collectives: rank 0's share alone): its
    wall time, the time the GPU ran kernels or copies (the union of their intervals; below the
    wall time where the host bounds the step) and the `top` operations and kernels by their own
    GPU time. With `trace`: the step's Chrome trace written there."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        next_token_loss(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    gpu = torch.autograd.DeviceType.CUDA
    kernels = [
        e
        for e in prof.events()
        if e.device_type == gpu and not getattr(e, "is_user_annotation", False)
    ]
    busy, end = 0.0, float("-inf")  # the union of the kernels' intervals, us
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    print(
        f"profiled step: {wall:.2f} ms wall, GPU busy {busy / 1e3:.2f} ms, "
        f"{len(kernels)} kernels and copies"
    )
    print(
        prof.key_averages().table(
            sort_by="self_device_time_total", row_limit=top, max_name_column_width=60
        )
    )
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))


def expert_load(model, tokens: torch.Tensor, experts: int) -> list[float]:
    """Per MoE layer of a transformers model, the routing's skew on `tokens` [B, L + 1] (an eager
    forward without gradients): the most (token, slot) pairs any expert takes over the mean, 1.0
    for an even split. Empty where the experts modules take no `top_k_index` (TorchTitan)."""
    import inspect

    loads = []

    def record(module, args, kwargs):
        top_k_index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
        counts = torch.bincount(top_k_index.flatten(), minlength=experts).float()
        loads.append((counts.max() / counts.mean()).item())

    hooks = [
        module.register_forward_pre_hook(record, with_kwargs=True)
        for module in model.modules()
        if "top_k_index" in inspect.signature(module.forward).parameters
    ]
    try:
        with torch.no_grad():
            logits_of(model, tokens[:, :-1])
    finally:
        for hook in hooks:
            hook.remove()
    return loads


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, L, vocab] logits of a transformers model or of a TorchTitan one (`TitanLM`)."""
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


class EagerCausalAttention(torch.nn.Module):
    """TorchTitan's inner-attention call, (q, k, v [B, L, N, H], masks) -> [B, L, N, H], as
    eager causal SDPA: its flex attention has no backward on the CPU (every implementation of a
    run gets the same)."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **_):
        del attention_masks  # one causal document a sequence: the masks say no more
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)


class TitanLM(torch.nn.Module):
    """A TorchTitan decoder called as model(ids) -> logits: positions 0..L-1 and its attention
    masks for them (made once per length)."""

    def __init__(self, decoder: torch.nn.Module):
        super().__init__()
        self.decoder = decoder
        self._masks: dict[tuple, object] = {}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        key = tuple(ids.shape)
        if key not in self._masks:
            self._masks[key] = self.decoder.get_attention_masks(positions)
        return self.decoder(ids, positions, self._masks[key])


def balance_routing(model, tokens: int, seed: int) -> int:
    """--routing balanced: every router of a transformers model keeps its weights and its scores
    (the weights still train through them) but routes the t-th of its `tokens` rows to a fixed
    random choice of k distinct experts (a seeded table per layer), so every expert takes about
    tokens * k / E pairs, as in a training run that balances its experts. The same table for
    every implementation. A random-initialised model left to its own routing sends most pairs
    to a few experts (up to all of them to k experts: max / mean = E / k), which no balanced run
    does. Returns how many routers it changed."""
    import types

    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("router")]
    for layer, router in enumerate(routers):
        generator = torch.Generator().manual_seed(seed * 1000 + layer)
        noise = torch.rand(tokens, router.weight.shape[0], generator=generator)
        choice = noise.topk(router.top_k, dim=-1).indices
        router.register_buffer("balanced_choice", choice, persistent=False)
        router.forward = types.MethodType(_balanced_router_forward, router)
    return len(routers)


def _balanced_router_forward(router, hidden_states):
    """A router's (logits, top-k weights, top-k indices) with the indices of `balanced_choice`:
    the weights are its own scores (softmax, or DeepSeek-V3's sigmoid) at those experts,
    normalised and scaled as the router does."""
    logits, own_weights, _ = type(router).forward(router, hidden_states)
    indices = router.balanced_choice
    if logits.shape[0] != indices.shape[0]:
        raise ValueError(
            f"--routing balanced holds a choice for {indices.shape[0]} tokens, "
            f"not {logits.shape[0]}"
        )
    sigmoid = hasattr(router, "e_score_correction_bias")
    scores = logits.float().sigmoid() if sigmoid else logits.float().softmax(dim=-1)
    weights = scores.gather(1, indices)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * getattr(router, "routed_scaling_factor", 1.0)
    return logits, weights.to(own_weights.dtype), indices


def titan_model(args) -> torch.nn.Module:
    """TorchTitan's Qwen3-MoE of flavor --titan-flavor cut to its first --layers layers and to
    the task's vocabulary, its own initialisation, bf16; on the CPU with `EagerCausalAttention`.
    Writes the MoE shape into args (hidden, experts, top_k, moe_intermediate) for the report."""
    import dataclasses

    from torchtitan.models.qwen3 import qwen3_configs

    config = qwen3_configs[args.titan_flavor](attn_backend="flex")
    config = dataclasses.replace(
        config,
        layers=config.layers[: args.layers],
        vocab_size=VOCAB,  # the synthetic task's, as for the transformers models
        tok_embeddings=dataclasses.replace(config.tok_embeddings, num_embeddings=VOCAB),
        lm_head=dataclasses.replace(config.lm_head, out_features=VOCAB),
    )
    decoder = config.build()
    decoder.init_states()
    for block in decoder.layers.values():
        if args.device == "cpu":
            block.attention.inner_attention = EagerCausalAttention()
        if getattr(block, "moe", None) is not None:
            experts, inter, hidden = block.moe.routed_experts.inner_experts.w1_EFD.shape
            args.experts, args.moe_intermediate = experts, inter
            args.hidden, args.top_k = hidden, block.moe.router.top_k
    return TitanLM(decoder).to(torch.bfloat16 if args.weights == "bf16" else torch.float32)


def train_titan(args) -> dict:
    """`train_rank` for --framework torchtitan (one process): TorchTitan's own routed experts
    ("torchtitan") and MoK behind them (`mok.integrations.torchtitan.use_mok`, "mok")."""
    from mok.integrations import torchtitan as mok_torchtitan

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    initial = titan_model(args)
    results = {}
    for implementation in args.implementations.split(","):
        model = copy.deepcopy(initial)
        if implementation in MOK_VARIANTS:
            mok_torchtitan.use_mok(model, **MOK_VARIANTS[implementation])
        elif implementation != "torchtitan":
            raise SystemExit(
                f"--framework torchtitan runs torchtitan and {', '.join(MOK_VARIANTS)}, "
                f"not {implementation}"
            )
        name = run_name(results, implementation)
        with deterministic_algorithms(args.deterministic):
            results[name] = train(model.to(device), args, device, label=name)
        del model
        results[name]["left_gib"] = memory_left(device)
    return results


def train_rank(rank: int, world: int, args) -> dict:
    """Every implementation on this rank, from the same initial model (EP: this rank's experts)."""
    import transformers

    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    else:
        device = torch.device("cpu")
    group = dist.group.WORLD if world > 1 else None
    mok_transformers.register()
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if args.weights == "bf16" else torch.float32
    initial = transformers.AutoModelForCausalLM.from_config(model_config(args), dtype=dtype)
    results = {}
    for implementation in args.implementations.split(","):
        model = copy.deepcopy(initial)
        if (
            args.routing == "balanced"
            and balance_routing(model, args.batch * args.seq, args.seed) == 0
        ):
            raise SystemExit(f"--routing balanced found no router in the {args.arch} model")
        if group is not None:
            mok_transformers.shard_experts(model, group, args.batch * args.seq)
        model.to(device).set_experts_implementation(transformers_implementation(implementation))
        name = run_name(results, implementation)
        with deterministic_algorithms(args.deterministic):
            results[name] = train(model, args, device, rank, world, group, name)
        del model
        results[name]["left_gib"] = memory_left(device)
    return results


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """Within, if enabled: `torch.use_deterministic_algorithms` and cuBLAS's deterministic
    workspace; both as before afterwards. Strict, not warn-only: under warn-only, cuDNN's
    attention backward keeps its non-deterministic algorithm (it warns and runs it), and on an
    H200 two runs of one model parted from the third step on (bf16 and MXFP8 alike). An op
    with no deterministic implementation fails the run with PyTorch's error naming it."""
    if not enabled:
        yield
        return
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn_only)
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG")


def run_name(results: dict, implementation: str) -> str:
    """The implementation's name in the results, numbered from its second run on ("mok #2")."""
    runs = 1 + sum(name.split(" #")[0] == implementation for name in results)
    return implementation if runs == 1 else f"{implementation} #{runs}"


def memory_left(device: torch.device) -> float | None:
    """GiB still allocated on the GPU once a run's model is gone (garbage collected first, so
    that the next run's peak starts clean and what a run leaks shows); None on the CPU."""
    gc.collect()
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None


def run(args) -> dict:
    if args.framework == "torchtitan":
        if args.ep > 1:
            raise SystemExit("--framework torchtitan runs at EP 1 here (one process)")
        from mok.integrations.torchtitan import missing_torch_features

        if missing := missing_torch_features():
            raise SystemExit(
                f"TorchTitan's model code needs a newer PyTorch than {torch.__version__} "
                f"(it lacks {', '.join(missing)})"
            )
        results = train_titan(args)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: join its job
        world = int(os.environ["WORLD_SIZE"])
        if world != args.ep:
            raise SystemExit(f"torchrun started {world} ranks but --ep is {args.ep}")
        init_from_env("nccl" if args.device == "cuda" else "gloo")
        results = train_rank(dist.get_rank(), world, args)
    elif args.ep > 1:
        collectives = "nccl" if args.device == "cuda" else "gloo"
        results = run_ranks(train_rank, args.ep, args=(args,), backend=collectives)[0]
    else:
        results = train_rank(0, 1, args)
    first = results[next(iter(results))]
    for result in results.values():
        result["max_loss_difference"] = max(
            abs(a - b) for a, b in zip(result["losses"], first["losses"], strict=True)
        )
        result["speedup"] = result["tokens_per_s"] / first["tokens_per_s"]
        result["same_losses_as_first"] = result["losses"] == first["losses"]
    return results


def model_label(args) -> str:
    if args.framework == "torchtitan":
        return f"TorchTitan qwen3 {args.titan_flavor}"
    return args.arch


def markdown(args, results, header) -> str:
    lines = [
        f"# End-to-end training, {model_label(args)} ({header['date']})",
        "",
        f"- commit `{header['commit']}`; {header['machine']}; torch {torch.__version__}",
        f"- command: `{header['command']}`",
        f"- {args.layers} layers, hidden {args.hidden}, {args.experts} experts, top {args.top_k}, "
        f"expert intermediate {args.moe_intermediate}; EP {args.ep}; batch {args.batch} x "
        f"{args.seq} tokens a rank, {args.accumulate} micro-batch(es) a step; "
        f"{args.steps} steps (timing after {args.warmup}); AdamW ({args.optimizer}) lr {args.lr}; "
        f"{args.weights} weights; "
        f"torch.compile: {args.compile}; routing: {args.routing}; "
        f"deterministic algorithms: {'on' if args.deterministic else 'off'}",
        "",
        "| experts | final loss | max loss diff vs first | step ms median (min-max) | tokens/s "
        "| speedup | peak GiB | expert load max / mean, per layer (last batch) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        load = ", ".join(f"{value:.2f}" for value in r["expert_load"]) or "n/a"
        lines.append(
            f"| {name} | {r['losses'][-1]:.4f} | {r['max_loss_difference']:.4f} | "
            f"{r['median_ms']:.2f} ({r['min_ms']:.2f}-{r['max_ms']:.2f}) | "
            f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {peak} | {load} |"
        )
    if len(results) > 1:
        first, *others = results
        same = [name for name in others if results[name]["same_losses_as_first"]]
        lines += ["", f"Losses bit for bit those of {first}: {', '.join(same) or 'none'}"]
    repeats = []
    for name, r in results.items():
        if " #" in name:
            same = r["losses"] == results[name.split(" #")[0]]["losses"]
            repeats.append(f"{name} {'bit for bit' if same else 'differs'}")
    if repeats:
        lines += ["", f"Repeated runs against their implementation's first: {', '.join(repeats)}"]
    left = [(name, r.get("left_gib")) for name, r in results.items()]
    if any(value is not None for _, value in left):
        held = ", ".join(f"{name} {value:.2f}" for name, value in left if value is not None)
        lines += ["", f"GiB still allocated after each run (its model deleted, gc run): {held}"]
    return "\n".join(lines) + "\n"


def plot(results, path: Path, title: str, warmup: int) -> None:
    """Loss per step (top), and step time per step after the warm-up (bottom: the first steps
    compile kernels and would hide the rest)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 7), layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, time_axes = figure.subplots(2, 1, sharex=True)
    for name, r in results.items():
        steps = range(1, len(r["losses"]) + 1)
        loss_axes.plot(steps, r["losses"], label=name)
        time_axes.plot(steps[warmup:], r["step_ms"][warmup:], label=name)
    loss_axes.set_ylabel("training loss")
    time_axes.set_ylabel(f"step time, ms (after {warmup} warm-up steps)")
    time_axes.set_ylim(bottom=0)
    time_axes.set_xlabel("step")
    for axes in (loss_axes, time_axes):
        axes.legend(fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    """The command line (sizes default to a GPU's where one is present, else to the CPU's)."""
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--framework",
        choices=("transformers", "torchtitan"),
        default="transformers",
        help="whose model: transformers' (--arch, sized by the options below) or TorchTitan's "
        "Qwen3-MoE (--titan-flavor, cut to --layers)",
    )
    parser.add_argument(
        "--arch", choices=("qwen3-moe", "mixtral", "deepseek-v3"), default="qwen3-moe"
    )
    parser.add_argument(
        "--titan-flavor",
        default="30B-A3B" if cuda else "debugmodel_moe",
        help="TorchTitan's Qwen3 flavor (its qwen3_configs key)",
    )
    parser.add_argument(
        "--routing",
        choices=("model", "balanced"),
        default="model",
        help="model: the routers' own choice (a random-initialised model's is skewed); balanced: "
        "each token's experts a fixed random choice, weighted by the router's scores (transformers "
        "models)",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024 if cuda else 64)
    parser.add_argument("--experts", type=int, default=64 if cuda else 8)
    parser.add_argument("--top-k", type=int, default=8 if cuda else 2)
    parser.add_argument("--moe-intermediate", type=int, default=512 if cuda else 32)
    parser.add_argument("--batch", type=int, default=8 if cuda else 2)
    parser.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="micro-batches of --batch sequences per optimizer step (gradient accumulation)",
    )
    parser.add_argument(
        "--weights",
        choices=("bf16", "fp32-autocast"),
        default="bf16",
        help="bf16 weights, or fp32 weights with every step under torch.autocast to bf16",
    )
    parser.add_argument("--seq", type=int, default=1024 if cuda else 16)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--optimizer",
        choices=("fused", "foreach"),
        default="fused",
        help="AdamW's implementation: fused (one kernel for every parameter, as trainers such as "
        "TorchTitan default to) or foreach (a kernel per operation over lists of parameters)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="train under torch.use_deterministic_algorithms with cuBLAS's "
        "deterministic workspace: with an implementation named twice (--implementations "
        "mok,mok), whether two runs give the same losses bit for bit",
    )
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument(
        "--ep", type=int, default=1, help="expert-parallel ranks (one per GPU, or gloo CPU ranks)"
    )
    parser.add_argument(
        "--implementations",
        default=None,
        help="experts implementations, the first the reference of the ratios; one named twice "
        "runs twice (the second reported as NAME #2) (default: the "
        "native grouped_mm on GPUs, eager on the CPU, then mok; at EP > 1 mok-baseline, then mok); "
        "mok-mxfp8: mok with the routed experts in MXFP8 (mok-mxfp8-keep: their weights' "
        "casts kept between steps); mok-fp8-block: in the 128-block FP8 recipe; mok-unfused: "
        "mok with the micro-batches' weight gradients "
        "added by autograd; mok-recompute, mok-router-epilogue: mok with MoKTuning.recompute="
        "gate_up, router_gradient=epilogue",
    )
    parser.add_argument(
        "--compile",
        default="none",
        metavar="BACKEND",
        help="torch.compile the model with this backend (inductor, aot_eager, ...) from the "
        "second step on, every implementation alike (default none: eager)",
    )
    parser.add_argument("--out", help="write train-e2e.md, .json and .png here")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after training on GPUs, profile one more step per implementation (rank 0) and "
        "print its wall and GPU-busy time and its N costliest kernels",
    )
    parser.add_argument(
        "--trace",
        metavar="DIR",
        help="with --profile: write each profiled step's Chrome trace to DIR/trace-NAME.json",
    )
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.framework == "torchtitan" and args.routing != "model":
        parser.error("--routing balanced applies to transformers models")
    if args.implementations is None and args.framework == "torchtitan":
        args.implementations = "torchtitan,mok"
    elif args.implementations is None:
        native = "grouped_mm" if args.device == "cuda" else "eager"
        args.implementations = ("mok-baseline" if args.ep > 1 else native) + ",mok"
    results = run(args)
    machine = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "machine": machine,
        "command": " ".join(["benchmarks/train_e2e.py", *(argv or sys.argv[1:])]),
    }
    if dist.is_initialized() and dist.get_rank() != 0:  # under torchrun: rank 0 reports
        return 0
    report = markdown(args, results, header)
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "train-e2e.md").write_text(report)
        (out / "train-e2e.json").write_text(
            json.dumps({**header, "args": vars(args), "results": results}, indent=2)
        )
        title = f"{model_label(args)}: {header['commit']}, {machine}"
        plot(results, out / "train-e2e.png", title, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
