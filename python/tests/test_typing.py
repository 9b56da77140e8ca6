"""What type checkers and IDEs see: the extension's stub (gpuipc/_gpuipc.pyi)
covers every public name and method of gpuipc._gpuipc, with the parameter
names the extension takes; every public function, constructor and method
of dir(gpuipc._gpuipc) carries a __text_signature__ (inspect.signature works)
with the stub's parameter names and kinds (positional-only, keyword-only);
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


_KIND = {"posonly": inspect.Parameter.POSITIONAL_ONLY,
         "arg": inspect.Parameter.POSITIONAL_OR_KEYWORD,
         "vararg": inspect.Parameter.VAR_POSITIONAL,
         "kwonly": inspect.Parameter.KEYWORD_ONLY,
         "kwarg": inspect.Parameter.VAR_KEYWORD}


def _params(fn_node):
    """The stub's parameters, (name, kind), without self/cls."""
    a = fn_node.args
    out = [(x.arg, _KIND["posonly"]) for x in a.posonlyargs]
    out += [(x.arg, _KIND["arg"]) for x in a.args]
    if a.vararg:
        out.append((a.vararg.arg, _KIND["vararg"]))
    out += [(x.arg, _KIND["kwonly"]) for x in a.kwonlyargs]
    if a.kwarg:
        out.append((a.kwarg.arg, _KIND["kwarg"]))
    return [(n, k) for n, k in out if n not in ("self", "cls")]


def _runtime_params(obj):
    """(name, kind) of the runtime signature; ValueError without one."""
    return [(n, p.kind) for n, p in inspect.signature(obj).parameters.items()
            if n not in ("self", "type", "$self", "$type")]


def _public_functions():
    return sorted(n for n in dir(_gpuipc)
                  if not n.startswith("_") and callable(getattr(_gpuipc, n))
                  and not isinstance(getattr(_gpuipc, n), type))


def _public_classes():
    return sorted(n for n in dir(_gpuipc)
                  if not n.startswith("_") and isinstance(getattr(_gpuipc, n), type)
                  and not issubclass(getattr(_gpuipc, n), BaseException))


def _methods(t):
    """The public methods (and PROTOCOL dunders) a class defines itself:
    its callables, classmethods included; getsets and members are not."""
    out = []
    for m, v in vars(t).items():
        if m.startswith("_") and m not in PROTOCOL:
            continue
        if callable(v) or type(v).__name__ == "classmethod_descriptor":
            out.append(m)
    return out


def test_the_walk_finds_what_it_should():
    # the walk over dir(_gpuipc) is what the two tests below check: it must
    # see the module's functions, its classes and their methods
    funcs, classes = _public_functions(), _public_classes()
    assert {"init", "listen", "release_batch", "broadcast", "open"} <= set(funcs)
    assert {"Connection", "Received", "Listener", "TensorSetC", "TensorSetSub",
            "TensorSetVersion", "TensorView", "HoldLog", "Arena", "CopyPlan"} <= set(classes)
    assert {"send", "recv", "__enter__", "__exit__"} <= set(_methods(_gpuipc.Connection))
    assert "open" in _methods(_gpuipc.HoldLog)  # a classmethod
    assert "__dlpack__" in _methods(_gpuipc.TensorView)


@pytest.mark.parametrize("name", _public_functions())
def test_module_functions_have_signatures_matching_the_stub(name):
    top, _ = _stub()
    assert _runtime_params(getattr(_gpuipc, name)) == _params(top[name])


@pytest.mark.parametrize("cls", _public_classes())
def test_methods_have_signatures_matching_the_stub(cls):
    _, classes = _stub()
    declared = _members(classes, cls)
    t = getattr(_gpuipc, cls)
    if "__new__" in vars(t):
        # a constructor of its own: its signature is the class docstring's
        # (tp_doc), the stub's __init__
        assert _runtime_params(t) == _params(declared["__init__"]), f"{cls}()"
    else:
        # made by the extension only (Connection, Received, ...)
        with pytest.raises(TypeError):
            t()
    for m in _methods(t):
        got = _runtime_params(getattr(t, m))  # raises ValueError without a signature
        if m == "__exit__":
            assert got == [("exc", inspect.Parameter.VAR_POSITIONAL)], f"{cls}.{m}"
            continue
        assert got == _params(declared[m]), f"{cls}.{m}"


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
