#!/bin/bash
# One device call that re-validates every GPU test of the suite (first thing in a session whose previous
# session changed GPU code it could not run), then the quick attention bench as a speed sanity check.
#   OUT=/tmp/out [ENGINE_BENCH=1] bash profiling/gpu_check.sh   (on the one-GPU loaner; ~3-4 min, +2-3 with the bench)
# Prints one pytest summary (and the FAILED lines) per group and the attention table; full logs under $OUT;
# exits with the number of test groups that failed (0: all passed).
set -u
export PYTHONPATH=$PWD PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/k26_out}; mkdir -p "$OUT"
if [ -z "${K26_OPS_LIB:-}" ]; then
  timeout 150 python3 -m k26.ops.build > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
fi
FAILED_GROUPS=0
run() {  # name, timeout, pytest args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@" > "$OUT/$name.txt" 2>&1 || FAILED_GROUPS=$((FAILED_GROUPS + 1))
  echo "$name: $(tail -1 "$OUT/$name.txt")"
  grep -E "^FAILED" "$OUT/$name.txt" | head -10
}
KERNELS="tests/test_tree_attn_gpu.py tests/test_moe_gpu.py tests/test_moe_router.py tests/test_linear_gpu.py
  tests/test_load_repack.py tests/test_spec_gpu.py"
MODEL="tests/test_graphs_gpu.py tests/test_engine_gpu.py tests/test_continuous.py"
run kernels 300 $KERNELS
run model 450 $MODEL
# Every other GPU-marked test (multi-GPU ones skip on one GPU: run them on nvidia-h200-x2).
run other_gpu 300 -m "gpu or multigpu" tests/ $(for f in $KERNELS $MODEL; do echo --ignore=$f; done)
timeout 200 python3 profiling/bench_tree_attn.py --quick --out "$OUT/bench_tree_attn.md" > "$OUT/bench.log" 2>&1
grep "^|" "$OUT/bench_tree_attn.md"
# ENGINE_BENCH=1: also the compiled engine bench (issue 20's host time of the adaptive budget, ~2-3 min).
if [ "${ENGINE_BENCH:-0}" = 1 ]; then
  timeout 300 python3 -m k26 bench --device cuda --batch 1 --max-tokens 128 --budget 12 --compile --no-hf \
    --out "$OUT/bench_engine.md" > "$OUT/bench_engine.log" 2>&1 || tail -5 "$OUT/bench_engine.log"
  grep "^|" "$OUT/bench_engine.md"
fi
# Exit status: the number of test groups that failed or timed out (the benches above do not count).
exit "$FAILED_GROUPS"
