#!/usr/bin/env bash
# The multi-GPU measurement, for a machine with N >= 2 GPUs (2, 4 or 8 H100s or H200s):
# everything comes from gpu-bin/ (scripts/build-gpu-bin.sh here; copy gpu-bin and scripts to
# the GPU machine), logs under $OUT.
#   OUT=$OUT scripts/multi-gpu.sh            # on the GPU machine
# NVLink SHARP (multicast) stays off: NCCL_NVLS_ENABLE=0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=gpu-bin
N=$(nvidia-smi -L | wc -l)
DEVS=$(seq -s, 0 $((N - 1)))
export NCCL_NVLS_ENABLE=0
NCCL_LIB=$(python3 -c "import nvidia.nccl, os; print(os.path.join(os.path.dirname(nvidia.nccl.__file__), 'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=${NCCL_LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{ nvidia-smi -L; nvidia-smi topo -m; } >"$OUT/machine.txt" 2>&1

# 1. Conformance on distinct GPUs: in-process, then one process per GPU.
ALLREDUCE_TEST_DEVICES=$DEVS timeout 600 $B/conformance "[cuda" >"$OUT/conformance.log" 2>&1
echo "conformance rc=$?" >>"$OUT/conformance.log"
ALLREDUCE_TEST_DEVICES=$DEVS timeout 300 $B/cuda_processes >>"$OUT/conformance.log" 2>&1
echo "processes rc=$?" >>"$OUT/conformance.log"
ALLREDUCE_TEST_DEVICES=$DEVS timeout 300 $B/cuda_graphs >>"$OUT/conformance.log" 2>&1
echo "graphs rc=$?" >>"$OUT/conformance.log"

# 2. Sweeps 8 B .. 1 GiB, bf16, every strategy and codec, NCCL in the same run; JSON for the
#    tables and an SVG per world size.
for r in 2 4 8; do
  [ "$r" -le "$N" ] || continue
  devs=$(seq -s, 0 $((r - 1)))
  timeout 900 $B/allreduce-bench --backend cuda --ranks $r --devices $devs \
    -b 8 -e 1G -f 2 -d bf16 --strategy oneshot,twoshot,quantized,vendor \
    --precision exact,fp8,q8,q6,q4,q8a,q4a --row-time 0.05 --baselines \
    --tune "$OUT/tuned.json" --plot "$OUT/busbw_r$r.svg" >"$OUT/sweep_r$r.txt" 2>&1
  echo "sweep $r rc=$?" >>"$OUT/sweep_r$r.txt"
done

# 3. PyTorch symmetric memory one-shot / two-shot on the same sizes, as a second peer.
if python3 -c "import torch.distributed._symmetric_memory" 2>/dev/null; then
  timeout 600 torchrun --standalone --nproc-per-node "$N" scripts/torch_symm_mem.py \
    >"$OUT/torch_symm_mem.txt" 2>&1
  echo "torch rc=$?" >>"$OUT/torch_symm_mem.txt"
fi
grep -h "rc=" "$OUT"/*.txt "$OUT"/*.log
