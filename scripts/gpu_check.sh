#!/usr/bin/env bash
# Everything the GPU machine should check, in one call: environment, the test suite (GPU tests
# included), and benchmarks. One log ($OUT/gpu_check.log, or ./gpu-logs/) plus the JSON and markdown
# results, few files, since the device tool brings back at most 8. Usage:
#   scripts/gpu_check.sh [tests] [bench] [kernels] [exchange] [triton] [clamp] [fuzz] [gluon] [host]
#                        [fused] [mxfp8] [memory] [e2e] [e2e-compiled] [e2e-balanced]
#                        [e2e-profile] [e2e-step] [e2e-mxfp8] [e2e-ep] [ep1-rows] [repeat]
#                        [recompute] [e2e-recompute] [router-gradient]
#                        [tests-1] [tests-2]
#   (default: the first five; tests-1 and tests-2: the suite's two halves by file, verbose, for
#   calls on an H100, where the whole suite outlasts one 10-minute call)
# exchange: the NVLink exchange's tests and its benchmark (EXCHANGE_ARGS adds options).
# triton: the triton backend's GPU tests, then `mok bench` of the issue-5 presets at EP 1 and all GPUs.
# Set MOK_COMMIT=$(git rev-parse --short HEAD) when the tree travels without its git history, and
# HYPOTHESIS_PROFILE=dev for fewer fuzzed cases (each new shape compiles kernels: minutes on GPUs).
# PYTEST_ARGS adds pytest options to the tests step (e.g. "-n 4" with pytest-xdist).
# clamp: accuracy under an active SwiGLU clamp against float64, and its cost (one GPU).
# fuzz: the fuzz campaign of the triton and fused backends (FUZZ_ARGS, default
# "--cases 1300 --ep 1,2 --workers 4").
# gluon: the warp-specialized Gluon GEMMs against the tl kernels (tests, then the benchmark).
# e2e: end-to-end training steps, mok against the native transformers experts (EP 1) and against
# mok-baseline at EP = the GPU count (benchmarks/train_e2e.py), with loss curves and plots;
# e2e-compiled: the same compiled by Inductor, and TorchTitan's own model with and without MoK;
# e2e-balanced: the GPU-bound run with balanced routing, eager and compiled (and the model's own
# routing, compiled, beside it; the compiled balanced step profiled); e2e-profile: one compiled
# step of each profiled, with Chrome traces. e2e-step: the compiled balanced step alone.
# e2e-mxfp8: eager training with MoK's routed experts in MXFP8 beside bf16 MoK and the native.
# e2e-ep: that step's shape at EP = the GPU count (two or more), mok against mok-baseline, eager
# and compiled (docs/notes/two-gpu-campaign.md lists what else waits for two GPUs).
# repeat: two training runs of one model in one process, bf16 and MXFP8, under --deterministic:
# whether the step repeats bit for bit (benchmarks/results/2026-12-04-train-e2e-repeatability-h200.md).
# recompute: `MoKConfig.recompute`'s tests, then the layer with it beside the layer without
# (benchmarks/recompute.py: bitwise, time, memory kept for the backward; triton and fused) and the
# peak against the baseline's (benchmarks/peak_memory.py, EP 1). e2e-recompute: the eager
# training step with it and with router_gradient="epilogue" beside bf16 MoK and the native experts.
# router-gradient: `MoKConfig.router_gradient="epilogue"`'s tests, the down product's backward
# both ways (benchmarks/router_weighting.py) and the layer with it beside the layer without
# (benchmarks/recompute.py --option: time, memory kept for the backward).
# ep1-rows: EP 1's gathered gate/up rows against the copy, and the local combine's sum by tile.
# host: host time per layer call (forward / backward, beside the baseline's, kernels launched),
# a replayed call's stages and whether the GPU waits over 8 such layers, the copies and checks
# around a replay two ways each, against the GPU's in a 24-layer stack by validation mode, and
# `mok bench --preset tiny` with the layer's own CUDA graphs and without.
# mxfp8: the MXFP8 tests, then the MXFP8 layer beside the bf16 one (benchmarks/mxfp8.py, one
# GPU), both precisions beside the baseline at EP = the GPU count (`mok bench --precision`: on 2
# GPUs the dispatch's NVLink bytes at 0.52x), and the cast kernels by tile (benchmarks/mx_casts.py).
# memory: peak memory per rank, symmetric buffers counted (benchmarks/peak_memory.py): EP 2 on
# two GPUs or on ranks sharing one (worst-case receive buffers, at 1.25x the mean pairs, and
# sized by the pairs received with exact_buffers),
# EP 1 (and at 32768 tokens with the grouped rows kept and not: keep_grouped_rows), and the MXFP8
# layer at EP 1.
# fused: the overlapped layer's tests, its benchmark against the triton backend (pull and push;
# comm_sms 8, 16, 24) at EP = the GPU count, `mok bench` of it with and without exact_buffers,
# its overlapped schedule forced at EP 1 (the price of
# the SMs the copies take), and a profiler trace of one fused forward + backward.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
steps=${*:-tests bench kernels exchange triton}
status=0

