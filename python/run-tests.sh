#!/usr/bin/env bash
# The Python package's tests, from a fresh machine with a Rust toolchain and python3 (3.9 or
# newer, with venv): builds liballreduce_c (release), makes .venv-py at the repository root
# with the pinned test packages (requirements-test.txt) and torch (requirements-torch.txt:
# about 3 GB, a minute to install; ALLREDUCE_TEST_TORCH=0 leaves it out and the torch tests
# skip), installs the package from ./python as a user would, and runs pytest against the
# library just built, on the host backend. Extra arguments go to pytest (e.g. -k lossy).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

cargo build --release --locked -p allreduce-capi
# The built library's directory, wherever CARGO_TARGET_DIR or a cargo config puts it.
target="$(cargo metadata --format-version 1 --no-deps --locked |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
case "$(uname -s)" in
  Darwin) lib="$target/release/liballreduce_c.dylib" ;;
  *) lib="$target/release/liballreduce_c.so" ;;
esac

venv="$root/.venv-py"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install -r python/requirements-test.txt
if [ "${ALLREDUCE_TEST_TORCH:-1}" != 0 ]; then
  start=$SECONDS
  "${pip[@]}" install -r python/requirements-torch.txt
  echo "torch and its packages installed or checked in $((SECONDS - start)) s"
fi
# A regular (not editable) install: the tests import the installed copy, so what they pass
# on is what `pip install ./python` ships.
"${pip[@]}" install --force-reinstall --no-deps ./python

# pytest, not `python -m pytest`: the latter puts the working directory on sys.path, and a
# source tree there would be imported instead of the installed package.
# -rs: each skipped test's reason (no torch, no CUDA) is printed.
ALLREDUCE_LIB="$lib" "$venv/bin/pytest" python/tests -q -rs "$@"

# The wheel as a user installs it (python/build-wheel.sh): it carries the library, found
# with no ALLREDUCE_LIB, and runs a group.
wheel="$(PYTHON="$venv/bin/python" python/build-wheel.sh)"
"${pip[@]}" install --force-reinstall --no-deps "$wheel"
(cd /tmp && env -u ALLREDUCE_LIB "$venv/bin/python" - <<'PY'
import os, numpy as np, allreduce
here = os.path.dirname(allreduce.__file__)
assert os.path.dirname(allreduce.library_path()) == here, (allreduce.library_path(), here)
comms = allreduce.Communicator.group(2)
xs = [np.arange(8, dtype=np.float32) + r for r in range(2)]
import threading
ts = [threading.Thread(target=comms[r].all_reduce, args=(xs[r],)) for r in range(2)]
[t.start() for t in ts]; [t.join() for t in ts]
assert (xs[0] == 2 * np.arange(8) + 1).all() and (xs[1] == xs[0]).all(), xs
print("the wheel runs: library", allreduce.library_path())
PY
)
# Back to the plain install, so a later run of the tests against ALLREDUCE_LIB is unchanged.
"${pip[@]}" install --force-reinstall --no-deps ./python
