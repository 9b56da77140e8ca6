/*
 * gpuipc/proc.h: starting processes that share GPU memory with their
 * parent: the spawn helper (the C counterpart of Python's multiprocessing)
 * and worker groups.
 *
 * Included from gpuipc.h; do not include it on its own.
 *
 * Why a spawn helper. A child forked after its parent initialized CUDA
 * cannot use CUDA (the driver's state does not survive fork; gpuipc refuses
 * with GPUIPC_E_FORKED). gpuipc_spawn starts a new program with
 * posix_spawn (which never runs the parent's CUDA state in the child) and
 * hands it one end of a connected socket pair; the child picks the
 * connection up with one call, gpuipc_spawn_connection().
 *
 *   parent                                     child (a new program)
 *   gpuipc_spawn(path, argv, &opts, &ch)  ---> gpuipc_spawn_connection(NULL,
 *   conn = gpuipc_child_get_conn(ch)                &conn)
 *   gpuipc_conn_send_buffer(conn, buf, ...)     gpuipc_conn_recv(conn, ...)
 *   ... gpuipc_conn_send / send_msg ...         ... gpuipc_conn_release ...
 *   gpuipc_child_wait(ch, -1, &status)          exit(0)
 *   gpuipc_child_destroy(ch, 0, NULL)
 *
 * The connection is an ordinary gpuipc_conn: buffers travel on it as on
 * any connection (conn.h: arena blocks with gpuipc_conn_send, any other
 * buffer with gpuipc_conn_send_buffer), and descriptors (handle.h:
 * gpuipc_buffer_export / gpuipc_buffer_import, gpuipc_pool_export /
 * gpuipc_pool_import) may ride in its user messages with their file
 * descriptors (gpuipc_conn_send_msg / gpuipc_conn_recv_msg). This header
 * adds no third way.
 *
 * The child learns its end of the pair from the environment variable
 * GPUIPC_CONN_FD (a file descriptor number); gpuipc_spawn_connection()
 * removes it from its environment so that the child's own children do not
 * inherit it. A worker of a group also finds GPUIPC_WORKER_INDEX and
 * GPUIPC_WORKER_COUNT there (gpuipc_worker_index()).
 */
#ifndef GPUIPC_PROC_H
#define GPUIPC_PROC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The environment variables the spawn helper sets in a child. */
#define GPUIPC_ENV_CONN_FD "GPUIPC_CONN_FD"
#define GPUIPC_ENV_WORKER_INDEX "GPUIPC_WORKER_INDEX"
#define GPUIPC_ENV_WORKER_COUNT "GPUIPC_WORKER_COUNT"

/* ------------------------------------------------------------------------ */
/* The spawn helper                                                         */
/* ------------------------------------------------------------------------ */

typedef struct gpuipc_child gpuipc_child;

typedef struct gpuipc_spawn_options {
  size_t size; /* sizeof(gpuipc_spawn_options): set by the initializer */
  /* The child's environment ("NAME=value" strings, NULL-terminated); NULL:
   * the parent's environment. gpuipc adds its own variables to it either
   * way (replacing entries of the same names). */
  char *const *envp;
  /* Extra "NAME=value" entries added to (and overriding) envp; NULL-
   * terminated, or NULL. */
  char *const *env_add;
  /* Nonzero: look path up in PATH as execvp does (posix_spawnp). */
  int search_path;
  /* Options of the parent's end of the connection (and its timeout, which
   * also bounds the handshake with the child); NULL: defaults. */
  const gpuipc_conn_options *conn;
} gpuipc_spawn_options;

#define GPUIPC_SPAWN_OPTIONS_INIT                                              \
  {sizeof(gpuipc_spawn_options), NULL, NULL, 0, NULL}

/* How a child ended. */
typedef enum gpuipc_child_state {
  GPUIPC_CHILD_RUNNING = 0,  /* not ended (yet) */
  GPUIPC_CHILD_EXITED = 1,   /* exit(code) */
  GPUIPC_CHILD_SIGNALED = 2  /* killed by signal */
} gpuipc_child_state;

typedef struct gpuipc_child_status {
  gpuipc_child_state state;
  int code;   /* EXITED: the exit code */
  int signal; /* SIGNALED: the signal number */
  int core_dumped;
} gpuipc_child_status;

