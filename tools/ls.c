/*
 * ls.c: `gpuipc ls` and `gpuipc top`: every live gpuipc process of this
 * user, what it holds and with whom it shares it, read from the stats
 * segments the processes keep in the runtime directory (src/core/stats.c;
 * the layout is in core/core.h). Only files of the caller's uid in its
 * 0700 directory are read. A segment whose process is gone (its pid no
 * longer names a process with the same start time) is shown as gone and
 * removed. The JSON keys are documented in docs/ls.md and only added to.
 *
 * Exit status: 0 (also when no process is listed); 1 when the runtime
 * directory cannot be read for another reason than not existing; 2 for a
 * usage error.
 */
#include "cli.h"
#include "tree.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define LS_MAX 1024

static const char *const state_names[] = {"open", "peer_gone", "broken"};
static const char *const order_names[] = {"memop", "none", "event"};

typedef struct ls_proc {
  gpuipc__stats_seg s; /* a copy, taken at once */
  bool alive;
  bool foreign; /* of another pid namespace: not judged (alive) */
  char path[300];
} ls_proc;

static int64_t ctr(const ls_proc *p, gpuipc__stat i) {
  int64_t v = atomic_load_explicit(&p->s.ctr[i], memory_order_relaxed);
  return v < 0 ? 0 : v; /* a forked child's first decrements */
}

/* Milliseconds since the oldest lease of a connection began; -1: none. */
static double oldest_lease_ms(const gpuipc__stats_conn *c, uint64_t now) {
  uint64_t min = 0;
  for (int k = 0; k < GPUIPC__STATS_LEASES; k++) {
    uint64_t t = atomic_load_explicit(&c->lease_ns[k], memory_order_relaxed);
    if (t && (min == 0 || t < min))
      min = t;
  }
  if (min == 0)
    return -1.0;
  return min > now ? 0.0 : (double)(now - min) / 1e6;
}

/* Reads one segment file into p; false when it is not one of ours. */
static bool read_one(const char *dir, const char *name, ls_proc *p) {
  int pid = 0;
  unsigned long long start = 0;
  int used = 0;
  if (sscanf(name, "proc-%d-%llu.stats%n", &pid, &start, &used) != 2 ||
      used == 0 || name[used] != '\0' || pid <= 0)
    return false;
  snprintf(p->path, sizeof p->path, "%s/%s", dir, name);
  /* O_NONBLOCK: a FIFO in a segment's place would wait for a writer. The
   * bytes are read, not mapped: a file that shrinks under a mapping raises
   * SIGBUS in the reader; a short read is only a segment not listed. */
  int fd = open(p->path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    return false;
  struct stat st;
  bool ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
            st.st_uid == geteuid() &&
            (size_t)st.st_size >= sizeof(gpuipc__stats_seg);
  size_t got = 0;
  while (ok && got < sizeof p->s) {
    ssize_t r = pread(fd, (char *)&p->s + got, sizeof p->s - got, (off_t)got);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      ok = false;
    else
      got += (size_t)r;
  }
  close(fd);
  if (!ok)
    return false;
  if (atomic_load(&p->s.magic) != GPUIPC__STATS_MAGIC ||
      p->s.version != GPUIPC__STATS_VERSION || p->s.pid != pid ||
      p->s.start_time != start || p->s.uid != (uint32_t)geteuid())
    return false;
  p->s.command[sizeof p->s.command - 1] = '\0';
  /* Only a segment of our own pid namespace can be judged: in another,
   * its pid names some other process here (or none), and the directory
   * may be shared (a bind mount, a common XDG_RUNTIME_DIR). Such a
   * segment is listed as alive and never removed. */
  uint64_t ns = gpuipc__pid_namespace();
  p->foreign = p->s.pid_ns == 0 || ns == 0 || p->s.pid_ns != ns;
  uint64_t now_start = 0;
  p->alive = p->foreign ||
             (gpuipc__proc_stat(pid, NULL, &now_start) == GPUIPC_OK &&
              now_start == start);
  return true;
}

static int by_pid(const void *a, const void *b) {
  const ls_proc *x = a, *y = b;
  return (x->s.pid > y->s.pid) - (x->s.pid < y->s.pid);
}

/* Every segment of ours, sorted by pid; the gone ones removed from disk
 * (they stay in the list, marked). Returns the count, -1 on error. */
static int gather(const char *dir, ls_proc **out) {
  *out = NULL;
  DIR *d = opendir(dir);
  if (d == NULL)
    return errno == ENOENT ? 0 : -1;
  ls_proc *v = calloc(LS_MAX, sizeof *v);
  if (v == NULL) {
    closedir(d);
    return -1;
  }
  int n = 0, more = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (n == LS_MAX) { /* counted, not read: said below */
      more += strncmp(e->d_name, "proc-", 5) == 0;
      continue;
    }
    if (read_one(dir, e->d_name, &v[n]))
      n++;
  }
  closedir(d);
  static bool said; /* once: top gathers again at every refresh */
  if (more && !said && (said = true))
    fprintf(stderr, "gpuipc: %d more segment file(s) in %s not read (at most %d "
                    "are)\n", more, dir, LS_MAX);
  qsort(v, (size_t)n, sizeof *v, by_pid);
  for (int i = 0; i < n; i++)
    if (!v[i].alive)
      unlink(v[i].path);
  *out = v;
  return n;
}

