"""Accuracy of the layer against float64, y and every gradient, for each numerics form: bf16,
MXFP8, the 128-block FP8 recipe, an active SwiGLU clamp, and the router weights' gradient from the
down product's epilogue.

    python benchmarks/accuracy.py [--forms bf16,mxfp8,fp8_block,clamp,router-gradient]
                                  [--preset qwen3-30b-a3b,deepseek-v3] [--experts 16]
                                  [--tokens 512] [--backends triton,reference] [--limit 7]
                                  [--std 4] [--seed 0] [--out F]

One process, EP 1: on the GPU, or on the CPU without one (the triton backend's kernels under the
Triton interpreter, whose test mode computes in fp32 where GPUs round to bf16: for trying the
script, not for its figures; defaults there: the tiny preset, 64 tokens). Per preset, cut to
--experts routed experts (float64 of every expert of a large preset does not fit beside it),
--tokens tokens routed uniformly (top-k of a softmax over random logits), random bf16 x and grad_y,
weights of std 1/sqrt(fan_in). The forms (--forms):

  bf16             the preset's layer as configured
  mxfp8            precision="mxfp8": the routed experts' GEMMs in MXFP8 (32-element blocks)
  fp8_block        precision="fp8_block": the routed experts' GEMMs in the 128-block recipe (the
                   reference backend's emulation, the oracle; the triton backend's tl kernels)
  clamp            swiglu_limit=--limit, the gate and up weights scaled so that the
                   pre-activations have standard deviation --std (as models trained with a clamp
                   reach): the share of routed gate/up elements the clamp changes is printed
  router-gradient  router_gradient="epilogue": the router weights' gradient and the weighted h from
                   the down data gradient's fp32 accumulator instead of the saved pair outputs

Per form and backend: the normwise relative error of y and of every gradient against the same
layer computed in float64 on the same bf16 inputs and weights (`mok.testing.float64_results`;
MXFP8, the 128-block recipe and the epilogue form move rounding points only, so their truth is
the bf16 form's); the
largest single weight-gradient entry error relative to the largest entry; and the largest
normwise distance from the form's oracle (the `reference` backend: fp32 math, rounded where the
form's contract rounds; on the CPU that reference on fp32 copies, see `oracle_results`). Check:
every result finite, and every backend but the reference within `mok bench`'s tolerance of the
oracle (2e-2); exit status 1 otherwise. A backend that refuses a form on this device (its
`unavailable_reason`) is listed with its reason.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import mok  # noqa: E402
from mok.backends import BACKENDS  # noqa: E402
from mok.bench import DEFAULT_CHECK_TOLERANCE, git_commit  # noqa: E402
from mok.routing import make_routing  # noqa: E402
from mok.testing import (  # noqa: E402
    RankInputs,
    clamped_share,
    float64_results,
    global_weights,
    one_call_results,
    reference_results,
    relative_error,
    weights_of_preactivation_std,
)

FORMS = ("bf16", "mxfp8", "fp8_block", "clamp", "router-gradient")
ORACLE = "reference"
PASS_KEYS = ("y", "grad x", "grad topk_weights")
"""The keys of `one_call_results` that are not weight gradients."""


def form_config(base: mok.MoKConfig, form: str, limit: float) -> mok.MoKConfig:
    """The layer of `form` on the preset's cut `base`."""
    changes = {
        "bf16": {},
        "mxfp8": {"precision": "mxfp8"},
        "fp8_block": {"precision": "fp8_block"},
        "clamp": {"swiglu_limit": limit},
        "router-gradient": {"router_gradient": "epilogue"},
    }[form]
    return base.replace(**changes)


def make_inputs(config: mok.MoKConfig, tokens: int, seed: int, device) -> RankInputs:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    idx, w = make_routing("uniform", tokens, config.num_experts, config.top_k, gen)
    grad_y = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
    return RankInputs(x.to(device), idx.to(device), w.to(device), grad_y.to(device))


