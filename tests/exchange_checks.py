"""One layer call through the NVLink exchange and the collective one, compared step by step: shared
by the GPU test and the CPU protocol test of `mok.comm.symmetric`."""

import torch

from mok.testing import relative_error


def compare_exchanges(symmetric, collective, inputs, expert, shared=None, extra=None):
    """Run route, dispatch, combine and both backward steps through both exchanges on the same
    inputs (x, topk_idx, topk_weights, grad_y); `expert` maps the grouped rows [R, H] to outputs.
    With a symmetric layout of `router_values`, the combine's backward is the epilogue form's
    (`compare_unweighted_backward`). Returns which results are bitwise equal (the router-weight
    gradients: to fp32 rounding, their dot products being summed in another order than
    torch.einsum)."""
    x, idx, w, grad_y = inputs
    want, got = collective.route(idx), symmetric.route(idx)
    grouped_want, grouped = collective.dispatch(want, x), symmetric.dispatch(got, x)
    rows = int(got.recv_pairs)
    expert_out = expert(grouped_want, want)
    y_want, pairs_want = collective.combine(want, expert_out, w, shared)
    symmetric.expert_output_buffer()[:rows].copy_(expert_out)
    y, pairs = symmetric.combine(got, symmetric.expert_output_buffer(), w, shared)
    grad_grouped_want, grad_w_want = collective.combine_backward(want, grad_y, w, pairs_want)
    if not symmetric.shape.router_values:  # else its layout has no pair gradients
        grad_grouped, grad_w = symmetric.combine_backward(got, grad_y, w, pairs)
    grad_rows = torch.randn_like(grouped_want)
    padded = torch.zeros_like(grouped)
    padded[:rows] = grad_rows
    grad_x_want = collective.dispatch_backward(want, grad_rows, extra)
    grad_x = symmetric.dispatch_backward(got, padded, extra)
    equal = {
        "group offsets": torch.equal(got.group_offsets, want.group_offsets),
        "grouped rows": rows == grouped_want.shape[0] and torch.equal(grouped[:rows], grouped_want),
        "y": torch.equal(y, y_want),
        "pair outputs": torch.equal(pairs, pairs_want),
        "grad x": torch.equal(grad_x, grad_x_want),
    }
    if not symmetric.shape.router_values:
        equal["grad grouped"] = torch.equal(grad_grouped[:rows], grad_grouped_want)
        equal["grad weights"] = relative_error(grad_w, grad_w_want) < 1e-5
    else:
        wanted = (grad_grouped_want, expert_out, grad_w_want)
        equal.update(
            compare_unweighted_backward(symmetric, collective, (want, got), inputs, wanted)
        )
    symmetric.check()
    return equal


def compare_unweighted_backward(symmetric, collective, routings, inputs, wanted):
    """The epilogue form's two steps (`unweighted_combine_backward`, `pair_values`) through both
    exchanges: bitwise equal. Catches a token's row pushed into the wrong staging row, a weight
    stored at another pair's grouped row or rank, a dot fetched from the wrong owner. And the
    collective's against its `combine_backward` (wanted: its grouped rows' gradients, the
    grouped expert outputs, the router weights' gradient): the unweighted rows times their
    weights are the weighted rows bit for bit (the same fp32 product, rounded once), and each
    row's <grad_y row, output> sent back by `pair_values` is the router weights' gradient
    (fp32 sums in another order)."""
    want, got = routings
    _, _, w, grad_y = inputs
    grad_grouped_want, expert_out, grad_w_want = wanted
    rows_want, weights_want = collective.unweighted_combine_backward(want, grad_y, w)
    rows_got, weights_got = symmetric.unweighted_combine_backward(got, grad_y, w)
    rows = rows_want.shape[0]
    values = torch.randn(rows, dtype=torch.float32, device=grad_y.device)
    padded = torch.full((rows_got.shape[0],), float("nan"), device=grad_y.device)
    padded[:rows] = values
    weighted = (weights_want.unsqueeze(1) * rows_want.float()).to(rows_want.dtype)
    dots = (rows_want.float() * expert_out.float()).sum(1)
    return {
        "unweighted rows": torch.equal(rows_got[:rows], rows_want),
        "row weights": torch.equal(weights_got[:rows], weights_want),
        "pair values": torch.equal(
            symmetric.pair_values(got, padded), collective.pair_values(want, values)
        ),
        "weighted as combine_backward": torch.equal(weighted, grad_grouped_want),
        "dots as the router gradient": relative_error(
            collective.pair_values(want, dots), grad_w_want
        )
        < 1e-5,
    }
