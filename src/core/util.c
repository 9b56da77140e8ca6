/*
 * util.c: owns small process-level facts and helpers that several layers
 * need: the monotonic clock, the boot id, the pid namespace (this
 * process's and another's), the one parser of /proc/<pid>/stat (state,
 * start time), the one reader of /proc's "Key: numbers" files
 * (/proc/<pid>/status, fdinfo), the one growable array, option-struct
 * copying, the version functions, and the runtime directory: the default
 * one (XDG_RUNTIME_DIR, else /tmp/gpuipc-<uid>) and the checks that make
 * it private (ours, 0700).
 */
#include "core_int.h"

#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

unsigned gpuipc_version(void) { return GPUIPC_VERSION_HEX; }
const char *gpuipc_version_string(void) { return GPUIPC_VERSION_STRING; }


uint64_t gpuipc__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int hexval(int c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

void gpuipc__appendf(char *buf, size_t cap, const char *fmt, ...) {
  size_t len = strlen(buf);
  if (len + 1 >= cap)
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + len, cap - len, fmt, ap);
  va_end(ap);
}

gpuipc_status gpuipc__boot_id(uint8_t out[16]) {
  char buf[64] = {0};
  int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return gpuipc__fail_errno(errno, "open", "/proc/sys/kernel/random/boot_id");
  ssize_t n;
  GPUIPC__EINTR_RETRY(n, read(fd, buf, sizeof buf - 1));
  int err = errno;
  close(fd);
  if (n < 0)
    return gpuipc__fail_errno(err, "read", "/proc/sys/kernel/random/boot_id");
  int k = 0;
  for (ssize_t i = 0; i + 1 < n && k < 16; i++) {
    int hi = hexval((unsigned char)buf[i]);
    if (hi < 0)
      continue;
    int lo = hexval((unsigned char)buf[i + 1]);
    if (lo < 0)
      continue;
    out[k++] = (uint8_t)(hi << 4 | lo);
    i++;
  }
  if (k != 16)
    return gpuipc__fail(GPUIPC_E_SYSTEM, "boot_id: cannot parse '%s'", buf);
  return GPUIPC_OK;
}

uint64_t gpuipc__pid_namespace(void) {
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0)
    return 0;
  return (uint64_t)st.st_ino;
}

uint64_t gpuipc__proc_pid_namespace(int pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/ns/pid", pid);
  struct stat st;
  if (pid <= 0 || stat(path, &st) != 0)
    return 0;
  return (uint64_t)st.st_ino;
}

gpuipc_status gpuipc__proc_stat(int pid, char *state, uint64_t *start_time) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT || errno == ESRCH
               ? GPUIPC_E_NOT_FOUND
               : gpuipc__fail_errno(errno, "open", "%s", path);
  ssize_t n;
  GPUIPC__EINTR_RETRY(n, read(fd, buf, sizeof buf - 1));
  int err = errno;
  close(fd);
  if (n < 0)
    return err == ESRCH ? GPUIPC_E_NOT_FOUND
                        : gpuipc__fail_errno(err, "read", "%s", path);
  buf[n] = '\0';
  /* The command name (field 2) may hold spaces and parentheses: count
   * fields from the last ')'. Field 3 is the state, 22 the start time. */
  char *p = strrchr(buf, ')');
  if (p == NULL || p[1] != ' ' || p[2] == '\0')
    return gpuipc__fail(GPUIPC_E_SYSTEM, "%s: unexpected format", path);
  if (state)
    *state = p[2];
  p++;
  int field = 2;
  while (*p && field < 22) {
    if (*p == ' ') {
      field++;
      while (*p == ' ')
        p++;
      continue;
    }
    p++;
  }
  if (field != 22)
    return gpuipc__fail(GPUIPC_E_SYSTEM, "%s: unexpected format", path);
  if (start_time)
    *start_time = strtoull(p, NULL, 10);
  return GPUIPC_OK;
}

gpuipc_status gpuipc__proc_field(const char *path, const char *key,
                                 long *first, long *last) {
  char buf[4096];
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT || errno == ESRCH ? GPUIPC_E_NOT_FOUND
                                             : GPUIPC_E_SYSTEM;
  ssize_t n;
  GPUIPC__EINTR_RETRY(n, read(fd, buf, sizeof buf - 1));
  close(fd);
  if (n <= 0) /* a process reaped between the open and the read: ESRCH */
    return GPUIPC_E_NOT_FOUND;
  buf[n] = '\0';
  size_t klen = strlen(key);
  const char *t = buf;
  while (!(strncmp(t, key, klen) == 0 && t[klen] == ':')) {
    t = strchr(t, '\n');
    if (t == NULL)
      return GPUIPC_E_NOT_SUPPORTED;
    t++;
  }
  t += klen + 1;
  for (bool seen = false;;) {
    while (*t == ' ' || *t == '\t')
      t++;
    if (*t == '\n') /* strtol would read on into the next line */
      break;
    char *end;
    long v = strtol(t, &end, 10);
    if (end == t)
      break;
    if (first && !seen)
      *first = v;
    if (last)
      *last = v;
    seen = true;
    t = end;
  }
  return GPUIPC_OK;
}

uint64_t gpuipc__process_start_time(int pid) {
  uint64_t t = 0;
  return gpuipc__proc_stat(pid, NULL, &t) == GPUIPC_OK ? t : 0;
}

