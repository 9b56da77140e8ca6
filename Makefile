# Wraps CMake for the commands people type. See README.md.
#   make            build everything (build/)
#   make demo       two processes sharing GPU memory (the emulator without a GPU)
#   make test       build and run the test suite on the CUDA driver emulator
#                   (with the Python package's pytest suite when python3,
#                   pytest and Python.h are here; it says when they are not)
#   make python     build the Python package in place (python/gpuipc)
#   make gpu-test   the same suite on the real driver (needs a GPU)
#   make bench      benchmarks (real GPU if present, else the emulator)
#   make install PREFIX=/usr/local
#   make asan | tsan   the suite under sanitizers (build-asan/, build-tsan/)

MAKEFLAGS += --no-print-directory

BUILD   ?= build
PREFIX  ?= /usr/local
CC      ?= cc
JOBS    ?= $(shell nproc 2>/dev/null || echo 2)
# GPU tests at once: each starts CUDA in several processes, which the
# kernel driver serializes; more than 16 at a time only makes each slower.
GPU_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 16 ] && n=16; echo $$n)
CMAKE_FLAGS ?=
PYTHON ?= python3
CTEST_FLAGS ?=

EMU = $(BUILD)/tests/emu/libcuda-emu.so

.PHONY: all build demo test gpu-test bench install asan tsan fuzz clean python

all: build

build: $(BUILD)/CMakeCache.txt
	@cmake --build $(BUILD) -j $(JOBS)

$(BUILD)/CMakeCache.txt:
	@cmake -S . -B $(BUILD) -DCMAKE_INSTALL_PREFIX=$(PREFIX) $(CMAKE_FLAGS) >/dev/null

demo: build
	@$(BUILD)/gpuipc demo --emulator $(abspath $(EMU))

test: build
	@cd $(BUILD) && ctest -j $(JOBS) --output-on-failure $(CTEST_FLAGS)
	@PYTHON=$(PYTHON) sh python/tests/run-pytest.sh --check

python: build
	@cd python && GPUIPC_BUILD_DIR=$(abspath $(BUILD)) $(PYTHON) setup.py -q build_ext --inplace
	@echo "python: gpuipc built in python/gpuipc (PYTHONPATH=$(abspath python), or pip install --no-build-isolation ./python)"

gpu-test:
	@cmake -S . -B build-gpu -DGPUIPC_GPU_TEST=ON $(CMAKE_FLAGS) >/dev/null
	@cmake --build build-gpu -j $(JOBS)
	@build-gpu/gpuipc doctor --quiet; rc=$$?; if [ $$rc -ne 0 ]; then \
	  echo "make gpu-test: no usable GPU here (gpuipc doctor exit $$rc); run 'build-gpu/gpuipc doctor' to see why, or use 'make test' for the emulator"; \
	  exit 1; fi
	@cd build-gpu && ctest -j $(GPU_JOBS) --output-on-failure $(CTEST_FLAGS)
	@PYTHON=$(PYTHON) sh python/tests/run-pytest.sh --check

bench: build
	@$(BUILD)/gpuipc bench all --emulator $(abspath $(EMU))

install: build
	@cmake --install $(BUILD) --prefix $(PREFIX)

asan:
	@cmake -S . -B build-asan -DGPUIPC_ASAN=ON -DCMAKE_BUILD_TYPE=Debug $(CMAKE_FLAGS) >/dev/null
	@cmake --build build-asan -j $(JOBS)
	@cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest -j $(JOBS) --output-on-failure $(CTEST_FLAGS)

tsan:
	@cmake -S . -B build-tsan -DGPUIPC_TSAN=ON -DCMAKE_BUILD_TYPE=Debug $(CMAKE_FLAGS) >/dev/null
	@cmake --build build-tsan -j $(JOBS)
	@cd build-tsan && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
	  ctest -j $(JOBS) --output-on-failure $(CTEST_FLAGS)

fuzz:
	@cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DGPUIPC_FUZZ=ON -DGPUIPC_ASAN=ON $(CMAKE_FLAGS) >/dev/null
	@cmake --build build-fuzz -j $(JOBS)

clean:
	@rm -rf $(BUILD) build-gpu build-asan build-tsan build-fuzz python/build python/gpuipc/*.so
