"""Host time of one layer call, forward and backward, beside the device time and the baseline's:
where a small layer's time goes when the GPU waits for the host.

    PYTHONPATH=src python3 benchmarks/host_time.py [--preset tiny] [--tokens 8192] [--iters 20]
                                                   [--kernels] [--profile 40] [--graphed]
                                                   [--stages] [--stack N]

EP 1 on one GPU, uniform random routing, bf16. Per implementation (`triton` backend launching every
kernel, `MoKConfig.graphs="off"`; the same layer replaying its own CUDA graphs, `graphs="on"`; the
`mok.baseline` layer on the same weights), over --iters calls after a warm-up, medians of: the host
time to enqueue forward and backward (perf_counter around the Python calls, the GPU idle before
each call) and the device time of both (CUDA events; equal to the host time when the GPU waits for
the host). --graphed adds the triton layer wrapped by `torch.cuda.make_graphed_callables` (forward
and backward each one CUDA graph: the host launches a graph and copies the inputs in). --kernels
lists the kernels one call launches (torch.profiler); --profile prints cProfile's top functions of
one implementation (--profile-impl: the triton layer launching its kernels, or the same layer
replaying its own graphs) by their own time, then by their cumulative time. --launches times
every launch through `mok.kernels.launch` on its own (median host us per launch and launches per
call, by kernel). --stages times the stages of a replayed call (the layer replaying its own
graphs, forward and backward back to back): the median host us spent inside each (inclusive),
beside a trivial autograd.Function's forward and backward, PyTorch's own floor per call.
--stack N asks whether the GPU waits for the host in a model: N layers one after another (h = h +
layer(h), each with its own weights and routing), forward and backward, the GPU idle before each
step; the step's device time beside the same step replayed as two CUDA graphs
(`make_graphed_callables`, no host work between kernels: the GPU's own time). A ratio of 1.00
means the GPU never waited for the host.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import inspect
import io
import pstats
import statistics
import sys
import time

import torch

import mok
from mok import functional, graphs, module
from mok.baseline import BaselineMoE
from mok.testing import global_weights


def one_call(layer, x, idx, weights, grad):
    """(host ms forward, host ms backward, device ms forward, device ms forward+backward)."""
    torch.cuda.synchronize()
    start, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    t0 = time.perf_counter()
    start.record()
    y = layer(x, idx, weights)
    t1 = time.perf_counter()
    middle.record()
    y.backward(grad)
    t2 = time.perf_counter()
    end.record()
    end.synchronize()
    layer.zero_grad(set_to_none=True)
    x.grad = weights.grad = None
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, start.elapsed_time(middle), start.elapsed_time(end)


def kernel_counts(layer, x, idx, weights, grad) -> collections.Counter:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer(x, idx, weights).backward(grad)
        torch.cuda.synchronize()
    layer.zero_grad(set_to_none=True)
    x.grad = weights.grad = None
    gpu = torch.autograd.DeviceType.CUDA
    return collections.Counter(e.name[:70] for e in prof.events() if e.device_type == gpu)


def launch_times(layer, x, idx, weights, grad, calls: int) -> dict[str, list[float]]:
    """Host us of each launch through `mok.kernels.launch` over `calls` forward+backward calls,
    by kernel name (each launch wrapped in perf_counter: ~0.1 us added)."""
    from mok.kernels.launch import FastLaunch

    times = collections.defaultdict(list)
    launch = FastLaunch.launch

    def timed(self, grid, args, kwargs):
        start = time.perf_counter()
        compiled = launch(self, grid, args, kwargs)
        times[self.kernel.__name__].append((time.perf_counter() - start) * 1e6)
        return compiled

    FastLaunch.launch = timed
    try:
        for _ in range(calls):
            one_call(layer, x, idx, weights, grad)
    finally:
        FastLaunch.launch = launch
    return times


REPLAY_STAGES = (
    ("mok.MoE.forward", module.MoE, "forward"),
    ("autograd.Function forward", module._MoEFunction, "forward"),
    ("input checks: routing", functional, "_routing_problem"),
    ("input checks: tokens and weights", functional, "_forward_problem"),
    ("graph cache forward", graphs.GraphCache, "forward"),
    ("CUDAGraph.replay", torch.cuda.CUDAGraph, "replay"),
    ("autograd.Function backward", module._MoEFunction, "backward"),
    ("graph cache backward", graphs.GraphCache, "backward"),
    ("gradients copied out", graphs.GraphCache, "_gradients"),
)


@contextlib.contextmanager
def timing(stages, times: dict[str, list[float]]):
    """Every (label, owner, attribute) of `stages` wrapped to append its host us to
    `times[label]` while the context is open (~0.3 us added per wrapped call)."""
    originals = []
    for label, owner, name in stages:
        original = inspect.getattr_static(owner, name)
        static = isinstance(original, staticmethod)
        function = original.__func__ if static else original

        def timed(*args, _function=function, _label=label, **kwargs):
            start = time.perf_counter()
            result = _function(*args, **kwargs)
            times[_label].append((time.perf_counter() - start) * 1e6)
            return result

        setattr(owner, name, staticmethod(timed) if static else timed)
        originals.append((owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


class _Trivial(torch.autograd.Function):
    """x -> x.clone() with the layer's inputs: autograd's own cost per call."""

    @staticmethod
    def forward(x, topk_weights, *weights):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad, None) + (None,) * ctx.weight_count

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.weight_count = len(inputs) - 2


def stage_times(layer, x, idx, weights, grad, calls: int) -> list[tuple[str, float, float]]:
    """(stage, median host us, calls per step) of `calls` forward+backward calls back to back."""
    times = collections.defaultdict(list)
    params = list(layer.parameters())

    def step(label, call):
        start = time.perf_counter()
        y = call()
        middle = time.perf_counter()
        y.backward(grad)
        times[f"{label} forward"].append((middle - start) * 1e6)
        times[f"{label} backward"].append((time.perf_counter() - middle) * 1e6)
        layer.zero_grad(set_to_none=True)
        x.grad = weights.grad = None

    def layer_call():
        return layer(x, idx, weights)

    for _ in range(5):  # warm-up: the first calls of a token count capture
        step("warm-up", layer_call)
    for _ in range(calls):
        step("trivial autograd.Function", lambda: _Trivial.apply(x, weights, *params))
    torch.cuda.synchronize()
    with timing(REPLAY_STAGES, times):
        for _ in range(calls):
            step("layer call", layer_call)
    torch.cuda.synchronize()
    order = ["trivial autograd.Function forward", "trivial autograd.Function backward"]
    order += ["layer call forward", *(stage[0] for stage in REPLAY_STAGES), "layer call backward"]
    return [
        (name, statistics.median(times[name]), len(times[name]) / calls)
        for name in order
        if name in times
    ]


def _spread(values) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


class _Stack(torch.nn.Module):
    """h = h + layer_i(h, topk_idx_i, topk_weights_i) for each layer: a model's MoE layers alone."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x, *routing):
        h = x
        for layer, idx, weights in zip(self.layers, routing[0::2], routing[1::2], strict=True):
            h = h + layer(h, idx, weights)
        return h


