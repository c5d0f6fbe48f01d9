"""One layer call through the NVLink exchange and the collective one, compared step by step: shared
by the GPU test and the CPU protocol test of `mok.comm.symmetric`."""

import torch

from mok.testing import relative_error


def compare_exchanges(symmetric, collective, inputs, expert, shared=None, extra=None):
    """Run route, dispatch, combine and both backward steps through both exchanges on the same
    inputs (x, topk_idx, topk_weights, grad_y); `expert` maps the grouped rows [R, H] to outputs.
    Returns which results are bitwise equal (the router-weight gradients: to fp32 rounding, their
    dot products being summed in another order than torch.einsum)."""
    x, idx, w, grad_y = inputs
    want, got = collective.route(idx), symmetric.route(idx)
    grouped_want, grouped = collective.dispatch(want, x), symmetric.dispatch(got, x)
    rows = int(got.recv_pairs)
    expert_out = expert(grouped_want, want)
    y_want, pairs_want = collective.combine(want, expert_out, w, shared)
    symmetric.expert_output_buffer()[:rows].copy_(expert_out)
    y, pairs = symmetric.combine(got, symmetric.expert_output_buffer(), w, shared)
    grad_grouped_want, grad_w_want = collective.combine_backward(want, grad_y, w, pairs_want)
    grad_grouped, grad_w = symmetric.combine_backward(got, grad_y, w, pairs)
    grad_rows = torch.randn_like(grouped_want)
    padded = torch.zeros_like(grouped)
    padded[:rows] = grad_rows
    grad_x_want = collective.dispatch_backward(want, grad_rows, extra)
    grad_x = symmetric.dispatch_backward(got, padded, extra)
    symmetric.check()
    return {
        "group offsets": torch.equal(got.group_offsets, want.group_offsets),
        "grouped rows": rows == grouped_want.shape[0] and torch.equal(grouped[:rows], grouped_want),
        "y": torch.equal(y, y_want),
        "pair outputs": torch.equal(pairs, pairs_want),
        "grad grouped": torch.equal(grad_grouped[:rows], grad_grouped_want),
        "grad weights": relative_error(grad_w, grad_w_want) < 1e-5,
        "grad x": torch.equal(grad_x, grad_x_want),
    }
