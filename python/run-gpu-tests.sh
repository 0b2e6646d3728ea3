#!/usr/bin/env bash
# The Python package's GPU tests (python/tests/test_cuda.py: virtual ranks, a CUDA graph of the
# torch ops, 2/4/8 processes on one GPU, the tp_linear example with --device cuda), on a
# machine with an NVIDIA GPU and a python3 that has torch (and pytest; without it the file's
# own runner is used), no network needed:
#
#   ALLREDUCE_LIB=target/release/liballreduce_c.so python/run-gpu-tests.sh [pytest args]
#
# ALLREDUCE_LIB: a library built with `cargo build --release -p allreduce-capi --features
# cuda` (default: target/release/liballreduce_c.so). Starts the MPS daemon (several processes
# on one GPU need it) and stops it on exit, installs the package from ./python into a
# temporary folder (pip --no-deps --no-build-isolation; the source tree if that fails), and
# writes its logs under $OUT (default python/gpu-test-logs).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

out="${OUT:-$root/python/gpu-test-logs}"
mkdir -p "$out"
log="$out/gpu-tests.log"
: >"$log"
say() { echo "$*" | tee -a "$log"; }

lib="${ALLREDUCE_LIB:-target/release/liballreduce_c.so}"
if [ ! -f "$lib" ]; then
  say "ALLREDUCE_LIB=$lib: no such file; build it with cargo build --release -p allreduce-capi --features cuda"
  exit 1
fi
export ALLREDUCE_LIB="$(cd "$(dirname "$lib")" && pwd)/$(basename "$lib")"
python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

tmp="$(mktemp -d)"
mps_started=0
finish() {
  if [ "$mps_started" = 1 ]; then
    echo quit | nvidia-cuda-mps-control || true
  fi
  for f in control.log server.log; do
    [ -f "${CUDA_MPS_LOG_DIRECTORY:-/tmp/mpslog}/$f" ] &&
      cp "${CUDA_MPS_LOG_DIRECTORY:-/tmp/mpslog}/$f" "$out/mps-$f"
  done
  rm -rf "$tmp"
}
trap finish EXIT

# The package as a user installs it, into a folder of its own (the python3 environment is left
# as it is); --no-build-isolation: no network for the build backend, the environment's
# setuptools builds it.
if "$python" -m pip install --quiet --no-deps --no-build-isolation --target "$tmp/site" \
  ./python >>"$log" 2>&1; then
  export PYTHONPATH="$tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  say "package installed from ./python"
else
  export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
  say "pip could not install ./python (see above); testing the source tree"
fi

# What is tested, and a refusal up front where the run could only skip or fail: no GPU, or a
# library without the CUDA backend.
"$python" - <<'EOF' 2>&1 | tee -a "$log"
import sys, allreduce, torch
print(f"allreduce {allreduce.__file__}, library {allreduce.library_path()} "
      f"(version {allreduce.library_version()}); torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, devices {torch.cuda.device_count()}")
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device: nothing to test")
print(f"device 0: {torch.cuda.get_device_name(0)}")
try:
    allreduce.Communicator.group(1, backend="cuda", devices=[0])[0].close()
except allreduce.Error as e:
    sys.exit(f"the library cannot run the CUDA backend: {e}")
EOF

run_tests() {
  local rc
  if "$python" -c "import pytest" 2>/dev/null; then
    "$python" -m pytest python/tests/test_cuda.py -v -rs "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
  else
    "$python" python/tests/test_cuda.py 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
  fi
  return "$rc"
}

# Virtual ranks first, without MPS and with the default CUDA_DEVICE_MAX_CONNECTIONS: one
# hardware queue (the MPS setting below) serializes a process's streams, so a rank's kernel
# that spins for a peer's can sit in front of it until the deadline.
set +e
(export CUDA_DEVICE_MAX_CONNECTIONS=${ALLREDUCE_VIRTUAL_CONNECTIONS:-32}
 run_tests -k "not processes and not tp_linear" "$@")
status_virtual=$?
set -e

# MPS: without it the processes' kernels only time-slice, and ranks spinning on each other's
# flags crawl. CUDA_DEVICE_MAX_CONNECTIONS=1 in the daemon's environment and in every client.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
export CUDA_DEVICE_MAX_CONNECTIONS=1
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
  mps_started=1
  say "MPS daemon started"
else
  say "MPS daemon not started (missing, or already running): the process tests may time out"
fi

set +e
run_tests -k "processes or tp_linear" "$@"
status_processes=$?
set -e
status=$((status_virtual != 0 || status_processes != 0))
say "test_cuda.py: virtual ranks exit status $status_virtual, processes $status_processes; logs in $out"
exit "$status"
