#!/usr/bin/env bash
# Two or more builds of the bench side by side on one GPU, interleaved, so that a change that
# should not move speed is shown not to: the 30 fused target rows (fused / unfused at 1-128
# tokens x hidden 4096/8192 x 2/4/8 virtual ranks) and the codec kernels' fraction of the copy
# roofline. Each build is a folder holding an allreduce-bench (scripts/build-gpu-bin.sh makes
# gpu-bin; copy an older build's bench into gpu-bin-<x>). On the GPU machine:
#   BUILDS="gpu-bin-base gpu-bin" OUT=$OUT scripts/compare-builds.sh
# Writes $OUT/compare_fused.log ("== rep=N R=ranks cfg=FOLDER" before each run, the format
# scripts/fused-table.py reads) and $OUT/compare_codecs.log ("== rep=N cfg=FOLDER" before each
# --codec-bench run). REPS (3) repetitions; about 1 minute each on an H100.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
F=$OUT/compare_fused.log C=$OUT/compare_codecs.log
for rep in $(seq 1 "${REPS:-3}"); do
  for b in ${BUILDS:-gpu-bin-base gpu-bin}; do
    for r in 2 4 8; do
      echo "== rep=$rep R=$r cfg=$(basename "$b")" >>"$F"
      timeout 120 "$b"/allreduce-bench --backend cuda --fused --ranks $r -d bf16 --tokens 1,8,32,64,128 \
        --fused-hidden 4096,8192 --timeout 5 >>"$F" 2>&1
      echo "rc=$?" >>"$F"
    done
    echo "== rep=$rep cfg=$(basename "$b")" >>"$C"
    timeout 120 "$b"/allreduce-bench --backend cuda --ranks 1 -b 64K -e 64K --strategy quantized --precision q8 \
      -d bf16 --row-time 0.01 --codec-bench 256M >>"$C" 2>&1
    echo "rc=$?" >>"$C"
  done
done
