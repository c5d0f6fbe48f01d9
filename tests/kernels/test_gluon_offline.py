"""Every warp-specialized Gluon kernel variant compiles for Hopper on a machine with no GPU.

`scripts/compile_gluon.py` runs in its own process (it replaces Triton's active driver) and
compiles each launcher's kernel to a cubin for sm_90. Bugs this catches on CPU-only CI, before any
GPU sees the change: a Gluon edit that does not compile (a wrong layout, a type that differs between
a loop's iterations, a partition's arguments out of step), a ring or tile change that asks for more
shared memory than a Hopper block has, and a register-budget change that makes a consumer spill.
Correctness stays with the GPU tests (`test_warp_specialized.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

KNOWN_STACK_BYTES = {
    # The clamped SwiGLU backward's epilogue (gpt-oss) keeps its masks beside the gradients: ptxas
    # spills 216 (Triton 3.6) to 248 (3.8) bytes a thread in both tilings.
    "down_dgrad_swiglu ping-pong clamp": 256,
    "down_dgrad_swiglu cooperative clamp": 256,
}


@pytest.mark.skipif(not (TOOLS / "ptxas").exists(), reason="Triton without its NVIDIA backend")
def test_every_gluon_variant_compiles_for_hopper_within_its_resources(tmp_path):
    from mok.kernels import warp_specialized as ws

    out = tmp_path / "gluon.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_gluon.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = json.loads(out.read_text())
    variants = {row["variant"] for row in rows}
    assert len(variants) == 18 and all("error" not in row for row in rows)
    for row in rows:
        assert row["kernel"] in ("_rows_wt_kernel", "_group_at_b_kernel")
        assert 0 < row["shared"] <= 232448, row
        # Each consumer's budget is set in the kernel; the whole kernel's limit stays MAX_REGISTERS.
        assert row["registers"] <= ws.MAX_REGISTERS, row
        assert row["stack"] <= KNOWN_STACK_BYTES.get(row["variant"], 0), row
