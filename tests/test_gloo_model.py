"""collective_model="gloo": collectives timed with the algorithms torch's gloo backend runs on CPU tensors, and a
reduce-scatter as the all-reduce of its whole input (ProcessGroupGloo.reduce_scatter_tensor_coalesced).

Oracles: the closed forms of simdist's ring and binomial tree (an uncontended switch equals them); the
alpha-beta model's own reduce-scatter, unchanged; times made by the gloo model's closed forms for the fit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simdist import algorithms, calibrate
from simdist.bench import bench
from simdist.calibrate import Sample, command
from simdist.cli import main
from simdist.errors import ClusterSpecError
from simdist.network import Cluster

ALPHA, BANDWIDTH = 80e-6, 2e9


def _switch(n: int, model: str) -> Cluster:
    cluster = Cluster.switch(n, bandwidth=BANDWIDTH, latency=ALPHA / 2, device="cpu")
    cluster.collective_model = model
    return cluster


def _closed(collective: str, name: str, n: int, m: int) -> float:
    return algorithms.get(collective, name).effective(n).estimate(n, m, ALPHA, 1 / BANDWIDTH)


@settings(max_examples=4, deadline=None)
@given(n=st.sampled_from([2, 3, 4]), k=st.integers(3, 20))
def test_gloo_runs_its_own_algorithms_and_reduce_scatter_as_an_all_reduce(n: int, k: int) -> None:
    m = (1 << k) // (4 * n) * 4 * n or 4 * n
    gloo, plain = _switch(n, "gloo"), _switch(n, "alpha-beta")

    def timed(cluster: Cluster, collective: str) -> tuple[float, str]:
        row = bench(cluster, collective, m, m, 2)[0]
        return row.time_us * 1e-6, row.algorithm

    rs, _ = timed(gloo, "reduce_scatter")
    assert rs == pytest.approx(_closed("all_reduce", "ring", n, m), rel=1e-3)
    assert timed(gloo, "all_reduce") == (pytest.approx(_closed("all_reduce", "ring", n, m), rel=1e-3), "ring")
    assert timed(gloo, "broadcast")[1] == "tree"
    # the alpha-beta model keeps its own reduce-scatter: half the all-reduce's bytes and latencies
    plain_rs, plain_name = timed(plain, "reduce_scatter")
    assert plain_rs == pytest.approx(_closed("reduce_scatter", plain_name, n, m), rel=1e-3)


def test_the_gloo_model_is_a_cluster_files_collective_model(tmp_path: Path) -> None:
    _switch(2, "gloo").save(tmp_path / "c.toml")
    assert Cluster.from_file(tmp_path / "c.toml").collective_model == "gloo"
    text = (tmp_path / "c.toml").read_text().replace('collective_model = "gloo"', 'collective_model = "GLOO"')
    (tmp_path / "x.toml").write_text(text)
    with pytest.raises(ClusterSpecError, match="collective_model must be one of alpha-beta, nccl, gloo"):
        Cluster.from_file(tmp_path / "x.toml")


def test_the_fit_prices_gloo_samples_with_gloos_algorithms() -> None:
    samples = [
        Sample(
            c,
            m,
            2,
            _closed(
                "all_reduce" if c == "reduce_scatter" else c, "ring" if c != "broadcast" else "tree", 2, m
            ),
        )
        for c in ("reduce_scatter", "broadcast")
        for m in (8 << (2 * k) for k in range(10))
    ]
    fit = calibrate.fit(samples, collective_model="gloo")
    assert fit.alpha == pytest.approx(ALPHA, rel=1e-6) and fit.bandwidth == pytest.approx(BANDWIDTH, rel=1e-6)
    assert fit.cluster.collective_model == "gloo" and "(gloo algorithms)" in fit.report()
    # the alpha-beta model reads the same times as a reduce-scatter twice as slow as its closed form
    assert max(abs(r.error) for r in calibrate.fit(samples).residuals) > 0.2


def test_a_measure_sweep_is_written_under_the_gloo_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    swept = [
        Sample("all_reduce", m, 2, _closed("all_reduce", "ring", 2, m), f"--measure {m}")
        for m in (8, 512, 32768, 1 << 21)
    ]
    monkeypatch.setattr(
        command, "measure", lambda *args, **kwargs: swept
    )  # no real processes: the sweep's rows
    assert main(["calibrate", "--measure", "-o", str(tmp_path / "c.toml")]) == 0
    assert "fitted 2-rank switch cluster (gloo algorithms)" in capsys.readouterr().out
    assert Cluster.from_file(tmp_path / "c.toml").collective_model == "gloo"
    assert main(["calibrate", "--measure", "--model", "alpha-beta", "-o", str(tmp_path / "c.toml")]) == 0
    assert Cluster.from_file(tmp_path / "c.toml").collective_model == "alpha-beta"
