"""Bandwidth of the MXFP8 cast kernels by tile shape, on deepseek-v3's shapes at EP 1 (one GPU):
the weights' two-layout cast ([64 experts x 2048, 7168] bf16 -> two bf16 value tensors), the
row cast of x before its dispatch ([8192, 7168] -> packed MX rows), and the casts of the grouped
rows (`mx_group_casts`, 65536 rows in 256 groups) in each of the layer's uses: its tl kernel at
its tiles, then its Gluon kernel at each register layout of a sweep, each checked bit for bit
against the tl kernel first. Reads + writes per CUDA-event time, median of 5, random data.

    python benchmarks/mx_casts.py
"""

from __future__ import annotations

import statistics

import torch
import triton

from mok.kernels import mx
from mok.kernels.grouped_gemm import row_tile_map


def _ms(fn, iters=5) -> float:
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def weight_casts(device) -> None:
    w = torch.randn(64 * 2048, 7168, device=device).bfloat16()  # a quarter of the experts
    rows, cols = w.shape
    along_k, along_n = torch.empty_like(w), torch.empty_like(w)
    for block_rows, block_cols in ((32, 64), (32, 128), (32, 256)):
        for warps in (4, 8):

            def both(br=block_rows, bc=block_cols, nw=warps):
                mx._mx_quantize_both_kernel[(rows // br, triton.cdiv(cols, bc))](
                    w.view(torch.int16),
                    along_k.view(torch.int16),
                    w,
                    along_n.view(torch.int16),
                    w,
                    rows,
                    cols,
                    RCEIL=True,
                    BF16_BITS=True,
                    VALUES=True,
                    VALUES_BF16_BITS=True,
                    BLOCK_ROWS=br,
                    BLOCK_COLS=bc,
                    num_warps=nw,
                )

            gbs = 6 * w.numel() / _ms(both) / 1e6
            tile = f"{block_rows} x {block_cols}"
            print(f"| both layouts of a weight | {tile} | {warps} | {gbs:.0f} |")


def gluon_layouts(vectors) -> list[tuple[int, int, int]]:
    """(vector, row lanes, blocks per thread) of `mx.group_cast_layout` for each vector width:
    every power-of-two row-lane count that fits a warp beside a block's 32 // vector column
    lanes, one or two blocks a thread, at most 64 values a thread."""
    layouts = []
    for vector in vectors:
        row_lanes = 1
        while row_lanes * (32 // vector) <= 32:
            for per_thread in (1, 2):
                if 32 // row_lanes * per_thread * vector <= 64:
                    layouts.append((vector, row_lanes, per_thread))
            row_lanes *= 2
    return layouts


GLUON_LAYOUTS = {"from values": gluon_layouts((2, 4, 8)), "from bytes": gluon_layouts((4, 8, 16))}


def group_casts(device) -> None:
    """Every use of `mx_group_casts` in the MX layer: the tl twin at its tiles, then the Gluon
    kernel at each layout of a sweep (4 warps, 4 programs an SM), checked bit for bit against
    the twin first."""
    m, groups = 65536, 256
    offsets = torch.linspace(0, m, groups + 1, device=device).to(torch.int32)
    tiles = row_tile_map(offsets, m, mx.GROUP_ROWS)
    packed_bytes = lambda cols: mx.MXRows.row_bytes(cols) / cols  # noqa: E731
    default = dict(mx.GLUON_GROUP_CAST_TILES)
    for name, cols, packed, asks, write_bytes in (
        ("grad out: along H + tokens", 7168, False, {"values": True, "token_values": True}, 4),
        ("SwiGLU grads: along I + tokens", 4096, False, {"values": True, "token_values": True}, 4),
        ("h: values + bytes", 2048, False, {"values": True, "codes": True}, 2 + packed_bytes(2048)),
        ("pre-activations: bytes", 4096, False, {"codes": True}, packed_bytes(4096)),
        ("x: values from bytes", 7168, True, {"values": True}, 2),
        ("x: tokens from bytes", 7168, True, {"token_values": True}, 2),
    ):
        values = torch.randn(m, cols, device=device).bfloat16()
        a = mx.mx_quantize_rows(values) if packed else values
        read_bytes = packed_bytes(cols) if packed else 2
        moved = (read_bytes + write_bytes) * m * cols
        dtype = torch.bfloat16 if packed else None
        reads = "from bytes" if packed else "from values"
        tl_tiles = "from bytes, tokens" if packed and "token_values" in asks else reads

        def cast(kernel, a=a, asks=asks, d=dtype):
            return mx.mx_group_casts(a, tiles, **asks, dtype=d, kernel=kernel)

        twin = cast("tl")
        ms = _ms(lambda: cast("tl"))
        print(f"| {name} | tl | {mx.GROUP_CAST_TILES[tl_tiles]} | {moved / ms / 1e6:.0f} |")
        for vector, row_lanes, per_thread in GLUON_LAYOUTS[reads]:
            tile = {
                "vector": vector,
                "row_lanes": row_lanes,
                "blocks_per_thread": per_thread,
                "num_warps": 4,
            }
            mx.GLUON_GROUP_CAST_TILES = {**default, reads: tile}
            ours = cast("gluon")
            for field in ("values", "token_values"):
                if getattr(twin, field) is not None:
                    same = torch.equal(getattr(ours, field), getattr(twin, field))
                    assert same, f"{name}: {field} differ from the twin's at {tile}"
            if twin.codes is not None:
                assert torch.equal(
                    ours.codes.packed[:, : cols + cols // 32],
                    twin.codes.packed[:, : cols + cols // 32],
                )
            ms = _ms(lambda: cast("gluon"))
            layout = f"vector {vector}, {row_lanes} row lanes, {per_thread} block(s) a thread"
            print(f"| {name} | gluon | {layout} | {moved / ms / 1e6:.0f} |", flush=True)
        mx.GLUON_GROUP_CAST_TILES = default


def main() -> None:
    device = torch.device("cuda")
    print("| kernel | tile | warps | GB/s |\n| --- | --- | --- | --- |")
    weight_casts(device)
    x = torch.randn(8192, 7168, device=device).bfloat16()
    ms = _ms(lambda: mx.mx_quantize_rows(x))
    moved = (2 + mx.MXRows.row_bytes(7168) / 7168) * x.numel()
    print(f"| x before the dispatch (packed rows) | 16 x 512 | 4 | {moved / ms / 1e6:.0f} |")
    print("\n| grouped rows' cast | kernel | tile | GB/s |\n| --- | --- | --- | --- |")
    group_casts(device)


if __name__ == "__main__":
    main()
