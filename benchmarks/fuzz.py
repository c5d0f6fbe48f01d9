"""Fuzz campaign of the triton backend: random shapes and routings, every result checked.

    python benchmarks/fuzz.py --cases 1000 [--ep 1,2] [--seed 0] [--minutes M] [--out F]

Each case draws H and I (multiples of 16), E, k, a shared expert or none, a SwiGLU clamp or none,
tokens per rank (0 on some ranks), a routing (uniform, Zipf, all to one expert, half the experts
empty, all to the first experts), and sometimes expert ids out of range (E, E + 7 or -1 on a few
pairs) or receive capacities too small, and at EP > 1 in a quarter of the cases the per-pair
tensors sized by the pairs received (`exact_buffers`). One forward and backward of `mok.MoE`
(backend triton) runs on every rank, then `Workspace.check()`; the results are compared with the
reference backend (`mok.reference`, fp32 math on the same bf16 inputs; ids out of range become
zero-weight pairs there, whose router-weight gradients the triton backend sets to zero) or, where
an error is due, the error must be raised. Outcomes per case:
  exact              no error due, none raised, every result within TOLERANCE of the reference
  bad ids raised     MoKInputError on the ranks holding them, the valid pairs' results exact
  overflow raised    MoKCapacityError on every rank, results finite
  silent corruption  a result off, non-finite, or an error due but not raised (goal: 0)
  unexpected error   any other exception
  context kill       a rank's process died (goal: 0; a device trap would do this)
EP 2 runs on two GPUs when there are two (NCCL, symmetric memory), else as two processes sharing
one GPU (a gloo group, buffers shared through CUDA IPC: the same kernels and protocol, slower).
Without a GPU it runs on the CPU (kernels under the Triton interpreter, a shared file standing in
for symmetric memory): slow, for trying the campaign itself.
"""

from __future__ import annotations

import argparse
import collections
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
from mok.comm.simulation import simulated_symmetric_memory  # noqa: E402
from mok.launch import RankFailedError, run_ranks  # noqa: E402
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

TOLERANCE = 2e-2
"""bf16 kernels against the fp32 reference (errors are ~4e-3); a wrong row or index is O(1)."""
OUTCOMES = (
    "exact",
    "bad ids raised",
    "overflow raised",
    "silent corruption",
    "unexpected error",
    "context kill",
)


def draw_case(rng: random.Random, ep: int, index: int) -> dict:
    """One random case for `ep` ranks (a plain dict: it travels to the rank processes)."""
    # Few distinct E and k: each new pair compiles kernels (seconds), sizes do not.
    experts = ep * rng.choice([1, 3, 4, 16])
    case = {
        "index": index,
        "ep": ep,
        "hidden": 16 * rng.choice([1, 2, 3, 5, 8, 16, 24, 32]),
        "inter": 16 * rng.choice([1, 2, 3, 4, 7, 8, 16]),
        "experts": experts,
        "top_k": min(experts, rng.choice([1, 2, 3, 8])),
        "shared": 16 * rng.choice([0, 0, 1, 4]),
        "limit": rng.choice([None, None, 0.5, 3.0]),
        "tokens": [rng.choice([0, 1, 7, 64, 100, 255]) for _ in range(ep)],
        "routing": rng.choice(ROUTINGS),
        "bad_ids": rng.random() < 0.15,
        "capacity": None,
        "seed": rng.randrange(1 << 30),
    }
    if ep > 1 and rng.random() < 0.15:
        case["capacity"] = rng.choice(["tokens", "pairs"])
    # From the seed, not a draw of its own: the other fields of every case stay as they were.
    case["exact_buffers"] = ep > 1 and case["seed"] % 4 == 0
    return case


def rank_inputs(case: dict, rank: int, device) -> RankInputs:
    """Inputs of `rank` in `case` (every rank can rebuild every rank's)."""
    generator = torch.Generator().manual_seed(case["seed"] * 8 + rank)
    tokens, experts, top_k = case["tokens"][rank], case["experts"], case["top_k"]
    x = torch.randn(tokens, case["hidden"], generator=generator)
    idx, w = make_routing(case["routing"], tokens, experts, top_k, generator)
    grad_y = torch.randn(tokens, case["hidden"], generator=generator)
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


def needs(case: dict, everyone: list[RankInputs]) -> tuple[list[int], list[int]]:
    """(tokens, pairs) each rank receives: its tokens once per owner, and the valid pairs."""
    local = case["experts"] // case["ep"]
    tokens, pairs = [0] * case["ep"], [0] * case["ep"]
    for inputs in everyone:
        idx = inputs.topk_idx.cpu()
        valid = (idx >= 0) & (idx < case["experts"])
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
    config = mok.MoKConfig(
        hidden_size=case["hidden"],
        intermediate_size=case["inter"],
        num_experts=case["experts"],
        top_k=case["top_k"],
        shared_intermediate_size=case["shared"],
        swiglu_limit=case["limit"],
        backend="triton",
        max_tokens_per_rank=max(1, *case["tokens"]),
        exact_buffers=case["exact_buffers"],
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
    y = moe_forward(x, torch.cat(idxs), w, weights, config.swiglu_limit)
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
        results[f"grad {name}"] = (
            grad[first : first + local] if name in ("gate", "up", "down") else grad
        )
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
    full = global_weights(config, case["seed"] % 1000, device)
    layer = mok.MoE(config, group=group, device=device)
    layer.load_global_weights(full)
    workspace = layer.workspace(device)
    got = one_call_results(layer, everyone[rank])
    raised = raised_errors(workspace)
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


def rank_device(where: str, rank: int) -> tuple[torch.device, object]:
    """(this rank's device, the symmetric-memory stand-in or None) for `where`."""
    if where == "cpu":
        return torch.device("cpu"), shared_file_allocator(tempfile.gettempdir())
    device = torch.device("cuda", rank if where == "gpus" else 0)
    torch.cuda.set_device(device)
    return device, cuda_ipc_allocator if where == "one-gpu" else None


def run_cases(rank, world, cases, progress, where, deadline):
    """Rank worker: every case in order, one JSON line per case into progress/rank<r>.jsonl,
    until the wall-clock `deadline` (time.time()) has passed."""
    device, allocate = rank_device(where, rank)
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
    findings = []
    for ep in eps:
        count = args.cases // len(eps)
        cases = [draw_case(rng, ep, i) for i in range(count)]
        start = time.monotonic()
        budget = float("inf") if args.minutes is None else 60 * args.minutes
        results = campaign(cases, ep, time.time() + budget)
        seconds = time.monotonic() - start
        tally = collections.Counter(result["outcome"] for result in results.values())
        worst = max((result["error"] for result in results.values()), default=0.0)
        counts = " | ".join(str(tally.get(outcome, 0)) for outcome in OUTCOMES)
        lines.append(f"| {ep} | {len(results)} | {counts} | {worst:.2e} | {seconds:.0f} |")
        for index, result in sorted(results.items()):
            if result["outcome"] in ("silent corruption", "unexpected error", "context kill"):
                findings.append(
                    f"EP {ep} case {cases[index]}: {result['outcome']}: {result.get('detail', '')}"
                )
    report = "\n".join(lines + ([""] + findings if findings else []))
    print(report)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(report + "\n")


if __name__ == "__main__":
    main()
