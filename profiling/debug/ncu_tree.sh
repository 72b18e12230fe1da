#!/bin/bash
# Nsight Compute on one DDTree build launch of a snapshot's library (profiling/snapshot.sh): warp stalls and the
# per-SASS-instruction stall samples (the heap's pop chain: where its cycles go).
#   OUT=/tmp/out bash profiling/debug/ncu_tree.sh SNAP_DIR [BUDGET=64] [DEPTH=15]
# Writes $OUT/ncu-tree-<snap>-B<budget>.txt (the report) and .csv (SASS with its stall samples).
set -u
D=$(cd "$1" && pwd) B=${2:-64} L=${3:-15}
OUT=${OUT:-/tmp/k26_out}; mkdir -p "$OUT"
f="$OUT/ncu-tree-$(basename "$D")-B$B"
(cd "$D" && PYTHONPATH=$D K26_OPS_LIB=$(ls "$D"/k26/ops/_build/*.so) timeout "${NCU_TIMEOUT:-120}" \
  ncu --clock-control none -k regex:build_kernel -s 2 -c 1 --warp-sampling-interval 0 --section WarpStateStats \
  --section SourceCounters \
  -f -o "$f" python3 profiling/debug/tree_one.py --budget "$B" --depth "$L" > "$f.log" 2>&1)
echo "== ncu $(cat "$D/COMMIT") budget $B depth $L (rc $?)"
ncu -i "$f.ncu-rep" --print-details all > "$f.txt" 2>&1
ncu -i "$f.ncu-rep" --page source --csv --print-source sass > "$f.csv" 2>&1
grep -E "Duration|Warp Cycles Per Issued|Stall" "$f.txt" | cut -c1-150 | head -30
