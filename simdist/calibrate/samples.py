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
#: a pair of sizes "falls" when the larger one's time is below the smaller one's by more than this (relative)
MONOTONE_SLACK = 0.5
#: the share of falling pairs beyond which the times are refused as not one collective's
MAX_FALLING = 0.1


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
    """Refuse a collective whose times fall as its sizes grow: not a measurement of that collective.

    A loaded machine delays single calls by several times, so one slow small size is noise; garbage (a time
    column read from the wrong place, two runs mixed) makes many pairs of sizes fall, or the largest size the
    fastest.
    """
    for coll in sorted({s.collective for s in samples}):
        line = sorted((s for s in samples if s.collective == coll and s.nbytes > 0), key=lambda s: s.nbytes)
        # a single call far slower than the sizes either side of it is a rank descheduled mid-call: not counted
        rows = [s for i, s in enumerate(line) if not _spike(line, i)]
        pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1 :] if b.nbytes >= 2 * a.nbytes]
        falling = [(a, b) for a, b in pairs if b.seconds < a.seconds * (1 - MONOTONE_SLACK)]
        if falling and (len(falling) > MAX_FALLING * len(pairs) or rows[-1].seconds < rows[0].seconds):
            a, b = max(falling, key=lambda ab: ab[0].seconds / ab[1].seconds)
            raise CalibrationError(
                f"{what}: {coll} takes {b.seconds * 1e6:.3g} us at {b.nbytes} bytes ({b.source}) but "
                f"{a.seconds * 1e6:.3g} us at {a.nbytes} bytes ({a.source}), and {len(falling)} of {len(pairs)} "
                f"pairs of sizes fall so: a larger call is not faster; the times are not of one collective "
                f"(mixed runs? columns out of place?)"
            )


def _spike(line: Sequence[Sample], i: int) -> bool:
    """Whether ``line[i]`` is over twice as slow as each of its neighbours in size."""
    neighbours = [line[j].seconds for j in (i - 1, i + 1) if 0 <= j < len(line)]
    return bool(neighbours) and all(line[i].seconds > 2 * t for t in neighbours)
