"""hypothesis strategies of what a simulated run can meet: perturbations, clusters and faults.

Each shrinks toward the plainest value: a perturbation toward none at all (the unperturbed run, same trace
hash), a cluster toward the fewest ranks on a switch, faults toward none. So a failing test ends on the smallest
change to today's run that still fails::

    @given(p=perturbations(max_events=20), c=clusters(max_ranks=8))
    def test_step(p, c):
        res = simdist.run(step, c, perturbation=p)
        assert ...
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import strategies as st

from simdist.clock.perturbation import Perturbation
from simdist.errors import RunArgumentError
from simdist.faults import Crash, Fault, FlappingLink, LinkDown, MessageDelay, NodeLoss, SlowLink, Straggler
from simdist.network.cluster import Cluster

#: the largest choice drawn at a decision: a choice counts round the agents tied there (``wrap``), so this only
#: bounds how far apart two equivalent draws may be; 8 agents is more than most decisions meet
MAX_CHOICE = 7
#: the topologies :func:`clusters` draws from, the plainest first (what a failing example shrinks to)
TOPOLOGIES = ("switch", "ring", "fully_connected", "two_level")
#: the faults :func:`faults` draws by default: those a correct program survives (slower, never broken)
SURVIVABLE = ("Straggler", "SlowLink", "FlappingLink", "MessageDelay")
#: the faults it can draw when asked
FAULT_KINDS = (*SURVIVABLE, "Crash", "LinkDown", "NodeLoss")


def perturbations(
    max_events: int = 20,
    *,
    jitter: Mapping[str, float] | None = None,
    callbacks: bool = True,
) -> st.SearchStrategy[Perturbation]:
    """Perturbations of up to ``max_events`` decisions (which tied agent goes first), optionally with latency
    and compute jitter up to ``jitter[...]`` and a drawn ``then()`` callback order; shrinks toward no perturbation
    (no decision taken but the first agent's, no jitter, callbacks in order)."""
    if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 0:
        raise RunArgumentError(f"perturbations: max_events must be an int >= 0, got {max_events!r:.40}")
    bounds = _jitter_bounds(jitter)
    if not isinstance(callbacks, bool):
        raise RunArgumentError(f"perturbations: callbacks must be True or False, got {callbacks!r:.40}")
    return st.builds(
        _perturbation,
        choices=st.lists(st.integers(0, MAX_CHOICE), max_size=max_events),
        latency=_amount(bounds["latency"]),
        compute=_amount(bounds["compute"]),
        callbacks=st.booleans() if callbacks else st.just(False),
        seed=st.integers(0, 2**32 - 1),
    )


def _perturbation(
    choices: list[int], latency: float, compute: float, callbacks: bool, seed: int
) -> Perturbation:
    """The drawn perturbation; its seed counts only where something draws from it (jitter, callbacks), so a
    perturbation with neither has seed 0 and equal draws give equal values."""
    draws = bool(latency or compute or callbacks)
    return Perturbation(
        seed=seed if draws else 0,
        ties="choices",
        choices=tuple(choices),
        wrap=True,
        latency=latency,
        compute=compute,
        callbacks=callbacks,
    )


def _jitter_bounds(jitter: Mapping[str, float] | None) -> dict[str, float]:
    """``jitter`` as a bound per point, 0 where not given."""
    if jitter is None:
        return {"latency": 0.0, "compute": 0.0}
    if not isinstance(jitter, Mapping) or set(jitter) - {"latency", "compute"}:
        raise RunArgumentError(
            f"perturbations: jitter must map 'latency' and/or 'compute' to the largest relative stretch (0.2: up to "
            f"20% longer), got {jitter!r:.60}"
        )
    out = {}
    for key in ("latency", "compute"):
        value = jitter.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise RunArgumentError(
                f"perturbations: jitter[{key!r}] must be a finite number >= 0, got {value!r:.40}"
            )
        out[key] = float(value)
    return out


def _amount(bound: float) -> st.SearchStrategy[float]:
    """A jitter amount in ``[0, bound]`` that shrinks to 0."""
    if bound == 0:
        return st.just(0.0)
    return st.floats(0.0, bound, allow_nan=False, allow_infinity=False)


def clusters(
    max_ranks: int = 8,
    *,
    min_ranks: int = 2,
    topologies: Sequence[str] = TOPOLOGIES,
    device: str = "cpu",
) -> st.SearchStrategy[Cluster]:
    """Clusters of ``min_ranks`` to ``max_ranks`` ranks on ``device``, each of one of ``topologies`` (switch,
    ring, fully_connected, two_level: nodes of ranks); shrinks toward ``min_ranks`` ranks on the first topology."""
    for name, value, least in (("min_ranks", min_ranks, 1), ("max_ranks", max_ranks, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise RunArgumentError(f"clusters: {name} must be an int >= {least}, got {value!r:.40}")
    if max_ranks < min_ranks:
        raise RunArgumentError(f"clusters: max_ranks {max_ranks} is below min_ranks {min_ranks}")
    if isinstance(topologies, str) or not topologies or set(topologies) - set(TOPOLOGIES):
        raise RunArgumentError(f"clusters: topologies must be some of {TOPOLOGIES}, got {topologies!r:.60}")
    return st.builds(
        _cluster,
        st.sampled_from(tuple(topologies)),
        st.integers(min_ranks, max_ranks),
        st.integers(1, max_ranks),
        st.just(device),
    )


def _cluster(topology: str, world: int, per_node: int, device: str) -> Cluster:
    """A ``topology`` cluster of ``world`` ranks; two_level takes the largest divisor of ``world`` up to
    ``per_node`` as its ranks per node."""
    if topology == "two_level":
        per = max(d for d in range(1, min(per_node, world) + 1) if world % d == 0)
        return Cluster.two_level(world // per, gpus_per_node=per, device=device)
    return getattr(Cluster, topology)(world, device=device)


def faults(
    cluster: Cluster | int,
    *,
    max_faults: int = 2,
    kinds: Sequence[str] = SURVIVABLE,
    horizon: float = 1e-3,
) -> st.SearchStrategy[list[Fault]]:
    """Lists of up to ``max_faults`` faults of ``kinds`` (see :mod:`simdist.faults`) on ``cluster`` (or a world of
    that many ranks: link faults then need a cluster), at simulated times below ``horizon`` seconds; shrinks
    toward no fault. The default kinds slow a run without breaking it; name ``Crash``, ``LinkDown`` or
    ``NodeLoss`` to draw those too."""
    world = cluster.world_size if isinstance(cluster, Cluster) else cluster
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise RunArgumentError(f"faults: give a simdist.Cluster or a world size >= 1, got {cluster!r:.60}")
    if isinstance(kinds, str) or not kinds or set(kinds) - set(FAULT_KINDS):
        raise RunArgumentError(f"faults: kinds must be some of {FAULT_KINDS}, got {kinds!r:.60}")
    links = len(cluster.links) if isinstance(cluster, Cluster) else 0
    needs_links = {"SlowLink", "FlappingLink", "LinkDown"}
    if not links and set(kinds) & needs_links:
        kinds = [k for k in kinds if k not in needs_links]
        if not kinds:
            raise RunArgumentError("faults: link faults need a simdist.Cluster (its links), not a world size")
    if isinstance(max_faults, bool) or not isinstance(max_faults, int) or max_faults < 0:
        raise RunArgumentError(f"faults: max_faults must be an int >= 0, got {max_faults!r:.40}")
    if isinstance(horizon, bool) or not isinstance(horizon, (int, float)) or not 0 < horizon < math.inf:
        raise RunArgumentError(
            f"faults: horizon must be a positive number of simulated seconds, got {horizon!r}"
        )
    nodes = world // cluster.ranks_per_node if isinstance(cluster, Cluster) and cluster.ranks_per_node else 0
    if "NodeLoss" in kinds and not nodes:
        kinds = [k for k in kinds if k != "NodeLoss"]
        if not kinds:
            raise RunArgumentError(
                "faults: NodeLoss needs a cluster of nodes (a two_level cluster or a preset)"
            )
    one = st.one_of(*(_fault(k, world, links, nodes, float(horizon)) for k in kinds))
    return st.lists(one, max_size=max_faults)


def _fault(kind: str, world: int, links: int, nodes: int, horizon: float) -> st.SearchStrategy[Any]:
    """One fault of ``kind``, its times below ``horizon``."""
    rank = st.integers(0, world - 1)
    time = st.floats(0.0, horizon, allow_nan=False, allow_infinity=False)
    window = st.one_of(st.none(), st.tuples(time, time).filter(lambda w: w[0] < w[1]))
    link = st.integers(0, max(links - 1, 0))
    if kind == "Straggler":
        return st.builds(Straggler, rank=rank, slowdown=st.floats(1.0, 10.0), window=window)
    if kind == "SlowLink":
        return st.builds(
            SlowLink, link=link, bandwidth_factor=st.floats(0.01, 1.0), latency=time, window=window
        )
    if kind == "FlappingLink":
        period = st.floats(horizon / 100, horizon)
        return period.flatmap(
            lambda p: st.builds(
                FlappingLink, link=link, period=st.just(p), down=st.floats(p / 100, p / 2), window=window
            )
        )
    if kind == "MessageDelay":
        delay = st.floats(horizon / 1000, horizon)
        return st.builds(MessageDelay, src=rank, dst=rank, delay=delay, window=window)
    if kind == "Crash":
        by_time = st.builds(Crash, rank=rank, at=time)
        return st.one_of(st.builds(Crash, rank=rank, collective=st.integers(1, 8)), by_time)
    if kind == "LinkDown":
        return st.builds(LinkDown, link=link, at=time)
    return st.builds(NodeLoss, node=st.integers(0, nodes - 1), at=time)
