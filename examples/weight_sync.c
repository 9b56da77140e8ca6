/*
 * weight_sync.c: a trainer pushing each new version of its model's weights
 * into an inference engine's process with a tensor set, double-buffered.
 *
 * The trainer (this program) starts the engine (this program again, with
 * the argument "engine") with a connection to it, makes a set of the
 * model's tensors with two copies, and subscribes the engine. After every
 * "training step" it writes the new weights into the copy the engine is
 * not reading (gpuipc_tset_begin picks it and waits, on the GPU, for the
 * engine's reads of it to finish) and publishes them: one message and one
 * stream-ordered signal, whatever the number of tensors. The engine copies
 * each version into its own weight tensors (gpuipc_tset_version_copy_into,
 * the copies of the whole set on one stream), checks a value, releases
 * the version, and stops when the trainer ends the subscription.
 *
 *   ./weight_sync [steps]
 *
 * The "training" fills each tensor with a value that depends on the step
 * (on the host, copied in with gpuipc_xfer) to stay free of kernels; a
 * real trainer would write the copy with its own kernels, or copy its
 * weights in with gpuipc_tset_copy_from, on the stream it passes to begin
 * and publish.
 */
#include <gpuipc.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LAYERS 4
#define HIDDEN 256
#define VOCAB 1000

