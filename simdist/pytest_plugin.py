"""simdist's pytest plugin: the ``simdist_explore`` fixture and marker, for explorations in a user's test suite.

::

    @pytest.mark.simdist_explore(runs=200, strategy="pct", depth=2)
    def test_step_in_every_order(simdist_explore):
        simdist_explore(step, cluster, check=lambda res: ...)

The fixture runs :func:`simdist.explore` with the marker's keywords (those of the call win) and fails the test
when a run fails, with the summary and, for each kind of failure, the first failing run shrunk to its fewest
decisions off the unperturbed order (:func:`simdist.shrink`; ``shrink=False`` leaves it as found) and its replay
token.
``--simdist-runs N`` and ``--simdist-seed S`` override every exploration's runs and seed (more runs in a nightly
job, another seed each day). Installed as the ``simdist`` plugin (``-p no:simdist`` turns it off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from simdist.explore.api import explore
from simdist.explore.exploration import Exploration
from simdist.explore.shrink import shrink_kinds
from simdist.explore.target import Target

#: the marker's name, and what it holds
MARKER = "simdist_explore"


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--simdist-runs`` and ``--simdist-seed``."""
    group = parser.getgroup("simdist", "simdist explorations")
    group.addoption(
        "--simdist-runs",
        type=int,
        default=None,
        metavar="N",
        help="run every simdist_explore exploration N times (overrides the marker's and the call's runs)",
    )
    group.addoption(
        "--simdist-seed",
        type=int,
        default=None,
        metavar="SEED",
        help="explore with this seed (overrides the marker's and the call's seed)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker."""
    config.addinivalue_line(
        "markers",
        f"{MARKER}(**keywords): simdist.explore keywords (runs, strategy, depth, seed, jitter, check, ...) for the "
        "simdist_explore fixture of this test",
    )


@pytest.fixture
def simdist_explore(request: pytest.FixtureRequest) -> Callable[..., Exploration]:
    """``simdist_explore(fn, cluster, **keywords)``: explore ``fn`` on ``cluster`` and fail the test, naming each
    failure's replay token, when a run fails; returns the :class:`simdist.Exploration` otherwise."""
    marker = request.node.get_closest_marker(MARKER)
    defaults = dict(marker.kwargs) if marker is not None else {}
    if marker is not None and marker.args:
        raise pytest.UsageError(
            f"@pytest.mark.{MARKER} takes keywords only (runs=..., strategy=...), got {marker.args}"
        )
    overrides = {
        key: value
        for key, value in (
            ("runs", request.config.getoption("--simdist-runs")),
            ("seed", request.config.getoption("--simdist-seed")),
        )
        if value is not None
    }

    def run(fn: Callable[..., Any], cluster: Any = None, **keywords: Any) -> Exploration:
        options = {**defaults, **keywords, **overrides}
        shrink = options.pop("shrink", True)
        ex = explore(fn, cluster, **options)
        if ex.failures:
            if shrink and not isinstance(fn, Target):  # a target reports no decisions to shrink
                shrink_kinds(ex, fn, cluster, check=options.get("check"))
            pytest.fail(failure_report(fn, ex), pytrace=False)
        return ex

    return run


def failure_report(fn: Callable[..., Any], ex: Exploration) -> str:
    """The message of a failed exploration: its summary, then each kind's first failure and its replay token."""
    name = getattr(fn, "__qualname__", repr(fn))
    lines = [f"simdist.explore({name}) found {len(ex.failures)} failing runs of {ex.runs}:", ex.summary(), ""]
    for kind, found in ex.by_kind().items():
        first = found[0]
        lines.append(f"first {kind}: {first}")
        if first.shrunk is not None:
            lines.append("  " + str(first.shrunk).replace("\n", "\n  "))
        replay = getattr(first.shrunk, "replay", None) or first.replay
        which = " (the shrunk run)" if replay is not first.replay else ""
        lines += [f"replay it{which} with simdist.replay({name}, cluster, token), token:", replay, ""]
    return "\n".join(lines)
