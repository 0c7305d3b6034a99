"""The remote runtime's delivery jitter and tie order as a perturbation's scheduling points
(``simulate(..., perturbation=p)``): unperturbed without one, in order on each direction, the values of local
execution, and the hot-path race found over perturbations as over seeds."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_mlp import train

from simdist.clock.perturbation import Perturbation
from simdist.errors import RankError
from simdist.runtime import BufferingWorker, LinkSpec, StreamTimes, simulate


def test_a_fifo_perturbation_without_jitter_is_the_plain_session() -> None:
    plain = simulate(train, link=LinkSpec())
    fifo = simulate(train, link=LinkSpec(), perturbation=Perturbation(ties="fifo", callbacks=False))
    assert fifo.deliveries == plain.deliveries and fifo.sim_time == plain.sim_time


def test_perturbed_deliveries_keep_each_directions_order_and_the_values_of_local_execution() -> None:
    local = train()
    spec = LinkSpec(jitter=50e-6)
    seen = set()
    for seed in range(4):
        p = Perturbation(seed=seed, ties="random")
        res = simulate(train, link=spec, perturbation=p)
        assert simulate(train, link=spec, perturbation=p).deliveries == res.deliveries  # a pure function of p
        for direction in ("client->worker", "worker->client"):
            arrivals = [d.arrived for d in res.deliveries if d.direction == direction]
            assert arrivals == sorted(arrivals)
        for got, want in zip(res.value[:2], local[:2]):
            np.testing.assert_array_equal(got, want)
        assert res.value[2] == local[2]
        seen.add(tuple(d.arrived for d in res.deliveries))
    assert len(seen) == 4


@pytest.mark.parametrize(("policy", "fails"), [("fallback", True), ("flush_on_backward", False)])
def test_the_hot_path_race_is_found_over_perturbations_as_over_seeds(policy: str, fails: bool) -> None:
    # the hot-path scenario's configuration (hotpath_buffer_race.py): its current policy fails for some seeds
    base = StreamTimes()
    times = StreamTimes(base.trace_per_op * 0.3, base.compile_base * 0.3, base.compile_per_op * 0.3, base.cached_compile * 0.3)
    failed = 0
    for seed in range(12):
        try:
            simulate(
                train, 6, 8, link=LinkSpec(jitter=100e-6), worker=BufferingWorker(policy, times=times),
                client_seconds=10e-6, perturbation=Perturbation(seed=seed, ties="random"),
            )  # fmt: skip
        except RankError as e:
            assert "Input tensor not found" in str(e.exc)
            failed += 1
    assert (failed > 0) is fails, failed
