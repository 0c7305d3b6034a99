"""Which algorithm a collective runs with: the policy over the registry (:mod:`simdist.algorithms`).

The group's choice (``simdist.set_algorithms`` in rank code) comes first, then the cluster's
(``Cluster.algorithms``), then ``"auto"``: the algorithm with the smallest closed-form time, priced with the
alpha-beta of the group's ranks on this cluster. The result is the algorithm that really runs (recursive
halving/doubling falls back to ring off powers of two).
"""

from __future__ import annotations

from simdist import algorithms
from simdist.algorithms import Algorithm
from simdist.network.cluster import Cluster


class AlgorithmSelector:
    """Chooses algorithms for one run's groups on ``cluster``; remembers each group's alpha-beta."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._alpha_beta: dict[int, tuple[tuple[float, float], tuple[float, float]]] = {}

    def select(self, group: int, ranks: list[int], choices: dict[str, str], collective: str, nbytes: int) -> Algorithm:
        """The algorithm for ``collective`` of ``nbytes`` per rank on group number ``group`` (global ``ranks``),
        whose own choices are ``choices``."""
        name = choices.get(collective) or self.cluster.algorithms.get(collective) or algorithms.AUTO
        n = len(ranks)
        if name != algorithms.AUTO:
            return algorithms.get(collective, name).effective(n)
        ab = self._alpha_beta.get(group)
        if ab is None:
            ab = self._alpha_beta[group] = self.cluster.alpha_beta(ranks)
        near, far = ab
        return algorithms.choose(collective, n, nbytes, near, far).effective(n)
