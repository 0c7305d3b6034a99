"""Each rank has its own torch, Python ``random`` and NumPy generators, as each process of a real launch has.

Oracles: fresh generators in this process (a separately seeded ``torch.Generator``, ``random.Random``,
``numpy.random.RandomState`` draw what a new process draws after seeding), and the same program on real gloo
processes.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import real
import simdist


def _draws() -> tuple[int, list[float], float, float]:
    """What an unseeded rank draws: torch's initial seed, two torch numbers, one of ``random``, one of NumPy."""
    return torch.initial_seed(), torch.rand(2).tolist(), random.random(), float(np.random.rand())


def test_unseeded_ranks_draw_differently_and_a_run_repeats_its_draws() -> None:
    first = simdist.run(_draws, simdist.Cluster.ring(4), seed=7).returns
    again = simdist.run(_draws, simdist.Cluster.ring(4), seed=7).returns
    other = simdist.run(_draws, simdist.Cluster.ring(4), seed=8).returns
    assert first == again
    for kind in range(4):  # every generator differs between ranks, and between runs of other seeds
        assert len({repr(r[kind]) for r in first}) == 4, [r[kind] for r in first]
        assert all(a[kind] != b[kind] for a, b in zip(first, other))


def _seeded(seed: int) -> tuple[list[float], float, float, list[int]]:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    return torch.rand(3).tolist(), random.random(), float(np.random.rand()), np.random.randint(0, 100, 4).tolist()


@settings(deadline=None)
@given(seed=st.integers(0, 2**32 - 1), world=st.integers(1, 4))
def test_identically_seeded_ranks_draw_what_a_fresh_process_draws(seed: int, world: int) -> None:
    got = simdist.run(_seeded, simdist.Cluster.ring(world), args=(seed,)).returns
    rs = np.random.RandomState(seed)
    want = (
        torch.rand(3, generator=torch.Generator().manual_seed(seed)).tolist(),
        random.Random(seed).random(),
        float(rs.rand()),
        rs.randint(0, 100, 4).tolist(),
    )
    assert got == [want] * world


def _random_length_all_reduce() -> list[float]:
    """Correct on real processes: every rank seeds ``random`` alike, so every rank draws the same length."""
    random.seed(1234)
    np.random.seed(1234)
    dist.barrier()  # the other ranks seed and draw in between, as other processes would
    n = random.randint(1, 50) + int(np.random.randint(0, 50))
    t = torch.ones(n) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.tolist()


def test_ranks_seeded_alike_agree_on_shapes_drawn_from_random_and_numpy() -> None:
    out = simdist.run(_random_length_all_reduce, simdist.Cluster.ring(3)).returns
    assert out[0] == out[1] == out[2] and set(out[0]) == {6.0}


def _per_rank_seeded() -> tuple[list[float], float, float]:
    r = dist.get_rank()
    torch.manual_seed(100 + r)
    random.seed(200 + r)
    np.random.seed(300 + r)
    return torch.randn(3).tolist(), random.gauss(0, 1), float(np.random.standard_normal())


@pytest.mark.slow
def test_seeded_draws_equal_real_gloo_processes() -> None:
    sim = simdist.run(_per_rank_seeded, simdist.Cluster.ring(2)).returns
    out = real.run(_per_rank_seeded, nproc=2, backend="gloo").returns
    assert sim == out


def _thread_draws() -> tuple[float, float, float, float]:
    """A thread the rank starts draws from the rank's generators (one process, one generator)."""
    random.seed(5)
    np.random.seed(5)
    got: list[float] = []
    th = threading.Thread(target=lambda: got.extend([random.random(), float(np.random.rand())]))
    th.start()
    th.join()
    return got[0], got[1], random.random(), float(np.random.rand())


def test_threads_of_a_rank_share_its_generators() -> None:
    r = random.Random(5)
    n = np.random.RandomState(5)
    want = (r.random(), float(n.rand()), r.random(), float(n.rand()))
    assert simdist.run(_thread_draws, simdist.Cluster.ring(2)).returns == [want, want]


def _reseeds() -> tuple[int, int, float, float, float]:
    """Argument-less seeding takes the operating system's entropy in a real process: here, the run's seed."""
    s = torch.seed()
    random.seed()
    np.random.seed()
    return s, torch.initial_seed(), random.random(), float(np.random.rand()), float(np.random.default_rng().random())


def test_argument_less_seeding_is_reproducible_and_per_rank() -> None:
    a = simdist.run(_reseeds, simdist.Cluster.ring(2), seed=3).returns
    b = simdist.run(_reseeds, simdist.Cluster.ring(2), seed=3).returns
    assert a == b
    assert a[0][0] == a[0][1] and a[0][0] != a[1][0]
    assert all(x != y for x, y in zip(a[0], a[1]))


def _draw_and_fail() -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    random.random(), np.random.rand(), torch.rand(1)
    if dist.get_rank() == 1:
        raise ValueError("boom")


@pytest.mark.parametrize("fails", [False, True])
def test_the_process_generators_are_untouched_by_a_run(fails: bool) -> None:
    random.seed(42)
    np.random.seed(42)
    torch.manual_seed(42)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    functions = (random.random, np.random.rand, np.random.seed, np.random.default_rng, torch.seed, random.Random.seed)
    if fails:
        with pytest.raises(simdist.RankError):
            simdist.run(_draw_and_fail, simdist.Cluster.ring(2))
    else:
        simdist.run(_seeded, simdist.Cluster.ring(2), args=(9,))
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])
    assert (random.random, np.random.rand, np.random.seed, np.random.default_rng, torch.seed, random.Random.seed) == (
        functions
    )
