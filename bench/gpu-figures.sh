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
#   copy     gpuipc bench copy (pinned and pageable, both directions,
#            4 KiB to 4 GiB, torch's and CuPy's copies in the same run)
#   mpi      gpuipc bench mpi to 256 MiB (node-local and the staged path
#            across simulated machines, against MPI and plain copies)
#   probes   the driver's answers the docs record: gpuipc doctor --json
#            (fabric export among them), tests/gpu-probes/fabric.c (also
#            from another pid namespace when run as root) and
#            tests/gpu-probes/stream_gate.c (which calls wait behind a
#            held stream)
#
#   bench/gpu-figures.sh OUT [STEP ...]
set -u
out=${1:?usage: bench/gpu-figures.sh OUT [suite|handoff|python|sets|copy|mpi|probes ...]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
steps=${*:-suite handoff python sets copy mpi probes}
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
  mpi)
    build || exit 1
    build-gpu/gpuipc bench mpi --max-mib 256 --json "$out/mpi.json" >"$out/mpi.txt" 2>&1
    echo "bench mpi: exit $?"
    ;;
  probes)
    build || exit 1
    build-gpu/gpuipc doctor --json >"$out/doctor.json" 2>"$out/doctor.err"
    echo "doctor: exit $?"
    inc=$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")/../include
    for pr in fabric stream_gate; do
      cc -O1 -pthread -I"$inc" -o "$out/$pr" "tests/gpu-probes/$pr.c" -lcuda \
        >"$out/$pr.build.log" 2>&1 || { echo "$pr: did not build"; continue; }
    done
    [ -x "$out/fabric" ] && { timeout 120 "$out/fabric" >"$out/fabric.txt" 2>&1; echo "fabric probe: exit $?"; }
    [ -x "$out/stream_gate" ] && { timeout 60 "$out/stream_gate" streamcount prewarm >"$out/stream_gate.txt" 2>&1; echo "stream_gate probe: exit $?"; }
    ;;
  *) echo "unknown step $s" >&2; exit 2 ;;
  esac
done
