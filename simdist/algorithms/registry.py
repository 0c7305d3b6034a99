"""The registry of collective algorithms: each (collective, algorithm) declared once, with everything about it.

An :class:`Algorithm` says how its schedule is built, its closed-form alpha-beta time on an uncontended
network (Thakur, Rabenseifner & Gropp 2005), which pair of ranks' alpha-beta it is priced with, and its
constraints. Cluster validation, :func:`simdist.set_algorithms`, ``"auto"`` selection, ``simdist bench`` and
the documentation all read this one table. What each collective is, whatever algorithm runs it, is its
:class:`~simdist.algorithms.collectives.Collective` record.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from simdist.algorithms import direct, halving_doubling, ring, tree
from simdist.algorithms.collectives import COLLECTIVE_RECORDS, Collective
from simdist.algorithms.schedule import Msg, pipeline_chunks, split_offsets


@dataclass(frozen=True)
class Problem:
    """One collective call as an algorithm sees it.

    ``numel`` counts the elements of each rank's whole buffer: for reduce-scatter, all-gather, gather and
    scatter that is the n-chunk buffer. All-to-all gives per-rank block sizes instead (``send_counts[r][j]``
    elements from rank r to rank j, ``recv_counts[j][r]`` the block rank j expects from rank r).
    """

    n: int
    numel: int
    itemsize: int
    root: int = 0
    send_counts: tuple[tuple[int, ...], ...] | None = None
    recv_counts: tuple[tuple[int, ...], ...] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of each rank's buffer."""
        return self.numel * self.itemsize


#: a schedule builder: the messages of one call (group ranks, element offsets into each rank's flat buffers)
Builder = Callable[[Problem], Sequence[Msg]]
#: a closed form: seconds for (n ranks, m bytes, alpha seconds, beta seconds per byte, numel elements)
ClosedForm = Callable[[int, float, float, float, int], float]
#: the slowest (alpha seconds, beta seconds per byte) between the group's ranks r and r XOR d, for a distance d
HopPrice = Callable[[int], "tuple[float, float]"]
#: a closed form priced round by round: seconds for (n ranks, m bytes, the price of each exchange distance)
RoundsForm = Callable[[int, float, HopPrice], float]


@dataclass(frozen=True)
class Algorithm:
    """One way to run one collective."""

    collective: str
    name: str
    build: Builder
    #: uncontended time in seconds, as a function of (n, bytes, alpha, beta, numel); n >= 2
    closed_form: ClosedForm
    #: which alpha-beta prices it: "neighbours" (the slowest hop between ring neighbours: it only talks to
    #: them) or "group" (between the group's farthest-apart ranks)
    reach: Literal["neighbours", "group"]
    summary: str
    #: the algorithm that really runs on a group whose size is not a power of two (None: any size works)
    non_power_of_two: str | None = None
    #: ``"auto"`` considers it only on groups of at most this many ranks (None: any size); the closed form of
    #: an all-to-all-style exchange does not see the contention of n^2 simultaneous messages
    auto_max_ranks: int | None = None
    #: formula of ``closed_form`` as documentation prints it
    formula: str = ""
    #: the closed form with each round priced between the ranks it pairs (None: every round at one price);
    #: recursive halving and doubling exchange with partners at a different distance each round, so on a
    #: two-level cluster only the rounds that cross nodes pay the fabric's latency and bandwidth
    rounds_form: RoundsForm | None = None

    def effective(self, n: int) -> Algorithm:
        """The algorithm that runs on ``n`` ranks (itself, or its fallback off powers of two)."""
        if self.non_power_of_two is not None and n & (n - 1):
            return get(self.collective, self.non_power_of_two)
        return self

    def estimate(self, n: int, nbytes: float, alpha: float, beta: float, numel: int | None = None) -> float:
        """Closed-form seconds on ``n`` ranks for ``nbytes`` per rank; ``beta`` is seconds per byte."""
        if n <= 1:
            return 0.0
        algo = self.effective(n)
        return algo.closed_form(n, nbytes, alpha, beta, numel if numel is not None else max(1, int(nbytes)))

    def estimate_rounds(self, n: int, nbytes: float, price: HopPrice) -> float | None:
        """Seconds on ``n`` ranks priced round by round with ``price``, or None without a per-round form."""
        if n <= 1:
            return 0.0
        algo = self.effective(n)
        return algo.rounds_form(n, nbytes, price) if algo.rounds_form is not None else None

    def schedule(self, problem: Problem) -> Sequence[Msg]:
        """The messages of ``problem`` (none on one rank)."""
        if problem.n == 1:
            return []
        return self.effective(problem.n).build(problem)


