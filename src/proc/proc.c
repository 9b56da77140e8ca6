/*
 * proc.c: owns the process layer: the spawn helper (posix_spawn and a
 * connection over an inherited socket pair, its fd named to the child in
 * GPUIPC_CONN_FD), the child's side of it (gpuipc_spawn_connection),
 * waiting for, signalling and reaping children, and worker groups built on
 * it, with the worker's side (gpuipc_worker_index). Buffers travel on the
 * connections it makes like on any other (gpuipc/conn.h); this file never
 * handles one.
 *
 * posix_spawn rather than fork: a CUDA context does not survive fork (the
 * driver's threads and mappings are gone in the child), and a forked child
 * of a large CUDA process also pays for copying its page tables. glibc's
 * posix_spawn uses clone(CLONE_VM|CLONE_VFORK) and execs at once, so no
 * CUDA state is ever touched in between.
 */
#include "proc_int.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

/* ---- children ------------------------------------------------------------------ */

struct gpuipc_child {
  pid_t pid;
  gpuipc_conn *conn;
  bool reaped;
  gpuipc_child_status status;
};

static void decode_wait_status(int ws, gpuipc_child_status *st) {
  memset(st, 0, sizeof *st);
  if (WIFEXITED(ws)) {
    st->state = GPUIPC_CHILD_EXITED;
    st->code = WEXITSTATUS(ws);
  } else if (WIFSIGNALED(ws)) {
    st->state = GPUIPC_CHILD_SIGNALED;
    st->signal = WTERMSIG(ws);
#ifdef WCOREDUMP
    st->core_dumped = WCOREDUMP(ws) ? 1 : 0;
#endif
  }
}

static const char *signal_name(int sig) {
  switch (sig) {
  case SIGHUP: return "SIGHUP";
  case SIGINT: return "SIGINT";
  case SIGQUIT: return "SIGQUIT";
  case SIGILL: return "SIGILL";
  case SIGTRAP: return "SIGTRAP";
  case SIGABRT: return "SIGABRT";
  case SIGBUS: return "SIGBUS";
  case SIGFPE: return "SIGFPE";
  case SIGKILL: return "SIGKILL";
  case SIGUSR1: return "SIGUSR1";
  case SIGSEGV: return "SIGSEGV";
  case SIGUSR2: return "SIGUSR2";
  case SIGPIPE: return "SIGPIPE";
  case SIGALRM: return "SIGALRM";
  case SIGTERM: return "SIGTERM";
  default: return "?";
  }
}

const char *gpuipc_child_status_str(const gpuipc_child_status *st, char *buf,
                                    size_t cap) {
  if (buf == NULL || cap == 0)
    return buf;
  if (st == NULL) {
    snprintf(buf, cap, "unknown");
    return buf;
  }
  switch (st->state) {
  case GPUIPC_CHILD_EXITED:
    snprintf(buf, cap, "exit code %d", st->code);
    break;
  case GPUIPC_CHILD_SIGNALED:
    snprintf(buf, cap, "killed by signal %d (%s)%s", st->signal,
             signal_name(st->signal), st->core_dumped ? ", core dumped" : "");
    break;
  default:
    snprintf(buf, cap, "running");
    break;
  }
  return buf;
}

/* One non-blocking reap attempt. true when the child has ended. */
static bool try_reap(gpuipc_child *c) {
  if (c->reaped)
    return true;
  int ws = 0;
  pid_t r;
  GPUIPC__EINTR_RETRY(r, waitpid(c->pid, &ws, WNOHANG));
  if (r == c->pid) {
    decode_wait_status(ws, &c->status);
    c->reaped = true;
  } else if (r < 0 && errno == ECHILD) {
    /* Someone else reaped it (a SIGCHLD handler with waitpid(-1)): it has
     * ended, how is unknown. */
    c->status.state = GPUIPC_CHILD_EXITED;
    c->status.code = -1;
    c->reaped = true;
  }
  return c->reaped;
}

/* Waits for the child to end; polls with a growing sleep (1 ms to 20 ms)
 * so that no SIGCHLD handler has to be installed behind the caller's back. */
static bool reap_within(gpuipc_child *c, int timeout_ms) {
  uint64_t deadline =
      timeout_ms < 0 ? UINT64_MAX
                     : gpuipc__now_ns() + (uint64_t)timeout_ms * 1000000ull;
  long sleep_us = 1000;
  for (;;) {
    if (try_reap(c))
      return true;
    uint64_t now = gpuipc__now_ns();
    if (now >= deadline)
      return false;
    uint64_t left_us = (deadline - now) / 1000;
    long us = (uint64_t)sleep_us < left_us ? sleep_us : (long)left_us;
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
    if (sleep_us < 20000)
      sleep_us *= 2;
  }
}

