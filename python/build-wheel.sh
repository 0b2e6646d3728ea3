#!/usr/bin/env bash
# Build a wheel of the Python package that carries liballreduce_c, into dist/ at the repository
# root, and print its path. Extra arguments go to cargo (e.g. --features cuda, which needs nvcc:
# scripts/setup-cuda.sh; a CUDA build also runs on machines without a GPU, and says so):
#
#   python/build-wheel.sh --features cuda && pip install dist/allreduce-*.whl
#
# The wheel is tagged py3-none-<platform>: the binding is ctypes, so any CPython 3.9+ loads it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"

cargo build --release --locked -p allreduce-capi "$@" >&2
target="$(cargo metadata --format-version 1 --no-deps --locked |
  "$python" -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
case "$(uname -s)" in
  Darwin) name=liballreduce_c.dylib ;;
  *) name=liballreduce_c.so ;;
esac
bundled="python/allreduce/$name"
trap 'rm -f "$root/$bundled"' EXIT
cp "$target/release/$name" "$bundled"
# The debug information stays in target/: the wheel carries the stripped library.
if command -v strip >/dev/null && [ "$name" = liballreduce_c.so ]; then strip "$bundled"; fi
rm -rf python/build python/allreduce.egg-info
mkdir -p dist
rm -f dist/allreduce-*.whl
"$python" -m pip wheel --quiet --disable-pip-version-check --no-deps -w dist ./python >&2
rm -rf python/build python/allreduce.egg-info
ls dist/allreduce-*.whl
