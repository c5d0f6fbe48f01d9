"""Compile every warp-specialized Gluon kernel variant for Hopper (sm_90) on a machine with no GPU.

Gluon kernels cannot run under the Triton interpreter, so without this a change to them meets
its first compiler error on the GPU machine. Here Triton's active driver is replaced by a stand-in
that reports an sm_90 target and launches nothing: each launcher in `mok.kernels.warp_specialized`
runs on small CPU tensors, Triton compiles its kernel down to a cubin (ptxas included), and the
cubin's resources are read back with `cuobjdump`. Prints one row per variant: shared memory,
registers, stack (register spills land there). Exit status 1 when a variant fails to compile or
asks for more shared memory than a Hopper block may have.

    python scripts/compile_gluon.py [--json PATH]

Nothing is launched and no result is checked: correctness stays with the GPU tests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

os.environ["MOK_TRITON_LAUNCH"] = "standard"  # Triton's own launch: the stand-in sees every call
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

HOPPER_SHARED_BYTES = 232448
"""The most dynamic shared memory one block may have on H100 and H200 (227 KiB)."""
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


class _NoLaunch:
    """A compiled kernel's launcher that launches nothing."""

    def __init__(self, src, metadata) -> None:
        pass

    def __call__(self, *args, **kwargs) -> None:
        return None


class _Binaries:
    """Driver utilities: every loaded binary is recorded, none is loaded."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, bytes, int]] = []

    def load_binary(self, name, cubin, shared, device):
        self.loaded.append((name, cubin, shared))
        return None, None, 0, 0, 1024

    def get_device_properties(self, device):
        return {"max_shared_mem": HOPPER_SHARED_BYTES, "multiprocessor_count": 132}


class OfflineHopper:
    """Triton's active driver while inside: an sm_90 target that compiles and never launches."""

    def __init__(self) -> None:
        self.utils = _Binaries()
        self.launcher_cls = _NoLaunch

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True

    def __enter__(self) -> OfflineHopper:
        driver.set_active(self)
        return self

    def __exit__(self, *exc) -> None:
        try:
            driver.reset_active()
        except RuntimeError:  # no GPU driver here: the stand-in stays until the process ends
            pass


