"""Problems and runs shared by the tests of the quantized expert MLPs (MXFP8, the 128-block FP8
recipe), and their accuracy checks against float64."""

from __future__ import annotations

import torch

import mok
from mok.reference.expert import grouped_expert_mlp
from mok.testing import relative_error

GPT_OSS = {"alpha": 1.702, "up_offset": 1.0}


def uneven(t: torch.Tensor, gen) -> torch.Tensor:
    """t with every row and every column scaled by its own power of two in [2^-6, 2^6]: blocks
    along rows and along columns then get different scales (with Gaussian entries alone nearly
    every block has the same scale, and quantizing along the wrong dimension goes unseen)."""
    rows = torch.exp2(torch.randint(-6, 7, (*t.shape[:-1], 1), generator=gen).float())
    cols = torch.exp2(torch.randint(-6, 7, (*t.shape[:-2], 1, t.shape[-1]), generator=gen).float())
    return t * rows * cols


def problem(sizes, hidden, inter, seed=0, scale_rows=None):
    """(rows [M, hidden], [w_gate, w_up [E, inter, hidden], w_down [E, hidden, inter]], grad [M,
    hidden]) in bf16 for groups of `sizes` rows; scaled `uneven`ly unless `scale_rows` scales
    each row."""
    gen = torch.Generator().manual_seed(seed)
    experts = len(sizes)
    rows = torch.randn(sum(sizes), hidden, generator=gen)
    if scale_rows is not None:
        rows = rows * scale_rows[:, None]
    weights = [
        torch.randn(experts, inter, hidden, generator=gen) * hidden**-0.5,
        torch.randn(experts, inter, hidden, generator=gen) * hidden**-0.5,
        torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5,
    ]
    grad = torch.randn(sum(sizes), hidden, generator=gen)
    if scale_rows is None:
        rows, grad = uneven(rows, gen), uneven(grad, gen)
        weights = [uneven(w, gen) for w in weights]
    return rows.bfloat16(), [w.bfloat16() for w in weights], grad.bfloat16()


def run(fn, rows, weights, grad, sizes, limit=None, biases=None, **activation):
    """(out, gradients of rows, the weights and the biases, in that order) of one call."""
    leaves = [t.clone().requires_grad_(True) for t in (rows, *weights, *(biases or ()))]
    bias_leaves = tuple(leaves[4:]) if biases is not None else None
    out = fn(leaves[0], sizes, *leaves[1:4], limit, biases=bias_leaves, **activation)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def expert_biases(sizes, hidden, inter, seed=5):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(len(sizes), inter), (len(sizes), inter), (len(sizes), hidden)]
    return [(torch.randn(shape, generator=gen) / 4).bfloat16() for shape in shapes]


def assert_fp8_level_accuracy(fn, hidden, inter) -> None:
    """`fn`'s output and every gradient against unquantized float64 math: e4m3 (3 mantissa bits)
    is ~8x coarser than bf16 (7 bits), so the error lies well above the bf16 reference's and well
    below O(1). Catches a quantization that does nothing and a wrong scale."""
    sizes = [64, 160, 32]
    rows, weights, grad = problem(sizes, hidden, inter, seed=1)
    quantized = run(fn, rows, weights, grad, sizes)
    bf16 = run(grouped_expert_mlp, rows, weights, grad, sizes)
    exact = run(
        grouped_expert_mlp, rows.double(), [w.double() for w in weights], grad.double(), sizes
    )
    for ours, bf, want in zip(
        [quantized[0], *quantized[1]], [bf16[0], *bf16[1]], [exact[0], *exact[1]], strict=True
    ):
        error, bf_error = relative_error(ours, want), relative_error(bf, want)
        assert 2 * bf_error < error < 0.1, (error, bf_error)


def assert_token_blocks_stay_inside_a_group(fn, hidden, inter) -> None:
    """Expert 0's rows are 2^20 times larger than expert 1's: a block of rows along the tokens
    shared by the two groups would flush expert 1's rows to zero in its weight gradients."""
    sizes = [5, 27]
    scale = torch.cat([torch.full((5,), 2.0**20), torch.ones(27)])
    rows, weights, grad = problem(sizes, hidden, inter, seed=2, scale_rows=scale)
    _, grads = run(fn, rows, weights, grad, sizes)
    _, exact = run(
        grouped_expert_mlp, rows.double(), [w.double() for w in weights], grad.double(), sizes
    )
    assert relative_error(grads[1][1], exact[1][1]) < 0.1  # grad W_gate of expert 1


def assert_the_layer_computes_in(precision: str, hidden: int, inter: int) -> None:
    """mok.MoE with `precision` on the reference backend: its routed experts quantized (x's and
    the gate weights' gradients within FP8 accuracy of the bf16 layer's, but not equal to them),
    repeatable bit for bit. Catches the precision dropped on the way to the reference's experts
    (the bf16 layer's results)."""
    config = mok.MoKConfig(
        hidden_size=hidden, intermediate_size=inter, num_experts=4, top_k=2,
        shared_intermediate_size=32,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(48, hidden, generator=gen).bfloat16()
    idx = torch.argsort(torch.rand(48, 4, generator=gen), -1)[:, :2]
    w = torch.softmax(torch.randn(48, 2, generator=gen), -1)
    results = []
    for run_precision in ("bf16", precision, precision):
        layer = mok.MoE(config.replace(precision=run_precision, backend="reference"))
        layer.load_global_weights(mok.testing.global_weights(config, 0, torch.device("cpu")))
        x_leaf = x.clone().requires_grad_(True)
        layer(x_leaf, idx, w).float().square().sum().backward()
        results.append((x_leaf.grad, layer.gate.grad))
    (bf_x, bf_gate), (q_x, q_gate), (again_x, again_gate) = results
    assert torch.equal(q_x, again_x) and torch.equal(q_gate, again_gate)
    assert 0 < relative_error(q_x, bf_x) < 0.1
    assert 0 < relative_error(q_gate, bf_gate) < 0.1