def _rotated(build: Callable[[int, list[int]], list[Msg]]) -> Builder:
    """A relative-rank (root = 0) gather/scatter schedule mapped onto group ranks; buffers stay in relative
    order (chunk v belongs to rank (root + v) % n)."""

    def run(p: Problem) -> list[Msg]:
        msgs = build(p.n, split_offsets(p.numel, p.n))
        return [m._replace(src=(m.src + p.root) % p.n, dst=(m.dst + p.root) % p.n) for m in msgs]

    return run


def _chunked(build: Callable[[int, list[int]], Sequence[Msg]]) -> Builder:
    """A builder over n equal chunks of the buffer."""
    return lambda p: build(p.n, split_offsets(p.numel, p.n))


def _lg(n: int) -> int:
    return tree.levels(n)


def _rhd_all_reduce_time(n: int, m: float, a: float, b: float, _numel: int) -> float:
    p = halving_doubling.pow2_floor(n)
    fold = 2 * (a + m * b) if p != n else 0.0
    return 2 * (p.bit_length() - 1) * a + 2 * (p - 1) / p * m * b + fold


def _halving_rounds(p: int, m: float, price: HopPrice) -> float:
    """Recursive halving over a power of two ``p``: round i exchanges m / 2^(i+1) bytes at distance p / 2^(i+1)
    (recursive doubling sends the same amounts at the same distances in the reverse order)."""
    t = 0.0
    for i in range(p.bit_length() - 1):
        a, b = price(p >> (i + 1))
        t += a + m / (2 << i) * b
    return t


def _rhd_all_reduce_rounds(n: int, m: float, price: HopPrice) -> float:
    p = halving_doubling.pow2_floor(n)
    fold = 0.0
    if p != n:
        a, b = price(p)  # extra rank p + e folds into e = (p + e) XOR p
        fold = 2 * (a + m * b)
    return 2 * _halving_rounds(p, m, price) + fold


def _tree_all_reduce_rounds(n: int, m: float, price: HopPrice) -> float:
    """Binomial reduce then broadcast, each message the whole buffer between ranks 2^k apart. A rank sends as
    soon as its own subtree is done, so the subtrees of a group that is not a power of two finish at
    different times; messages arriving at one rank at the same price share its link and arrive one after
    another. The reduce takes the longest such chain to rank 0; the broadcast walks the same tree down."""
    prices = [price(1 << k) for k in range(_lg(n))]
    done = [0.0] * n  # when relative rank v holds its whole subtree's reduction
    for v in range(n - 1, -1, -1):
        children = []
        k = 0
        while k < len(prices) and v % (2 << k) == 0 and v + (1 << k) < n:
            children.append((done[v + (1 << k)], k))
            k += 1
        free: dict[tuple[float, float], float] = {}  # when v's link at each price is next free
        for ready, k in sorted(children):
            a, b = prices[k]
            leave = free[prices[k]] = max(free.get(prices[k], 0.0), ready) + m * b
            done[v] = max(done[v], leave + a)
    return 2 * done[0]


def _rhd_half_rounds(n: int, m: float, price: HopPrice) -> float:
    return _halving_rounds(n, m, price)


def _ring_pipeline_time(n: int, m: float, a: float, b: float, numel: int) -> float:
    # a chain of n-1 links carrying K pieces back to back: the latency is paid once per hop and the last
    # piece leaves the root after K piece-times, then crosses n-2 more links
    k = pipeline_chunks(int(m), numel)
    return (n - 1) * a + (n - 2 + k) * m / k * b


