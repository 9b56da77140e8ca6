"""Starting Python children that share GPU memory with their parent.

``gpuipc.spawn(target, *args)`` starts a new interpreter (posix_spawn
through the C helper: never fork, so it is safe after CUDA was initialized),
hands it a connection, initializes CUDA there (cuInit) before anything is
unpickled, then calls ``target(conn, *args)`` in the child. target must be
importable by name (a module-level function), as with multiprocessing's
'spawn' start method; functions of the main script are found by running it
as ``__mp_main__``.
"""
import os
import pickle
import signal
import sys

from . import _gpuipc


class Process:
    """A child started by spawn(): .conn (Connection), .pid, join(), kill()."""

    def __init__(self, child):
        self._child = child
        self.pid = child.pid
        self.conn = child.conn
        self.exitcode = None
        self.status = None

    def join(self, timeout=None):
        """Waits for the child (seconds, None forever); returns its exit code
        (negative: killed by that signal) or None while it runs."""
        r = self._child.wait(timeout=timeout)
        if r is not None:
            self.exitcode, self.status = r
        return self.exitcode

    def is_alive(self):
        return self.join(timeout=0) is None

    def kill(self, sig=signal.SIGKILL):
        self._child.kill(sig)

    def terminate(self):
        self.kill(signal.SIGTERM)

    def close(self, timeout=5.0):
        """Closes the connection, waits up to timeout, then kills; returns
        the exit code."""
        r = self._child.destroy(timeout=timeout)
        if r is not None:
            self.exitcode, self.status = r
        return self.exitcode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<gpuipc.Process pid={self.pid} exitcode={self.exitcode}>"


def _main_path():
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.abspath(path) if path else None


def spawn(target, *args, env=None, timeout=30.0, carrier=None, spin_us=None, polling=None,
          _worker=None):
    """Starts ``target(conn, *args)`` in a new Python process; returns a
    Process whose .conn is the parent's end of the connection. The args are
    pickled (parent to child: the child trusts its parent). env: extra
    environment variables (dict). carrier ("auto", "socket", "ring"),
    spin_us and polling: the options of the parent's end, as for
    gpuipc.connect (the child's end takes the defaults, which accept
    either carrier)."""
    payload = pickle.dumps((target, args))
    if len(payload) > _gpuipc.MSG_MAX - 4096:
        raise ValueError("spawn: arguments too large to pickle into one message "
                         f"({len(payload)} bytes); send them over the connection")
    env_add = [f"{k}={v}" for k, v in (env or {}).items()]
    if _worker is not None:
        env_add += [f"GPUIPC_WORKER_INDEX={_worker[0]}", f"GPUIPC_WORKER_COUNT={_worker[1]}"]
    # The child finds this very package first, wherever it was imported from.
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    boot = (f"import sys; sys.path.insert(0, {top!r}); "
            "from gpuipc._child import main; main()")
    child = _gpuipc.spawn_child(sys.executable, [sys.executable, "-c", boot],
                                env_add=env_add or None, timeout=timeout, carrier=carrier,
                                spin_us=spin_us, polling=polling)
    proc = Process(child)
    try:
        head = pickle.dumps({"sys_path": sys.path, "main": _main_path(), "cwd": os.getcwd()})
        proc.conn.send_msg(head)
        proc.conn.send_msg(payload)
    except BaseException:
        proc.close(timeout=0)
        raise
    return proc


def spawn_workers(target, n, *args, env=None, timeout=30.0):
    """Starts n workers, each ``target(conn, *args)``; a worker finds its
    index with gpuipc.worker_index() -> (index, n)."""
    procs = []
    try:
        for i in range(n):
            procs.append(spawn(target, *args, env=env, timeout=timeout, _worker=(i, n)))
    except BaseException:
        for p in procs:
            p.close(timeout=0)
        raise
    return procs
