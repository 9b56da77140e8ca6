"""The module itself: version, devices, errors."""
import builtins

import pytest

import gpuipc


def test_version_and_devices():
    assert gpuipc.version() == gpuipc.__version__
    gpuipc.init()
    assert gpuipc.device_count() >= 1
    u = gpuipc.device_uuid(0)
    assert u.startswith("GPU-") and len(u) == 40
    assert gpuipc.device_from_uuid(u) == 0


def test_error_classes_named_after_status_codes():
    assert issubclass(gpuipc.TimeoutError, gpuipc.Error)
    assert issubclass(gpuipc.TimeoutError, builtins.TimeoutError)
    assert issubclass(gpuipc.PeerGoneError, ConnectionError)
    assert issubclass(gpuipc.InvalidArgError, ValueError)
    for code, cls in gpuipc.errors_by_status.items():
        name = gpuipc._gpuipc.status_name(code)  # GPUIPC_E_OUT_OF_RANGE
        camel = "".join(w.capitalize() for w in name[len("GPUIPC_E_"):].split("_")) + "Error"
        assert cls.__name__ == camel, (code, cls.__name__, camel)
        assert getattr(gpuipc, camel) is cls
    assert gpuipc.error_class(22) is gpuipc.TimeoutError


def test_error_carries_status_and_message():
    with pytest.raises(gpuipc.OutOfRangeError) as ei:
        gpuipc._gpuipc._raise_status(15, "the detail")
    e = ei.value
    assert e.status == 15 and e.status_name == "GPUIPC_E_OUT_OF_RANGE"
    assert e.detail == "the detail" and "the detail" in str(e)


def test_forked_error_names_the_fix():
    with pytest.raises(gpuipc.ForkedError, match="gpuipc.spawn"):
        gpuipc._gpuipc._raise_status(5)


def test_connect_to_nobody_is_not_found():
    with pytest.raises(gpuipc.NotFoundError) as ei:
        gpuipc.connect("nobody-listens-here", timeout=1)
    assert "connect" in str(ei.value)


def test_bad_arguments():
    with pytest.raises(ValueError):
        gpuipc.listen("bad/name")
    with pytest.raises(ValueError):
        gpuipc.listen("x", order="sometimes")
    with pytest.raises(ValueError):
        gpuipc.listen("x", timeout=-1)
    with pytest.raises(TypeError):
        gpuipc.Arena().alloc()
