#!/usr/bin/env bash
# What the GPU machine checks, in one call: the named steps of the table below, in order, each
# command's output appended to $OUT/gpu_check.log (default ./gpu-logs/) beside the JSON and
# markdown results it writes there. Usage:
#   [DRY_RUN=1] [MOK_COMMIT=<sha>] scripts/gpu_check.sh [STEP ...]    (default: tests speed)
#   scripts/gpu_check.sh --list                                      (the steps and commands)
# MOK_COMMIT: the commit results are stamped with, when the tree travels without its git history.
# PYTEST_ARGS: more pytest options (e.g. "-n 4"); HYPOTHESIS_PROFILE=dev: fewer fuzzed cases.
# FUZZ_ARGS: the fuzz campaign's options. DRY_RUN=1 prints each command, expanded, and runs none.
# tests-1 / tests-2: the suite in two halves by file, verbose (on an H100 the whole suite outlasts
# one 10-minute call). speed: the before/after comparison in one call, the expert products and
# `mok bench` at deepseek-v3 and qwen3-30b-a3b, 8192 tokens, EP 1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
PYTEST_ARGS=${PYTEST_ARGS:-}
FUZZ_ARGS=${FUZZ_ARGS:---cases 1300 --ep 1,2 --workers 4}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}
EPS=1; [ "$NGPU" -gt 1 ] && EPS="1,$NGPU"
PYTEST="python3 -m pytest -q -rs -p no:cacheprovider"
E2E="python3 benchmarks/train_e2e.py"
QWEN3_30B="--layers 4 --hidden 2048 --experts 128 --top-k 8 --moe-intermediate 768 --seq 1024"
BALANCED="$QWEN3_30B --batch 32 --accumulate 2 --routing balanced --steps 10 --warmup 3"

half() {  # half 1|2: the test files of that half of the suite
  local files; files=$(ls tests/kernels/test_*.py tests/test_*.py)
  local n=$(( $(echo "$files" | wc -l) / 2 ))
  if [ "$1" = 1 ]; then echo "$files" | head -n "$n"; else echo "$files" | tail -n +"$((n + 1))"; fi
}