/*
 * Starts the program `path` with arguments argv (argv[0] included,
 * NULL-terminated) and a connection to it. Uses posix_spawn (never fork:
 * safe after CUDA was initialized, and cheap for large parents). The child
 * inherits the parent's open descriptors that are not close-on-exec, its
 * stdin/stdout/stderr, and one end of a socket pair (numbered in
 * GPUIPC_CONN_FD). Then completes the connection handshake with the child
 * (waiting up to the connection timeout for it to call
 * gpuipc_spawn_connection).
 *
 * Returns GPUIPC_E_NOT_FOUND / GPUIPC_E_PERMISSION / GPUIPC_E_SYSTEM when
 * the program cannot be started; GPUIPC_E_PEER_GONE when it started but
 * exited before connecting (the message gives its exit status);
 * GPUIPC_E_TIMEOUT when it did not connect in time (it is then killed).
 * On any failure no child is left behind (it is killed and reaped).
 * On success *child is owned by the caller: gpuipc_child_destroy().
 * Thread-safe (each call starts its own child).
 */
GPUIPC_API gpuipc_status gpuipc_spawn(const char *path, char *const argv[],
                                      const gpuipc_spawn_options *opts,
                                      gpuipc_child **child /* OUT */);

/* The parent's connection to the child. Owned by the child object (closed
 * by gpuipc_child_destroy; do not gpuipc_conn_close it); NULL child, or
 * one whose connection was taken, gives NULL. */
GPUIPC_API gpuipc_conn *gpuipc_child_get_conn(const gpuipc_child *child);
/* Takes the parent's connection to the child out of the child object: the
 * caller owns it from now on (gpuipc_conn_close, which the child sees at
 * once, as a peer over gpuipc_connect does: its calls return
 * GPUIPC_E_PEER_GONE, and what it held comes back once it exits), and
 * gpuipc_child_destroy no longer closes it. NULL when child is NULL or its
 * connection was taken already. */
GPUIPC_API gpuipc_conn *gpuipc_child_take_conn(gpuipc_child *child);
/* The child's process id (-1 for NULL). */
GPUIPC_API int gpuipc_child_get_pid(const gpuipc_child *child);

/*
 * Waits up to timeout_ms (-1: forever, 0: just look) for the child to end
 * and reaps it. status (may be NULL) receives how it ended. Returns
 * GPUIPC_OK once it has ended (also on later calls: the status is kept),
 * GPUIPC_E_TIMEOUT while it runs. Does not touch the connection.
 */
GPUIPC_API gpuipc_status gpuipc_child_wait(gpuipc_child *child, int timeout_ms,
                                           gpuipc_child_status *status /* OUT */);

/* Sends signal sig to the child (unless it was reaped already: then
 * GPUIPC_OK and nothing is sent). */
GPUIPC_API gpuipc_status gpuipc_child_kill(gpuipc_child *child, int sig);

/*
 * Writes "exit code N", "killed by signal N (NAME)" or "running" into
 * buf[0..cap). Returns buf.
 */
GPUIPC_API const char *gpuipc_child_status_str(const gpuipc_child_status *status,
                                               char *buf, size_t cap);

/*
 * Ends the relationship: closes the connection (the child's calls on it
 * then return GPUIPC_E_PEER_GONE), waits up to timeout_ms for the child to
 * exit, then kills it (SIGKILL) and reaps it, so that no zombie is left.
 * status (may be NULL) receives how it ended. NULL child is a no-op
 * returning GPUIPC_OK. Returns GPUIPC_E_TIMEOUT when the child had to be
 * killed, GPUIPC_OK otherwise; the object is freed either way.
 */
GPUIPC_API gpuipc_status gpuipc_child_destroy(gpuipc_child *child,
                                              int timeout_ms,
                                              gpuipc_child_status *status /* OUT */);

