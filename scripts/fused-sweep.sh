#!/usr/bin/env bash
# The fused bench's open questions at 4 and 8 virtual ranks on one GPU (docs/benchmarks.md,
# "Open leads"), for the H200: build with scripts/build-gpu-bin.sh here (and the variants,
# below), carry gpu-bin/allreduce-bench, gpu-bin/cuda_fused and each variant's folder (the
# whole gpu-bin with two variants is over the 64 MiB a call carries), then on the GPU machine
#   EXTRA="gpu-bin-lb1 gpu-bin-fp8 gpu-bin-fp8:--fused-pattern=residual_rmsnorm_fp8_static" \
#     OUT=$OUT scripts/fused-sweep.sh
# Writes $OUT/sweep.log (lines "== rep=N R=ranks cfg=NAME" before each bench run),
# $OUT/fused_default.log and $OUT/fused_wide.log (the fused test list at the default grid
# and at the widest one 8 ranks may take). About 6-9 minutes on the H200 with two variants
# (a call may run 10): REPS=2 or TESTS=0 (benches only) make it shorter. Back
# here: scripts/fused-table.py sweep.log (medians per configuration, as a markdown table).
#  - grid: ALLREDUCE_FUSED_BLOCKS (default: SMs / ranks of a GPU, one block per SM in all;
#    the kernels fit two), eager and graph;
#  - eager pace: the bench's last two columns, the host's enqueue time per call (fused,
#    unfused), against the eager times;
#  - other builds: EXTRA="gpu-bin-x ..." (carry them too), each bench at its default grid;
#    "gpu-bin-x:--opt=value" adds bench arguments (no spaces), e.g.
#    gpu-bin-fp8:--fused-pattern=residual_rmsnorm_fp8_static;
#    scripts/build-variant.sh REV gpu-bin-x builds one. Pending: exp/fused-one-block-per-sm
#    (launch bounds of one block per SM: no register spills in the one-block fused kernels)
#    and feat/fp8-static (the static-scale FP8 pattern: its quick fused test list covers the
#    new pattern, and its bench shows whether the default pattern's kernels moved).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=gpu-bin
NCCL_LIB=$(python3 -c "import nvidia.nccl, os; print(os.path.join(os.path.dirname(nvidia.nccl.__file__), 'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=${NCCL_LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
L=$OUT/sweep.log
bench() { # ranks [more bench arguments]
  local r=$1; shift
  timeout 120 $B/allreduce-bench --backend cuda --fused --ranks "$r" -d bf16 \
    --tokens 1,8,16,32,64,128,256 --fused-hidden 4096,8192 --timeout 5 "$@" >>"$L" 2>&1
  echo "rc=$?" >>"$L"
}
# Other builds (EXTRA="dir ..."; each dir holds an allreduce-bench, e.g. an experiment
# branch's) run at their default grid, as cfg=<dir>.
for rep in $(seq 1 "${REPS:-3}"); do
  [ "${BENCH:-1}" = 1 ] || break
  # G<n>: ALLREDUCE_FUSED_BLOCKS=n; PDL: ALLREDUCE_FUSED_PDL=1 at the default grid.
  for cfg in ${CFGS:-8:G16 8:G24 8:G32 8:PDL 4:G32 4:G48 4:G64 4:PDL}; do
    r=${cfg%%:*} c=${cfg#*:}
    echo "== rep=$rep R=$r cfg=$c" >>"$L"
    case $c in
      G*) ALLREDUCE_FUSED_BLOCKS=${c#G} bench "$r" ;;
      PDL) ALLREDUCE_FUSED_PDL=1 bench "$r" ;;
    esac
  done
  for x in ${EXTRA:-}; do
    d=${x%%:*} more=; [ "$x" != "$d" ] && more=${x#*:}
    for r in 8 4; do
      echo "== rep=$rep R=$r cfg=$(basename "$d")${more:+:$more}" >>"$L"
      B=$d bench "$r" $more
    done
  done
done
# TESTS=0: benches only; BENCH=0: tests only.
[ "${TESTS:-1}" = 1 ] || exit 0
# An extra build's own fused tests, quick list (into the sweep log).
seen=
for x in ${EXTRA:-}; do
  d=${x%%:*}
  case " $seen " in *" $d "*) continue ;; esac
  seen="$seen $d"
  [ -x "$d/cuda_fused" ] || continue
  ALLREDUCE_FUSED_QUICK=1 timeout 200 "$d/cuda_fused" >>"$L" 2>&1
  echo "$(basename "$d") cuda_fused quick rc=$?" >>"$L"
done
# The test list at the default grid (it has its own cases at 12 blocks and at twice the
# default), then everything at 32 blocks (8 ranks: two per SM, the tightest co-residency).
timeout 300 $B/cuda_fused >"$OUT/fused_default.log" 2>&1
echo "cuda_fused rc=$?" >>"$OUT/fused_default.log"
ALLREDUCE_FUSED_BLOCKS=32 timeout 300 $B/cuda_fused >"$OUT/fused_wide.log" 2>&1
echo "cuda_fused (32 blocks) rc=$?" >>"$OUT/fused_wide.log"
ALLREDUCE_FUSED_PDL=1 timeout 300 $B/cuda_fused >"$OUT/fused_pdl.log" 2>&1
echo "cuda_fused (PDL) rc=$?" >>"$OUT/fused_pdl.log"
tail -n 3 "$OUT/fused_default.log" "$OUT/fused_wide.log" "$OUT/fused_pdl.log"; grep -c "^== " "$L"; grep -v "rc=0" "$L" | grep "rc=" | head
