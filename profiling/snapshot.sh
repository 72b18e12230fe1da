#!/bin/bash
# A clean tree of one commit with its kernel library built here (the CPU machine), ready to carry to a device
# call: the device then builds nothing. Two snapshots side by side make an A/B inside one call (profiling/ab.sh).
#   bash profiling/snapshot.sh [REV=HEAD] [DIR=.snap]     (k26/default, 23 MB of the embedded pair, left out)
# DIR must be ignored by git (.gitignore: /.snap*/) so it travels only in `carry` and is never committed.
# A kernel variant of the same commit: K26_OPS_DEFINES="-DNAME" bash profiling/snapshot.sh HEAD .snapV (its
# library is built with the defines; k26/ops/build.py). SNAP_ARCH=sm_90a builds the H200's SASS only: half the
# library, so five snapshots fit one call's 64 MiB carry.
set -eu
REV=${1:-HEAD}
DIR=${2:-.snap}
ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
rm -rf "$DIR" && mkdir -p "$DIR"
git archive "$REV" | tar -x -C "$DIR" --exclude=k26/default
echo "$(git rev-parse --short "$REV")${K26_OPS_DEFINES:+ $K26_OPS_DEFINES}" > "$DIR/COMMIT"
(cd "$DIR" && python -m k26.ops.build --arch "${SNAP_ARCH:-sm_90a,sm_120a}" > build.txt 2>&1) || { tail -20 "$DIR/build.txt"; exit 1; }
echo "$DIR: $(cat "$DIR/COMMIT"), $(ls "$DIR"/k26/ops/_build/*.so), $(du -sh "$DIR" | cut -f1)"