def _all_reduce_family(collective: str) -> list[Algorithm]:
    """All-reduce, and the barrier that is a one-element all-reduce (what NCCL's barrier does)."""
    return [
        Algorithm(
            collective, "ring", lambda p: ring.all_reduce(p.n, p.numel),
            lambda n, m, a, b, _: 2 * (n - 1) * a + 2 * (n - 1) / n * m * b, "neighbours",
            "reduce-scatter then all-gather around the ring", formula="2(n-1)α + 2(n-1)/n·mβ",
        ),
        Algorithm(
            collective, "tree", lambda p: tree.all_reduce(p.n, p.numel),
            lambda n, m, a, b, _: 2 * _lg(n) * (a + m * b), "group",
            "binomial-tree reduce to rank 0, then binomial-tree broadcast", formula="2⌈log2 n⌉(α + mβ)",
            rounds_form=_tree_all_reduce_rounds,
        ),
        Algorithm(
            collective, "rhd", lambda p: halving_doubling.all_reduce(p.n, p.numel), _rhd_all_reduce_time, "group",
            "recursive halving reduce-scatter, recursive doubling all-gather (Rabenseifner); extra ranks of a "
            "non-power-of-two group fold into partners first",
            formula="2 log2(p)α + 2(p-1)/p·mβ (+ 2(α + mβ) to fold when p < n; p = largest power of two ≤ n)",
            rounds_form=_rhd_all_reduce_rounds,
        ),
        Algorithm(
            collective, "direct", lambda p: direct.all_reduce(p.n, p.numel),
            lambda n, m, a, b, _: 2 * a + 2 * (n - 1) / n * m * b, "group",
            "every rank sends chunk j to rank j, which reduces it and sends it to every rank",
            auto_max_ranks=2, formula="2α + 2(n-1)/n·mβ",
        ),
    ]


