"""Whether the Gluon kernels may run with the installed Triton. Gluon is experimental and its API
changes between Triton releases (names removed in 3.9, tools moved): the kernels are compiled in
CI with the releases of `TESTED_TRITON`, and outside them the tl twins run unless the user asks
for Gluon. Importable without Triton."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import warnings

TESTED_TRITON = ((3, 6), (3, 9))
"""The oldest and newest Triton (major, minor) whose Gluon API the kernels are written for; CI
compiles every Gluon kernel with both."""
SETTING = "MOK_WARP_SPECIALIZED"
"""Unset: the Gluon kernels on Hopper GPUs with a tested Triton; 1: with any Triton; 0: never."""


@functools.cache
def triton_version() -> tuple[int, int] | None:
    """(major, minor) of the installed Triton; None without one. Read once: the package lookup
    scans the installed distributions, and every product of every layer call asks
    (`warp_specialized.available`)."""
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def off_reason() -> str | None:
    """Why the Gluon kernels do not run here even on a Hopper GPU (None: they do)."""
    setting = os.environ.get(SETTING)
    if setting == "0":
        return f"{SETTING}=0"
    version = triton_version()
    if version is None:
        return "Triton is not installed"
    low, high = TESTED_TRITON
    if setting != "1" and not low <= version <= high:
        return (
            f"Triton {version[0]}.{version[1]} is outside the Gluon kernels' tested range "
            f"{low[0]}.{low[1]} to {high[0]}.{high[1]} ({SETTING}=1 runs them anyway)"
        )
    return None


def enabled() -> bool:
    """Whether the Gluon kernels may run (on Hopper GPUs); warns once when an untested Triton
    turns them off, so that the slower tl kernels are not a silent surprise."""
    reason = off_reason()
    if reason is not None and not reason.startswith(SETTING):
        _warn_once(reason)
    return reason is None


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"MoK runs its tl kernels in place of the Gluon ones: {reason}", stacklevel=3)
