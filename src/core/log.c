/*
 * log.c: owns the logger. The level comes from GPUIPC_LOG, the destination
 * from GPUIPC_LOG_FILE ("%p" becomes the pid, "%h" the host name; default
 * stderr), each read once (parameters declared below).
 * GPUIPC_LOG_SUBSYS (read once) selects the modules whose INFO, DEBUG
 * and TRACE lines are written, as NCCL_DEBUG_SUBSYS does: a comma-separated
 * list of module names ("all": every one), or, starting with '^', the
 * modules not to write; warnings and errors are always written.
 * Every line starts "host:pid:tid gpuipc LEVEL [module] " and is written
 * with one write(2), so lines from several threads or processes sharing a
 * file do not interleave.
 */
#include "core_int.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static atomic_int level_cache = -1;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static int log_fd = -1;     /* -1: not opened yet */
static pid_t log_fd_pid;    /* the pid whose "%p" the file name carries */
static char hostname[64];

static const char *const level_names[] = {"OFF",  "ERROR", "WARN",
                                          "INFO", "DEBUG", "TRACE"};

GPUIPC__PARAM(log_level, "GPUIPC_LOG", GPUIPC__PARAM_ONCE, "warn",
              "log level: off (or none), error, warn, info, debug, trace; "
              "anything else is warn")
GPUIPC__PARAM(log_subsys, "GPUIPC_LOG_SUBSYS", GPUIPC__PARAM_ONCE, "all",
              "modules whose info, debug and trace lines are written: "
              "comma-separated names or all; ^ first: the modules to leave out")
GPUIPC__PARAM(log_file, "GPUIPC_LOG_FILE", GPUIPC__PARAM_ONCE, "stderr",
              "the log file; %p becomes the pid, %h the host name")

/* GPUIPC_LOG_SUBSYS, parsed once (under log_lock). */
static bool subsys_read;
static bool subsys_exclude; /* the list names the modules not to write */
static char subsys_list[256]; /* ",name,name," lower case; "" none given */

static void subsys_parse(void) {
  subsys_read = true;
  const char *e = param_log_subsys();
  if (e == NULL)
    return;
  while (*e == ' ')
    e++;
  if (*e == '\0')
    return; /* set but empty: as if unset */
  if (*e == '^') {
    subsys_exclude = true;
    e++;
  }
  size_t o = 0;
  subsys_list[o++] = ',';
  for (; *e && o + 2 < sizeof subsys_list; e++) {
    char ch = *e;
    if (ch == ' ')
      continue;
    subsys_list[o++] = (ch >= 'A' && ch <= 'Z') ? (char)(ch - 'A' + 'a') : ch;
  }
  subsys_list[o++] = ',';
  subsys_list[o] = '\0';
}

/* Whether a line of this level and module is written. Called with
 * log_lock held. */
static bool subsys_on(int level, const char *module) {
  if (!subsys_read)
    subsys_parse();
  if (level <= GPUIPC_LOG_WARN || subsys_list[0] == '\0')
    return true;
  if (strstr(subsys_list, ",all,"))
    return !subsys_exclude;
  char key[40];
  snprintf(key, sizeof key, ",%s,", module);
  bool named = strstr(subsys_list, key) != NULL;
  return subsys_exclude ? !named : named;
}

static int parse_level(const char *s) {
  if (s == NULL || *s == '\0')
    return GPUIPC_LOG_WARN;
  static const struct {
    const char *name;
    int level;
  } names[] = {{"off", GPUIPC_LOG_OFF},     {"none", GPUIPC_LOG_OFF},
               {"error", GPUIPC_LOG_ERROR}, {"warn", GPUIPC_LOG_WARN},
               {"warning", GPUIPC_LOG_WARN}, {"info", GPUIPC_LOG_INFO},
               {"debug", GPUIPC_LOG_DEBUG}, {"trace", GPUIPC_LOG_TRACE}};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(names); i++)
    if (strcasecmp(s, names[i].name) == 0)
      return names[i].level;
  return GPUIPC_LOG_WARN;
}

