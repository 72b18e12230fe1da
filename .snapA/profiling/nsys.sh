#!/usr/bin/env bash
# nsys timeline of a k26 generation with NVTX ranges (prefill, capture, draft, verify, replay).
#   profiling/nsys.sh [MODEL_DIR] [DRAFTER_DIR]
# Open the .nsys-rep in Nsight Systems; filter the NVTX domain "k26". Where nsys is absent (the loaner),
# use `python -m k26 profile --out trace.json` for a torch.profiler trace instead.
set -euo pipefail
MODEL=${1:-}
DRAFTER=${2:-}
args=(generate --prompt "Hello" --max-tokens 128 --device cuda)
[ -n "$MODEL" ] && args+=(--model "$MODEL")
[ -n "$DRAFTER" ] && args+=(--drafter "$DRAFTER" --spec ddtree --budget 12)
nsys profile --trace=cuda,nvtx,osrt --cuda-graph-trace=node -o k26-profile --force-overwrite true \
  python -m k26 "${args[@]}"
