"""When the GPU tests can run: a real driver, and the framework."""
import importlib
import os

import pytest


def on_emulator():
    drv = os.environ.get("GPUIPC_CUDA_DRIVER", "")
    return "emu" in os.path.basename(drv)


def need_gpu():
    if on_emulator():
        pytest.skip("GPU test: on the CUDA driver emulator (torch, CuPy and cuda.core load "
                    "libcuda.so.1 themselves); runs under make gpu-test")


def need(module, check=None, gpu=True):
    if gpu:
        need_gpu()
    try:
        m = importlib.import_module(module)
    except Exception as e:  # ImportError, or a broken install
        pytest.skip(f"{module} not importable here: {type(e).__name__}: {e}")
    if check is not None:
        why = check(m)
        if why:
            pytest.skip(why)
    return m


def torch_cuda(m):
    if not m.cuda.is_available():
        return "torch: torch.cuda.is_available() is False"
    return None


def cupy_cuda(m):
    try:
        if m.cuda.runtime.getDeviceCount() < 1:
            return "cupy: no device"
    except Exception as e:
        return f"cupy: {e}"
    return None


def cuda_core_ok(m):
    return None


FRAMEWORKS = {
    "torch": ("torch", torch_cuda),
    "torch-expandable": ("torch", torch_cuda),
    "cupy": ("cupy", cupy_cuda),
    "cuda.core": ("cuda.core", cuda_core_ok),
    "arena": (None, None),
}


def need_framework(kind):
    mod, check = FRAMEWORKS[kind]
    if mod is None:
        need_gpu()
        return None
    return need(mod, check)