static void human_bytes(char *buf, size_t cap, int64_t b) {
  static const char *const u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double x = (double)b;
  int i = 0;
  while (x >= 1024 && i < 4) {
    x /= 1024;
    i++;
  }
  snprintf(buf, cap, i ? "%.1f %s" : "%.0f %s", x, u[i]);
}

static void uuid_text(const ls_proc *p, int k, char text[64]) {
  gpuipc_uuid u;
  memcpy(u.bytes, p->s.dev[k].uuid, sizeof u.bytes);
  gpuipc_uuid_format(&u, text);
}

/* A command as text for a terminal: it is the segment writer's to choose,
 * so control characters (C0, DEL, and C1 in its UTF-8 form: they could move
 * the cursor, clear the screen or fake other lines) are shown as '?'. */
static void safe_text(char *out, size_t cap, const char *in) {
  size_t k = 0;
  for (size_t i = 0; in[i] && k + 1 < cap; i++) {
    unsigned char ch = (unsigned char)in[i];
    unsigned char next = (unsigned char)in[i + 1];
    if (ch == 0xc2 && next >= 0x80 && next <= 0x9f) { /* U+0080..U+009F */
      out[k++] = '?';
      i++;
    } else if (ch < 0x20 || ch == 0x7f) {
      out[k++] = '?';
    } else {
      out[k++] = (char)ch;
    }
  }
  out[k] = '\0';
}

