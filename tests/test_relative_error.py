"""mok.testing.relative_error: the comparison every check relies on."""

import pytest
import torch

import mok
import mok.testing
from mok.testing import (
    RankInputs,
    global_weights,
    one_call_errors,
    one_call_results,
    relative_error,
)


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


def test_one_call_errors_pair_each_result_with_its_own_expected():
    """The bench's memory-light check (no copy of the layer's gradients) must give what comparing
    `one_call_results` gives, key by key; a key paired with another's expected value (a swapped
    gradient, a parameter missed) shows here, since every key is compared with a shifted copy."""
    config = mok.MoKConfig(
        hidden_size=16,
        intermediate_size=8,
        num_experts=4,
        top_k=2,
        shared_intermediate_size=8,
        backend="reference",
    )
    layer = mok.MoE(config)
    layer.load_global_weights(global_weights(config, 0, torch.device("cpu")))
    generator = torch.Generator().manual_seed(1)
    tokens = 5
    inputs = RankInputs(
        torch.randn(tokens, 16, generator=generator).to(torch.bfloat16),
        torch.randint(0, 4, (tokens, 2), generator=generator),
        torch.rand(tokens, 2, generator=generator),
        torch.randn(tokens, 16, generator=generator).to(torch.bfloat16),
    )
    results = one_call_results(layer, inputs)
    expected = {
        key: value.float() * (1 + 0.01 * i) for i, (key, value) in enumerate(results.items())
    }
    errors = one_call_errors(layer, inputs, expected)
    assert errors.keys() == results.keys()
    for key, value in results.items():
        assert errors[key] == relative_error(value, expected[key]), key
    assert all(error > 0 for error in list(errors.values())[1:])
    assert all(param.grad is None for param in layer.parameters())
