"""What type checkers and IDEs see: the extension's stub (gpuipc/_gpuipc.pyi)
covers every public name and method of gpuipc._gpuipc, with the parameter
names the extension takes; the functions and methods of module.c, arena.c,
buffer.c and proc.c carry __text_signature__s (inspect.signature works);
setup.py installs the stub and the py.typed marker."""
import ast
import inspect
import os
import subprocess
import sys

import pytest

import gpuipc
from gpuipc import _gpuipc

PKG_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUB = os.path.join(PKG_SRC, "gpuipc", "_gpuipc.pyi")
PROTOCOL = {"__dlpack__", "__dlpack_device__", "__enter__", "__exit__",
            "__cuda_array_interface__"}


def _stub():
    with open(STUB) as f:
        tree = ast.parse(f.read())
    top, classes = {}, {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            top[node.name] = node
        elif isinstance(node, ast.ClassDef):
            top[node.name] = node
            members = {}
            for n in node.body:
                if isinstance(n, ast.FunctionDef):
                    members[n.name] = n
                elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    members[n.target.id] = n
            classes[node.name] = (members, [b.id for b in node.bases if isinstance(b, ast.Name)])
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    top[t.id] = node
    return top, classes


def _members(classes, name):
    members, bases = classes[name]
    out = dict(members)
    for b in bases:
        if b in classes:
            out.update(_members(classes, b))
    return out


def test_stub_covers_every_public_name_and_member():
    top, classes = _stub()
    missing = []
    for name in dir(_gpuipc):
        if name.startswith("__") and name != "__version__":
            continue
        if name not in top:
            missing.append(name)
            continue
        obj = getattr(_gpuipc, name)
        if isinstance(obj, type) and not issubclass(obj, BaseException):
            declared = _members(classes, name)
            for m in vars(obj):
                if (m.startswith("_") and m not in PROTOCOL) or m in declared:
                    continue
                missing.append(f"{name}.{m}")
    assert not missing, f"not in {STUB}: {missing}"


def _params(fn_node):
    a = fn_node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return [n for n in names if n not in ("self", "cls")]


def _runtime_params(obj):
    return [p for p in inspect.signature(obj).parameters
            if p not in ("self", "type", "$self", "$type")]


SIGNED_FUNCS = ["init", "version", "driver_path", "driver_version", "device_count",
                "device_uuid", "device_from_uuid", "listen", "connect", "from_fd",
                "conn_pair", "spawn_connection", "spawn_child", "release_batch", "broadcast",
                "share", "open", "desc_info", "cache_stats", "counters", "collect",
                "worker_index", "status_name", "log_level"]
SIGNED_CLASSES = ["Arena", "Block", "Pool", "Buffer", "Event", "Shared", "Child"]


@pytest.mark.parametrize("name", SIGNED_FUNCS)
def test_module_functions_have_signatures_matching_the_stub(name):
    top, _ = _stub()
    assert _runtime_params(getattr(_gpuipc, name)) == _params(top[name])


@pytest.mark.parametrize("cls", SIGNED_CLASSES)
def test_methods_have_signatures_matching_the_stub(cls):
    _, classes = _stub()
    declared = _members(classes, cls)
    t = getattr(_gpuipc, cls)
    checked = 0
    for m, v in vars(t).items():
        if not callable(v) and type(v).__name__ not in ("classmethod_descriptor",):
            continue
        if m.startswith("_") and m not in PROTOCOL:
            continue
        got = _runtime_params(getattr(t, m))  # raises ValueError without a signature
        if m == "__exit__":
            assert got == ["exc"]
            continue
        assert got == _params(declared[m]), f"{cls}.{m}"
        checked += 1
    assert checked > 0


def test_signatures_name_keywords():
    sig = inspect.signature(gpuipc.Arena.alloc)
    assert sig.parameters["stream"].kind is inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["nbytes"].default is None
    assert str(inspect.signature(gpuipc.Arena)) == \
        "(device=0, chunk_bytes=67108864, max_bytes=0)"
    assert inspect.signature(gpuipc.listen).parameters["carrier"].default == "auto"


def test_setup_installs_the_stub_and_py_typed(tmp_path):
    out = tmp_path / "lib"
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
                       cwd=PKG_SRC, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (out / "gpuipc" / "py.typed").exists()
    assert (out / "gpuipc" / "_gpuipc.pyi").read_text() == open(STUB).read()