static void print_text(FILE *f, const ls_proc *v, int n) {
  uint64_t now = gpuipc__stats_now();
  if (n == 0) {
    fprintf(f, "no gpuipc process of this user\n");
    return;
  }
  for (int i = 0; i < n; i++) {
    const ls_proc *p = &v[i];
    char command[sizeof p->s.command];
    safe_text(command, sizeof command, p->s.command);
    fprintf(f, "%-7d %s%s\n", p->s.pid,
            p->alive ? "" : "(gone, entry removed) ",
            command[0] ? command : "?");
    if (!p->alive)
      continue;
    for (int k = 0; k < GPUIPC__STATS_DEVICES; k++) {
      if (atomic_load(&p->s.dev[k].used) != 1)
        continue;
      char text[64];
      uuid_text(p, k, text);
      fprintf(f, "  device %d  %s\n", p->s.dev[k].ordinal, text);
    }
    char b1[32], b2[32];
    human_bytes(b1, sizeof b1, ctr(p, GPUIPC__ST_POOL_BYTES));
    human_bytes(b2, sizeof b2, ctr(p, GPUIPC__ST_ARENA_BYTES));
    fprintf(f, "  pools %lld (%lld buffers, %s)  arenas %lld (%lld chunks, %s, "
               "%lld blocks out, %lld deferred frees)\n",
            (long long)ctr(p, GPUIPC__ST_POOLS),
            (long long)ctr(p, GPUIPC__ST_POOL_BUFFERS), b1,
            (long long)ctr(p, GPUIPC__ST_ARENAS),
            (long long)ctr(p, GPUIPC__ST_ARENA_CHUNKS), b2,
            (long long)ctr(p, GPUIPC__ST_ARENA_BLOCKS),
            (long long)ctr(p, GPUIPC__ST_ARENA_DEFERRED));
    fprintf(f, "  import cache  %lld live, %lld hits, %lld misses, %lld stale\n",
            (long long)ctr(p, GPUIPC__ST_CACHE_LIVE),
            (long long)ctr(p, GPUIPC__ST_CACHE_HITS),
            (long long)ctr(p, GPUIPC__ST_CACHE_MISSES),
            (long long)ctr(p, GPUIPC__ST_CACHE_STALE));
    for (int k = 0; k < GPUIPC__STATS_CONNS; k++) {
      const gpuipc__stats_conn *c = &p->s.conn[k];
      if (atomic_load(&c->used) != 1)
        continue;
      uint32_t st = atomic_load(&c->state), o = atomic_load(&c->order);
      double age = oldest_lease_ms(c, now);
      char ages[32] = "-";
      if (age >= 0)
        snprintf(ages, sizeof ages, "%.1f ms", age);
      fprintf(f, "  conn peer %-7d %-9s %-5s peer holds %lld, we hold %lld, "
                 "oldest lease %s\n",
              (int)atomic_load(&c->peer_pid), st < 3 ? state_names[st] : "?",
              o < 3 ? order_names[o] : "?",
              (long long)atomic_load(&c->held_by_peer),
              (long long)atomic_load(&c->held_here), ages);
    }
    uint64_t of = atomic_load(&p->s.conn_overflow);
    if (of)
      fprintf(f, "  (%llu more connections, not shown)\n",
              (unsigned long long)of);
  }
}

/* Length of the well-formed UTF-8 sequence at s (1 to 4), or 0 when the
 * bytes there are not one (a stray continuation byte, an overlong form, a
 * surrogate, past U+10FFFF, cut short). */
