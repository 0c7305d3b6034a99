"""The hostile-case table: programs, inputs and command lines a careless or hostile user tries.

Each :class:`Case` states the one outcome that is right for it: a clear error (a :class:`simdist.SimdistError`
subclass, or a documented CLI exit status, whose message names what was wrong and what was expected) or a
correct result (checked against an oracle: NumPy, the single-process computation, or what real gloo does).
A case that hangs is stopped by the simulator's watchdog or by pytest-timeout and fails.

The test modules beside this one (``test_hostile_*.py``) each define ``CASES`` and run them with
:func:`check`; ``tally.py`` counts them for the reliability figures in ``docs/reliability.md``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

import simdist


@dataclass(frozen=True)
class Case:
    """One hostile program or input and the outcome that is right for it."""

    #: short identifier (the pytest id)
    name: str
    #: what the hostile user does, in one line (shown in the docs)
    what: str
    #: runs the case; returns whatever ``check`` inspects (a run's result, a CLI's ``(status, output)``)
    run: Callable[[], Any]
    #: expected error type (a SimdistError subclass, or SystemExit for argparse usage errors) ...
    error: type[BaseException] | None = None
    #: ... and a regex its message must contain (the field, the rank, what was expected)
    match: str = ""
    #: for a correct result: asserts on ``run()``'s return value against an oracle
    check: Callable[[Any], None] | None = None
    #: slow cases are marked ``slow`` (still run in CI)
    slow: bool = False

    def __post_init__(self) -> None:
        if (self.error is None) == (self.check is None):
            raise ValueError(f"case {self.name!r}: give exactly one of error= and check=")

    @property
    def outcome(self) -> str:
        """``"clear error"`` or ``"correct result"``."""
        return "clear error" if self.error is not None else "correct result"


def params(cases: list[Case]) -> list[Any]:
    """``cases`` as pytest params: ids are the case names, slow cases carry the ``slow`` mark."""
    names = [c.name for c in cases]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate hostile case names: {dupes}")
    return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in cases]


def check(case: Case) -> None:
    """Run ``case`` and assert its outcome: the expected clear error, or a result its oracle accepts."""
    if case.error is not None:
        with pytest.raises(case.error) as info:
            case.run()
        err = info.value
        if not isinstance(err, SystemExit):
            assert isinstance(err, simdist.SimdistError), f"{type(err).__name__} is not a SimdistError: {err}"
        if case.match:
            assert re.search(case.match, str(err)), f"message does not match {case.match!r}:\n{err}"
    else:
        assert case.check is not None
        case.check(case.run())
