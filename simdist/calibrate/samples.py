"""Measured collective times, the input of a fit, and the checks that refuse input a fit cannot trust."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from simdist_base.errors import SimdistError

#: the collectives a fit prices (simdist's names); ``sendrecv`` is nccl-tests' ring of sends and receives
FITTED = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv")
#: fewest distinct sizes a fit needs: two unknowns (latency, bandwidth) and one size to check them against
MIN_SIZES = 3
#: a measured time may drop this much (relative) as the size grows before it counts as garbage: a loaded machine
#: delays single calls by several times (seen: 3.6x on a shared 2-core machine), a real call never gets 4x faster
MONOTONE_SLACK = 0.75


class CalibrationError(SimdistError, ValueError):
    """Measurements a cluster cannot be fitted from: unreadable, inconsistent or too sparse."""


@dataclass(frozen=True)
class Sample:
    """One measured call: ``collective`` on ``ranks`` ranks moving ``nbytes`` took ``seconds``."""

    collective: str
    #: the whole buffer, as simdist's closed forms count it (all-gather output, reduce-scatter input)
    nbytes: int
    ranks: int
    seconds: float
    #: where it came from (``file:line``), for error messages
    source: str = ""
    #: nodes the ranks were spread over (1 where the source does not say)
    nodes: int = 1


def check(samples: Sequence[Sample], what: str) -> list[Sample]:
    """``samples`` if a fit can use them; a CalibrationError saying what is wrong with ``what`` otherwise."""
    if not samples:
        raise CalibrationError(
            f"{what}: no measurements found; give nccl-tests output, a real timeline or --measure"
        )
    worlds = sorted({s.ranks for s in samples})
    if len(worlds) > 1:
        by = {w: next(s.source for s in samples if s.ranks == w) for w in worlds}
        raise CalibrationError(
            f"{what}: measurements of different world sizes ({', '.join(f'{w} ranks at {by[w]}' for w in worlds)}); "
            f"a cluster file has one world size: fit each world size on its own"
        )
    nodes = sorted({s.nodes for s in samples})
    if len(nodes) > 1:
        raise CalibrationError(
            f"{what}: measurements over {' and '.join(map(str, nodes))} nodes mixed; fit one node count at a time"
        )
    if worlds[0] < 2:
        raise CalibrationError(
            f"{what}: measurements of a world of {worlds[0]} rank ({samples[0].source}); a collective on one rank "
            f"moves nothing over a link: measure at least 2 ranks"
        )
    for s in samples:
        if not (math.isfinite(s.seconds) and s.seconds > 0):
            raise CalibrationError(
                f"{what}: {s.source}: time {s.seconds!r} s of {s.collective} is not a positive number"
            )
        if s.collective not in FITTED:
            raise CalibrationError(
                f"{what}: {s.source}: collective {s.collective!r} cannot be fitted; expected one of {', '.join(FITTED)}"
            )
    sizes = sorted({s.nbytes for s in samples if s.nbytes > 0})
    if len(sizes) < MIN_SIZES:
        raise CalibrationError(
            f"{what}: {len(sizes)} distinct non-zero size{'s' * (len(sizes) != 1)} "
            f"({', '.join(map(str, sizes)) or 'none'} bytes); a latency and a bandwidth need at least {MIN_SIZES}, "
            f"from small (latency-bound) to large (bandwidth-bound), e.g. nccl-tests -b 8 -e 64M -f 2"
        )
    if sizes[-1] < 64 * sizes[0]:
        raise CalibrationError(
            f"{what}: sizes span only {sizes[0]} to {sizes[-1]} bytes; latency and bandwidth cannot be told apart "
            f"unless the largest size is at least 64 times the smallest (e.g. 8 B to 64 MiB)"
        )
    _check_monotone(samples, what)
    return [s for s in samples if s.nbytes > 0]


def _check_monotone(samples: Sequence[Sample], what: str) -> None:
    """Refuse a collective whose time falls steeply as its size grows: not a measurement of that collective."""
    for coll in sorted({s.collective for s in samples}):
        rows = sorted((s for s in samples if s.collective == coll and s.nbytes > 0), key=lambda s: s.nbytes)
        slowest = rows[0]
        for s in rows[1:]:
            if s.seconds < slowest.seconds * (1 - MONOTONE_SLACK) and s.nbytes >= 2 * slowest.nbytes:
                raise CalibrationError(
                    f"{what}: {coll} takes {s.seconds * 1e6:.3g} us at {s.nbytes} bytes ({s.source}) but "
                    f"{slowest.seconds * 1e6:.3g} us at {slowest.nbytes} bytes ({slowest.source}): a larger call "
                    f"cannot be {slowest.seconds / s.seconds:.1f}x faster; the times are not of one collective "
                    f"(mixed runs? columns out of place?)"
                )
            if s.seconds > slowest.seconds:
                slowest = s
