"""Bandwidth of the MXFP8 cast kernels by tile shape, on deepseek-v3's shapes at EP 1 (one GPU):
the weights' two-layout cast ([256 experts x 2048, 7168] bf16 -> two bf16 value tensors), the
row cast of grouped rows ([65536, 7168] -> values and bytes) and the per-group token cast
([65536, 7168], 256 groups). Reads + writes per CUDA-event time, median of 5.

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


def main() -> None:
    device = torch.device("cuda")
    w = torch.randn(64 * 2048, 7168, device=device).bfloat16()  # a quarter of the experts
    rows, cols = w.shape
    along_k, along_n = torch.empty_like(w), torch.empty_like(w)
    print("| kernel | tile | warps | GB/s |\n| --- | --- | --- | --- |")
    for block_rows, block_cols in ((32, 64), (32, 128), (32, 256), (64, 128)):
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
            print(f"| both layouts | {block_rows} x {block_cols} | {warps} | {gbs:.0f} |")
    x = torch.randn(65536, 7168, device=device).bfloat16()
    values = torch.empty_like(x)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=device)
    scales = torch.empty(65536, 7168 // 32, dtype=torch.uint8, device=device)
    for block_rows, block_cols in ((16, 128), (32, 256), (64, 128), (16, 512)):
        for warps in (4, 8):

            def row_cast(br=block_rows, bc=block_cols, nw=warps):
                mx._mx_quantize_kernel[(triton.cdiv(65536, br), triton.cdiv(7168, bc))](
                    x.view(torch.int16),
                    codes,
                    scales,
                    values.view(torch.int16),
                    65536,
                    7168,
                    7168,
                    1,
                    7168,
                    1,
                    RCEIL=True,
                    BF16_BITS=True,
                    STORE_CODES=True,
                    STORE_VALUES=True,
                    VALUES_BF16_BITS=True,
                    BLOCK_ROWS=br,
                    BLOCK_COLS=bc,
                    num_warps=nw,
                )

            gbs = 5.03 * x.numel() / _ms(row_cast) / 1e6
            print(
                f"| row cast (values + bytes) | {block_rows} x {block_cols} | {warps} | {gbs:.0f} |"
            )
    offsets = torch.linspace(0, 65536, 257, device=device).to(torch.int32)
    tiles = row_tile_map(offsets, 65536, mx.GROUP_ROWS)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for block_cols in (32, 64, 128):
        for warps in (4, 8):
            for per_sm in (4, 8):
                programs = sms * per_sm

                def tokens(bc=block_cols, nw=warps, p=programs):
                    mx._mx_group_rows_kernel[(p,)](
                        x.view(torch.int16),
                        x,
                        values.view(torch.int16),
                        tiles.table,
                        tiles.counts,
                        tiles.capacity,
                        7168,
                        RCEIL=True,
                        BF16_BITS=True,
                        MX_IN=False,
                        OUT_BF16_BITS=True,
                        BLOCK_ROWS=mx.GROUP_ROWS,
                        BLOCK_COLS=bc,
                        NUM_PROGRAMS=p,
                        num_warps=nw,
                    )

                gbs = 4 * x.numel() / _ms(tokens) / 1e6
                label = f"{mx.GROUP_ROWS} x {block_cols}, {per_sm}/SM"
                print(f"| token cast per group | {label} | {warps} | {gbs:.0f} |")


if __name__ == "__main__":
    main()
