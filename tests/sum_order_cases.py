"""Adversarial data for the fp32 sums whose order is part of the contract (README "Numerics"): the
combine and the exchanges' reductions. Every output element sums +2^24, -2^24 and small odd
integers placed in a random order; a small term added while 2^24 is in the fp32 accumulator is
rounded (the spacing there is 2), so the result, a small integer exact in bf16, depends on the
order. The oracle sums in numpy float32, one rounding per addition, in the order it is given."""

import numpy as np
import torch

BIG = 2.0**24


def order_sensitive_addends(rows: int, count: int, hidden: int, seed: int) -> torch.Tensor:
    """[rows, count, hidden] float32, exact in bf16: in every column (r, :, h) of count >= 2
    addends, +BIG and -BIG at two random positions and odd integers in [-7, 7] elsewhere."""
    generator = np.random.default_rng(seed)
    addends = generator.choice([-7.0, -5.0, -3.0, -1.0, 1.0, 3.0, 5.0, 7.0], (rows, hidden, count))
    big_at = generator.permuted(np.tile(np.arange(count), (rows, hidden, 1)), axis=2)[..., :2]
    np.put_along_axis(addends, big_at, np.array([BIG, -BIG]), axis=2)
    return torch.from_numpy(addends.astype(np.float32)).transpose(1, 2).contiguous()


def power_of_two_weights(rows: int, count: int, seed: int) -> torch.Tensor:
    """[rows, count] float32 router weights in {1/4, 1/2, 1, 2}: scaling an addend by one and
    back is exact, so `addend / w` makes terms whose products w * (addend / w) are the addends."""
    weights = np.random.default_rng(seed).choice([0.25, 0.5, 1.0, 2.0], (rows, count))
    return torch.from_numpy(weights.astype(np.float32))


def sequential_sum(addends: torch.Tensor) -> torch.Tensor:
    """addends [rows, count, hidden] -> [rows, hidden]: float32 sum over count, index 0 first."""
    values = addends.numpy().astype(np.float32)
    acc = np.zeros_like(values[:, 0])
    for index in range(values.shape[1]):
        acc = acc + values[:, index]
    return torch.from_numpy(acc)


def contraction_sensitive_terms(hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(terms [1, 2, hidden] float32 exact in bf16, weights [1, 2] float32) whose contract sum
    w0 * t0 + w1 * t1 is 0: w0 * t0 = -(1 + 2^-7 + 2^-17) exactly, and w1 * t1 =
    1 + 2^-7 + 2^-17 + 2^-24 rounds (to even) to its negation. A multiply-add contracted into
    one rounding keeps the 2^-24."""
    terms = torch.tensor([-1.0, 1.0 + 2.0**-7]).view(1, 2, 1).expand(1, 2, hidden).contiguous()
    weights = torch.tensor([[1.0 + 2.0**-7 + 2.0**-17, 1.0 + 2.0**-17]])
    return terms, weights