static void kill_and_reap(gpuipc_child *c) {
  if (!try_reap(c)) {
    kill(c->pid, SIGKILL);
    reap_within(c, -1);
  }
}

/* Builds the child's environment: base (or environ) without our variables
 * and without names that add overrides, then add, then ours. */
static bool env_name_eq(const char *entry, const char *name_eq) {
  size_t n = strcspn(name_eq, "=");
  return strncmp(entry, name_eq, n) == 0 && entry[n] == '=';
}

static char **build_env(char *const *base, char *const *add, char *const *ours,
                        int n_ours) {
  if (base == NULL)
    base = environ;
  size_t nb = 0, na = 0;
  while (base && base[nb])
    nb++;
  while (add && add[na])
    na++;
  char **env = calloc(nb + na + (size_t)n_ours + 1, sizeof *env);
  if (env == NULL)
    return NULL;
  size_t k = 0;
  for (size_t i = 0; i < nb; i++) {
    bool drop = false;
    for (int j = 0; j < n_ours && !drop; j++)
      drop = env_name_eq(base[i], ours[j]);
    for (size_t j = 0; j < na && !drop; j++)
      drop = env_name_eq(base[i], add[j]);
    if (!drop)
      env[k++] = base[i];
  }
  for (size_t j = 0; j < na; j++) {
    bool drop = false;
    for (int i = 0; i < n_ours && !drop; i++)
      drop = env_name_eq(add[j], ours[i]);
    if (!drop)
      env[k++] = add[j];
  }
  for (int j = 0; j < n_ours; j++)
    env[k++] = ours[j];
  env[k] = NULL;
  return env;
}

static gpuipc_status read_spawn_opts(const gpuipc_spawn_options *in,
                                     gpuipc_spawn_options *o) {
  gpuipc_spawn_options d = GPUIPC_SPAWN_OPTIONS_INIT;
  *o = d;
  if (in == NULL)
    return GPUIPC_OK;
  if (in->size < sizeof(size_t) || in->size > (1u << 16))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_spawn: options size %zu", in->size);
  memcpy(o, in, in->size < sizeof *o ? in->size : sizeof *o);
  o->size = sizeof *o;
  return GPUIPC_OK;
}

/* Starts the child and completes the handshake; extra: more of our
 * variables (the worker index), n_extra of them. */
