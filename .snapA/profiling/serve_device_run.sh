#!/bin/bash
# One device call for issue 21 (server): the GPU tests of continuous batching in graphs and of the graph
# runner, then bench_serve on the H200 with the embedded pair. Needs the server wheels carried in .whl/
# (fastapi, starlette, uvicorn, pydantic, ...) and a kernel library built here (k26/ops/_build) or built
# on the spot (or .opslib/libk26_ops.so, built here from the same sources).
#   OUT=/tmp/out bash profiling/serve_device_run.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/k26_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
if [ -f .opslib/libk26_ops.so ]; then export K26_OPS_LIB=$PWD/.opslib/libk26_ops.so  # built here from these sources
else timeout 100 python3 -m k26.ops.build > "$OUT/build.txt" 2>&1 || { tail -20 "$OUT/build.txt"; exit 1; }; fi
timeout ${T_TESTS:-50} python3 -m pytest -q tests/test_continuous.py tests/test_graphs_gpu.py \
  -k "graph_rows or replay or auto_budget or capture_report" > "$OUT/tests.txt" 2>&1
grep -E "passed|failed|Error|error|assert" "$OUT/tests.txt" | tail -12
K26_COMMIT=${K26_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo ?)} timeout ${T_BENCH:-50} python3 profiling/bench_serve.py \
  --device cuda --requests 16 --max-tokens 64 --max-model-len 512 --out "$OUT/bench_serve-h200.md" > "$OUT/bench.txt" 2>&1
tail -12 "$OUT/bench.txt"
