#!/bin/bash
# Nsight Compute on one small-M linear (tile mode) launch of a snapshot's library (profiling/snapshot.sh): speed of
# light, warp stalls and the memory workload, to compare M or kernel variants on one projection shape.
#   OUT=/tmp/out bash profiling/debug/ncu_linear.sh SNAP_DIR N K M
# Writes $OUT/ncu-<snap>-linear-N<N>-K<K>-M<M>.txt (the whole report) and prints its key lines.
set -u
D=$(cd "$1" && pwd) N=$2 K=$3 M=$4
OUT=${OUT:-/tmp/k26_out}; mkdir -p "$OUT"
f="$OUT/ncu-$(basename "$D")-linear-N$N-K$K-M$M.txt"
(cd "$D" && PYTHONPATH=$D K26_OPS_LIB=$(ls "$D"/k26/ops/_build/*.so) timeout "${NCU_TIMEOUT:-120}" \
  ncu --clock-control none -k regex:linear_tile -s 3 -c 1 --section SpeedOfLight --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section Occupancy \
  python3 profiling/debug/linear_one.py --n "$N" --k "$K" --m "$M" > "$f" 2>&1)
echo "== ncu $(cat "$D/COMMIT") linear N=$N K=$K M=$M (rc $?)"
grep -E "linear_tile|Duration|Throughput|Hit Rate|Achieved Occupancy|Warp Cycles Per Issued|stall|Stall" "$f" | \
  cut -c1-150 | head -40
