# The test suite: one binary, one CTest case per TEST_IMPL found in tests/*.c.
# Files named conformance-*.c carry the label "conformance".
file(GLOB GPUIPC_TEST_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/*.c)
add_executable(gpuipc-tests ${GPUIPC_TEST_SOURCES})
target_link_libraries(gpuipc-tests PRIVATE gpuipc_internal)
# Host allocation failure injection (tests/runner.c: harness_alloc_arm,
# harness_fail_allocs): the library's objects and the tests call
# __wrap_malloc & co., which fail on request.
target_link_options(gpuipc-tests PRIVATE
  "LINKER:--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=strdup")
target_include_directories(gpuipc-tests PRIVATE ${PROJECT_SOURCE_DIR}/tests)
if(TARGET cuda-emu)
  target_compile_definitions(gpuipc-tests PRIVATE
    GPUIPC_EMU_PATH="$<TARGET_FILE:cuda-emu>")
  add_dependencies(gpuipc-tests cuda-emu)
endif()
target_compile_definitions(gpuipc-tests PRIVATE
  GPUIPC_CLI_PATH="$<TARGET_FILE:gpuipc_cli>"
  GPUIPC_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
add_dependencies(gpuipc-tests gpuipc_cli)

if(GPUIPC_GPU_TEST)
  set(GPUIPC_TEST_ENV "GPUIPC_TEST_MODE=gpu")
elseif(TARGET cuda-emu)
  set(GPUIPC_TEST_ENV "GPUIPC_TEST_MODE=emu;GPUIPC_CUDA_DRIVER=$<TARGET_FILE:cuda-emu>")
else()
  set(GPUIPC_TEST_ENV "GPUIPC_TEST_MODE=emu")
endif()
# The tests count driver opens and closes per import: the import cache's
# linger (idle mappings kept after their last close) is off for them; the
# tests of the linger (test-handle-linger.c) turn it on themselves.
list(APPEND GPUIPC_TEST_ENV "GPUIPC_IMPORT_LINGER_MS=0")

# Re-run the configure step when a test file changes, so that a TEST_IMPL
# added to an existing file becomes a CTest case without a manual re-run.
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${GPUIPC_TEST_SOURCES})
foreach(src ${GPUIPC_TEST_SOURCES})
  get_filename_component(base ${src} NAME_WE)
  file(STRINGS ${src} lines REGEX "^TEST_IMPL\\(")
  foreach(line ${lines})
    string(REGEX REPLACE "^TEST_IMPL\\(([A-Za-z0-9_]+)\\).*" "\\1" name "${line}")
    add_test(NAME ${name} COMMAND gpuipc-tests ${name})
    set(labels unit)
    if(base MATCHES "^conformance")
      set(labels conformance)
    endif()
    set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300
      LABELS "${labels}" ENVIRONMENT "${GPUIPC_TEST_ENV}")
    # The connection and handoff tests run once per carrier: by default
    # over the ring (what two gpuipc processes negotiate), and again with
    # the socket carrying every frame (GPUIPC_CARRIER=socket).
    if(base MATCHES "^test-conn" AND NOT base STREQUAL "test-conn-carrier")
      add_test(NAME ${name}_on_socket COMMAND gpuipc-tests ${name})
      set_tests_properties(${name}_on_socket PROPERTIES SKIP_RETURN_CODE 77
        TIMEOUT 300 LABELS "${labels};socket"
        ENVIRONMENT "${GPUIPC_TEST_ENV};GPUIPC_CARRIER=socket")
    endif()
  endforeach()
endforeach()

# Tests that start dozens of processes on the GPU: each process is a CUDA
# context (device memory of its own, and its creation delays the other
# processes' CUDA start). Two of them at once, under ctest -j 16, starved
# the rest of the suite on an H200 (contexts failed for want of device
# memory, helpers took over 30 s to start): they run one at a time and
# take 8 of ctest's slots each. The held-stream broadcast (48 consumers)
# is one of them: run beside its socket twin and a dozen other tests, its
# consumers' and others' contexts failed with CUDA_ERROR_OUT_OF_MEMORY.
foreach(t handoff_64_consumers handoff_broadcast_64_consumers
          handoff_64_consumers_on_socket handoff_broadcast_64_consumers_on_socket
          handoff_broadcast_held_stream_fresh_connections
          handoff_broadcast_held_stream_fresh_connections_on_socket)
  if(TEST ${t})
    set_tests_properties(${t} PROPERTIES RESOURCE_LOCK gpu_process_crowd PROCESSORS 8)
  endif()
endforeach()

# cuMemGetInfo is device-wide: on a GPU, every other test's process that
# makes or ends its context or allocates moves it. Under ctest -j 16 on an
# H200 (2026-12-04), 20 tries in 2 s beside the suite's first tests all
# saw other processes' allocations in the window ("dropped by 67305472,
# came back by -12976128"). It runs alone.
if(TEST conformance_mem_get_info_tracks_alloc)
  set_tests_properties(conformance_mem_get_info_tracks_alloc
                       PROPERTIES RUN_SERIAL TRUE)
endif()

# The Python package's pytest suite (python/tests), built against this
# build's static library; it skips (77) without python3, pytest and the C
# headers. In an AddressSanitizer build the extension is built with it and
# the interpreter preloads its runtime (run-pytest.sh); not in a
# ThreadSanitizer build, whose runtime cannot be preloaded into an
# interpreter that was not built with it.
if(NOT GPUIPC_TSAN AND EXISTS ${PROJECT_SOURCE_DIR}/python/tests/run-pytest.sh)
  add_test(NAME python_pytest
    COMMAND sh ${PROJECT_SOURCE_DIR}/python/tests/run-pytest.sh ${PROJECT_BINARY_DIR})
  # COST: the longest case, started first under ctest -j.
  set_tests_properties(python_pytest PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 1800
    COST 10000 LABELS python ENVIRONMENT "${GPUIPC_TEST_ENV}")
endif()

# The suite leaves nothing in the user's runtime directory (the one gpuipc
# ls lists; docs/ls.md). Each test of gpuipc-tests makes its own inside its
# temporary directory (tests/runner.c); every other case here (MPI, pytest)
# gets the suite's, GPUIPC_TEST_RUNTIME_DIR. runtime_dir_setup makes that
# before any case and notes what the user's holds; runtime_dir_untouched,
# after them all, fails on a segment a case left there
# (tests/harness-runtime.c). Both see the user's XDG_RUNTIME_DIR.
string(MD5 GPUIPC_TEST_RUNTIME_ID "${PROJECT_BINARY_DIR}")
string(SUBSTRING "${GPUIPC_TEST_RUNTIME_ID}" 0 12 GPUIPC_TEST_RUNTIME_ID)
set(GPUIPC_TEST_RUNTIME_DIR "/tmp/gpuipc-tests-${GPUIPC_TEST_RUNTIME_ID}")
set(GPUIPC_TEST_RUNTIME_SNAPSHOT "${PROJECT_BINARY_DIR}/tests/runtime-dir-before.txt")
get_property(GPUIPC_ALL_TESTS DIRECTORY PROPERTY TESTS)
foreach(t ${GPUIPC_ALL_TESTS})
  set_property(TEST ${t} APPEND PROPERTY ENVIRONMENT
    "XDG_RUNTIME_DIR=${GPUIPC_TEST_RUNTIME_DIR}")
  set_property(TEST ${t} APPEND PROPERTY FIXTURES_REQUIRED runtime_dir)
endforeach()
add_test(NAME runtime_dir_setup COMMAND gpuipc-tests --helper runtime_dir_setup
  ${GPUIPC_TEST_RUNTIME_DIR} ${GPUIPC_TEST_RUNTIME_SNAPSHOT})
add_test(NAME runtime_dir_untouched COMMAND gpuipc-tests --helper
  runtime_dir_untouched ${GPUIPC_TEST_RUNTIME_SNAPSHOT} ${PROJECT_BINARY_DIR})
set_tests_properties(runtime_dir_setup PROPERTIES FIXTURES_SETUP runtime_dir
  TIMEOUT 60 LABELS unit)
set_tests_properties(runtime_dir_untouched PROPERTIES FIXTURES_CLEANUP runtime_dir
  TIMEOUT 60 LABELS unit)

# libFuzzer targets and their corpus replay live under tests/fuzz.
if(EXISTS ${PROJECT_SOURCE_DIR}/tests/fuzz/CMakeLists.txt)
  add_subdirectory(${PROJECT_SOURCE_DIR}/tests/fuzz ${PROJECT_BINARY_DIR}/tests/fuzz)
endif()

# Every environment variable the tree reads is a row of docs/environment.md,
# and `gpuipc doctor` lists every declared parameter (tools/check-env).
find_program(GPUIPC_PYTHON3 python3)
if(GPUIPC_PYTHON3)
  add_test(NAME env_documented COMMAND ${GPUIPC_PYTHON3}
    ${PROJECT_SOURCE_DIR}/tools/check-env --cli $<TARGET_FILE:gpuipc_cli>)
  set_tests_properties(env_documented PROPERTIES LABELS unit)
  # The man page says what the command's --help says (tools/check-man).
  add_test(NAME man_page_matches_help COMMAND ${GPUIPC_PYTHON3}
    ${PROJECT_SOURCE_DIR}/tools/check-man $<TARGET_FILE:gpuipc_cli>)
  set_tests_properties(man_page_matches_help PROPERTIES LABELS unit)
endif()

# The checked-in gather kernel image is what tools/gen-gather makes of
# src/sets/gather.cu (skipped, with the reason, where there is no nvcc).
add_test(NAME check_gather_image COMMAND sh ${PROJECT_SOURCE_DIR}/tools/check-gather)
set_tests_properties(check_gather_image PROPERTIES LABELS unit SKIP_RETURN_CODE 77
  TIMEOUT 300)
