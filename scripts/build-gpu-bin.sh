#!/usr/bin/env bash
# Build everything the H200 run needs into gpu-bin/ (git-ignored; carry it to the device):
# the conformance suite and the graph test with the cuda feature, the bench, and run.sh,
# which runs them all and leaves logs under $OUT. No cargo exists on the GPU machine.
#   scripts/build-gpu-bin.sh            # sm_90 only (the H200), fast
#   ALLREDUCE_CUDA_ARCHS=sm_80,sm_90,sm_100 scripts/build-gpu-bin.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export ALLREDUCE_CUDA_ARCHS=${ALLREDUCE_CUDA_ARCHS:-sm_90}
scripts/setup-cuda.sh >/dev/null
mkdir -p gpu-bin
rm -f gpu-bin/*
json=$(mktemp)
cargo test -p allreduce-conformance --features cuda --no-run --message-format=json >"$json"
python3 - "$json" <<'PY'
import json, shutil, sys
for line in open(sys.argv[1]):
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("conformance", "cuda_graphs"):
        shutil.copy2(m["executable"], "gpu-bin/" + m["target"]["name"])
PY
rm -f "$json"
cargo build --release -p allreduce-bench --features cuda
cp target/release/allreduce-bench gpu-bin/
strip gpu-bin/conformance gpu-bin/cuda_graphs gpu-bin/allreduce-bench
cat >gpu-bin/run.sh <<'RUN'
#!/usr/bin/env bash
# On the GPU machine: OUT=$OUT gpu-bin/run.sh (at most 8 log files come back).
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCCL_LIB=$(python3 -c "import nvidia.nccl, os; print(os.path.join(os.path.dirname(nvidia.nccl.__file__), 'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=${NCCL_LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
timeout 300 ./conformance "[cuda" >"$OUT/conformance.log" 2>&1; echo "conformance rc=$?" >>"$OUT/conformance.log"
timeout 120 ./cuda_graphs >"$OUT/graphs.log" 2>&1; echo "graphs rc=$?" >>"$OUT/graphs.log"
for r in 2 4 8; do
  timeout 90 ./allreduce-bench --backend cuda --ranks $r -b 8 -e 4M -f 4 --strategy oneshot,twoshot -d bf16 \
    --baselines --row-time 0.05 >"$OUT/bench_r$r.txt" 2>&1; echo "bench $r rc=$?" >>"$OUT/bench_r$r.txt"
done
timeout 60 ./allreduce-bench --backend cuda --ranks 1 -b 8 -e 4M -f 4 --strategy oneshot,vendor -d bf16 \
  --row-time 0.05 >"$OUT/bench_r1_nccl.txt" 2>&1; echo "bench 1 rc=$?" >>"$OUT/bench_r1_nccl.txt"
tail -12 "$OUT/conformance.log"; tail -3 "$OUT/graphs.log"; tail -2 "$OUT"/bench_r*.txt
RUN
chmod +x gpu-bin/run.sh
du -sh gpu-bin