#define CHECK(what, expr)                                                      \
  do {                                                                         \
    gpuipc_status s_ = (expr);                                                 \
    if (s_ != GPUIPC_OK) {                                                     \
      fprintf(stderr, "%s: %s: %s\n", what, gpuipc_status_name(s_),            \
              gpuipc_last_error());                                            \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

/* The model: an embedding, then per layer a weight matrix and a norm. */
typedef struct model {
  size_t n;
  gpuipc_tensor t[1 + 2 * LAYERS];
  char names[1 + 2 * LAYERS][48];
  int64_t shapes[1 + 2 * LAYERS][2];
} model;

static void model_init(model *m) {
  memset(m, 0, sizeof *m);
  size_t i = 0;
  snprintf(m->names[i], sizeof m->names[i], "embed.weight");
  m->shapes[i][0] = VOCAB;
  m->shapes[i][1] = HIDDEN;
  m->t[i] = (gpuipc_tensor){m->names[i], GPUIPC_DTYPE_F32, 2, m->shapes[i],
                            NULL, NULL, 0};
  i++;
  for (int l = 0; l < LAYERS; l++, i += 2) {
    snprintf(m->names[i], sizeof m->names[i], "layers.%d.weight", l);
    m->shapes[i][0] = m->shapes[i][1] = HIDDEN;
    m->t[i] = (gpuipc_tensor){m->names[i], GPUIPC_DTYPE_F32, 2, m->shapes[i],
                              NULL, NULL, 0};
    snprintf(m->names[i + 1], sizeof m->names[i + 1], "layers.%d.norm", l);
    m->shapes[i + 1][0] = HIDDEN;
    m->t[i + 1] = (gpuipc_tensor){m->names[i + 1], GPUIPC_DTYPE_F32, 1,
                                  m->shapes[i + 1], NULL, NULL, 0};
  }
  m->n = i;
}

/* The value of every element of tensor i after training step `step`. */
static float value(size_t i, uint64_t step) { return (float)(step * 100 + i); }

/* ---- the engine ------------------------------------------------------------------ */

static int engine_main(void) {
  gpuipc_conn *conn = NULL;
  CHECK("gpuipc_spawn_connection", gpuipc_spawn_connection(NULL, &conn));
  gpuipc_conn_set_timeout(conn, -1);
  gpuipc_tset_sub *sub = NULL;
  CHECK("gpuipc_tset_sub_open", gpuipc_tset_sub_open(conn, &sub));
  gpuipc_xfer *x = NULL;
  CHECK("gpuipc_xfer_create", gpuipc_xfer_create(NULL, NULL, &x));
  /* The engine's own weights: one allocation, tensors packed in order
   * (so that copy_into merges them into few copies). */
  gpuipc_pool *pool = NULL;
  gpuipc_buffer *weights = NULL;
  void *dst[1 + 2 * LAYERS];
  size_t nt = 0;
  for (;;) {
    gpuipc_tset_version *v = NULL;
    gpuipc_status s = gpuipc_tset_recv(sub, NULL, &v);
    if (s == GPUIPC_E_CANCELED || s == GPUIPC_E_PEER_GONE)
      break; /* the trainer is done */
    CHECK("gpuipc_tset_recv", s);
    if (weights == NULL) {
      nt = gpuipc_tset_version_get_count(v);
      if (nt > sizeof dst / sizeof dst[0]) {
        fprintf(stderr, "engine: %zu tensors, more than the model has\n", nt);
        return 1;
      }
      size_t total = 0;
      for (size_t i = 0; i < nt; i++) {
        gpuipc_tensor t;
        CHECK("gpuipc_tset_version_get_tensor",
              gpuipc_tset_version_get_tensor(v, i, &t));
        total += t.nbytes;
      }
      CHECK("gpuipc_pool_create", gpuipc_pool_create(NULL, &pool));
      CHECK("gpuipc_buffer_alloc",
            gpuipc_buffer_alloc(pool, total, NULL, &weights));
      char *p = gpuipc_buffer_get_ptr(weights);
      for (size_t i = 0; i < nt; i++) {
        gpuipc_tensor t;
        CHECK("gpuipc_tset_version_get_tensor",
              gpuipc_tset_version_get_tensor(v, i, &t));
        dst[i] = p;
        p += t.nbytes;
      }
      printf("engine: %zu tensors, %zu bytes of weights\n", nt, total);
    }
    uint64_t step = gpuipc_tset_version_get_number(v);
    CHECK("gpuipc_tset_version_copy_into",
          gpuipc_tset_version_copy_into(v, dst, NULL));
    /* The copy is ours: the version can go back at once (ordered on the
     * GPU after the copy), so the trainer may reuse that copy. */
    CHECK("gpuipc_tset_version_release", gpuipc_tset_version_release(v, NULL));
    size_t last = nt - 1;
    float got = 0;
    CHECK("gpuipc_xfer_to_host", gpuipc_xfer_to_host(x, &got, dst[last],
                                                     sizeof got, NULL,
                                                     GPUIPC_XFER_SYNC));
    printf("engine: version %llu, %s[0] = %g (want %g)\n",
           (unsigned long long)step, "last tensor", got, value(last, step));
    if (got != value(last, step))
      return 1;
  }
  gpuipc_buffer_free(weights, NULL);
  gpuipc_pool_destroy(pool);
  gpuipc_xfer_destroy(x);
  gpuipc_tset_sub_close(sub);
  gpuipc_conn_close(conn);
  return 0;
}

/* ---- the trainer ------------------------------------------------------------------- */

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "engine") == 0)
    return engine_main();
  int steps = argc > 1 ? atoi(argv[1]) : 5;
  if (steps < 1)
    steps = 1;
  char *cargv[] = {argv[0], "engine", NULL};
  gpuipc_child *engine = NULL;
  CHECK("gpuipc_spawn", gpuipc_spawn("/proc/self/exe", cargv, NULL, &engine));
  gpuipc_conn *conn = gpuipc_child_get_conn(engine);

  model m;
  model_init(&m);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.copies = 2; /* write the next version while the engine reads this one */
  o.timeout_ms = 60000;
  gpuipc_tset *set = NULL;
  CHECK("gpuipc_tset_create", gpuipc_tset_create(m.t, m.n, &o, &set));
  CHECK("gpuipc_tset_subscribe", gpuipc_tset_subscribe(set, conn, NULL));
  gpuipc_xfer *x = NULL;
  CHECK("gpuipc_xfer_create", gpuipc_xfer_create(NULL, NULL, &x));
  float *host = malloc((size_t)VOCAB * HIDDEN * sizeof *host);
  for (int step = 1; step <= steps; step++) {
    int copy = -1;
    CHECK("gpuipc_tset_begin", gpuipc_tset_begin(set, NULL, &copy));
    for (size_t i = 0; i < m.n; i++) {
      gpuipc_tensor t;
      CHECK("gpuipc_tset_get_tensor", gpuipc_tset_get_tensor(set, copy, i, &t));
      for (size_t k = 0; k < t.nbytes / sizeof *host; k++)
        host[k] = value(i, (uint64_t)step);
      CHECK("gpuipc_xfer_to_device",
            gpuipc_xfer_to_device(x, t.ptr, host, t.nbytes, NULL,
                                  GPUIPC_XFER_SYNC));
    }
    CHECK("gpuipc_tset_publish", gpuipc_tset_publish(set, NULL));
    printf("trainer: step %d published in copy %d\n", step, copy);
  }
  /* Ends the subscription: waits until the engine released everything. */
  CHECK("gpuipc_tset_destroy", gpuipc_tset_destroy(set));
  gpuipc_child_status st;
  gpuipc_child_wait(engine, 60000, &st);
  char buf[64];
  printf("trainer: engine %s\n", gpuipc_child_status_str(&st, buf, sizeof buf));
  free(host);
  gpuipc_xfer_destroy(x);
  gpuipc_child_destroy(engine, 5000, NULL);
  return st.state == GPUIPC_CHILD_EXITED && st.code == 0 ? 0 : 1;
}
