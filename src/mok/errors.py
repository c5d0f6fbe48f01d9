"""Every error MoK raises on purpose, in one place. The messages name the tensor, field, rank or
wait at fault; `mok` re-exports all of them."""

from __future__ import annotations


class MoKConfigError(ValueError):
    """A configuration that cannot describe a valid MoE layer."""


class MoKInputError(ValueError):
    """An input the layer cannot process; the message names the tensor and the problem."""


class MoKCapacityError(MoKInputError):
    """More rows were routed to a rank than its receive buffers hold; rows were dropped."""


class MoKTimeoutError(RuntimeError):
    """A rank waited on a peer longer than the timeout allows, or found the peers' calls out of
    step; the message names the rank, the peer and the wait. The results of the calls since the
    last check are undefined; every rank must reset the workspace before the next call."""


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run with this config, device or group."""
