#!/bin/bash
# One device call on the two-GPU loaner (nvidia-h200-x2): the multi-GPU tests (fused all-reduce 10,000
# replays, TP 2 == TP 1, TP 2 with the fused op: graphs == eager, DDTree == AR), then the TP 2 bench
# (collective latency table with the fused op's rows, the TP 2 pair fused vs NCCL).
#   OUT=/tmp/out bash profiling/gpu_check_x2.sh        (~5-6 min; the single-GPU suite is gpu_check.sh)
# Prints the pytest summary and the bench's tables; full logs under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/k26_out}; mkdir -p "$OUT"
if [ -z "${K26_OPS_LIB:-}" ]; then
  timeout 150 python3 -m k26.ops.build > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
fi
timeout 330 python3 -m pytest -q -p no:cacheprovider -m multigpu tests/test_allreduce_gpu.py tests/test_tp_gpu.py \
  > "$OUT/multigpu.txt" 2>&1
echo "multigpu: $(tail -1 "$OUT/multigpu.txt")"
grep -E "^(FAILED|ERROR)" "$OUT/multigpu.txt"
timeout 200 torchrun --nproc-per-node 2 profiling/bench_tp2.py --out "$OUT/bench_tp2.md" > "$OUT/bench_tp2.log" 2>&1
echo "bench_tp2 rc=$?"
grep -E "^\|" "$OUT/bench_tp2.md"