def resources(cubin: bytes) -> dict[str, int]:
    """Registers and stack bytes per thread of a cubin's kernel (`cuobjdump -res-usage`)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(TOOLS / "cuobjdump"), "-res-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return {"registers": int(usage[1]), "stack": int(usage[2])}


def _groups(sizes: list[int]) -> tuple[int, torch.Tensor]:
    offsets = torch.tensor([0, *sizes]).cumsum(0).to(torch.int32)
    return sum(sizes), offsets


def variants() -> dict[str, Callable[[], None]]:
    """Name -> a call of one launcher on small CPU tensors (groups of uneven sizes)."""
    from mok.kernels import warp_specialized as ws
    from mok.kernels.grouped_gemm import row_tile_map

    m, offsets = _groups([300, 257, 128, 511])
    experts, n, k = 4, 384, 256
    bf16 = torch.bfloat16
    x = torch.randn(m, k).to(bf16)
    w, w2 = torch.randn(experts, n, k).to(bf16), torch.randn(experts, n, k).to(bf16)
    gate_up = torch.randn(m, 2 * n).to(bf16)
    w_down = torch.randn(experts, k, n).to(bf16)
    tokens = torch.randint(0, m, (m,), dtype=torch.int32)

    def tiles(cfg):
        return row_tile_map(offsets, m, cfg.block_m)

    calls = {}
    for label, cfg in (("ping-pong", ws.PING_PONG), ("cooperative", ws.COOPERATIVE)):
        calls[f"rows_wt {label}"] = lambda cfg=cfg: ws.rows_wt(x, w, tiles(cfg), cfg)
        calls[f"gate_up_dgrad {label}"] = lambda cfg=cfg: ws.gate_up_dgrad(
            gate_up, w, w2, tiles(cfg), cfg
        )
    calls["rows_wt gathered"] = lambda: ws.rows_wt(
        x, w, tiles(ws.PING_PONG), ws.PING_PONG, source_rows=tokens
    )
    for label, cfg in (("ping-pong", ws.SWIGLU_PING_PONG), ("cooperative", ws.SWIGLU_COOPERATIVE)):
        for limit in (None, 7.0):
            name = f"gate_up_swiglu {label}{'' if limit is None else ' clamp'}"
            calls[name] = lambda cfg=cfg, limit=limit: ws.gate_up_swiglu(
                x, w, w2, tiles(cfg), limit, True, cfg
            )
    calls["gate_up_swiglu gathered"] = lambda: ws.gate_up_swiglu(
        x, w, w2, tiles(ws.SWIGLU_PING_PONG), None, True, source_rows=tokens
    )
    dgrad = (("ping-pong", ws.DGRAD_SWIGLU_PING_PONG), ("cooperative", ws.DGRAD_SWIGLU_COOPERATIVE))
    for label, cfg in dgrad:
        for limit in (None, 7.0):
            name = f"down_dgrad_swiglu {label}{'' if limit is None else ' clamp'}"
            calls[name] = lambda cfg=cfg, limit=limit: ws.down_dgrad_swiglu(
                x, w_down, gate_up, tiles(cfg), limit, cfg
            )
    h = torch.randn(m, n).to(bf16)
    for dtype, accumulate in ((bf16, False), (torch.float32, True)):
        name = f"down_wgrad {'+= fp32' if accumulate else 'bf16'}"
        calls[name] = lambda dtype=dtype, accumulate=accumulate: ws.down_wgrad(
            x, h, offsets, torch.zeros(experts, k, n, dtype=dtype), accumulate
        )
    grads = [torch.zeros(experts, n, k).to(bf16) for _ in range(2)]
    calls["gate_up_wgrad bf16"] = lambda: ws.gate_up_wgrad(
        gate_up, x, offsets, *grads, False, False
    )
    calls["gate_up_wgrad gathered"] = lambda: ws.gate_up_wgrad(
        gate_up, x, offsets, *grads, False, False, source_rows=tokens
    )
    return calls


def compile_all(names: list[str] | None = None) -> list[dict]:
    """One row per variant (all of `variants()`, or those named): its kernels' shared memory,
    registers and stack, or the error that stopped its compilation."""
    from mok.kernels import warp_specialized as ws

    on_gpus = ws.available
    ws.available = lambda device: True  # the launchers' check of a Hopper GPU: the target is one
    try:
        with OfflineHopper() as offline:
            return [
                row
                for name, call in variants().items()
                if not names or name in names
                for row in _compiled(offline, name, call)
            ]
    finally:
        ws.available = on_gpus


def _compiled(offline: OfflineHopper, name: str, call: Callable[[], None]) -> list[dict]:
    """The rows of one variant: each Gluon kernel its call compiled, or its error."""
    offline.utils.loaded.clear()
    try:
        call()
    except Exception as error:  # noqa: BLE001 - reported per variant
        return [{"variant": name, "error": f"{type(error).__name__}: {error}"}]
    return [
        {"variant": name, "kernel": kernel, "shared": shared, **resources(cubin)}
        for kernel, cubin, shared in offline.utils.loaded
        if not kernel.startswith("_row_tile_map")  # the tl helper that builds the row tiles
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("variants", nargs="*", help="only these variants (default: all)")
    args = parser.parse_args(argv)
    if not (TOOLS / "ptxas").exists() or not (TOOLS / "cuobjdump").exists():
        print(f"no ptxas and cuobjdump under {TOOLS}: Triton's NVIDIA backend is needed")
        return 2
    rows = compile_all(args.variants)
    failed = False
    print(f"Triton {triton.__version__}, target sm_90")
    print("| variant | kernel | shared bytes | registers | stack bytes |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        if "error" in row:
            failed = True
            print(f"| {row['variant']} | **failed**: {row['error'][:300]} | | | |")
            continue
        over = row["shared"] > HOPPER_SHARED_BYTES
        failed |= over
        shared = f"**{row['shared']}** (over {HOPPER_SHARED_BYTES})" if over else row["shared"]
        print(
            f"| {row['variant']} | {row['kernel']} | {shared} | {row['registers']} | "
            f"{row['stack']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
