"""Fuzz campaign of the fast backends: random routings and token counts on a fixed palette of
layer shapes, every result checked against the reference.

    python benchmarks/fuzz.py --cases 1000 [--ep 1,2] [--workers 4] [--seed 0] [--minutes M]
                              [--out F]

Each case takes one layer shape of `PALETTE` (so that the kernels compile once per shape, not
once per case: a campaign of 1000 cases stays affordable on a GPU), a backend (`triton`,
`fused`) and a precision (bf16; MXFP8 on the triton backend, for shapes its 32-element blocks
take), and draws the rest: tokens per rank (0 on some ranks), a routing (uniform, Zipf, all to
one expert, half the experts empty, all to the first experts), for bf16 sometimes the router
weights' gradient in the down product's epilogue, sometimes expert ids out of range (E, E + 7 or
-1 on a few pairs), receive capacities too small, and at EP > 1 in a quarter of the cases the
per-pair tensors sized by the pairs received (`exact_buffers`). A forward and backward of
`mok.MoE` runs twice on every rank (the second call's results must be bitwise the first's: a
training step is a later call), then `Workspace.check()`; the results are compared with the
reference backend (`mok.reference`, fp32 math on the same bf16 inputs, the same precision and
activation; ids out of range become zero-weight pairs there, whose router-weight gradients the
fast backends set to zero) or, where an error is due, the error must be raised. Outcomes:
  exact              no error due, none raised, every result within TOLERANCE of the reference
  bad ids raised     MoKInputError on the ranks holding them, the valid pairs' results exact
  overflow raised    MoKCapacityError on every rank, results finite
  withheld           the backend refuses the case's options on this device (its reason shown)
  silent corruption  a result off, non-finite, or an error due but not raised (goal: 0)
  unexpected error   any other exception
  context kill       a rank's process died (goal: 0; a device trap would do this)
EP 2 runs on two GPUs when there are two (NCCL, symmetric memory), else as two processes sharing
one GPU (a gloo group, buffers shared through CUDA IPC: the same kernels and protocol, slower).
`--workers` campaigns run side by side per EP size, each on its share of the cases (the small
shapes leave a GPU mostly idle: the host's Python is the bound). Without a GPU it runs on the
CPU (kernels under the Triton interpreter, a shared file standing in for symmetric memory):
slow, for trying the campaign itself.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import json
import os
import random
import tempfile
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch.distributed as dist  # noqa: E402

import mok  # noqa: E402
from mok.backends import BACKENDS  # noqa: E402
from mok.comm.memory import simulated_symmetric_memory  # noqa: E402
from mok.ranks import RankFailedError, run_ranks  # noqa: E402
from mok.reference import moe_forward  # noqa: E402
from mok.routing import ROUTINGS, make_routing  # noqa: E402
from mok.testing import (  # noqa: E402
    RankInputs,
    cuda_ipc_allocator,
    global_weights,
    one_call_results,
    relative_error,
    shared_file_allocator,
)
from mok.weights import ROUTED_FIELDS  # noqa: E402

TOLERANCE = 2e-2
"""bf16 kernels against the fp32 reference (errors are ~4e-3); a wrong row or index is O(1)."""
OUTCOMES = (
    "exact",
    "bad ids raised",
    "overflow raised",
    "withheld",
    "silent corruption",
    "unexpected error",
    "context kill",
)


PALETTE = (
    {"hidden": 64, "inter": 32, "experts_per_rank": 4, "top_k": 2},
    {"hidden": 128, "inter": 96, "experts_per_rank": 3, "top_k": 3, "shared": 64, "limit": 3.0},
    {"hidden": 80, "inter": 48, "experts_per_rank": 1, "top_k": 1, "shared": 16},
    {
        "hidden": 96,
        "inter": 64,
        "experts_per_rank": 4,
        "top_k": 4,
        "limit": 7.0,
        "alpha": 1.702,
        "up_offset": 1.0,
        "bias": True,
    },
    {"hidden": 256, "inter": 128, "experts_per_rank": 16, "top_k": 8},
)
"""Layer shapes of the cases (E = EP x experts_per_rank): one with a shared expert and a clamp,
one whose sizes are not multiples of 32 (bf16 only), gpt-oss's experts (activation, clamp,
biases), top 8 of many experts."""
PALETTE_NAMES = ("small", "shared+clamp", "not-32", "gpt-oss", "top-8")


def draw_case(rng: random.Random, ep: int, index: int) -> dict:
    """One random case for `ep` ranks (a plain dict: it travels to the rank processes)."""
    shape = rng.randrange(len(PALETTE))
    mx_able = PALETTE[shape]["hidden"] % 32 == 0 and PALETTE[shape]["inter"] % 32 == 0
    backend = rng.choice(["triton", "fused"])
    precision = "mxfp8" if backend == "triton" and mx_able and rng.random() < 0.4 else "bf16"
    case = {
        "index": index,
        "ep": ep,
        "shape": shape,
        "backend": backend,
        "precision": precision,
        "router_gradient": (
            "epilogue" if precision == "bf16" and rng.random() < 0.25 else "saved_outputs"
        ),
        "tokens": [rng.choice([0, 1, 7, 64, 100, 255]) for _ in range(ep)],
        "routing": rng.choice(ROUTINGS),
        "bad_ids": rng.random() < 0.15,
        "capacity": None,
        "seed": rng.randrange(1 << 30),
    }
    if ep > 1 and rng.random() < 0.15:
        case["capacity"] = rng.choice(["tokens", "pairs"])
    case["exact_buffers"] = ep > 1 and case["seed"] % 4 == 0
    return case


def rank_inputs(case: dict, rank: int, device) -> RankInputs:
    """Inputs of `rank` in `case` (every rank can rebuild every rank's)."""
    generator = torch.Generator().manual_seed(case["seed"] * 8 + rank)
    shape = PALETTE[case["shape"]]
    tokens, experts, top_k = case["tokens"][rank], experts_of(case), shape["top_k"]
    x = torch.randn(tokens, shape["hidden"], generator=generator)
    idx, w = make_routing(case["routing"], tokens, experts, top_k, generator)
    grad_y = torch.randn(tokens, shape["hidden"], generator=generator)
    if case["bad_ids"] and tokens:
        picks = torch.randint(
            0, tokens * top_k, (max(1, tokens * top_k // 16),), generator=generator
        )
        bad = torch.tensor([experts, experts + 7, -1])[torch.arange(picks.numel()) % 3]
        idx.view(-1)[picks] = bad
    return RankInputs(
        x.to(device, torch.bfloat16),
        idx.to(device),
        w.to(device),
        grad_y.to(device, torch.bfloat16),
    )


def experts_of(case: dict) -> int:
    return case["ep"] * PALETTE[case["shape"]]["experts_per_rank"]


def needs(case: dict, everyone: list[RankInputs]) -> tuple[list[int], list[int]]:
    """(tokens, pairs) each rank receives: its tokens once per owner, and the valid pairs."""
    local = PALETTE[case["shape"]]["experts_per_rank"]
    tokens, pairs = [0] * case["ep"], [0] * case["ep"]
    for inputs in everyone:
        idx = inputs.topk_idx.cpu()
        valid = (idx >= 0) & (idx < experts_of(case))
        owner = torch.where(valid, idx // local, -1)
        for rank in range(case["ep"]):
            tokens[rank] += int((owner == rank).any(1).sum())
            pairs[rank] += int((owner == rank).sum())
    return tokens, pairs


def config_of(case: dict, everyone: list[RankInputs]) -> tuple[mok.MoKConfig, bool]:
    """(the case's config, whether a receive buffer overflows)."""
    capacities, overflow = {}, False
    if case["capacity"]:
        tokens, pairs = needs(case, everyone)
        most = max(tokens) if case["capacity"] == "tokens" else max(pairs)
        if most > 1:
            name = "recv_capacity" if case["capacity"] == "tokens" else "recv_pair_capacity"
            capacities[name] = most - 1
            overflow = True
    shape = PALETTE[case["shape"]]
    config = mok.MoKConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["inter"],
        num_experts=experts_of(case),
        top_k=shape["top_k"],
        shared_intermediate_size=shape.get("shared", 0),
        swiglu_limit=shape.get("limit"),
        swiglu_alpha=shape.get("alpha", 1.0),
        swiglu_up_offset=shape.get("up_offset", 0.0),
        expert_bias=shape.get("bias", False),
        backend=case["backend"],
        precision=case["precision"],
        router_gradient=case["router_gradient"],
        max_tokens_per_rank=max(1, *case["tokens"]),
        tuning=mok.MoKTuning(exact_buffers=case["exact_buffers"], graphs="off"),
        **capacities,
    )
    return config, overflow


def reference_results(config, full, everyone, rank, group):
    """The reference on every rank's inputs; ids out of range become zero-weight pairs. On the
    CPU the kernels compute in fp32 under the interpreter, rounding only their results to bf16:
    the reference then gets fp32 copies of the inputs, so that it rounds nowhere else either
    (its bf16 rounding of h, amplified by cancellation in a 48-term dot product, made a correct
    router-weight gradient look 2 % off)."""
    dtype = torch.float32 if everyone[rank].x.device.type == "cpu" else None
    xs, idxs, ws, grads = [], [], [], []
    for inputs in everyone:
        idx = inputs.topk_idx
        valid = (idx >= 0) & (idx < config.num_experts)
        xs.append(inputs.x.to(dtype))
        idxs.append(torch.where(valid, idx, 0))
        ws.append(torch.where(valid, inputs.topk_weights, 0))
        grads.append(inputs.grad_y.to(dtype))
    x = torch.cat(xs).requires_grad_(True)
    w = torch.cat(ws).requires_grad_(True)
    weights = full.map(lambda t: t.detach().clone().to(dtype).requires_grad_(True))
    y = moe_forward(x, torch.cat(idxs), w, weights, **config.reference_options())
    y.backward(torch.cat(grads))
    start = sum(inputs.x.shape[0] for inputs in everyone[:rank])
    rows = slice(start, start + everyone[rank].x.shape[0])
    idx = everyone[rank].topk_idx
    valid = (idx >= 0) & (idx < config.num_experts)
    results = {
        "y": y[rows].detach(),
        "grad x": x.grad[rows],
        "grad topk_weights": torch.where(valid, w.grad[rows], 0),
    }
    local = config.num_experts // (1 if group is None else dist.get_world_size(group))
    first = rank * local
    for name, tensor in weights.tensors().items():
        if tensor is None:
            continue
        grad = torch.zeros_like(tensor) if tensor.grad is None else tensor.grad
        results[f"grad {name}"] = grad[first : first + local] if name in ROUTED_FIELDS else grad
    return results


def raised_errors(workspace) -> set[str]:
    """The errors check() raises, until it raises none (each is reported once)."""
    raised = set()
    for _ in range(3):
        try:
            workspace.check()
            break
        except mok.MoKCapacityError:
            raised.add("overflow")
        except mok.MoKInputError:
            raised.add("bad ids")
    return raised


def run_case(case: dict, rank: int, group, device) -> tuple[str, float, str]:
    """(outcome, largest relative error, detail) of one case on this rank."""
    everyone = [rank_inputs(case, r, device) for r in range(case["ep"])]
    config, overflow = config_of(case, everyone)
    withheld = BACKENDS[config.backend].unavailable_reason(config, device, group)
    if withheld is not None:
        return "withheld", 0.0, withheld
    full = global_weights(config, case["seed"] % 1000, device)
    layer = mok.MoE(config, group=group, device=device)
    layer.load_global_weights(full)
    workspace = layer.workspace(device)
    first = one_call_results(layer, everyone[rank])
    raised = raised_errors(workspace)
    got = one_call_results(layer, everyone[rank])
    raised |= raised_errors(workspace)
    changed = [key for key in got if not torch.equal(first[key], got[key])]
    if group is not None:
        for name in ("shared_gate", "shared_up", "shared_down"):
            if f"grad {name}" in got:  # replicated: data parallelism sums it
                grad = got[f"grad {name}"].float()
                dist.all_reduce(grad, group=group)
                got[f"grad {name}"] = grad
    want = reference_results(config, full, everyone, rank, group)
    workspace.release()
    idx = everyone[rank].topk_idx
    bad_here = bool(((idx < 0) | (idx >= config.num_experts)).any())
    due = ({"bad ids"} if bad_here else set()) | ({"overflow"} if overflow else set())
    finite = all(bool(torch.isfinite(t.float()).all()) for t in got.values())
    if changed and not overflow:
        return "silent corruption", 0.0, f"the second call differs from the first: {changed}"
    if raised != due:
        return "silent corruption", 0.0, f"raised {sorted(raised)}, due {sorted(due)}"
    if overflow:
        return ("overflow raised" if finite else "silent corruption"), 0.0, ""
    errors = {key: relative_error(got[key], want[key]) for key in want}
    worst = max(errors.values(), default=0.0)
    if worst > TOLERANCE:
        key = max(errors, key=errors.get)
        return "silent corruption", worst, f"{key}: {errors[key]:.3g}"
    return ("bad ids raised" if bad_here else "exact"), worst, ""


def rank_device(where: str, rank: int, folder: str) -> tuple[torch.device, object]:
    """(this rank's device, the symmetric-memory stand-in or None) for `where`; on the CPU, files
    in `folder` (the campaign's own: campaigns side by side must not share them)."""
    if where == "cpu":
        return torch.device("cpu"), shared_file_allocator(folder)
    device = torch.device("cuda", rank if where == "gpus" else 0)
    torch.cuda.set_device(device)
    return device, cuda_ipc_allocator if where == "one-gpu" else None


def run_cases(rank, world, cases, progress, where, deadline):
    """Rank worker: every case in order, one JSON line per case into progress/rank<r>.jsonl,
    until the wall-clock `deadline` (time.time()) has passed."""
    device, allocate = rank_device(where, rank, progress)
    group = dist.group.WORLD if world > 1 else None
    simulated = contextlib.nullcontext()
    if allocate is not None and world > 1:
        simulated = simulated_symmetric_memory(allocate)
    log_path = os.path.join(progress, f"rank{rank}.jsonl")
    with simulated, open(log_path, "a") as log:
        for case in cases:
            if time.time() > deadline:
                break
            log.write(json.dumps({"index": case["index"], "started": True}) + "\n")
            log.flush()
            try:
                outcome, worst, detail = run_case(case, rank, group, device)
            except Exception as error:  # noqa: BLE001 - every failure is a finding
                outcome, worst, detail = "unexpected error", 0.0, f"{type(error).__name__}: {error}"
            line = {"index": case["index"], "outcome": outcome, "error": worst, "detail": detail}
            log.write(json.dumps(line) + "\n")
            log.flush()
            if rank == 0:
                print(
                    f"EP {world} case {case['index']}: {outcome} {worst:.1e} {detail}", flush=True
                )
            if outcome == "unexpected error" and world > 1:
                break  # the ranks' calls may have diverged: start fresh processes


def read_progress(progress: str, world: int) -> dict[int, dict]:
    """Per case index: the worst outcome over ranks, the largest error, every rank's detail (a
    case started but without an outcome was in flight when a rank died: outcome None)."""
    results: dict[int, dict] = {}
    for rank in range(world):
        path = os.path.join(progress, f"rank{rank}.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as log:
            for line in log:
                entry = json.loads(line)
                current = results.setdefault(
                    entry["index"], {"outcome": None, "error": 0.0, "detail": ""}
                )
                if "outcome" not in entry:
                    continue
                ranked = [current["outcome"] or "exact", entry["outcome"]]
                current["outcome"] = max(ranked, key=OUTCOMES.index)
                current["error"] = max(current["error"], entry["error"])
                if entry["detail"]:
                    current["detail"] += f"[rank {rank}] {entry['detail']} "
    return results


def campaign(cases: list[dict], world: int, deadline: float) -> dict[int, dict]:
    """Run `cases` on `world` ranks, restarting the ranks after a death or a diverging error; the
    cases not started by the wall-clock `deadline` are left out."""
    if not torch.cuda.is_available():
        where = "cpu"
    elif world > 1 and torch.cuda.device_count() >= world:
        where = "gpus"
    else:
        where = "one-gpu"
    backend = "nccl" if where == "gpus" else "gloo"
    results: dict[int, dict] = {}
    remaining = list(cases)
    with tempfile.TemporaryDirectory() as progress:
        while remaining and time.time() < deadline:
            try:
                run_ranks(
                    run_cases,
                    world,
                    args=(remaining, progress, where, deadline),
                    backend=backend,
                    timeout_s=3600,
                )
            except RankFailedError:
                pass
            results = read_progress(progress, world)
            for result in results.values():
                if result["outcome"] is None:
                    result.update(outcome="context kill", detail="a rank died during the case")
            done = {index for index, result in results.items() if result["outcome"]}
            remaining = [case for case in remaining if case["index"] not in done]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--ep", default="1,2", help="EP sizes, sharing the cases evenly")
    parser.add_argument("--workers", type=int, default=1, help="campaigns side by side per EP size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="time budget per EP size (cases not started "
        "by then are left out and the table counts only those that ran)",
    )
    parser.add_argument("--out", default=None, help="write the report (markdown) here too")
    args = parser.parse_args()
    eps = [int(ep) for ep in args.ep.split(",")]
    rng = random.Random(args.seed)
    lines = ["| EP | cases | " + " | ".join(OUTCOMES) + " | largest error | seconds |"]
    lines.append("| --- " * (len(OUTCOMES) + 4) + "|")
    findings, mixes = [], []
    for ep in eps:
        count = args.cases // len(eps)
        cases = [draw_case(rng, ep, i) for i in range(count)]
        start = time.monotonic()
        budget = float("inf") if args.minutes is None else 60 * args.minutes
        deadline = time.time() + budget
        with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
            shares = [cases[w :: args.workers] for w in range(args.workers)]
            results = {}
            runs = pool.map(campaign, shares, [ep] * len(shares), [deadline] * len(shares))
            for done in runs:
                results.update(done)
        seconds = time.monotonic() - start
        tally = collections.Counter(result["outcome"] for result in results.values())
        worst = max((result["error"] for result in results.values()), default=0.0)
        counts = " | ".join(str(tally.get(outcome, 0)) for outcome in OUTCOMES)
        lines.append(f"| {ep} | {len(results)} | {counts} | {worst:.2e} | {seconds:.0f} |")
        mix = collections.Counter(
            (PALETTE_NAMES[cases[i]["shape"]], cases[i]["backend"], cases[i]["precision"])
            for i in results
        )
        mixes.append(f"EP {ep}: " + ", ".join(f"{'/'.join(k)} {n}" for k, n in sorted(mix.items())))
        for index, result in sorted(results.items()):
            if result["outcome"] in ("silent corruption", "unexpected error", "context kill"):
                findings.append(
                    f"EP {ep} case {cases[index]}: {result['outcome']}: {result.get('detail', '')}"
                )
    report = "\n".join(lines + ["", "Cases run per shape, backend, precision:", *mixes])
    report += "\n" + "\n".join([""] + findings if findings else [])
    print(report)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(report + "\n")


if __name__ == "__main__":
    main()
