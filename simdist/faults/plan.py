"""A run's faults checked against its world, and read out as each mechanism needs them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from simdist.errors import FaultSpecError
from simdist.faults.specs import Crash, Fault, MessageDelay, NodeLoss, Straggler, from_json, in_window


def as_faults(faults: Any) -> tuple[Fault, ...]:
    """``faults`` (a list of fault records, or their JSON mappings) as a tuple of records."""
    if faults is None:
        return ()
    if isinstance(faults, (Fault, dict)):
        raise FaultSpecError(
            f"faults must be a list of faults, got one {type(faults).__name__}: write faults=[...]"
        )
    if isinstance(faults, (str, bytes)) or not isinstance(faults, (list, tuple)):
        raise FaultSpecError(
            f"faults must be a list of simdist.faults records (Crash, Straggler, ...), got {type(faults).__name__} "
            f"{faults!r:.60}"
        )
    out = []
    for i, f in enumerate(faults):
        if isinstance(f, dict):
            f = from_json(f)
        if type(f) not in Fault.TYPES.values():
            raise FaultSpecError(
                f"faults[{i}] must be a simdist.faults record (Crash, Straggler, SlowLink, FlappingLink, MessageDelay, "
                f"LinkDown, NodeLoss) or its JSON mapping, got {type(f).__name__} {f!r:.60}"
            )
        out.append(f)
    return tuple(out)


def check_world(faults: Sequence[Fault], world_size: int, ranks_per_node: int | None, cluster: str) -> None:
    """Refuse a fault naming a rank or node that a world of ``world_size`` ranks on ``cluster`` lacks."""

    def rank_ok(fault: Fault, name: str, rank: int) -> None:
        if rank >= world_size:
            raise FaultSpecError(
                f"{type(fault).__name__}: {name} {rank} is not a rank of cluster {cluster!r}, whose ranks are "
                f"0..{world_size - 1}"
            )

    for f in faults:
        if isinstance(f, Crash):
            rank_ok(f, "rank", f.rank)
        elif isinstance(f, Straggler):
            for r in f.rank:  # type: ignore[union-attr]
                rank_ok(f, "rank", r)
        elif isinstance(f, MessageDelay):
            for r in (*f.src, *f.dst):  # type: ignore[misc]
                rank_ok(f, "rank", r)
        elif isinstance(f, NodeLoss):
            if ranks_per_node is None:
                raise FaultSpecError(
                    f"NodeLoss(node={f.node}): cluster {cluster!r} has no nodes (build one with Cluster.two_level or "
                    f"a preset such as 'dgx-h100'); crash its ranks with Crash and fail links with LinkDown instead"
                )
            nodes = -(-world_size // ranks_per_node)
            if f.node >= nodes:
                raise FaultSpecError(
                    f"NodeLoss: node {f.node} is not a node of cluster {cluster!r}, whose nodes are 0..{nodes - 1}"
                )


def straggling(faults: Sequence[Fault]) -> Callable[[int, float], float] | None:
    """``factor(rank, start)``: how many times longer an op of ``rank`` starting at ``start`` takes (None: no
    straggler)."""
    stragglers = [f for f in faults if isinstance(f, Straggler)]
    if not stragglers:
        return None

    def factor(rank: int, start: float) -> float:
        out = 1.0
        for f in stragglers:
            if rank in f.rank and in_window(f.window, start):  # type: ignore[operator]
                out *= f.slowdown
        return out

    return factor


def timed_crashes(faults: Sequence[Fault], ranks_per_node: int | None) -> list[tuple[float, int, str]]:
    """(time, rank, what killed it) of every crash at a time, a lost node's ranks included, in time order."""
    out = []
    for f in faults:
        if isinstance(f, Crash) and f.at is not None:
            out.append((f.at, f.rank, repr(f)))
        elif isinstance(f, NodeLoss):
            assert ranks_per_node is not None  # checked by check_world
            out += [(f.at, r, repr(f)) for r in range(f.node * ranks_per_node, (f.node + 1) * ranks_per_node)]
    return sorted(out)


def counted_crashes(faults: Sequence[Fault]) -> dict[int, tuple[int, str]]:
    """rank -> (k, the fault) for crashes at a rank's k-th collective (the earliest where a rank has several)."""
    out: dict[int, tuple[int, str]] = {}
    for f in faults:
        earliest = isinstance(f, Crash) and f.collective is not None
        if earliest and (f.rank not in out or f.collective < out[f.rank][0]):  # type: ignore[union-attr,operator]
            out[f.rank] = (f.collective, repr(f))  # type: ignore[union-attr]
    return out
