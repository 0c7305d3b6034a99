"""A run pins its process to the CPU the caller runs on, not to one fixed CPU, and gives the affinity back."""

from __future__ import annotations

import os

import pytest

import simdist
from simdist.engine import process

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cpus = pytest.mark.skipif(
    len(ALLOWED) < 2, reason="pinning needs an OS with affinity and two CPUs to choose from"
)


def _affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@needs_two_cpus
def test_the_current_cpu_is_the_one_a_thread_confined_to_one_cpu_runs_on() -> None:
    try:
        for cpu in ALLOWED:
            os.sched_setaffinity(0, {cpu})
            assert process._current_cpu() == cpu
    finally:
        os.sched_setaffinity(0, ALLOWED)


@needs_two_cpus
def test_a_run_pins_its_ranks_to_the_callers_cpu_and_restores_the_affinity(monkeypatch) -> None:
    # Several processes simulating at once (test workers, scenario scripts, an exploration's process pool) each
    # pin where the scheduler placed them: pinned to one fixed CPU they would all share one core.
    for cpu in (ALLOWED[-1], ALLOWED[0]):
        monkeypatch.setattr(process, "_current_cpu", lambda cpu=cpu: cpu)
        res = simdist.run(_affinity, simdist.Cluster.ring(2))
        assert res.returns == [[cpu], [cpu]]
        assert _affinity() == ALLOWED
    monkeypatch.setattr(process, "_current_cpu", lambda: None)  # the OS does not say: the lowest allowed
    assert simdist.run(_affinity, simdist.Cluster.ring(2)).returns == [[ALLOWED[0]]] * 2
