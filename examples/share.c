/*
 * share.c: the smallest whole program of the README. A parent puts a
 * message into GPU memory and hands that memory to a child process it
 * starts; the child reads the message from the same memory (no copy of the
 * buffer between the processes: it is mapped in both) and gives it back.
 *
 *   ./share
 *
 * Error handling is one macro; every gpuipc call returns a status and
 * gpuipc_last_error() says what failed.
 */
#include <gpuipc.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(expr)                                                            \
  do {                                                                         \
    gpuipc_status s_ = (expr);                                                 \
    if (s_ != GPUIPC_OK) {                                                     \
      fprintf(stderr, "%s: %s: %s\n", #expr, gpuipc_status_name(s_),           \
              gpuipc_last_error());                                            \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

/* The child: receives the buffer, reads it, releases it. */
static int child(void) {
  gpuipc_conn *conn;
  CHECK(gpuipc_spawn_connection(NULL, &conn));
  gpuipc_received rx = GPUIPC_RECEIVED_INIT;
  CHECK(gpuipc_conn_recv(conn, NULL, &rx)); /* rx.ptr: the parent's memory */
  char text[64] = "";
  gpuipc_xfer *x;
  CHECK(gpuipc_xfer_create(NULL, NULL, &x));
  CHECK(gpuipc_xfer_to_host(x, text, rx.ptr, sizeof text - 1, NULL,
                            GPUIPC_XFER_SYNC));
  printf("child read \"%s\" from the parent's GPU memory\n", text);
  CHECK(gpuipc_conn_release(conn, rx.id, NULL)); /* the parent may reuse it */
  gpuipc_xfer_destroy(x);
  gpuipc_conn_close(conn);
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--child") == 0)
    return child();

  /* The parent: GPU memory from an arena, a message written into it. */
  gpuipc_arena *arena;
  gpuipc_block *block;
  gpuipc_xfer *x;
  CHECK(gpuipc_arena_create(NULL, &arena));
  CHECK(gpuipc_arena_alloc(arena, 4096, NULL, &block));
  CHECK(gpuipc_xfer_create(NULL, NULL, &x));
  char text[64] = "hello from the parent";
  CHECK(gpuipc_xfer_to_device(x, gpuipc_block_get_ptr(block), text,
                              sizeof text, NULL, GPUIPC_XFER_SYNC));

  /* A child with a connection to us, and the block sent over it. */
  char *cargv[] = {argv[0], "--child", NULL};
  gpuipc_child *c;
  CHECK(gpuipc_spawn("/proc/self/exe", cargv, NULL, &c));
  CHECK(gpuipc_conn_send(gpuipc_child_get_conn(c), block, NULL, NULL, 0));

  gpuipc_child_status st;
  CHECK(gpuipc_child_wait(c, 10000, &st));
  gpuipc_child_destroy(c, 0, NULL);
  CHECK(gpuipc_block_free(block, NULL)); /* the child released it */
  gpuipc_xfer_destroy(x);
  CHECK(gpuipc_arena_destroy(arena));
  char how[96];
  printf("child: %s\n", gpuipc_child_status_str(&st, how, sizeof how));
  return st.state == GPUIPC_CHILD_EXITED && st.code == 0 ? 0 : 1;
}
