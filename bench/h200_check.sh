#!/usr/bin/env bash
# One device session's GPU checks (README "GPU tests"), in parts that each fit one device call:
#   bench/h200_check.sh build     build the H200 pipeline with its GPU levels, run and bench it
#   bench/h200_check.sh compare   bench/pipeline.py: bundles against host letterbox + ONNX Runtime CUDA + torchvision
#   bench/h200_check.sh tests     every gpu-marked test
#   bench/h200_check.sh postprocess  bench/postprocess.py with the H200 spec's kernel settings, fp32 and fp16 head maps,
#                                 and the fused decode + NMS (yolov8_decode mode nms) beside them
#   bench/h200_check.sh floors    bench/nms_floors.py: where the decode + nms pair's graph time goes (issue 17)
#   bench/h200_check.sh t4        validate and run a T4 bundle built on a CPU box ($T4_BUNDLE)
#   bench/h200_check.sh triton    the H200 bundle served by Triton (KIND_GPU) under load, next to `deepjit bench`
#                                 of it, and the gpu-marked Triton test; needs the wheels bench/triton_wheels.sh
#                                 fetches, copied into /tmp/whl_triton by the calls it prints
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
      --large-batch-lanes 2 --anchors-per-thread 1 --nms-block 512 --nms-chunk 512 --nms-cluster 8 \
      --nms-large-batch-cluster 2 --fused --fused-block 1024 --fused-chunk 512 --json "$OUT/postprocess.json" 2>&1 \
      | tee "$OUT/postprocess.txt" ;;
  floors)
    echo "== bench/nms_floors.py" && python3 bench/nms_floors.py --batches 1 8 32 2>&1 | tee "$OUT/nms_floors.txt" ;;
  t4)
    echo "== validate T4 bundle (PTX)" && dj validate "$T4_BUNDLE" 2>&1 | tail -12
    echo "== run T4 bundle" && dj run "$T4_BUNDLE" --input /tmp/images_b2.npy 2>&1 | tail -8 ;;
  triton)
    # Client side (tritonserver, tritonclient and what it needs) in /tmp/site_triton, ahead of /tmp/site.
    # The models' Python environment (EXECUTION_ENV_PATH) is a venv of its own, /tmp/triton_env: numpy 1.x
    # in it (Triton's Python backend passes tensors wrongly with numpy 2, this machine's) and an ml_dtypes
    # built for it (onnx imports ml_dtypes; this machine's needs numpy 2), then, by a .pth
    # file, what this process sees: the carried wheels, this checkout, the machine's packages.
    ls /tmp/whl_triton/nvidia_pytriton-*.whl /tmp/whl_triton/numpy-1.*.whl >/dev/null || {
      echo "no /tmp/whl_triton: make the calls bench/triton_wheels.sh prints first" >&2; exit 2; }
    if [ ! -e /tmp/site_triton/.deepjit-ready ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_triton \
        $(ls /tmp/whl_triton/*.whl | grep -v -E '/(numpy|ml_dtypes)-') && touch /tmp/site_triton/.deepjit-ready || exit 1
    fi
    export PYTHONPATH=/tmp/site_triton:$PYTHONPATH
    env=/tmp/triton_env
    if [ ! -e $env/.deepjit-ready ]; then
      python3 -m venv --without-pip $env || exit 1
      sp=$($env/bin/python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$sp" /tmp/whl_triton/numpy-1.*.whl \
        /tmp/whl_triton/ml_dtypes-*.whl || exit 1
      { echo /tmp/site; echo "$PWD"; python3 -c 'import site; print("\n".join(site.getsitepackages()))'; } > "$sp/deepjit_paths.pth"
      touch $env/.deepjit-ready
    fi
    $env/bin/python3 -c "import numpy, onnxruntime, deepjit_compiler.serve.triton_model, deepjit_compiler.runtime.gpu as g; print('serving env: numpy', numpy.__version__, 'onnxruntime', onnxruntime.__version__, onnxruntime.get_available_providers(), 'GPU', g.available())" \
      | tee -a "$OUT/gpu.txt" || exit 1
    python3 -c "import sysconfig, glob; d = sysconfig.get_config_var('LIBDIR'); print('libpython for the stub:', glob.glob(d + '/libpython3*.so*') or 'none in ' + d)"
    bundle=${TRITON_BUNDLE:-build/yolov8s_h200}; kind=${TRITON_KIND:-gpu}   # (the two: to try this part on a CPU box)
    if [ ! -d "$bundle" ]; then
      echo "== build H200" && dj build pipelines/yolov8_h200.yaml --no-publish >"$OUT/build_h200.txt" 2>"$OUT/build_h200.log"
      [ -d "$bundle" ] || bundle=build/rejected/yolov8s_h200
    fi
    echo "== bench H200 (deepjit bench, in process)" && dj bench "$bundle" --batch 1,8 --iters 200 2>&1 | tee "$OUT/bench_h200_triton.txt" | grep -v INFO
    for b in ${TRITON_BATCHES:-1 8}; do
      echo "== Triton KIND_${kind^^}, requests of batch $b" && python3 bench/triton_load.py "$bundle" --kind "$kind" --env $env \
        --batch $b --clients "${CLIENTS:-8}" --requests "${REQUESTS:-800}" --queue-delay-us "${QUEUE_US:-500}" \
        --append "$OUT/triton_results.md" --log "$OUT/tritonserver.log"   # (at most 8 files come back from $OUT)
    done
    echo "== gpu-marked Triton test" && DEEPJIT_TRITON_ENV=$env python3 -m pytest -m gpu -q -ra -p no:cacheprovider \
      tests/serve 2>&1 | tee "$OUT/pytest_triton_gpu.txt" | tail -15 ;;
  *) echo "unknown part $part: build, compare, tests, postprocess, floors, t4, triton" >&2; exit 2 ;;
  esac
done
