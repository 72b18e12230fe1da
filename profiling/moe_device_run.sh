#!/bin/bash
# One device call for issue 17 (MoE block): the kernel library (a carried build matching the sources, else
# built here), GPU tests of the router and the expert op against the references on fresh random inputs, the
# whole-block benchmark and, with NCU=1, Nsight Compute on one router launch (TP8 shape, M = 1); PROBE=1: the
# one-token gate/up's read probe (profiling/debug/moe_read_probe.py: the memory system's floor for its bytes
# against the kernel's walk); NCU_GU=1: Nsight Compute on one one-token gate/up launch (TP8 shape, with the
# shared expert, caches flushed by ncu: the kernel alone, without the router's overlap).
#   OUT=/tmp/out [QUICK=1] [SHAPES=tp8,tp1] [NCU=1] [PROBE=1] [NCU_GU=1] [MODEL_TESTS=1] bash profiling/moe_device_run.sh [MS]
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/k26_out}; mkdir -p "$OUT"
MS=${1:-1,2,4,8,16,32,64}
if [ -z "${K26_OPS_LIB:-}" ]; then
  python3 -c "from k26.ops import build; build.library()" > "$OUT/build.txt" 2>&1 ||
    timeout 150 python3 -m k26.ops.build > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
fi
timeout 200 python3 -m pytest -q -s -rf --durations=4 tests/test_moe_router.py tests/test_moe_gpu.py \
  tests/test_moe_shared.py tests/test_moe_repack.py > "$OUT/tests.txt" 2>&1
grep -E "differing|passed|failed|FAILED|s call" "$OUT/tests.txt" | tail -14
if [ -n "${MODEL_TESTS:-}" ]; then  # the model with the fused router under graph capture and torch.compile
  timeout 150 python3 -m pytest -q -rf tests/test_graphs_gpu.py tests/test_engine_gpu.py > "$OUT/model_tests.txt" 2>&1
  grep -E "passed|failed|FAILED" "$OUT/model_tests.txt" | tail -6
fi
timeout 300 python3 profiling/bench_moe.py --block ${QUICK:+--quick} --shapes "${SHAPES:-tp8,tp1}" --ms "$MS" \
  --out "$OUT/bench_block.md" > "$OUT/bench_log.txt" 2>&1
tail -4 "$OUT/bench_log.txt" | grep -v "^|"; grep "^|" "$OUT/bench_block.md"
if [ -n "${NCU:-}" ]; then
  timeout 120 ncu --clock-control none --kernel-name regex:router_kernel --launch-skip 1 -c 1 --set full \
    python3 profiling/debug/moe_debug.py --router > "$OUT/ncu_router.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Waves Per|Theoretical Occ|Elapsed Cycles" \
    "$OUT/ncu_router.txt" | head -20
fi
if [ -n "${PROBE:-}" ]; then
  timeout 150 python3 profiling/debug/moe_read_probe.py --out "$OUT/read_probe.md" > "$OUT/read_probe.log" 2>&1
  grep "^|" "$OUT/read_probe.md" || tail -5 "$OUT/read_probe.log"
fi
if [ -n "${NCU_GU:-}" ]; then
  timeout 150 ncu --clock-control none --kernel-name regex:gemm_kernel --launch-skip 1 -c 1 --set full \
    python3 profiling/debug/moe_debug.py --op uniform 1 > "$OUT/ncu_gate_up.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Waves Per|L2 Hit|L1/TEX Hit|Stall" \
    "$OUT/ncu_gate_up.txt" | head -30
fi
