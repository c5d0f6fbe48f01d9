"""The routed weights' casts kept between calls while the weights are unchanged (evaluation,
the micro-batches of one optimizer step): `WeightCastCache`, the keeping that MXFP8's
(`mx_expert_mlp.MXWeightCache`) and the 128-block recipe's (`fp8_block_expert_mlp`) casts share."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

Casts = TypeVar("Casts")


class WeightCastCache(Generic[Casts]):
    """The last casts made, reused while the weights are unchanged: the same tensor objects (held
    weakly) with the same storage, shape, strides and version counter, and the same options.
    Every in-place update through PyTorch (an optimizer step, `load_state_dict`, `copy_`) bumps
    the version; a write through `.data` does not, and calls for `clear()`. Never used while a
    CUDA graph is captured: a replay must cast the weights it finds then."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._refs: tuple = ()
        self._casts: Casts | None = None
        self.casts = 0
        """How many times the weights were cast (tests, benchmarks)."""

    def cached(
        self,
        weights: tuple[torch.Tensor, ...],
        options: tuple,
        make: Callable[[], Casts],
        enough: Callable[[Casts], bool] = lambda casts: True,
    ) -> Casts:
        """The kept casts of `weights` made with `options` where they still hold and are `enough`,
        else make()'s, kept in their place."""
        if weights[0].is_cuda and torch.cuda.is_current_stream_capturing():
            return make()
        key = options + tuple(
            (w.data_ptr(), w._version, tuple(w.shape), w.stride(), w.dtype) for w in weights
        )
        same = len(self._refs) == len(weights) and all(
            ref() is w for ref, w in zip(self._refs, weights, strict=True)
        )
        if not same or key != self._key or not enough(self._casts):
            self._casts = None  # the old casts' memory first
            self._casts = make()
            self._key, self._refs = key, tuple(weakref.ref(w) for w in weights)
            self.casts += 1
        return self._casts

    @property
    def kept(self) -> Casts | None:
        """The casts kept now, or None."""
        return self._casts

    def clear(self) -> None:
        self._key, self._refs, self._casts = None, (), None
