"""``simdist bench`` sweeps every collective of the algorithm registry; rows checked against the closed forms."""

from __future__ import annotations

import math

import pytest

import simdist
from simdist import algorithms
from simdist.bench import COLLECTIVES, bench

LATENCY, BANDWIDTH = 2e-6, 10e9  # per link of the switch; a rank-to-rank path crosses two links


def test_the_bench_covers_the_registry() -> None:
    assert set(COLLECTIVES) == set(algorithms.COLLECTIVES) - {"barrier"}


@pytest.mark.parametrize("collective", ["gather", "scatter"])
@pytest.mark.parametrize("algorithm", ["tree", "direct"])
def test_gather_and_scatter_rows_match_their_closed_forms(collective: str, algorithm: str) -> None:
    n = 4
    cluster = simdist.Cluster.switch(n, bandwidth=BANDWIDTH, latency=LATENCY, device="cpu")
    rows = bench(cluster, collective, 1 << 10, 1 << 16, 8, root=1, algorithm=algorithm)
    assert [r.size for r in rows] == [1 << 10, 1 << 13, 1 << 16]
    for r in rows:
        assert r.wrong == 0 and r.algorithm == algorithm and r.root == 1
        # by hand (Thakur et al. 2005): alpha is the two-link path latency, m the root's whole buffer
        alpha, m, lg = 2 * LATENCY, r.size, math.ceil(math.log2(n))
        want = (lg * alpha if algorithm == "tree" else alpha) + (n - 1) / n * m / BANDWIDTH
        assert r.time_us == pytest.approx(want * 1e6, rel=1e-6)
        assert r.algbw == pytest.approx(r.size / (r.time_us * 1e-6) / 1e9)
        assert r.busbw == pytest.approx(r.algbw * 0.75)  # nccl-tests' (n-1)/n


def test_an_algorithm_the_collective_lacks_is_refused() -> None:
    with pytest.raises(simdist.ClusterSpecError, match="'tree' does not implement all_gather"):
        bench(simdist.Cluster.switch(4, device="cpu"), "all_gather", algorithm="tree")