log="$OUT/gpu_check.log"
run() {  # run NAME COMMAND...: append to the log, remember failures
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$log"
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc" | tee -a "$log"
  [ "$rc" -eq 0 ] || status=1
}

run gpus nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,clocks.max.sm --format=csv
run env python3 -m mok env

for step in $steps; do
  case $step in
    tests)
      run pytest python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} ;;
    tests-1|tests-2)  # the suite in two halves by file, for calls shorter than the whole (an H100)
      files=$(ls tests/kernels/test_*.py tests/test_*.py)
      half=$(( $(echo "$files" | wc -l) / 2 ))
      if [ "$step" = tests-1 ]; then part=$(echo "$files" | head -n "$half"); else part=$(echo "$files" | tail -n +"$((half + 1))"); fi
      run "pytest-${step#tests-}" python3 -m pytest -v -rfs -p no:cacheprovider ${PYTEST_ARGS:-} $part ;;
    clamp)
      run clamp python3 benchmarks/clamp_accuracy.py --out "$OUT/clamp-accuracy.md" ;;
    fuzz)
      run fuzz python3 benchmarks/fuzz.py ${FUZZ_ARGS:---cases 1300 --ep 1,2 --workers 4} --out "$OUT/fuzz.md" ;;
    bench)
      ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      run bench-tiny python3 -m mok bench --no-progress --preset tiny --ep "$ngpu" --json "$OUT/bench-tiny.json"
      run bench-qwen3-30b python3 -m mok bench --no-progress --preset qwen3-30b-a3b --ep "$ngpu" \
        --tokens 4096 --iters 5 --warmup 2 --json "$OUT/bench-qwen3-30b.json" ;;
    kernels)
      if [ -f benchmarks/expert_kernels.py ]; then
        run kernels python3 benchmarks/expert_kernels.py --check --bench --out "$OUT/expert-kernels.md"
      fi
      run kernels-zipf python3 benchmarks/expert_kernels.py --bench --routing zipf \
        --presets qwen3-30b-a3b qwen3-235b-a22b --tokens 8192 --out "$OUT/expert-kernels-zipf.md"
      run pair-gradients python3 benchmarks/pair_gradients.py --out "$OUT/pair-gradients.md" ;;
    exchange)
      run exchange-tests python3 -m pytest -q -rs -p no:cacheprovider \
        tests/kernels/test_rows_kernels.py tests/kernels/test_placement_kernels.py tests/test_comm_placement.py \
        tests/test_comm_symmetric.py
      run exchange-bench python3 benchmarks/exchange.py --out "$OUT/exchange.md" ${EXCHANGE_ARGS:-} ;;
    triton)
      run triton-tests python3 -m pytest -q -rs -p no:cacheprovider tests/test_triton_backend.py \
        tests/test_comm_symmetric.py tests/kernels/test_rows_kernels.py \
        tests/kernels/test_placement_kernels.py
      ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      eps=1; [ "$ngpu" -gt 1 ] && eps="1,$ngpu"
      run triton-bench python3 -m mok bench --no-progress \
        --preset qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3 --ep "$eps" --iters 10 --warmup 3 \
        --out "$OUT/bench" ;;
    host)
      ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      # The tl kernels in place of the Gluon ones: their launches cost the host less.
      run host-time-tiny-tl env MOK_WARP_SPECIALIZED=0 python3 benchmarks/host_time.py \
        --preset tiny
      # Where a replayed call's host time goes, stage by stage.
      run host-time-tiny-stages python3 benchmarks/host_time.py --preset tiny --iters 200 --stages \
        --stack 8
      # The host work around a replay's graph launches, two ways each, in one process.
      run host-replay-ops python3 benchmarks/replay_host_ops.py --out "$OUT/replay-host-ops.md"
      for preset in tiny qwen3-30b-a3b; do
        run "host-time-$preset" python3 benchmarks/host_time.py --preset "$preset" --kernels --launches \
          --graphed
        run "host-$preset" python3 benchmarks/host_cost.py --preset "$preset" --ep "$ngpu" \
          --compiled --graphed
      done
      for graphs in auto off; do  # the layer's own CUDA graphs (the default), then none
        run "host-bench-tiny-graphs-$graphs" python3 -m mok bench --no-progress --preset tiny \
          --ep 1 --graphs "$graphs" --json "$OUT/bench-tiny-graphs-$graphs.json"
      done
      run host-bench-tiny-graph python3 -m mok bench --no-progress --preset tiny,qwen3-30b-a3b \
        --tokens 4096 --ep 1 --cuda-graph --json "$OUT/bench-graph.json"
      run host-bench python3 -m mok bench --no-progress --preset tiny,qwen3-30b-a3b \
        --tokens 4096 --iters 10 --warmup 3 --validation local --json "$OUT/bench-local.json" ;;
    e2e)
      # Issue 15's end-to-end comparison: the default small model, then qwen3-30b-a3b's layer
      # shape (H 2048, 128 experts of I 768, top 8), where the experts' work dominates a step.
      ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      run e2e-small python3 benchmarks/train_e2e.py --steps 30 --warmup 5 --out "$OUT/e2e-small"
      run e2e-qwen3-30b python3 benchmarks/train_e2e.py --steps 30 --warmup 5 --layers 4 \
        --hidden 2048 --experts 128 --top-k 8 --moe-intermediate 768 --batch 8 --seq 1024 \
        --out "$OUT/e2e-qwen3-30b"
      # 32k tokens a micro-batch, 2 a step: enough GPU work per launch that the host (the model's
      # eager Python, the optimizer's launches) no longer bounds the step, and the optimizer
      # (~30 ms, a third of a one-batch step above) amortized as with large global batches.
      run e2e-qwen3-30b-accumulate python3 benchmarks/train_e2e.py --steps 10 --warmup 3 \
        --layers 4 --hidden 2048 --experts 128 --top-k 8 --moe-intermediate 768 --batch 32 \
        --seq 1024 --accumulate 2 --out "$OUT/e2e-qwen3-30b-accumulate"
      # A trainer's bf16 mixed precision: fp32 weights, each step under autocast.
      run e2e-qwen3-30b-autocast python3 benchmarks/train_e2e.py --steps 20 --warmup 5 \
        --layers 4 --hidden 2048 --experts 128 --top-k 8 --moe-intermediate 768 --batch 8 \
        --seq 1024 --weights fp32-autocast --out "$OUT/e2e-qwen3-30b-autocast"
      if [ "$ngpu" -gt 1 ]; then
        run e2e-ep python3 benchmarks/train_e2e.py --ep "$ngpu" --steps 30 --warmup 5 \
          --out "$OUT/e2e-ep$ngpu"
      fi ;;
    e2e-compiled)
      # Issue 15's end-to-end comparison compiled, and TorchTitan's model (a step of its own:
      # each compiles for minutes). qwen3-30b-a3b's layer shape compiled by Inductor (both
      # implementations; MoK's experts as its custom ops): the models' eager Python, which
      # bounds the one-batch step of `e2e`, mostly gone.
      run e2e-qwen3-30b-compiled python3 benchmarks/train_e2e.py --steps 20 --warmup 8 \
        --layers 4 --hidden 2048 --experts 128 --top-k 8 --moe-intermediate 768 --batch 8 \
        --seq 1024 --compile inductor --out "$OUT/e2e-qwen3-30b-compiled"
      # TorchTitan's own Qwen3-MoE (qwen3-30b-a3b's layers, cut to 4) against itself with MoK
      # behind its routed experts. The GPU machine has no package index: carry .wheels/ (made
      # here by `pip download torchtitan==0.3.0 tyro docstring_parser spmd_types shtab
      # typeguard --no-deps -d .wheels`), installed beside the machine's own packages.
      if [ -d .wheels ] && ! python3 -c 'import torchtitan' 2>/dev/null; then
        python3 -m pip install -q --no-deps --target /tmp/mok-wheels .wheels/*.whl
        export PYTHONPATH="$PYTHONPATH:/tmp/mok-wheels"
      fi
      # TorchTitan 0.3.0's model code needs a PyTorch newer than 2.11 (the GPU machine's).
      titan_gaps=$(python3 -c 'from mok.integrations.torchtitan import missing_torch_features as m
print(*m())' 2>&1)
      if [ -n "$titan_gaps" ]; then
        echo "=== e2e-torchtitan: skipped, this PyTorch lacks $titan_gaps" | tee -a "$log"
      elif python3 -c 'import torchtitan' 2>/dev/null; then
        run e2e-torchtitan python3 benchmarks/train_e2e.py --framework torchtitan --layers 4 \
          --steps 20 --warmup 5 --batch 8 --seq 1024 --out "$OUT/e2e-torchtitan"
      fi ;;
    e2e-balanced)
      # The GPU-bound qwen3-30b shape (2 micro-batches of 32k tokens) with every router's choice
      # a fixed balanced one (--routing balanced): the random-initialised model's own routing
      # sends every token to the same 8 experts by the last steps (max / mean load 16 = E / k),
      # where the native grouped GEMMs run as 8 dense ones. Eager and compiled, then the
      # compiled run with the model's own routing beside them.
      shape="--layers 4 --hidden 2048 --experts 128 --top-k 8 --moe-intermediate 768"
      shape="$shape --batch 32 --seq 1024 --accumulate 2 --steps 10 --warmup 3"
      run e2e-balanced python3 benchmarks/train_e2e.py $shape --routing balanced \
        --out "$OUT/e2e-balanced"
      run e2e-balanced-compiled python3 benchmarks/train_e2e.py $shape --routing balanced \
        --compile inductor --profile 25 --trace "$OUT/traces-balanced" \
        --out "$OUT/e2e-balanced-compiled"
      run e2e-model-routing-compiled python3 benchmarks/train_e2e.py $shape --compile inductor \
        --out "$OUT/e2e-model-routing-compiled" ;;
    e2e-profile)
      # Where a compiled step goes, native experts against MoK's (the 1.11x of 2026-12-02):
      # each implementation's step profiled (kernels by own GPU time) with its Chrome trace, and
      # the routing's skew per layer in the report.
      run e2e-compiled-profile python3 benchmarks/train_e2e.py --steps 12 --warmup 8 --layers 4 \
        --hidden 2048 --experts 128 --top-k 8 --moe-intermediate 768 --batch 8 --seq 1024 \
        --compile inductor --profile 25 --trace "$OUT/traces" --out "$OUT/e2e-compiled-profile" ;;
    mxfp8)
      run mxfp8-tests python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} \
        tests/kernels/test_mx_kernels.py tests/kernels/test_mx_expert_mlp.py \
        tests/test_triton_backend_mx.py tests/test_mx_expert.py
      run mxfp8-bench env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 benchmarks/mxfp8.py --profile --out "$OUT/mxfp8.md"
      ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      run mxfp8-layer-bench python3 -m mok bench --no-progress \
        --preset deepseek-v3,qwen3-235b-a22b --ep "$ngpu" --precision bf16,mxfp8 \
        --iters 10 --warmup 3 --json "$OUT/bench-mxfp8.json"
      run mx-casts python3 benchmarks/mx_casts.py ;;
    gluon)
      run gluon-tests python3 -m pytest -q -rs -p no:cacheprovider tests/kernels/test_warp_specialized.py
      run gluon-bench python3 benchmarks/warp_specialized.py --out "$OUT/warp-specialized.md" ;;
    fused)
      run fused-tests python3 -m pytest -q -rs -p no:cacheprovider tests/test_fused_backend.py \
        tests/kernels/test_row_sources.py tests/test_triton_backend.py
      ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      for dispatch in pull push; do
        run "fused-bench-$dispatch" python3 benchmarks/overlap.py --dispatch "$dispatch" \
          --preset qwen3-235b-a22b,deepseek-v3 --ep "$ngpu" --out "$OUT/overlap-$dispatch.md"
      done
      for sms in 8 24; do
        run "fused-bench-sms$sms" python3 benchmarks/overlap.py --preset deepseek-v3 \
          --ep "$ngpu" --comm-sms "$sms" --out "$OUT/overlap-sms$sms.md"
      done
      for sizing in "" "--exact-buffers"; do  # what exact_buffers' host sync costs
        run "fused-bench $sizing" python3 -m mok bench --preset deepseek-v3,qwen3-235b-a22b \
          --ep "$ngpu" --backend fused $sizing --iters 10 --json "$OUT/bench-fused${sizing:+-exact}.json"
      done
      run fused-bench-ep1-overlapped python3 benchmarks/overlap.py --overlap --ep 1 \
        --preset qwen3-235b-a22b,deepseek-v3 --out "$OUT/overlap-ep1-overlapped.md"
      run fused-trace python3 benchmarks/profile_layer.py --preset deepseek-v3 --backend fused \
        --trace "$OUT/trace-fused" ;;
    e2e-step)
      # The compiled, balanced qwen3-30b-a3b step of issue 15's table alone (two micro-batches
      # of 32k tokens, Inductor, one step profiled): ~190 s.
      run e2e-step python3 benchmarks/train_e2e.py --layers 4 --hidden 2048 --experts 128 \
        --top-k 8 --moe-intermediate 768 --batch 32 --seq 1024 --accumulate 2 --steps 8 \
        --warmup 3 --routing balanced --compile inductor --profile 25 --out "$OUT/e2e-step" ;;
    e2e-mxfp8)
      # Training with MoK's routed experts in MXFP8 beside bf16 MoK and the native grouped_mm
      # experts: qwen3-30b-a3b's layer shape, 4 layers, 8k tokens a step, balanced routing, eager;
      # the weights' casts made per pass (the default) and kept between steps. Then 2 micro-batches
      # a step, where the kept casts serve both.
      shape="--layers 4 --hidden 2048 --experts 128 --top-k 8 --moe-intermediate 768 --seq 1024"
      shape="$shape --routing balanced --steps 12 --warmup 4"
      run e2e-mxfp8 python3 benchmarks/train_e2e.py $shape --batch 8 \
        --implementations grouped_mm,mok,mok-mxfp8,mok-mxfp8-keep --out "$OUT/e2e-mxfp8"
      run e2e-mxfp8-accumulate python3 benchmarks/train_e2e.py $shape --batch 8 --accumulate 2 \
        --implementations mok,mok-mxfp8,mok-mxfp8-keep --out "$OUT/e2e-mxfp8-accumulate" ;;
    e2e-ep)
      # Issue 15's EP row: the GPU-bound qwen3-30b-a3b shape of `e2e-step` at EP = the GPU count
      # (32k tokens a rank and micro-batch), mok against mok-baseline, eager then compiled.
      ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      if [ "$ngpu" -lt 2 ]; then
        echo "=== e2e-ep: needs two GPUs, $ngpu here" | tee -a "$log"; status=1
      else
        shape="--ep $ngpu --layers 4 --hidden 2048 --experts 128 --top-k 8 --moe-intermediate 768"
        shape="$shape --batch 32 --seq 1024 --accumulate 2 --steps 8 --warmup 3 --routing balanced"
        run e2e-ep python3 benchmarks/train_e2e.py $shape --out "$OUT/e2e-ep$ngpu"
        run e2e-ep-compiled python3 benchmarks/train_e2e.py $shape --compile inductor \
          --out "$OUT/e2e-ep$ngpu-compiled"
      fi ;;
    repeat)
      run e2e-repeat python3 benchmarks/train_e2e.py --layers 2 --hidden 2048 --experts 128 \
        --top-k 8 --moe-intermediate 768 --seq 1024 --routing balanced --steps 8 --warmup 2 \
        --batch 8 --implementations mok,mok,mok-mxfp8,mok-mxfp8 --deterministic \
        --out "$OUT/e2e-repeat" ;;
    recompute)
      run recompute-tests python3 -m pytest -q -rf -p no:cacheprovider tests/test_recompute.py \
        tests/test_compile.py -k "recompute or equals_eager_bitwise"
      run recompute-triton python3 benchmarks/recompute.py --preset qwen3-30b-a3b,deepseek-v3 \
        --tokens 16384 --out "$OUT/recompute-triton.md"
      run recompute-fused python3 benchmarks/recompute.py --preset qwen3-30b-a3b --tokens 16384 \
        --backend fused --out "$OUT/recompute-fused.md"
      run recompute-peak python3 benchmarks/peak_memory.py --ep 1 --preset qwen3-30b-a3b \
        --tokens 16384 --backends baseline,triton,triton-recompute --out "$OUT/recompute-peak.md" ;;
    router-gradient)
      run router-gradient-tests python3 -m pytest -q -rf -p no:cacheprovider \
        tests/test_router_gradient.py tests/kernels/test_warp_specialized.py \
        tests/kernels/test_group_column_sums.py -k "weighted or gpu or dots or sums"
      run router-gradient-kernels python3 benchmarks/router_weighting.py --iters 20
      run router-gradient-layer python3 benchmarks/recompute.py --preset qwen3-30b-a3b \
        --tokens 16384 --option router_gradient=epilogue --out "$OUT/router-gradient.md"
      run router-gradient-layer-ds python3 benchmarks/recompute.py --preset deepseek-v3 \
        --tokens 8192 --option router_gradient=epilogue --out "$OUT/router-gradient-ds.md" ;;
    e2e-recompute)
      run e2e-recompute python3 benchmarks/train_e2e.py --layers 4 --hidden 2048 --experts 128 \
        --top-k 8 --moe-intermediate 768 --seq 1024 --routing balanced --steps 12 --warmup 4 \
        --batch 8 --implementations grouped_mm,mok,mok-recompute,mok-router-epilogue \
        --out "$OUT/e2e-recompute" ;;
    ep1-rows)
      # EP 1's data movement around the products: the gate/up product reading rows through an
      # index against the copy plus TMA tiles, every preset (`gathers_rows_well`'s evidence), and
      # the one-process combine's sum by tile and programs per SM, alone and in the combine.
      run ep1-gather python3 benchmarks/warp_specialized.py --products gate_up_sources \
        --tokens 8192,32768 --out "$OUT/gate-up-sources.md"
      run ep1-local-sum python3 benchmarks/tune_rows.py --preset qwen3-30b-a3b --local-sum \
        --tokens 32768
      run ep1-pair-outputs python3 benchmarks/pair_outputs_in_place.py \
        --preset qwen3-30b-a3b,deepseek-v3 --tokens 32768 --iters 10 ;;
    memory)
      for sizing in "" "--pair-capacity 1.25" "--exact-buffers"; do
        name=$(echo "${sizing:-worst-case}" | tr -d ' .-')
        run "memory-ep2 $sizing" python3 benchmarks/peak_memory.py --ep 2 $sizing \
          --out "$OUT/peak-memory-ep2-$name.md"
      done
      run memory-ep1 python3 benchmarks/peak_memory.py --ep 1 --out "$OUT/peak-memory-ep1.md"
      for keep in "" "--keep-grouped-rows"; do
        run "memory-ep1-32k $keep" python3 benchmarks/peak_memory.py --ep 1 --tokens 32768 \
          --preset qwen3-30b-a3b,qwen3-235b-a22b $keep
      done
      run memory-mxfp8 python3 benchmarks/peak_memory.py --ep 1 --backends baseline,triton \
        --precision mxfp8 --out "$OUT/peak-memory-mxfp8.md" ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
exit $status
