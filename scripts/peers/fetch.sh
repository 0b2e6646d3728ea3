#!/usr/bin/env bash
# Downloads the peers' published all-reduce code, pinned, into .peers/ (git-ignored), for the
# bench's `peers` feature (crates/peers): nothing of it is copied into the repository.
#   - flashinfer-python 0.7.2.post1: a pure-Python wheel that ships vLLM's custom all-reduce
#     (flashinfer/comm/vllm_custom_all_reduce.cuh, from vLLM v0.8.2's csrc),
#     TensorRT-LLM's all-reduce fusion headers and FlashInfer's own PCIe IPC all-reduce
#     (flashinfer/comm/pcie_ipc_all_reduce.cuh); Apache-2.0; and the spdlog headers they
#     include (MIT).
#   - nvidia-cuda-cccl 13.0.85: the libcu++ headers (nv/target) that cuda_fp16.h needs in host
#     code, of the same CUDA release as our pinned nvcc (scripts/setup-cuda.sh); Apache-2.0
#     with LLVM exception.
# Idempotent; needs the Python package index. Then build with --features peers.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=.peers
FLASHINFER=flashinfer-python==0.7.2.post1
CCCL=nvidia-cuda-cccl==13.0.85
if [ -f "$DIR/VERSIONS" ] && grep -qx "$FLASHINFER $CCCL" "$DIR/VERSIONS" && [ -d "$DIR/spdlog" ]; then
  echo "peers already fetched: $(cat "$DIR/VERSIONS")"
  exit 0
fi
rm -rf "$DIR" && mkdir -p "$DIR/wheels"
python3 -m pip download --disable-pip-version-check --quiet --no-deps -d "$DIR/wheels" "$FLASHINFER" "$CCCL"
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
PY
rm -rf "$DIR/wheels"
echo "$FLASHINFER $CCCL" >"$DIR/VERSIONS"
echo "peers fetched into $DIR: $(cat "$DIR/VERSIONS")"