static gpuipc_status spawn_impl(const char *path, char *const argv[],
                                const gpuipc_spawn_options *opts_in,
                                char *const *extra, int n_extra,
                                gpuipc_child **out) {
  if (path == NULL || argv == NULL || argv[0] == NULL || out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_spawn: NULL path, argv, argv[0] or out");
  *out = NULL;
  gpuipc_spawn_options o;
  GPUIPC__CHECK(read_spawn_opts(opts_in, &o));

  gpuipc_status s = GPUIPC_OK;
  int sv[2] = {-1, -1};
  int tmp = -1;
  char **env = NULL;
  bool fa_init = false, attr_init = false;
  posix_spawn_file_actions_t fa;
  posix_spawnattr_t attr;
  gpuipc_child *c = calloc(1, sizeof *c);
  if (c == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_spawn");
  c->pid = -1;

  GPUIPC__CHECK_GOTO(gpuipc_conn_pair(sv), s, out);
  /* The pair is close-on-exec so that no other child started meanwhile by
   * another thread inherits it. For this child, sv[1] is re-made without
   * close-on-exec by a dup2 in the file actions: dup2 onto a different
   * number clears the flag on the copy, whereas dup2(fd, fd) is a no-op on
   * older C libraries. tmp (close-on-exec) is the source of that dup2. */
  tmp = fcntl(sv[1], F_DUPFD_CLOEXEC, 0);
  if (tmp < 0) {
    s = gpuipc__fail_errno(errno, "fcntl", "F_DUPFD_CLOEXEC");
    goto out;
  }
  char fd_var[64];
  snprintf(fd_var, sizeof fd_var, GPUIPC_ENV_CONN_FD "=%d", sv[1]);
  char *ours[8];
  int n_ours = 0;
  ours[n_ours++] = fd_var;
  for (int i = 0; i < n_extra && n_ours < 8; i++)
    ours[n_ours++] = extra[i];
  env = build_env(o.envp, o.env_add, ours, n_ours);
  if (env == NULL) {
    s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_spawn: environment");
    goto out;
  }
  int err = posix_spawn_file_actions_init(&fa);
  if (err == 0) {
    fa_init = true;
    err = posix_spawn_file_actions_adddup2(&fa, tmp, sv[1]);
  }
  if (err == 0) {
    err = posix_spawnattr_init(&attr);
    attr_init = err == 0;
  }
  if (err == 0) {
    /* The child starts with default signal dispositions for the signals a
     * parent commonly ignores, and an empty mask. */
    sigset_t def, none;
    sigemptyset(&def);
    sigaddset(&def, SIGPIPE);
    sigaddset(&def, SIGCHLD);
    sigemptyset(&none);
    err = posix_spawnattr_setsigdefault(&attr, &def);
    if (err == 0)
      err = posix_spawnattr_setsigmask(&attr, &none);
    if (err == 0)
      err = posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF |
                                                POSIX_SPAWN_SETSIGMASK);
  }
  if (err != 0) {
    s = gpuipc__fail_errno(err, "posix_spawn_file_actions", NULL);
    goto out;
  }
  pid_t pid = -1;
  err = o.search_path ? posix_spawnp(&pid, path, &fa, &attr, argv, env)
                      : posix_spawn(&pid, path, &fa, &attr, argv, env);
  if (err != 0) {
    s = gpuipc__fail_errno(err, o.search_path ? "posix_spawnp" : "posix_spawn",
                           "%s", path);
    if (err == ENOENT)
      s = gpuipc__fail(GPUIPC_E_NOT_FOUND, "%s: %s: no such program",
                       o.search_path ? "posix_spawnp" : "posix_spawn", path);
    goto out;
  }
  c->pid = pid;
  close(tmp);
  tmp = -1;
  close(sv[1]);
  sv[1] = -1;
  GPUIPC__DEBUG("proc", "spawned %s as pid %d", path, (int)pid);

  /* The handshake: the child must call gpuipc_spawn_connection. */
  int fd0 = sv[0];
  sv[0] = -1;
  s = gpuipc_conn_from_fd(fd0, o.conn, &c->conn);
  if (s != GPUIPC_OK) {
    gpuipc_status hs = s;
    char why[256];
    snprintf(why, sizeof why, "%s", gpuipc_last_error());
    if (reap_within(c, 200)) {
      char st[96];
      s = gpuipc__fail(GPUIPC_E_PEER_GONE,
                       "gpuipc_spawn: %s (pid %d) ended before connecting: "
                       "%s (did it call gpuipc_spawn_connection?)",
                       path, (int)pid,
                       gpuipc_child_status_str(&c->status, st, sizeof st));
    } else {
      s = gpuipc__fail(hs, "gpuipc_spawn: %s (pid %d) did not connect: %s",
                       path, (int)pid, why);
    }
    goto out;
  }
out:
  if (fa_init)
    posix_spawn_file_actions_destroy(&fa);
  if (attr_init)
    posix_spawnattr_destroy(&attr);
  free(env);
  if (tmp >= 0)
    close(tmp);
  if (sv[0] >= 0)
    close(sv[0]);
  if (sv[1] >= 0)
    close(sv[1]);
  if (s != GPUIPC_OK) {
    gpuipc_conn_close(c->conn);
    if (c->pid > 0)
      kill_and_reap(c);
    free(c);
    return s;
  }
  *out = c;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_spawn(const char *path, char *const argv[],
                           const gpuipc_spawn_options *opts,
                           gpuipc_child **child) {
  return spawn_impl(path, argv, opts, NULL, 0, child);
}

gpuipc_conn *gpuipc_child_get_conn(const gpuipc_child *child) {
  return child ? child->conn : NULL;
}

gpuipc_conn *gpuipc_child_take_conn(gpuipc_child *child) {
  if (child == NULL)
    return NULL;
  gpuipc_conn *c = child->conn;
  child->conn = NULL;
  return c;
}

int gpuipc_child_get_pid(const gpuipc_child *child) {
  return child ? (int)child->pid : -1;
}

gpuipc_status gpuipc_child_wait(gpuipc_child *child, int timeout_ms,
                                gpuipc_child_status *status) {
  if (child == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_child_wait: NULL");
  bool ended = reap_within(child, timeout_ms);
  if (status)
    *status = child->status;
  if (!ended)
    return gpuipc__fail(GPUIPC_E_TIMEOUT,
                        "gpuipc_child_wait: pid %d still runs after %d ms",
                        (int)child->pid, timeout_ms);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_child_kill(gpuipc_child *child, int sig) {
  if (child == NULL || sig < 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_child_kill: NULL");
  if (try_reap(child))
    return GPUIPC_OK;
  if (kill(child->pid, sig) != 0)
    return gpuipc__fail_errno(errno, "kill", "pid %d signal %d",
                              (int)child->pid, sig);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_child_destroy(gpuipc_child *child, int timeout_ms,
                                   gpuipc_child_status *status) {
  if (child == NULL)
    return GPUIPC_OK;
  gpuipc_conn_close(child->conn);
  child->conn = NULL;
  gpuipc_status s = GPUIPC_OK;
  if (!reap_within(child, timeout_ms)) {
    s = gpuipc__fail(GPUIPC_E_TIMEOUT,
                     "gpuipc_child_destroy: pid %d still ran after %d ms: "
                     "killed",
                     (int)child->pid, timeout_ms);
    kill_and_reap(child);
  }
  if (status)
    *status = child->status;
  free(child);
  return s;
}

GPUIPC__PARAM(conn_fd, GPUIPC_ENV_CONN_FD, GPUIPC__PARAM_CHILD, NULL,
              "set by gpuipc_spawn for the child: its end of the connection "
              "(gpuipc_spawn_connection takes it and removes the variable)")
GPUIPC__PARAM(worker_index, GPUIPC_ENV_WORKER_INDEX, GPUIPC__PARAM_CHILD,
              NULL, "set for each worker of a gpuipc_group_start group: "
              "its index (gpuipc_worker_index)")
GPUIPC__PARAM(worker_count, GPUIPC_ENV_WORKER_COUNT, GPUIPC__PARAM_CHILD,
              NULL, "set for each worker of a gpuipc_group_start group: "
              "how many workers the group has")

/* Parses a whole non-negative decimal int; -1 when it is not one. */
static int parse_nonneg(const char *v) {
  if (v == NULL || *v == '\0')
    return -1;
  char *end = NULL;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno != 0 || *end != '\0' || x < 0 || x > 1 << 30)
    return -1;
  return (int)x;
}

gpuipc_status gpuipc_spawn_connection(const gpuipc_conn_options *opts,
                                      gpuipc_conn **conn) {
  if (conn == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_spawn_connection: NULL conn");
  *conn = NULL;
  const char *v = param_conn_fd();
  if (v == NULL)
    return gpuipc__fail(GPUIPC_E_NOT_FOUND,
                        "gpuipc_spawn_connection: " GPUIPC_ENV_CONN_FD
                        " is not set: this process was not started by "
                        "gpuipc_spawn (or picked its connection up already)");
  char shown[32];
  snprintf(shown, sizeof shown, "%s", v);
  int fd = parse_nonneg(v);
  unsetenv(GPUIPC_ENV_CONN_FD);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_spawn_connection: " GPUIPC_ENV_CONN_FD
                        "=%s names no open socket",
                        shown);
  /* From here on the descriptor is ours: keep it from our own children. */
  (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
  return gpuipc_conn_from_fd(fd, opts, conn);
}

/* ---- worker groups ------------------------------------------------------------- */

struct gpuipc_group {
  int n;
  gpuipc_child **kids;
  bool *reported;
};

#define GROUP_MAX 1024

gpuipc_status gpuipc_group_start(const char *path, char *const argv[], int n,
                                 const gpuipc_spawn_options *opts,
                                 gpuipc_group **out) {
  if (out == NULL || n < 1 || n > GROUP_MAX)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_group_start: %d workers (1..%d) or NULL out", n,
                        GROUP_MAX);
  *out = NULL;
  gpuipc_group *g = calloc(1, sizeof *g);
  if (g == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_group_start");
  g->kids = calloc((size_t)n, sizeof *g->kids);
  g->reported = calloc((size_t)n, sizeof *g->reported);
  if (g->kids == NULL || g->reported == NULL) {
    free(g->kids);
    free(g->reported);
    free(g);
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_group_start");
  }
  gpuipc_status s = GPUIPC_OK;
  for (int i = 0; i < n; i++) {
    char idx[48], cnt[48];
    snprintf(idx, sizeof idx, GPUIPC_ENV_WORKER_INDEX "=%d", i);
    snprintf(cnt, sizeof cnt, GPUIPC_ENV_WORKER_COUNT "=%d", n);
    char *extra[2] = {idx, cnt};
    s = spawn_impl(path, argv, opts, extra, 2, &g->kids[i]);
    if (s != GPUIPC_OK) {
      char why[512];
      snprintf(why, sizeof why, "%s", gpuipc_last_error());
      s = gpuipc__fail(s, "gpuipc_group_start: worker %d of %d: %s", i, n, why);
      break;
    }
    g->n = i + 1;
  }
  if (s != GPUIPC_OK) {
    gpuipc_status keep = s;
    char why[512];
    snprintf(why, sizeof why, "%s", gpuipc_last_error());
    gpuipc_group_stop(g, 1000, NULL);
    return gpuipc__fail(keep, "%s", why);
  }
  *out = g;
  return GPUIPC_OK;
}

int gpuipc_group_get_size(const gpuipc_group *g) { return g ? g->n : 0; }

gpuipc_child *gpuipc_group_get_child(const gpuipc_group *g, int i) {
  return g && i >= 0 && i < g->n ? g->kids[i] : NULL;
}

gpuipc_conn *gpuipc_group_get_conn(const gpuipc_group *g, int i) {
  return gpuipc_child_get_conn(gpuipc_group_get_child(g, i));
}

gpuipc_status gpuipc_group_check(gpuipc_group *g, int timeout_ms, int *worker,
                                 gpuipc_child_status *status) {
  if (g == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_group_check: NULL");
  if (worker)
    *worker = -1;
  uint64_t deadline =
      timeout_ms < 0 ? UINT64_MAX
                     : gpuipc__now_ns() + (uint64_t)timeout_ms * 1000000ull;
  for (;;) {
    int alive = 0;
    for (int i = 0; i < g->n; i++) {
      if (g->reported[i])
        continue;
      gpuipc_child *c = g->kids[i];
      /* Progress first: it reads releases, and learns of a closed peer,
       * which makes the connection reclaim what the worker held. */
      if (c->conn)
        (void)gpuipc_conn_progress(c->conn, 0);
      if (try_reap(c)) {
        /* Once more, so the connection sees the end of the stream of a
         * process that is now surely gone. */
        if (c->conn)
          (void)gpuipc_conn_progress(c->conn, 0);
        g->reported[i] = true;
        if (worker)
          *worker = i;
        if (status)
          *status = c->status;
        char st[96];
        return gpuipc__fail(GPUIPC_E_PEER_GONE, "worker %d (pid %d) %s", i,
                            (int)c->pid,
                            gpuipc_child_status_str(&c->status, st, sizeof st));
      }
      alive++;
    }
    if (alive == 0)
      return gpuipc__fail(GPUIPC_E_NOT_FOUND,
                          "gpuipc_group_check: every worker has ended");
    uint64_t now = gpuipc__now_ns();
    if (now >= deadline)
      return GPUIPC_OK;
    uint64_t left_ms = (deadline - now) / 1000000ull;
    struct timespec ts = {0, (left_ms < 5 ? (long)left_ms : 5) * 1000000L};
    if (ts.tv_nsec == 0)
      ts.tv_nsec = 200000;
    nanosleep(&ts, NULL);
  }
}

gpuipc_status gpuipc_group_stop(gpuipc_group *g, int timeout_ms,
                                gpuipc_child_status *statuses) {
  if (g == NULL)
    return GPUIPC_OK;
  for (int i = 0; i < g->n; i++) {
    gpuipc_conn_close(g->kids[i]->conn);
    g->kids[i]->conn = NULL;
  }
  uint64_t deadline =
      timeout_ms < 0 ? UINT64_MAX
                     : gpuipc__now_ns() + (uint64_t)timeout_ms * 1000000ull;
  gpuipc_status s = GPUIPC_OK;
  for (int i = 0; i < g->n; i++) {
    uint64_t now = gpuipc__now_ns();
    int left = deadline == UINT64_MAX ? -1
               : now >= deadline      ? 0
                                      : (int)((deadline - now) / 1000000ull);
    gpuipc_child_status st;
    gpuipc_status r = gpuipc_child_destroy(g->kids[i], left, &st);
    if (r != GPUIPC_OK && s == GPUIPC_OK)
      s = r;
    if (statuses)
      statuses[i] = st;
  }
  free(g->kids);
  free(g->reported);
  free(g);
  if (s != GPUIPC_OK)
    return gpuipc__fail(s, "gpuipc_group_stop: some workers had to be killed");
  return GPUIPC_OK;
}

gpuipc_status gpuipc_worker_index(int *index, int *count) {
  int i = parse_nonneg(param_worker_index());
  int n = parse_nonneg(param_worker_count());
  if (i < 0 || n <= 0 || i >= n)
    return gpuipc__fail(GPUIPC_E_NOT_FOUND,
                        "gpuipc_worker_index: " GPUIPC_ENV_WORKER_INDEX
                        "/" GPUIPC_ENV_WORKER_COUNT
                        " not set: not a worker of a group");
  if (index)
    *index = i;
  if (count)
    *count = n;
  return GPUIPC_OK;
}
