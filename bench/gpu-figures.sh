#!/bin/sh
# The figures docs/ quote, on a machine with a GPU: builds in a fresh
# folder and writes each step's log (and JSON where the step has it) into
# OUT. Steps (default: all, in this order):
#
#   suite    make gpu-test (the whole suite on the real driver)
#   handoff  gpuipc bench handoff (every row: paths, carriers, sizes,
#            fan-out, batches, flatness) and gpuipc bench ring --quick
#   python   python3 -m gpuipc.bench (send -> a usable torch tensor, the
#            peers in the same run), bench/py_profile.py (the raw parts)
#   sets     gpuipc bench sets (Llama-2-7B-shaped set, KV-cache sets of
#            1,000-100,000 blocks with both floors) and python3 -m
#            gpuipc.bench_sets (the same from Python, torch's index_copy_)
#   copy     gpuipc bench copy (pinned and pageable, both directions)
#
#   bench/gpu-figures.sh OUT [STEP ...]
set -u
out=${1:?usage: bench/gpu-figures.sh OUT [suite|handoff|python|sets|copy ...]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
steps=${*:-suite handoff python sets copy}
here=$(pwd)
export NCCL_NVLS_ENABLE=0
build() {
  [ -x build-gpu/gpuipc ] && return 0
  cmake -S . -B build-gpu -DGPUIPC_GPU_TEST=ON >/dev/null &&
    cmake --build build-gpu -j "$(nproc)" >"$out/build.log" 2>&1 ||
    { tail -40 "$out/build.log"; return 1; }
}
pybuild() {
  (cd python && GPUIPC_BUILD_DIR="$here/build-gpu" python3 setup.py -q build_ext --inplace) \
    >"$out/pybuild.log" 2>&1 || { tail -40 "$out/pybuild.log"; return 1; }
}
for s in $steps; do
  case $s in
  suite)
    make gpu-test JOBS="$(nproc)" >"$out/suite.log" 2>&1
    echo "suite: exit $?"
    grep -E "tests passed|tests failed|python:" "$out/suite.log"
    grep -E "^\s+[0-9]+ - .*\((Failed|Timeout|SEGFAULT|Subprocess)" "$out/suite.log" | head -20
    ;;
  handoff)
    build || exit 1
    build-gpu/gpuipc bench handoff --json "$out/handoff.json" >"$out/handoff.txt" 2>&1
    echo "handoff: exit $?"
    build-gpu/gpuipc bench ring --quick >"$out/ring.txt" 2>&1
    echo "ring: exit $?"
    ;;
  python)
    build && pybuild || exit 1
    PYTHONPATH=python python3 -m gpuipc.bench --json >"$out/python.txt" 2>&1
    echo "python bench: exit $?"
    python3 bench/py_profile.py --json "$out/py_profile.json" >"$out/py_profile.txt" 2>&1
    echo "py_profile: exit $?"
    ;;
  sets)
    build && pybuild || exit 1
    build-gpu/gpuipc bench sets --json "$out/csets.json" >"$out/csets.txt" 2>&1
    echo "bench sets: exit $?"
    PYTHONPATH=python python3 -m gpuipc.bench_sets --json >"$out/sets.txt" 2>&1
    echo "bench_sets: exit $?"
    ;;
  copy)
    build || exit 1
    build-gpu/gpuipc bench copy --json "$out/copy.json" >"$out/copy.txt" 2>&1
    echo "bench copy: exit $?"
    ;;
  *) echo "unknown step $s" >&2; exit 2 ;;
  esac
done
