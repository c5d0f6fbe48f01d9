"""Compile the warp-specialized Gluon kernels for sm_90a on a machine without a GPU, and report
each one's registers, spills and shared memory (ptxas -v), before any GPU time is spent; the JSON
also holds digests of each kernel's PTX code (`code_digest`; `instructions_digest`, blind to the
parameter list), so that a refactoring can show it compiles to the same instructions.

Gluon does not run under TRITON_INTERPRET, but it compiles without a driver: a stand-in driver
gives the JIT a Hopper target, every launch becomes a compile-only `warmup`, and the PTX of each
kernel goes through the ptxas that Triton carries. It runs with the installed Triton (CI's, and
`tests/kernels/test_gluon_compile.py` there); for the one the GPU machine runs (3.6):

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:src python scripts/gluon_compile_check.py [--cases REGEX] [--json PATH]

Exit status 1 if a kernel fails to compile or needs more shared memory than Hopper has; spills
are reported (a few bytes in an epilogue can be acceptable; a main loop's are not).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import pathlib
import re
import subprocess
import sys
import tempfile
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

HOPPER_SHARED_BYTES = 232448
"""Shared memory a block of an H100/H200 may take (227 KiB)."""
H200_SMS = 132


class _HopperStandIn:
    """The parts of Triton's CUDA driver that compiling needs, answering as one H200 would."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def compile_only(compiled: list):
    """Within: kernel launches compile and record (name, CompiledKernel) instead of running, with
    the persistent grid of an H200 (one program per SM)."""
    from mok.kernels import grouped_gemm as gg
    from mok.kernels import mx, warp_specialized

    def warmup(self, grid):
        def run(*args, **kwargs):
            kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
            compiled.append((self.fn.__name__, kwargs, kernel))

        return run

    previous = driver._active
    driver.set_active(_HopperStandIn())
    try:
        with (
            mock.patch.object(JITFunction, "__getitem__", warmup),
            mock.patch.object(
                warp_specialized, "num_programs", lambda device, tasks, cfg: H200_SMS
            ),
            mock.patch.object(gg, "num_programs", lambda device, tasks, cfg: H200_SMS),
            mock.patch.object(mx, "num_programs", lambda device, tasks, cfg: H200_SMS),
            mock.patch.object(
                mx, "_group_cast_kernel_is_gluon", lambda kernel, device, token_values: True
            ),
            mock.patch.object(gg, "use_scratch_allocator", lambda device: None),
            mock.patch.object(warp_specialized, "available", lambda device: True),
        ):
            yield
    finally:
        driver._active = previous


