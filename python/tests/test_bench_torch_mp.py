"""python -m gpuipc.bench's torch.multiprocessing rows without torch: the
plain Queue's floor row (run over the standard library's multiprocessing
standing in for torch.multiprocessing, which is the same Queue), and the
summary's ratios and target."""
import multiprocessing
import sys
import types

import pytest

from gpuipc import bench


def row(us, per_s=1000.0):
    return {"median_us": us, "p90_us": us, "per_s": per_s}


def test_the_summary_compares_with_torch_and_the_floor():
    r = {bench.TORCH_MP_FLOOR: {4096: row(40.0)}, bench.TORCH_MP: {4096: row(210.0, 5000)},
         bench.TORCH_MP_GPUIPC: {4096: row(60.0, 16000)}}
    (line,) = bench.torch_mp_summary(r)
    assert "3.50x faster than PyTorch's" in line and "1.50x the floor" in line
    assert "target >= 3x faster than torch.mp: met (70.0 us)" in line
    assert "throughput 3.20x" in line
    # a floor above a third of torch.mp: the target is 1.2x the floor
    r[bench.TORCH_MP_FLOOR] = {4096: row(100.0)}
    r[bench.TORCH_MP_GPUIPC] = {4096: row(125.0)}
    (line,) = bench.torch_mp_summary(r)
    assert "target <= 1.2x the Queue floor" in line and "MISSED (120.0 us)" in line
    assert bench.torch_mp_summary({}) == []


def test_the_rows_and_what_they_need():
    names = [m[0] for m in bench.torch_mp_methods()]
    assert names == [bench.TORCH_MP_FLOOR, bench.TORCH_MP, bench.TORCH_MP_GPUIPC]
    assert [m[3] for m in bench.torch_mp_methods()] == [True, False, False]
    try:
        import torch  # noqa: F401
    except ImportError:
        assert "torch not importable" in bench.torch_mp_methods()[0][1]()


def test_the_floor_row_runs_without_cuda(monkeypatch):
    if "torch" in sys.modules or _have_torch():
        pytest.skip("torch is here: the bench runs the row itself")
    fake = types.ModuleType("torch")
    fake.multiprocessing = multiprocessing
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setitem(sys.modules, "torch.multiprocessing", multiprocessing)
    rows = bench.bench_torch_mp([4096], 5, 16, "plain")
    assert set(rows) == {4096}
    r = rows[4096]
    assert r["median_us"] > 0 and r["p90_us"] >= r["median_us"] and r["per_s"] > 0


def _have_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False
