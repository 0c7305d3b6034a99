"""Which algorithm a collective runs with, and how its messages are timed: the policy over the registry
(:mod:`simdist.algorithms`) and NCCL's tuner (:mod:`simdist.algorithms.nccl`).

The group's choice (``simdist.set_algorithms`` in rank code) comes first, then the cluster's
(``Cluster.algorithms``), then ``"auto"``. Under the cluster's ``"alpha-beta"`` collective model, ``auto`` is
the algorithm with the smallest closed-form time, priced with the alpha-beta of the group's ranks (round by
round for recursive halving/doubling, whose partners are at a different distance each round), and each
message moves at its links' own latency and bandwidth. Under ``"nccl"``, ``auto`` is the algorithm and
protocol NCCL's tuner picks (within the group's ``NCCL_ALGO``/``NCCL_PROTO``), the schedule that moves the
data is the closest one simdist has (ring for NCCL's rings and NVLS, the binomial tree for its tree), and
every message is paced so that the uncontended schedule takes the model's time (the tuner's prediction and
the fill of an NVLS pipeline, :mod:`simdist.algorithms.nccl.runtime`). Under ``"gloo"``,
``auto`` is what torch's gloo backend runs (:data:`GLOO`), and a reduce-scatter is paced to take the time of
the ring all-reduce of its whole input, which is what ProcessGroupGloo runs for it; at
``Cluster.local_bandwidth`` (bytes/s) each rank adds a received reduce message in before it goes on, and makes
the copies ProcessGroupGloo makes (:data:`GLOO_COPIES`), as gloo's ranks do on their own threads. The result is the
algorithm that really runs (recursive halving/doubling falls back to ring off powers of two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from simdist import algorithms
from simdist.algorithms import Algorithm, nccl
from simdist.network.cluster import Cluster

#: the schedule that moves the data of each NCCL algorithm (NVLS reduces in the switch; the ring's messages
#: carry the same result)
_SCHEDULE = {"Ring": "ring", "Tree": "tree", "NVLS": "ring", "NVLSTree": "ring"}
#: a pinned simdist algorithm as NCCL's
_PINNED = {"ring": "Ring", "tree": "Tree"}
#: the algorithm gloo runs each collective with on CPU tensors (gloo's allreduce.cc: ring unless bcube is asked
#: for; allgather.cc: a ring; broadcast.cc: a binomial tree; reduce.cc: a ring). torch's ProcessGroupGloo runs
#: reduce_scatter_tensor as an all-reduce of a clone of the whole input, keeping its rank's chunk
#: (ProcessGroupGloo::reduce_scatter_tensor_coalesced): the all-reduce's ring sets its time
GLOO = {
    "all_reduce": "ring",
    "all_gather": "ring",
    "broadcast": "tree",
    "reduce": "ring",
    "reduce_scatter": "ring",
}
#: bytes each rank copies on its own before and after the messages, per byte of the buffer the closed forms count
#: (an all-gather's output, a reduce-scatter's input), as torch's ProcessGroupGloo runs them on one tensor: gloo's
#: allgather copies the rank's input into the flat output (1/n) and torch copies the flat output into the
#: caller's (1); reduce_scatter_tensor clones the whole input (1) and copies the rank's chunk out (1/n)
GLOO_COPIES: dict[str, Callable[[int], tuple[float, float]]] = {
    "all_gather": lambda n: (1.0 / n, 1.0),
    "reduce_scatter": lambda n: (1.0, 1.0 / n),
}


@dataclass(frozen=True)
class Selection:
    """The algorithm a collective runs and how its messages are timed."""

    algorithm: Algorithm
    #: (seconds of latency, seconds per byte) of every message; None: each link's own
    pace: tuple[float, float] | None = None
    #: NCCL's algorithm and protocol ("NVLS/Simple") when NCCL's model times the call
    nccl: str | None = None
    #: seconds per byte the receiver of a reduce message spends adding it in (the gloo model); 0: free
    reduce_cost: float = 0.0
    #: seconds each rank spends copying on its own before its first message and after its last (the gloo model)
    local: tuple[float, float] = (0.0, 0.0)


class AlgorithmSelector:
    """Chooses algorithms for one run's groups on ``cluster``; remembers each group's alpha-beta and fabric.

    ``symmetric``: every hop of a group's ring costs what its first does, and every pair of members ``d`` apart
    what its first member and member ``d`` cost (a symmetric run's condition), so a group is priced from its first
    member's routes instead of every member's (O(1) routes rather than O(n) at 100,000 ranks).
    """

    def __init__(self, cluster: Cluster, symmetric: bool = False) -> None:
        self.cluster = cluster
        self.symmetric = symmetric
        self._alpha_beta: dict[int, tuple[tuple[float, float], tuple[float, float]]] = {}
        self._fabrics: dict[int, nccl.Fabric] = {}
        self._hops: dict[int, dict[int, tuple[float, float]]] = {}
        #: (group, collective, bytes) -> auto's choice: pricing round by round costs O(n log n)
        self._auto: dict[tuple[int, str, int], Selection] = {}
        #: (group, selection, bytes) -> its closed-form seconds, for the same reason
        self._seconds: dict[tuple[int, Selection, int], float] = {}
        if cluster.collective_model == "nccl" and cluster.world_size > 1:
            cluster.nccl_fabric([0, 1])  # a cluster without nodes is refused before any rank runs

    def select(
        self,
        group: int,
        ranks: list[int],
        choices: dict[str, str],
        collective: str,
        nbytes: int,
        enabled: nccl.Enabled | None = None,
        by_nccl: bool = True,
    ) -> Selection:
        """The algorithm for ``collective`` of ``nbytes`` per rank on group number ``group`` (global ``ranks``),
        whose own choices are ``choices`` and whose ``NCCL_ALGO``/``NCCL_PROTO`` leave ``enabled``; ``by_nccl``
        False (a group presenting gloo) keeps the alpha-beta timing under the cluster's NCCL model."""
        name = choices.get(collective) or self.cluster.algorithms.get(collective) or algorithms.AUTO
        n = len(ranks)
        if by_nccl and self.cluster.collective_model == "nccl" and n > 1 and collective in nccl.COLLECTIVES:
            timed = self._nccl(group, ranks, name, collective, nbytes, enabled or nccl.Enabled())
            if timed is not None:
                return timed
        gloo = self.cluster.collective_model == "gloo" and n > 1 and name == algorithms.AUTO
        if gloo and collective in GLOO:
            name = GLOO[collective]
        if name != algorithms.AUTO:
            cost = 1.0 / self.cluster.local_bandwidth if self.cluster.collective_model == "gloo" else 0.0
            before, after = GLOO_COPIES[collective](n) if cost and collective in GLOO_COPIES else (0.0, 0.0)
            local = (nbytes * cost * before, nbytes * cost * after)
            chosen = Selection(algorithms.get(collective, name).effective(n), reduce_cost=cost, local=local)
            return (
                self._gloo_reduce_scatter(group, ranks, chosen, nbytes)
                if gloo and collective == "reduce_scatter"
                else chosen
            )
        ab = self._group_alpha_beta(group, ranks)
        near, far = ab
        key = (group, collective, nbytes)
        known = self._auto.get(key)
        if known is not None:
            return known
        hop = self._hop_price(group, ranks)
        chosen = self._auto[key] = Selection(
            algorithms.choose(collective, n, nbytes, near, far, hop).effective(n)
        )
        return chosen

    def _group_alpha_beta(self, group: int, ranks: list[int]) -> tuple[tuple[float, float], tuple[float, float]]:
        """The (near, far) alpha-beta of group number ``group`` (see ``Cluster.alpha_beta``), remembered."""
        ab = self._alpha_beta.get(group)
        if ab is None:
            if self.symmetric and len(ranks) > 1:
                ab = (self._pair(ranks[0], ranks[1]), self._pair(ranks[0], ranks[len(ranks) // 2]))
            else:
                ab = self.cluster.alpha_beta(ranks)
            self._alpha_beta[group] = ab
        return ab

    def _pair(self, a: int, b: int) -> tuple[float, float]:
        """(latency s, seconds per byte) of the route from global rank ``a`` to ``b``."""
        return self.cluster.path_latency(a, b), 1.0 / self.cluster.path_bandwidth(a, b)

    def _hop_price(self, group: int, ranks: list[int]) -> Callable[[int], tuple[float, float]]:
        """The price of one round between members ``d`` apart in group number ``group``, remembered per ``d``."""
        hops = self._hops.setdefault(group, {})

        def hop(d: int) -> tuple[float, float]:
            price = hops.get(d)
            if price is None:
                if self.symmetric:
                    price = self._pair(ranks[0], ranks[d]) if d < len(ranks) else (0.0, 0.0)
                else:
                    price = self.cluster.hop_alpha_beta(ranks, d)
                hops[d] = price
            return price

        return hop

    def seconds(self, group: int, ranks: list[int], selection: Selection, nbytes: int) -> float:
        """The closed-form seconds of ``selection`` moving ``nbytes`` per rank on group number ``group``: what its
        uncontended schedule takes from start to its last rank's end (a symmetric run's collective time)."""
        key = (group, selection, nbytes)
        known = self._seconds.get(key)
        if known is None:
            known = self._seconds[key] = self._closed_form(group, ranks, selection, nbytes)
        return known

    def _closed_form(self, group: int, ranks: list[int], selection: Selection, nbytes: int) -> float:
        """:meth:`seconds`, computed."""
        n = len(ranks)
        algo = selection.algorithm
        if selection.pace is not None:  # every message paced: the schedule's closed form at that pace
            return algo.estimate(n, nbytes, *selection.pace)
        near, far = self._group_alpha_beta(group, ranks)
        rounds = algo.estimate_rounds(n, nbytes, self._hop_price(group, ranks))
        if rounds is not None:
            return rounds
        return algo.estimate(n, nbytes, *(near if algo.reach == "neighbours" else far))

    def _gloo_reduce_scatter(self, group: int, ranks: list[int], chosen: Selection, nbytes: int) -> Selection:
        """``chosen``'s reduce-scatter schedule paced to take the closed-form time of the ring all-reduce of its
        whole input (``nbytes``), priced with the group's slowest pair's alpha-beta, as gloo runs it."""
        ab = self._group_alpha_beta(group, ranks)
        alpha, beta = ab[1]
        n = len(ranks)
        ring = algorithms.get("all_reduce", "ring")
        algo = chosen.algorithm
        hops, path_bytes = algo.estimate(n, nbytes, 1.0, 0.0), algo.estimate(n, nbytes, 0.0, 1.0)
        latency, moving = ring.estimate(n, nbytes, alpha, 0.0), ring.estimate(n, nbytes, 0.0, beta)
        pace = (latency / hops, moving / path_bytes if path_bytes > 0 else 0.0)
        return Selection(algo, pace, reduce_cost=chosen.reduce_cost, local=chosen.local)

    def _nccl(
        self, group: int, ranks: list[int], name: str, collective: str, nbytes: int, enabled: nccl.Enabled
    ) -> Selection | None:
        """NCCL's choice and pace, or None where a pinned algorithm is not one NCCL runs this collective with."""
        fab = self._fabrics.get(group)
        if fab is None:
            fab = self._fabrics[group] = self.cluster.nccl_fabric(ranks)
        if name != algorithms.AUTO:
            pinned = _PINNED.get(name)
            if pinned is None or not any(a == pinned for a, _ in nccl.candidates(fab, collective)):
                return None  # the user's schedule, on the links' own timing
            enabled = nccl.Enabled(frozenset({pinned}), enabled.protocols)
        choice = nccl.choose(fab, collective, nbytes, enabled)
        n = len(ranks)
        algo = algorithms.get(collective, _SCHEDULE[choice.algorithm]).effective(n)
        # the schedule's closed form splits into (latency count) x alpha + (bytes on its critical path) x beta:
        # spreading NCCL's latency over the first and the rest of its time over the second makes the
        # uncontended schedule take exactly the model's time
        hops = algo.estimate(n, nbytes, 1.0, 0.0)
        path_bytes = algo.estimate(n, nbytes, 0.0, 1.0)
        per_byte = (choice.seconds - choice.latency) / path_bytes if path_bytes > 0 else 0.0
        return Selection(algo, (choice.latency / hops, per_byte), choice.label)