static int utf8_len(const unsigned char *s) {
  unsigned c = s[0];
  int n = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3
                       : (c & 0xf8) == 0xf0 ? 4 : 0;
  if (n <= 1)
    return n;
  unsigned cp = c & (0x7fu >> n);
  for (int i = 1; i < n; i++) {
    if ((s[i] & 0xc0) != 0x80)
      return 0;
    cp = (cp << 6) | (s[i] & 0x3fu);
  }
  static const unsigned min[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < min[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
    return 0;
  return n;
}

/* A JSON string. Text that a process gave (its command line) need not be
 * UTF-8: a byte that is not part of a well-formed sequence is written as
 * \u00XX (read as Latin-1), so the listing stays valid JSON. */
static void json_str(FILE *f, const char *str) {
  const unsigned char *s = (const unsigned char *)str;
  fputc('"', f);
  while (*s) {
    unsigned char ch = *s;
    int n = utf8_len(s);
    if (ch == '"' || ch == '\\')
      fprintf(f, "\\%c", ch);
    else if (ch < 0x20 || ch == 0x7f || n == 0)
      fprintf(f, "\\u%04x", ch);
    else {
      fwrite(s, 1, (size_t)n, f);
      s += n;
      continue;
    }
    s++;
  }
  fputc('"', f);
}

static void print_json(FILE *f, const char *dir, const ls_proc *v, int n) {
  uint64_t now = gpuipc__stats_now();
  fprintf(f, "{\"runtime_dir\": ");
  json_str(f, dir);
  fprintf(f, ", \"processes\": [");
  for (int i = 0; i < n; i++) {
    const ls_proc *p = &v[i];
    fprintf(f, "%s\n  {\"pid\": %d, \"start_time\": %llu, \"alive\": %s, "
               "\"own_pid_namespace\": %s, \"command\": ",
            i ? "," : "", p->s.pid, (unsigned long long)p->s.start_time,
            p->alive ? "true" : "false", p->foreign ? "false" : "true");
    json_str(f, p->s.command);
    fprintf(f, ", \"devices\": [");
    int nd = 0;
    for (int k = 0; k < GPUIPC__STATS_DEVICES; k++) {
      if (atomic_load(&p->s.dev[k].used) != 1)
        continue;
      char text[64];
      uuid_text(p, k, text);
      fprintf(f, "%s{\"ordinal\": %d, \"uuid\": \"%s\"}", nd++ ? ", " : "",
              p->s.dev[k].ordinal, text);
    }
    fprintf(f, "],\n   \"pools\": {\"count\": %lld, \"buffers\": %lld, "
               "\"bytes\": %lld},\n",
            (long long)ctr(p, GPUIPC__ST_POOLS),
            (long long)ctr(p, GPUIPC__ST_POOL_BUFFERS),
            (long long)ctr(p, GPUIPC__ST_POOL_BYTES));
    fprintf(f, "   \"arenas\": {\"count\": %lld, \"chunks\": %lld, \"bytes\": "
               "%lld, \"blocks_out\": %lld, \"deferred_frees\": %lld},\n",
            (long long)ctr(p, GPUIPC__ST_ARENAS),
            (long long)ctr(p, GPUIPC__ST_ARENA_CHUNKS),
            (long long)ctr(p, GPUIPC__ST_ARENA_BYTES),
            (long long)ctr(p, GPUIPC__ST_ARENA_BLOCKS),
            (long long)ctr(p, GPUIPC__ST_ARENA_DEFERRED));
    fprintf(f, "   \"import_cache\": {\"live\": %lld, \"hits\": %lld, "
               "\"misses\": %lld, \"stale\": %lld},\n",
            (long long)ctr(p, GPUIPC__ST_CACHE_LIVE),
            (long long)ctr(p, GPUIPC__ST_CACHE_HITS),
            (long long)ctr(p, GPUIPC__ST_CACHE_MISSES),
            (long long)ctr(p, GPUIPC__ST_CACHE_STALE));
    fprintf(f, "   \"connections_total\": %lld, \"connections_untracked\": "
               "%llu, \"connections\": [",
            (long long)ctr(p, GPUIPC__ST_CONNS),
            (unsigned long long)atomic_load(&p->s.conn_overflow));
    int nc = 0;
    for (int k = 0; k < GPUIPC__STATS_CONNS; k++) {
      const gpuipc__stats_conn *c = &p->s.conn[k];
      if (atomic_load(&c->used) != 1)
        continue;
      uint32_t st = atomic_load(&c->state), o = atomic_load(&c->order);
      double age = oldest_lease_ms(c, now);
      uint64_t opened = atomic_load(&c->opened_ns);
      fprintf(f, "%s\n     {\"peer_pid\": %d, \"peer_start_time\": %llu, "
                 "\"state\": \"%s\", \"order\": \"%s\", \"held_by_peer\": "
                 "%lld, \"held_here\": %lld, \"age_ms\": %.1f, "
                 "\"oldest_lease_ms\": ",
              nc++ ? "," : "", (int)atomic_load(&c->peer_pid),
              (unsigned long long)atomic_load(&c->peer_start),
              st < 3 ? state_names[st] : "unknown",
              o < 3 ? order_names[o] : "unknown",
              (long long)atomic_load(&c->held_by_peer),
              (long long)atomic_load(&c->held_here),
              opened && opened < now ? (double)(now - opened) / 1e6 : 0.0);
      if (age >= 0)
        fprintf(f, "%.1f}", age);
      else
        fprintf(f, "null}");
    }
    fprintf(f, "]}");
  }
  fprintf(f, "%s]}\n", n ? "\n" : "");
}

static void ls_usage(FILE *f, bool top) {
  gpuipc_cli_usage_line(f, top ? "top" : "ls");
  if (top)
    fprintf(f, "\n"
               "  the gpuipc ls listing, refreshed (plain ANSI; ^C ends)\n"
               "  --interval S  seconds between refreshes (default 1)\n"
               "  --count N     stop after N refreshes (default: until ^C)\n"
               "  -h, --help    this text\n");
  else
    fprintf(f, "\n"
               "  every gpuipc process of this user: devices, pools, arenas,\n"
               "  connections, import cache. Entries of processes that died\n"
               "  are shown as gone and removed.\n"
               "  --json      one JSON object (keys documented in docs/ls.md)\n"
               "  -h, --help  this text\n");
}

int gpuipc_cmd_ls(int argc, char **argv) {
  bool json = false;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      ls_usage(stdout, false);
      return 0;
    } else {
      fprintf(stderr, "gpuipc ls: unknown option '%s'\n", argv[i]);
      ls_usage(stderr, false);
      return 2;
    }
  }
  char dir[200];
  gpuipc__default_runtime_dir(dir, sizeof dir, NULL, 0, NULL);
  ls_proc *v = NULL;
  int n = gather(dir, &v);
  if (n < 0) {
    fprintf(stderr, "gpuipc ls: cannot read %s: %s\n", dir, strerror(errno));
    return 1;
  }
  if (json)
    print_json(stdout, dir, v, n);
  else
    print_text(stdout, v, n);
  free(v);
  return 0;
}