def hopper_ptxas() -> str:
    """The ptxas Triton itself runs for sm_90 (its bundled `ptxas` up to 3.8, the newer
    `ptxas-blackwell` from 3.9 on, whose PTX the older one refuses)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def ptxas_report(ptx: str) -> dict[str, int]:
    """registers, spill bytes and shared memory of the PTX's kernel, from Triton's ptxas."""
    ptxas = hopper_ptxas()
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run(
            [str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(src.with_suffix(".o"))],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill", out))
    registers = max(int(n) for n in re.findall(r"Used (\d+) registers", out))
    return {"registers": registers, "spill_bytes": spills}


def code_digest(ptx: str) -> str:
    """A digest of the PTX's code alone: source lines and debug sections left out, so that a
    refactoring that moves code around but compiles to the same instructions keeps it."""
    code = ptx.split("\t.section\t.debug", 1)[0]
    kept = [
        line
        for line in code.splitlines()
        if line.strip()
        and not line.lstrip().startswith((".loc", ".file", "//"))
        and not re.fullmatch(r"\$L__tmp\d+:", line.strip())  # labels for the line table
    ]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def instructions_digest(ptx: str) -> str:
    """A digest of the PTX's instructions alone: `code_digest`'s lines without the parameter
    list, the loads of parameters and the register declarations, with registers and parameters
    unnumbered, so that a change of a kernel's arguments that compiles to the same instructions
    keeps it (the order of the parameter loads and of their address moves is part of it)."""
    code = ptx.split("\t.section\t.debug", 1)[0]
    kept = []
    for line in code.splitlines():
        text = line.strip()
        if (
            not text
            or text.startswith((".loc", ".file", "//", ".param", ".reg"))
            or re.fullmatch(r"\$L__tmp\d+:", text)
            or "ld.param" in text
        ):
            continue
        kept.append(re.sub(r"_param_\d+", "_param", re.sub(r"%[a-z]+\d+", "%r", text)))
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


class _StandInClaims:
    """`TileClaims` for compiling: a zero counter, and an extension of 16 more programs."""

    def counter(self) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.int32)

    def extend(self, relaunch) -> None:
        relaunch(16)


def cases():
    """(label, callable) for each row-tiled kernel mode and tiling used or benchmarked."""
    from mok.kernels import warp_specialized
    from mok.kernels.host import SWIGLU, Activation, GemmTiles, RowScatter, RowsReady, RowTiles

    def tiles(cfg):
        capacity = triton.cdiv(m, cfg.block_m) + experts + 2
        table = torch.zeros(3, capacity, dtype=torch.int32)
        counts = torch.zeros(2, dtype=torch.int32)
        return RowTiles(table=table, counts=counts, capacity=capacity, block_m=cfg.block_m)

    bf16 = torch.bfloat16
    m, experts, hidden, inter = 1024, 4, 512, 256
    x = torch.zeros(m, hidden, dtype=bf16)
    w_gate = torch.zeros(experts, inter, hidden, dtype=bf16)
    w_down = torch.zeros(experts, hidden, inter, dtype=bf16)
    gate_up = torch.zeros(m, 2 * inter, dtype=bf16)
    grad, other_grad = gate_up[:, :inter], gate_up[:, inter:]
    single = {
        "64x256": warp_specialized.PING_PONG,
        "64x128": GemmTiles(64, 128, 64, 4, 6),
        "128x256 cooperative": warp_specialized.COOPERATIVE,
    }
    source_rows = torch.zeros(m, dtype=torch.int32)
    int64 = torch.zeros(2, dtype=torch.int64)
    scatter = RowScatter(
        out=x,
        out_offsets=int64,
        dest_rank=source_rows,
        dest_row=source_rows,
        counts=torch.zeros(2, dtype=torch.int32),
        counts_offsets=int64,
        rank=0,
    )
    for label, cfg in single.items():
        down = warp_specialized._RowsProblem(warp_specialized.DOWN.value, grad, w_down, x)
        gathered = warp_specialized._RowsProblem(
            warp_specialized.DOWN.value, grad, w_down, x, source_rows=source_rows
        )
        scattered = warp_specialized._RowsProblem(
            warp_specialized.DOWN.value, grad, w_down, x, source_rows=source_rows, scatter=scatter
        )
        yield (
            f"down gather {label}",
            lambda p=gathered, c=cfg: warp_specialized._launch(p, tiles(c), c),
        )
        # K not a multiple of BLOCK_K (nor of 16 elements): the gather's column mask.
        ragged = warp_specialized._RowsProblem(
            warp_specialized.DOWN.value,
            grad[:, :136],
            w_down[:, :, :136].contiguous(),
            x,
            source_rows=source_rows,
        )
        yield (
            f"down gather K=136 {label}",
            lambda p=ragged, c=cfg: warp_specialized._launch(p, tiles(c), c),
        )
        yield (
            f"down gather+scatter {label}",
            lambda p=scattered, c=cfg: warp_specialized._launch(p, tiles(c), c),
        )
        dgrad = warp_specialized._RowsProblem(
            warp_specialized.GATE_UP_DGRAD.value, grad, w_gate, x, other_grad, w_gate
        )
        yield f"down {label}", lambda p=down, c=cfg: warp_specialized._launch(p, tiles(c), c)
        yield (
            f"gate_up_dgrad {label}",
            lambda p=dgrad, c=cfg: warp_specialized._launch(p, tiles(c), c),
        )
    swiglu = {
        "64x128": warp_specialized.SWIGLU_PING_PONG,
        "128x128 cooperative": warp_specialized.SWIGLU_COOPERATIVE,
    }
    dgrad_swiglu = {
        "64x128": warp_specialized.DGRAD_SWIGLU_PING_PONG,
        "128x128 cooperative": warp_specialized.DGRAD_SWIGLU_COOPERATIVE,
    }

    def swiglu_problem(limit=None, source=None, ready=None):
        return warp_specialized._RowsProblem(
            warp_specialized.GATE_UP_SWIGLU.value,
            x,
            w_gate,
            grad,
            w2=w_gate,
            gate_up=gate_up,
            swiglu_limit=limit,
            source_rows=source,
            ready=ready,
        )

    def dgrad_problem(limit=None, activation=SWIGLU, weighted=False, ready=None):
        weighting = (torch.zeros(m, inter, dtype=bf16), torch.zeros(m)) if weighted else None
        return warp_specialized._RowsProblem(
            warp_specialized.DOWN_DGRAD_SWIGLU.value,
            x,
            w_down,
            torch.zeros_like(gate_up),
            gate_up=gate_up,
            swiglu_limit=limit,
            activation=activation,
            weighting=weighting,
            ready=ready,
        )

    flags = torch.zeros(m // 32, dtype=torch.int32)
    ready = RowsReady(flags, 32, flags[:1], torch.zeros(4, dtype=torch.int64), 1.0, 0)
    for label, cfg in swiglu.items():
        problem = swiglu_problem(source=source_rows)
        yield (
            f"gate_up_swiglu gather {label}",
            lambda p=problem, c=cfg: warp_specialized._launch(p, tiles(c), c),
        )
        problem = swiglu_problem(ready=ready)
        yield (
            f"gate_up_swiglu waiting {label}",
            lambda p=problem, c=cfg: warp_specialized._launch(p, tiles(c), c),
        )
    claiming = _StandInClaims()
    for label, cfg in swiglu.items():
        claimed = dataclasses.replace(cfg, claims=claiming)
        problem = swiglu_problem(ready=ready)
        yield (
            f"gate_up_swiglu waiting, claiming {label}",
            lambda p=problem, c=claimed: warp_specialized._launch(p, tiles(c), c),
        )
        problem = swiglu_problem(source=source_rows)
        yield (
            f"gate_up_swiglu gather, claiming {label}",
            lambda p=problem, c=claimed: warp_specialized._launch(p, tiles(c), c),
        )
    for label, cfg in dgrad_swiglu.items():
        problem = dgrad_problem(weighted=True)
        yield (
            f"down_dgrad_swiglu weighted {label}",
            lambda p=problem, c=cfg: warp_specialized._launch(p, tiles(c), c),
        )
        # The fused backward's form: the rows land beside the product, its tasks claimed.
        problem = dgrad_problem(weighted=True, ready=ready)
        weighted_claimed = dataclasses.replace(cfg, claims=claiming)
        yield (
            f"down_dgrad_swiglu weighted waiting, claiming {label}",
            lambda p=problem, c=weighted_claimed: warp_specialized._launch(p, tiles(c), c),
        )
        problem = dgrad_problem()
        claimed = dataclasses.replace(cfg, claims=claiming)
        yield (
            f"down_dgrad_swiglu claiming {label}",
            lambda p=problem, c=claimed: warp_specialized._launch(p, tiles(c), c),
        )
    offsets = torch.zeros(experts + 1, dtype=torch.int32)
    for dtype, cfg in (
        (bf16, warp_specialized.WGRAD_TILES.half),
        (torch.float32, warp_specialized.WGRAD_TILES.single),
    ):
        grads = (torch.zeros(experts, inter, hidden, dtype=dtype),) * 2
        for claims in (None, claiming):
            c = dataclasses.replace(cfg, claims=claims)
            yield (
                f"wgrad gate_up {dtype} {cfg.block_m}x{cfg.block_n}"
                + (" claiming" if claims else ""),
                lambda c=c, g=grads: warp_specialized._launch_weight_gradients(
                    gate_up, x, offsets, g, (True, False), c
                ),
            )
            yield (
                f"wgrad gate_up {dtype} {cfg.block_m}x{cfg.block_n} gather"
                + (" claiming" if claims else ""),
                lambda c=c, g=grads: warp_specialized._launch_weight_gradients(
                    gate_up, x, offsets, g, (True, False), c, source_rows=source_rows
                ),
            )
    for limit in (None, 7.0):
        for label, cfg in swiglu.items():
            problem = swiglu_problem(limit)
            yield (
                f"gate_up_swiglu {label} limit={limit}",
                lambda p=problem, c=cfg: warp_specialized._launch(p, tiles(c), c),
            )
        for label, cfg in dgrad_swiglu.items():
            problem = dgrad_problem(limit)
            yield (
                f"down_dgrad_swiglu {label} limit={limit}",
                lambda p=problem, c=cfg: warp_specialized._launch(p, tiles(c), c),
            )
    # gpt-oss's experts: its activation, clamp and biases.
    gpt_oss = Activation(1.702, 1.0)
    bias_i = torch.zeros(experts, inter, dtype=bf16)
    bias_h = torch.zeros(experts, hidden, dtype=bf16)
    for label, cfg in swiglu.items():
        problem = dataclasses.replace(
            swiglu_problem(7.0, source=source_rows), activation=gpt_oss, bias=bias_i, bias2=bias_i
        )
        yield (
            f"gate_up_swiglu gpt-oss gather {label}",
            lambda p=problem, c=cfg: warp_specialized._launch(p, tiles(c), c),
        )
    for label, cfg in dgrad_swiglu.items():
        problem = dgrad_problem(7.0, gpt_oss)
        yield (
            f"down_dgrad_swiglu gpt-oss {label}",
            lambda p=problem, c=cfg: warp_specialized._launch(p, tiles(c), c),
        )
    for label, cfg in single.items():
        problem = warp_specialized._RowsProblem(
            warp_specialized.DOWN.value, grad, w_down, x, bias=bias_h
        )
        yield (
            f"down bias {label}",
            lambda p=problem, c=cfg: warp_specialized._launch(p, tiles(c), c),
        )
        problem = dataclasses.replace(problem, source_rows=source_rows, scatter=scatter)
        yield (
            f"down bias gather+scatter {label}",
            lambda p=problem, c=cfg: warp_specialized._launch(p, tiles(c), c),
        )
    # The 128-block FP8 product on the FP8 tensor cores (`_block_scaled_step`), bf16 and fp32
    # out, at deepseek-v3's down shape per expert (K = I = 2048, N = H = 7168).
    fp8 = torch.float8_e4m3fn
    a_values = torch.zeros(m, 2048, dtype=fp8)
    w_values = torch.zeros(experts, 7168, 2048, dtype=fp8)
    a_descales, w_descales = torch.zeros(m, 16), torch.zeros(experts, 56, 16)
    offsets = torch.zeros(experts + 1, dtype=torch.int32)
    fp8_cfg = warp_specialized.BLOCK_SCALED_TILES
    for out_dtype in (bf16, torch.float32):
        yield (
            f"block-scaled fp8 {str(out_dtype)[6:]} out",
            lambda d=out_dtype: warp_specialized.block_scaled_grouped_mm(
                a_values, a_descales, w_values, w_descales, offsets, tiles(fp8_cfg), d
            ),
        )
    down_bias = torch.zeros(experts, 7168, dtype=bf16)
    yield (
        "block-scaled fp8 bf16 out, bias",
        lambda: warp_specialized.block_scaled_grouped_mm(
            a_values, a_descales, w_values, w_descales, offsets, tiles(fp8_cfg), bias=down_bias
        ),
    )
    # The down product's data gradient in the recipe with the activation's backward, at
    # deepseek-v3's shape per expert (K = H = 7168, N = I = 2048), gpt-oss's clamp.
    down_t = (torch.zeros(experts, 2048, 7168, dtype=fp8), torch.zeros(experts, 16, 56))
    grad_out = torch.zeros(m, 7168, dtype=fp8)
    saved_gate_up = torch.zeros(m, 4096, dtype=bf16)
    yield (
        "block-scaled fp8 down_dgrad swiglu, clamp",
        lambda: warp_specialized.block_scaled_down_dgrad_swiglu(
            grad_out, torch.zeros(m, 56), down_t, offsets, tiles(fp8_cfg), saved_gate_up, 7.0,
            Activation(1.702, 1.0),
        ),
    )  # fmt: skip
    # The recipe's weight gradient at deepseek-v3's down shape per expert (N = H = 7168, K = I =
    # 2048), fp32 and bf16 out, its operands cast along the tokens, tokens contiguous.
    token_tiles = m // 128 + experts
    g_tokens = (torch.zeros(7168, token_tiles * 128, dtype=fp8), torch.zeros(token_tiles, 7168))
    x_tokens = (torch.zeros(2048, token_tiles * 128, dtype=fp8), torch.zeros(token_tiles, 2048))
    starts = torch.zeros(experts, dtype=torch.int32)
    for out_dtype in (torch.float32, bf16):
        yield (
            f"block-scaled fp8 wgrad {str(out_dtype)[6:]} out",
            lambda d=out_dtype: warp_specialized.block_scaled_grouped_wgrad(
                g_tokens, x_tokens, offsets, starts, d
            ),
        )
    # The gate/up product in the recipe (two weights a pass) at qwen3-30b-a3b's shape per
    # expert (H 2048, I 768), saving the pre-activations, with gpt-oss's clamp and biases.
    gate_cast = (torch.zeros(experts, 768, 2048, dtype=fp8), torch.zeros(experts, 6, 16))
    swiglu_cfg = warp_specialized.BLOCK_SCALED_SWIGLU_TILES
    gate_biases = (torch.zeros(experts, 768, dtype=bf16),) * 2
    yield (
        "block-scaled fp8 gate_up swiglu, saved, clamp, biases",
        lambda: warp_specialized.block_scaled_gate_up_swiglu(
            a_values[:, :2048].contiguous(), a_descales, gate_cast, gate_cast, offsets,
            tiles(swiglu_cfg), 7.0, True, activation=Activation(1.702, 1.0), biases=gate_biases,
        ),
    )  # fmt: skip


def cast_cases():
    """(label, callable) for the Gluon MXFP8 casts of grouped rows, in each use the MXFP8 layer
    makes of them (the `uses` below) and with fp32 values and FLOOR scales."""
    from mok.kernels import mx
    from mok.kernels.host import RowTiles

    m, cols = 1024, 768
    capacity = m // mx.GROUP_ROWS + 6
    table = torch.zeros(3, capacity, dtype=torch.int32)
    tiles = RowTiles(table, torch.zeros(2, dtype=torch.int32), capacity, mx.GROUP_ROWS)
    values = torch.zeros(m, cols, dtype=torch.bfloat16)
    packed = mx.MXRows.empty(m, cols, torch.device("cpu"))
    bf16 = torch.bfloat16
    uses = {
        "values + tokens": (values, {"values": True, "token_values": True}),
        "values + codes": (values, {"values": True, "codes": True}),
        "codes": (values, {"codes": True}),
        "fp32 values + tokens, FLOOR": (values.float(), {"values": True, "token_values": True}),
        "values from bytes": (packed, {"values": True, "dtype": bf16}),
        "tokens from bytes": (packed, {"token_values": True, "dtype": bf16}),
    }
    for label, (a, asks) in uses.items():
        rounding = "floor" if "FLOOR" in label else "rceil"
        yield (
            f"gluon cast {label}",
            lambda a=a, k=asks, r=rounding: mx.mx_group_casts(a, tiles, r, **k),
        )


def tl_cases():
    """(label, callable) for tl kernels that run on Hopper: gpt-oss's products where its weights
    are not rows the Gluon kernels read, the bias gradients, the claiming twins, and the
    combine's backward on the token side."""
    from mok.kernels import grouped_gemm as gg
    from mok.kernels.host import Activation, GemmTiles, RowsReady, RowTiles
    from mok.kernels.rows import pair_gradients

    m, experts, hidden, inter = 1024, 4, 512, 256
    bf16 = torch.bfloat16
    x, h = torch.zeros(m, hidden, dtype=bf16), torch.zeros(m, inter, dtype=bf16)
    w_gate = torch.zeros(experts, inter, hidden, dtype=bf16)
    w_down = torch.zeros(experts, hidden, inter, dtype=bf16)
    gate_up = torch.zeros(m, 2 * inter, dtype=bf16)
    bias_i, bias_h = (
        torch.zeros(experts, inter, dtype=bf16),
        torch.zeros(experts, hidden, dtype=bf16),
    )
    gpt_oss = Activation(1.702, 1.0)

    def tiles(cfg):
        capacity = triton.cdiv(m, cfg.block_m) + experts + 2
        table = torch.zeros(3, capacity, dtype=torch.int32)
        counts = torch.zeros(2, dtype=torch.int32)
        return RowTiles(table=table, counts=counts, capacity=capacity, block_m=cfg.block_m)

    # The tl tiles of `expert_mlp.default_config` for groups of >= 192 rows.
    up_cfg, down_cfg = GemmTiles(128, 128, 64, 8, 3), GemmTiles(128, 256, 64, 8, 3)
    dgrad_cfg = GemmTiles(128, 128, 64, num_warps=8, num_stages=4)
    offsets = torch.zeros(experts + 1, dtype=torch.int32)
    yield "tl gate_up gpt-oss", lambda: gg.gate_up_swiglu(
        x, w_gate, w_gate, tiles(up_cfg), 7.0, True, up_cfg, activation=gpt_oss,
        biases=(bias_i, bias_i),
    )  # fmt: skip
    yield "tl down bias", lambda: gg.down(h, w_down, tiles(down_cfg), down_cfg, bias=bias_h)
    claimed_up = dataclasses.replace(up_cfg, claims=_StandInClaims())
    yield "tl gate_up claiming", lambda: gg.gate_up_swiglu(
        x, w_gate, w_gate, tiles(claimed_up), 7.0, True, claimed_up
    )  # fmt: skip
    claimed_dgrad = dataclasses.replace(dgrad_cfg, claims=_StandInClaims())
    yield (
        "tl down_dgrad claiming",
        lambda: gg.down_dgrad_swiglu(x, w_down, gate_up, tiles(claimed_dgrad), 7.0, claimed_dgrad),
    )
    flags = torch.zeros(m // 32, dtype=torch.int32)
    ready = RowsReady(flags, 32, flags[:1], torch.zeros(4, dtype=torch.int64), 1.0, 0)
    yield (
        "tl down_dgrad weighted waiting, claiming",
        lambda: gg.down_dgrad_swiglu_weighted(
            x, w_down, gate_up, h, torch.zeros(m), tiles(claimed_dgrad), 7.0, claimed_dgrad,
            ready=ready,
        ),
    )  # fmt: skip
    yield (
        "tl down_dgrad gpt-oss",
        lambda: gg.down_dgrad_swiglu(
            x, w_down, gate_up, tiles(dgrad_cfg), 7.0, dgrad_cfg, activation=gpt_oss
        ),
    )
    yield (
        "tl group_column_sums",
        lambda: gg.group_column_sums(
            gate_up[:, inter:], offsets, torch.zeros(experts, inter, dtype=bf16), True
        ),
    )
    yield (
        "tl group_column_sums row-weighted",
        lambda: gg.group_column_sums(
            x, offsets, torch.zeros(experts, hidden), True, row_weights=torch.zeros(m)
        ),
    )
    dots_tiles = tiles(GemmTiles(gg.ROW_DOTS_BLOCK_M, 128, 64))
    yield (
        "tl group_row_dots",
        lambda: gg.group_row_dots(x, dots_tiles, bias_h, torch.zeros(m)),
    )
    # The tl weight gradients (where the Gluon one does not take the gradients), fp32 buffers
    # added into, and the gate/up one reading its rows through an index.
    wgrad_cfg = GemmTiles(128, 256, 32, num_warps=8, num_stages=4)
    grad_w_down = torch.zeros(experts, hidden, inter)
    grad_w_gate = torch.zeros(experts, inter, hidden)
    yield (
        "tl down_wgrad fp32 accumulate",
        lambda: gg.down_wgrad(x, h, offsets, grad_w_down, True, wgrad_cfg),
    )
    yield (
        "tl gate_up_wgrad gathered",
        lambda: gg.gate_up_wgrad(
            gate_up, x, offsets, grad_w_gate, grad_w_gate.clone(), False, True, wgrad_cfg,
            source_rows=torch.zeros(m, dtype=torch.int32),
        ),
    )  # fmt: skip
    yield from _row_copy_cases()
    # The 128-block FP8 recipe's grouped product (the tl twin), at deepseek-v3's down shape.
    yield "tl fp8_block grouped_mm", lambda: _fp8_block_product(m, experts, offsets)
    yield "tl fp8_block cast", lambda: _fp8_block_cast(x)
    yield "tl fp8_block weights cast", lambda: _fp8_block_weights_cast(experts)
    yield "tl fp8_block cast along the tokens", lambda: _fp8_block_tokens_cast(x, offsets)
    yield "tl fp8_block weight gradient", lambda: _fp8_block_wgrad(m, experts, offsets)
    # The combine's backward on the token side, at a real model's top_k and H (all pairs'
    # loads of a column chunk in flight at once: registers and spills to watch).
    tokens, top_k, wide = 64, 8, 4096
    yield (
        "tl pair_gradients k=8 H=4096",
        lambda: pair_gradients(
            torch.zeros(tokens, wide, dtype=bf16),
            torch.zeros(tokens, top_k),
            torch.zeros(tokens, top_k, wide, dtype=bf16),
            torch.zeros(tokens * top_k, wide, dtype=bf16),
            H200_SMS,
            dst_row=torch.zeros(tokens, top_k, dtype=torch.int64),
        ),
    )


def _fp8_block_product(m: int, experts: int, offsets: torch.Tensor) -> None:
    from mok.kernels.fp8_block import block_scaled_grouped_mm

    e4m3 = torch.float8_e4m3fn
    a_values, w_values = (
        torch.zeros(m, 2048, dtype=e4m3),
        torch.zeros(experts, 7168, 2048, dtype=e4m3),
    )
    block_scaled_grouped_mm(
        a_values, torch.zeros(m, 16), w_values, torch.zeros(experts, 56, 16), offsets
    )


def _fp8_block_cast(x: torch.Tensor) -> None:
    from mok.kernels.fp8_block import block_quantize_tiles

    block_quantize_tiles(x)


def _fp8_block_weights_cast(experts: int) -> None:
    from mok.kernels.fp8_block import block_quantize_weights

    block_quantize_weights(torch.zeros(experts, 2048, 7168, dtype=torch.bfloat16))


def _fp8_block_tokens_cast(x: torch.Tensor, offsets: torch.Tensor) -> None:
    from mok.kernels.fp8_block import block_quantize_tokens
    from mok.kernels.grouped_gemm import row_tile_map

    block_quantize_tokens(x, row_tile_map(offsets, x.shape[0], 128))


def _fp8_block_wgrad(m: int, experts: int, offsets: torch.Tensor) -> None:
    from mok.kernels.fp8_block import block_scaled_grouped_wgrad

    e4m3, tiles = torch.float8_e4m3fn, m // 128 + experts + 2
    grad, x = torch.zeros(m, 2048, dtype=e4m3), torch.zeros(m, 7168, dtype=e4m3)
    block_scaled_grouped_wgrad(grad, torch.zeros(tiles, 2048), x, torch.zeros(tiles, 7168), offsets)


def _row_copy_cases():
    """(label, callable) for the exchange's row kernels in each of their forms: copies local or
    between peers, waiting on flags, flagging the tiles landed; sums plain, with every optional
    part, and with each term's rank by column into MX rows."""
    from mok.kernels import rows
    from mok.kernels.mx import MXRows

    tokens, hidden, ep, bf16 = 256, 1024, 4, torch.bfloat16
    src, dst = torch.zeros(tokens, hidden, dtype=bf16), torch.zeros(tokens, hidden, dtype=bf16)

    def ints(*shape, dtype=torch.int64):
        return torch.zeros(*shape, dtype=dtype)

    count, at = ints(1, dtype=torch.int32), ints(tokens)
    peers = {"src_offsets": ints(ep), "src_rank": ints(tokens, dtype=torch.int32)}
    copies = {
        "plain": {},
        "peers": {
            **peers, "dst_row": at, "dst_offsets": ints(ep),
            "dst_rank": ints(tokens, dtype=torch.int32),
        },
        "waiting": {
            **peers, "flags": ints(64, dtype=torch.int32), "wait": at,
            "epoch": ints(1, dtype=torch.int32), "status": ints(4), "timeout_s": 1.0, "wait_id": 3,
        },
        "flagging": {"epoch": ints(1, dtype=torch.int32), "landed": ints(64, dtype=torch.int32)},
    }  # fmt: skip
    for label, options in copies.items():
        yield (
            f"tl rows copy {label}",
            lambda o=options: rows.copy_rows(dst, src, at, count, 16, 32, **o),
        )
    row = ints(tokens, 4)
    full = {
        "src_offsets": ints(ep), "rank": ints(tokens, 4, dtype=torch.int32),
        "weight": torch.zeros(tokens, 4), "init": torch.zeros_like(dst),
        "tail": torch.zeros_like(dst), "count": count,
        "gathered": torch.zeros(tokens, 4, hidden, dtype=bf16),
    }  # fmt: skip
    packed = torch.zeros(tokens * 4, MXRows.row_bytes(hidden), dtype=torch.uint8)
    column_mx = {
        "src_offsets": ints(ep), "rank_is_column": True, "gathered": MXRows(packed, hidden)
    }  # fmt: skip
    for label, options in {"plain": {}, "full": full, "column-rank MX": column_mx}.items():
        yield (
            f"tl rows reduce {label}",
            lambda o=options: rows.reduce_rows(dst, src, row, 16, 16, **o),
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", help="only the kernels whose label matches this regex")
    parser.add_argument("--json", help="also write one row per compiled kernel here")
    args = parser.parse_args(argv)
    failed = False
    rows = []
    print(f"triton {triton.__version__}, sm_90a, {hopper_ptxas()}")
    print("| kernel | registers | spill bytes | shared bytes |")
    print("| --- | --- | --- | --- |")
    for label, launch in [*cases(), *cast_cases(), *tl_cases()]:
        if args.cases and not re.search(args.cases, label):
            continue
        compiled = []
        try:
            with compile_only(compiled):
                launch()
        except Exception as error:  # noqa: BLE001 - report every kernel, then fail
            print(f"| {label} | compile failed: {type(error).__name__}: {str(error)[:3000]} | | |")
            rows.append({"label": label, "error": f"{type(error).__name__}: {error}"})
            failed = True
            continue
        for _, _, kernel in compiled:
            report = ptxas_report(kernel.asm["ptx"])
            shared = kernel.metadata.shared
            failed |= shared > HOPPER_SHARED_BYTES
            ptx = kernel.asm["ptx"]
            rows.append(
                {
                    "label": label,
                    **report,
                    "shared": shared,
                    "code": code_digest(ptx),
                    "instructions": instructions_digest(ptx),
                }
            )
            print(
                f"| {label} | {report['registers']} | {report['spill_bytes']} | {shared}"
                f"{' TOO MUCH' if shared > HOPPER_SHARED_BYTES else ''} |"
            )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