ALGORITHMS: tuple[Algorithm, ...] = (
    *_all_reduce_family("all_reduce"),
    Algorithm(
        "reduce_scatter", "ring", _chunked(ring.reduce_scatter),
        lambda n, m, a, b, _: (n - 1) * a + (n - 1) / n * m * b, "neighbours",
        "n-1 steps around the ring, each reducing one chunk", formula="(n-1)α + (n-1)/n·mβ",
    ),
    Algorithm(
        "reduce_scatter", "rhd", _chunked(halving_doubling.reduce_scatter),
        lambda n, m, a, b, _: _lg(n) * a + (n - 1) / n * m * b, "group",
        "recursive halving", non_power_of_two="ring", formula="log2(n)α + (n-1)/n·mβ",
        rounds_form=_rhd_half_rounds,
    ),
    Algorithm(
        "reduce_scatter", "direct", _chunked(direct.reduce_scatter),
        lambda n, m, a, b, _: a + (n - 1) / n * m * b, "group",
        "every rank sends chunk j straight to rank j", auto_max_ranks=2, formula="α + (n-1)/n·mβ",
    ),
    Algorithm(
        "all_gather", "ring", _chunked(ring.all_gather),
        lambda n, m, a, b, _: (n - 1) * a + (n - 1) / n * m * b, "neighbours",
        "n-1 steps around the ring, each forwarding one chunk", formula="(n-1)α + (n-1)/n·mβ",
    ),
    Algorithm(
        "all_gather", "rhd", _chunked(halving_doubling.all_gather),
        lambda n, m, a, b, _: _lg(n) * a + (n - 1) / n * m * b, "group",
        "recursive doubling", non_power_of_two="ring", formula="log2(n)α + (n-1)/n·mβ",
        rounds_form=_rhd_half_rounds,
    ),
    Algorithm(
        "all_gather", "direct", _chunked(direct.all_gather),
        lambda n, m, a, b, _: a + (n - 1) / n * m * b, "group",
        "every rank sends its chunk straight to every other rank", auto_max_ranks=2, formula="α + (n-1)/n·mβ",
    ),
    Algorithm(
        "broadcast", "ring", lambda p: ring.broadcast(p.n, p.numel, p.nbytes, p.root), _ring_pipeline_time,
        "neighbours", "pipelined chain from the root in K pieces of about 256 KiB (at most 32)",
        formula="(n-1)α + (n-2+K)·m/K·β",
    ),
    Algorithm(
        "broadcast", "tree", lambda p: tree.broadcast(p.n, p.numel, p.root),
        lambda n, m, a, b, _: _lg(n) * (a + m * b), "group", "binomial tree from the root",
        formula="⌈log2 n⌉(α + mβ)",
    ),
    Algorithm(
        "broadcast", "direct", lambda p: direct.broadcast(p.n, p.numel, p.root),
        lambda n, m, a, b, _: a + (n - 1) * m * b, "group", "the root sends to every rank",
        formula="α + (n-1)·mβ",
    ),
    Algorithm(
        "reduce", "ring", lambda p: ring.reduce(p.n, p.numel, p.nbytes, p.root), _ring_pipeline_time,
        "neighbours", "pipelined chain ending at the root in K pieces of about 256 KiB (at most 32)",
        formula="(n-1)α + (n-2+K)·m/K·β",
    ),
    Algorithm(
        "reduce", "tree", lambda p: tree.reduce(p.n, p.numel, p.root),
        lambda n, m, a, b, _: _lg(n) * (a + m * b), "group", "binomial tree to the root",
        formula="⌈log2 n⌉(α + mβ)",
    ),
    Algorithm(
        "reduce", "direct", lambda p: direct.reduce(p.n, p.numel, p.root),
        lambda n, m, a, b, _: a + (n - 1) * m * b, "group", "every rank sends to the root",
        formula="α + (n-1)·mβ",
    ),
    Algorithm(
        "gather", "tree", _rotated(tree.gather), lambda n, m, a, b, _: _lg(n) * a + (n - 1) / n * m * b,
        "group", "binomial tree to the root, subtrees' chunks forwarded together", formula="⌈log2 n⌉α + (n-1)/n·mβ",
    ),
    Algorithm(
        "gather", "direct", _rotated(direct.gather), lambda n, m, a, b, _: a + (n - 1) / n * m * b,
        "group", "every rank sends its chunk to the root", formula="α + (n-1)/n·mβ",
    ),
    Algorithm(
        "scatter", "tree", _rotated(tree.scatter), lambda n, m, a, b, _: _lg(n) * a + (n - 1) / n * m * b,
        "group", "binomial tree from the root, subtrees' chunks sent together", formula="⌈log2 n⌉α + (n-1)/n·mβ",
    ),
    Algorithm(
        "scatter", "direct", _rotated(direct.scatter), lambda n, m, a, b, _: a + (n - 1) / n * m * b,
        "group", "the root sends each rank its chunk", formula="α + (n-1)/n·mβ",
    ),
    Algorithm(
        "all_to_all", "direct",
        lambda p: direct.all_to_all(p.n, p.send_counts or (), p.recv_counts or ()),
        lambda n, m, a, b, _: a + (n - 1) / n * m * b, "group",
        "every rank sends block j straight to rank j", formula="α + (n-1)/n·mβ",
    ),
    *_all_reduce_family("barrier"),
)
"""Every algorithm; per collective, declaration order is the order of preference when estimates tie."""

_BY_KEY: dict[tuple[str, str], Algorithm] = {(a.collective, a.name): a for a in ALGORITHMS}

#: the collectives, in declaration order (each has its record and at least one algorithm)
COLLECTIVES: tuple[str, ...] = tuple(c.name for c in COLLECTIVE_RECORDS)
_RECORDS: dict[str, Collective] = {c.name: c for c in COLLECTIVE_RECORDS}
#: every algorithm name, in declaration order
NAMES: tuple[str, ...] = tuple(dict.fromkeys(a.name for a in ALGORITHMS))
#: what a cluster or group may choose instead of a name: the cheapest algorithm by its closed form
AUTO = "auto"


