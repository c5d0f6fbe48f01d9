"""The expert MLP kernels under the Triton interpreter (CPU, in CI) against the reference.

The interpreter computes bf16 wrongly (a limitation of Triton's), so these tests run the kernels,
which are dtype-generic, in fp32: the interpreter does fp32 math exactly, so a wrong index, mask,
offset or tile bound shows as an error far above fp32 rounding (~1e-7) against the float64
reference. Shapes are tiny and tiles are 16 x 32 x 32, so every case has ragged row tails, partial
column and reduction tiles, and several tasks per persistent program. The cases and the fuzz run
SwiGLU and gpt-oss's activation with biases (their gradients as per-expert column sums).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mok.kernels import (
    SWIGLU,
    Activation,
    ExpertKernelConfig,
    GemmTiles,
    default_config,
    down_data_gradient,
    down_weight_gradient,
    expert_bias_gradients,
    expert_mlp_backward,
    expert_mlp_forward,
    gate_up_data_gradient,
    gate_up_weight_gradients,
)
from mok.kernels.grouped_gemm import row_tile_map
from mok.reference.expert import grouped_expert_mlp
from mok.testing import relative_error
from mok.weights import are_gate_up_halves, gate_up_halves, joined_gate_up

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="interpreter tests; the GPU tests cover CUDA"
    ),
    # The NaN planted in rows outside the groups makes numpy warn inside the interpreter.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

# fp32 kernels against float64 math: only accumulation order differs.
FP32_TOL = 1e-5
# Accumulating into a bf16 buffer: the interpreter truncates the final downcast (2^-8 relative).
BF16_BUFFER_TOL = 1e-2


@dataclasses.dataclass
class Case:
    sizes: list[int]
    hidden: int
    inter: int
    before: int = 0
    """Rows before the first group (group_offsets[0] > 0)."""
    after: int = 0
    """Capacity padding after the last group (group_offsets[E] < M)."""
    limit: float | None = None
    seed: int = 0
    gpt_oss: bool = False
    """gpt-oss's activation (alpha 1.702, up offset 1) and biases on every projection."""

    @property
    def activation(self) -> Activation:
        return Activation(1.702, 1.0) if self.gpt_oss else SWIGLU

    def biases(self, num_experts: int) -> tuple[torch.Tensor, ...] | None:
        """gate, up [E, I] and down [E, H] of std 0.5 (the pre-activations' scale), or None."""
        if not self.gpt_oss:
            return None
        gen = torch.Generator().manual_seed(self.seed + 1)
        shapes = ((num_experts, self.inter), (num_experts, self.inter), (num_experts, self.hidden))
        return tuple(torch.randn(*shape, generator=gen) * 0.5 for shape in shapes)

    def make(self):
        gen = torch.Generator().manual_seed(self.seed)
        num_experts = len(self.sizes)
        m = self.before + sum(self.sizes) + self.after
        offsets = torch.tensor([0, *self.sizes]).cumsum(0) + self.before
        rows = torch.randn(m, self.hidden, generator=gen)
        # NaN in every row outside the groups: any read of them into a result shows.
        rows[: self.before] = float("nan")
        rows[m - self.after :] = float("nan")

        def weight(*shape):
            return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

        w_gate = weight(num_experts, self.inter, self.hidden)
        w_up = weight(num_experts, self.inter, self.hidden)
        w_down = weight(num_experts, self.hidden, self.inter)
        grad_out = torch.randn(m, self.hidden, generator=gen)
        grad_out[: self.before] = float("nan")
        grad_out[m - self.after :] = float("nan")
        return rows, offsets.to(torch.int32), w_gate, w_up, w_down, grad_out

    @property
    def valid(self) -> slice:
        return slice(self.before, self.before + sum(self.sizes))