int gpuipc_cmd_top(int argc, char **argv) {
  double interval = 1.0;
  long count = -1;
  for (int i = 1; i < argc; i++) {
    char *end = NULL;
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      ls_usage(stdout, true);
      return 0;
    } else if (strcmp(argv[i], "--interval") == 0 && i + 1 < argc) {
      interval = strtod(argv[++i], &end);
      if (*end != '\0' || !(interval > 0 && interval <= 3600)) {
        fprintf(stderr, "gpuipc top: --interval takes seconds in (0, 3600]\n");
        ls_usage(stderr, true);
        return 2;
      }
    } else if (strcmp(argv[i], "--count") == 0 && i + 1 < argc) {
      count = strtol(argv[++i], &end, 10);
      if (*end != '\0' || count <= 0) {
        fprintf(stderr, "gpuipc top: --count takes a positive number\n");
        ls_usage(stderr, true);
        return 2;
      }
    } else {
      fprintf(stderr, "gpuipc top: unknown option '%s'\n", argv[i]);
      ls_usage(stderr, true);
      return 2;
    }
  }
  char dir[200];
  gpuipc__default_runtime_dir(dir, sizeof dir, NULL, 0, NULL);
  bool tty = isatty(STDOUT_FILENO);
  for (long k = 0; count < 0 || k < count; k++) {
    if (k > 0) {
      struct timespec ts = {(time_t)interval,
                            (long)((interval - (double)(time_t)interval) * 1e9)};
      nanosleep(&ts, NULL);
    }
    ls_proc *v = NULL;
    int n = gather(dir, &v);
    if (tty)
      fputs("\033[H\033[2J", stdout);
    time_t t = time(NULL);
    char when[64];
    strftime(when, sizeof when, "%H:%M:%S", localtime(&t));
    printf("gpuipc top  %s  %s  (every %.3g s)\n\n", when, dir, interval);
    if (n < 0)
      printf("cannot read %s: %s\n", dir, strerror(errno));
    else
      print_text(stdout, v, n);
    fflush(stdout);
    free(v);
  }
  return 0;
}
