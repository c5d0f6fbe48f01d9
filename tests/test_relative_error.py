"""mok.testing.relative_error: the comparison every check relies on."""

import pytest
import torch

import mok.testing
from mok.testing import relative_error


def test_matches_the_norm_ratio_across_chunks(monkeypatch):
    monkeypatch.setattr(mok.testing, "_ERROR_CHUNK", 7)  # many chunks, the last one short
    generator = torch.Generator().manual_seed(0)
    expected = torch.randn(5, 11, generator=generator).to(torch.bfloat16)
    actual = expected.float() + 0.01 * torch.randn(5, 11, generator=generator)
    want = ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
    assert relative_error(actual, expected) == pytest.approx(want, rel=1e-12)


def test_plain_error_when_expected_is_zero():
    assert relative_error(torch.full((3,), 2.0), torch.zeros(3)) == pytest.approx(12**0.5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_never_pass(monkeypatch, bad):
    monkeypatch.setattr(mok.testing, "_ERROR_CHUNK", 4)
    values = torch.ones(10)
    broken = values.clone()
    broken[9] = bad  # in the last chunk
    assert relative_error(broken, values) == float("inf")
    assert relative_error(values, broken) == float("inf")


def test_shapes_must_match():
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(torch.zeros(2, 3), torch.zeros(3, 2))
