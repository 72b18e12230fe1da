#!/bin/bash
# One device call for kernel variants kept behind build defines (k26/ops/build.py VARIANTS): each variant's
# snapshot runs the named GPU tests with its own library, then each is benchmarked against the first
# (default) snapshot with profiling/ab.sh. Snapshots are made on the CPU machine first, e.g.
#   bash profiling/snapshot.sh HEAD .snap
#   K26_OPS_DEFINES=-DK26_MY_VARIANT bash profiling/snapshot.sh HEAD .snapV
# then on the device (carry the snapshot folders; ~80 s for three with the tree-attention tests, measured
# 2026-12-04 with the two variants then kept: profiling/results/2026-12-04-variants-session17-h200.md):
#   OUT=$OUT bash .snap/profiling/variants_check.sh .snap .snapV
# Environment: TESTS (pytest paths, default the tree-attention GPU tests), BENCH (the benchmark command,
# default `python3 profiling/bench_tree_attn.py --quick`), ROUNDS (A/B rounds, default 1).
set -u
OUT=${OUT:-/tmp/k26_out}; mkdir -p "$OUT"
ROOT=$PWD
TESTS=${TESTS:-tests/test_tree_attn_gpu.py}
BENCH=${BENCH:-python3 profiling/bench_tree_attn.py --quick}
BASE=$1
for d in "$@"; do
  [ -e "$ROOT/k26/default" ] && ln -sfn "$ROOT/k26/default" "$d/k26/default"
  log="$OUT/tests_$(basename "$d").txt"
  # its own inductor cache, as profiling/ab.sh's sides (a shared one can hand a snapshot another's graphs)
  (cd "$d" && PYTHONPATH=$PWD K26_OPS_LIB=$(ls "$PWD"/k26/ops/_build/*.so) \
    TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor_cache timeout 300 python3 -m pytest -q -p no:cacheprovider $TESTS > "$log" 2>&1)
  echo "== tests $d ($(cat "$d/COMMIT")): $(tail -1 "$log")"
  grep -E "^FAILED" "$log" | head -5
done
shift
for d in "$@"; do
  OUT=$OUT/$(basename "$d") bash "$BASE/profiling/ab.sh" "$BASE" "$d" "${ROUNDS:-1}" $BENCH
done
