#!/usr/bin/env bash
# Runs a command (a cargo build or test) in the environment candle's `cuda` feature needs,
# with no GPU and no CUDA toolkit installed:
#   scripts/with-candle-cuda.sh cargo build --release -p tp-minilm --features candle-cuda
#
# candle's `cuda` feature compiles its kernels with nvcc (which needs the cccl headers) and
# pins cudarc's `dynamic-linking`, so the binary links against libcuda, cuBLAS, cuRAND, the
# CUDA runtime and NCCL. This installs NVIDIA's pip wheels of one CUDA 13.0 release into
# .venv-candle, links the libraries under their unversioned names in .venv-candle/cuda/lib64
# (cudarc's build looks there through CUDA_PATH), and builds a stub libcuda.so.1 that only
# names the driver's functions: the driver itself comes from the machine the binary runs on.
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-candle
PINS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.88
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.0.0.19
  nvidia-curand==10.4.0.35
  nvidia-nccl-cu13==2.28.9
)
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
stamp="$VENV/pins"
if [ "$(cat "$stamp" 2>/dev/null)" != "${PINS[*]}" ]; then
  "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet "${PINS[@]}"
  echo "${PINS[*]}" >"$stamp"
fi

site=$(ls -d "$PWD/$VENV"/lib/python3*/site-packages/nvidia | head -n1)
lib64="$PWD/$VENV/cuda/lib64"
mkdir -p "$lib64"
for name in cublas cublasLt curand nvrtc cudart; do
  ln -sf "$(ls "$site"/cu13/lib/lib$name.so.* | grep -v -e builtins -e alt | head -n1)" "$lib64/lib$name.so"
done
ln -sf "$site/nccl/lib/libnccl.so.2" "$lib64/libnccl.so"
if [ ! -f "$lib64/libcuda.so" ]; then
  # Every cu* name cuda.h declares (the versioned _v2 names included), as empty functions:
  # enough for the linker to record libcuda.so.1 as needed; nothing here is ever called.
  grep -o '\bcu[A-Z][A-Za-z0-9_]*\b' "$site/cu13/include/cuda.h" | sort -u |
    sed 's/.*/void &(void) {}/' >"$lib64/stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$lib64/libcuda.so" "$lib64/stub.c"
fi

export PATH="$site/cu13/bin:$PATH"
export CUDA_PATH="$PWD/$VENV/cuda"
# candle's kernels are built for one architecture; the default is the H100/H200's.
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
exec "$@"
