#!/bin/sh
# Runs the Python package's pytest suite (python/tests) against the library
# of one build directory: builds the extension into BUILD_DIR/python first
# (always whole: a few seconds; setuptools' timestamp check missed a source
# changed within the second of the last build),
# so that every build (build/, build-gpu/) tests its own library and the
# source tree stays clean. The CTest case python_pytest runs it, with the
# suite's environment (GPUIPC_TEST_MODE, GPUIPC_CUDA_DRIVER for the emulator).
#
#   run-pytest.sh BUILD_DIR [pytest arguments]
#   run-pytest.sh --check     says whether this machine can run it
#
# Exit 77 (CTest: skipped), with the reason, when no interpreter here has
# pytest, setuptools and its C headers. PYTHON=... picks the interpreter.
set -u
here=$(cd "$(dirname "$0")" && pwd)
pkg=$(dirname "$here")

PY=""
for py in ${PYTHON:-} python3 /usr/bin/python3; do
  command -v "$py" >/dev/null 2>&1 || continue
  if "$py" -c 'import os, sys, sysconfig, pytest, setuptools
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)' \
      >/dev/null 2>&1; then
    PY=$py
    break
  fi
done
why="no python3 with pytest, setuptools and the C headers (Python.h) here (Debian: apt-get install python3-dev python3-pytest)"

if [ "${1:-}" = "--check" ]; then
  if [ -n "$PY" ]; then
    echo "python: the pytest suite ran as the CTest case python_pytest ($PY)"
  else
    echo "python: the pytest suite did NOT run: $why"
  fi
  exit 0
fi

[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR [pytest args]" >&2; exit 2; }
build=$(cd "$1" && pwd) || exit 1
shift
if [ -z "$PY" ]; then
  echo "SKIP: $why"
  exit 77
fi
out="$build/python"
# A build with AddressSanitizer (GPUIPC_ASAN): the extension is built with
# it too, and the interpreter, which is not, starts with its runtime
# preloaded (it must come first) and with Python's allocator replaced by
# malloc, so that the sanitizer sees the objects' memory. Leak checking is
# off: the interpreter keeps much of its memory to the end by design.
san_env=""
if grep -q '^GPUIPC_ASAN:BOOL=ON' "$build/CMakeCache.txt" 2>/dev/null; then
  cc=$(sed -n 's/^CMAKE_C_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
  rt=$("${cc:-cc}" -print-file-name=libasan.so)
  case "$rt" in
    /*) ;;
    *) echo "FAIL: the ASan build's compiler (${cc:-cc}) names no libasan.so to preload"; exit 1 ;;
  esac
  san="-fsanitize=address,undefined -fno-omit-frame-pointer"
  export CFLAGS="${CFLAGS:-} $san" LDFLAGS="${LDFLAGS:-} $san"
  san_env="LD_PRELOAD=$rt PYTHONMALLOC=malloc"
  export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
  echo "python: AddressSanitizer build: the extension is built with it, $rt is preloaded"
fi
echo "python: building the extension with $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])')) into $out/lib"
(cd "$pkg" && GPUIPC_BUILD_DIR="$build" "$PY" setup.py -q build --force --build-lib "$out/lib" \
   --build-temp "$out/tmp" >"$out.log" 2>&1) || { cat "$out.log"; echo "FAIL: building the extension"; exit 1; }
cd "$here" || exit 1
# shellcheck disable=SC2086
GPUIPC_PKG_DIR="$out/lib" exec env $san_env "$PY" -m pytest -p no:cacheprovider -q -rs \
  --durations=12 "$@" "$here"
