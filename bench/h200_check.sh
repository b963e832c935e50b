#!/usr/bin/env bash
# One device session's worth of GPU checks, in one call (see README "GPU tests"). Writes logs to $OUT.
#   build the H200 pipeline on the GPU (kernels + end_to_end levels run), run and bench it;
#   validate and run a T4 bundle built on a CPU box (its sm_75 PTX is JIT-compiled here);
#   run every gpu-marked test.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
dj() { python3 -m deepjit_compiler.cli "$@"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 - <<'PY'
import numpy as np
np.save("/tmp/images_b2.npy", np.random.default_rng(7).uniform(0, 1, (2, 3, 640, 640)).astype(np.float32))
PY
echo "== build H200" && dj build pipelines/yolov8_h200.yaml --no-publish 2>"$OUT/build_h200.log" | tee "$OUT/build_h200.txt"
echo "build rc=${PIPESTATUS[0]}"
echo "== run H200" && dj run build/yolov8s_h200 --input /tmp/images_b2.npy --out "$OUT/dets.json" 2>&1 | tail -15
echo "== bench H200" && dj bench build/yolov8s_h200 --batch 1,8 --iters 50 2>&1 | tee "$OUT/bench_h200.txt" | tail -20
echo "== bench H200 no graph" && dj bench build/yolov8s_h200 --batch 1,8 --iters 50 --no-graph 2>&1 | tail -12
if [ -d "${T4_BUNDLE:-}" ]; then
  echo "== validate T4 bundle (PTX)" && dj validate "$T4_BUNDLE" 2>&1 | tail -12
  echo "== run T4 bundle" && dj run "$T4_BUNDLE" --input /tmp/images_b2.npy 2>&1 | tail -8
fi
echo "== gpu tests" && python3 -m pytest -m gpu -q -ra tests 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -25
