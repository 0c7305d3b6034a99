"""The algorithm registry: every schedule computes its collective (NumPy oracle), choices and errors, the docs.

Schedules are run here without the simulator, step by step: the payloads of step k are read once every
message of an earlier step has arrived, then the step's messages arrive. The simulator's own execution
(asynchronous per rank, on real tensors) is checked against NumPy in test_collectives.py and against the
closed forms in test_timing.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simdist import algorithms
from simdist.algorithms import Problem, format_schedule, split_offsets, steps
from simdist.algorithms.table import markdown, update

ROOT = Path(__file__).resolve().parent.parent


def run_schedule(msgs: list, bufs: list[np.ndarray]) -> None:
    """Run ``msgs`` on per-rank buffers (source and destination the same), one step at a time."""
    for k in range(steps(msgs)):
        batch = [(m, bufs[m.src][m.slo : m.shi].copy()) for m in msgs if m.step == k]
        for m, payload in batch:
            if m.kind == "reduce":
                bufs[m.dst][m.dlo : m.dhi] += payload
            else:
                bufs[m.dst][m.dlo : m.dhi] = payload


def expected_and_run(collective: str, name: str, n: int, numel: int, root: int, seed: int) -> tuple[list, list, list]:
    """(what each rank's buffer should hold, what it holds, which ranks' buffers are defined) for one case."""
    rng = np.random.default_rng(seed)
    data = [rng.integers(-5, 6, size=numel).astype(np.int64) for _ in range(n)]
    off = split_offsets(numel, n)
    bufs = [d.copy() for d in data]
    check = list(range(n))
    total = np.sum(data, axis=0)
    if collective in ("all_reduce", "barrier"):
        want = [total] * n
    elif collective == "broadcast":
        want = [data[root]] * n
    elif collective == "reduce":
        want, check = [total] * n, [root]
    elif collective == "reduce_scatter":
        want = [total] * n
        check = []  # compared per chunk below
    elif collective == "all_gather":
        # rank r starts with its own chunk r; chunk c everywhere ends as rank c's chunk
        bufs = [np.zeros(numel, np.int64) for _ in range(n)]
        for r in range(n):
            bufs[r][off[r] : off[r + 1]] = data[r][off[r] : off[r + 1]]
        full = np.concatenate([data[c][off[c] : off[c + 1]] for c in range(n)])
        want = [full] * n
    elif collective == "gather":
        # buffers in relative-rank order: chunk v belongs to rank (root + v) % n
        bufs = [np.zeros(numel, np.int64) for _ in range(n)]
        for r in range(n):
            v = (r - root) % n
            bufs[r][off[v] : off[v + 1]] = data[r][off[v] : off[v + 1]]
        full = np.concatenate([data[(v + root) % n][off[v] : off[v + 1]] for v in range(n)])
        want, check = [full] * n, [root]
    elif collective == "scatter":
        bufs = [np.zeros(numel, np.int64) for _ in range(n)]
        bufs[root] = data[root].copy()
        want, check = [data[root]] * n, []
    else:
        raise AssertionError(collective)
    msgs = algorithms.build(collective, name, Problem(n, numel, 8, root))
    run_schedule(msgs, bufs)
    if collective == "reduce_scatter":
        for r in range(n):
            np.testing.assert_array_equal(bufs[r][off[r] : off[r + 1]], total[off[r] : off[r + 1]])
    if collective == "scatter":
        for r in range(n):
            v = (r - root) % n
            np.testing.assert_array_equal(bufs[r][off[v] : off[v + 1]], data[root][off[v] : off[v + 1]])
    return want, bufs, check


CASES = [(a.collective, a.name) for a in algorithms.ALGORITHMS if a.collective != "all_to_all"]


@pytest.mark.parametrize("collective, name", CASES)
@given(n=st.integers(1, 12), numel=st.integers(1, 40), root=st.integers(0, 11), seed=st.integers(0, 2**16))
def test_every_schedule_computes_its_collective(collective: str, name: str, n: int, numel: int, root: int, seed: int) -> None:
    if algorithms.collective(collective).chunked:
        numel = max(numel, n)
    want, got, check = expected_and_run(collective, name, n, numel, root % n, seed)
    for r in check:
        np.testing.assert_array_equal(got[r], want[r], err_msg=f"{collective}/{name} n={n} rank {r}")


@given(n=st.integers(1, 8), data=st.data())
def test_all_to_all_moves_every_block_to_its_rank(n: int, data: st.DataObject) -> None:
    counts = [[data.draw(st.integers(0, 4)) for _ in range(n)] for _ in range(n)]
    recv = [[counts[j][r] for j in range(n)] for r in range(n)]
    inputs = [np.arange(sum(counts[r]), dtype=np.int64) + 100 * r for r in range(n)]
    outputs = [np.full(sum(recv[r]), -1, np.int64) for r in range(n)]
    p = Problem(n, sum(counts[0]), 8, 0, tuple(map(tuple, counts)), tuple(map(tuple, recv)))
    for m in algorithms.build("all_to_all", "direct", p):
        outputs[m.dst][m.dlo : m.dhi] = inputs[m.src][m.slo : m.shi]
    for r in range(n):
        for j in range(n):
            if j == r:
                continue
            lo = sum(counts[j][:r])
            dlo = sum(recv[r][:j])
            np.testing.assert_array_equal(outputs[r][dlo : dlo + recv[r][j]], inputs[j][lo : lo + counts[j][r]])


def test_every_collective_has_algorithms_and_each_is_declared_once() -> None:
    keys = [(a.collective, a.name) for a in algorithms.ALGORITHMS]
    assert len(keys) == len(set(keys))
    for c in algorithms.COLLECTIVES:
        assert algorithms.names(c), c
    assert algorithms.names("all_to_all") == ("direct",)


@given(
    n=st.integers(1, 64),
    nbytes=st.integers(1, 1 << 30),
    a=st.tuples(st.floats(1e-7, 1e-4), st.floats(1e-12, 1e-8)),
    b=st.tuples(st.floats(1e-7, 1e-4), st.floats(1e-12, 1e-8)),
    collective=st.sampled_from(algorithms.COLLECTIVES),
)
def test_auto_picks_an_eligible_algorithm_no_slower_than_any_other(n, nbytes, a, b, collective) -> None:
    chosen = algorithms.choose(collective, n, nbytes, a, b)
    eligible = [x for x in algorithms.ALGORITHMS
                if x.collective == collective and (x.auto_max_ranks is None or n <= x.auto_max_ranks)]
    assert chosen in eligible

    def cost(x: algorithms.Algorithm) -> float:
        alpha, beta = a if x.reach == "neighbours" else b
        return x.estimate(n, nbytes, alpha, beta)

    assert all(cost(chosen) <= cost(x) * (1 + 1e-9) for x in eligible)


def test_closed_forms_against_the_formulas_by_hand() -> None:
    alpha, beta, m = 5e-6, 1 / 100e9, 4 << 20
    assert math.isclose(algorithms.estimate("all_reduce", "ring", 8, m, alpha, beta), 14 * alpha + 2 * 7 / 8 * m * beta)
    assert math.isclose(algorithms.estimate("all_reduce", "tree", 8, m, alpha, beta), 6 * (alpha + m * beta))
    # rhd off a power of two folds the extra ranks in and out: two more full-buffer messages
    assert math.isclose(algorithms.estimate("all_reduce", "rhd", 6, m, alpha, beta),
                        2 * 2 * alpha + 2 * 3 / 4 * m * beta + 2 * (alpha + m * beta))
    # reduce-scatter by recursive halving runs as ring on 6 ranks
    assert algorithms.get("reduce_scatter", "rhd").effective(6).name == "ring"
    assert math.isclose(algorithms.estimate("reduce_scatter", "rhd", 6, m, alpha, beta), 5 * alpha + 5 / 6 * m * beta)
    assert algorithms.estimate("all_reduce", "ring", 1, m, alpha, beta) == 0.0


def test_bad_choices_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown collective 'allreduce'.*Did you mean 'all_reduce'"):
        algorithms.check_choice("allreduce", "ring")
    with pytest.raises(ValueError, match="unknown algorithm 'rings'.*Did you mean 'ring'"):
        algorithms.check_choice("all_reduce", "rings")
    with pytest.raises(ValueError, match="'tree' does not implement all_gather; choose one of ring, rhd, direct"):
        algorithms.check_choice("all_gather", "tree")
    algorithms.check_choice("all_gather", "auto")


def test_the_schedule_printer_shows_every_message_once_per_step() -> None:
    p = Problem(n=4, numel=8, itemsize=4)
    msgs = algorithms.build("all_reduce", "ring", p)
    text = format_schedule(msgs, 4)
    lines = text.splitlines()
    assert lines[0].split() == ["step", "rank", "0", "rank", "1", "rank", "2", "rank", "3"]
    assert len(lines) == 1 + steps(msgs) == 7
    assert sum(line.count("->") for line in lines) == len(msgs)
    for m in msgs:
        sign = "+" if m.kind == "reduce" else "="
        assert f"->{m.dst} {sign}[{m.slo}:{m.shi}]" in lines[1 + m.step]
    marked = format_schedule(msgs, 4, done=[6, 6, 2, 6])
    assert [" *" in line for line in marked.splitlines()[1:7]] == [False, False, True, True, True, True]
    assert marked.splitlines()[-1] == "* not yet done"
    assert "(4 more ranks not shown)" in format_schedule(algorithms.build("all_reduce", "ring", Problem(12, 12, 4)), 12)


def test_the_documentation_table_is_generated_from_the_registry() -> None:
    page = (ROOT / "docs" / "algorithms.md").read_text()
    assert update(page) == page, "docs/algorithms.md is stale: run python3 -m simdist.algorithms.table docs/algorithms.md"
    for a in algorithms.ALGORITHMS:
        assert f"| `{a.collective}` | `{a.name}` |" in markdown()


def _gather_16k(variant: str) -> str:
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    x = torch.ones(4096)  # 16 KiB per rank, 64 KiB gathered
    if variant == "list":
        dist.all_gather([torch.empty(4096) for _ in range(n)], x)
    elif variant == "reduce_scatter_list":
        dist.reduce_scatter(x, [torch.ones(4096) for _ in range(n)])
    else:
        dist.all_gather_into_tensor(torch.empty(4096 * n), x)
    return "ok"


@pytest.mark.parametrize("variant", ["list", "tensor", "reduce_scatter_list"])
def test_auto_prices_all_gather_with_the_whole_buffer_like_the_closed_forms(variant: str) -> None:
    import networkx as nx

    import simdist

    # a fast ring (10 us, 100 GB/s) with slow shortcuts between opposite ranks (1 us, 1 GB/s): the ring pays
    # more latency, recursive doubling (which talks across) more bandwidth; they cross near 38 KB
    g = nx.Graph()
    for i in range(4):
        g.add_edge(i, (i + 1) % 4, bandwidth="100GB/s", latency="10us")
    g.add_edge(0, 2, bandwidth="1GB/s", latency="1us")
    g.add_edge(1, 3, bandwidth="1GB/s", latency="1us")
    cluster = simdist.Cluster.from_graph(g, device="cpu")
    m = 4 * 4096 * 4  # the whole gathered buffer, bytes
    ring = 3 * 10e-6 + 3 / 4 * m / 100e9
    rhd = 2 * 1e-6 + 3 / 4 * m / 1e9
    want = "ring" if ring < rhd else "rhd"
    assert want == "ring"  # at a quarter of the size (one rank's input) it would be rhd
    res = simdist.run(_gather_16k, cluster, args=(variant,))
    spans = res.trace.collectives()
    assert {s.args["algorithm"] for s in spans} == {want}
    assert res.sim_time == pytest.approx(ring, rel=1e-6)