def reference(case: Case, rows, w_gate, w_up, w_down, grad_out, biases=None):
    """Output and gradients of the valid rows in float64, through autograd: out, grad x, the
    weights' gradients, then the biases' (with `biases`)."""
    x = rows[case.valid].double().requires_grad_(True)
    weights = [w.double().requires_grad_(True) for w in (w_gate, w_up, w_down)]
    exact_biases = None if biases is None else [b.double().requires_grad_(True) for b in biases]
    activation = case.activation
    out = grouped_expert_mlp(
        x,
        case.sizes,
        *weights,
        swiglu_limit=case.limit,
        biases=exact_biases,
        alpha=activation.alpha,
        up_offset=activation.up_offset,
    )
    out.backward(grad_out[case.valid].double())
    # Without any rows the reference's graph never reaches the weights: their gradient is zero.
    params = weights + (exact_biases or [])
    grads = [torch.zeros_like(w) if w.grad is None else w.grad for w in params]
    return out.detach(), x.grad, *grads


def run_and_check(case: Case, config: ExpertKernelConfig | None = None, buffers=None) -> None:
    rows, offsets, w_gate, w_up, w_down, grad_out = case.make()
    biases = case.biases(len(case.sizes))
    out, saved = expert_mlp_forward(
        rows,
        offsets,
        w_gate,
        w_up,
        w_down,
        swiglu_limit=case.limit,
        config=config,
        activation=case.activation,
        biases=biases,
    )
    gate_buffer, up_buffer, down_buffer = buffers or (None, None, None)
    grad_gate_up = down_data_gradient(grad_out, saved)
    grad_rows = gate_up_data_gradient(grad_gate_up, saved)
    grad_weights = [
        *gate_up_weight_gradients(grad_gate_up, saved, gate_buffer, up_buffer),
        down_weight_gradient(grad_out, saved, down_buffer),
    ]
    if biases is not None:
        grad_weights += expert_bias_gradients(grad_out, grad_gate_up, saved)
    ref_out, *ref_grads = reference(case, rows, w_gate, w_up, w_down, grad_out, biases)

    assert out.dtype == rows.dtype and out.shape == rows.shape
    assert relative_error(out[case.valid], ref_out) < FP32_TOL
    assert relative_error(grad_rows[case.valid], ref_grads[0]) < FP32_TOL
    names = ("gate", "up", "down", "gate bias", "up bias", "down bias")
    for name, got, want in zip(names, grad_weights, ref_grads[1:], strict=False):
        assert got.shape == want.shape and got.dtype == torch.float32, name
        assert relative_error(got, want) < FP32_TOL, name
    assert len(grad_weights) == len(ref_grads) - 1
    # Rows outside the groups get a zero gradient; empty experts a zero weight gradient.
    assert torch.equal(grad_rows[: case.before], torch.zeros_like(grad_rows[: case.before]))
    assert torch.equal(grad_rows[case.valid.stop :], torch.zeros_like(grad_rows[case.valid.stop :]))
    for expert, size in enumerate(case.sizes):
        if size == 0:
            for got in grad_weights:
                assert torch.equal(got[expert], torch.zeros_like(got[expert]))


@pytest.mark.parametrize(
    "case",
    [
        # The shared expert: one group holding every row.
        pytest.param(Case([37], 16, 16), id="one-group"),
        # Group tails, an empty middle expert, H and I not multiples of the 32-wide tiles, clamp.
        pytest.param(Case([5, 0, 21], 48, 80, after=7, limit=0.5), id="ragged-empty-clamp"),
        # Empty first and last experts, rows before the first group and capacity padding after.
        pytest.param(Case([0, 9, 16, 3, 0], 80, 48, before=4, after=5, seed=1), id="empty-ends"),
        # Every row on one expert of five.
        pytest.param(Case([0, 0, 40, 0, 0], 48, 16, seed=2), id="all-on-one"),
        # Fewer rows than one tile.
        pytest.param(Case([3, 1], 16, 48, seed=3), id="below-one-tile"),
        # A group one row short of a full tile, then padding: a store one row too far would put
        # garbage into a padding row of grad_rows after a later program zeroed it.
        pytest.param(Case([15], 48, 16, after=16, seed=7), id="tile-minus-one"),
        # No rows at all in the groups.
        pytest.param(Case([0, 0, 0], 16, 16, after=6, seed=4), id="all-empty"),
        # gpt-oss's activation and biases: ragged groups, empty experts, padding, its clamp.
        pytest.param(
            Case([0, 13, 0, 30], 48, 80, before=3, after=5, limit=0.9, seed=9, gpt_oss=True),
            id="gpt-oss",
        ),
    ],
)
def test_matches_reference(case):
    run_and_check(case)


