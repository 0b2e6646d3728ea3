#!/usr/bin/env bash
# On the GPU machine, with a bench built with the peers (scripts/peers/fetch.sh, then
# scripts/build-gpu-bin.sh): the "versus peers" tables of docs/benchmarks.md at 2, 4 and 8
# virtual ranks, logs under $OUT.
#   BENCH=gpu-bin/allreduce-bench OUT=/tmp/out scripts/peers/versus.sh [exact] [fused]
# exact: ours against vLLM's custom all-reduce, FlashInfer's PCIe IPC all-reduce and SGLang's
# custom all-reduce v2 (its choice and its four kernels), 16 B to 64 MiB, bf16, eager and graphs.
# fused: ours against TensorRT-LLM's all-reduce fusion, tokens 1-2048 x hidden 2048-8192 (the
# shapes the peers test), + residual + RMSNorm, and + FP8 (per-token and static scale).
set -uo pipefail
BENCH=${BENCH:-$(dirname "$0")/../../gpu-bin/allreduce-bench}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${*:-exact fused}
for w in $what; do
  for r in 2 4 8; do
    case $w in
      exact)
        timeout 360 "$BENCH" --backend cuda --peers --ranks $r -b 16 -e 64M -f 4 -d bf16 --timeout 10 \
          >>"$OUT/peers_exact.txt" 2>&1; echo "peers exact $r rc=$?" >>"$OUT/peers_exact.txt" ;;
      fused)
        for p in residual_rmsnorm residual_rmsnorm_fp8 residual_rmsnorm_fp8_static; do
          timeout 150 "$BENCH" --backend cuda --peers --fused --fused-pattern $p --ranks $r -d bf16 \
            --tokens 1,8,32,128,512,2048 --fused-hidden 2048,4096,7168,8192 --timeout 10 \
            >>"$OUT/peers_fused.txt" 2>&1; echo "peers fused $p $r rc=$?" >>"$OUT/peers_fused.txt"
        done ;;
      *) echo "unknown table $w (exact, fused)"; exit 2 ;;
    esac
  done
done
