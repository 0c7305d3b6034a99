"""The same rank functions on simdist and on real gloo processes give the same results and the same errors."""

from __future__ import annotations

import pytest
import sim_vs_real_fns as fns
import torch

import real
import simdist


def assert_same(a, b, where: str) -> None:
    if isinstance(a, tuple) and a and a[0] == "raised":
        # the simulated error is an instance of the class gloo raised, and names the same ranks
        assert isinstance(b, tuple) and b[0] == "raised", f"{where}: real raised {a[1][0]}: {a[2]}; simulated {b!r}"
        assert a[1][0] in b[1], f"{where}: real {a[1][0]} ({a[2]}) vs simulated {b[1][0]} ({b[2]})"
        if "monitoredBarrier" in a[2]:
            assert b[2].startswith(a[2]), f"{where}: real {a[2]!r} vs simulated {b[2]!r}"
        return
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        if a.dtype == torch.complex32:  # no comparison kernels for complex half: compare the bytes
            a, b = torch.view_as_real(a).view(torch.int16), torch.view_as_real(b).view(torch.int16)
        assert torch.equal(a, b), f"{where}: real {a} vs simulated {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: real {a!r} vs simulated {b!r}"


@pytest.mark.real
@pytest.mark.parametrize("nproc", [2, 4])
def test_simulated_results_equal_gloo(nproc):
    numel = 5  # not divisible by the world size
    got_real = real.run(fns.everything, nproc=nproc, backend="gloo", args=(numel,))
    got_sim = simdist.run(fns.everything, simdist.Cluster.switch(nproc, device="cpu"), args=(numel,), backend_name="gloo")
    for r in range(nproc):
        assert_same(got_real.returns[r], got_sim.returns[r], f"rank {r}")
    # the comparison is not vacuous: collectives produced data
    kinds = {v[0] for v in got_real.returns[0]["dtypes"].values()}
    assert kinds == {"ok", "error"}  # both results and errors (dtypes gloo cannot move) were compared
    gloo = got_real.returns[0]["gloo"]
    assert sum(v[0] == "raised" for v in gloo.values()) >= 20 and gloo["sparse_all_reduce_sum"][0] == "ok"
    if nproc == 2:
        assert gloo["monitored_barrier_missing"][2].startswith("[Rank 0]: Rank 1 failed to pass monitoredBarrier")
