#!/usr/bin/env bash
# The fused bench at 8, 4 and 2 virtual ranks on one GPU, with and without PDL, for the
# H100/H200: build with scripts/build-gpu-bin.sh here (and variants, below), copy
# gpu-bin/allreduce-bench, gpu-bin/cuda_fused and each variant's folder to the GPU machine
# (the test binaries other than cuda_fused are not needed), then there
#   [EXTRA="gpu-bin-x gpu-bin-x:--fused-pattern=residual_rmsnorm_fp8_static"] \
#     OUT=$OUT scripts/fused-sweep.sh
# Writes $OUT/sweep.log (lines "== rep=N R=ranks cfg=NAME" before each bench run),
# $OUT/fused_default.log and $OUT/fused_nopdl.log (the fused test list with the defaults and
# without PDL). The benches take about 3 s a run (H100); the two test lists 2-3 minutes each.
# REPS (3), CFGS, TESTS=0 (benches only), BENCH=0 (tests only) choose. Back here:
# scripts/fused-table.py sweep.log (medians per configuration, as a markdown table).
#  - CFGS: "ranks:NAME ...", NAME G<n> (ALLREDUCE_FUSED_BLOCKS=n; at most one block per SM
#    for all ranks together, the default), PDL (the defaults) or NOPDL (ALLREDUCE_FUSED_PDL=0);
#  - eager pace: the bench's last two columns, the host's enqueue time per call (fused,
#    unfused), against the eager times;
#  - other builds: EXTRA="gpu-bin-x ..." (copy them too), each bench with its defaults;
#    "gpu-bin-x:--opt=value" adds bench arguments (no spaces); scripts/build-variant.sh REV
#    gpu-bin-x builds one.
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
  # G<n>: ALLREDUCE_FUSED_BLOCKS=n (at most one block per SM for all ranks together, the
  # default); PDL: the defaults (PDL on); NOPDL: ALLREDUCE_FUSED_PDL=0.
  for cfg in ${CFGS:-8:PDL 8:NOPDL 4:PDL 4:NOPDL 2:PDL 2:NOPDL}; do
    r=${cfg%%:*} c=${cfg#*:}
    echo "== rep=$rep R=$r cfg=$c" >>"$L"
    case $c in
      G*) ALLREDUCE_FUSED_BLOCKS=${c#G} bench "$r" ;;
      PDL) bench "$r" ;;
      NOPDL) ALLREDUCE_FUSED_PDL=0 bench "$r" ;;
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
  rc=$?
  echo "$(basename "$d") cuda_fused quick rc=$rc" >>"$L"
done
# The test list with the defaults (it has its own cases at other grids and without PDL),
# then everything without PDL.
timeout 300 $B/cuda_fused >"$OUT/fused_default.log" 2>&1
echo "cuda_fused rc=$?" >>"$OUT/fused_default.log"
ALLREDUCE_FUSED_PDL=0 timeout 300 $B/cuda_fused >"$OUT/fused_nopdl.log" 2>&1
echo "cuda_fused (no PDL) rc=$?" >>"$OUT/fused_nopdl.log"
tail -n 3 "$OUT/fused_default.log" "$OUT/fused_nopdl.log"; grep -c "^== " "$L"; grep -v "rc=0" "$L" | grep "rc=" | head
