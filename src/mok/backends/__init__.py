"""Backends behind the functional API (each a `mok.backends.protocol.LayerBackend`), and how
`auto` chooses among them."""

from __future__ import annotations

from mok.backends.fused import FusedBackend
from mok.backends.reference import ReferenceBackend
from mok.backends.triton import TritonBackend
from mok.config import Backend, MoKConfig
from mok.errors import BackendUnavailableError

# Fastest first: `auto` takes the first that can run.
BACKENDS = {
    Backend.TRITON: TritonBackend,
    Backend.FUSED: FusedBackend,
    Backend.REFERENCE: ReferenceBackend,
}


def _auto_reason(backend, config: MoKConfig, device, group) -> str | None:
    """Why `auto` does not pick `backend` here (None: it may)."""
    reason = backend.unavailable_reason(config, device, group)
    return reason if reason is not None else backend.auto_skip_reason(device)


def select_backend(config: MoKConfig, device, group):
    """The backend class for `config.backend` (for `auto`: the fastest that can run here)."""
    if config.backend is Backend.AUTO:
        reasons = {}
        for name, backend in BACKENDS.items():
            reason = _auto_reason(backend, config, device, group)
            if reason is None:
                return backend
            reasons[name.value] = reason
        details = "; ".join(f"{name}: {why}" for name, why in reasons.items())
        raise BackendUnavailableError(f"no backend can run this layer ({details})")
    backend = BACKENDS[config.backend]
    reason = backend.unavailable_reason(config, device, group)
    if reason is not None:
        raise BackendUnavailableError(f"backend {config.backend.value!r} cannot run: {reason}")
    return backend


def backend_report(config: MoKConfig, device, group=None) -> dict[str, str | None]:
    """Backend name -> None if `auto` may pick it here, else why not."""
    return {
        name.value: _auto_reason(backend, config, device, group)
        for name, backend in BACKENDS.items()
    }


def symmetric_buffer_bytes(config: MoKConfig, ep_size: int) -> dict[str, int]:
    """Bytes per region of the symmetric buffer each rank allocates on GPUs for layers of
    `config` at `ep_size` (the triton backend's layout for `auto`, as `auto` picks it on GPUs),
    without allocating it. Layers of one config share one buffer. Empty at EP 1 and for the
    reference backend, which allocate none (the reference's collectives use NCCL's buffers)."""
    backend = TritonBackend if config.backend is Backend.AUTO else BACKENDS[config.backend]
    if not issubclass(backend, TritonBackend):
        return {}
    return backend.symmetric_buffer_bytes(config, ep_size)
