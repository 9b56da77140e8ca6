/*
 * pick.c: chooses between the real CUDA driver and the emulator for the
 * commands that must run anywhere (bench, and `gpuipc demo` through
 * bench.h).
 */
#include "bench.h"
#include "gpuipc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

int gpuipc_bench_pick_driver(int *argc, char **argv, const char *what) {
  const char *emu = NULL;
  for (int i = 1; i < *argc; i++) {
    if (strcmp(argv[i], "--emulator") == 0 && i + 1 < *argc) {
      emu = argv[i + 1];
      for (int j = i; j + 2 <= *argc; j++)
        argv[j] = argv[j + 2];
      *argc -= 2;
      argv[*argc] = NULL;
      break;
    }
  }
  if (getenv("GPUIPC_CUDA_DRIVER") != NULL)
    return strstr(getenv("GPUIPC_CUDA_DRIVER"), "cuda-emu") != NULL;
  if (emu == NULL)
    return 0;
  /* Probe the real driver in a child, so that this process is free to load
   * the emulator instead (the driver library is loaded once per process). */
  pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    _exit(gpuipc_init() == GPUIPC_OK && gpuipc_device_count(&n) == GPUIPC_OK &&
                  n > 0
              ? 0
              : 1);
  }
  int st = 1;
  if (pid > 0)
    waitpid(pid, &st, 0);
  if (pid > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0)
    return 0;
  if (access(emu, R_OK) != 0) {
    fprintf(stderr, "gpuipc %s: no GPU driver here, and the emulator %s is "
                    "missing (run make first)\n", what, emu);
    return -1;
  }
  setenv("GPUIPC_CUDA_DRIVER", emu, 1);
  printf("gpuipc %s: no usable GPU driver on this machine: running on the "
         "CUDA driver emulator (%s)\n", what, emu);
  fflush(stdout);
  return 1;
}
