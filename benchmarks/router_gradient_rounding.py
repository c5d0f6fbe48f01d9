"""How far two ways of rounding the backward of the combine land from float64, on the CPU: the
contract's today (the oracle's, as autograd rounds) against the form a down data gradient's
epilogue could compute (`docs/notes/expert-kernels.md`, "Ideas not yet tried").

    python3 benchmarks/router_gradient_rounding.py [--pairs 4096] [--hidden 2048]
                                                   [--intermediate 768] [--seed 0]

Per pair p (a token's route to one expert): h [I] bf16 (the activation the forward keeps), the
expert's down weight W [H, I] bf16, grad_y [H] bf16 (the token's output gradient), router
weight w (fp32). Today: y = bf16(h W^T), the router weight's gradient <grad_y, y> in fp32, and
grad_h = bf16(bf16(w grad_y) W). Epilogue form: acc = grad_y W in fp32 (the GEMM's accumulator),
the router weight's gradient <acc, h> in fp32, grad_h = bf16(w acc). Truth: the same bf16
operands in float64. Prints each one's normwise relative error against the truth, and the two
forms' distance from each other (what a test of one against the other would see).
"""

from __future__ import annotations

import argparse

import torch


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    bf16, pairs, hidden, inter = torch.bfloat16, args.pairs, args.hidden, args.intermediate
    down = (torch.randn(hidden, inter, generator=gen) / inter**0.5).to(bf16)
    h = torch.randn(pairs, inter, generator=gen).to(bf16)
    grad_y = torch.randn(pairs, hidden, generator=gen).to(bf16)
    w = torch.rand(pairs, generator=gen)

    grad_w_true = (grad_y.double() * (h.double() @ down.double().T)).sum(-1)
    grad_h_true = w.double()[:, None] * (grad_y.double() @ down.double())

    y = (h.float() @ down.float().T).to(bf16)
    grad_w_today = (grad_y.float() * y.float()).sum(-1)
    grad_h_today = ((w[:, None] * grad_y.float()).to(bf16).float() @ down.float()).to(bf16)

    accumulator = grad_y.float() @ down.float()
    grad_w_epilogue = (accumulator * h.float()).sum(-1)
    grad_h_epilogue = (w[:, None] * accumulator).to(bf16)

    print(f"{pairs} pairs, H {hidden}, I {inter}, seed {args.seed}: relative error (normwise)")
    print("| gradient | today vs float64 | epilogue form vs float64 | epilogue form vs today |")
    print("| --- | --- | --- | --- |")
    for name, today, epilogue, truth in (
        ("router weights", grad_w_today, grad_w_epilogue, grad_w_true),
        ("h", grad_h_today, grad_h_epilogue, grad_h_true),
    ):
        print(
            f"| {name} | {relative(today, truth):.2e} | {relative(epilogue, truth):.2e} | "
            f"{relative(epilogue, today):.2e} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
