#!/usr/bin/env bash
# Downloads the peers' published all-reduce code, pinned, into .peers/ (git-ignored), for the
# bench's `peers` feature (crates/peers): nothing of it is copied into the repository.
#   - flashinfer-python 0.7.2.post1: a pure-Python wheel that ships vLLM's custom all-reduce
#     (flashinfer/comm/vllm_custom_all_reduce.cuh, from vLLM v0.8.2's csrc),
#     TensorRT-LLM's all-reduce fusion headers and FlashInfer's own PCIe IPC all-reduce
#     (flashinfer/comm/pcie_ipc_all_reduce.cuh); Apache-2.0; and the spdlog headers they
#     include (MIT).
#   - sglang 0.5.23: SGLang's JIT kernel sources (sglang/kernels/jit/csrc/distributed: its
#     custom all-reduce v2 and all-reduce fusion kernels; sglang/kernels/jit/include: the
#     sgl_kernel headers they include) and the dispatch table they are tuned with
#     (sglang/srt/distributed/device_communicators/configs/custom_all_reduce_v2.py);
#     Apache-2.0.
#   - apache-tvm-ffi 0.1.11 (the version sglang 0.5.23 pins): the TVM-FFI and DLPack headers
#     the sgl_kernel headers include; Apache-2.0.
#   - nvidia-cuda-cccl 13.0.85: the libcu++ headers (nv/target) that cuda_fp16.h needs in host
#     code, of the same CUDA release as our pinned nvcc (scripts/setup-cuda.sh); Apache-2.0
#     with LLVM exception.
# Idempotent; needs the Python package index. Then build with --features peers.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=.peers
FLASHINFER=flashinfer-python==0.7.2.post1
CCCL=nvidia-cuda-cccl==13.0.85
SGLANG=sglang==0.5.23
TVMFFI=apache-tvm-ffi==0.1.11
PINS="$FLASHINFER $CCCL $SGLANG $TVMFFI"
if [ -f "$DIR/VERSIONS" ] && grep -qx "$PINS" "$DIR/VERSIONS" && [ -d "$DIR/spdlog" ]; then
  echo "peers already fetched: $(cat "$DIR/VERSIONS")"
  exit 0
fi
rm -rf "$DIR" && mkdir -p "$DIR/wheels"
# SGLang and TVM-FFI publish CPython wheels only: ask for one whatever python3 is here (the
# headers and sources taken from them are the same in every one).
python3 -m pip download --disable-pip-version-check --quiet --no-deps -d "$DIR/wheels" "$FLASHINFER" "$CCCL"
python3 -m pip download --disable-pip-version-check --quiet --no-deps --only-binary=:all: \
  --python-version 3.11 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 -d "$DIR/wheels" "$SGLANG" "$TVMFFI"
python3 - "$DIR" <<'PY'
import glob, os, sys, zipfile
root = sys.argv[1]
def extract(pattern, prefix, dest):
    (whl,) = glob.glob(os.path.join(root, "wheels", pattern))
    with zipfile.ZipFile(whl) as z:
        names = [n for n in z.namelist() if n.startswith(prefix) and not n.endswith("/")]
        if not names:
            sys.exit(f"{whl}: nothing under {prefix}")
        for n in names:
            out = os.path.join(root, dest, n[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(n) as src, open(out, "wb") as dst:
                dst.write(src.read())
extract("flashinfer_python-*.whl", "flashinfer/data/include/", "include")
# FlashInfer's logging header (included by the TensorRT-LLM fusion header) needs spdlog, which
# the same wheel ships (MIT).
extract("flashinfer_python-*.whl", "flashinfer/data/spdlog/include/", "spdlog")
extract("nvidia_cuda_cccl-*.whl", "nvidia/cu13/include/", "cccl")
extract("sglang-*.whl", "sglang/kernels/jit/include/", "sglang/include")
extract("sglang-*.whl", "sglang/kernels/jit/csrc/distributed/", "sglang/csrc/distributed")
extract("sglang-*.whl", "sglang/srt/distributed/device_communicators/configs/", "sglang/configs")
extract("apache_tvm_ffi-*.whl", "tvm_ffi/include/", "tvm-ffi")
PY
rm -rf "$DIR/wheels"
echo "$PINS" >"$DIR/VERSIONS"
echo "peers fetched into $DIR: $(cat "$DIR/VERSIONS")"
