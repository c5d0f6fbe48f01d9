#!/usr/bin/env bash
# Hardware counters (Nsight Compute) of the Gluon expert GEMMs at one preset's shape, one GPU.
#   scripts/ncu_expert_gemms.sh PRESET PRODUCT LAUNCHES [OUT_DIR]
# Profiles the first LAUNCHES Gluon launches of `benchmarks/expert_kernels.py --products
# PRODUCT` (its correctness pass runs the Gluon tilings in the order of its tables: e.g. gate_up's
# ping-pong, then cooperative), then lets the benchmark finish unprofiled. Clocks are left alone.
set -uo pipefail
cd "$(dirname "$0")/.."
preset=$1 product=$2 launches=$3 out=${4:-${OUT:-gpu-logs}}
mkdir -p "$out"
# The tensor pipe's wgmma activity, where this ncu knows the metric under that name.
gmma=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '$1 ~ /^sm__pipe_tensor_op_gmma_cycles_active$/ {print $1}')
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
ncu --clock-control none -k 'regex:_row_tiles_kernel|_weight_gradient_kernel' --launch-count "$launches" \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section LaunchStats \
  ${gmma:+--metrics "$gmma.avg.pct_of_peak_sustained_active"} \
  python3 benchmarks/expert_kernels.py --presets "$preset" --products "$product" --tokens 8192 \
  > "$out/ncu-$preset-$product.txt" 2>&1
echo "ncu $preset $product: exit $? ($(grep -c '_kernel' "$out/ncu-$preset-$product.txt") kernel lines)"
