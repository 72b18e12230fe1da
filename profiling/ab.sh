#!/bin/bash
# An A/B inside one device call: the same command in two snapshots (profiling/snapshot.sh), alternating,
# ROUNDS times each, so both sides see the same machine (machines differ by ~2 % on the step).
#   OUT=/tmp/out bash profiling/ab.sh OLD_DIR NEW_DIR ROUNDS python3 profiling/bench_moe.py --block --quick --ms 1
# Each run gets PYTHONPATH, K26_COMMIT and K26_OPS_LIB of its snapshot and `--out $OUT/<side><round>.md`
# appended; its table rows (lines starting with "|") are printed under a "== side round" header.
# A flag A/B in one snapshot: the same directory twice and NEW_ARGS (and / or OLD_ARGS), appended to that
# side's command, e.g. NEW_ARGS=--no-pdl bash profiling/ab.sh .snap .snap 2 python3 profiling/bench_k26.py ...
# Each snapshot compiles into its own inductor cache (<snapshot>/.inductor_cache): with one shared cache a side
# whose custom op's fake gave other sizes (a routing table's bound, 2026-12-07) loaded the other side's compiled
# graph and failed its size assertion (expected 535, the cached graph's 586).
# AB_ROWS (an extended regex, optional): only the table rows matching it are printed, e.g. AB_ROWS='decode|verify'
# for bench_k26's step rows without its per-op tables — a device call returns only the last 12,000 characters of
# its output, which a few rounds of whole tables overflow (2026-12-07). The full tables stay in $OUT.
set -u
OLD=$(cd "$1" && pwd) NEW=$(cd "$2" && pwd) ROUNDS=$3
shift 3
OUT=${OUT:-/tmp/k26_out}; mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  for side in old new; do
    d=$OLD extra=${OLD_ARGS:-}
    [ "$side" = new ] && d=$NEW extra=${NEW_ARGS:-}
    out="$OUT/$side$r.md"
    # shellcheck disable=SC2086  # the extra arguments split on spaces on purpose
    (cd "$d" && PYTHONPATH=$d K26_COMMIT=$(cat COMMIT) K26_OPS_LIB=$(ls "$d"/k26/ops/_build/*.so) \
      TORCHINDUCTOR_CACHE_DIR=$d/.inductor_cache \
      timeout "${AB_TIMEOUT:-300}" "$@" $extra --out "$out" > "$OUT/$side$r.log" 2>&1)
    rc=$?
    echo "== $side $r ($(cat "$d/COMMIT")${extra:+ $extra}, rc $rc)"
    grep "^|" "$out" 2>/dev/null | grep -E "${AB_ROWS:-.}" || tail -3 "$OUT/$side$r.log"
  done
done