def largest_entry_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (inf where actual is not finite)."""
    difference = (actual.double() - expected).abs()
    if not torch.isfinite(difference).all():
        return float("inf")
    return float(difference.max() / expected.abs().max().clamp_min(1e-300))


def layer_results(config, weights, inputs: RankInputs, device) -> dict[str, torch.Tensor]:
    """y and every gradient of one forward + backward of the layer of `config` on `inputs`."""
    layer = mok.MoE(config, device=device)
    layer.load_global_weights(weights)
    results = one_call_results(layer, inputs)
    workspace = layer.workspace(device)
    workspace.check()
    workspace.release()
    return results


def oracle_results(config, weights, inputs: RankInputs, device) -> dict[str, torch.Tensor]:
    """The oracle of `config`'s form: the reference backend's results. On the CPU the reference
    on fp32 copies of the inputs and weights instead: the triton backend's test mode computes in
    fp32 there, rounding only its results to bf16, and against a reference that also rounds in
    between, a correct MXFP8 layer reads 4e-2 off (one MX block's scale moves with a rounding)."""
    if device.type == "cuda":
        return layer_results(config.replace(backend=ORACLE), weights, inputs, device)
    return reference_results(
        torch.float32,
        inputs.x,
        inputs.topk_idx,
        inputs.topk_weights,
        inputs.grad_y,
        weights,
        **config.reference_options(),
    )


def preset_rows(name, forms, backends, args, device, log) -> tuple[list[str], bool]:
    """The markdown section of one preset and whether every check passed."""
    preset = mok.get_preset(name)
    experts = min(args.experts, preset.num_experts)
    base = preset.config(num_experts=experts, max_tokens_per_rank=args.tokens)
    inputs = make_inputs(base, args.tokens, args.seed, device)
    plain = global_weights(base, args.seed, device)
    lines = [f"## {name}: {experts} of {preset.num_experts} routed experts, {args.tokens} tokens"]
    notes, rows, ok, columns = [], [], True, None
    truths: dict[tuple, dict[str, torch.Tensor]] = {}
    for form in forms:
        config = form_config(base, form, args.limit)
        weights = plain
        if form == "clamp":
            weights = weights_of_preactivation_std(config, args.std, device, seed=args.seed)
            share = clamped_share(inputs.x, inputs.topk_idx, weights, args.limit)
            notes.append(
                f"clamp: L = {args.limit}, gate and up weights scaled to pre-activations of "
                f"standard deviation {args.std}: the clamp changes {share:.1%} of the routed "
                "gate/up elements."
            )
        key = (form == "clamp", config.swiglu_limit)
        if key not in truths:
            truths[key] = float64_results(
                inputs.x,
                inputs.topk_idx,
                inputs.topk_weights,
                inputs.grad_y,
                weights,
                config.swiglu_limit,
                config.swiglu_alpha,
                config.swiglu_up_offset,
            )
        exact = truths[key]
        columns = columns or list(exact)
        oracle = oracle_results(config, weights, inputs, device)
        for backend in backends:
            config_b = config.replace(backend=backend)
            withheld = BACKENDS[config_b.backend].unavailable_reason(config_b, device, None)
            if withheld is not None:
                rows.append(f"| {form} | {backend} | withheld: {withheld} |")
                continue
            got = layer_results(config_b, weights, inputs, device)
            errors = [relative_error(got[k], exact[k]) for k in columns]
            entry = max(
                largest_entry_error(got[k], exact[k]) for k in columns if k not in PASS_KEYS
            )
            finite = all(e < float("inf") for e in errors)
            distance = max(relative_error(got[k], oracle[k]) for k in columns)
            if backend == ORACLE:  # the oracle itself (on the CPU: beside its fp32 twin)
                shown, good = ("oracle" if device.type == "cuda" else f"{distance:.2e}"), finite
                verdict = "oracle" if good else "NO"
            else:
                shown, good = f"{distance:.2e}", finite and distance <= DEFAULT_CHECK_TOLERANCE
                verdict = "yes" if good else "NO"
            ok &= good
            cells = " | ".join(f"{e:.2e}" for e in errors)
            rows.append(f"| {form} | {backend} | {cells} | {entry:.2e} | {shown} | {verdict} |")
            log(rows[-1])
        del oracle
    lines += ["", *notes, ""] if notes else [""]
    lines += [
        "| form | backend | "
        + " | ".join(columns)
        + " | largest weight-gradient entry | vs oracle | checked |",
        "| --- | --- | " + " | ".join("---" for _ in columns) + " | --- | --- | --- |",
        *rows,
    ]
    return lines, ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu = torch.cuda.is_available()
    parser.add_argument("--forms", default=",".join(FORMS), help=f"of {', '.join(FORMS)}")
    parser.add_argument("--preset", default="qwen3-30b-a3b,deepseek-v3" if gpu else "tiny")
    parser.add_argument("--experts", type=int, default=16, help="routed experts kept")
    parser.add_argument("--tokens", type=int, default=512 if gpu else 64)
    parser.add_argument("--backends", default="triton,reference")
    parser.add_argument("--limit", type=float, default=7.0, help="the clamp form's SwiGLU limit")
    parser.add_argument("--std", type=float, default=4.0, help="the clamp form's pre-activations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the markdown here too")
    args = parser.parse_args(argv)
    forms = args.forms.split(",")
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        parser.error(f"unknown forms {unknown}; known: {', '.join(FORMS)}")
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    kernels = any(backend != ORACLE for backend in args.backends.split(","))
    where = torch.cuda.get_device_name(device) if gpu else "CPU"
    if not gpu and kernels:
        where += " (the kernels under the Triton interpreter)"

    def log(message):
        print(message, flush=True)

    header = [
        f"# Layer accuracy against float64 ({datetime.date.today()})",
        "",
        f"- commit {git_commit()}; {where}; torch {torch.__version__}; EP 1; seed {args.seed}",
        f"- command: `{' '.join(['python', *sys.argv])}`",
        "- normwise relative errors against float64; 'vs oracle': the largest over y and the "
        "gradients against the form's reference backend"
        + ("" if gpu else " (on the CPU: that reference in fp32)"),
    ]
    log("\n".join(header))
    sections, ok = ["\n".join(header)], True
    for name in args.preset.split(","):
        lines, good = preset_rows(name, forms, args.backends.split(","), args, device, log)
        ok &= good
        sections.append("\n".join(lines))
        log(sections[-1])
        if gpu:
            torch.cuda.empty_cache()
    log(f"checks: {'all passed' if ok else 'FAILURES'}")
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n\n".join(sections) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