titan() {  # COMMAND with TorchTitan importable: the GPU machine has no package index, so its
  # wheels travel in .wheels/ (made by `pip download torchtitan==0.3.0 tyro docstring_parser
  # spmd_types shtab typeguard --no-deps -d .wheels`), installed beside the machine's packages.
  if [ -d .wheels ] && ! python3 -c 'import torchtitan' 2>/dev/null; then
    python3 -m pip install -q --no-deps --target /tmp/mok-wheels .wheels/*.whl
  fi
  PYTHONPATH="$PYTHONPATH:/tmp/mok-wheels" "$@"
}

# Step -> its commands, one a line: a name for the log, then the command (expanded when it runs).
declare -A STEP
STEP[tests]="pytest $PYTEST \$PYTEST_ARGS"
STEP[tests-1]="pytest-1 python3 -m pytest -v -rfs -p no:cacheprovider \$PYTEST_ARGS \$(half 1)"
STEP[tests-2]="pytest-2 python3 -m pytest -v -rfs -p no:cacheprovider \$PYTEST_ARGS \$(half 2)"
STEP[speed]="
speed-kernels python3 benchmarks/expert_kernels.py --bench --products --presets deepseek-v3 qwen3-30b-a3b --tokens 8192 --out \$OUT/speed-kernels.md
speed-bench python3 -m mok bench --no-progress --preset deepseek-v3,qwen3-30b-a3b --tokens 8192 --ep 1 --iters 10 --warmup 3 --json \$OUT/speed-bench.json"
STEP[bench]="
bench-tiny python3 -m mok bench --no-progress --preset tiny --ep \$NGPU --json \$OUT/bench-tiny.json
bench-qwen3-30b python3 -m mok bench --no-progress --preset qwen3-30b-a3b --ep \$NGPU --tokens 4096 --iters 5 --warmup 2 --json \$OUT/bench-qwen3-30b.json"
STEP[kernels]="
kernels python3 benchmarks/expert_kernels.py --check --bench --products --out \$OUT/expert-kernels.md
kernels-zipf python3 benchmarks/expert_kernels.py --bench --routing zipf --presets qwen3-30b-a3b qwen3-235b-a22b --tokens 8192 --out \$OUT/expert-kernels-zipf.md"
STEP[exchange]="
exchange-tests $PYTEST tests/kernels/test_rows_kernels.py tests/kernels/test_placement_kernels.py tests/test_comm_placement.py tests/test_comm_symmetric.py
exchange-bench python3 benchmarks/exchange.py --out \$OUT/exchange.md"
STEP[triton]="
triton-tests $PYTEST tests/test_triton_backend.py tests/test_comm_symmetric.py tests/kernels/test_rows_kernels.py tests/kernels/test_placement_kernels.py
triton-bench python3 -m mok bench --no-progress --preset qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3 --ep \$EPS --iters 10 --warmup 3 --out \$OUT/bench"
STEP[fused]="
fused-tests $PYTEST tests/test_fused_backend.py tests/kernels/test_row_sources.py tests/test_triton_backend.py
fused-bench python3 -m mok bench --no-progress --preset deepseek-v3,qwen3-235b-a22b --ep \$NGPU --backend fused --iters 10 --json \$OUT/bench-fused.json
fused-bench-exact python3 -m mok bench --no-progress --preset deepseek-v3,qwen3-235b-a22b --ep \$NGPU --backend fused --exact-buffers --iters 10 --json \$OUT/bench-fused-exact.json
fused-profile python3 benchmarks/profile_layer.py --preset deepseek-v3 --backend fused --trace \$OUT/trace-fused"
STEP[mxfp8]="
mxfp8-tests $PYTEST \$PYTEST_ARGS tests/kernels/test_mx_kernels.py tests/kernels/test_mx_expert_mlp.py tests/test_triton_backend_mx.py tests/test_mx_expert.py
mxfp8-bench python3 -m mok bench --no-progress --preset deepseek-v3,qwen3-235b-a22b --ep \$NGPU --precision bf16,mxfp8 --iters 10 --warmup 3 --json \$OUT/bench-mxfp8.json"
STEP[options]="
options-tests $PYTEST tests/test_recompute.py tests/test_router_gradient.py
recompute-bench python3 -m mok bench --no-progress --preset qwen3-30b-a3b,deepseek-v3 --tokens 16384 --ep 1 --recompute gate_up --iters 10 --json \$OUT/bench-recompute.json
router-gradient-bench python3 -m mok bench --no-progress --preset qwen3-30b-a3b,deepseek-v3 --tokens 16384 --ep 1 --router-gradient epilogue --iters 10 --json \$OUT/bench-router-gradient.json"
STEP[fp8]="
fp8-tests $PYTEST \$PYTEST_ARGS tests/kernels/test_fp8_block_kernels.py tests/kernels/test_fp8_block_expert_mlp.py tests/test_triton_backend_fp8_block.py
fp8-products python3 benchmarks/expert_kernels.py --products fp8_block_down fp8_block_gate fp8_block_wgrad --presets deepseek-v3 qwen3-235b-a22b --tokens 8192 --out \$OUT/fp8-block-products.md
fp8-bench python3 -m mok bench --no-progress --preset deepseek-v3,qwen3-235b-a22b --tokens 8192 --ep 1 --precision bf16,fp8_block --mx-weight-casts keep --iters 10 --warmup 3 --json \$OUT/bench-fp8-block.json
fp8-profile python3 benchmarks/profile_layer.py --preset deepseek-v3 --precision fp8_block --rows 30"
STEP[accuracy]="accuracy python3 benchmarks/accuracy.py --out \$OUT/accuracy.md"
STEP[fuzz]="fuzz python3 benchmarks/fuzz.py \$FUZZ_ARGS --out \$OUT/fuzz.md"
STEP[memory]="
memory-ep2 python3 benchmarks/peak_memory.py --ep 2 --out \$OUT/peak-memory-ep2.md
memory-ep2-exact python3 benchmarks/peak_memory.py --ep 2 --exact-buffers --out \$OUT/peak-memory-ep2-exact.md
memory-ep1 python3 benchmarks/peak_memory.py --ep 1 --backends baseline,triton,triton-recompute,fused --out \$OUT/peak-memory-ep1.md
memory-mxfp8 python3 benchmarks/peak_memory.py --ep 1 --backends baseline,triton --precision mxfp8 --out \$OUT/peak-memory-mxfp8.md"
STEP[profile]="profile python3 benchmarks/profile_layer.py --preset deepseek-v3 --trace \$OUT/trace-triton"
STEP[e2e]="
e2e-small $E2E --steps 30 --warmup 5 --out \$OUT/e2e-small
e2e-qwen3-30b $E2E $QWEN3_30B --batch 8 --steps 30 --warmup 5 --out \$OUT/e2e-qwen3-30b"
STEP[e2e-compiled]="
e2e-qwen3-30b-compiled $E2E $QWEN3_30B --batch 8 --steps 20 --warmup 8 --compile inductor --out \$OUT/e2e-qwen3-30b-compiled
e2e-torchtitan titan $E2E --framework torchtitan --layers 4 --batch 8 --seq 1024 --steps 20 --warmup 5 --out \$OUT/e2e-torchtitan"
STEP[e2e-balanced]="
e2e-balanced $E2E $BALANCED --out \$OUT/e2e-balanced
e2e-balanced-compiled $E2E $BALANCED --compile inductor --profile 25 --trace \$OUT/traces-balanced --out \$OUT/e2e-balanced-compiled"
STEP[e2e-mxfp8]="e2e-mxfp8 $E2E $QWEN3_30B --batch 8 --routing balanced --steps 12 --warmup 4 --implementations grouped_mm,mok,mok-mxfp8,mok-mxfp8-keep --out \$OUT/e2e-mxfp8"
STEP[e2e-fp8]="e2e-fp8 $E2E $QWEN3_30B --batch 8 --routing balanced --steps 200 --warmup 4 --implementations mok,mok-fp8-block,mok-mxfp8 --out \$OUT/e2e-fp8"
STEP[e2e-ep]="
e2e-ep $E2E $BALANCED --ep \$NGPU --out \$OUT/e2e-ep
e2e-ep-compiled $E2E $BALANCED --ep \$NGPU --compile inductor --out \$OUT/e2e-ep-compiled"
STEP[repeat]="e2e-repeat $E2E $QWEN3_30B --layers 2 --batch 8 --routing balanced --steps 8 --warmup 2 --implementations mok,mok,mok-mxfp8,mok-mxfp8 --deterministic --out \$OUT/e2e-repeat"
ORDER="tests tests-1 tests-2 speed bench kernels exchange triton fused mxfp8 fp8 options accuracy fuzz memory profile e2e e2e-compiled e2e-balanced e2e-mxfp8 e2e-fp8 e2e-ep repeat"

if [ "${1:-}" = --list ]; then
  for step in $ORDER; do echo "$step:"; sed '/^$/d; s/^/    /' <<< "${STEP[$step]}"; done
  exit 0
fi
mkdir -p "$OUT"
log="$OUT/gpu_check.log"
status=0
run() {  # run NAME COMMAND: expand COMMAND, log it and its output, remember a failure
  local name=$1; eval "set -- $2"
  echo "=== $name: $*" | tee -a "$log"
  [ -n "${DRY_RUN:-}" ] && return
  "$@" < /dev/null 2>&1 | tee -a "$log"  # stdin: not the table's remaining lines
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc" | tee -a "$log"
  [ "$rc" -eq 0 ] || status=1
}

echo "=== MOK_COMMIT=${MOK_COMMIT:-unset}, git HEAD $(git rev-parse --short HEAD 2>/dev/null), $NGPU GPUs" | tee -a "$log"
run gpus "nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,clocks.max.sm --format=csv"
run env "python3 -m mok env"
for step in ${*:-tests speed}; do
  if [ -z "${STEP[$step]+set}" ]; then echo "unknown step $step (known: $ORDER)" | tee -a "$log"; status=1; continue; fi
  if [ "$step" = e2e-ep ] && [ "$NGPU" -lt 2 ]; then echo "=== e2e-ep: needs two GPUs, $NGPU here" | tee -a "$log"; status=1; continue; fi
  while read -r name command; do
    [ -n "$name" ] && run "$name" "$command"
  done <<< "${STEP[$step]}"
done
exit $status
