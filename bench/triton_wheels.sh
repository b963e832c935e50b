#!/bin/bash
# Fetch here the wheels `bench/h200_check.sh triton` installs on the H200 machine (Python 3.12, x86-64, no
# network), in two git-ignored folders that each travel in a device call of their own (64 MiB a call):
#   .whl_triton/       nvidia-pytriton (its tritonserver and Python-backend stubs, ~55 MB) and tritonclient
#   .whl_triton_deps/  numpy 1.x and an ml_dtypes built for it (the serving environment's: Triton's Python
#                      backend needs numpy < 2, and that machine has numpy 2), python-rapidjson, and the grpcio
#                      and protobuf tritonclient needs
# Usage, from the project root:  bash bench/triton_wheels.sh
# It prints the device calls that copy each folder into /tmp on the machine (where it stays while the
# machine stays warm); h200_check.sh's triton part installs from there.
set -euo pipefail
get() {  # folder, packages...
  local dest=$1; shift
  mkdir -p "$dest"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "$@"
}
get .whl_triton "nvidia-pytriton==0.7.0" "tritonclient==2.73.0"
get .whl_triton_deps "numpy==1.26.4" "ml_dtypes==0.5.4" "python-rapidjson" "grpcio>=1.81.1" "protobuf>=6.30,<7"
for d in .whl_triton .whl_triton_deps; do   # both git-ignored (.gitignore)
  echo "$d: $(du -sh "$d" | cut -f1)"; ls -1 "$d" | sed 's/^/  /'
done
cat <<'EOF'
device calls, back to back (the machine keeps /tmp only while it stays warm):
  run  carry=[".whl_triton"]       command: mkdir -p /tmp/whl_triton && cp .whl_triton/*.whl /tmp/whl_triton/ && ls -l /tmp/whl_triton
  run  carry=[".whl_triton_deps"]  command: mkdir -p /tmp/whl_triton && cp .whl_triton_deps/*.whl /tmp/whl_triton/ && ls -l /tmp/whl_triton
  run  carry=[".whl"]              command: bash bench/h200_check.sh triton
EOF
