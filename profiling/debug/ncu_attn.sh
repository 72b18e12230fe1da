#!/bin/bash
# Nsight Compute on one tree-attention launch of a snapshot's library (profiling/snapshot.sh): speed of light,
# warp stalls, the pipes and shared memory, for comparing kernel variants on the same shape.
#   OUT=/tmp/out bash profiling/debug/ncu_attn.sh SNAP_DIR N L [H]
# Writes $OUT/ncu-<snap>-N<N>-L<L>.txt (the whole report) and prints its key lines.
set -u
D=$(cd "$1" && pwd) N=$2 L=$3 H=${4:-8}
OUT=${OUT:-/tmp/k26_out}; mkdir -p "$OUT"
f="$OUT/ncu-$(basename "$D")-N$N-L$L.txt"
(cd "$D" && PYTHONPATH=$D K26_OPS_LIB=$(ls "$D"/k26/ops/_build/*.so) timeout "${NCU_TIMEOUT:-120}" \
  ncu --clock-control none -k regex:tree_attn -s 3 -c 1 --section SpeedOfLight --section WarpStateStats \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
  python3 profiling/debug/attn_one.py --n "$N" --l "$L" --h "$H" > "$f" 2>&1)
echo "== ncu $(cat "$D/COMMIT") N=$N L=$L H=$H (rc $?)"
grep -E "tree_attn|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Executed Ipc Active|\
Shared Memory|L1/TEX Hit|Achieved Occupancy|Warp Cycles Per Issued|stall|Stall" "$f" | cut -c1-150 | head -40
