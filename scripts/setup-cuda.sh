#!/usr/bin/env bash
# Installs a pinned CUDA 13.0 nvcc from NVIDIA's pip wheels into .venv-cuda at the workspace
# root, where build-support's find_nvcc looks for it. No GPU or system toolkit needed.
#
# Every wheel is pinned to the same release: mixing versions breaks (nvvm 13.5 emits PTX that
# ptxas 13.0 rejects), and 13.0 is what the H200 machine's driver (580) runs, so the SASS we
# embed was built by the same toolkit release as the driver's. No cccl: the kernels use raw
# PTX atomics instead of <cuda/atomic>.
#
# Idempotent: an existing venv that already has these exact versions is left alone.
# Prints the NVCC=... line to export (optional: find_nvcc finds .venv-cuda by itself).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-cuda
PY=${PYTHON:-python3}
PINS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.88
)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi

# `pip install` of already-satisfied pins is a no-op, but it still asks the index; skip it
# when every pin is present so an offline re-run works.
missing=0
for pin in "${PINS[@]}"; do
  name=${pin%%==*}
  want=${pin##*==}
  have=$("$VENV/bin/python" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
  [ "$have" = "$want" ] || missing=1
done
if [ "$missing" = 1 ]; then
  "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet "${PINS[@]}"
fi

NVCC=$(ls -d "$PWD/$VENV"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc 2>/dev/null | head -n1 || true)
if [ -z "$NVCC" ] || [ ! -x "$NVCC" ]; then
  echo "setup-cuda.sh: nvcc not found under $VENV after installing ${PINS[*]}" >&2
  exit 1
fi
"$NVCC" --version | tail -n 2 >&2
echo "NVCC=$NVCC"