@settings(max_examples=8, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    hidden=st.sampled_from([16, 48]),
    inter=st.sampled_from([16, 80]),
    before=st.integers(0, 3),
    after=st.integers(0, 9),
    limit=st.sampled_from([None, 0.7]),
    seed=st.integers(0, 2**16),
    gpt_oss=st.booleans(),
)
def test_fuzz_group_sizes(sizes, hidden, inter, before, after, limit, seed, gpt_oss):
    run_and_check(Case(sizes, hidden, inter, before, after, limit, seed, gpt_oss))


@pytest.mark.parametrize("accumulate", [False, True], ids=["fresh", "accumulate"])
def test_wide_weight_gradient_tiles(accumulate):
    """Weight-gradient tiles wider than 128 columns are stored in two halves (H and I above 128,
    so that both halves hold columns)."""
    case = Case([9, 0, 22], 160, 144, after=2, seed=8)
    small = default_config(torch.device("cpu"), case.hidden, case.inter)
    wide = GemmTiles(16, 256, 32, num_warps=4, num_stages=1, group_m=2)
    config = dataclasses.replace(small, down_wgrad=wide, gate_up_wgrad=wide)
    shapes = [(3, 144, 160), (3, 144, 160), (3, 160, 144)]
    buffers = [torch.zeros(shape) for shape in shapes] if accumulate else None
    run_and_check(case, config, buffers)


@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.bfloat16])
def test_weight_gradients_accumulate_into_buffers(buffer_dtype):
    case = Case([6, 0, 19], 48, 80, after=3, seed=5)
    rows, offsets, w_gate, w_up, w_down, grad_out = case.make()
    _, saved = expert_mlp_forward(rows, offsets, w_gate, w_up, w_down)
    _, *fresh = expert_mlp_backward(grad_out, saved)
    buffers = [torch.randn(w.shape).to(buffer_dtype) for w in (w_gate, w_up, w_down)]
    before = [b.clone() for b in buffers]
    _, *returned = expert_mlp_backward(grad_out, saved, *buffers)
    tol = FP32_TOL if buffer_dtype == torch.float32 else BF16_BUFFER_TOL
    for buffer, old, grad, got in zip(buffers, before, fresh, returned, strict=True):
        assert got is buffer
        assert relative_error(buffer, old.double() + grad.double()) < tol
        # Expert 1 has no rows: its slice of the buffer is untouched.
        assert torch.equal(buffer[1], old[1])


def test_forward_without_saving_matches():
    case = Case([7, 12], 16, 48, after=2, seed=6)
    rows, offsets, w_gate, w_up, w_down, _ = case.make()
    out, saved = expert_mlp_forward(rows, offsets, w_gate, w_up, w_down)
    out_nosave, nothing = expert_mlp_forward(
        rows, offsets, w_gate, w_up, w_down, save_for_backward=False
    )
    assert nothing is None and saved is not None
    assert torch.equal(out[case.valid], out_nosave[case.valid])


def test_no_rows():
    rows = torch.empty(0, 16)
    offsets = torch.zeros(3, dtype=torch.int32)
    weights = [torch.randn(2, 32, 16), torch.randn(2, 32, 16), torch.randn(2, 16, 32)]
    out, saved = expert_mlp_forward(rows, offsets, *weights)
    grad_rows, *grad_weights = expert_mlp_backward(torch.empty(0, 16), saved)
    assert out.shape == (0, 16) and grad_rows.shape == (0, 16)
    for grad in grad_weights:
        assert torch.equal(grad, torch.zeros_like(grad))


def test_row_tile_map_lists_every_tile():
    sizes = [0, 5, 16, 17, 0, 40]
    before, after, block_m = 3, 20, 16
    num_rows = before + sum(sizes) + after
    offsets = (torch.tensor([0, *sizes]).cumsum(0) + before).to(torch.int32)
    tiles = row_tile_map(offsets, num_rows, block_m)
    expected = []
    groups = [(e, int(offsets[e]), int(offsets[e + 1])) for e in range(len(sizes))]
    groups += [(-1, 0, before), (-1, before + sum(sizes), num_rows)]
    for expert, lo, hi in groups:
        expected += [(expert, row, hi) for row in range(lo, hi, block_m)]
    num_expert_tiles = sum(1 for entry in expected if entry[0] >= 0)
    assert tiles.counts.tolist() == [num_expert_tiles, len(expected)]
    listed = tiles.table[:, : len(expected)].T.tolist()
    assert [tuple(entry) for entry in listed] == expected