/*
 * The child's end of gpuipc_spawn: in a child started by it, finds the
 * inherited socket (GPUIPC_CONN_FD), makes it close-on-exec and makes the
 * connection to the parent of it (gpuipc_conn_from_fd: the handshake, with
 * opts or defaults). This is what gpuipc_conn_from_fd cannot do alone:
 * the rendezvous through the environment, checked (the variable must name
 * an open socket) and consumed once. Removes GPUIPC_CONN_FD from the
 * environment (so call it before starting threads that read the
 * environment). Returns GPUIPC_E_NOT_FOUND when this process was not
 * started by gpuipc_spawn (or the connection was picked up already),
 * GPUIPC_E_INVALID_ARG when the variable names no socket, the statuses of
 * gpuipc_conn_from_fd otherwise. *conn is owned by the caller:
 * gpuipc_conn_close().
 */
GPUIPC_API gpuipc_status gpuipc_spawn_connection(const gpuipc_conn_options *opts,
                                                 gpuipc_conn **conn /* OUT */);

/* ------------------------------------------------------------------------ */
/* Worker groups                                                            */
/* ------------------------------------------------------------------------ */

/*
 * A group of n workers running the same program, each with its own
 * connection (a star: the parent is the hub). Each worker finds its index
 * (0..n-1) and n in GPUIPC_WORKER_INDEX / GPUIPC_WORKER_COUNT (see
 * gpuipc_worker_index()). Scatter buffers with gpuipc_conn_send (arena
 * blocks: the fast path) or gpuipc_conn_send_buffer to each worker's
 * connection; gather results with gpuipc_conn_recv_msg / gpuipc_conn_recv.
 * A worker that dies is reported by gpuipc_group_check (which worker, and
 * its exit code or signal); the connection layer then reclaims the blocks
 * it held (they "come back": gpuipc_conn_get_outstanding drops to 0 on its
 * connection once gpuipc_conn_progress has seen it go).
 * Not thread-safe: one thread drives a group.
 */
typedef struct gpuipc_group gpuipc_group;

/* Starts n (1..1024) workers with gpuipc_spawn(path, argv, opts). On failure the workers already started are
 * killed and reaped, and the message says which worker failed. */
GPUIPC_API gpuipc_status gpuipc_group_start(const char *path, char *const argv[],
                                            int n,
                                            const gpuipc_spawn_options *opts,
                                            gpuipc_group **group /* OUT */);
GPUIPC_API int gpuipc_group_get_size(const gpuipc_group *group);
/* Worker i's child object (owned by the group), NULL when out of range. */
GPUIPC_API gpuipc_child *gpuipc_group_get_child(const gpuipc_group *group, int i);
/* Worker i's connection (owned by the group), NULL when out of range. */
GPUIPC_API gpuipc_conn *gpuipc_group_get_conn(const gpuipc_group *group, int i);

/*
 * Looks for a worker that ended, waiting up to timeout_ms (-1: until one
 * ends, 0: just look) and making progress on every worker's connection
 * meanwhile (so releases are processed and a dead worker's blocks are
 * reclaimed). Each ended worker is reported once: returns GPUIPC_E_PEER_GONE
 * with *worker its index and *status how it ended (the message says so,
 * e.g. "worker 2 (pid 4242) killed by signal 9 (SIGKILL)"), GPUIPC_OK with
 * *worker = -1 when none ended within the timeout, GPUIPC_E_NOT_FOUND when
 * every worker has ended and been reported already. worker/status may be
 * NULL.
 */
GPUIPC_API gpuipc_status gpuipc_group_check(gpuipc_group *group, int timeout_ms,
                                            int *worker /* OUT */,
                                            gpuipc_child_status *status /* OUT */);

/*
 * Shuts the group down: closes every connection (workers see
 * GPUIPC_E_PEER_GONE and should exit), waits up to timeout_ms for them all
 * (in total), kills the rest and reaps everyone. statuses (may be NULL)
 * receives each worker's status, in index order (n entries). Returns
 * GPUIPC_E_TIMEOUT when some worker had to be killed, GPUIPC_OK otherwise;
 * the group is freed either way. NULL is a no-op.
 */
GPUIPC_API gpuipc_status gpuipc_group_stop(gpuipc_group *group, int timeout_ms,
                                           gpuipc_child_status *statuses /* OUT */);

/* In a worker: its index and the group's size, from the environment.
 * GPUIPC_E_NOT_FOUND when this process is not a worker of a group. */
GPUIPC_API gpuipc_status gpuipc_worker_index(int *index /* OUT */,
                                             int *count /* OUT */);

#ifdef __cplusplus
}
#endif

#endif /* GPUIPC_PROC_H */
