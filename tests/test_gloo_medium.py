"""gloo's model on one host: a shared medium every transfer crosses both ways, and each rank's own work through
its memory (adding a reduce message in before it goes on; the copies ProcessGroupGloo makes around all-gather and
reduce-scatter) at a rate per byte; the fit of both (``simdist calibrate --medium shared``).

Oracles: closed forms derived by hand from the transfer rules (a route's links held for ``bytes / bandwidth``,
first come first served; a receiver adding each reduce message in before its next step), written out here
apart from the fit's own; NumPy's sum for the reduced values; parameters planted in synthetic timings.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import simdist
from simdist import calibrate
from simdist.bench import bench
from simdist.calibrate import CalibrationError, Sample
from simdist.calibrate.medium import shared_cluster
from simdist.errors import ClusterSpecError
from simdist.network import Cluster

SIZES = tuple(8 << (2 * k) for k in range(11))  # 8 B .. 8 MiB


def _shared(alpha: float, bandwidth: float, local_bandwidth: float) -> Cluster:
    cluster = shared_cluster(2, bandwidth, alpha, "cpu", "host")
    cluster.collective_model = "gloo"
    cluster.local_bandwidth = local_bandwidth
    return cluster


def _shared_closed(collective: str, m: float, a: float, b: float, g: float) -> float:
    """Two ranks on one medium: every message waits for the one before it, whichever way it goes."""
    return {
        "broadcast": a + m * b,  # one message
        # two halves, one after the other; the rank's own chunk copied into the output before, the output out after
        "all_gather": a + m * b + 1.5 * m * g,
        # the sums wait for the medium (the second chunk) or for the adds, whichever ends later
        "all_reduce": max(2 * a + 1.5 * m * b + 0.5 * m * g, a + 2 * m * b),
        # gloo's all-reduce of a clone of the whole input: the clone, both chunks paced at twice the bytes, the
        # add, the rank's chunk copied out
        "reduce_scatter": m * g + 2 * a + 2 * m * b + 0.5 * m * g + 0.5 * m * g,
    }[collective]


def _time(cluster: Cluster, collective: str, m: int) -> float:
    return bench(cluster, collective, m, m, 2)[0].time_us * 1e-6


@settings(max_examples=6, deadline=None)
@given(
    alpha=st.floats(1e-6, 2e-4),
    bandwidth=st.floats(5e8, 2e10),
    reduce_over=st.floats(0.1, 10.0),
    k=st.integers(1, 20),
    collective=st.sampled_from(["broadcast", "all_gather", "all_reduce", "reduce_scatter"]),
)
def test_a_shared_medium_times_both_directions_one_after_the_other(
    alpha: float, bandwidth: float, reduce_over: float, k: int, collective: str
) -> None:
    m = 8 << k
    local_bandwidth = bandwidth * reduce_over
    got = _time(_shared(alpha, bandwidth, local_bandwidth), collective, m)
    assert got == pytest.approx(
        _shared_closed(collective, m, alpha, 1 / bandwidth, 1 / local_bandwidth), rel=1e-6
    )


def test_on_a_shared_medium_a_large_all_reduce_costs_more_than_twice_a_broadcast() -> None:
    m = 8 << 20
    host, switch = _shared(50e-6, 3e9, 1e9), Cluster.switch(2, bandwidth=3e9, latency=25e-6, device="cpu")
    switch.collective_model = "gloo"
    # duplex links overlap the two directions: a ring all-reduce of two ranks moves as much as a broadcast
    assert _time(switch, "all_reduce", m) / _time(switch, "broadcast", m) == pytest.approx(1.0, rel=0.02)
    # one medium: twice the bytes; and where adding is slower than moving (here 3x), each rank's add of half the
    # buffer outlasts the other rank's transfer: 1.5 buffers moved and 0.5 added, 1.5 + 0.5 x 3
    assert _time(host, "all_reduce", m) / _time(host, "broadcast", m) == pytest.approx(3.0, rel=0.02)
    host.local_bandwidth = math.inf  # free adds: the medium alone, twice the broadcast
    assert _time(host, "all_reduce", m) / _time(host, "broadcast", m) == pytest.approx(2.0, rel=0.02)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_rank_pays_its_adds_and_processgroupgloos_copies_on_its_critical_path(n: int) -> None:
    a, bandwidth, local, m = 30e-6, 4e9, 1e9, 12 * 4096
    cluster = Cluster.switch(n, bandwidth=bandwidth, latency=a / 2, device="cpu")
    cluster.collective_model = "gloo"
    free = {c: _time(cluster, c, m) for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")}
    cluster.local_bandwidth = local
    c = m / n
    # n-1 reduce steps, each: the chunk's latency and bytes, then its add; n-1 copy steps
    ring = (n - 1) * (a + c / bandwidth + c / local) + (n - 1) * (a + c / bandwidth)
    assert _time(cluster, "all_reduce", m) == pytest.approx(ring, rel=1e-6)
    assert free["all_reduce"] == pytest.approx(ring - (n - 1) * c / local, rel=1e-6)
    # the rank's chunk into the output, n-1 steps, the whole output out
    gather = c / local + (n - 1) * (a + c / bandwidth) + m / local
    assert _time(cluster, "all_gather", m) == pytest.approx(gather, rel=1e-6)
    # the clone of the input, the all-reduce's time, the rank's chunk out
    assert _time(cluster, "reduce_scatter", m) == pytest.approx(m / local + ring + c / local, rel=1e-6)
    assert _time(cluster, "broadcast", m) == free["broadcast"]  # in place: nothing of its own


def _reduce(world: int) -> list[float]:
    t = torch.arange(6, dtype=torch.float32) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.tolist()


def test_a_costed_reduction_still_sums_the_values() -> None:
    res = simdist.run(_reduce, _shared(50e-6, 1e9, 1e8), args=(2,))
    expected = [float(x) for x in torch.arange(6, dtype=torch.float32).numpy() * 3]
    assert res.returns == [expected, expected]


def test_the_reduction_rate_is_a_cluster_files_gloo_table(tmp_path: Path) -> None:
    host = _shared(50e-6, 3e9, 1.5e9)
    host.save(tmp_path / "host.toml")
    text = (tmp_path / "host.toml").read_text()
    assert "[cluster.gloo]" in text
    back = Cluster.from_file(tmp_path / "host.toml")
    assert back.local_bandwidth == 1.5e9 and back.switches == ("bus.in", "bus.out")
    assert "timed by the gloo model (adds and copies at 1.5 GB/s)" in back.describe()
    assert _time(back, "all_reduce", 1 << 20) == _time(host, "all_reduce", 1 << 20)
    for old, new, message in [
        ('collective_model = "gloo"', "", r"\[cluster.gloo\] times gloo's adds and copies.*alpha-beta model"),
        ("local_bandwidth = 1500000000.0", "local_bandwidth = -1", "local_bandwidth"),
        ("local_bandwidth = 1500000000.0", "reduce_bw = 1", "reduce_bw"),
    ]:
        (tmp_path / "bad.toml").write_text(text.replace(old, new))
        with pytest.raises(ClusterSpecError, match=message):
            Cluster.from_file(tmp_path / "bad.toml")
    Cluster.switch(2, device="cpu").save(tmp_path / "plain.toml")  # no gloo table: reductions free
    assert Cluster.from_file(tmp_path / "plain.toml").local_bandwidth == math.inf
    assert "[cluster.gloo]" not in (tmp_path / "plain.toml").read_text()


@pytest.mark.parametrize("medium", ["shared", "switch"])
def test_the_fit_recovers_a_planted_medium_and_reduction_rate(medium: str) -> None:
    alpha, bandwidth, local_bandwidth = 90e-6, 2.5e9, 1.2e9
    if medium == "shared":
        cluster = _shared(alpha, bandwidth, local_bandwidth)
    else:
        cluster = Cluster.switch(2, bandwidth=bandwidth, latency=alpha / 2, device="cpu")
        cluster.collective_model, cluster.local_bandwidth = "gloo", local_bandwidth
    samples = [
        Sample(c, m, 2, _time(cluster, c, m), f"{c} {m}")
        for c in ("all_reduce", "broadcast", "all_gather")
        for m in SIZES
    ]
    fit = calibrate.fit(samples, device="cpu", collective_model="gloo", medium=medium)
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert fit.local_bandwidth == pytest.approx(local_bandwidth, rel=1e-6)
    assert max(abs(r.error) for r in fit.residuals) < 1e-6
    assert f"local copies and adds {local_bandwidth / 1e9:.4g} GB/s" in fit.report()
    assert fit.cluster.local_bandwidth == fit.local_bandwidth
    # the all-reduce alone cannot tell the bytes' time from the adds': no local rate is fitted
    alone = calibrate.fit(
        [s for s in samples if s.collective == "all_reduce"], collective_model="gloo", medium=medium
    )
    assert alone.local_bandwidth == math.inf and "local copies" not in alone.report()


def test_a_shared_medium_refuses_what_its_closed_forms_do_not_time() -> None:
    two = [Sample("all_reduce", m, 2, 1e-4 + m / 1e9, "x") for m in SIZES]
    four = [dataclasses.replace(s, ranks=4) for s in two]
    with pytest.raises(CalibrationError, match="a shared medium is fitted on 2 ranks"):
        calibrate.fit(four, collective_model="gloo", medium="shared")
    with pytest.raises(CalibrationError, match="under the gloo model"):
        calibrate.fit(two, medium="shared")
    with pytest.raises(CalibrationError, match="medium must be one of switch, shared; found 'bus'"):
        calibrate.fit(two, collective_model="gloo", medium="bus")
    reduce = [Sample("reduce", m, 2, 1e-4 + m / 1e9, "x") for m in SIZES]
    with pytest.raises(CalibrationError, match="found reduce: leave them out"):
        calibrate.fit(two + reduce, collective_model="gloo", medium="shared")


def test_the_cli_writes_a_shared_medium(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from simdist.calibrate import command
    from simdist.cli import main

    host = _shared(80e-6, 2e9, 1e9)
    swept = [
        Sample(c, m, 2, _time(host, c, m), f"--measure {m}")
        for c in ("all_reduce", "broadcast")
        for m in SIZES
    ]
    monkeypatch.setattr(
        command, "measure", lambda *args, **kwargs: swept
    )  # no real processes: the sweep's rows
    assert main(["calibrate", "--measure", "--medium", "shared", "-o", str(tmp_path / "c.toml")]) == 0
    assert "fitted 2-rank shared medium (gloo algorithms)" in capsys.readouterr().out
    back = Cluster.from_file(tmp_path / "c.toml")
    assert back.local_bandwidth == pytest.approx(1e9, rel=1e-6)
    assert _time(back, "all_reduce", 1 << 20) == pytest.approx(_time(host, "all_reduce", 1 << 20), rel=1e-6)


def test_the_gloo_fit_prices_an_all_to_all_with_autos_choice_as_a_run_does() -> None:
    cluster = Cluster.switch(2, bandwidth=2e9, latency=40e-6, device="cpu")
    cluster.collective_model = "gloo"
    samples = [Sample("all_to_all", m, 2, _time(cluster, "all_to_all", m), f"{m}") for m in SIZES]
    fit = calibrate.fit(samples, collective_model="gloo")
    assert fit.alpha == pytest.approx(80e-6, rel=1e-6) and fit.bandwidth == pytest.approx(2e9, rel=1e-6)
