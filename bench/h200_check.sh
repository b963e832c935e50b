#!/usr/bin/env bash
# One device session's GPU checks (README "GPU tests"), in parts that each fit one device call:
#   bench/h200_check.sh build     build the H200 pipeline with its GPU levels, run and bench it
#   bench/h200_check.sh compare   bench/pipeline.py: bundles against host letterbox + ONNX Runtime CUDA + torchvision
#   bench/h200_check.sh tests     every gpu-marked test
#   bench/h200_check.sh postprocess  bench/postprocess.py with the H200 spec's kernel settings, fp32 and fp16 head maps
#   bench/h200_check.sh t4        validate and run a T4 bundle built on a CPU box ($T4_BUNDLE)
# Several parts in one call: bench/h200_check.sh build compare. Logs go to $OUT.
# Wheels: carry .whl (../shared/device/prepare-wheels.sh; nudenet 3.4.2 for the real-data tests). With
# onnxruntime-gpu's parts in /tmp/carry (../shared/device/split-wheel.sh) it is installed too, and the
# engine runs on ONNX Runtime's CUDA provider; without it, on the CPU.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
dj() { python3 -m deepjit_compiler.cli "$@"; }

if [ ! -e /tmp/site/.deepjit-ready ]; then
  wheels=(.whl/*.whl)
  ortgpu=$(ls /tmp/carry/part.* >/dev/null 2>&1 && echo /tmp/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl)
  [ -n "$ortgpu" ] && cat /tmp/carry/part.* > "$ortgpu" && wheels+=("$ortgpu")
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${wheels[@]}" \
    && touch /tmp/site/.deepjit-ready
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())" | tee -a "$OUT/gpu.txt"

parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(build tests)
for part in "${parts[@]}"; do
  case $part in
  build)
    python3 -c "import numpy as np; np.save('/tmp/images_b2.npy', np.random.default_rng(7).uniform(0, 1, (2, 3, 640, 640)).astype(np.float32))"
    echo "== build H200" && dj build pipelines/yolov8_h200.yaml --no-publish 2>"$OUT/build_h200.log" | tee "$OUT/build_h200.txt"
    echo "build rc=${PIPESTATUS[0]}"; grep -iE "capture|cannot|error|warn" "$OUT/build_h200.log" | head -10
    bundle=build/yolov8s_h200; [ -d "$bundle" ] || bundle=build/rejected/yolov8s_h200
    echo "== run H200" && dj run "$bundle" --input /tmp/images_b2.npy --out "$OUT/dets.json" 2>&1 | tail -6
    echo "== bench H200" && dj bench "$bundle" --batch 1,8 --iters 50 2>&1 | tee "$OUT/bench_h200.txt" | grep -v INFO
    echo "== bench H200 no graph" && dj bench "$bundle" --batch 1,8 --iters 50 --no-graph 2>&1 | grep -v INFO
    echo "== bench H200 on the CPU" && dj bench "$bundle" --batch 1 --iters 3 --warmup 1 --device cpu 2>&1 | grep -v INFO ;;
  compare)
    echo "== bench/pipeline.py" && python3 bench/pipeline.py /tmp/cmp --iters "${ITERS:-30}" --json "$OUT/pipeline.json" \
      2>"$OUT/pipeline.log" | tee "$OUT/pipeline.txt"; tail -5 "$OUT/pipeline.log" ;;
  tests)
    echo "== gpu tests" && python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -40 ;;
  postprocess)
    echo "== bench/postprocess.py" && python3 bench/postprocess.py --batches 1 8 32 --iters 200 --lanes-per-anchor 4 \
      --anchors-per-thread 1 --nms-block 1024 --nms-chunk 512 --json "$OUT/postprocess.json" 2>&1 | tee "$OUT/postprocess.txt" ;;
  t4)
    echo "== validate T4 bundle (PTX)" && dj validate "$T4_BUNDLE" 2>&1 | tail -12
    echo "== run T4 bundle" && dj run "$T4_BUNDLE" --input /tmp/images_b2.npy 2>&1 | tail -8 ;;
  *) echo "unknown part $part: build, compare, tests, postprocess, t4" >&2; exit 2 ;;
  esac
done