int gpuipc__log_level_get(void) {
  int l = atomic_load_explicit(&level_cache, memory_order_relaxed);
  if (GPUIPC__LIKELY(l >= 0))
    return l;
  l = parse_level(param_log_level());
  int expected = -1;
  atomic_compare_exchange_strong(&level_cache, &expected, l);
  return atomic_load(&level_cache);
}

void gpuipc_log_set_level(gpuipc_log_level level) {
  if ((int)level < GPUIPC_LOG_OFF)
    level = GPUIPC_LOG_OFF;
  if ((int)level > GPUIPC_LOG_TRACE)
    level = GPUIPC_LOG_TRACE;
  atomic_store(&level_cache, (int)level);
}

gpuipc_log_level gpuipc_log_get_level(void) {
  return (gpuipc_log_level)gpuipc__log_level_get();
}

/* Expands "%p" to the pid and "%h" to the host name. */
static void expand_path(const char *tmpl, char *out, size_t n) {
  size_t o = 0;
  for (const char *p = tmpl; *p && o + 1 < n; p++) {
    if (p[0] == '%' && (p[1] == 'p' || p[1] == 'h')) {
      int w = p[1] == 'p' ? snprintf(out + o, n - o, "%d", (int)getpid())
                          : snprintf(out + o, n - o, "%s", hostname);
      if (w < 0 || (size_t)w >= n - o) {
        o = n - 1;
        break;
      }
      o += (size_t)w;
      p++;
    } else {
      out[o++] = *p;
    }
  }
  out[o] = '\0';
}

/* Called with log_lock held. Re-opens after fork so that "%p" names the
 * child's own file. */
static int log_target(void) {
  if (hostname[0] == '\0') {
    if (gethostname(hostname, sizeof hostname - 1) != 0)
      strcpy(hostname, "?");
    char *dot = strchr(hostname, '.');
    if (dot)
      *dot = '\0';
  }
  const char *tmpl = param_log_file();
  if (tmpl == NULL || *tmpl == '\0')
    return STDERR_FILENO;
  pid_t pid = getpid();
  if (log_fd >= 0 && log_fd_pid == pid)
    return log_fd;
  if (log_fd >= 0 && strstr(tmpl, "%p") == NULL) {
    log_fd_pid = pid; /* same file: keep it */
    return log_fd;
  }
  if (log_fd >= 0)
    close(log_fd);
  char path[4096];
  expand_path(tmpl, path, sizeof path);
  log_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  log_fd_pid = pid;
  return log_fd >= 0 ? log_fd : STDERR_FILENO;
}

void gpuipc__log_write(int level, const char *module, const char *fmt, ...) {
  int saved_errno = errno;
  char line[2048];
  pthread_mutex_lock(&log_lock);
  if (!subsys_on(level, module)) {
    pthread_mutex_unlock(&log_lock);
    errno = saved_errno;
    return;
  }
  int fd = log_target();
  int n = snprintf(line, sizeof line, "%s:%d:%ld gpuipc %s [%s] ", hostname,
                   (int)getpid(), (long)syscall(SYS_gettid),
                   level_names[level < 0 ? 0 : level > 5 ? 5 : level], module);
  pthread_mutex_unlock(&log_lock);
  if (n < 0)
    n = 0;
  if ((size_t)n < sizeof line - 2) {
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - 1 - (size_t)n, fmt, ap);
    va_end(ap);
    if (m > 0)
      n += m;
  }
  if ((size_t)n > sizeof line - 2)
    n = (int)(sizeof line - 2);
  line[n++] = '\n';
  size_t off = 0;
  while (off < (size_t)n) {
    ssize_t w = write(fd, line + off, (size_t)n - off);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      break;
    off += (size_t)w;
  }
  errno = saved_errno;
}