def names(collective: str) -> tuple[str, ...]:
    """The algorithms of ``collective`` in order of preference."""
    check_collective(collective)
    return tuple(a.name for a in ALGORITHMS if a.collective == collective)


def collective(name: str) -> Collective:
    """The record of the collective ``name``; a ValueError naming the choices if there is none."""
    check_collective(name)
    return _RECORDS[name]


def get(collective: str, name: str) -> Algorithm:
    """The algorithm ``name`` of ``collective``; a ValueError naming the choices if there is none."""
    algo = _BY_KEY.get((collective, name))
    if algo is None:
        check_choice(collective, name)  # raises, naming the choices, unless name is "auto"
        raise ValueError(f"'auto' names no algorithm of {collective}: it asks choose() for one")
    return algo


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=3, cutoff=0.6)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def check_collective(collective: str) -> None:
    """Raise ValueError unless ``collective`` has algorithms."""
    if not isinstance(collective, str):
        # ValueError like every other bad choice: callers turn ValueErrors into ClusterSpecErrors
        raise ValueError(  # noqa: TRY004
            f"a collective is named by a string such as 'all_reduce'; found {type(collective).__name__} "
            f"{collective!r}; expected one of {', '.join(sorted(COLLECTIVES))}"
        )
    if collective not in COLLECTIVES:
        raise ValueError(
            f"unknown collective {collective!r}; expected one of {', '.join(sorted(COLLECTIVES))}."
            f"{_did_you_mean(collective, COLLECTIVES)}"
        )


def check_choice(collective: str, name: str) -> None:
    """Raise ValueError unless ``name`` (or ``"auto"``) is an algorithm of ``collective``."""
    check_collective(collective)
    if not isinstance(name, str):
        raise ValueError(  # noqa: TRY004 - as above
            f"an algorithm is named by one string such as 'ring'; found {type(name).__name__} {name!r}; "
            f"expected one of {', '.join(names(collective))} or 'auto'"
        )
    if name == AUTO or (collective, name) in _BY_KEY:
        return
    if name not in NAMES:
        raise ValueError(
            f"unknown algorithm {name!r}; expected one of {', '.join(sorted((*NAMES, AUTO)))}."
            f"{_did_you_mean(name, (*NAMES, AUTO))}"
        )
    raise ValueError(f"{name!r} does not implement {collective}; choose one of {', '.join(names(collective))} or 'auto'")


def choose(
    collective: str,
    n: int,
    nbytes: float,
    near: tuple[float, float],
    far: tuple[float, float],
    hop: HopPrice | None = None,
) -> Algorithm:
    """The algorithm ``"auto"`` picks: the smallest closed-form time, ties to the earlier declared.

    ``near`` is the slowest (alpha, beta) between ring neighbours, ``far`` between the farthest-apart ranks;
    each algorithm is priced with the pair its ``reach`` names, or round by round with ``hop`` where it has a
    per-round form.
    """
    best, best_t = None, math.inf
    for algo in ALGORITHMS:
        if algo.collective != collective or (algo.auto_max_ranks is not None and n > algo.auto_max_ranks):
            continue
        alpha, beta = near if algo.reach == "neighbours" else far
        t = algo.estimate_rounds(n, nbytes, hop) if hop is not None else None
        if t is None:
            t = algo.estimate(n, nbytes, alpha, beta)
        if t < best_t * (1 - 1e-9):
            best, best_t = algo, t
    if best is None:
        check_collective(collective)
        raise AssertionError(f"no algorithm of {collective} is eligible on {n} ranks")
    return best


def estimate(
    collective: str, algorithm: str, n: int, nbytes: float, alpha: float, beta: float, numel: int | None = None
) -> float:
    """Closed-form seconds of ``algorithm`` running ``collective`` on ``n`` ranks, ``nbytes`` per rank."""
    return get(collective, algorithm).estimate(n, nbytes, alpha, beta, numel)


def build(collective: str, algorithm: str, problem: Problem) -> Sequence[Msg]:
    """The schedule of ``algorithm`` running ``collective`` for ``problem``."""
    return get(collective, algorithm).schedule(problem)
