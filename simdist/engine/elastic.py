"""torchrun's restarts in a simulated job: ``--max-restarts`` and elastic ``--nnodes MIN:MAX``.

As torch.distributed.elastic's agent does, a failed worker group is stopped and started again, at most
``max_restarts`` times: every rank runs the program from its start in a new attempt, with
``TORCHELASTIC_RESTART_COUNT`` counting the attempts before it (the program resumes from its own checkpoint).
A lost node's agent is gone, so a new attempt runs on the surviving nodes, renumbered in order, when at least
``MIN`` of them remain; a crashed rank's node restarts it, so a crash alone keeps the world.

Faults are on the job's clock: attempt ``k`` starts at the time attempt ``k - 1`` failed (its first crash), each
fault's times are shifted by that start, a fault that has already happened (a crash, a link failure, a node
loss) does not happen again, and a lost node's ranks and links are gone from later attempts' world.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

from simdist.engine.runner import RunResult, run
from simdist.errors import RankCrashError, RunArgumentError, SimdistError, safe_str
from simdist.faults.plan import as_faults
from simdist.faults.specs import (
    Crash,
    Fault,
    FlappingLink,
    LinkDown,
    MessageDelay,
    NodeLoss,
    SlowLink,
    Straggler,
)
from simdist.network.cluster import Cluster


def node_bounds(nnodes: int | str | None, nodes: int) -> tuple[int, int]:
    """torchrun's ``--nnodes`` (``N`` or ``MIN:MAX``) as (MIN, MAX) for a cluster of ``nodes`` nodes."""
    if nnodes is None:
        return nodes, nodes
    text = str(nnodes)
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    if not match or isinstance(nnodes, bool):
        raise RunArgumentError(
            f"nnodes must be N or MIN:MAX (whole numbers, as torchrun's --nnodes), got {nnodes!r}"
        )
    low = int(match.group(1))
    high = int(match.group(2) or low)
    if not 1 <= low <= high:
        raise RunArgumentError(f"nnodes {text!r}: expected 1 <= MIN <= MAX")
    if not low <= nodes <= high:
        raise RunArgumentError(
            f"nnodes {text!r}: the cluster has {nodes} node(s); torchrun starts a job only with MIN..MAX nodes"
        )
    return low, high


