#!/bin/bash
# One device call for issue 17 (MoE block): build the kernel library (or use K26_OPS_LIB), GPU tests of the
# router and the expert op against the references on fresh random inputs, then the whole-block benchmark.
#   OUT=/tmp/out bash profiling/moe_device_run.sh [MS]
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/k26_out}; mkdir -p "$OUT"
MS=${1:-1,2,4,8,16,32,64}
if [ -z "${K26_OPS_LIB:-}" ]; then
  timeout 150 python3 -m k26.ops.build > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
fi
timeout 200 python3 -m pytest -q -x -s tests/test_moe_router.py tests/test_moe_gpu.py > "$OUT/tests.txt" 2>&1
grep -E "differing|passed|failed|Error|error" "$OUT/tests.txt" | tail -8
# The model with the fused router and shared expert under graph capture and torch.compile.
timeout 150 python3 -m pytest -q -x tests/test_graphs_gpu.py tests/test_engine_gpu.py > "$OUT/model_tests.txt" 2>&1
grep -E "passed|failed|Error" "$OUT/model_tests.txt" | tail -4
timeout 300 python3 profiling/bench_moe.py --block --shapes tp8,tp1 --ms "$MS" --out "$OUT/bench_block.md" \
  > "$OUT/bench_log.txt" 2>&1
tail -4 "$OUT/bench_log.txt" | grep -v "^|" ; grep "^|" "$OUT/bench_block.md"
