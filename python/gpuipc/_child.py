"""The child side of gpuipc.spawn (started as python -c '... main()')."""
import os
import pickle
import sys
import types


def _fixup_main(path):
    """Runs the parent's main script as __mp_main__ so that its functions
    unpickle, as multiprocessing does."""
    if not path or not os.path.exists(path):
        return
    mod = types.ModuleType("__mp_main__")
    mod.__file__ = path
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    sys.modules["__mp_main__"] = mod
    sys.modules["__main__"] = mod
    exec(code, mod.__dict__)


def main():
    from . import _gpuipc

    # CUDA before anything else: a driver that cannot start fails here with
    # its own message, not in the middle of unpickling.
    _gpuipc.init()
    conn = _gpuipc.spawn_connection()
    head = pickle.loads(conn.recv_msg(timeout=30))
    sys.path[:] = head["sys_path"]
    try:
        os.chdir(head["cwd"])
    except OSError:
        pass
    if head.get("main"):
        _fixup_main(head["main"])
    target, args = pickle.loads(conn.recv_msg(timeout=30))
    rc = target(conn, *args)
    conn.close()
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
