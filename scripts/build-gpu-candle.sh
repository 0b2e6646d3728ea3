#!/usr/bin/env bash
# Build what a GPU run of the candle CUDA path needs into gpu-bin-candle/ (git-ignored): the
# allreduce-candle CUDA test and tp-minilm with its layers on the GPU, packed (xz) beside a
# run.sh that unpacks and runs them, logs under $OUT. Add the model with
#   examples/tp-minilm/setup.sh --f16 gpu-bin-candle/model
# (the f16 copy: what fits beside the binaries in a copy to the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
json=$(mktemp)
scripts/with-candle-cuda.sh cargo test --release -p allreduce-candle --features cuda --no-run \
  --message-format=json >"$json"
scripts/with-candle-cuda.sh cargo build --release -p tp-minilm --features candle-cuda
mkdir -p gpu-bin-candle/bin
rm -f gpu-bin-candle/bin/* gpu-bin-candle/bins.tar.xz
python3 - "$json" <<'PY'
import json, shutil, sys
for line in open(sys.argv[1]):
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        shutil.copy2(m["executable"], "gpu-bin-candle/bin/candle_cuda")
PY
rm -f "$json"
cp "${CARGO_TARGET_DIR:-target}/release/tp-minilm" gpu-bin-candle/bin/
strip gpu-bin-candle/bin/*
# -9e: its large dictionary finds the candle kernels both binaries embed (15 MB at -6, 8 MB).
(cd gpu-bin-candle && tar cf - bin | xz -T0 -9e >bins.tar.xz && rm -rf bin)
cat >gpu-bin-candle/run.sh <<'RUN'
#!/usr/bin/env bash
# On the GPU machine: OUT=$OUT gpu-bin-candle/run.sh
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import tarfile; tarfile.open('bins.tar.xz').extractall('.')"
# The binaries link the CUDA runtime, cuBLAS, cuRAND and NCCL: the toolkit's, or PyTorch's wheels'.
L=/usr/local/cuda/lib64
for d in $(python3 -c "import nvidia, os; [print(os.path.join(p, d, 'lib')) for p in nvidia.__path__ for d in os.listdir(p)]" 2>/dev/null); do
  [ -d "$d" ] && L=$L:$d
done
export LD_LIBRARY_PATH=$L${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
(timeout 150 bin/candle_cuda --nocapture --test-threads=1; echo "candle_cuda rc=$?") >"$OUT/candle_cuda.log" 2>&1
(TP_MINILM_MODEL=model timeout 360 bin/tp-minilm --on gpu; echo "tp-minilm rc=$?") >"$OUT/tp_gpu.md" 2>&1
cat "$OUT/gpu.txt" "$OUT/candle_cuda.log" "$OUT/tp_gpu.md"
# Where a TP size failed, TP 2 (exact and one codec) again with cuBLAS given no workspace:
# its split-K / stream-K kernels, whose blocks wait for each other, need one, and beside a
# peer's spinning all-reduce not all their blocks may fit. (The hardware queues are already
# 32: the library sets CUDA_DEVICE_MAX_CONNECTIONS before CUDA starts.)
if grep -q "failed:" "$OUT/tp_gpu.md"; then
  (echo "== CUBLAS_WORKSPACE_CONFIG=:0:0"
    CUBLAS_WORKSPACE_CONFIG=:0:0 TP_MINILM_MODEL=model timeout 60 bin/tp-minilm --on gpu --tp 2 \
      --codecs q8) >"$OUT/tp_gpu_settings.md" 2>&1
  cat "$OUT/tp_gpu_settings.md"
fi
RUN
chmod +x gpu-bin-candle/run.sh
du -sh gpu-bin-candle