void *gpuipc__grow(void *p, size_t *cap, size_t need, size_t elem,
                   size_t first) {
  if (need <= *cap)
    return p;
  size_t n = *cap ? *cap : first ? first : 1;
  while (n < need)
    n = n > SIZE_MAX / 2 ? need : 2 * n;
  if (elem == 0 || n > SIZE_MAX / elem)
    return NULL;
  void *q = realloc(p, n * elem);
  if (q != NULL)
    *cap = n;
  return q;
}

gpuipc_status gpuipc__options_copy(void *dst, size_t dst_size, const void *src,
                                   size_t min_size, const char *what,
                                   const char *init_name) {
  if (src != NULL) {
    size_t n;
    memcpy(&n, src, sizeof n);
    if (n < min_size || n < sizeof(size_t) || n > ((size_t)1 << 16))
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "%s.size %zu: set it with %s", what, n, init_name);
    memcpy(dst, src, n < dst_size ? n : dst_size);
  }
  memcpy(dst, &dst_size, sizeof dst_size);
  return GPUIPC_OK;
}

GPUIPC__PARAM(xdg_runtime_dir, "XDG_RUNTIME_DIR", GPUIPC__PARAM_EACH_USE,
              "/tmp/gpuipc-<uid>",
              "sockets and stats segments live in $XDG_RUNTIME_DIR/gpuipc when "
              "it is a usable directory of this user")

void gpuipc__default_runtime_dir(char *dir, size_t cap, char *why,
                                 size_t why_cap, bool *from_xdg) {
  const char *xdg = param_xdg_runtime_dir();
  char scratch[256];
  if (why == NULL) {
    why = scratch;
    why_cap = sizeof scratch;
  }
  why[0] = '\0';
  struct stat st;
  bool ok = false;
  if (xdg == NULL || xdg[0] == '\0')
    snprintf(why, why_cap, "XDG_RUNTIME_DIR is not set");
  else if (xdg[0] != '/')
    snprintf(why, why_cap, "XDG_RUNTIME_DIR=%s is not an absolute path", xdg);
  else if (strlen(xdg) + sizeof "/gpuipc" > cap)
    snprintf(why, why_cap, "XDG_RUNTIME_DIR is too long");
  else if (stat(xdg, &st) != 0)
    snprintf(why, why_cap, "XDG_RUNTIME_DIR=%s: %s", xdg, strerror(errno));
  else if (!S_ISDIR(st.st_mode))
    snprintf(why, why_cap, "XDG_RUNTIME_DIR=%s is not a directory", xdg);
  else if (st.st_uid != geteuid())
    snprintf(why, why_cap, "XDG_RUNTIME_DIR=%s is owned by uid %u, not by us",
             xdg, (unsigned)st.st_uid);
  else if (access(xdg, W_OK | X_OK) != 0)
    snprintf(why, why_cap, "XDG_RUNTIME_DIR=%s is not writable", xdg);
  else
    ok = true;
  if (ok)
    snprintf(dir, cap, "%s/gpuipc", xdg);
  else
    snprintf(dir, cap, "/tmp/gpuipc-%u", (unsigned)geteuid());
  if (from_xdg)
    *from_xdg = ok;
}

/* The one check of a runtime directory (sockets, stats segments). Nothing
 * is recorded: the caller decides whether the reason in why is an error
 * (the transport) or only means "do without" (the stats segment). */
gpuipc_status gpuipc__private_dir(const char *dir, char *why, size_t why_cap) {
  char scratch[8];
  if (why == NULL || why_cap == 0) {
    why = scratch;
    why_cap = sizeof scratch;
  }
  struct stat st;
  if (lstat(dir, &st) != 0) {
    if (errno != ENOENT)
      goto sys_lstat;
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
      int err = errno;
      snprintf(why, why_cap, "mkdir: %s (runtime directory %s)", strerror(err),
               dir);
      return gpuipc__status_from_errno(err);
    }
    if (lstat(dir, &st) != 0)
      goto sys_lstat;
    /* mkdir's mode went through the umask, which can only remove bits; a
     * fresh directory of ours may need them back. */
    if (S_ISDIR(st.st_mode) && st.st_uid == geteuid() &&
        (st.st_mode & 07777) != 0700 && chmod(dir, 0700) == 0)
      st.st_mode = (st.st_mode & ~(mode_t)07777) | 0700;
  }
  if (!S_ISDIR(st.st_mode)) {
    snprintf(why, why_cap,
             "runtime directory %s is not a directory (a link or file is "
             "there): refusing it",
             dir);
    return GPUIPC_E_PERMISSION;
  }
  if (st.st_uid != geteuid()) {
    snprintf(why, why_cap,
             "runtime directory %s belongs to uid %u, not to us (uid %u): "
             "refusing it",
             dir, (unsigned)st.st_uid, (unsigned)geteuid());
    return GPUIPC_E_PERMISSION;
  }
  if ((st.st_mode & 07777) != 0700) {
    snprintf(why, why_cap,
             "runtime directory %s has mode %04o, not 0700: refusing it "
             "(chmod 700 it, or remove it)",
             dir, (unsigned)(st.st_mode & 07777));
    return GPUIPC_E_PERMISSION;
  }
  return GPUIPC_OK;
sys_lstat: {
  int err = errno;
  snprintf(why, why_cap, "lstat: %s (runtime directory %s)", strerror(err),
           dir);
  return gpuipc__status_from_errno(err);
}
}