def launch(
    fn: Callable[..., Any],
    cluster: Cluster,
    *,
    max_restarts: int = 0,
    nnodes: int | str | None = None,
    faults: Any = None,
    **options: Any,
) -> RunResult:
    """Run ``fn`` on ``cluster`` as torchrun does with ``--max-restarts`` and ``--nnodes``: the last attempt's
    result, with ``restarts`` and ``failures`` (each failed attempt's error text, in order)."""
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise RunArgumentError(f"max_restarts must be a whole number >= 0, got {max_restarts!r:.40}")
    per_node = cluster.ranks_per_node or cluster.world_size
    nodes = -(-cluster.world_size // per_node)
    low, _ = node_bounds(nnodes, nodes)
    # the faults still to happen, in the first attempt's numbering of ranks and nodes
    pending = list(as_faults(faults))
    failures: list[str] = []
    start = 0.0  # the job's time at which this attempt starts
    alive = list(range(nodes))  # the first attempt's numbers of the nodes still there
    world = cluster
    for attempt in range(max_restarts + 1):
        # each still pending fault as this attempt sees it (its world's numbering, its clock), by its index
        current = {
            i: g
            for i, f in enumerate(pending)
            if (r := _renamed(f, alive, per_node, len(alive) < nodes)) is not None
            and (g := _shift(r, start)) is not None
        }
        try:
            result = run(_attempt(fn, attempt, max_restarts), world, faults=list(current.values()), **options)
        except RankCrashError as e:
            failures.append(safe_str(e))
            crashed_at = min(e.crashed.values())
            fired = {i for i, f in current.items() if _fired(f, crashed_at, e.crashed)}
            lost = {alive[f.node] for i, f in current.items() if i in fired and isinstance(f, NodeLoss)}
            pending = [f for i, f in enumerate(pending) if i not in fired]
            start += crashed_at
            if attempt == max_restarts:
                raise
            if lost:
                alive = [k for k in alive if k not in lost]
                if len(alive) < low:
                    raise SimdistError(
                        f"{safe_str(e)}\nThe job cannot re-form: {len(alive)} node(s) survive and nnodes asks for at "
                        f"least {low}; torchrun's agents would wait for more nodes until the rendezvous times out"
                    ) from e
                world = _surviving(cluster, alive, per_node)
            continue
        except SimdistError as e:
            failures.append(safe_str(e))
            if attempt == max_restarts:
                raise
            continue
        return dataclasses.replace(result, restarts=attempt, failures=failures)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _attempt(fn: Callable[..., Any], attempt: int, max_restarts: int) -> Callable[..., Any]:
    """``fn`` with torchrun's restart variables set in each rank's environment."""

    def main(*args: Any, **kwargs: Any) -> Any:
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
        os.environ["TORCHELASTIC_MAX_RESTARTS"] = str(max_restarts)
        return fn(*args, **kwargs)

    main.__name__ = getattr(fn, "__name__", "main")
    main.__qualname__ = getattr(fn, "__qualname__", main.__name__)
    return main


def _shift(fault: Fault, start: float) -> Fault | None:
    """``fault`` on the clock of an attempt starting at job time ``start`` (None: it has no part in it)."""
    if start == 0.0:
        return fault
    if isinstance(fault, (LinkDown, NodeLoss)):
        return dataclasses.replace(fault, at=max(0.0, fault.at - start))
    if isinstance(fault, Crash):
        if fault.at is None:
            return fault
        return dataclasses.replace(fault, at=fault.at - start) if fault.at >= start else None
    if isinstance(fault, (Straggler, SlowLink, FlappingLink, MessageDelay)):
        if fault.window is None:
            return fault
        begin, end = fault.window
        if end <= start:
            return None
        return dataclasses.replace(fault, window=(max(0.0, begin - start), end - start))
    return fault


def _fired(fault: Fault, at: float, crashed: dict[int, float]) -> bool:
    """Whether one-shot ``fault`` (as its attempt saw it) happened by the attempt's failure at ``at``."""
    if isinstance(fault, Crash):
        return fault.rank in crashed if fault.at is None else fault.at <= at
    return isinstance(fault, NodeLoss) and fault.at <= at


def _renumbering(alive: list[int], per_node: int) -> dict[int, int]:
    """First-attempt rank -> rank in the world of the ``alive`` nodes (renumbered in order)."""
    return {
        node * per_node + local: new * per_node + local
        for new, node in enumerate(alive)
        for local in range(per_node)
    }


def _renamed(fault: Fault, alive: list[int], per_node: int, shrunk: bool) -> Fault | None:
    """``fault`` (first-attempt numbering) in the world of the ``alive`` nodes; None where it names only what is
    gone. Link faults end with the first world (their ids are its links')."""
    if not shrunk:
        return fault
    ranks = _renumbering(alive, per_node)
    if isinstance(fault, Crash):
        return dataclasses.replace(fault, rank=ranks[fault.rank]) if fault.rank in ranks else None
    if isinstance(fault, Straggler):
        kept = tuple(ranks[r] for r in fault.rank if r in ranks)  # type: ignore[union-attr]
        return dataclasses.replace(fault, rank=kept) if kept else None
    if isinstance(fault, MessageDelay):
        src = tuple(ranks[r] for r in fault.src if r in ranks)  # type: ignore[union-attr]
        dst = tuple(ranks[r] for r in fault.dst if r in ranks)  # type: ignore[union-attr]
        return dataclasses.replace(fault, src=src, dst=dst) if src and dst else None
    if isinstance(fault, NodeLoss):
        return dataclasses.replace(fault, node=alive.index(fault.node)) if fault.node in alive else None
    return None


def _surviving(cluster: Cluster, alive: list[int], per_node: int) -> Cluster:
    """The cluster of the ``alive`` nodes of ``cluster``: their ranks renumbered in order, their switches
    renamed ``node{k}.*`` after their new numbers, the links among them and the shared switches kept."""
    config = cluster.to_config()
    ranks = _renumbering(alive, per_node)
    switches = {f"node{node}.": f"node{new}." for new, node in enumerate(alive)}

    def vertex(v: Any) -> Any:
        if isinstance(v, int):
            return ranks.get(v)
        for old, new in switches.items():
            if v.startswith(old):
                return new + v[len(old) :]
        return None if re.match(r"node\d+\.", v) else v

    links = []
    for link in config["links"]:
        src, dst = vertex(link["src"]), vertex(link["dst"])
        if src is not None and dst is not None:
            links.append({**link, "src": src, "dst": dst})
    body = {**config["cluster"], "world_size": len(ranks), "name": f"{cluster.name}-{len(alive)}-nodes"}
    if "switches" in body:
        body["switches"] = [w for w in (vertex(s) for s in body["switches"]) if w is not None]
    return Cluster.from_config(
        {"cluster": body, "links": links}, source=f"{cluster.name} less its lost nodes"
    )
