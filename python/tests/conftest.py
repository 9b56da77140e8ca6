"""pytest setup of the gpuipc suite.

The package under test is GPUIPC_PKG_DIR's (run-pytest.sh, the CTest case
python_pytest), else the one built in place in python/ (make python). Without a usable CUDA driver (no libcuda.so.1 that
initializes) the tests run on the CUDA driver emulator of the source tree
(build/tests/emu/libcuda-emu.so, or GPUIPC_EMU), selected with
GPUIPC_CUDA_DRIVER exactly as the C suite does; the header line says which.
"""
import atexit
import ctypes
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(HERE)
ROOT = os.path.dirname(PKG)
# GPUIPC_PKG_DIR: a built package (run-pytest.sh builds one per build dir).
sys.path.insert(0, os.environ.get("GPUIPC_PKG_DIR") or PKG)
sys.path.insert(0, HERE)


def _real_driver_works():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        return lib.cuInit(0) == 0
    except OSError:
        return False


def _pick_driver():
    if os.environ.get("GPUIPC_CUDA_DRIVER"):
        return f"GPUIPC_CUDA_DRIVER={os.environ['GPUIPC_CUDA_DRIVER']} (from the environment)"
    if os.environ.get("GPUIPC_TEST_MODE") != "emu" and _real_driver_works():
        return "the real CUDA driver (libcuda.so.1)"
    emu = os.environ.get("GPUIPC_EMU") or os.path.join(
        os.environ.get("GPUIPC_BUILD_DIR", os.path.join(ROOT, "build")), "tests", "emu",
        "libcuda-emu.so")
    if not os.path.exists(emu):
        raise RuntimeError(f"no CUDA driver here and no emulator at {emu}: run 'make' first "
                           "(or set GPUIPC_EMU)")
    os.environ["GPUIPC_CUDA_DRIVER"] = emu
    return f"the CUDA driver emulator {emu} (no real driver here)"


DRIVER = _pick_driver()
# The tests' sockets and stats segments go to a runtime directory of this
# run's own, removed at its end: never the user's ($XDG_RUNTIME_DIR/gpuipc,
# else /tmp/gpuipc-<uid>), where `gpuipc ls` would list what a killed
# child left (the C suite does the same, tests/runner.c).
RUNTIME_DIR = tempfile.mkdtemp(prefix="gpuipc-pytest-")
os.environ["XDG_RUNTIME_DIR"] = RUNTIME_DIR
atexit.register(shutil.rmtree, RUNTIME_DIR, True)


def pytest_report_header(config):
    import gpuipc

    return [f"gpuipc {gpuipc.version()} from {os.path.dirname(gpuipc.__file__)}",
            f"driver: {DRIVER}"]