def _inputs():
    case = Case([4, 4], 16, 32)
    rows, offsets, w_gate, w_up, w_down, _ = case.make()
    return dict(rows=rows, group_offsets=offsets, w_gate=w_gate, w_up=w_up, w_down=w_down)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(rows=torch.randn(8, 16, dtype=torch.float64)), "rows has dtype float64"),
        (dict(rows=torch.randn(8, 32)), "rows has shape"),
        (dict(rows=torch.randn(8)), "rows must be a 2-D tensor"),
        (dict(group_offsets=torch.tensor([0, 4, 8])), "group_offsets has dtype int64"),
        (dict(group_offsets=torch.tensor([0, 8], dtype=torch.int32)), "group_offsets has shape"),
        (dict(w_gate=torch.randn(2, 32, 16).double()), "w_gate has dtype float64"),
        (dict(w_up=torch.randn(2, 16, 16)), "w_up has shape"),
        (dict(w_down=torch.randn(3, 16, 32)), "w_down has shape"),
        (
            dict(
                rows=torch.randn(8, 24),
                w_gate=torch.randn(2, 32, 24),
                w_up=torch.randn(2, 32, 24),
                w_down=torch.randn(2, 24, 32),
            ),
            "H=24 must be a positive multiple of 16",
        ),
        (dict(w_gate=torch.randn(2, 16, 32).transpose(1, 2)), "w_gate must have a unit last"),
        (dict(swiglu_limit=-1.0), "swiglu_limit must be finite and > 0"),
    ],
)
def test_bad_forward_inputs_raise(change, message):
    inputs = _inputs()
    inputs.update(change)
    with pytest.raises(ValueError, match=message):
        expert_mlp_forward(**inputs)


def test_bad_backward_inputs_raise():
    inputs = _inputs()
    _, saved = expert_mlp_forward(**inputs)
    grad_out = torch.randn(8, 16)
    with pytest.raises(ValueError, match="grad_out has shape"):
        expert_mlp_backward(torch.randn(8, 32), saved)
    with pytest.raises(ValueError, match="grad_w_gate has dtype float16"):
        expert_mlp_backward(grad_out, saved, grad_w_gate=torch.zeros(2, 32, 16).half())
    with pytest.raises(ValueError, match="grad_w_down has shape"):
        expert_mlp_backward(grad_out, saved, grad_w_down=torch.zeros(2, 32, 16))
    with pytest.raises(ValueError, match="saved must be the ExpertMLPSaved"):
        expert_mlp_backward(grad_out, None)


