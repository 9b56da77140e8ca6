/*
 * worker_group.c: a parent and N worker processes sharing GPU buffers.
 *
 * The parent starts N copies of this program as workers (gpuipc_group_start:
 * posix_spawn, a connection to each), scatters buffers to them from one
 * arena (each buffer travels as a small message: gpuipc_conn_send), and
 * gathers the results: every worker adds its index + 1 to each byte of the
 * buffers it gets, in place, and answers with a checksum. With --kill, one
 * worker is killed halfway through: the parent learns which worker died and
 * why (gpuipc_group_check), the buffers it held come back to the arena, and
 * its remaining work goes to the survivors. Then the group shuts down.
 *
 *   ./worker_group [N] [--kill]
 *
 * Workers compute on the host here (copy in, add, copy out) to stay free
 * of kernels; a real worker would launch its kernels on the stream it
 * passes to gpuipc_conn_recv.
 */
#include <gpuipc.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BYTES 65536
#define JOBS_PER_WORKER 4

#define CHECK(what, expr)                                                      \
  do {                                                                         \
    gpuipc_status s_ = (expr);                                                 \
    if (s_ != GPUIPC_OK) {                                                     \
      fprintf(stderr, "%s: %s: %s\n", what, gpuipc_status_name(s_),            \
              gpuipc_last_error());                                            \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

/* What a worker answers for each buffer. */
typedef struct result {
  uint32_t job;
  uint32_t worker;
  uint64_t checksum;
} result;

static int worker_main(void) {
  gpuipc_conn *conn = NULL;
  CHECK("gpuipc_spawn_connection", gpuipc_spawn_connection(NULL, &conn));
  int me = 0, n = 0;
  CHECK("gpuipc_worker_index", gpuipc_worker_index(&me, &n));
  gpuipc_conn_set_timeout(conn, -1);
  gpuipc_xfer *x = NULL;
  unsigned char *host = malloc(BYTES);
  for (;;) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    gpuipc_status s = gpuipc_conn_recv(conn, NULL, &r);
    if (s == GPUIPC_E_PEER_GONE || s == GPUIPC_E_CLOSED)
      break; /* the parent shut us down */
    CHECK("gpuipc_conn_recv", s);
    if (x == NULL) {
      /* A copy engine on the device that holds the memory (r.device is
       * its local ordinal; gpuipc names devices by UUID). */
      gpuipc_uuid dev;
      CHECK("gpuipc_device_uuid", gpuipc_device_uuid(r.device, &dev));
      CHECK("gpuipc_xfer_create", gpuipc_xfer_create(&dev, NULL, &x));
    }
    uint32_t job = 0;
    memcpy(&job, r.meta, sizeof job);
    size_t len = r.length < BYTES ? r.length : BYTES;
    CHECK("gpuipc_xfer_to_host",
          gpuipc_xfer_to_host(x, host, r.ptr, len, NULL, GPUIPC_XFER_SYNC));
    uint64_t sum = 0;
    for (size_t i = 0; i < len; i++) {
      host[i] = (unsigned char)(host[i] + me + 1);
      sum += host[i];
    }
    CHECK("gpuipc_xfer_to_device",
          gpuipc_xfer_to_device(x, r.ptr, host, len, NULL, GPUIPC_XFER_SYNC));
    CHECK("gpuipc_conn_release", gpuipc_conn_release(conn, r.id, NULL));
    result res = {job, (uint32_t)me, sum};
    CHECK("gpuipc_conn_send_msg",
          gpuipc_conn_send_msg(conn, &res, sizeof res, NULL, 0));
  }
  gpuipc_xfer_destroy(x);
  free(host);
  gpuipc_conn_close(conn);
  return 0;
}

int main(int argc, char **argv) {
  int n = 3, kill_one = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--worker") == 0)
      return worker_main();
    if (strcmp(argv[i], "--kill") == 0)
      kill_one = 1;
    else
      n = atoi(argv[i]);
  }
  if (n < 1 || n > 64) {
    fprintf(stderr, "usage: %s [N (1..64)] [--kill]\n", argv[0]);
    return 2;
  }
  if (kill_one && n < 2) {
    fprintf(stderr, "--kill needs at least 2 workers\n");
    return 2;
  }

  gpuipc_arena *arena = NULL;
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = (size_t)8 << 20;
  CHECK("gpuipc_arena_create", gpuipc_arena_create(&ao, &arena));
  gpuipc_xfer *x = NULL;
  CHECK("gpuipc_xfer_create", gpuipc_xfer_create(NULL, NULL, &x));

  char *wargv[] = {argv[0], "--worker", NULL};
  gpuipc_group *g = NULL;
  CHECK("gpuipc_group_start",
        gpuipc_group_start("/proc/self/exe", wargv, n, NULL, &g));
  printf("started %d workers\n", n);

  int jobs = n * JOBS_PER_WORKER;
  gpuipc_block **blocks = calloc((size_t)jobs, sizeof *blocks);
  int *owner = calloc((size_t)jobs, sizeof *owner);
  int *done = calloc((size_t)jobs, sizeof *done);
  int *alive = calloc((size_t)n, sizeof *alive);
  unsigned char *host = malloc(BYTES);
  for (int w = 0; w < n; w++)
    alive[w] = 1;

  /* Scatter: job j goes to worker j % n, with the job number as metadata. */
  for (int j = 0; j < jobs; j++) {
    CHECK("gpuipc_arena_alloc", gpuipc_arena_alloc(arena, BYTES, NULL, &blocks[j]));
    memset(host, j & 0xff, BYTES);
    CHECK("gpuipc_xfer_to_device",
          gpuipc_xfer_to_device(x, gpuipc_block_get_ptr(blocks[j]), host, BYTES,
                                NULL, GPUIPC_XFER_SYNC));
    owner[j] = j % n;
    uint32_t job = (uint32_t)j;
    CHECK("gpuipc_conn_send", gpuipc_conn_send(gpuipc_group_get_conn(g, owner[j]),
                                               blocks[j], NULL, &job, sizeof job));
  }
  if (kill_one) {
    /* Worker 1 dies at once (it may have finished some jobs already). */
    gpuipc_child_kill(gpuipc_group_get_child(g, 1), SIGKILL);
  }

  /* Gather, watching for deaths. */
  int finished = 0;
  while (finished < jobs) {
    int progressed = 0;
    for (int w = 0; w < n; w++) {
      if (!alive[w])
        continue;
      gpuipc_conn *c = gpuipc_group_get_conn(g, w);
      result res;
      size_t len = 0;
      gpuipc_conn_set_timeout(c, 0);
      gpuipc_status s = gpuipc_conn_recv_msg(c, &res, sizeof res, &len, NULL, NULL);
      if (s == GPUIPC_E_WOULD_BLOCK || s == GPUIPC_E_TIMEOUT || s == GPUIPC_E_PEER_GONE)
        continue; /* a death is reported by gpuipc_group_check below */
      CHECK("gpuipc_conn_recv_msg", s);
      if (len == sizeof res && res.job < (uint32_t)jobs && !done[res.job]) {
        done[res.job] = 1;
        finished++;
        progressed = 1;
      }
    }
    int dead = -1;
    gpuipc_child_status st;
    gpuipc_status s = gpuipc_group_check(g, progressed ? 0 : 5, &dead, &st);
    if (s == GPUIPC_E_PEER_GONE) {
      printf("%s\n", gpuipc_last_error());
      alive[dead] = 0;
      /* Its unfinished jobs go to the next survivor. The blocks came back:
       * their lease on the dead worker's connection is gone. */
      int to = -1;
      for (int k = 1; k <= n && to < 0; k++)
        if (alive[(dead + k) % n])
          to = (dead + k) % n;
      if (to < 0) {
        fprintf(stderr, "every worker died\n");
        return 1;
      }
      int moved = 0;
      for (int j = 0; j < jobs; j++)
        if (!done[j] && owner[j] == dead) {
          owner[j] = to;
          uint32_t job = (uint32_t)j;
          CHECK("gpuipc_conn_send",
                gpuipc_conn_send(gpuipc_group_get_conn(g, to), blocks[j], NULL,
                                 &job, sizeof job));
          moved++;
        }
      printf("moved %d unfinished job(s) of worker %d to worker %d\n", moved,
             dead, to);
    } else if (s != GPUIPC_OK) {
      CHECK("gpuipc_group_check", s);
    }
  }

  /* The killed worker may have finished every job of its own before it
   * died: then the gathering ended before its death was seen. */
  if (kill_one && alive[1]) {
    int dead = -1;
    gpuipc_child_status st;
    gpuipc_status s = gpuipc_group_check(g, 10000, &dead, &st);
    if (s == GPUIPC_E_PEER_GONE) {
      printf("%s\n", gpuipc_last_error());
      printf("worker %d had finished its jobs before it died\n", dead);
      alive[dead] = 0;
    } else {
      CHECK("gpuipc_group_check", s == GPUIPC_OK ? GPUIPC_E_TIMEOUT : s);
    }
  }

  /* Check the data: each byte is j + (index of the worker that did it) + 1
   * at least once; with --kill a dead worker may have added before dying,
   * so only the survivors' share is checked exactly. */
  int bad = 0;
  for (int j = 0; j < jobs; j++) {
    CHECK("gpuipc_xfer_to_host",
          gpuipc_xfer_to_host(x, host, gpuipc_block_get_ptr(blocks[j]), BYTES, NULL,
                              GPUIPC_XFER_SYNC));
    unsigned char want = (unsigned char)((j & 0xff) + owner[j] + 1);
    if (!kill_one && host[0] != want)
      bad++;
  }
  printf("gathered %d jobs from %d workers%s\n", jobs, n,
         bad ? ": WRONG DATA" : "");

  gpuipc_child_status *all = calloc((size_t)n, sizeof *all);
  gpuipc_status s = gpuipc_group_stop(g, 10000, all);
  for (int w = 0; w < n; w++) {
    char text[96];
    printf("worker %d: %s\n", w, gpuipc_child_status_str(&all[w], text, sizeof text));
  }
  for (int j = 0; j < jobs; j++)
    CHECK("gpuipc_block_free", gpuipc_block_free(blocks[j], NULL));
  gpuipc_arena_stats as = GPUIPC_ARENA_STATS_INIT;
  CHECK("gpuipc_arena_get_stats", gpuipc_arena_get_stats(arena, &as));
  printf("arena: %zu lease(s) out after shutdown\n", as.leases);
  CHECK("gpuipc_arena_destroy", gpuipc_arena_destroy(arena));
  gpuipc_xfer_destroy(x);
  free(all);
  free(blocks);
  free(owner);
  free(done);
  free(alive);
  free(host);
  return bad || s != GPUIPC_OK || as.leases != 0 ? 1 : 0;
}
