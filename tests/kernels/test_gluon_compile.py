"""The Gluon kernels (the warp-specialized products, the MXFP8 casts of grouped rows) compile for
Hopper on a machine with no GPU.

`scripts/gluon_compile_check.py` runs in its own process (it replaces Triton's active driver),
compiles each Gluon kernel variant the layer launches to PTX for sm_90a with the installed Triton
and runs the bundled ptxas on it. Bugs this catches on CPU-only CI, before any GPU sees the
change: a Gluon edit that does not compile (a wrong layout, a type that differs between a loop's
iterations, a partition's arguments out of step, an API that a newer Triton renamed), a ring or
tile change that asks for more shared memory than a Hopper block has, and a change that makes a
kernel spill registers where it did not. Correctness stays with the GPU tests
(`test_warp_specialized.py`); the tl kernels run under the interpreter in other CPU tests.
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
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
"""Where Triton keeps the ptxas builds it runs (`gluon_compile_check.hopper_ptxas` picks one)."""

GLUON_CASES = r"^(?!tl )(?!.*K=136)"
"""Every Gluon variant but the repeat of the gathered rows at an odd K: 48 labels, ~110 s
on two cores with a cold Triton cache."""

KNOWN_SPILL_BYTES = {
    # ptxas's spill stores and loads, summed, the most of Triton 3.6 to 3.9 (the ptxas each
    # runs for sm_90). The clamped SwiGLU backward's epilogue (gpt-oss) keeps its masks beside the
    # gradients; the waiting gate/up kernel keeps the readiness wait's bounds (none under 3.9).
    # Under Triton 3.6 the claiming gather loader (40 registers) saves one 64-bit address around
    # its warpgroup's barrier once per K step (none from 3.7).
    "down_dgrad_swiglu 64x128 limit=7.0": 1024,
    "down_dgrad_swiglu 128x128 cooperative limit=7.0": 1024,
    "down_dgrad_swiglu gpt-oss 64x128": 1024,
    "down_dgrad_swiglu gpt-oss 128x128 cooperative": 1024,
    "block-scaled fp8 down_dgrad swiglu, clamp": 1224,
    # The FP8 weight gradient's descales of X, one per column (32 a thread), beside the
    # accumulator and the step's partial tile.
    "block-scaled fp8 wgrad float32 out": 120,
    "block-scaled fp8 wgrad bfloat16 out": 120,
    "gate_up_swiglu waiting 64x128": 64,
    "gate_up_swiglu waiting 128x128 cooperative": 64,
    "gate_up_swiglu waiting, claiming 64x128": 64,
    "gate_up_swiglu waiting, claiming 128x128 cooperative": 64,
    "gate_up_swiglu gather, claiming 128x128 cooperative": 16,
    # Triton 3.7 and 3.8 only: the cast to packed bytes alone, a use that "auto" leaves to the tl
    # twin.
    "gluon cast codes": 16,
}


@pytest.mark.skipif(not PTXAS.is_dir(), reason="Triton without its NVIDIA backend (ptxas)")
def test_every_gluon_kernel_compiles_for_hopper_within_its_resources(tmp_path):
    from mok.kernels import warp_specialized

    out = tmp_path / "gluon.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("TRITON_INTERPRET", None)
    script = ROOT / "scripts" / "gluon_compile_check.py"
    done = subprocess.run(
        [sys.executable, str(script), "--cases", GLUON_CASES, "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    rows = json.loads(out.read_text())
    labels = {row["label"] for row in rows}
    assert len(labels) >= 30 and all("error" not in row for row in rows)
    assert any("claiming" in label for label in labels)
    assert any("scatter" in label for label in labels)
    assert any(label.startswith("wgrad") for label in labels)
    assert any(label.startswith("gluon cast") for label in labels)
    for row in rows:
        if row["label"].startswith("gluon cast"):
            # No shared memory; 4 programs of 4 warps an SM need at most 128 registers a thread.
            assert row["shared"] == 0 and row["registers"] <= 128, row
        else:
            assert 0 < row["shared"] <= 232448, row
        assert row["registers"] <= warp_specialized.MAX_REGISTERS, row
        assert row["spill_bytes"] <= KNOWN_SPILL_BYTES.get(row["label"], 0), row


_PTX = """//
.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u32 k_param_1
)
{
\t.reg .b32 \t%r<9>;
\tld.param.u64 \t%rd1, [k_param_0];
\tmov.b64 \t%rd2, k_param_0;
\tadd.s32 \t%r3, %r1, %r2;
\tst.global.u32 \t[%rd1], %r3;
\tret;
}
"""


def test_the_instructions_digest_sees_instructions_not_arguments():
    """What the refactorings of a kernel's arguments are checked by: a kernel that takes one
    argument more, with its registers numbered otherwise, keeps its instructions digest (not
    its code digest); one instruction changed changes it. Bugs this catches: a digest that
    still hashes the parameter list (every argument change would look like new code) or one that
    drops instructions (a real change would look like none)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gluon_compile_check as check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    moved = (
        _PTX.replace("k_param_1\n", "k_param_1,\n\t.param .u32 k_param_2\n")
        .replace("k_param_0", "k_param_1")
        .replace("%r3", "%r7")
        .replace("%rd1", "%rd4")
    )
    changed = _PTX.replace("add.s32", "sub.s32")
    assert check.instructions_digest(moved) == check.instructions_digest(_PTX)
    assert check.code_digest(moved) != check.code_digest(_PTX)
    assert check.instructions_digest(changed) != check.instructions_digest(_PTX)
