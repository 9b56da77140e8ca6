# The optional MPI part: the gpuipc_mpi helper library (src/mpi/*.c), the MPI
# examples (examples/mpi_*.c) and their tests, all built only when MPI is
# found. libgpuipc itself never depends on MPI.
#
# gpuipc_mpi is a static library on top of the static gpuipc (it reports
# errors through gpuipc's per-thread last error, whose setters are internal),
# so a program links gpuipc_mpi and gets gpuipc_static with it.

option(GPUIPC_MPI "Build the MPI helper and examples when MPI is found" ON)
if(NOT GPUIPC_MPI)
  return()
endif()

find_package(MPI COMPONENTS C QUIET)
if(NOT MPI_C_FOUND)
  message(STATUS "gpuipc: MPI not found: the MPI helper and examples are not built")
  return()
endif()
message(STATUS "gpuipc: MPI found (${MPI_C_LIBRARY_VERSION_STRING}): building gpuipc_mpi")

file(GLOB GPUIPC_MPI_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/mpi/*.c)
add_library(gpuipc_mpi STATIC ${GPUIPC_MPI_SOURCES})
target_link_libraries(gpuipc_mpi PUBLIC gpuipc_static MPI::MPI_C)
target_include_directories(gpuipc_mpi
  PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
         $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
  PRIVATE ${PROJECT_SOURCE_DIR}/src ${CUDA_INCLUDE_DIR})
install(TARGETS gpuipc_mpi
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})

file(GLOB GPUIPC_MPI_EXAMPLES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/examples/mpi_*.c)
set(GPUIPC_MPI_EXAMPLE_NAMES "")
foreach(ex ${GPUIPC_MPI_EXAMPLES})
  get_filename_component(exname ${ex} NAME_WE)
  add_executable(example_${exname} ${ex})
  set_target_properties(example_${exname} PROPERTIES OUTPUT_NAME ${exname}
    RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/examples)
  target_link_libraries(example_${exname} PRIVATE gpuipc_mpi)
  list(APPEND GPUIPC_MPI_EXAMPLE_NAMES ${exname})
endforeach()

# The benchmark of gpuipc_mpi_send / recv: an MPI program of its own
# (bench/mpi/), installed beside the gpuipc command, which runs it under
# mpirun for `gpuipc bench mpi` (the command itself never links MPI).
add_executable(gpuipc_bench_mpi ${PROJECT_SOURCE_DIR}/bench/mpi/bench-mpi.c)
set_target_properties(gpuipc_bench_mpi PROPERTIES OUTPUT_NAME gpuipc-bench-mpi)
target_link_libraries(gpuipc_bench_mpi PRIVATE gpuipc_mpi gpuipc_internal)
install(TARGETS gpuipc_bench_mpi RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# Tests: each MPI example under mpirun with 4 ranks on this machine. This
# file is included before cmake/tests.cmake, so the environment is made
# here the same way: the emulator unless GPUIPC_GPU_TEST.
if(NOT GPUIPC_TESTS)
  return()
endif()
find_program(GPUIPC_MPIEXEC NAMES mpirun mpiexec HINTS ${MPIEXEC_EXECUTABLE})
if(NOT GPUIPC_MPIEXEC)
  set(GPUIPC_MPIEXEC ${MPIEXEC_EXECUTABLE})
endif()
if(NOT GPUIPC_MPIEXEC)
  message(STATUS "gpuipc: no mpirun found: MPI tests not registered")
  return()
endif()

# Open MPI refuses to run as root without these (CI containers run as root);
# both the option and the variables are accepted by Open MPI only, so ask
# mpirun which it is.
execute_process(COMMAND ${GPUIPC_MPIEXEC} --version OUTPUT_VARIABLE _gpuipc_mpirun_version
  ERROR_QUIET RESULT_VARIABLE _gpuipc_mpirun_rc)
set(GPUIPC_MPIRUN_FLAGS -n 4)
set(GPUIPC_MPI_TEST_ENV "")
if(_gpuipc_mpirun_version MATCHES "Open MPI|OpenRTE")
  list(APPEND GPUIPC_MPIRUN_FLAGS --oversubscribe)
  list(APPEND GPUIPC_MPI_TEST_ENV OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    OMPI_MCA_rmaps_base_oversubscribe=1)
  execute_process(COMMAND id -u OUTPUT_VARIABLE _gpuipc_uid OUTPUT_STRIP_TRAILING_WHITESPACE
    ERROR_QUIET)
  if(_gpuipc_uid STREQUAL "0")
    list(APPEND GPUIPC_MPIRUN_FLAGS --allow-run-as-root)
  endif()
endif()

if(GPUIPC_GPU_TEST)
  list(APPEND GPUIPC_MPI_TEST_ENV GPUIPC_TEST_MODE=gpu)
elseif(EXISTS ${PROJECT_SOURCE_DIR}/tests/emu/CMakeLists.txt)
  # The emulator target is defined after this file (tests/emu); the
  # generator expression is resolved once it exists.
  list(APPEND GPUIPC_MPI_TEST_ENV GPUIPC_TEST_MODE=emu
    "GPUIPC_CUDA_DRIVER=$<TARGET_FILE:cuda-emu>")
else()
  list(APPEND GPUIPC_MPI_TEST_ENV GPUIPC_TEST_MODE=emu)
endif()

# Open MPI leaks its own allocations at exit (in components it dlopens and
# unloads, so the reports cannot even be symbolized): leak checking of MPI
# programs reports only MPI. The rest of AddressSanitizer stays on.
if(GPUIPC_ASAN)
  list(APPEND GPUIPC_MPI_TEST_ENV ASAN_OPTIONS=detect_leaks=0)
endif()
# Open MPI's own threads (PMIx's progress thread and libevent) are not
# built with ThreadSanitizer, which sees only their libc calls and not how
# they synchronize: at MPI_Finalize it reported a race inside PMIx's
# epoll_ctl and crashed building the report ("CHECK failed:
# sanitizer_common.h:494"). Calls made from modules that are not
# instrumented are not checked; gpuipc's and the examples' code still is.
if(GPUIPC_TSAN)
  list(APPEND GPUIPC_MPI_TEST_ENV
    TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1)
endif()

foreach(exname ${GPUIPC_MPI_EXAMPLE_NAMES})
  add_test(NAME ${exname}
    COMMAND ${GPUIPC_MPIEXEC} ${GPUIPC_MPIRUN_FLAGS} $<TARGET_FILE:example_${exname}>)
  set_tests_properties(${exname} PROPERTIES TIMEOUT 120 LABELS "mpi"
    ENVIRONMENT "${GPUIPC_MPI_TEST_ENV}")
endforeach()

# The ring across two simulated machines (rank % 2): every neighbour is
# remote (the plain mpi_ring test has them all local).
if(TARGET example_mpi_ring)
  add_test(NAME mpi_ring_two_machines
    COMMAND ${GPUIPC_MPIEXEC} ${GPUIPC_MPIRUN_FLAGS} $<TARGET_FILE:example_mpi_ring>)
  set_tests_properties(mpi_ring_two_machines PROPERTIES TIMEOUT 120 LABELS "mpi"
    ENVIRONMENT "${GPUIPC_MPI_TEST_ENV};GPUIPC_MPI_SIMULATE_MACHINES=2")
endif()

# The helper's cross-machine reporting, on one machine: ranks pretend to
# run on two machines (see GPUIPC_MPI_SIMULATE_MACHINES in gpuipc/mpi.h).
if(TARGET example_mpi_node)
  add_test(NAME mpi_node_two_machines
    COMMAND ${GPUIPC_MPIEXEC} ${GPUIPC_MPIRUN_FLAGS} $<TARGET_FILE:example_mpi_node>)
  set_tests_properties(mpi_node_two_machines PROPERTIES TIMEOUT 120 LABELS "mpi"
    ENVIRONMENT "${GPUIPC_MPI_TEST_ENV};GPUIPC_MPI_SIMULATE_MACHINES=2")
endif()

# gpuipc_mpi_send / recv: one program (tests/mpi/), every path. Ranks
# exchange with rank ^ 1 and rank ^ 2: with two simulated machines the
# first is remote, the second local.
add_executable(test_mpi_sendrecv ${PROJECT_SOURCE_DIR}/tests/mpi/test-mpi-sendrecv.c)
set_target_properties(test_mpi_sendrecv PROPERTIES OUTPUT_NAME test-mpi-sendrecv
  RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
target_link_libraries(test_mpi_sendrecv PRIVATE gpuipc_mpi)
# Each entry: name:VAR=value,VAR=value (the environment of that test).
foreach(cfg
    "local:"
    "staged:GPUIPC_MPI_SIMULATE_MACHINES=2"
    "staged_small_chunks:GPUIPC_MPI_SIMULATE_MACHINES=2,GPUIPC_MPI_CHUNK_BYTES=65536,GPUIPC_MPI_CUDA_AWARE=0"
    "cuda_aware:GPUIPC_MPI_SIMULATE_MACHINES=2,GPUIPC_MPI_CUDA_AWARE=1,GPUIPC_MPI_CHUNK_BYTES=1048576"
    "no_local:GPUIPC_MPI_LOCAL=0,GPUIPC_MPI_CUDA_AWARE=0,GPUIPC_MPI_CHUNK_BYTES=131072"
    "fault_recv_staged:GPUIPC_TEST_FAULT=recv,GPUIPC_MPI_SIMULATE_MACHINES=2,GPUIPC_MPI_CUDA_AWARE=0,GPUIPC_MPI_CHUNK_BYTES=65536"
    "fault_send_staged:GPUIPC_TEST_FAULT=send,GPUIPC_MPI_SIMULATE_MACHINES=2,GPUIPC_MPI_CUDA_AWARE=0,GPUIPC_MPI_CHUNK_BYTES=65536"
    "fault_recv_local:GPUIPC_TEST_FAULT=recv")
  string(FIND "${cfg}" ":" colon)
  string(SUBSTRING "${cfg}" 0 ${colon} cfgname)
  math(EXPR colon "${colon} + 1")
  string(SUBSTRING "${cfg}" ${colon} -1 cfgenv)
  string(REPLACE "," ";" cfgenv "${cfgenv}")
  # On a real GPU: no emulator fault injection, and device memory is not
  # host-addressable (forcing CUDA-awareness on an MPI that is not would
  # hand it pointers it cannot read).
  if(GPUIPC_GPU_TEST AND cfgname MATCHES "^(fault_|cuda_aware)")
    continue()
  endif()
  add_test(NAME mpi_sendrecv_${cfgname}
    COMMAND ${GPUIPC_MPIEXEC} ${GPUIPC_MPIRUN_FLAGS} $<TARGET_FILE:test_mpi_sendrecv>)
  set_tests_properties(mpi_sendrecv_${cfgname} PROPERTIES TIMEOUT 180 LABELS "mpi"
    ENVIRONMENT "${GPUIPC_MPI_TEST_ENV};${cfgenv}")
endforeach()

# The benchmark's CI smoke run: two ranks, --quick.
add_test(NAME mpi_bench_quick
  COMMAND ${GPUIPC_MPIEXEC} ${GPUIPC_MPIRUN_FLAGS} $<TARGET_FILE:gpuipc_bench_mpi> --quick)
set_tests_properties(mpi_bench_quick PROPERTIES TIMEOUT 180 LABELS "mpi"
  ENVIRONMENT "${GPUIPC_MPI_TEST_ENV}")
