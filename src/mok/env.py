"""`mok env`: what this machine offers the MoE layer, and which backends can run."""

from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

import mok
from mok.backends import backend_report
from mok.kernels import gluon_support
from mok.presets import get_preset


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _symmetric_memory() -> dict[str, object]:
    """Whether torch's symmetric memory imports, and whether NVSHMEM is there."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except Exception as error:  # noqa: BLE001 - any import failure means "not available"
        return {"importable": False, "reason": f"{type(error).__name__}: {error}"}
    info: dict[str, object] = {"importable": True}
    nvshmem = getattr(symm_mem, "is_nvshmem_available", None)
    if nvshmem is not None:
        try:
            info["nvshmem"] = bool(nvshmem())
        except Exception as error:  # noqa: BLE001
            info["nvshmem"] = f"error: {error}"
    return info


def _cuda_devices() -> list[dict[str, object]]:
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        peers = [
            other
            for other in range(torch.cuda.device_count())
            if other != index and torch.cuda.can_device_access_peer(index, other)
        ]
        devices.append(
            {
                "index": index,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "sms": props.multi_processor_count,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "peer_access": peers,
            }
        )
    return devices


SETTINGS = {
    "MOK_TRITON_LAUNCH": "fast (kernels launched beneath Triton's per-call work) or standard",
    "MOK_WARP_SPECIALIZED": "unset (Gluon kernels on Hopper with a tested Triton), 1 (with any "
    "Triton) or 0 (the tl kernels everywhere)",
    "TRITON_INTERPRET": "1: Triton kernels on CPU tensors under the interpreter (a test mode)",
}
"""The environment variables that change what MoK runs, with what their values mean."""


def collect_env() -> dict[str, object]:
    """A JSON-friendly description of the machine and of the backends that can run on it."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    config = get_preset("tiny").config()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "mok": mok.__version__,
        "cuda_available": cuda,
        "cuda_devices": _cuda_devices() if cuda else [],
        "distributed": {
            "available": torch.distributed.is_available(),
            "nccl": torch.distributed.is_available() and torch.distributed.is_nccl_available(),
            "gloo": torch.distributed.is_available() and torch.distributed.is_gloo_available(),
        },
        "symmetric_memory": _symmetric_memory(),
        "backends": {
            name: reason or "ok" for name, reason in backend_report(config, device).items()
        },
        "gluon_kernels": gluon_support.off_reason() or "on (Hopper GPUs)",
        "settings": {name: os.environ.get(name) for name in SETTINGS},
    }


def print_env(info: dict[str, object]) -> None:
    """Print `collect_env()` as tables."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    table = Table(title="MoK environment", show_header=False)
    for key in ("python", "platform", "torch", "torch_cuda", "triton", "mok", "cuda_available"):
        table.add_row(key, str(info[key]))
    table.add_row("Gluon kernels", escape(info["gluon_kernels"]))
    table.add_row("distributed", ", ".join(f"{k}={v}" for k, v in info["distributed"].items()))
    table.add_row(
        "symmetric memory", ", ".join(f"{k}={v}" for k, v in info["symmetric_memory"].items())
    )
    console.print(table)
    if info["cuda_devices"]:
        devices = Table(title="CUDA devices")
        for column in ("index", "name", "capability", "SMs", "memory GiB", "peer access"):
            devices.add_column(column)
        for dev in info["cuda_devices"]:
            devices.add_row(
                str(dev["index"]),
                dev["name"],
                dev["capability"],
                str(dev["sms"]),
                str(dev["memory_gib"]),
                ", ".join(map(str, dev["peer_access"])) or "none",
            )
        console.print(devices)
    backends = Table(title="Backends")
    backends.add_column("backend")
    backends.add_column("can run here")
    for name, status in info["backends"].items():
        backends.add_row(name, escape(status))
    console.print(backends)
    settings = Table(title="Settings (environment)")
    for column in ("variable", "value", "values"):
        settings.add_column(column)
    for name, value in info["settings"].items():
        settings.add_row(name, "unset" if value is None else value, SETTINGS[name])
    console.print(settings)
