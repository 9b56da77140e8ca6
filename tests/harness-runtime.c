/*
 * harness-runtime.c: the suite leaves nothing in the user's runtime
 * directory ($XDG_RUNTIME_DIR/gpuipc, else /tmp/gpuipc-<uid>: the one
 * `gpuipc ls` lists).
 *
 * Each test runs with a runtime directory of its own (runner.c), the
 * other CTest cases (MPI, pytest) with the suite's (cmake/tests.cmake).
 * Two CTest cases frame the run as a fixture: runtime_dir_setup, before
 * every other case, makes the suite's directory and notes what the user's
 * already holds; runtime_dir_untouched, after them all, fails on a stats
 * segment that appeared there meanwhile and was written by a program of
 * this build (its command line starts with the build directory: the
 * harness re-executes itself under its full path) whose process is gone:
 * what a killed helper leaves, and `gpuipc ls` then lists. Segments of
 * live processes (a case outside the fixture may still run), of other
 * programs, other builds and other pid namespaces are not this run's to
 * judge. Both cases run with the user's
 * XDG_RUNTIME_DIR, which no other case sees.
 */
#include "harness.h"
#include "tree.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdatomic.h>
#include <stddef.h>
#include <sys/stat.h>
#include <unistd.h>

/* The pid and start time a segment's name gives; false for another file. */
static bool segment_name(const char *name, int *pid,
                         unsigned long long *start) {
  int used = 0;
  return sscanf(name, "proc-%d-%llu.stats%n", pid, start, &used) == 2 &&
         used > 0 && name[used] == '\0' && *pid > 0;
}

static int rm_entry(const char *p, const struct stat *s, int f,
                    struct FTW *w) {
  (void)s;
  (void)f;
  (void)w;
  return remove(p);
}

/* argv[0]: the suite's runtime directory (made, or checked to be ours and
 * 0700; what a previous run left in it removed); argv[1]: the file that
 * receives the names already in the user's runtime directory. */
HELPER_IMPL(runtime_dir_setup) {
  if (argc < 2) {
    fprintf(stderr, "usage: runtime_dir_setup SUITE_DIR SNAPSHOT\n");
    return 2;
  }
  char why[512] = "";
  if (gpuipc__private_dir(argv[0], why, sizeof why) != GPUIPC_OK) {
    fprintf(stderr, "runtime_dir_setup: %s: %s\n", argv[0], why);
    return 1;
  }
  char old[600];
  snprintf(old, sizeof old, "%s/gpuipc", argv[0]);
  nftw(old, rm_entry, 16, FTW_DEPTH | FTW_PHYS);

  char real[512];
  gpuipc__default_runtime_dir(real, sizeof real, NULL, 0, NULL);
  FILE *f = fopen(argv[1], "w");
  if (f == NULL) {
    fprintf(stderr, "runtime_dir_setup: %s: %s\n", argv[1], strerror(errno));
    return 1;
  }
  int n = 0;
  DIR *d = opendir(real);
  for (struct dirent *e; d != NULL && (e = readdir(d)) != NULL;)
    if (e->d_name[0] != '.') {
      fprintf(f, "%s\n", e->d_name);
      n++;
    }
  if (d != NULL)
    closedir(d);
  fclose(f);
  printf("runtime_dir_setup: the suite's runtime directory is %s; %d "
         "entr%s already in %s\n", argv[0], n, n == 1 ? "y" : "ies", real);
  return 0;
}

/* The snapshot file, read whole as "\nname\nname\n...\n"; NULL when it
 * cannot be read. */
static char *read_snapshot(const char *path) {
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return NULL;
  char *buf = NULL;
  long size = -1;
  if (fseek(f, 0, SEEK_END) == 0 && (size = ftell(f)) >= 0 &&
      fseek(f, 0, SEEK_SET) == 0)
    buf = malloc((size_t)size + 3);
  if (buf != NULL) {
    buf[0] = '\n';
    size_t got = fread(buf + 1, 1, (size_t)size, f);
    buf[1 + got] = '\n';
    buf[2 + got] = '\0';
  }
  fclose(f);
  return buf;
}

static bool in_snapshot(const char *snap, const char *name) {
  char key[300];
  snprintf(key, sizeof key, "\n%s\n", name);
  return strstr(snap, key) != NULL;
}

/* Reads the head of a segment file (pid namespace, command line) into *s;
 * false when it is not a readable segment of ours. */
static bool segment_head(const char *path, gpuipc__stats_seg *s) {
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    return false;
  size_t want = offsetof(gpuipc__stats_seg, command) + sizeof s->command;
  ssize_t r = pread(fd, s, want, 0);
  close(fd);
  if (r != (ssize_t)want || atomic_load(&s->magic) != GPUIPC__STATS_MAGIC)
    return false;
  s->command[sizeof s->command - 1] = '\0';
  return true;
}

/* argv[0]: the snapshot runtime_dir_setup wrote; argv[1]: the build
 * directory (a segment whose command line starts with it is this run's). */
HELPER_IMPL(runtime_dir_untouched) {
  if (argc < 2) {
    fprintf(stderr, "usage: runtime_dir_untouched SNAPSHOT BUILD_DIR\n");
    return 2;
  }
  char build[600];
  snprintf(build, sizeof build, "%s/", argv[1]);
  char *snap = read_snapshot(argv[0]);
  if (snap == NULL) {
    fprintf(stderr, "runtime_dir_untouched: %s: %s (runtime_dir_setup did "
                    "not run)\n", argv[0], strerror(errno));
    return 1;
  }

  char real[512];
  gpuipc__default_runtime_dir(real, sizeof real, NULL, 0, NULL);
  uint64_t ns = gpuipc__pid_namespace();
  static gpuipc__stats_seg seg;
  int left = 0;
  DIR *d = opendir(real);
  for (struct dirent *e; d != NULL && (e = readdir(d)) != NULL;) {
    int pid = 0;
    unsigned long long start = 0;
    if (!segment_name(e->d_name, &pid, &start) ||
        in_snapshot(snap, e->d_name))
      continue;
    char path[1100];
    snprintf(path, sizeof path, "%s/%s", real, e->d_name);
    if (!segment_head(path, &seg) || seg.pid_ns == 0 || seg.pid_ns != ns ||
        strncmp(seg.command, build, strlen(build)) != 0)
      continue;
    uint64_t now_start = 0;
    if (gpuipc__proc_stat(pid, NULL, &now_start) == GPUIPC_OK &&
        now_start == start)
      continue; /* alive */
    printf("runtime_dir_untouched: %s: its process is gone (%s)\n", path,
           seg.command);
    left++;
  }
  if (d != NULL)
    closedir(d);
  free(snap);
  if (left) {
    printf("runtime_dir_untouched: FAILED: the run left %d segment(s) in "
           "the user's runtime directory %s: each test keeps its own "
           "(tests/runner.c), the other cases the suite's "
           "(cmake/tests.cmake); a case that sets XDG_RUNTIME_DIR itself "
           "must point it at a directory of its own\n", left, real);
    return 1;
  }
  printf("runtime_dir_untouched: ok: nothing was left in %s\n", real);
  return 0;
}
