#!/usr/bin/env bash
# Build another commit's bench and fused test (an experiment branch, say) into a folder beside
# gpu-bin, for scripts/fused-sweep.sh's EXTRA:
#   scripts/build-variant.sh exp/fused-one-block-per-sm gpu-bin-lb1
# then copy gpu-bin, gpu-bin-lb1 and scripts to the GPU machine, and run EXTRA=gpu-bin-lb1 scripts/fused-sweep.sh.
# Builds in a git worktree under target/variants (its own target dir), sm_90 only unless
# ALLREDUCE_CUDA_ARCHS says otherwise, with this checkout's pinned nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$1 out=$2
root=$PWD
scripts/setup-cuda.sh >/dev/null
export NVCC="$root/.venv-cuda/lib/python3.11/site-packages/nvidia/cu13/bin/nvcc"
[ -x "$NVCC" ] || NVCC=$(ls "$root"/.venv-cuda/lib/python3*/site-packages/nvidia/cu13/bin/nvcc | head -1)
export ALLREDUCE_CUDA_ARCHS=${ALLREDUCE_CUDA_ARCHS:-sm_90}
export ALLREDUCE_BUILD_GIT="$(git rev-parse "$rev")"
wt="$root/target/variants/$(echo "$rev" | tr '/' '_')"
rm -rf "$wt"; git worktree prune
git worktree add --detach "$wt" "$rev" >/dev/null
mkdir -p "$out"; rm -f "$out"/*
(
  cd "$wt"
  cargo build --release -p allreduce-bench --features cuda
  cp target/release/allreduce-bench "$root/$out/"
  cargo test -p allreduce-conformance --features cuda --test cuda_fused --no-run --message-format=json \
    | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_fused":
        shutil.copy2(m["executable"], sys.argv[1] + "/cuda_fused")
' "$root/$out"
)
strip "$out"/allreduce-bench "$out"/cuda_fused
git worktree remove --force "$wt"
du -sh "$out"
