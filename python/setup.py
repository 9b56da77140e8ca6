"""Builds the gpuipc Python package: the C extension gpuipc._gpuipc over
gpuipc's public C API, linked with the static library.

Where the library comes from, in order:
  1. GPUIPC_BUILD_DIR (a CMake build directory holding libgpuipc.a);
  2. the source tree this directory sits in (python/ of the gpuipc
     repository): its build/libgpuipc.a, built here with CMake when absent;
  3. an installed gpuipc found by pkg-config (pkg-config --cflags --libs).
Needs only setuptools and a C compiler; no third-party package.
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("GPUIPC_ROOT", os.path.dirname(HERE))


def in_tree():
    return os.path.exists(os.path.join(ROOT, "include", "gpuipc.h")) and os.path.exists(
        os.path.join(ROOT, "CMakeLists.txt")
    )


def cmake_build(build_dir):
    """Builds libgpuipc.a of the source tree in build_dir with CMake."""
    cmake = shutil.which("cmake")
    if cmake is None:
        sys.exit("gpuipc: cmake is needed to build the library (or set GPUIPC_BUILD_DIR "
                 "to a build of it, or install gpuipc so that pkg-config finds it)")
    print(f"gpuipc: building libgpuipc.a with CMake in {build_dir}", flush=True)
    subprocess.check_call([cmake, "-S", ROOT, "-B", build_dir, "-DGPUIPC_TESTS=OFF",
                           "-DCMAKE_BUILD_TYPE=RelWithDebInfo"])
    subprocess.check_call([cmake, "--build", build_dir, "--target", "gpuipc_static", "-j",
                           str(os.cpu_count() or 2)])


def pkg_config():
    if shutil.which("pkg-config") is None:
        return None
    try:
        subprocess.check_output(["pkg-config", "--exists", "gpuipc"])
        cflags = subprocess.check_output(["pkg-config", "--cflags", "gpuipc"]).decode().split()
        libs = subprocess.check_output(["pkg-config", "--libs", "gpuipc"]).decode().split()
        libdir = subprocess.check_output(["pkg-config", "--variable=libdir", "gpuipc"]).decode().strip()
    except (subprocess.CalledProcessError, OSError):
        return None
    return cflags, libs, libdir


def library():
    """(include_dirs, extra_objects, extra_link_args)"""
    bd = os.environ.get("GPUIPC_BUILD_DIR")
    if bd:
        lib = os.path.join(bd, "libgpuipc.a")
        if not os.path.exists(lib):
            sys.exit(f"gpuipc: GPUIPC_BUILD_DIR={bd} holds no libgpuipc.a")
        return [os.path.join(ROOT, "include")], [lib], ["-Wl,--exclude-libs,ALL"]
    if in_tree():
        bd = os.path.join(ROOT, "build")
        lib = os.path.join(bd, "libgpuipc.a")
        if not os.path.exists(lib):
            bd = os.path.join(HERE, "build", "libgpuipc")
            lib = os.path.join(bd, "libgpuipc.a")
            cmake_build(bd)
        print(f"gpuipc: linking {lib}", flush=True)
        return [os.path.join(ROOT, "include")], [lib], ["-Wl,--exclude-libs,ALL"]
    pc = pkg_config()
    if pc is None:
        sys.exit("gpuipc: no gpuipc library: build from the gpuipc source tree, set "
                 "GPUIPC_BUILD_DIR, or install gpuipc (make install) so that pkg-config "
                 "finds it")
    cflags, libs, libdir = pc
    inc = [f[2:] for f in cflags if f.startswith("-I")]
    print(f"gpuipc: linking the installed library ({' '.join(libs)})", flush=True)
    return inc, [], libs + [f"-Wl,-rpath,{libdir}"]


class BuildExt(build_ext):
    def build_extensions(self):
        inc, objs, link = library()
        for ext in self.extensions:
            ext.include_dirs += inc
            ext.extra_objects += objs
            ext.extra_link_args += link
        super().build_extensions()


ext = Extension(
    "gpuipc._gpuipc",
    sources=["src/module.c", "src/array.c", "src/conn.c", "src/arena.c", "src/buffer.c",
             "src/proc.c", "src/sets.c", "src/torchc.c", "src/hold.c"],
    depends=["src/ext.h"],
    libraries=["dl", "pthread"],
    extra_compile_args=["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra",
                        "-Wno-unused-parameter", "-Wno-missing-field-initializers",
                        "-Wno-cast-function-type", "-fvisibility=hidden"],
)

setup(
    name="gpuipc",
    version="0.1.0",
    description="Share CUDA device memory between processes: zero-copy, leased, "
                "stream-ordered (torch, CuPy, cuda.core)",
    license="MIT",
    packages=["gpuipc"],
    # The extension's type stubs and the PEP 561 marker: type checkers read
    # the installed package's annotations and _gpuipc.pyi.
    package_data={"gpuipc": ["py.typed", "_gpuipc.pyi"]},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.9",
)
