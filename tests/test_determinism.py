"""A run does not depend on what the process did before it: the same run gives the same trace hash and results
after other runs, after garbage collections, in a fresh process."""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from gpu_programs.common import digest
from gpu_programs.suite import PROGRAMS

import simdist
from simdist.engine.rank_process import WALL_CLOCK_BASE

RING = simdist.Cluster.preset("ring", world_size=2)


class _Node:
    """An object in a reference cycle: only the cyclic garbage collector frees what it holds."""

    other: _Node
    tensor: torch.Tensor


def _cyclic_garbage(steps: int = 30) -> float:
    """Each step leaves a tensor in a reference cycle and allocates what drives Python's collector."""
    keep: list[list] = []
    x = torch.ones(1000)
    for _ in range(steps):
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        a.tensor = torch.ones(25_000)
        del a, b
        keep.extend([] for _ in range(6000))  # live containers: what CPython's collector counts
        for _ in range(40):  # storages: what the run's collections count
            x = x * 1.0
        dist.all_reduce(x)
    return x.sum().item()


def _between_runs(shift: int) -> None:
    """What a process may do between two runs: collections that move the collector's counters."""
    for _ in range(shift):
        gc.collect(0)
    garbage = [[] for _ in range(shift * 1000)]
    del garbage


@pytest.mark.parametrize("shift", [1, 7])
def test_cyclic_garbage_is_freed_at_the_same_points_in_every_run(shift: int) -> None:
    first = simdist.run(_cyclic_garbage, RING, memory=True)
    _between_runs(shift)
    second = simdist.run(_cyclic_garbage, RING, memory=True)
    assert [m.peak_bytes for m in first.memory] == [m.peak_bytes for m in second.memory]
    assert first.trace_hash == second.trace_hash
    # the cycles were collected during the run: the peak is below every step's tensor kept at once
    assert all(m.peak_bytes < 30 * 100_000 for m in first.memory), [m.peak_bytes for m in first.memory]
    assert gc.isenabled()


_REAL_SLEEP = time.sleep  # a run makes time.sleep simulated in rank code
_LOCAL = threading.local()


class _SlowToGo:
    """Thread-local state whose teardown, as the rank's thread exits, takes real time."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __del__(self) -> None:
        _REAL_SLEEP(0.1)


def _leaves_thread_local_state() -> None:
    x = torch.ones(1000)
    dist.all_reduce(x)
    if dist.get_rank() == 0:
        _LOCAL.kept = _SlowToGo(torch.ones(250_000))  # freed as the rank's thread exits
        return
    for _ in range(20):  # rank 1 goes on for 0.2 s of simulated time
        x = x * 1.0
        time.sleep(0.01)


def test_what_a_ranks_thread_frees_as_it_exits_is_freed_when_the_rank_ends() -> None:
    """A finished rank's thread exits in real time, freeing its thread-local state: the run waits for it, so the
    free is at the rank's end in simulated time, not wherever the other ranks are when the OS gets to it."""
    res = simdist.run(_leaves_thread_local_state, RING, memory=True)
    last = [c for c in res.trace.counters if c.rank == 0][-1]
    assert res.memory[0].current_bytes == 0
    assert last.time < 0.1 < res.sim_time, (last.time, res.sim_time)


def _seeded_by_the_clock() -> tuple:
    """What scripts do with the clock: seed from it, name a run by it, time a step by it."""
    random.seed(int(time.time() * 1000))
    stamp = time.time_ns()
    start = time.perf_counter()
    dist.all_reduce(torch.ones(1000))
    name = time.strftime("run-%Y%m%d-%H%M%S")
    return (
        random.random(),
        stamp,
        time.perf_counter() - start,
        time.monotonic(),
        time.monotonic_ns(),
        name,
        time.gmtime()[:6],
        time.ctime(),
        time.asctime(),
    )


def test_a_ranks_clocks_read_the_same_values_in_every_run() -> None:
    first = simdist.run(_seeded_by_the_clock, RING)
    time.sleep(0.01)  # the process's own clocks move on
    second = simdist.run(_seeded_by_the_clock, RING)
    assert first.returns == second.returns
    assert first.returns[0][1] == int(WALL_CLOCK_BASE * 1e9)  # rank 0 read it at simulated time 0
    assert first.returns[0][2] > 0  # the all-reduce took simulated time
    assert first.returns[0][6] == (2026, 1, 1, 0, 0, 0)
    assert first.returns[0][5] == time.strftime("run-%Y%m%d-%H%M%S", time.localtime(WALL_CLOCK_BASE))


def _fingerprints() -> list[str]:
    """Trace hashes and result digests of a GPU program with memory accounting, cyclic garbage and the clocks."""
    runs = [
        simdist.run(
            PROGRAMS["fsdp2_mixed"], simdist.Cluster.switch(2, device="H100"), args=("cuda",), memory=True
        ),
        simdist.run(_cyclic_garbage, RING, memory=True),
        simdist.run(_seeded_by_the_clock, RING),
    ]
    return [f"{r.trace_hash} {digest(r.returns)}" for r in runs]


_CHILD = """
import sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, {tests!r})
from test_determinism import _fingerprints
print("\\n".join(_fingerprints()))
"""


def test_runs_are_the_same_in_a_fresh_process_under_another_hash_seed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONHASHSEED": "4321", "PYTHONPATH": os.path.dirname(here)}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD.format(tests=here)], env=env, capture_output=True, text=True, check=True
    )
    assert child.stdout.split("\n")[-4:-1] == _fingerprints()