def stack_times(config, depth: int, tokens: int, iters: int, warmup: int, device) -> dict:
    """Median [min, max] host and device ms of a forward+backward step through `depth` layers,
    beside the device ms of the same step replayed as CUDA graphs."""
    generator = torch.Generator(device=device).manual_seed(1)
    layers, routing = [], []
    for i in range(depth):
        layer = mok.MoE(config, device=device)
        layer.load_global_weights(global_weights(config, i, device))
        layer.fuse_grad_accumulation = False  # the graphed backward hands gradients to autograd
        layers.append(layer)
        logits = torch.randn(tokens, config.num_experts, device=device, generator=generator)
        weights, idx = logits.softmax(-1).topk(config.top_k, -1)
        routing += [idx, weights.detach().requires_grad_(True)]
    stack = _Stack(layers)
    x = torch.randn(tokens, config.hidden_size, device=device, generator=generator)
    x = x.bfloat16().requires_grad_(True)
    grad = torch.randn_like(x)

    def step(model):
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        t0 = time.perf_counter()
        start.record()
        model(x, *routing).backward(grad)
        end.record()
        host = (time.perf_counter() - t0) * 1e3
        end.synchronize()
        stack.zero_grad(set_to_none=True)
        x.grad = None
        for tensor in routing[1::2]:
            tensor.grad = None
        return host, start.elapsed_time(end)

    eager = [step(stack) for _ in range(warmup + iters)][warmup:]
    graphed_stack = torch.cuda.make_graphed_callables(stack, (x, *routing))
    graphed = [step(graphed_stack) for _ in range(warmup + iters)][warmup:]
    return {"eager": eager, "graphed": graphed}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--profile-impl", choices=("triton", "own-graphs"), default="triton")
    parser.add_argument("--graphed", action="store_true")
    parser.add_argument("--launches", action="store_true")
    parser.add_argument("--stages", action="store_true")
    parser.add_argument("--stack", type=int, default=0, metavar="N")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    config = mok.get_preset(args.preset).config(
        backend="triton", max_tokens_per_rank=args.tokens, graphs="off"
    )
    layer = mok.MoE(config, device=device)
    layer.load_global_weights(global_weights(config, 0, device))
    own_graphs = mok.MoE.sharing_weights_of(layer, config.replace(graphs="on"))
    baseline = BaselineMoE.sharing_weights_of(layer)
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.tokens, config.hidden_size, device=device, generator=generator)
    x = x.bfloat16().requires_grad_(True)
    logits = torch.randn(args.tokens, config.num_experts, device=device, generator=generator)
    weights, idx = logits.softmax(-1).topk(config.top_k, -1)
    weights = weights.detach().requires_grad_(True)
    grad = torch.randn_like(x)
    print(f"{args.preset}, {args.tokens} tokens, EP 1, {torch.cuda.get_device_name(device)}")
    print("| implementation | host ms fwd | host ms bwd | device ms fwd | device ms fwd+bwd |")
    print("| --- | --- | --- | --- | --- |")
    implementations = [
        ("triton", layer),
        ("triton, own graphs", own_graphs),
        ("baseline", baseline),
    ]
    if args.graphed:
        twin = mok.MoE(config, device=device)
        twin.load_global_weights(global_weights(config, 0, device))
        twin.fuse_grad_accumulation = False  # the graphed backward hands gradients to autograd
        sample = (
            x.detach().clone().requires_grad_(True),
            idx.clone(),
            weights.detach().clone().requires_grad_(True),
        )
        graphed = torch.cuda.make_graphed_callables(twin, sample)
        implementations.append(("triton, graphed", graphed))
    for name, impl in implementations:
        for _ in range(args.warmup):
            one_call(impl, x, idx, weights, grad)
        runs = [one_call(impl, x, idx, weights, grad) for _ in range(args.iters)]
        medians = [statistics.median(column) for column in zip(*runs, strict=True)]
        print(f"| {name} | " + " | ".join(f"{m:.3f}" for m in medians) + " |")
    if args.kernels:
        for name, impl in (("triton", layer), ("baseline", baseline)):
            counts = kernel_counts(impl, x, idx, weights, grad)
            print(f"\n{name}: {sum(counts.values())} kernels and copies per forward+backward")
            for kernel, count in counts.most_common():
                print(f"  {count:3d} {kernel}")
    if args.launches:
        times = launch_times(layer, x, idx, weights, grad, args.iters)
        total = sum(sum(t) for t in times.values()) / args.iters / 1e3
        print(f"\ntriton: launches through mok.kernels.launch, {total:.3f} ms of host per call")
        print("| kernel | host us per launch (median) | launches per call |")
        print("| --- | --- | --- |")
        for name, t in sorted(times.items(), key=lambda item: -sum(item[1])):
            print(f"| {name} | {statistics.median(t):.1f} | {len(t) / args.iters:g} |")
    if args.stages:
        rows = stage_times(own_graphs, x, idx, weights, grad, max(args.iters, 100))
        print("\ntriton, own graphs: host us inside each stage of a replayed call (inclusive)")
        print("| stage | host us (median) | per step |")
        print("| --- | --- | --- |")
        for name, median, per_step in rows:
            print(f"| {name} | {median:.1f} | {per_step:g} |")
    if args.stack:
        stacked = stack_times(
            config.replace(graphs="auto"), args.stack, args.tokens, args.iters, args.warmup, device
        )
        print(f"\n{args.stack} layers (graphs='auto'), forward+backward a step, ms")
        print("| step | host (median [min, max]) | device (median [min, max]) |")
        print("| --- | --- | --- |")
        for name, runs in stacked.items():
            host, device_ms = zip(*runs, strict=True)
            print(f"| {name} | {_spread(host)} | {_spread(device_ms)} |")
        ratio = statistics.median(d for _, d in stacked["eager"])
        ratio /= statistics.median(d for _, d in stacked["graphed"])
        print(f"eager device / graphed device: {ratio:.2f} (1.00: the GPU never waited)")
    if args.profile:
        profiled = own_graphs if args.profile_impl == "own-graphs" else layer
        for _ in range(args.warmup):
            one_call(profiled, x, idx, weights, grad)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.iters):
            profiled(x, idx, weights).backward(grad)
            profiled.zero_grad(set_to_none=True)
            x.grad = weights.grad = None
        profiler.disable()
        torch.cuda.synchronize()
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(args.profile)
            print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