def test_backward_reading_the_rows_through_an_index_matches():
    """A forward's saved rows swapped for the tokens they were copied from and each grouped row's
    index (`read_rows_through`, what the fused layer keeps at EP > 1): the same gradients bit for
    bit, released with the rows, and a mis-sized or int64 index refused before any kernel reads
    it. Bugs caught: the backward still reading the grouped rows (released) or an index of the
    wrong rows, and an index whose width the kernels would misread."""
    case = Case([5, 0, 9], 16, 48, after=3, seed=4)
    rows, offsets, w_gate, w_up, w_down, grad_out = case.make()
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randn(7, rows.shape[1], generator=generator)
    index = torch.randint(0, 7, (rows.shape[0],), generator=generator, dtype=torch.int32)
    grouped = tokens[index.long()]
    _, kept = expert_mlp_forward(grouped, offsets, w_gate, w_up, w_down)
    _, through = expert_mlp_forward(grouped, offsets, w_gate, w_up, w_down)
    with pytest.raises(ValueError, match="source_rows: expected"):
        through.read_rows_through(tokens, index.long())
    with pytest.raises(ValueError, match="source_rows: expected"):
        through.read_rows_through(tokens, index[:-1])
    with pytest.raises(ValueError, match="rows read through an index"):
        through.read_rows_through(tokens[:, :8], index)
    through.read_rows_through(tokens, index)
    expected = expert_mlp_backward(grad_out, kept)
    got = expert_mlp_backward(grad_out, through, release=True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert (through.rows, through.source_rows) == (None, None)


def test_weights_that_are_halves_of_one_tensor_get_gradients_in_one_tensor():
    """w_gate and w_up [E, I, H] as the halves of one [E, 2I, H] tensor (Hugging Face's
    `gate_up_proj`): the output and every gradient equal those of separate contiguous weights
    bit for bit, and the fresh gate and up gradients are the halves of one [E, 2I, H] tensor,
    which `joined_gate_up` hands back without a copy. Catches gradient tiles stored at the
    separate layout's rows (expert e at e * I: into the other half or the next expert) and the
    halves' gradients allocated apart (a concatenation per call in the layer)."""
    case = Case([5, 0, 9], 16, 48, after=3, seed=7)
    rows, offsets, w_gate, w_up, w_down, grad_out = case.make()
    halves = gate_up_halves(torch.cat((w_gate, w_up), dim=1))
    out, saved = expert_mlp_forward(rows, offsets, w_gate, w_up, w_down)
    out_halves, saved_halves = expert_mlp_forward(rows, offsets, *halves, w_down)
    assert torch.equal(out_halves[case.valid], out[case.valid])
    expected = expert_mlp_backward(grad_out, saved)
    got = expert_mlp_backward(grad_out, saved_halves)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert are_gate_up_halves(got[1], got[2])
    assert joined_gate_up(got[1], got[2]).data_ptr() == got[1].data_ptr()


def test_forward_reading_the_rows_through_an_index_matches():
    """The forward given x-like rows [S, H] and each grouped row's index (`source_rows`, what
    the one-process layer passes where the kernels gather well) instead of the grouped rows:
    the same output and gradients bit for bit, and the saved experts keep the S rows and the
    index, not a grouped copy. Bugs caught: grouped rows read in place of rows[index] (other
    values), the output sized by S instead of the index (rows missing), the index dropped from
    the saved experts (the backward reading S rows as grouped ones)."""
    case = Case([5, 0, 9], 16, 48, after=3, seed=8)
    _, offsets, w_gate, w_up, w_down, grad_out = case.make()
    generator = torch.Generator().manual_seed(8)
    m = grad_out.shape[0]
    tokens = torch.randn(7, w_gate.shape[2], generator=generator)
    index = torch.randint(0, 7, (m,), generator=generator, dtype=torch.int32)
    out, copied = expert_mlp_forward(tokens[index.long()], offsets, w_gate, w_up, w_down)
    out_through, through = expert_mlp_forward(
        tokens, offsets, w_gate, w_up, w_down, source_rows=index
    )
    assert out_through.shape == out.shape
    assert torch.equal(out_through[case.valid], out[case.valid])
    assert through.rows is tokens and through.source_rows is index
    expected = expert_mlp_backward(grad_out, copied)
    got = expert_mlp_backward(grad_out, through)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_backward_that_releases_the_saved_activations_matches():
    """`release=True` drops rows, h and the pre-activations after the last product that reads
    each: the same gradients bit for bit, the saved state emptied, and a product that needs a
    released activation raises instead of reading freed memory. Bug caught: an activation
    released before a product that reads it (expert_mlp_backward's order changed)."""
    case = Case([5, 0, 9], 16, 48, after=3, seed=3)
    rows, offsets, w_gate, w_up, w_down, grad_out = case.make()
    _, kept = expert_mlp_forward(rows, offsets, w_gate, w_up, w_down, swiglu_limit=1.0)
    _, released = expert_mlp_forward(rows, offsets, w_gate, w_up, w_down, swiglu_limit=1.0)
    expected = expert_mlp_backward(grad_out, kept)
    got = expert_mlp_backward(grad_out, released, release=True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert (released.rows, released.h, released.gate_up) == (None, None, None)
    assert all(t is not None for t in (kept.rows, kept.h, kept.gate_up))
    with pytest.raises(ValueError, match="the saved gate_up was released"):
        expert_mlp_backward(grad_out, released)
    with pytest.raises(ValueError, match="'w_gate' is not a saved activation"):
        kept.release("w_gate")
