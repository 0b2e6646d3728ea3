#!/usr/bin/env bash
# Build everything a GPU run needs into gpu-bin/ (git-ignored; copy it to the GPU machine):
# the conformance suite and the graph test with the cuda feature, the bench, and run.sh,
# which runs them all and leaves logs under $OUT. No cargo exists on the GPU machine.
#   scripts/build-gpu-bin.sh            # sm_90 only (the H200), fast
#   ALLREDUCE_CUDA_ARCHS=sm_80,sm_90,sm_100 scripts/build-gpu-bin.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export ALLREDUCE_CUDA_ARCHS=${ALLREDUCE_CUDA_ARCHS:-sm_90}
# The bench prints the commit it was built from (the GPU machine's checkout is not ours).
export ALLREDUCE_BUILD_GIT="$(git rev-parse HEAD)$(git diff --quiet HEAD -- . || echo -dirty)"
scripts/setup-cuda.sh >/dev/null
mkdir -p gpu-bin
rm -f gpu-bin/*
json=$(mktemp)
cargo test -p allreduce-conformance --features cuda,cudarc --no-run --message-format=json >"$json"
python3 - "$json" <<'PY'
import json, shutil, sys
for line in open(sys.argv[1]):
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("conformance", "cuda_graphs", "cuda_codecs", "cuda_processes", "cuda_fused", "cuda_cudarc", "soak"):
        shutil.copy2(m["executable"], "gpu-bin/" + m["target"]["name"])
PY
rm -f "$json"
# With the peers fetched (scripts/peers/fetch.sh), the bench times them too (--peers).
if [ -f .peers/VERSIONS ]; then bench_features=peers; else bench_features=cuda; fi
cargo build --release -p allreduce-bench --features "$bench_features"
cp "${CARGO_TARGET_DIR:-target}/release/allreduce-bench" gpu-bin/
strip gpu-bin/soak gpu-bin/cuda_cudarc gpu-bin/conformance gpu-bin/cuda_graphs gpu-bin/cuda_codecs gpu-bin/cuda_processes gpu-bin/cuda_fused gpu-bin/allreduce-bench
cat >gpu-bin/run.sh <<'RUN'
#!/usr/bin/env bash
# On the GPU machine: OUT=$OUT gpu-bin/run.sh (logs under $OUT).
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCCL_LIB=$(python3 -c "import nvidia.nccl, os; print(os.path.join(os.path.dirname(nvidia.nccl.__file__), 'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=${NCCL_LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
C="$OUT/conformance.log"; T="$OUT/tests.log"; Q="$OUT/bench_quantized.txt"; B="$OUT/bench_exact.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$C" 2>&1
timeout 400 ./conformance "[cuda" >>"$C" 2>&1; echo "conformance rc=$?" >>"$C"
timeout 60 ./cuda_codecs >"$T" 2>&1; echo "codecs rc=$?" >>"$T"
# One process per rank needs MPS on one GPU (else the processes' kernels only time-slice):
# start it for this test only.
# CUDA_DEVICE_MAX_CONNECTIONS=1 for the daemon and every client: with the default, the MPS
# server gave only 3 clients a context (README).
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog CUDA_DEVICE_MAX_CONNECTIONS=1
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d
# The scenarios in order; the SIGKILL one last (a fault it provoked could take the other
# MPS clients down with it).
timeout 300 ./cuda_processes >>"$T" 2>&1; echo "processes rc=$?" >>"$T"
echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_DEVICE_MAX_CONNECTIONS
timeout 200 ./cuda_graphs >>"$T" 2>&1; echo "graphs rc=$?" >>"$T"
timeout 300 ./soak "[cuda" >>"$T" 2>&1; echo "soak rc=$?" >>"$T"
timeout 300 ./cuda_fused >>"$T" 2>&1; echo "fused rc=$?" >>"$T"
for r in 2 4 8; do
  timeout 120 ./allreduce-bench --backend cuda --fused --ranks $r -d bf16 --tokens 1,8,32,64,128,512 \
    --fused-hidden 4096,8192 --timeout 5 >>"$OUT/bench_fused.txt" 2>&1; echo "fused bench $r rc=$?" >>"$OUT/bench_fused.txt"
done
for r in 2 4 8; do
  timeout 120 ./allreduce-bench --backend cuda --ranks $r -b 64K -e 64M -f 4 --strategy twoshot,quantized \
    --precision exact,fp8,q8,q6,q4,q8a,q6a,q4a,q8v2,q6v2,q4v2,fp4 -d bf16 --data gauss --row-time 0.05 >>"$Q" 2>&1; echo "quantized $r rc=$?" >>"$Q"
done
timeout 120 ./allreduce-bench --backend cuda --ranks 1 -b 64K -e 64K --strategy quantized --precision q8 -d bf16 \
  --row-time 0.01 --codec-bench 256M >"$OUT/codec_bench.txt" 2>&1; echo "codec bench rc=$?" >>"$OUT/codec_bench.txt"
for r in 2 4 8; do
  timeout 90 ./allreduce-bench --backend cuda --ranks $r -b 8 -e 16M -f 4 --strategy oneshot,twoshot -d bf16 \
    --row-time 0.03 --tune "$OUT/tuned_virtual_ranks.json" >>"$B" 2>&1; echo "tune $r rc=$?" >>"$B"
done
timeout 60 ./allreduce-bench --backend cuda --ranks 1 -b 8 -e 4M -f 4 --strategy oneshot,vendor -d bf16 \
  --row-time 0.03 >>"$B" 2>&1; echo "nccl 1 rc=$?" >>"$B"
# Ours against the peers' kernels (only in a build with the peers: scripts/peers/fetch.sh).
[ -x ./versus.sh ] && BENCH=./allreduce-bench OUT="$OUT" ./versus.sh
tail -14 "$C"; grep -E "rc=|FAIL|mismatch|panick" "$T" | head; tail -12 "$OUT/codec_bench.txt"; grep rc= "$Q" "$B"
RUN
chmod +x gpu-bin/run.sh
[ "$bench_features" = peers ] && cp scripts/peers/versus.sh gpu-bin/
du -sh gpu-bin
